"""Samples the running pipeline every few seconds while an experiment's load
runs: the outbox backlog (pending rows, age of the oldest, from SQL) and the
relay's commit->publish and payments' commit->effect histograms (from their
GET /metrics). Writes one CSV row per sample, and per minute (`--minutes`)
the backlog's worst and the two latencies' p50/p99 over that minute, from
the histograms' bucket deltas (as Prometheus' histogram_quantile does).

Usage: python3 experiments/lib/sampler.py --database-url URL --relay HOST:PORT
       --payments HOST:PORT --duration SECONDS --out samples.csv --minutes minutes.csv
       [--interval 5]

Standard library only (psql for the SQL). It starts counting when both
services answer /metrics, and stops after --duration seconds or on SIGTERM,
writing what it has.
"""
import argparse
import csv
import math
import signal
import subprocess
import sys
import time
import urllib.request

HISTOGRAMS = {"publish": "relay_commit_to_publish_seconds", "effect": "payments_commit_to_effect_seconds"}
BACKLOG_SQL = ("SELECT count(*), COALESCE(extract(epoch FROM now() - min(created_at)), 0) "
               "FROM orders.outbox WHERE published_at IS NULL AND failed_at IS NULL")


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


def backlog(url):
    """(pending rows, age of the oldest in seconds), or (None, None)."""
    try:
        out = subprocess.run(["psql", url, "-qAt", "-F", ",", "-c", BACKLOG_SQL], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        n, age = out.split(",")
        return int(n), float(age)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, None


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
    ap.add_argument("--payments", required=True, help="HOST:PORT of payments' /metrics")
    ap.add_argument("--duration", type=float, required=True, help="seconds to sample once both answer")
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
                scrape(args.payments, HISTOGRAMS["effect"]) is not None:
            break
        time.sleep(0.2)
    else:
        print("sampler: the relay's and payments' /metrics never answered", file=sys.stderr)
    t0 = time.monotonic()
    samples = []
    while not stop and time.monotonic() - t0 <= args.duration:
        t = time.monotonic() - t0
        pending, oldest = backlog(args.database_url)
        samples.append({"t": t, "pending": pending, "oldest_s": oldest,
                        "publish": scrape(args.relay, HISTOGRAMS["publish"]),
                        "effect": scrape(args.payments, HISTOGRAMS["effect"])})
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0 - t)))
    with open(args.out, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "pending_rows", "oldest_pending_s", "published", "effects"])
        for s in samples:
            w.writerow([round(s["t"], 1), s["pending"], s["oldest_s"],
                        (s["publish"] or {}).get(math.inf, ""), (s["effect"] or {}).get(math.inf, "")])
    rows = per_minute(samples)
    with open(args.minutes, "w", encoding="utf-8", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
