"""Experiment 1's summary and verdict: the retry storm. For each offered rate
three runs — `pipeline` (chaos without faults: orders + relay + payments, then
recon), `check` and `nocheck` (orders alone, with and without the idempotency
check) — judged for the invariant (PASS/FAIL) and measured against the
"sustainable" rule (the highest sustainable rate per mode; not a failure).

Reads, per rate R, in RES: R-pipeline.json (chaos's summary), and in
RES/logs/R-<mode>/: loadgen.json, loadgen.rc and recon.json (orders alone),
cpu.txt and top.txt (both). Writes RES/summary.json, points.csv,
comparison.csv; prints the table and, last, the verdict line; exit 0 on PASS.

Usage: python3 experiments/lib/exp1.py RES MODE SECONDS RETRY_RATE ZIPF_S "RATES" DRAIN ELAPSED BIN
(run.sh passes them; run it alone to judge results again).
"""
import os
import sys

from common import load_json, orders_account_for_keys, read_text, recon_intents, recon_report, write_csv, write_json

MODES = ("pipeline", "check", "nocheck")
LABELS = {
    "pipeline": "with check, full pipeline (recon)",
    "check": "with check, orders alone",
    "nocheck": "no check (--no-idempotency), orders alone",
}
CRITERION = {"achieved_min_pct": 99.0, "errors_max_pct": 0.1, "p99_max_ms": 25.0, "replay_mismatches": 0}
CRITERION_TEXT = ("achieved (answered sends) >= 99% of offered sends (first attempts + retries), "
                  "errors (non-ok, dropped, unfinished) <= 0.1%, p99 < 25 ms, 0 replay mismatches; "
                  "for the pipeline mode also recon CLEAN")


def sustainable(p):
    """The rule for one point: enough answered, few errors, a low p99, no
    replay mismatch with the check on (and recon CLEAN for the pipeline)."""
    ok = (p["achieved_pct"] >= CRITERION["achieved_min_pct"]
          and p["error_pct"] <= CRITERION["errors_max_pct"]
          and p["p99_ms"] < CRITERION["p99_max_ms"]
          and (p["mode"] == "nocheck" or p["replay_mismatches"] == CRITERION["replay_mismatches"]))
    if p["mode"] == "pipeline":
        ok = ok and p["recon_clean"]
    return ok


def machine_busy(cpu):
    """Busy share of all cores over the load (100 = every core busy) from
    cpu.txt's "busy0 total0 busy1 total1" (/proc/stat jiffies)."""
    try:
        b0, t0, b1, t1 = (int(x) for x in (cpu or "").split())
        return round(100.0 * (b1 - b0) / (t1 - t0), 1)
    except (ValueError, ZeroDivisionError):
        return None


def others_cpu(top, bin_dir):
    """%CPU (100 = one core) of processes that are not this run's, in the last
    sample of `top -b` output TOP: another user's builds and services on the
    shared machine. This run's binaries (under BIN_DIR), PostgreSQL (shared,
    not attributable) and the broker are left out."""
    if not top:
        return None
    total, seen = 0.0, False
    for line in top.split("top - ")[-1].splitlines():
        f = line.split(None, 11)
        if len(f) == 12 and f[0] == "PID":
            seen = True
            continue
        if not seen or len(f) < 12:
            continue
        cmd = f[11]
        if bin_dir in cmd or cmd.startswith(("postgres", "top ", "/usr/lib/postgresql")) or "kafka.Kafka" in cmd:
            continue
        try:
            total += float(f[8])
        except ValueError:
            pass
    return round(total, 1)


def point(mode, rate, r, recon, recon_exit, loadgen_exit, busy=None, others=None, where=""):
    """One (rate, mode) point from loadgen's report R and RECON (`recon --json`:
    the table counts, and for the pipeline the proof, RECON_EXIT its exit
    status). Returns (point, problems): the problems fail the experiment."""
    problems = []
    s, o, lat = r["sends"], r["outcomes"], r["latency_ms"]["all"]
    offered_sends = s["sent"] + s["dropped"]
    errors = (o["completed"] - o["ok"]) + s["dropped"] + r["unfinished"]
    rep = recon_report(recon)
    orders, outbox, keys = (rep.get(k, -1) for k in ("distinct_orders", "outbox_rows", "intents"))
    p = {
        "mode": mode, "label": LABELS[mode], "offered": rate,
        "offered_sends_per_s": round(r["rates"]["offered_sends"], 1),
        "achieved_per_s": round(r["rates"]["achieved"], 1),
        "achieved_pct": round(100.0 * o["responses"] / offered_sends, 2) if offered_sends else 0.0,
        "ok_per_s": round(r["rates"]["ok"], 1),
        "sent": s["sent"], "retries_sent": s["retries_sent"], "repeat_intents": s["repeat_intents"],
        "errors": errors, "error_pct": round(100.0 * errors / offered_sends, 3) if offered_sends else 0.0,
        "status_5xx": o["server_errors"], "timeouts": o["timeouts"], "dropped": s["dropped"],
        "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "p999_ms": lat["p999_ms"], "max_ms": lat["max_ms"],
        "replay_mismatches": r["replay"]["mismatches"], "replays_compared": r["replay"]["compared"],
        "keys_succeeded": r["keys"]["succeeded"], "keys_ambiguous": r["keys"]["ambiguous"],
        "orders": orders, "outbox_rows": outbox, "idempotency_keys": keys,
        "loadgen_exit": loadgen_exit,
        "machine_busy_pct": busy, "others_cpu_pct": others,
    }
    p["sustainable"] = False
    if mode == "pipeline":
        intents = recon_intents(recon)
        drained = (recon or {}).get("drained")
        if drained is None and rep:
            # recon --wait-drained ran before (chaos); its JSON run did not wait.
            drained = rep.get("pending_rows") == 0 and rep.get("events_not_consumed") == 0
        p.update({
            "recon_exit": recon_exit, "recon_clean": bool(recon and recon.get("clean")) and recon_exit == 0,
            "recon_drained": bool(drained),
            "distinct_orders": rep.get("distinct_orders"), "intents_in_db": rep.get("intents"),
            "charges": rep.get("distinct_charges"), "ledger_effects": rep.get("charge_effects"),
            "client_keys_matched": intents.get("matched"),
            "ambiguous_committed": intents.get("ambiguous_committed"),
        })
        # distinct orders == distinct keys that succeeded (+ the ambiguous
        # keys that did commit: a timeout, a 408 or a 503 after the commit
        # is not a loss); a refused key has no order.
        p["orders_equal_keys"], expected = orders_account_for_keys(p["distinct_orders"], r, intents)
        p["refused_committed"] = intents.get("failed_committed")
        if not p["recon_clean"]:
            problems.append(f"{rate} pipeline: recon not CLEAN (exit {recon_exit}; {where})")
        if not p["orders_equal_keys"]:
            problems.append(f"{rate} pipeline: distinct orders {p['distinct_orders']} != {expected}")
        if p["refused_committed"]:
            problems.append(f"{rate} pipeline: {p['refused_committed']} keys the client was refused have an order")
    p["sustainable"] = sustainable(p)
    if mode in ("pipeline", "check") and p["replay_mismatches"]:
        problems.append(f"{rate} {mode}: {p['replay_mismatches']} replay mismatches with the check on")
    if mode == "check" and orders != keys:
        problems.append(f"{rate} check: {orders} orders != {keys} idempotency keys")
    if mode == "nocheck":
        # Evidence that the baseline really skipped the check.
        p["duplicate_orders"] = orders - p["keys_succeeded"]
        if not (orders > p["keys_succeeded"] and keys == 0):
            problems.append(f"{rate} nocheck: {orders} orders, {p['keys_succeeded']} keys, "
                            f"{keys} idempotency rows: the check was not off")
    return p, problems


def read_point(res, rate, mode, bin_dir):
    """The point of RATE and MODE from the files a run left in RES (see the
    module doc); (None, [problem]) when loadgen's report is missing."""
    d = os.path.join(res, "logs", f"{rate}-{mode}")
    busy = machine_busy(read_text(os.path.join(d, "cpu.txt")))
    others = others_cpu(read_text(os.path.join(d, "top.txt")), bin_dir)
    if mode == "pipeline":
        c = load_json(os.path.join(res, f"{rate}-{mode}.json")) or {}
        r, recon = c.get("load"), c.get("recon")
        recon_exit, loadgen_exit = c.get("recon_exit", -1), (c.get("load") or {}).get("exit_code", -1)
        where = os.path.join(d, "recon.json")
    else:
        r, recon = load_json(os.path.join(d, "loadgen.json")), load_json(os.path.join(d, "recon.json"))
        recon_exit, where = None, ""
        try:
            loadgen_exit = int(read_text(os.path.join(d, "loadgen.rc"), "-1"))
        except ValueError:
            loadgen_exit = -1
    if not r:
        return None, [f"{rate} {mode}: no loadgen report (see {d})"]
    return point(mode, rate, r, recon, recon_exit, loadgen_exit, busy, others, where)


def compare(points):
    """Per rate with both orders-alone modes: p99 and p50 with vs without the check."""
    by = {(p["offered"], p["mode"]): p for p in points}
    out = []
    for rate in sorted({p["offered"] for p in points}):
        c, n, pl = by.get((rate, "check")), by.get((rate, "nocheck")), by.get((rate, "pipeline"))
        if not (c and n):
            continue
        out.append({
            "offered": rate,
            "p99_ms_pipeline": pl["p99_ms"] if pl else None,
            "p99_ms_check": c["p99_ms"], "p99_ms_nocheck": n["p99_ms"],
            "p99_ratio_check_over_nocheck": round(c["p99_ms"] / n["p99_ms"], 2) if n["p99_ms"] else None,
            "p50_ms_check": c["p50_ms"], "p50_ms_nocheck": n["p50_ms"],
            "p50_ratio_check_over_nocheck": round(c["p50_ms"] / n["p50_ms"], 2) if n["p50_ms"] else None,
            "orders_check": c["orders"], "orders_nocheck": n["orders"],
            "keys_succeeded_nocheck": n["keys_succeeded"],
        })
    return out


def summarize(points, problems, mode, parameters, elapsed):
    """The summary: highest sustainable rate per mode, the comparison, the
    headline (the highest rate both orders-alone modes sustain), the verdict
    (PASS: no problem)."""
    by = {(p["offered"], p["mode"]): p for p in points}
    comparison = compare(points)
    highest = {m: max((p["offered"] for p in points if p["mode"] == m and p["sustainable"]), default=0)
               for m in MODES}
    both = [c for c in comparison
            if by[(c["offered"], "check")]["sustainable"] and by[(c["offered"], "nocheck")]["sustainable"]]
    headline = both[-1] if both else (comparison[0] if comparison else None)
    return {
        "experiment": "exp-1-retry-storm", "mode": mode,
        "command": ("QUICK=1 " if mode == "quick" else "") + "experiments/exp-1-retry-storm/run.sh",
        "parameters": parameters,
        "sustainable_criterion": CRITERION_TEXT,
        "highest_sustainable_intents_per_s": highest,
        "headline_comparison": headline,
        "comparison": comparison,
        "points": points,
        "problems": problems,
        "verdict": "PASS" if points and not problems else "FAIL",
        "elapsed_s": elapsed,
    }


def lines(summary):
    """The printed table, the comparisons, the problems and, last, the verdict line."""
    def opt(v):
        return v if v is not None else "-"
    out = [f"{'offered':>7} {'mode':>8} {'sends/s':>8} {'achvd%':>7} {'err%':>6} {'p50':>7} {'p99':>7} {'p99.9':>7} "
           f"{'mism':>6} {'keys ok':>8} {'orders':>8} {'recon':>6} {'sust':>5} {'busy%':>6} {'others%':>7}"]
    for p in summary["points"]:
        recon = ("CLEAN" if p["recon_clean"] else "DRIFT") if p["mode"] == "pipeline" else "-"
        out.append(f"{p['offered']:>7} {p['mode']:>8} {p['offered_sends_per_s']:>8.0f} {p['achieved_pct']:>7.2f} "
                   f"{p['error_pct']:>6.3f} {p['p50_ms']:>7.2f} {p['p99_ms']:>7.2f} {p['p999_ms']:>7.2f} "
                   f"{p['replay_mismatches']:>6} {p['keys_succeeded']:>8} {p['orders']:>8} {recon:>6} "
                   f"{'yes' if p['sustainable'] else 'no':>5} {opt(p['machine_busy_pct']):>6} "
                   f"{opt(p['others_cpu_pct']):>7}")
    for c in summary["comparison"]:
        out.append(f"p99 at {c['offered']}/s: with check {c['p99_ms_check']:.2f} ms, without "
                   f"{c['p99_ms_nocheck']:.2f} ms, ratio {c['p99_ratio_check_over_nocheck']}; "
                   f"full pipeline {c['p99_ms_pipeline']}")
    out += [f"problem: {problem}" for problem in summary["problems"]]
    h, highest = summary["headline_comparison"], summary["highest_sustainable_intents_per_s"]
    ratio = f"p99 check/no-check at {h['offered']}/s {h['p99_ratio_check_over_nocheck']}" if h else "no comparison"
    out.append(f"exp-1: {summary['verdict']} highest sustainable: {highest['pipeline']}/s full pipeline "
               f"(recon CLEAN), {highest['check']}/s orders alone with check, {highest['nocheck']}/s without; {ratio}")
    return out


def main(argv):
    """Summarize RES (argv: see the module doc); the exit status."""
    res, mode, secs, retry, zipf, rates, drain, elapsed, bin_dir = argv[:9]
    rates = [int(x) for x in rates.split()]
    points, problems = [], []
    for rate in rates:
        for m in MODES:
            p, probs = read_point(res, rate, m, bin_dir)
            problems += probs
            if p:
                points.append(p)
    parameters = {
        "rates": rates, "seconds_per_point": int(secs), "retry_rate": float(retry),
        "zipf_s": float(zipf), "keys": 50_000_000, "protocol": "mixed", "loadgen_timeout_ms": 2000,
        "recon_wait_drained_s": int(drain), "fresh_database_per_point": True,
        "orders_defaults": "4 writers, batches <= 128, queue 4096",
    }
    summary = summarize(points, problems, mode, parameters, int(elapsed))
    write_json(os.path.join(res, "summary.json"), summary)
    write_csv(os.path.join(res, "points.csv"), points)
    write_csv(os.path.join(res, "comparison.csv"), summary["comparison"])
    print("\n".join(lines(summary)))
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
