"""The acceptance run's verdict (experiments/accept): reads chaos's summary
RES/accept.json (loadgen's report and recon's inside), loadgen's per-minute
CSV RES/logs/accept/loadgen-minutes.csv and the sampler's
RES/pipeline-minutes.csv; writes RES/minutes.csv (one row per minute: rate,
p50/p99/p999, outbox backlog, commit->publish and commit->effect p50/p99)
and RES/summary.json; lays the client's per-second p99 beside the sampler's
RES/samples.csv (spikes.py: what goes with the seconds over the SLO, where
the CPU went); prints the minutes, that, the checks and the verdict line;
exit 0 on PASS.

The SLO (p99 < 25 ms over the run) and the rate (5,000 sends/s for 20
minutes) are judged in full mode; quick mode (CI: a minute at a lower rate)
judges correctness and reports the latency.

Usage: python3 experiments/lib/accept.py RES MODE DURATION (run.sh passes them).
"""
import os
import sys

import spikes
from common import (chaos_intents, chaos_report, exit_code, load_json, number, orders_account_for_keys,
                    print_checks, read_csv, recon_word, verdict, write_csv, write_json)

SLO_P99_MS = 25.0
TARGET_SENDS_PER_S = 5000.0
TARGET_SECONDS = 1200


def minutes(load_rows, pipeline_rows):
    """The two per-minute tables joined on the minute."""
    by_minute = {int(r["minute"]): r for r in pipeline_rows}
    out = []
    for r in load_rows:
        m = int(r["minute"])
        row = {k: r[k] for k in ("minute", "sent", "ok", "errors", "sent_per_s", "p50_ms", "p99_ms",
                                 "p999_ms", "max_ms")}
        p = by_minute.get(m, {})
        for k in ("pending_rows_max", "oldest_pending_s_max", "publish_p50_ms", "publish_p99_ms",
                  "effect_p50_ms", "effect_p99_ms"):
            row[k] = p.get(k, "")
        out.append(row)
    return out


def judge(c, rows, mode, duration):
    """The summary from chaos summary C and the per-minute ROWS."""
    r, intents = chaos_report(c), chaos_intents(c)
    load = c.get("load") or {}
    rates = load.get("rates") or {}
    lat = (load.get("latency_ms") or {}).get("all") or {}
    keys = (load.get("keys") or {}).get("succeeded")
    p99s = [number(x["p99_ms"]) for x in rows if number(x["p99_ms"]) is not None]
    facts = {
        "recon": recon_word(c.get("recon_exit")),
        "distinct_orders": r.get("distinct_orders"),
        "distinct_keys": r.get("intents"),
        "client_keys_succeeded": keys,
        "client_ambiguous": intents.get("client_ambiguous"),
        "client_ambiguous_committed": intents.get("ambiguous_committed"),
        "client_refused": intents.get("client_failed"),
        "client_refused_committed": intents.get("failed_committed"),
        "replay_mismatches": (load.get("replay") or {}).get("mismatches"),
        "offered_sends_per_s": rates.get("offered_sends"),
        "achieved_per_s": rates.get("achieved"),
        "p50_ms": lat.get("p50_ms"),
        "p99_ms": lat.get("p99_ms"),
        "p999_ms": lat.get("p999_ms"),
        "max_ms": lat.get("max_ms"),
        "minutes": len(rows),
        "minutes_p99_over_slo": sum(1 for v in p99s if v >= SLO_P99_MS),
        "worst_minute_p99_ms": max(p99s) if p99s else None,
    }
    checks = {
        "recon CLEAN (distinct effects == distinct intents, the SQL diff in recon.sql)": c.get("recon_exit") == 0,
        # A key whose send timed out or was answered 408/5xx is ambiguous
        # to the client (0 or 1 order); recon finds whether it committed.
        # Every order is a key the client saw succeed or an ambiguous one
        # that committed.
        "distinct orders == distinct keys, exactly (client successes + committed ambiguous keys)": (
            facts["distinct_orders"] is not None and facts["distinct_orders"] == facts["distinct_keys"]
            and orders_account_for_keys(facts["distinct_orders"], load, intents)[0]),
        # Recon results from before it read loadgen's refused keys lack the count.
        "no key the client was refused has an order": (intents.get("failed_committed") or 0) == 0,
        "every key the client saw succeed has exactly its order": (
            intents.get("matched") == intents.get("client_succeeded")
            and intents.get("missing_in_db") == 0 and intents.get("wrong_order") == 0),
        "zero replay mismatches": facts["replay_mismatches"] == 0,
        "a row per minute of the run": len(rows) >= max(1, duration // 60),
    }
    if mode == "full":
        checks[f"ran {TARGET_SECONDS // 60} minutes or more"] = duration >= TARGET_SECONDS
        checks[f"offered {TARGET_SENDS_PER_S:,.0f} sends/s and achieved them (within 2%)"] = (
            (rates.get("offered_sends") or 0) >= 0.98 * TARGET_SENDS_PER_S
            and (rates.get("achieved") or 0) >= 0.98 * (rates.get("offered_sends") or 0))
        checks[f"synchronous p99 < {SLO_P99_MS:g} ms over the run"] = (
            lat.get("p99_ms") is not None and lat["p99_ms"] < SLO_P99_MS)
    return {"experiment": "accept", "mode": mode, "duration_s": duration, "facts": facts,
            "minutes": rows, "checks": checks, "verdict": verdict(checks)}


def verdict_line(s, res):
    f = s["facts"]
    slo = "under" if (f["p99_ms"] or 1e9) < SLO_P99_MS else "OVER"
    return (f"accept: {s['verdict']} — {f['distinct_orders']} orders == {f['distinct_keys']} keys, recon "
            f"{f['recon']}; {round(f['achieved_per_s'] or 0):,} sends/s; p99 {f['p99_ms']} ms ({slo} the {SLO_P99_MS:g} ms SLO), "
            f"{f['minutes_p99_over_slo']} of {f['minutes']} minutes over it, worst minute {f['worst_minute_p99_ms']} ms "
            f"({s['mode']}; {res}/summary.json)")


def main(argv):
    res, mode, duration = argv[0], argv[1], int(argv[2])
    c = load_json(os.path.join(res, "accept.json"))
    if c is None:
        print(f"accept: FAIL no chaos summary {res}/accept.json (see {res}/logs/accept/)")
        return 1
    try:
        load_rows = read_csv(os.path.join(res, "logs", "accept", "loadgen-minutes.csv"))
    except OSError:
        load_rows = []
    try:
        pipeline_rows = read_csv(os.path.join(res, "pipeline-minutes.csv"))
    except OSError:
        pipeline_rows = []
    rows = minutes(load_rows, pipeline_rows)
    s = judge(c, rows, mode, duration)
    started = (c.get("load") or {}).get("started_at_unix_ms")
    if started is not None:
        s["spikes"] = spikes.from_files(os.path.join(res, "logs", "accept", "loadgen.csv"),
                                        os.path.join(res, "samples.csv"), started / 1000.0, SLO_P99_MS)
    write_json(os.path.join(res, "summary.json"), s)
    write_csv(os.path.join(res, "minutes.csv"), rows)
    cols = ["minute", "sent_per_s", "p50_ms", "p99_ms", "p999_ms", "pending_rows_max", "oldest_pending_s_max",
            "publish_p99_ms", "effect_p99_ms"]
    print("  ".join(f"{c_:>14}" for c_ in cols))
    for x in rows:
        print("  ".join(f"{str(x.get(c_, '')):>14}" for c_ in cols))
    spikes.print_report(s.get("spikes"))
    print_checks(s["checks"])
    print(verdict_line(s, res))
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
