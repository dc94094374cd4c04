"""Experiment 7's verdict: idempotency-key contention on hot keys. Reads
chaos's summaries RES/<config>.json (loadgen's report with its per-key-class
results inside) and RES/<config>.pg.json (pg_stat_database of the run's
database), writes RES/summary.json and RES/classes.csv, prints the table, the
checks and the verdict line; exit 0 on PASS.

Usage: python3 experiments/lib/exp7.py RES MODE HOT_KEYS (run.sh passes them;
run it alone to judge results again).
"""
import os
import sys

from common import (chaos_intents, chaos_report, exit_code, load_json, print_checks, recon_word,
                    verdict, write_csv, write_json)

# Each configuration: (claim strategy, coalescing).
CONFIGS = [("on-conflict", "coalesced"), ("on-conflict", "single"),
           ("advisory-lock", "coalesced"), ("advisory-lock", "single")]


def tag(strategy, coalescing):
    return f"{strategy}-{coalescing}"


def row(strategy, coalescing, c, pg):
    """One configuration's numbers from its chaos summary C and its
    pg_stat_database row PG (None when missing)."""
    load = c.get("load") or {}
    classes = load.get("key_classes") or {}
    orders = ((c.get("services") or {}).get("orders") or {}).get("counters") or {}
    r, intents = chaos_report(c), chaos_intents(c)
    out = {"config": tag(strategy, coalescing), "strategy": strategy, "coalescing": coalescing,
           "recon": recon_word(c.get("recon_exit")), "recon_exit": c.get("recon_exit")}
    for name in ("hot", "cold"):
        k = classes.get(name) or {}
        lat = k.get("latency_ms") or {}
        out.update({
            f"{name}_sends": k.get("sends", 0),
            f"{name}_ok": k.get("ok", 0),
            f"{name}_errors": k.get("errors", 0),
            f"{name}_keys": k.get("keys_succeeded", 0),
            f"{name}_p50_ms": lat.get("p50_ms"),
            f"{name}_p99_ms": lat.get("p99_ms"),
            f"{name}_p999_ms": lat.get("p999_ms"),
            f"{name}_retries_per_success": k.get("retries_per_success", 0),
        })
    out.update({
        "deadlocks": (pg or {}).get("deadlocks"),
        "rollbacks": (pg or {}).get("xact_rollback"),
        "write_deadlocks": orders.get("write_deadlocks", 0),
        "write_serialization_failures": orders.get("write_serialization_failures", 0),
        "write_lock_timeouts": orders.get("write_lock_timeouts", 0),
        "replay_mismatches": (load.get("replay") or {}).get("mismatches"),
        "replays_compared": (load.get("replay") or {}).get("compared"),
        "orders": r.get("distinct_orders"),
        "keys": r.get("intents"),
        "keys_missing_in_db": intents.get("missing_in_db"),
        "keys_wrong_order": intents.get("wrong_order"),
    })
    return out


def judge(rows, mode, hot_keys):
    """The summary from ROWS (config -> row()): every configuration clean,
    the hot class really hot."""
    checks = {}
    for strategy, coalescing in CONFIGS:
        t = tag(strategy, coalescing)
        x = rows.get(t)
        if x is None:
            checks[f"{t}: ran (a chaos summary)"] = False
            continue
        checks[f"{t}: recon CLEAN"] = x["recon_exit"] == 0
        checks[f"{t}: zero replay mismatches, every key the client saw succeed has its order"] = (
            x["replay_mismatches"] == 0 and x["keys_missing_in_db"] == 0 and x["keys_wrong_order"] == 0)
        checks[f"{t}: the hot class took sends on at most {hot_keys} keys"] = (
            x["hot_sends"] > 0 and 0 < x["hot_keys"] <= hot_keys and x["cold_sends"] > 0)
        checks[f"{t}: no deadlock"] = x["deadlocks"] == 0 and x["write_deadlocks"] == 0
    return {"experiment": "exp-7-hot-keys", "mode": mode, "hot_keys": hot_keys,
            "runs": [rows[tag(*c)] for c in CONFIGS if tag(*c) in rows], "checks": checks,
            "verdict": verdict(checks)}


def table(runs):
    """The printed table: one line per configuration."""
    cols = [("config", 24), ("hot_sends", 9), ("hot_p50_ms", 10), ("hot_p99_ms", 10), ("hot_p999_ms", 11),
            ("cold_p50_ms", 11), ("cold_p99_ms", 11), ("cold_p999_ms", 12), ("hot_retries_per_success", 9),
            ("deadlocks", 9), ("write_serialization_failures", 6), ("replay_mismatches", 10), ("recon", 6)]
    heads = {"hot_retries_per_success": "hot r/ok", "write_serialization_failures": "serial",
             "replay_mismatches": "mismatch"}
    lines = ["  ".join(f"{heads.get(c, c):>{w}}" for c, w in cols)]
    for x in runs:
        lines.append("  ".join(f"{str(x.get(c)):>{w}}" for c, w in cols))
    return "\n".join(lines)


def verdict_line(s, res):
    """The last line: the verdict and the p99s behind it."""
    parts = [f"exp-7: {s['verdict']} — p99 hot/cold"]
    for x in s["runs"]:
        parts.append(f"{x['config']} {x['hot_p99_ms']}/{x['cold_p99_ms']} ms")
    return parts[0] + " " + "; ".join(parts[1:]) + f" ({s['mode']}; {res}/summary.json)"


def main(argv):
    """Judge RES (argv: RES MODE HOT_KEYS); the exit status."""
    res, mode, hot_keys = argv[0], argv[1], int(argv[2])
    rows = {}
    for strategy, coalescing in CONFIGS:
        t = tag(strategy, coalescing)
        c = load_json(os.path.join(res, f"{t}.json"))
        if c is None:
            print(f"exp-7: no chaos summary {res}/{t}.json (see {res}/logs/{t}/)")
            continue
        rows[t] = row(strategy, coalescing, c, load_json(os.path.join(res, f"{t}.pg.json")))
    s = judge(rows, mode, hot_keys)
    write_json(os.path.join(res, "summary.json"), s)
    write_csv(os.path.join(res, "classes.csv"), s["runs"])
    print(table(s["runs"]))
    print_checks(s["checks"])
    print(verdict_line(s, res))
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
