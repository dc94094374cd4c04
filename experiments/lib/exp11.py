"""Experiment 11's verdict from chaos's summaries in RES: the pipeline under
load through the PostgreSQL cluster's faults (a failover, a switchover, the
synchronous standby lost, the primary's postmaster crashed in place), with
synchronous replication: the checks, a digest with each fault's outage and
recovery in RES/summary.json, one line per fault; exit 0 on PASS.

Usage: python3 experiments/lib/exp11.py RES MODE MIN_KILLS MIN_PER_FAULT
(run.sh passes them; run it alone to judge results again).
"""
import os
import sys

from common import exit_code, load_json, print_checks, verdict, write_json
from exp8 import client_view, digest, run_checks, run_line

FAULTS = ["pg-failover", "pg-switchover", "pg-standby-loss", "pg-crash"]
POINTS = ["commit", "publish", "claim", "effect"]


def fault_rows(c):
    """Each injected fault: its kind, what it did (which node was lost and
    which took over), its outage (the injection to the cluster writable
    again) and its recovery (to every service moving again), in ms."""
    return [{"fault": f["fault"], "note": f.get("note"), "outage_ms": f.get("outage_ms"),
             "recovery_ms": f.get("recovery_ms"), "error": f.get("error")}
            for f in c.get("fault_log") or []]


def judge(sync, mode, min_kills, min_per_fault):
    """The summary of the synchronous run."""
    checks = run_checks(sync, "sync", min_per_fault, min_kills, FAULTS, POINTS)
    run = digest(sync)
    run["fault_log"] = fault_rows(sync)
    return {"experiment": "exp-11-failover", "mode": mode, "runs": {"sync": run}, "checks": checks,
            "verdict": verdict(checks)}


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS MIN_PER_FAULT); the exit status."""
    res, mode, min_kills, min_per_fault = argv[0], argv[1], int(argv[2]), int(argv[3])
    sync = load_json(os.path.join(res, "sync.json"))
    if sync is None:
        print(f"exp-11: FAIL the chaos summary is missing in {res} (see its logs/)")
        return 1
    s = judge(sync, mode, min_kills, min_per_fault)
    write_json(os.path.join(res, "summary.json"), s)
    print_checks(s["checks"])
    for tag, run in s["runs"].items():
        for f in run["fault_log"]:
            print(f"exp-11 {tag}: {f['fault']:<16} {f['note'] or f['error'] or '-'}: outage {f['outage_ms']} ms, "
                  f"every service moving again after {f['recovery_ms']} ms")
        print(run_line(tag, run, FAULTS, "exp-11"))
    print(f"exp-11: {s['verdict']} ({mode}; {res}/summary.json)")
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
