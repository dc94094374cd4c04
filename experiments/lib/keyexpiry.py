"""The key-expiry run's verdict: the pipeline under load while idempotency
keys expire (a short key retention), judged from chaos's summary
RES/key-expiry.json and recon's snapshots RES/snapshots.jsonl (one
`recon --json` taken every few seconds during the run, with the count of
keys still below the key floor). Writes RES/summary.json and
RES/snapshots.csv, prints the checks and the verdict line; exit 0 on PASS.

Usage: python3 experiments/lib/keyexpiry.py RES MODE RETENTION_S EXPIRE_EVERY_S
(run.sh passes them; run it alone to judge results again).
"""
import json
import os
import sys

from common import (chaos_report, exit_code, load_json, print_checks, verdict, write_csv,
                    write_json)

# The counts about keys recon takes in every snapshot, mid-run included: a
# key and its order commit in one transaction, so these hold at any moment.
KEY_DELTAS = ("distinct_orders - intents", "intents_without_order", "orders_without_key",
              "orders_with_many_keys")
NIL = "00000000-0000-0000-0000-000000000000"


def read_snapshots(path):
    """The snapshots in PATH (JSON lines), in order; a line that is not
    JSON (a run cut off mid-write) is left out."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def row(s, t0):
    """One snapshot as a CSV row: its time in the run, the key counts, the
    floor, and what recon before the fix would have called the first delta
    (it counted every key as an intent, those below the floor included)."""
    deltas = {d["name"]: d["value"] for d in s.get("deltas") or []}
    r = s.get("report") or {}
    below = s.get("keys_below_floor")
    first = deltas.get(KEY_DELTAS[0])
    return {
        "t_s": round(s["at"] - t0, 1),
        "distinct_orders": r.get("distinct_orders"),
        "orders_since_key_floor": r.get("orders_since_key_floor"),
        "intents": r.get("intents"),
        "keys_below_floor": below,
        "key_floor": (r.get("floors") or {}).get("keys"),
        **{k: deltas.get(k) for k in KEY_DELTAS},
        "before_the_fix": None if first is None or below is None else first - below,
    }


def judge(c, snapshots, mode, retention_s, expire_every_s):
    """The summary of a key-expiry run: C is chaos's summary, SNAPSHOTS
    recon's snapshots taken during it."""
    rows = [row(s, snapshots[0]["at"]) for s in snapshots] if snapshots else []
    r = chaos_report(c or {})
    floors = {x["key_floor"] for x in rows if x["key_floor"] not in (None, NIL)}
    elapsed = (c or {}).get("elapsed_s") or 0
    # Expiry passes run once a minute, the first at orders' start (it moves
    # the floor before any key exists); a second move means keys expired.
    moves = 2
    checks = {
        "recon CLEAN after the run (every intent one order, one event, one charge)": (c or {}).get("recon_exit") == 0,
        f"at least {max(3, int(elapsed // 30))} snapshots during the run": len(rows) >= max(3, int(elapsed // 30)),
        "every snapshot: the key counts are 0 (" + ", ".join(KEY_DELTAS) + ")": bool(rows) and all(
            all(x[k] == 0 for k in KEY_DELTAS) for x in rows),
        f"keys expired during the run (the key floor moved at least {moves} times)": len(floors) >= moves,
        "keys expired: the orders outnumber the intents at the end": bool(rows) and (
            rows[-1]["distinct_orders"] or 0) > (rows[-1]["intents"] or 0),
    }
    return {
        "experiment": "key-expiry",
        "mode": mode,
        "params": {"retention_s": retention_s, "expire_every_s": expire_every_s, **((c or {}).get("params") or {})},
        "snapshots": len(rows),
        "key_floor_moves": len(floors),
        "max_keys_below_floor": max((x["keys_below_floor"] or 0 for x in rows), default=0),
        "worst_before_the_fix": min((x["before_the_fix"] for x in rows if x["before_the_fix"] is not None),
                                    default=None),
        "distinct_orders": r.get("distinct_orders"),
        "intents_at_end": r.get("intents"),
        "recon_exit": (c or {}).get("recon_exit"),
        "rows": rows,
        "checks": checks,
        "verdict": verdict(checks),
    }


def verdict_line(s, res):
    """The last line: the verdict and the numbers behind it."""
    return (f"key-expiry: {s['verdict']} — {s['snapshots']} snapshots, key counts 0 in each; the key floor "
            f"moved {s['key_floor_moves']} times; up to {s['max_keys_below_floor']} keys outlived a floor's "
            f"move (recon before the fix: distinct_orders - intents down to {s['worst_before_the_fix']}); "
            f"{s['distinct_orders']} orders, recon exit {s['recon_exit']} ({s['mode']}; {res}/summary.json)")


def main(argv):
    res, mode, retention_s, expire_every_s = argv[1], argv[2], int(argv[3]), int(argv[4])
    c = load_json(os.path.join(res, "key-expiry.json"), {})
    s = judge(c, read_snapshots(os.path.join(res, "snapshots.jsonl")), mode, retention_s, expire_every_s)
    write_json(os.path.join(res, "summary.json"), {k: v for k, v in s.items() if k != "rows"})
    write_csv(os.path.join(res, "snapshots.csv"), s["rows"])
    print_checks(s["checks"])
    print(verdict_line(s, res))
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
