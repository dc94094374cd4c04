"""Experiment 4's verdict: payments killed at `effect` and `claim` must leave
recon CLEAN; the split-transaction counter-example must show its drift
(inbox-first: lost effects, no double; effect-first: doubled effects, one
charge row per order). Reads chaos's summaries RES/<run>.json, writes
RES/summary.json, prints the table, the checks and the verdict line; exit 0 on
PASS.

Usage: python3 experiments/lib/exp4.py RES MODE MIN_KILLS (run.sh passes them;
run it alone to judge results again).
"""
import os
import sys

from common import (chaos_report, exit_code, load_json, print_checks, recon_word,
                    service_deaths, verdict, write_json)

# Each run's tag and the crash point payments dies at in it.
RUNS = [("payments-effect", "effect"), ("payments-claim", "claim"),
        ("split-inbox-first", "split"), ("split-effect-first", "split")]
FULL_RUNS = [("payments-effect-dynamic", "effect")]


def row(c, point):
    """One run's numbers from its chaos summary C (recon_exit is chaos's exit status)."""
    r = chaos_report(c)
    pay = c["services"]["payments"]
    return {
        "recon_exit": c["recon_exit"],
        "payments_kills": service_deaths(c, "payments", f"crash_point:{point}"),
        "recovery_ms": pay["recovery_ms"],
        "distinct_orders": r.get("distinct_orders"),
        "distinct_charges": r.get("distinct_charges"),
        "effects": r.get("charge_effects"),
        "lost_effects": r.get("orders_without_charge"),
        "double_charged_orders": r.get("double_charges"),
        "extra_effects": (r.get("charge_effects") or 0) - (r.get("distinct_charges") or 0),
        "extra_cents": (r.get("effect_amount_cents") or 0) - (r.get("order_amount_cents") or 0),
        "inbox_hits": pay["counters"].get("inbox_hits", 0),
    }


def judge(rows, mode, min_kills):
    """The summary from ROWS (tag -> row()): the safe runs clean, the unsafe
    ones drifting the way their order of transactions predicts."""
    checks = {}
    for tag in ("payments-effect", "payments-claim"):
        x = rows[tag]
        checks[f"{tag}: killed at least {min_kills} times"] = x["payments_kills"] >= min_kills
        checks[f"{tag}: recon CLEAN (zero lost, zero double)"] = (
            x["recon_exit"] == 0 and x["lost_effects"] == 0 and x["double_charged_orders"] == 0)
    x = rows["split-inbox-first"]
    checks["split inbox-first: killed between its transactions"] = x["payments_kills"] >= 1
    checks["split inbox-first: recon DRIFT with lost effects and no double"] = (
        x["recon_exit"] == 1 and (x["lost_effects"] or 0) > 0 and x["double_charged_orders"] == 0)
    x = rows["split-effect-first"]
    checks["split effect-first: killed between its transactions"] = x["payments_kills"] >= 1
    checks["split effect-first: recon DRIFT with doubled effects, still one charge row per order"] = (
        x["recon_exit"] == 1 and (x["double_charged_orders"] or 0) > 0 and x["lost_effects"] == 0
        and x["distinct_charges"] == x["distinct_orders"])
    if mode == "full":
        checks["payments-effect-dynamic (no static membership): recon CLEAN"] = (
            rows["payments-effect-dynamic"]["recon_exit"] == 0)
    return {"experiment": "exp-4-payments-kill", "mode": mode, "runs": rows, "checks": checks,
            "verdict": verdict(checks)}


def table(rows):
    """The printed table: one line per run."""
    lines = [f"\n{'run':<24} {'kills':>5} {'orders':>7} {'charged':>7} {'effects':>7} {'lost':>5} "
             f"{'doubled':>7} {'recon':>6} {'death→work p50/max ms':>22}"]
    for tag, x in rows.items():
        rec = x["recovery_ms"]["to_progress"]
        lines.append(f"{tag:<24} {x['payments_kills']:>5} {x['distinct_orders']!s:>7} {x['distinct_charges']!s:>7} "
                     f"{x['effects']!s:>7} {x['lost_effects']!s:>5} {x['double_charged_orders']!s:>7} "
                     f"{recon_word(x['recon_exit']):>6} {str(rec['p50']) + '/' + str(rec['max']):>22}")
    return "\n".join(lines)


def verdict_line(s, res):
    """The last line: the verdict and the numbers behind it."""
    rows = s["runs"]
    l, d = rows["split-inbox-first"], rows["split-effect-first"]
    return (f"exp-4: {s['verdict']} — safe: {rows['payments-effect']['payments_kills']} kills at effect, "
            f"{rows['payments-claim']['payments_kills']} at claim, 0 lost, 0 doubled; unsafe split: inbox-first "
            f"lost {l['lost_effects']} of {l['distinct_orders']}, effect-first doubled "
            f"{d['double_charged_orders']} of {d['distinct_orders']} ({s['mode']}; {res}/summary.json)")


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS); the exit status."""
    res, mode, min_kills = argv[0], argv[1], int(argv[2])
    rows = {}
    for tag, point in RUNS + (FULL_RUNS if mode == "full" else []):
        c = load_json(os.path.join(res, f"{tag}.json"))
        if c is None:
            print(f"exp-4: FAIL no chaos summary {res}/{tag}.json (see its logs/)")
            return 1
        rows[tag] = row(c, point)
    s = judge(rows, mode, min_kills)
    write_json(os.path.join(res, "summary.json"), s)
    print(table(rows))
    print_checks(s["checks"])
    print(verdict_line(s, res))
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
