"""Experiment 3's verdict: the relay killed at crash point `publish` (or, with
RELAY_MODE=debezium, Debezium's Kafka Connect worker killed -9 from outside)
and orders killed at `commit`, judged from chaos's summaries
RES/relay-publish.json (RES/relay-kill.json) and RES/orders-commit.json. Writes RES/summary.json, prints the checks and the
verdict line; exit 0 on PASS.

Usage: python3 experiments/lib/exp3.py RES MODE MIN_KILLS (run.sh passes them;
run it alone to judge results again).
"""
import os
import sys

from common import (chaos_intents, chaos_report, exit_code, load_json, print_checks,
                    service_deaths, verdict, write_json)


def judge(c, o, mode, min_kills):
    """The summary of one experiment-3 run: C is the relay-publish chaos
    summary, O the orders-commit one."""
    relay, pay = c["services"]["relay"], c["services"]["payments"]
    r = chaos_report(c)
    debezium = c["params"].get("relay_kind") == "debezium"
    if debezium:
        kills = service_deaths(c, "relay", "random_kill")
        killed = f"Debezium's Connect worker killed -9 at least {min_kills} times"
    else:
        kills = service_deaths(c, "relay", "crash_point:publish")
        killed = f"relay killed at crash point publish at least {min_kills} times"
    hits = pay["counters"].get("inbox_hits", 0)
    orders = r.get("distinct_orders", 0)
    checks = {
        "recon CLEAN (every committed order published and charged once; client intents match)": c["recon_exit"] == 0,
        killed: kills >= min_kills,
        "re-published events reached payments and were absorbed (inbox hits > 0)": hits > 0,
        "no double effect": r.get("double_charges", -1) == 0,
        "no lost effect": r.get("orders_without_charge", -1) == 0,
    }
    orr, oi = chaos_report(o), chaos_intents(o)
    orders_kills = service_deaths(o, "orders", "crash_point:commit")
    oload = o.get("load") or {}
    error_retries = (oload.get("sends") or {}).get("error_retries_sent", 0)
    checks.update({
        "orders-commit: recon CLEAN": o["recon_exit"] == 0,
        f"orders-commit: orders killed after commit at least {min_kills} times": orders_kills >= min_kills,
        "orders-commit: the client retried errors, and every key ended with exactly one order (0 ambiguous)": (
            error_retries > 0 and oi.get("client_ambiguous", -1) == 0
            and oi.get("matched") == oi.get("client_succeeded") == orr.get("distinct_orders")),
    })
    return {
        "experiment": "exp-3-relay-kill",
        "mode": mode,
        "relay_kind": "debezium" if debezium else "relay",
        "params": c["params"],
        "load": {k: c["load"].get(k) for k in ("rates", "outcomes", "replay")} if c.get("load") else None,
        "relay_kills": kills,
        "relay_lives": relay["lives"],
        "recovery_ms": relay["recovery_ms"],
        "distinct_orders": orders,
        # Deliveries beyond one per event: the re-publishes that reached payments
        # (payments is never killed here, so its counters are exact).
        "duplicate_deliveries": pay["counters"].get("consumed", 0) - orders,
        "inbox_hits": hits,
        "inbox_misses": pay["counters"].get("inbox_misses", 0),
        "recon": r,
        "orders_commit": {
            "orders_kills": orders_kills,
            "recovery_ms": o["services"]["orders"]["recovery_ms"],
            "load": {k: oload.get(k) for k in ("rates", "sends", "outcomes", "replay")},
            "client_intents": oi,
            "distinct_orders": orr.get("distinct_orders"),
            "double_charges": orr.get("double_charges"),
            "recon_exit": o["recon_exit"],
        },
        "checks": checks,
        "verdict": verdict(checks),
    }


def verdict_line(s, res):
    """The last line: the verdict and the numbers behind it."""
    oc = s["orders_commit"]
    error_retries = (oc["load"].get("sends") or {}).get("error_retries_sent", 0)
    if s.get("relay_kind") == "debezium":
        # The worker serves no metrics: its recovery is death -> connector running.
        rr = s["recovery_ms"]["to_ready"]
        killed, back = "Debezium worker kills (-9)", "worker death→connector running again"
    else:
        rr = s["recovery_ms"]["to_progress"]
        killed, back = "relay kills at publish", "relay death→working again"
    return (f"exp-3: {s['verdict']} — {s['relay_kills']} {killed}, {s['distinct_orders']} orders, "
            f"each charged once; inbox hits {s['inbox_hits']:.0f} (re-published duplicates absorbed); "
            f"{back} p50 {rr['p50']} ms, max {rr['max']} ms; {oc['orders_kills']} orders kills at "
            f"commit, {error_retries} errors retried, {oc['distinct_orders']} orders = keys, 0 ambiguous "
            f"({s['mode']}; {res}/summary.json)")


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS); the exit status."""
    res, mode, min_kills = argv[0], argv[1], int(argv[2])
    relay_run = "relay-kill" if os.path.exists(os.path.join(res, "relay-kill.json")) else "relay-publish"
    c = load_json(os.path.join(res, f"{relay_run}.json"))
    o = load_json(os.path.join(res, "orders-commit.json"))
    if c is None or o is None:
        print(f"exp-3: FAIL a chaos summary is missing in {res} (see its logs/)")
        return 1
    s = judge(c, o, mode, min_kills)
    write_json(os.path.join(res, "summary.json"), s)
    print_checks(s["checks"])
    print(verdict_line(s, res))
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
