"""The verdicts of scripts/bench-orders.sh: whether a point passed, and the
run's table, knees, ratios and summary.json.

Usage: python3 scripts/lib/bench_orders.py cpu                (a CPU snapshot, JSON, to stdout)
       python3 scripts/lib/bench_orders.py dirty SECONDS      (the page cache's dirty and writeback
                                                               kB, 10 times a second, to stdout)
       python3 scripts/lib/bench_orders.py passed POINT.json  (exit 0 when the point passed)
       python3 scripts/lib/bench_orders.py summary OUT        (the results folder OUT)

bench-orders.sh packs each point's files into OUT/raw.tar.gz after the summary;
`summary` reads them from there when they are not beside it.

Standard library only; the CPU accounting is the experiments' sampler's.
"""
import glob
import json
import os
import re
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "experiments", "lib"))
import sampler  # noqa: E402
import writeback  # noqa: E402
from common import number, read_csv  # noqa: E402

SLO_P99_MS = 25
MIN_ACHIEVED = 0.95


def errors(r):
    """The answers of loadgen report R that were not successes, and its unfinished sends."""
    o = r["outcomes"]
    return o["server_errors"] + o["client_errors"] + o["connect_errors"] + o["other_status"] + r.get("unfinished", 0)


def passed(r):
    """A point passes: ≥ 95% of the offered sends achieved, p99 < 25 ms, no errors, none dropped."""
    return (r["rates"]["achieved"] >= MIN_ACHIEVED * r["rates"]["offered_sends"]
            and r["latency_ms"]["all"]["p99_ms"] < SLO_P99_MS and errors(r) == 0 and r["sends"]["dropped"] == 0)


def cores(out, tag):
    """Cores used per process group between the point's two CPU snapshots, and the machine's busy share."""
    try:
        before, after = (json.load(open(os.path.join(out, f"{tag}.cpu{i}"))) for i in (0, 1))
    except (OSError, ValueError):
        return {}
    # The snapshots carry no clock: the machine's ticks over its CPUs are the wall time, in ticks.
    wall = (after[1]["total"] - before[1]["total"]) / (os.cpu_count() or 1)
    row = sampler.cpu_columns(before, after, wall, 1, digits=2)
    if not row:
        return {}
    c = {k: row[f"cpu_{k}"] for k in ("orders", "loadgen", "postgres")}
    c["machine_busy"] = row["machine_busy"]
    return c


def cpu_us(cores_used, achieved):
    """CPU-microseconds per achieved send, per process group: the cores each used over the
    sends a second, so a change shows as a ratio whatever the machine's noise."""
    return sampler.cpu_us_per({k: v for k, v in cores_used.items()
                               if k != "machine_busy" and isinstance(v, (int, float))}, achieved)


def waits(out, tag):
    """The share of the orders backends' non-idle samples per wait event."""
    counts = {}
    try:
        for line in open(os.path.join(out, f"{tag}.waits")):
            parts = line.strip().split("|")
            if len(parts) == 2 and parts[1].isdigit():
                counts[parts[0]] = counts.get(parts[0], 0) + int(parts[1])
    except OSError:
        return {}
    total = sum(counts.values())
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
    return {k: round(v / total, 3) for k, v in top} if total else {}


def batches(out, tag):
    """The writers' batches during point TAG: batches a second and requests per batch (the
    coalescing), from orders' orders_write_batch_size histogram before and after the load."""
    try:
        (t0, c0, s0), (t1, c1, s1) = (map(float, line.split()) for line in open(os.path.join(out, f"{tag}.batches")))
    except (OSError, ValueError):
        return {}
    n = c1 - c0
    return {"per_sec": round(n / (t1 - t0)), "requests_per_batch": round((s1 - s0) / n, 1)} if n > 0 and t1 > t0 else {}


def dirty_sampler(seconds, interval=0.1, meminfo="/proc/meminfo", out=sys.stdout):
    """Lines `unix-time dirty-kB writeback-kB` every INTERVAL for SECONDS."""
    end = time.time() + seconds
    while time.time() < end:
        t = time.time()
        dirty, back = writeback.read_meminfo(meminfo)
        print(f"{t:.2f} {dirty} {back}", file=out, flush=True)
        time.sleep(max(0.0, interval - (time.time() - t)))


def stalls(out, tag):
    """Point TAG's seconds over the SLO (loadgen's per-second p99, TAG.seconds.csv) beside the
    page cache's writeback bursts (TAG.dirty): how many seconds were over, the worst three, the
    most dirty data, and each burst (writeback.bursts: dirty data falling by writeback.BURST_MB
    or more within a second) with the second of the load it fell in (from TAG.start, the clock
    just before loadgen started, to within its probe; without it, from the first sample)."""
    try:
        rows = read_csv(os.path.join(out, f"{tag}.seconds.csv"))
    except OSError:
        return {}
    cells = ((number(r.get("second")), number(r.get("p99_ms"))) for r in rows)
    p99 = [(int(sec), v) for sec, v in cells if sec is not None and v is not None]
    res = {"seconds_over_slo": sum(1 for _, v in p99 if v >= SLO_P99_MS),
           "worst_seconds": [[s, v] for s, v in sorted(p99, key=lambda x: -x[1])[:3]]}
    try:
        samples = [tuple(map(float, line.split())) for line in open(os.path.join(out, f"{tag}.dirty"))]
    except (OSError, ValueError):
        return res
    samples = [x for x in samples if len(x) == 3]
    if not samples:
        return res
    try:
        t0 = float(open(os.path.join(out, f"{tag}.start")).read())
    except (OSError, ValueError):
        t0 = samples[0][0]
    res["dirty_max_mb"] = round(max(d for _, d, _ in samples) / 1024)
    res["writeback_bursts"] = [[int(t - t0), round(top / 1024), round(d / 1024)]
                               for t, top, d in writeback.bursts([(t, d) for t, d, _ in samples])]
    return res


def stall_line(st):
    """One line of a point's stalls, for the table."""
    if not st:
        return ""
    worst = ", ".join(f"s{s} {v:.0f} ms" for s, v in st["worst_seconds"])
    line = f"{st['seconds_over_slo']} s over {SLO_P99_MS} ms (worst: {worst})"
    if "dirty_max_mb" in st:
        bursts = ", ".join(f"s{s} {a}->{b} MB" for s, a, b in st["writeback_bursts"]) or "none"
        line += f"; dirty at most {st['dirty_max_mb']} MB; writeback bursts: {bursts}"
    return line


def pg_settings(out):
    """The run's BENCH_PG_SETTINGS (OUT/pg-settings.txt), or None."""
    try:
        return open(os.path.join(out, "pg-settings.txt")).read().strip() or None
    except OSError:
        return None


def summary(out):
    """The run's table and summary.json; each point's files are read from OUT/raw.tar.gz when
    they are not in OUT (bench-orders.sh packs them there)."""
    raw = os.path.join(out, "raw.tar.gz")
    if glob.glob(os.path.join(out, "*-*.json")) or not os.path.exists(raw):
        return summarize(out, out)
    with tempfile.TemporaryDirectory() as points, tarfile.open(raw) as t:
        t.extractall(points, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return summarize(out, points)


def summarize(out, points):
    """summary() with each point's files (loadgen's report, CPU snapshots, waits, batches) read
    from the folder POINTS; pgbench's tables are read from and summary.json written to OUT."""
    def tps(name):
        # 0 when the run skipped the ceilings (BENCH_CEILINGS=0: an A/B with an older build).
        path = os.path.join(out, name)
        if not os.path.exists(path):
            return 0.0
        return float(re.search(r"tps = ([0-9.]+)", open(path).read()).group(1))
    single, batched = tps("pgbench.txt"), tps("pgbench-batch64.txt") * 64
    # Runs before the write became one statement have no transaction variant.
    has_txn = os.path.exists(os.path.join(out, "pgbench-batch64-txn.txt"))
    batched_txn = tps("pgbench-batch64-txn.txt") * 64 if has_txn else None
    rows = []
    for path in glob.glob(os.path.join(points, "*-*.json")):
        tag = os.path.basename(path)[:-5]
        r = json.load(open(path))
        used = cores(points, tag)
        rows.append({
            "intents": round(r["rates"]["offered"]), "mode": tag.split("-")[1], "again": tag.endswith("-again"),
            "offered_sends": round(r["rates"]["offered_sends"]), "achieved": round(r["rates"]["achieved"]),
            "p50_ms": r["latency_ms"]["all"]["p50_ms"], "p99_ms": r["latency_ms"]["all"]["p99_ms"],
            "errors": errors(r), "dropped": r["sends"]["dropped"], "replay_mismatches": r["replay"]["mismatches"],
            "cores": used, "cpu_us_per_send": cpu_us(used, r["rates"]["achieved"]),
            "waits": waits(points, tag), "batches": batches(points, tag), "passed": passed(r),
            "stalls": stalls(points, tag),
        })
    rows.sort(key=lambda x: (x["mode"] != "unique", x["intents"], x["again"]))
    print(f"{'intents':>8} {'mode':>8} {'sends':>7} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'err':>5} {'drop':>6} "
          f"{'pass':>5} {'orders':>7} {'loadgen':>8} {'postgres':>9} {'busy':>5}")
    for x in rows:
        c = x["cores"]
        print(f"{x['intents']:>8} {x['mode']:>8} {x['offered_sends']:>7} {x['achieved']:>9} {x['p50_ms']:>8.2f} "
              f"{x['p99_ms']:>8.2f} {x['errors']:>5} {x['dropped']:>6} {'yes' if x['passed'] else 'no':>5} "
              f"{c.get('orders', ''):>7} {c.get('loadgen', ''):>8} {c.get('postgres', ''):>9} {c.get('machine_busy', ''):>5}")
    print("CPU-microseconds per achieved send (orders, postgres, loadgen), the writers' batches (a second; "
          "requests per batch) and what the orders backends wait on (share of non-idle samples, 5 a second):")
    for x in rows:
        b, u = x["batches"], x["cpu_us_per_send"]
        print(f"{x['intents']:>8} {x['mode']:>8} {u.get('orders', ''):>5} {u.get('postgres', ''):>5} "
              f"{u.get('loadgen', ''):>5}  {b.get('per_sec', ''):>6} {b.get('requests_per_batch', ''):>6}  "
              + ", ".join(f"{k} {v}" for k, v in x["waits"].items()))
    print(f"Stalls: each point's seconds with a p99 over {SLO_P99_MS} ms (loadgen's, second by second) "
          f"and the page cache's writeback bursts (dirty data falling by {writeback.BURST_MB} MB or more within a second):")
    for x in rows:
        if x["stalls"]:
            print(f"{x['intents']:>8} {x['mode']:>8}  {stall_line(x['stalls'])}")

    def knee(mode):
        return max((x["achieved"] for x in rows if x["mode"] == mode and x["passed"]), default=0)
    unique, retry = knee("unique"), knee("retry15")
    s = {"command": "make bench-orders", "pgbench_tps": round(single),
         "pgbench_batch64_orders_per_sec": round(batched),
         "pgbench_batch64_txn_orders_per_sec": round(batched_txn) if has_txn else None,
         "best_sustained_req_per_sec": unique, "best_sustained_retry15_sends_per_sec": retry,
         "ratio": round(unique / single, 2) if single else 0,
         "batched_ratio": round(unique / batched, 2) if batched else 0,
         "pg_settings": pg_settings(out), "points": rows}
    json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=2)
    if s["pg_settings"]:
        print(f"PostgreSQL settings of the run's database: {s['pg_settings']}")
    if single:
        print(f"pgbench ceiling, one transaction per request: {single:.0f} tps")
        print(f"pgbench ceiling, 64 requests per statement: {batched:.0f} orders/s")
    if has_txn:
        print(f"pgbench, 64 requests per transaction of 3 statements: {batched_txn:.0f} orders/s")
    print(f"knee, unique keys (p99 < 25 ms, >= 95% achieved, 0 errors): {unique} req/s")
    print(f"knee, 15% retries: {retry} sends/s")
    print(f"results: {out}/summary.json")
    print(f"ratio: {unique / single:.2f}" if single else "ratio: 0.00")
    print(f"batched ratio: {unique / batched:.2f}" if batched else "batched ratio: 0.00")


def main(argv):
    if argv[:1] == ["cpu"]:
        print(json.dumps(sampler.cpu_ticks()))
        return 0
    if argv[:1] == ["dirty"] and len(argv) == 2:
        dirty_sampler(float(argv[1]))
        return 0
    if argv[:1] == ["passed"] and len(argv) == 2:
        return 0 if passed(json.load(open(argv[1]))) else 1
    if argv[:1] == ["summary"] and len(argv) == 2:
        summary(argv[1])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
