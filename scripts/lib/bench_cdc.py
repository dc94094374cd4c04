"""make bench-cdc's measurements and summary (scripts/bench-cdc.sh).

    python3 bench_cdc.py sample PID DATABASE_URL SLOT
        every second until killed, one JSON line: the time, process PID's
        resident memory (kB) and the replication slot SLOT's confirmed lag
        (bytes of WAL the server keeps for it; SLOT "" for none)
    python3 bench_cdc.py judge DATABASE_URL RECEIPTS P0 P1 RATE SECONDS
        one point's figures, as one JSON object: the orders committed from P0
        to P1 (Unix seconds) against their first receipt in RECEIPTS
        (payments/examples/receipts.rs's lines), commit→consume p50/p99/max,
        and whether RATE rows/s was sustained (`sustained`, `why`)
    python3 bench_cdc.py drain DATABASE_URL RECEIPTS STARTED
        the backlog's figures: the orders committed before STARTED, the
        time from the first of them received to the last
    python3 bench_cdc.py summary LOGS RESULT_DIR
        LOGS/raw.jsonl and each relay's samples into RESULT_DIR/summary.json
        and table.md; prints the table and the WAL relay's ratios to Debezium
    python3 bench_cdc.py plot RESULT_DIR
        RESULT_DIR/latency.png and cpu.png (needs matplotlib: the tools venv)
"""

import json
import os
import statistics
import sys
import time

import cpu  # noqa: E402  (its psql query, as the benchmarks run it)

# A point is sustained when pgbench committed at least this share of its rate...
ACHIEVED = 0.95
# ...and the median latency of its last 10 s is within this of its first 10 s's (after 5 s).
FLAT_S = 1.0


def psql_rows(url, sql):
    """SQL's rows (lists of fields) from psql, as cpu.py queries; raises on failure."""
    rows = cpu.query(url, sql)
    if rows is None:
        raise RuntimeError(f"psql failed: {sql}")
    return [r for r in rows if r != [""]]


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def sample(pid, url, slot):
    lag_sql = ("SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, -1) "
               f"FROM pg_replication_slots WHERE slot_name = '{slot}'")
    while True:
        t = time.time()
        lag = None
        if slot:
            try:
                rows = psql_rows(url, lag_sql)
                lag = int(rows[0][0]) if rows and int(rows[0][0]) >= 0 else None
            except (RuntimeError, ValueError, IndexError):
                lag = None
        print(json.dumps({"t": round(t, 3), "rss_kb": rss_kb(pid), "slot_lag_bytes": lag}), flush=True)
        time.sleep(max(0.0, 1.0 - (time.time() - t)))


def first_receipts(path, since_us):
    """key → the first receipt's Unix microseconds, of the lines at or after SINCE_US."""
    first = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3:
                continue
            try:
                us = int(parts[2])
            except ValueError:
                continue
            if us < since_us:
                continue
            key = parts[0]
            if key not in first or us < first[key]:
                first[key] = us
    return first


def commits(url, where):
    """(order id, commit Unix seconds) of the orders WHERE selects."""
    rows = psql_rows(url, "SELECT order_id, extract(epoch FROM pg_xact_commit_timestamp(xmin)) "
                          f"FROM orders.orders WHERE {where}")
    return [(r[0], float(r[1])) for r in rows if len(r) == 2 and r[1]]


def quantile(sorted_xs, q):
    if not sorted_xs:
        return None
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def latencies(events, first):
    """(commit, latency ms) of EVENTS received, and how many were not."""
    got, missing = [], 0
    for key, committed in events:
        us = first.get(key)
        if us is None:
            missing += 1
        else:
            got.append((committed, us / 1000.0 - committed * 1000.0))
    return got, missing


def judge(url, receipts, p0, p1, rate, seconds):
    p0, p1 = float(p0), float(p1)
    events = commits(url, f"created_at >= to_timestamp({p0}) - interval '1 second'")
    print(json.dumps(point(events, first_receipts(receipts, int(p0 * 1e6)), p0, p1, int(rate), int(seconds))))


def point(events, first, p0, p1, rate, seconds):
    """A point's figures from EVENTS (order id, commit time) and FIRST (order id → first
    receipt, µs): the events committed from P0 to P1 (and 1 s after: pgbench's last
    transactions), their commit→consume quantiles, and the verdict on RATE."""
    events = [(k, c) for k, c in events if p0 <= c <= p1 + 1.0]
    got, missing = latencies(events, first)
    ms = sorted(m for _, m in got)

    def median_in(a, b):
        xs = [m for c, m in got if a <= c < b]
        return round(statistics.median(xs), 1) if xs else None

    early, late = median_in(p0 + 5, p0 + 15), median_in(p1 - 10, p1)
    achieved = len(events) / seconds
    out = {
        "events": len(events), "achieved_per_s": round(achieved), "missing": missing,
        "p50_ms": round(quantile(ms, 0.50), 1) if ms else None,
        "p99_ms": round(quantile(ms, 0.99), 1) if ms else None,
        "max_ms": round(ms[-1], 1) if ms else None,
        "early_p50_ms": early, "late_p50_ms": late,
    }
    why = []
    if achieved < ACHIEVED * rate:
        why.append(f"pgbench committed {achieved:.0f} rows/s of {rate}")
    if missing:
        why.append(f"{missing} rows not received")
    if early is None or late is None:
        why.append("too few rows to judge the backlog")
    elif late - early > FLAT_S * 1000:
        why.append(f"the backlog grew: median latency {early:.0f} ms → {late:.0f} ms")
    out["sustained"] = not why
    out["why"] = "; ".join(why) or "sustained"
    return out


def drain(url, receipts, started):
    events = commits(url, f"created_at < to_timestamp({float(started)})")
    first = first_receipts(receipts, 0)
    times = [first[k] for k, _ in events if k in first]
    out = {"events": len(events), "received": len(times)}
    if len(times) >= 2:
        span = (max(times) - min(times)) / 1e6
        out.update({"first_after_start_s": round(min(times) / 1e6 - float(started), 2),
                    "seconds": round(span, 3), "rows_per_s": round(len(times) / span) if span > 0 else None})
    print(json.dumps(out))


# --- summary ---------------------------------------------------------------------

PROCESS = {"poll": "relay", "wal": "relay", "debezium": "kafka-connect"}
ROLE, WALSENDER = "effectively_relay", "walsender:effectively_relay"


def cpu_ms_per_1000(cpu, relay, per_s):
    """A span's CPU milliseconds per 1,000 events (= µs per event): the relay's process, its
    PostgreSQL sessions, its walsender, the brokers, the machine (cores × 2 for 2 cores)."""
    if not per_s:
        return {}
    cores = cpu.get("cores") or {}
    roles = cpu.get("postgres_cores_by_role") or {}

    def per(c):
        return round(c * 1e6 / per_s, 1)

    out = {"relay_process": per(cores.get(PROCESS[relay], 0.0)),
           "postgres_sessions": per(roles.get(ROLE, 0.0)),
           "walsender": per(roles.get(WALSENDER, 0.0)),
           "kafka": per(cores.get("kafka", 0.0))}
    out["relay_total"] = round(out["relay_process"] + out["postgres_sessions"] + out["walsender"], 1)
    return out


def in_span(samples, a, b, field):
    return [s[field] for s in samples if a <= s["t"] <= b and s.get(field) is not None]


def summary(logs, result):
    raw = [json.loads(line) for line in open(os.path.join(logs, "raw.jsonl")) if line.strip()]
    relays = {}
    ladder_top = max((r["rate"] for r in raw if r["what"] == "point"), default=None)
    settings = {}
    for r in raw:
        if r["what"] == "settings":
            settings = r["env"]
            continue
        relay = relays.setdefault(r["relay"], {"relay": r["relay"], "points": []})
        if r["what"] == "drain":
            d = r.get("drain") or {}
            seconds = r["done"] - r["started"]
            relay["drain"] = dict(d, cpu_ms_per_1000=cpu_ms_per_1000(r["cpu"], r["relay"], r["rows"] / seconds))
        elif r["what"] == "point":
            lat = r.get("latency") or {}
            relay["points"].append(dict(
                {k: r[k] for k in ("rate", "seconds", "drained", "drain_wait_s")}, **lat,
                started=r["started"], ended=r["ended"], machine_busy=r["cpu"].get("machine_busy"),
                cpu_ms_per_1000=cpu_ms_per_1000(r["cpu"], r["relay"], lat.get("achieved_per_s"))))
    for name, relay in relays.items():
        path = os.path.join(logs, name, "samples.jsonl")
        samples = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        for p in relay["points"]:
            rss = in_span(samples, p["started"], p["ended"], "rss_kb")
            lag = sorted(in_span(samples, p["started"], p["ended"], "slot_lag_bytes"))
            p["rss_mib"] = round(max(rss) / 1024) if rss else None
            p["slot_lag_p50_kib"] = round(quantile(lag, 0.5) / 1024) if lag else None
            p["slot_lag_max_kib"] = round(lag[-1] / 1024) if lag else None
            del p["started"], p["ended"]
        sustained = [p["rate"] for p in relay["points"] if p.get("sustained")]
        relay["highest_sustained_rate"] = max(sustained) if sustained else None
        # Its ladder's last rate sustained: it might carry more (a lower bound).
        relay["ladder_top_sustained"] = bool(relay["points"]) and bool(relay["points"][-1].get("sustained")) \
            and relay["points"][-1]["rate"] == ladder_top
        rss = [s["rss_kb"] for s in samples if s.get("rss_kb") is not None]
        relay["rss_max_mib"] = round(max(rss) / 1024) if rss else None
    out = {"settings": settings, "relays": list(relays.values()), "vs_debezium": ratios(relays)}
    os.makedirs(result, exist_ok=True)
    with open(os.path.join(result, "summary.json"), "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    text = table(out)
    if settings:
        text = "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "\n\n" + text
    with open(os.path.join(result, "table.md"), "w") as f:
        f.write(text)
    print(text)
    for line in headline(out["vs_debezium"]):
        print(line)


def point_at(relay, rate):
    return next((p for p in relay["points"] if p["rate"] == rate), None)


def ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def ratios(relays):
    """Each of our relays against Debezium: sustained rate, and at the highest rate both
    sustained, CPU per event (the relay's process, sessions and walsender) and p99."""
    dbz = relays.get("debezium")
    if not dbz:
        return {}
    out = {}
    for name in ("wal", "poll"):
        ours = relays.get(name)
        if not ours:
            continue
        both = [p["rate"] for p in ours["points"] if p.get("sustained")
                and (point_at(dbz, p["rate"]) or {}).get("sustained")]
        r = {"highest_sustained_rate": ratio(ours["highest_sustained_rate"], dbz["highest_sustained_rate"]),
             "at_least": bool(ours.get("ladder_top_sustained"))}
        if both:
            at = max(both)
            a, b = point_at(ours, at), point_at(dbz, at)
            r.update({"at_rate": at,
                      "cpu_per_event": ratio(a["cpu_ms_per_1000"].get("relay_total"),
                                             b["cpu_ms_per_1000"].get("relay_total")),
                      "p99": ratio(a.get("p99_ms"), b.get("p99_ms"))})
        out[name] = r
    return out


def table(out):
    lines = ["| relay | backlog drain rows/s | highest sustained rate (rows/s) | peak RSS MiB |",
             "| --- | --- | --- | --- |"]
    for r in out["relays"]:
        d = r.get("drain") or {}
        top = ("≥ " if r.get("ladder_top_sustained") else "") + str(r["highest_sustained_rate"])
        lines.append(f"| {r['relay']} | {d.get('rows_per_s')} | {top} (the top of the ladder) | {r['rss_max_mib']} |"
                     if r.get("ladder_top_sustained") else
                     f"| {r['relay']} | {d.get('rows_per_s')} | {top} | {r['rss_max_mib']} |")
    lines += ["", "| relay | rate | achieved | p50 ms | p99 ms | max ms | CPU ms/1000 events: process + sessions + walsender = total | brokers | slot lag p50/max KiB | verdict |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["relays"]:
        for p in r["points"]:
            c = p["cpu_ms_per_1000"]
            lag = f"{p['slot_lag_p50_kib']}/{p['slot_lag_max_kib']}" if p["slot_lag_max_kib"] is not None else "-"
            lines.append(f"| {r['relay']} | {p['rate']} | {p.get('achieved_per_s')} | {p.get('p50_ms')} | {p.get('p99_ms')} | "
                         f"{p.get('max_ms')} | {c.get('relay_process')} + {c.get('postgres_sessions')} + {c.get('walsender')} = "
                         f"{c.get('relay_total')} | {c.get('kafka')} | {lag} | {p.get('why', 'not drained')} |")
    return "\n".join(lines) + "\n"


def headline(vs):
    lines = []
    for name, r in vs.items():
        lines.append(f"{name} relay vs debezium: highest sustained rate {'at least ' if r.get('at_least') else ''}"
                     f"{r.get('highest_sustained_rate')}x"
                     + (f"; at {r['at_rate']} rows/s: CPU per event {r.get('cpu_per_event')}x, p99 {r.get('p99')}x"
                        if "at_rate" in r else "; no rate both sustained"))
    return lines


def plot(result):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(result, "summary.json")) as f:
        out = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in out["relays"]:
        pts = [p for p in r["points"] if p.get("p99_ms") is not None]
        line = ax.plot([p["rate"] for p in pts], [p["p99_ms"] for p in pts], marker="o", label=f"{r['relay']} p99")
        ax.plot([p["rate"] for p in pts], [p["p50_ms"] for p in pts], marker=".", linestyle="--",
                color=line[0].get_color(), label=f"{r['relay']} p50")
    ax.set_yscale("log")
    ax.set_xlabel("offered rows/s")
    ax.set_ylabel("commit → consume, ms")
    ax.set_title("make bench-cdc: commit → consume by relay")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(result, "latency.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in out["relays"]:
        pts = [p for p in r["points"] if p["cpu_ms_per_1000"]]
        ax.plot([p["rate"] for p in pts], [p["cpu_ms_per_1000"]["relay_total"] for p in pts], marker="o",
                label=f"{r['relay']}: process + sessions + walsender")
    ax.set_xlabel("offered rows/s")
    ax.set_ylabel("CPU ms per 1,000 events")
    ax.set_title("make bench-cdc: the relay's CPU per event")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(result, "cpu.png"), dpi=110)


def main(argv):
    if len(argv) == 5 and argv[1] == "sample":
        try:
            sample(*argv[2:])
        except KeyboardInterrupt:
            pass
    elif len(argv) == 8 and argv[1] == "judge":
        judge(*argv[2:])
    elif len(argv) == 5 and argv[1] == "drain":
        drain(*argv[2:])
    elif len(argv) == 4 and argv[1] == "summary":
        summary(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "plot":
        plot(argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
