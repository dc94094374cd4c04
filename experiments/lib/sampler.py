"""Samples the running pipeline every few seconds while an experiment's load
runs: the outbox backlog (pending rows, age of the oldest, from SQL) and the
relay's commit->publish and payments' commit->effect histograms (from their
GET /metrics). Writes one CSV row per sample, and per minute (`--minutes`)
the backlog's worst and the two latencies' p50/p99 over that minute, from
the histograms' bucket deltas (as Prometheus' histogram_quantile does).

Each sample also records what could slow the pipeline down, to be laid
beside the client's per-second latency (accept.py does): the CPU each
process group used since the previous sample (in cores, from /proc: every
process of the machine with that name), the machine's busy, iowait and
steal share, PostgreSQL's checkpoint buffers written and WAL bytes since the
previous sample, the tables an autovacuum worker was vacuuming or
analyzing at the sample, and the page cache's dirty data: its most since the
previous sample and its largest fall within a second (a writeback burst when
64 MB or more; read ten times a second in a thread, writeback.py).

Usage: python3 experiments/lib/sampler.py --database-url URL --relay HOST:PORT
       [--payments HOST:PORT] --duration SECONDS --out samples.csv --minutes minutes.csv
       [--interval 5]

Without --payments (a run of the relay alone, e.g. experiment 6) the
commit->effect columns stay empty.

Standard library only (psql for the SQL). It starts counting when the
services it was given answer /metrics, and stops after --duration seconds or on SIGTERM,
writing what it has.
"""
import argparse
import csv
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import writeback

HISTOGRAMS = {"publish": "relay_commit_to_publish_seconds", "effect": "payments_commit_to_effect_seconds"}
# One row: the backlog, then the server's cumulative counters and what its
# autovacuum workers are doing ('+'-joined table names, '' when idle).
SAMPLE_SQL = """
SELECT b.n, b.age, w.buffers_checkpoint, w.checkpoints_timed + w.checkpoints_req,
       pg_current_wal_lsn() - '0/0'::pg_lsn,
       COALESCE((SELECT string_agg(relid::regclass::text, '+' ORDER BY relid) FROM pg_stat_progress_vacuum), ''),
       COALESCE((SELECT string_agg(relid::regclass::text, '+' ORDER BY relid) FROM pg_stat_progress_analyze), '')
FROM (SELECT count(*) AS n, COALESCE(extract(epoch FROM now() - min(created_at)), 0) AS age
      FROM orders.outbox WHERE published_at IS NULL AND failed_at IS NULL) AS b, pg_stat_bgwriter AS w
"""
# The process groups whose CPU is recorded, by the name in /proc/PID/comm
# (COMM_GROUPS renames one: the Kafka nodes are JVMs, comm "java").
PROCESSES = ("orders", "relay", "payments", "loadgen", "chaos", "postgres", "kafka", "pgbench", "python3")
COMM_GROUPS = {"java": "kafka"}


def scrape(addr, name):
    """The cumulative buckets {le: count} of histogram NAME at http://ADDR/metrics, or None."""
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=2) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    buckets = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line.rpartition(" ")
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        try:
            buckets[math.inf if le == "+Inf" else float(le)] = float(value)
        except ValueError:
            continue
    return buckets


def pg_sample(url):
    """The database's row of SAMPLE_SQL as a dict, or {} when the query failed."""
    try:
        out = subprocess.run(["psql", url, "-qAt", "-F", "|", "-c", SAMPLE_SQL], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        n, age, ckpt_buffers, ckpts, wal, vacuum, analyze = out.split("|")
        return {"pending": int(n), "oldest_s": float(age), "ckpt_buffers": int(ckpt_buffers),
                "checkpoints": int(ckpts), "wal_bytes": int(float(wal)), "vacuum": vacuum, "analyze": analyze}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def process_ticks(proc="/proc"):
    """(pid, name in /proc/PID/comm, utime+stime clock ticks) of every process
    in PROC that can be read."""
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc, pid, "stat"), encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 12:
            yield pid, name, int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)


def machine_ticks(proc="/proc"):
    """{busy, idle, iowait, steal, total: the machine's clock ticks} from
    PROC/stat, or {} when it cannot be read."""
    try:
        with open(os.path.join(proc, "stat"), encoding="utf-8") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        machine = {"total": sum(cpu[:8]), "idle": cpu[3], "iowait": cpu[4], "steal": cpu[7]}
        machine["busy"] = machine["total"] - cpu[3] - cpu[4] - cpu[7]
        return machine
    except (OSError, ValueError, IndexError):
        return {}


def cpu_ticks(proc="/proc"):
    """({process group: utime+stime clock ticks summed over its processes},
    {busy, iowait, steal, total: the machine's ticks}) from PROC."""
    groups = dict.fromkeys(PROCESSES, 0)
    for _, name, ticks in process_ticks(proc):
        name = COMM_GROUPS.get(name, name)
        if name in groups:
            groups[name] += ticks
    return groups, machine_ticks(proc)


def cpu_columns(before, after, seconds, hz, digits=3):
    """The CPU columns of a sample from two cpu_ticks() readings SECONDS apart:
    cores used per process group, and the machine's busy/iowait/steal shares,
    rounded to DIGITS decimals."""
    row = {}
    if before is None or seconds <= 0:
        return row
    (g0, m0), (g1, m1) = before, after
    for name in PROCESSES:
        if name in g0 and name in g1:  # a snapshot from before a group existed has no column for it
            row[f"cpu_{name}"] = round(max(0, g1[name] - g0[name]) / hz / seconds, digits)
    total = m1.get("total", 0) - m0.get("total", 0)
    for k in ("busy", "iowait", "steal"):
        row[f"machine_{k}"] = round((m1.get(k, 0) - m0.get(k, 0)) / total, digits) if total > 0 else ""
    return row


def cpu_us_per(cores, per_s):
    """CPU-microseconds per unit of work for each entry of CORES (cores used
    over the same span), at PER_S units done a second: {} when none were done.
    The benchmarks' and the acceptance run's per-order figure."""
    if not per_s or per_s <= 0:
        return {}
    return {k: round(v * 1e6 / per_s) for k, v in cores.items()}


def quantile(q, before, after):
    """The Q quantile of the observations between two cumulative bucket
    snapshots (linear within a bucket), or None when there were none. A
    counter that went down (a restart) counts from zero."""
    if not after:
        return None
    les = sorted(after)
    delta = []
    for le in les:
        d = after[le] - (before or {}).get(le, 0)
        delta.append((le, d if d >= 0 else after[le]))
    total = delta[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lo, prev = 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if math.isinf(le):
                return lo
            width = count - prev
            return lo + (le - lo) * ((rank - prev) / width if width > 0 else 1.0)
        lo, prev = le, count
    return lo


def per_minute(samples):
    """Per-minute rows from the samples (each: t, pending, oldest_s, and the histograms)."""
    rows = []
    if not samples:
        return rows
    minutes = int(samples[-1]["t"] // 60) + 1
    for m in range(minutes):
        inside = [s for s in samples if m * 60 <= s["t"] < (m + 1) * 60]
        if not inside:
            continue
        # The minute's observations: the last snapshot at or before its end
        # minus the last at or before its start.
        start = [s for s in samples if s["t"] <= m * 60]
        first = start[-1] if start else None
        last = [s for s in samples if s["t"] <= (m + 1) * 60][-1]
        row = {"minute": m,
               "pending_rows_max": max((s["pending"] for s in inside if s["pending"] is not None), default=""),
               "oldest_pending_s_max": max((round(s["oldest_s"], 3) for s in inside if s["oldest_s"] is not None),
                                           default="")}
        for key in HISTOGRAMS:
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                v = quantile(q, first[key] if first else None, last[key])
                row[f"{key}_{label}_ms"] = "" if v is None else round(v * 1000, 2)
        rows.append(row)
    return rows


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--relay", required=True, help="HOST:PORT of the relay's /metrics")
    ap.add_argument("--payments", help="HOST:PORT of payments' /metrics (none: the relay runs alone)")
    ap.add_argument("--duration", type=float, required=True, help="seconds to sample once the services answer")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", required=True)
    args = ap.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    deadline = time.monotonic() + args.ready_timeout
    while not stop and time.monotonic() < deadline:
        if scrape(args.relay, HISTOGRAMS["publish"]) is not None and \
                (args.payments is None or scrape(args.payments, HISTOGRAMS["effect"]) is not None):
            break
        time.sleep(0.2)
    else:
        print("sampler: the services' /metrics never answered", file=sys.stderr)
    t0 = time.monotonic()
    hz = os.sysconf("SC_CLK_TCK")
    dirty = writeback.Watch().start()
    samples, previous, ticks_before = [], {}, None
    while not stop and time.monotonic() - t0 <= args.duration:
        t = time.monotonic() - t0
        ticks = (cpu_ticks(), time.monotonic())
        db = pg_sample(args.database_url)
        sample = {"t": t, "unix_s": time.time(), "pending": db.get("pending"), "oldest_s": db.get("oldest_s"),
                  "publish": scrape(args.relay, HISTOGRAMS["publish"]),
                  "effect": scrape(args.payments, HISTOGRAMS["effect"]) if args.payments else None,
                  "vacuum": db.get("vacuum", ""), "analyze": db.get("analyze", "")}
        for key in ("ckpt_buffers", "checkpoints", "wal_bytes"):
            if key in db and key in previous:
                sample[key] = db[key] - previous[key]
        if ticks_before is not None:
            sample.update(cpu_columns(ticks_before[0], ticks[0], ticks[1] - ticks_before[1], hz))
        sample.update(dirty.take() or {})
        previous, ticks_before = db or previous, ticks
        samples.append(sample)
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0 - t)))
    dirty.stop()
    columns = ["t_s", "unix_s", "pending_rows", "oldest_pending_s", "published", "effects", "ckpt_buffers",
               "checkpoints", "wal_bytes", "vacuum", "analyze"]
    columns += [f"cpu_{n}" for n in PROCESSES] + ["machine_busy", "machine_iowait", "machine_steal"]
    columns += ["dirty_max_mb", "dirty_fall_mb"]
    with open(args.out, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for s in samples:
            w.writerow([round(s["t"], 1), round(s["unix_s"], 3), s["pending"], s["oldest_s"],
                        (s["publish"] or {}).get(math.inf, ""), (s["effect"] or {}).get(math.inf, "")]
                       + [s.get(c, "") for c in columns[6:]])
    rows = per_minute(samples)
    with open(args.minutes, "w", encoding="utf-8", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
