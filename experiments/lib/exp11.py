"""Experiment 11's verdict from chaos's summaries in RES: the pipeline under
load through the PostgreSQL cluster's faults (a failover, one with the
standbys behind first, a switchover, the synchronous standby lost, the
primary's postmaster crashed in place), with synchronous replication; the
WAL relay through the switches; then the asynchronous counter-example (only
the lagged failover). A partition of the primary must promote another node
and never leave two primaries at once. The checks, a
digest with each fault's outage and recovery and what the asynchronous
failovers lost in RES/summary.json, one line per fault; exit 0 on PASS.

Usage: python3 experiments/lib/exp11.py RES MODE MIN_KILLS MIN_PER_FAULT
(run.sh passes them; run it alone to judge results again).
"""
import os
import re
import sys

from common import chaos_intents, chaos_report, exit_code, load_json, print_checks, verdict, write_json
from exp8 import digest, fault_checks, run_checks, run_line

FAULTS = ["pg-failover", "pg-lagged-failover", "pg-switchover", "pg-standby-loss", "pg-partition", "pg-crash"]
# Quick mode's synchronous run leaves the lagged failover out (run.sh says why).
QUICK_FAULTS = [f for f in FAULTS if f != "pg-lagged-failover"]
POINTS = ["commit", "publish", "claim", "effect"]
ASYNC_FAULTS = ["pg-lagged-failover"]
# The WAL relay's run: the switches that move the primary or restart it.
WAL_FAULTS = ["pg-failover", "pg-switchover", "pg-crash"]
# What an asynchronous failover breaks, as recon and the intents check name
# it: (where, its field, what it means).
LOSSES = [
    ("intents", "missing_in_db", "keys the client saw succeed whose key and order are gone"),
    ("intents", "wrong_order", "keys the client saw succeed that now name another order (its retry made a new one)"),
    ("report", "charges_without_order", "charges of orders that are gone (phantoms)"),
    ("report", "inbox_without_event", "inbox rows of events that are gone"),
    ("report", "orders_without_charge", "orders whose charge is gone (a lost effect)"),
    ("report", "events_not_consumed", "events no consumer will read again"),
    ("report", "double_charges", "orders charged twice"),
    ("committed", "lost_effects", "messages the consumer group committed past that left no trace (lost effects)"),
    ("committed", "events_without_outbox_row", "events in Kafka whose outbox row is gone"),
]


def fault_rows(c):
    """Each injected fault: its kind, what it did (which node was lost and
    which took over), its outage (the injection to the cluster writable
    again), its recovery (to every service moving again) and when the
    cluster was whole again (every replica streaming: whole_ms), in ms."""
    return [{"fault": f["fault"], "note": f.get("note"), "outage_ms": f.get("outage_ms"),
             "recovery_ms": f.get("recovery_ms"), "whole_ms": f.get("whole_ms"),
             "error": f.get("error")}
            for f in c.get("fault_log") or []]


PARTITION = re.compile(r"pg(?P<old>\d+) -> pg\d+, cut off [\d.]+ s: "
                       r"pg\d+ (?:no longer a primary after (?P<fenced_s>[\d.]+) s|a primary throughout), "
                       r"(?:pg(?P<new>\d+) the primary after (?P<promoted_s>[\d.]+) s|no other node promoted), "
                       r"two primaries in (?P<both>\d+) of (?P<looks>\d+) looks")


def partitions(c):
    """Each pg-partition of run C as its note tells it: the primary cut off,
    when it stopped being a primary and when another became one (seconds
    into the cut; None if never), and in how many of the looks at every node
    two were primaries at once. A note that does not parse is None."""
    out = []
    for f in c.get("fault_log") or []:
        if f["fault"] != "pg-partition" or f.get("error"):
            continue
        m = PARTITION.search(f.get("note") or "")
        out.append(None if m is None else {
            "cut_off": int(m["old"]), "promoted": int(m["new"]) if m["new"] else None,
            "fenced_s": float(m["fenced_s"]) if m["fenced_s"] else None,
            "promoted_s": float(m["promoted_s"]) if m["promoted_s"] else None,
            "two_primaries": int(m["both"]), "looks": int(m["looks"])})
    return out


def split_brain_checks(c, tag):
    """Every partition of the primary in run C: its note read, the cut-off
    primary stopped being one and another node was promoted, and never two
    primaries at once."""
    got = partitions(c)
    ok = bool(got) and all(p is not None and p["fenced_s"] is not None and p["promoted"] is not None
                           and p["looks"] > 0 and p["two_primaries"] == 0 for p in got)
    return {f"{tag}: each pg-partition fenced the cut-off primary and promoted another, never two primaries at once":
            ok}


def lost_wal(c):
    """The bytes of WAL each lagged failover's new primary never had, as its
    note says ("... N bytes of pgX's WAL not on pgY"), summed; None if no
    note says."""
    got = [int(m.group(1)) for f in c.get("fault_log") or []
           if (m := re.search(r"(\d+) bytes of pg\d+'s WAL not on", f.get("note") or ""))]
    return sum(got) if got else None


def losses(c):
    """What the failovers of run C broke, by recon's and the intents check's
    names; and the WAL the new primaries lacked."""
    where = {"intents": chaos_intents(c), "report": chaos_report(c),
             "committed": (c.get("recon") or {}).get("committed") or {}}
    out = {field: where[part].get(field) for part, field, _ in LOSSES}
    out["lost_wal_bytes"] = lost_wal(c)
    return out


def async_checks(c, min_per_fault):
    """The counter-example must show what it exists to show: the promoted
    standby lacked WAL the old primary had, acknowledged orders are gone, and
    recon and the intents check say so (DRIFT) by name."""
    checks = fault_checks(c, "async", min_per_fault, ASYNC_FAULTS)
    lost = losses(c)
    intents = chaos_intents(c)
    checks.update({
        "async: the promoted standbys lacked WAL the old primary had": (lost["lost_wal_bytes"] or 0) > 0,
        "async: acknowledged orders lost (keys the client saw succeed, gone or remade)": (
            (lost["missing_in_db"] or 0) + (lost["wrong_order"] or 0) > 0),
        "async: recon and the intents check report DRIFT": (
            c["recon_exit"] == 1 and intents.get("matched") != intents.get("client_succeeded")),
    })
    return checks


def wal_checks(c, min_per_fault):
    """The WAL relay through the switches: recon CLEAN (the committed
    offsets' check included), every succeeded key matched, each switch
    recovered (the relay streaming again, from a new slot on the new
    primary)."""
    checks = run_checks(c, "wal", min_per_fault, None, WAL_FAULTS)
    committed = (c.get("recon") or {}).get("committed") or {}
    checks["wal: every message the consumer group committed past left its trace (recon --committed-past)"] = (
        committed.get("messages", 0) > 0 and committed.get("lost_effects") == 0
        and committed.get("events_without_outbox_row") == 0)
    # A switch is the relay's to ride out: it dies only at its crash point.
    relay = ((c.get("services") or {}).get("relay") or {}).get("deaths") or {}
    checks["wal: the relay died only at its crash point (never exited through a switch)"] = all(
        cause.startswith("crash_point:") for cause, n in relay.items() if n)
    return checks


def judge(sync, mode, min_kills, min_per_fault, unsync=None, wal=None):
    """The summary of the synchronous run, the WAL relay's (WAL) and the
    asynchronous one (UNSYNC); a missing run fails its check."""
    sync_faults = QUICK_FAULTS if mode == "quick" else FAULTS
    checks = run_checks(sync, "sync", min_per_fault, min_kills, sync_faults, POINTS)
    committed = (sync.get("recon") or {}).get("committed") or {}
    checks["sync: every message the consumer group committed past left its trace (recon --committed-past)"] = (
        committed.get("messages", 0) > 0 and committed.get("lost_effects") == 0
        and committed.get("events_without_outbox_row") == 0)
    checks.update(split_brain_checks(sync, "sync"))
    run = digest(sync)
    run["partitions"] = partitions(sync)
    run["committed"] = committed or None
    run["fault_log"] = fault_rows(sync)
    runs = {"sync": run}
    if wal is None:
        checks["wal: the WAL relay's run's summary is there"] = False
    else:
        checks.update(wal_checks(wal, 1 if mode == "quick" else 3))
        w = digest(wal)
        w["fault_log"] = fault_rows(wal)
        runs["wal"] = w
    if unsync is None:
        checks["async: the asynchronous run's summary is there"] = False
    else:
        checks.update(async_checks(unsync, 1 if mode == "quick" else min_per_fault))
        a = digest(unsync)
        a["fault_log"] = fault_rows(unsync)
        a["losses"] = losses(unsync)
        runs["async"] = a
    return {"experiment": "exp-11-failover", "mode": mode, "runs": runs, "checks": checks,
            "verdict": verdict(checks)}


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS MIN_PER_FAULT); the exit status."""
    res, mode, min_kills, min_per_fault = argv[0], argv[1], int(argv[2]), int(argv[3])
    sync = load_json(os.path.join(res, "sync.json"))
    if sync is None:
        print(f"exp-11: FAIL the chaos summary is missing in {res} (see its logs/)")
        return 1
    s = judge(sync, mode, min_kills, min_per_fault, load_json(os.path.join(res, "async.json")),
              load_json(os.path.join(res, "wal.json")))
    write_json(os.path.join(res, "summary.json"), s)
    print_checks(s["checks"])
    for tag, run in s["runs"].items():
        for f in run["fault_log"]:
            print(f"exp-11 {tag}: {f['fault']:<18} {f['note'] or f['error'] or '-'}: outage {f['outage_ms']} ms, "
                  f"every service moving again after {f['recovery_ms']} ms, the cluster whole after {f.get('whole_ms')} ms")
        print(run_line(tag, run, {"sync": FAULTS, "wal": WAL_FAULTS}.get(tag, ASYNC_FAULTS), "exp-11"))
    if "async" in s["runs"]:
        lost = s["runs"]["async"]["losses"]
        print(f"exp-11 async: {lost['lost_wal_bytes']} bytes of acknowledged WAL never reached the promoted standbys")
        for _, field, meaning in LOSSES:
            print(f"exp-11 async: {lost[field]!s:>6} {field}: {meaning}")
    print(f"exp-11: {s['verdict']} ({mode}; {res}/summary.json)")
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
