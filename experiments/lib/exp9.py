"""Experiment 9's verdict: the pipeline over webhooks against a failing
receiver (chaos's `faults` run), the retry schedule as observed (RES/
attempts.csv -> RES/schedule.csv), and failed deliveries replayed to
delivered (chaos's `replay` run, then `relay webhooks replay --failed` and
recon). Writes RES/summary.json; exit 0 on PASS.

Usage: python3 experiments/lib/exp9.py RES MODE MIN_KILLS SCALE
(run.sh passes them; run it alone to judge results again).
"""
import os
import re
import statistics
import sys

from common import (chaos_intents, chaos_report, deaths, exit_code, load_json, number,
                    print_checks, read_csv, read_text, verdict, write_csv, write_json)

FAULTS = ["receiver-down", "receiver-errors", "receiver-slow"]
# The crash points of the HTTP hop, armed in every run; `effect` (payments'
# inbox processor) is armed in full mode, and each armed point must fire.
POINTS = ["respond", "deliver"]
# The sender's schedule (effectively::webhook::RETRY_SCHEDULE), in seconds:
# the wait after the 1st failed attempt, the 2nd, ...; the last repeats.
SCHEDULE_S = [5, 30, 300, 1800, 4 * 3600]
JITTER_MIN, JITTER_MAX = 0.8, 1.2
# An attempt's start is stamped after its claim: a wait can read a few
# milliseconds short of its due time (clock reads, the claim's round trip).
EARLY_SLACK_S = 0.005


def scheduled_s(failed):
    """The scheduled wait after FAILED attempts, before jitter and scale."""
    return SCHEDULE_S[min(max(failed, 1), len(SCHEDULE_S)) - 1]


def waits(rows):
    """Per delivery, the wait before each retry: (attempt that failed,
    seconds from its end to the next attempt's start)."""
    by_row = {}
    for r in rows:
        by_row.setdefault(r["outbox_id"], []).append(r)
    out = []
    for attempts in by_row.values():
        attempts.sort(key=lambda r: int(r["attempt"]))
        for a, b in zip(attempts, attempts[1:]):
            if a["outcome"] != "retry":
                continue
            ended = number(a["started_s"]) + number(a["duration_ms"]) / 1000.0
            out.append((int(a["attempt"]), number(b["started_s"]) - ended))
    return out


def schedule_table(rows, scale):
    """One row per failed-attempt number: the scheduled wait (scaled), its
    jitter bounds, and the waits observed (count, min, p50, max), in ms."""
    by_n = {}
    for n, w in waits(rows):
        by_n.setdefault(n, []).append(w)
    table = []
    for n in sorted(by_n):
        ws = by_n[n]
        s = scheduled_s(n) * scale
        table.append({
            "failed_attempts": n,
            "scheduled_ms": round(s * 1000, 3),
            "earliest_ms": round(s * JITTER_MIN * 1000, 3),
            "latest_ms": round(s * JITTER_MAX * 1000, 3),
            "count": len(ws),
            "observed_min_ms": round(min(ws) * 1000, 3),
            "observed_p50_ms": round(statistics.median(ws) * 1000, 3),
            "observed_max_ms": round(max(ws) * 1000, 3),
            "early": sum(1 for w in ws if w < s * JITTER_MIN - EARLY_SLACK_S),
        })
    return table


def faults_checks(c, table, min_kills, min_failed=4):
    """The checks of the faults run C and its observed schedule TABLE: a wait observed after at
    least MIN_FAILED failed attempts (quick mode asks 3: its three 5 s outages under a backlog of
    retries seldom fail one delivery four times; a CI run saw 1 to 3 only)."""
    r = chaos_report(c)
    intents = chaos_intents(c)
    t = c.get("totals") or {}
    f = c.get("faults") or {}
    d = deaths(c)
    log = c.get("fault_log") or []
    last = log[-1] if log else None
    checks = {
        "faults: recon CLEAN (0 lost, 0 doubled, every check)": c["recon_exit"] == 0,
        "faults: no double charge": r.get("double_charges", -1) == 0,
        "faults: no order without its charge": r.get("orders_without_charge", -1) == 0,
        "faults: no delivery given up": r.get("failed_deliveries", -1) == 0,
        "faults: every key the client saw succeed has exactly its order": (
            intents.get("matched") == intents.get("client_succeeded")),
        f"faults: at least {min_kills} kill -9 at the crash points": c["kills_total"] >= min_kills,
        "faults: the sender retried (attempts answered 500, timed out or refused)": t.get("webhook_retries", 0) > 0,
        "faults: the proxy answered 500s and held requests past the timeout": (
            t.get("proxy_errored", 0) > 0 and t.get("proxy_held", 0) > 0),
        "faults: retries of applied webhooks answered as duplicates": t.get("webhook_duplicates", 0) > 0,
        f"faults: the retry schedule observed (a wait after at least {min_failed} failed attempts)": (
            any(row["failed_attempts"] >= min_failed for row in table)),
        "faults: no retry earlier than its scheduled wait x0.8": all(row["early"] == 0 for row in table),
    }
    armed = (c.get("params") or {}).get("crash_point") or []
    for p in POINTS:
        checks[f"faults: crash point {p} armed"] = p in armed
    for p in armed:
        checks[f"faults: crash point {p} fired"] = d.get(f"crash_point:{p}", 0) > 0
    for name in FAULTS:
        got = f.get(name) or {}
        unobserved = int(bool(last and last["fault"] == name and last.get("recovery_ms") is None
                              and last.get("error") is None))
        checks[f"faults: {name} injected, recovered"] = (
            got.get("injected", 0) >= 1 and got.get("failed_to_inject", 1) == 0
            and got.get("recovered", 0) + unobserved == got.get("injected"))
    return checks


def drift_text(c):
    """What recon called drift in chaos run C, for the printed line: its
    checks and their values, and the client's keys it could not match."""
    recon = c.get("recon") or {}
    values = dict(chaos_report(c))
    values.update({d.get("name"): d.get("value") for d in recon.get("deltas") or []})
    parts = [f"{name} {values.get(name)}" for name in recon.get("drift") or []]
    intents = chaos_intents(c)
    if intents.get("matched") != intents.get("client_succeeded"):
        parts.append(f"client keys matched {intents.get('matched')} of {intents.get('client_succeeded')}")
    if recon.get("drained") is False:
        parts.append("not drained in time")
    return f" (drift: {', '.join(parts)})" if parts else ""


def replayed(text):
    """How many deliveries `relay webhooks replay` said it queued again."""
    m = re.search(r"(\d+) failed deliveries queued again", text or "")
    return int(m.group(1)) if m else None


def applied_anyway(text):
    """How many failed deliveries had been applied all the same (their order
    has its charge: an attempt timed out at the sender after the receiver
    committed, the later ones were refused); None if unread."""
    m = re.fullmatch(r"\s*(\d+)\s*", text or "")
    return int(m.group(1)) if m else None


def replay_checks(c, replay_text, after, applied):
    """The checks of the replay run C, the replay's output, recon after it and
    APPLIED, the failed deliveries whose order was charged all the same."""
    r = chaos_report(c)
    failed = r.get("failed_deliveries", 0)
    drift = (c.get("recon") or {}).get("drift") or []
    n = replayed(replay_text)
    return {
        "replay: deliveries failed after their last attempt": failed > 0,
        "replay: recon called them drift (failed_deliveries), each an order without its charge "
        "unless applied before its sender gave up, none doubled": (
            "failed_deliveries" in drift and applied is not None and 0 <= applied <= failed
            and r.get("orders_without_charge") == failed - applied
            and r.get("double_charges", -1) == 0),
        "replay: every failed delivery queued again": n is not None and n == failed,
        "replay: recon CLEAN after the replay (each order charged once)": bool(after and after.get("clean")),
    }


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS SCALE); the exit status."""
    res, mode, min_kills, scale = argv[0], argv[1], int(argv[2]), float(argv[3])
    faults = load_json(os.path.join(res, "faults.json"))
    replay = load_json(os.path.join(res, "replay.json"))
    if faults is None or replay is None:
        print(f"exp-9: FAIL a chaos summary is missing in {res} (see its logs/)")
        return 1
    try:
        attempts = read_csv(os.path.join(res, "attempts.csv"))
    except OSError:
        attempts = []
    table = schedule_table(attempts, scale)
    write_csv(os.path.join(res, "schedule.csv"), table)
    after = load_json(os.path.join(res, "replay-recon.json"))
    checks = faults_checks(faults, table, min_kills, 3 if mode == "quick" else 4)
    applied = applied_anyway(read_text(os.path.join(res, "replay-applied.txt")))
    checks.update(replay_checks(replay, read_text(os.path.join(res, "replay.txt")), after, applied))
    t = faults.get("totals") or {}
    summary = {
        "experiment": "exp-9-webhooks",
        "mode": mode,
        "schedule_scale": scale,
        "faults": {
            "params": faults["params"],
            "kills_total": faults["kills_total"],
            "deaths": deaths(faults),
            "faults": faults.get("faults"),
            "distinct_orders": chaos_report(faults).get("distinct_orders"),
            "webhooks": {k: t.get(k) for k in ("webhook_accepted", "webhook_duplicates", "webhook_retries",
                                                "webhook_failed", "proxy_passed", "proxy_errored", "proxy_held")},
            "attempts": len(attempts),
            "recon_exit": faults["recon_exit"],
        },
        "schedule": table,
        "replay": {
            "failed_deliveries": chaos_report(replay).get("failed_deliveries"),
            "applied_before_given_up": applied,
            "replayed": replayed(read_text(os.path.join(res, "replay.txt"))),
            "recon_after": {"clean": (after or {}).get("clean"), "drift": (after or {}).get("drift")},
        },
        "checks": checks,
        "verdict": verdict(checks),
    }
    write_json(os.path.join(res, "summary.json"), summary)
    print_checks(checks)
    w = summary["faults"]["webhooks"]
    print(f"exp-9 faults: {faults['kills_total']} kill -9, {w['webhook_retries']} retries, "
          f"{w['proxy_errored']} answered 500, {w['proxy_held']} held past the timeout, "
          f"{w['webhook_duplicates']} answered as duplicates; {summary['faults']['distinct_orders']} orders, "
          f"recon exit {faults['recon_exit']}{drift_text(faults)}")
    for row in table:
        print(f"exp-9 schedule: after {row['failed_attempts']} failed: scheduled {row['scheduled_ms']} ms "
              f"(x0.8-1.2: {row['earliest_ms']}-{row['latest_ms']}), observed {row['count']}: "
              f"min {row['observed_min_ms']} p50 {row['observed_p50_ms']} max {row['observed_max_ms']} ms")
    rp = summary["replay"]
    print(f"exp-9 replay: {rp['failed_deliveries']} failed ({rp['applied_before_given_up']} applied before "
          f"the sender gave up), {rp['replayed']} replayed, "
          f"recon after: {'CLEAN' if rp['recon_after']['clean'] else rp['recon_after']['drift']}")
    print(f"exp-9: {summary['verdict']} ({mode}; {res}/summary.json)")
    return exit_code(summary)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
