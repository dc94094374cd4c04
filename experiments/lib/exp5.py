"""Experiment 5's summary and verdict: the inbox at scale, single table vs
range partitions of msg_id, and the resurrection a too-short retention
allows. Reads the bench's documents RES/partitioned.json and RES/single.json
(crates/payments/examples/inbox_bench.rs) and chaos's summaries of the three
resurrection runs RES/resurrect-{unsafe,refused,tied}.json, writes
RES/summary.json, RES/growth.csv, RES/expiry.csv and RES/resurrection.csv,
prints the tables, the checks and the verdict line; exit 0 on PASS.

Usage: python3 experiments/lib/exp5.py RES MODE (run.sh passes them; run it
alone to judge results again).
"""
import os
import sys

from common import (chaos_report, exit_code, load_json, print_checks, recon_word, verdict,
                    write_csv, write_json)

LAYOUTS = ("partitioned", "single")
# The resurrection runs: a retention under the horizon with the late-arrival
# refusal off, the same with it on, and the retention tied to the horizon.
RESURRECTION = ("unsafe", "refused", "tied")
MB = 1024 * 1024


def growth_rows(docs):
    """One row per layout and checkpoint: the consume transaction and the sizes."""
    rows = []
    for layout in LAYOUTS:
        for p in docs[layout]["points"]:
            rows.append({
                "layout": layout,
                "keys": p["keys"],
                "txn_p50_ms": round(p["txn_p50_ms"], 2),
                "txn_p99_ms": round(p["txn_p99_ms"], 2),
                "txn_max_ms": round(p["txn_max_ms"], 2),
                "msgs_per_s": round(p["msgs_per_s"]),
                "wal_bytes_per_msg": round(p["wal_bytes_per_msg"]),
                "table_mb": round(p["table_bytes"] / MB, 1),
                "index_mb": round(p["index_bytes"] / MB, 1),
                "load_seconds": round(p["load_seconds"], 1),
            })
    return rows


def expiry_rows(docs):
    """One row per layout and expiry run (the quiet one, then under load)."""
    rows = []
    for layout in LAYOUTS:
        for e in docs[layout]["expiry"]:
            rows.append({
                "layout": layout,
                "op": e["op"],
                "concurrent": e["concurrent"],
                "rows_removed": e["rows_removed"],
                "seconds": round(e["seconds"], 3),
                "wal_mb": round(e["wal_bytes"] / MB, 2),
                "vacuum_seconds": round(e["vacuum_seconds"], 3),
                "vacuum_wal_mb": round(e["vacuum_wal_bytes"] / MB, 2),
                "table_mb_before": round(e["table_bytes_before"] / MB, 1),
                "table_mb_after": round(e["table_bytes_after"] / MB, 1),
                "index_mb_before": round(e["index_bytes_before"] / MB, 1),
                "index_mb_after": round(e["index_bytes_after"] / MB, 1),
                "concurrent_p99_ms": round(e["concurrent_p99_ms"], 2) if "concurrent_p99_ms" in e else "",
                "concurrent_txns": e.get("concurrent_txns", ""),
            })
    return rows


def bloom_row(doc):
    """The Bloom filter's measurement (the partitioned run's `--bloom`), or None."""
    b = doc.get("bloom")
    if not b:
        return None
    return {
        "keys": b["keys"],
        "build_seconds": round(b["build_seconds"], 2),
        "mb": round(b["bytes"] / MB, 1),
        "bits_per_key": round(b["bits"] / max(1, b["keys"]), 1),
        "false_positive_rate": round(b["false_positives"] / max(1, b["probes"]), 4),
        "lookup_ns": round(b["lookup_ns"], 1),
        "new_txn_p50_ms": b["new_txn_p50_ms"],
        "new_txn_p99_ms": b["new_txn_p99_ms"],
        "duplicate_txn_p50_ms": b["duplicate_txn_p50_ms"],
        "duplicate_txn_p99_ms": b["duplicate_txn_p99_ms"],
    }


def resurrection_row(run, c):
    """One resurrection run's numbers from its chaos summary C."""
    r = chaos_report(c)
    pay = c["services"]["payments"]["counters"]
    reset = c["faults"].get("offset-reset") or {}
    return {
        "run": run,
        "recon": recon_word(c["recon_exit"]),
        "recon_exit": c["recon_exit"],
        "offset_resets": reset.get("injected", 0),
        "orders": r.get("distinct_orders"),
        "charges": r.get("distinct_charges"),
        "effects": r.get("charge_effects"),
        "double_charges": r.get("double_charges"),
        "extra_cents": (r.get("effect_amount_cents") or 0) - (r.get("order_amount_cents") or 0),
        "inbox_hits": pay.get("inbox_hits", 0),
        "after_horizon": pay.get("after_horizon", 0),
        "applied_after_horizon": pay.get("applied_after_horizon", 0),
        "dead_letters": r.get("dead_letters"),
        "late_duplicates": r.get("late_duplicates"),
    }


def judge_resurrection(runs):
    """The checks of the resurrection runs (RUNS: run -> resurrection_row)."""
    checks = {}
    for run in RESURRECTION:
        checks[f"resurrect-{run}: the group's offsets were reset once"] = (runs.get(run) or {}).get("offset_resets", 0) >= 1
    u = runs.get("unsafe") or {}
    checks["unsafe (short retention, refusal off): late duplicates applied, recon DRIFT with double charges"] = (
        u.get("recon_exit") == 1 and (u.get("double_charges") or 0) > 0 and u.get("applied_after_horizon", 0) > 0)
    checks["unsafe: the charge rows' own guard held (one per order); the ledger doubled"] = (
        u.get("charges") == u.get("orders") and (u.get("effects") or 0) > (u.get("charges") or 0))
    f = runs.get("refused") or {}
    checks["refused (short retention, refusal on): recon CLEAN, no double charge"] = (
        f.get("recon_exit") == 0 and f.get("double_charges") == 0)
    checks["refused: every dead letter a proven late duplicate"] = (
        (f.get("dead_letters") or 0) > 0 and f.get("late_duplicates") == f.get("dead_letters"))
    t = runs.get("tied") or {}
    checks["tied (retention = horizon): recon CLEAN, the inbox caught the redelivery, nothing refused"] = (
        t.get("recon_exit") == 0 and t.get("inbox_hits", 0) > 0 and t.get("dead_letters") == 0
        and t.get("after_horizon", 0) == 0 and t.get("double_charges") == 0)
    return checks


def judge(docs, mode, checkpoints, resurrection=None):
    """The summary: every measurement there, and expiry by partition drop
    doing what it is for (less WAL, space back) where the delete does not."""
    growth, expiry = growth_rows(docs), expiry_rows(docs)
    checks = {}
    for layout in LAYOUTS:
        got = [p["keys"] for p in docs[layout]["points"]]
        checks[f"{layout}: measured at {checkpoints} keys"] = got == checkpoints
    quiet = {e["layout"]: e for e in expiry if not e["concurrent"]}
    loaded = {e["layout"]: e for e in expiry if e["concurrent"]}
    p, s = quiet.get("partitioned"), quiet.get("single")
    checks["both layouts expired the same day of keys"] = bool(
        p and s and p["rows_removed"] > 0 and abs(p["rows_removed"] - s["rows_removed"]) <= max(1, p["rows_removed"] // 100))
    checks["drop partition wrote less WAL than delete + vacuum"] = bool(
        p and s and p["wal_mb"] < s["wal_mb"] + s["vacuum_wal_mb"])
    checks["drop partition gave the space back (the table shrank)"] = bool(p and p["table_mb_after"] < p["table_mb_before"])
    checks["consumption went on during each expiry"] = all(
        (loaded.get(layout) or {}).get("concurrent_txns", 0) > 0 for layout in LAYOUTS)
    bloom = bloom_row(docs["partitioned"])
    checks["bloom: a filter built from every key, its false positives near the 1% asked"] = bool(
        bloom and bloom["keys"] >= checkpoints[-1] and bloom["false_positive_rate"] <= 0.02)
    runs = {row["run"]: row for row in resurrection or []}
    checks.update(judge_resurrection(runs))
    return {"experiment": "exp-5-dedup-store", "mode": mode, "checkpoints": checkpoints,
            "growth": growth, "expiry": expiry, "bloom": bloom, "resurrection": list(runs.values()),
            "checks": checks, "verdict": verdict(checks)}


def table(rows, columns):
    """ROWS as an aligned text table of COLUMNS."""
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    for r in rows:
        lines.append("  ".join(str(r[c]).rjust(widths[c]) for c in columns))
    return "\n".join(lines)


def verdict_line(s, res):
    """The last line: the verdict and the numbers behind it."""
    big = {g["layout"]: g for g in s["growth"] if g["keys"] == s["checkpoints"][-1]}
    quiet = {e["layout"]: e for e in s["expiry"] if not e["concurrent"]}
    parts = [f"exp-5: {s['verdict']} — at {s['checkpoints'][-1]:,} keys"]
    if len(big) == 2:
        parts.append(f"consume p99 {big['partitioned']['txn_p99_ms']} ms partitioned vs "
                     f"{big['single']['txn_p99_ms']} ms single")
    if len(quiet) == 2:
        p, q = quiet["partitioned"], quiet["single"]
        parts.append(f"a day's {p['rows_removed']:,} keys: drop {p['seconds']} s / {p['wal_mb']} MB WAL vs "
                     f"delete {q['seconds']} s + vacuum {q['vacuum_seconds']} s / {q['wal_mb'] + q['vacuum_wal_mb']:.2f} MB WAL")
    b = s.get("bloom")
    if b:
        parts.append(f"a Bloom filter of {b['keys']:,} keys: {b['mb']} MB, {b['build_seconds']} s to build; "
                     f"a redelivered batch {b['duplicate_txn_p50_ms']} ms vs new {b['new_txn_p50_ms']} ms (p50)")
    runs = {r["run"]: r for r in s.get("resurrection", [])}
    if "unsafe" in runs and "refused" in runs:
        parts.append(f"resurrection: {runs['unsafe']['double_charges']} double charges with the refusal off "
                     f"(recon {runs['unsafe']['recon']}), {runs['refused']['late_duplicates']} late duplicates "
                     f"refused with it on (recon {runs['refused']['recon']})")
    return "; ".join(parts) + f" ({s['mode']}; {res}/summary.json)"


def main(argv):
    """Judge RES (argv: RES MODE CHECKPOINTS); the exit status."""
    res, mode = argv[0], argv[1]
    checkpoints = sorted(int(c) for c in argv[2].split(","))
    docs = {}
    for layout in LAYOUTS:
        d = load_json(os.path.join(res, f"{layout}.json"))
        if d is None:
            print(f"exp-5: FAIL no bench results {res}/{layout}.json (see {res}/logs/)")
            return 1
        docs[layout] = d
    resurrection = []
    for run in RESURRECTION:
        c = load_json(os.path.join(res, f"resurrect-{run}.json"))
        if c is None:
            print(f"exp-5: no chaos summary {res}/resurrect-{run}.json (see {res}/logs/resurrect-{run}/)")
            continue
        resurrection.append(resurrection_row(run, c))
    s = judge(docs, mode, checkpoints, resurrection)
    write_json(os.path.join(res, "summary.json"), s)
    write_csv(os.path.join(res, "growth.csv"), s["growth"])
    write_csv(os.path.join(res, "expiry.csv"), s["expiry"])
    write_csv(os.path.join(res, "resurrection.csv"), s["resurrection"])
    print(table(s["growth"], ["layout", "keys", "txn_p50_ms", "txn_p99_ms", "msgs_per_s",
                              "wal_bytes_per_msg", "table_mb", "index_mb", "load_seconds"]))
    print()
    print(table(s["expiry"], ["layout", "op", "concurrent", "rows_removed", "seconds", "wal_mb",
                              "vacuum_seconds", "vacuum_wal_mb", "table_mb_before", "table_mb_after",
                              "concurrent_p99_ms"]))
    if s["bloom"]:
        print()
        print(table([s["bloom"]], list(s["bloom"])))
    if s["resurrection"]:
        print()
        print(table(s["resurrection"], ["run", "offset_resets", "orders", "charges", "effects",
                                        "double_charges", "extra_cents", "inbox_hits", "after_horizon",
                                        "applied_after_horizon", "dead_letters", "late_duplicates", "recon"]))
    print_checks(s["checks"])
    print(verdict_line(s, res))
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
