"""Experiment 6's verdict: outbox lag under steady load and bursts. For each
relay configuration (RES/w<workers>-b<batch>/): its drain rate from a backlog
(drain.json), the schedule's phases (phases.csv: steady S, burst 2×S,
recovery, burst 3×S, recovery), the sampler's one-second samples
(samples.csv: unpublished rows, the oldest one's age, CPU per process), the
rows written and published per second (seconds.csv), commit→publish per
phase (latency.csv) and the totals after the relay caught up (totals.json).

Writes RES/summary.json, RES/phases.csv (one row per configuration and
phase), RES/timeline.csv and RES/rates.csv (the plots' series), prints the
table, the checks and the verdict line; exit 0 on PASS.

A phase is *flat* when the backlog grew by less than FLAT_SHARE of the
phase's write rate (the least-squares slope of the unpublished rows over the
phase's samples): the relay published at least 90% of what was written.

Usage: python3 experiments/lib/exp6.py RES MODE (run.sh passes them; run it
alone to judge results again). run.sh's helpers: `--phase-sql PHASES.csv`
prints the query for latency.csv; `--cpu-ticks` prints the CPU clock ticks
of each process group so far (taken before and after the capacity drain).
"""
import json
import os
import sys

from common import exit_code, load_json, number, print_checks, read_csv, verdict, write_csv, write_json
from sampler import cpu_ticks

FLAT_SHARE = 0.10
# The least share of the schedule's rows the writers must deliver for a run
# to count as loaded. Quick mode (CI: a debug build beside three Kafka JVMs on
# 2 cores) takes 80%: pgbench wrote 89.5% of a quick schedule there (87% in its
# steady and 3×S phases) while
# the poll relay's 8 workers took their share of the CPU, every row
# published and every SLO check passing.
WRITTEN_SHARE = {"full": 0.90, "quick": 0.80}
SLO_S = 2.0  # the lab's commit→effect SLO; the oldest unpublished row should stay under it


def phase_bounds(phases):
    """[(name, multiple, start, end)] from phases.csv rows: a phase ends where
    the next one starts, the last after its own seconds."""
    out = []
    for i, p in enumerate(phases):
        start = float(p["start_unix"])
        end = float(phases[i + 1]["start_unix"]) if i + 1 < len(phases) else start + float(p["seconds"])
        out.append((p["phase"], float(p["multiple"]), start, end))
    return out


def phase_sql(phases):
    """The query of commit→publish per phase (rows by their commit time)."""
    values = ", ".join(f"('{name}', {start:.3f}, {end:.3f})" for name, _, start, end in phase_bounds(phases))
    return f"""COPY (
  WITH ph(phase, t0, t1) AS (VALUES {values}),
       r AS (SELECT ph.phase, EXTRACT(EPOCH FROM o.published_at - o.created_at) * 1000 AS ms
             FROM orders.outbox o JOIN ph ON EXTRACT(EPOCH FROM o.created_at) >= ph.t0
                                        AND EXTRACT(EPOCH FROM o.created_at) < ph.t1
             WHERE o.published_at IS NOT NULL)
  SELECT phase, count(*) AS rows,
         round((percentile_cont(0.5) WITHIN GROUP (ORDER BY ms))::numeric, 1) AS p50_ms,
         round((percentile_cont(0.99) WITHIN GROUP (ORDER BY ms))::numeric, 1) AS p99_ms,
         round(max(ms)::numeric, 1) AS max_ms
  FROM r GROUP BY phase) TO STDOUT WITH CSV HEADER"""


def slope(points):
    """The least-squares slope of [(t, y)], or None for fewer than two distinct t."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (y - my) for t, y in points) / var


def mean(values):
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def samples_of(rows):
    """The sampler's rows with the numbers this verdict reads."""
    out = []
    for r in rows:
        s = {k: number(r.get(k)) for k in ("unix_s", "pending_rows", "oldest_pending_s", "cpu_relay",
                                            "cpu_postgres", "cpu_kafka", "cpu_pgbench")}
        if s["unix_s"] is not None:
            out.append(s)
    return out


def phase_rows(config, bounds, samples, seconds, latency, steady_rate):
    """One row per phase of one configuration."""
    lat = {r["phase"]: r for r in latency}
    rows = []
    for name, multiple, start, end in bounds:
        inside = [s for s in samples if start <= s["unix_s"] < end and s["pending_rows"] is not None]
        # Whole seconds inside the phase (the first and last are partial).
        secs = [r for r in seconds if start <= number(r["second"]) and number(r["second"]) + 1 <= end]
        n = len(secs)
        written = sum(number(r["written"]) or 0 for r in secs) / n if n else None
        published = sum(number(r["published"]) or 0 for r in secs) / n if n else None
        growth = slope([(s["unix_s"], s["pending_rows"]) for s in inside])
        target = multiple * steady_rate
        last = inside[-1] if inside else {}
        row = {"config": config, "phase": name, "seconds": round(end - start, 3), "target_rows_per_s": round(target),
               "written_per_s": None if written is None else round(written),
               "published_per_s": None if published is None else round(published),
               "pending_max": max((s["pending_rows"] for s in inside), default=None),
               "pending_end": last.get("pending_rows"),
               "growth_rows_per_s": None if growth is None else round(growth, 1),
               "flat": growth is not None and growth <= FLAT_SHARE * target,
               "oldest_max_s": max((s["oldest_pending_s"] or 0 for s in inside), default=None),
               "oldest_end_s": last.get("oldest_pending_s"),
               "p50_ms": number((lat.get(name) or {}).get("p50_ms")),
               "p99_ms": number((lat.get(name) or {}).get("p99_ms")),
               "max_ms": number((lat.get(name) or {}).get("max_ms"))}
        for proc in ("relay", "postgres", "kafka", "pgbench"):
            row[f"cpu_{proc}"] = mean([s[f"cpu_{proc}"] for s in inside])
        rows.append(row)
    return rows


def config_name(tag):
    """A configuration's name from run.sh's [MODE:]WORKERS:BATCH: 8:1000 →
    w8-b1000 (the poll relay), wal:8:1000 → wal-w8-b1000."""
    parts = tag.split(":")
    mode = parts[0] if len(parts) == 3 else "poll"
    workers, batch = parts[-2], parts[-1]
    return f"w{workers}-b{batch}" if mode == "poll" else f"{mode}-w{workers}-b{batch}"


def relay_mode(config):
    """poll or wal, from a configuration's name."""
    return "wal" if config.startswith("wal-") else "poll"


def config_summary(config, drain, totals, phases):
    """One configuration's line: its capacity, what it kept flat, whether it lost anything."""
    flat = [p["target_rows_per_s"] for p in phases if p["flat"]]
    grew = [p["target_rows_per_s"] for p in phases if not p["flat"]]
    drain_rate = round(drain["rows"] / drain["seconds"]) if drain and drain.get("seconds") else None
    return {"config": config, "mode": relay_mode(config),
            "workers": (totals or {}).get("workers"), "batch": (totals or {}).get("batch"),
            "drain_rows_per_s": drain_rate, **drain_cpu(drain), "flat_up_to_rows_per_s": max(flat, default=None),
            "grew_at_rows_per_s": min(grew, default=None),
            "written": (totals or {}).get("written"), "published": (totals or {}).get("published"),
            "pending": (totals or {}).get("pending"), "failed": (totals or {}).get("failed"),
            "caught_up_s": (totals or {}).get("caught_up_s"),
            "steady_p99_ms": next((p["p99_ms"] for p in phases if p["phase"] == "steady"), None),
            "oldest_max_s": max((p["oldest_max_s"] or 0 for p in phases), default=None)}


def judge(configs, phases, meta, mode):
    """The summary: every configuration lost nothing and was offered its
    schedule (each phase's achieved rate is reported: on 2 cores the
    writers and the relay share the CPU); the first (whose capacity set S) kept the steady phase flat and
    under the SLO, and was back under the SLO by the end of each recovery."""
    checks = {}
    rate = meta.get("steady_rate") or 0
    for c in configs:
        name = c["config"]
        checks[f"{name}: every row written was published, none failed"] = (
            c["written"] is not None and c["written"] > 0 and c["published"] == c["written"]
            and c["pending"] == 0 and c["failed"] == 0)
        # Over the whole schedule, not one phase: a quick run's steady phase
        # is 5 whole seconds, about 420 of pgbench's Poisson-timed
        # transactions (σ ≈ 5%), and its 8 clients connect inside it.
        scheduled = sum(p["target_rows_per_s"] * p["seconds"] for p in phases if p["config"] == name)
        share = WRITTEN_SHARE.get(mode, WRITTEN_SHARE["full"])
        checks[f"{name}: the writers delivered ≥ {share:.0%} of the schedule's rows"] = (
            scheduled > 0 and c["written"] is not None and c["written"] >= share * scheduled)
    # The first configuration of each relay mode is held to the SLO.
    firsts = []
    for c in configs:
        if c["mode"] not in (relay_mode(f) for f in firsts):
            firsts.append(c["config"])
    for first in firsts:
        mine = {p["phase"]: p for p in phases if p["config"] == first}
        steady = mine.get("steady")
        checks[f"{first}: steady S = {rate} rows/s kept the backlog flat, oldest row under {SLO_S:g} s"] = (
            steady is not None and steady["flat"] and steady["oldest_max_s"] is not None
            and steady["oldest_max_s"] < SLO_S)
        for rec in ("recover-1", "recover-2"):
            p = mine.get(rec)
            checks[f"{first}: bounded burst: by the end of {rec} the oldest row is under {SLO_S:g} s again"] = (
                p is not None and p["oldest_end_s"] is not None and p["oldest_end_s"] < SLO_S)
    if not configs:
        checks["a configuration ran"] = False
    return {"experiment": "exp-6-outbox-lag", "mode": mode, "steady_rate": rate,
            "steady_share": meta.get("steady_share"), "flat_share": FLAT_SHARE, "configs": configs,
            "phases": phases, "checks": checks, "verdict": verdict(checks)}


def series(config, bounds, samples, seconds):
    """The plots' rows, in seconds from the schedule's start: the samples
    (timeline) and the per-second written/published counts (rates)."""
    if not bounds:
        return [], []
    t0 = bounds[0][2]
    timeline = [{"config": config, "t_s": round(s["unix_s"] - t0, 1), "pending_rows": s["pending_rows"],
                 "oldest_pending_s": s["oldest_pending_s"], "cpu_relay": s["cpu_relay"]}
                for s in samples if s["unix_s"] >= t0 - 1]
    rates = [{"config": config, "t_s": number(r["second"]) - int(t0), "written": r["written"],
              "published": r["published"]} for r in seconds if number(r["second"]) >= int(t0) - 1]
    return timeline, rates


def table(s):
    cols = [("config", 13), ("phase", 10), ("target_rows_per_s", 8), ("written_per_s", 8),
            ("published_per_s", 9), ("pending_max", 8), ("growth_rows_per_s", 8), ("flat", 5),
            ("oldest_max_s", 8), ("p50_ms", 8), ("p99_ms", 8), ("cpu_relay", 6), ("cpu_postgres", 6),
            ("cpu_kafka", 6)]
    heads = {"target_rows_per_s": "target", "written_per_s": "written", "published_per_s": "published",
             "pending_max": "backlog", "growth_rows_per_s": "growth", "oldest_max_s": "oldest s",
             "cpu_relay": "relay", "cpu_postgres": "pg", "cpu_kafka": "broker"}
    lines = ["  ".join(f"{heads.get(c, c):>{w}}" for c, w in cols)]
    for p in s["phases"]:
        lines.append("  ".join(f"{str(p.get(c)):>{w}}" for c, w in cols))
    lines.append("")
    for c in s["configs"]:
        lines.append(f"{c['config']}: drains {c['drain_rows_per_s']} rows/s (cores: relay "
                     f"{c.get('drain_cpu_relay')}, postgres {c.get('drain_cpu_postgres')}, broker "
                     f"{c.get('drain_cpu_kafka')}); flat up to "
                     f"{c['flat_up_to_rows_per_s']} rows/s, grew at {c['grew_at_rows_per_s']}; "
                     f"caught up {c['caught_up_s']} s after the schedule")
    return "\n".join(lines)


def drain_cpu(drain):
    """Cores per process group over the capacity drain, from the /proc
    snapshots run.sh took before and after it ({} without them)."""
    before, after = (drain or {}).get("cpu_before"), (drain or {}).get("cpu_after")
    if not before or not after or not drain.get("seconds"):
        return {}
    hz = after.get("hz") or 100
    return {f"drain_cpu_{k}": round(max(0, after["ticks"].get(k, 0) - before["ticks"].get(k, 0)) / hz / drain["seconds"], 2)
            for k in ("relay", "postgres", "kafka")}


def main(argv):
    if argv and argv[0] == "--phase-sql":
        print(phase_sql(read_csv(argv[1])))
        return 0
    if argv and argv[0] == "--config-name":  # run.sh's directory for a configuration
        print(config_name(argv[1]))
        return 0
    if argv and argv[0] == "--cpu-ticks":  # run.sh's snapshot around the drain
        print(json.dumps({"hz": os.sysconf("SC_CLK_TCK"), "ticks": cpu_ticks()[0]}))
        return 0
    res, mode = argv[0], argv[1]
    meta = load_json(os.path.join(res, "meta.json"), {})
    rate = meta.get("steady_rate") or 0
    configs, phases, timeline, rates = [], [], [], []
    for tag in (meta.get("configs") or "").split():
        name = config_name(tag)
        d = os.path.join(res, name)
        try:
            bounds = phase_bounds(read_csv(os.path.join(d, "phases.csv")))
            samples = samples_of(read_csv(os.path.join(d, "samples.csv")))
            seconds = read_csv(os.path.join(d, "seconds.csv"))
            latency = read_csv(os.path.join(d, "latency.csv"))
        except (OSError, KeyError, ValueError) as e:
            print(f"exp-6: {name} has no complete results ({e}); see {d}/")
            configs.append(config_summary(name, None, None, []))
            continue
        mine = phase_rows(name, bounds, samples, seconds, latency, rate)
        phases += mine
        configs.append(config_summary(name, load_json(os.path.join(d, "drain.json")),
                                      load_json(os.path.join(d, "totals.json")), mine))
        t, r = series(name, bounds, samples, seconds)
        timeline += t
        rates += r
    s = judge(configs, phases, meta, mode)
    write_json(os.path.join(res, "summary.json"), s)
    write_csv(os.path.join(res, "phases.csv"), phases)
    write_csv(os.path.join(res, "timeline.csv"), timeline)
    write_csv(os.path.join(res, "rates.csv"), rates)
    print(table(s))
    print_checks(s["checks"])
    first = configs[0] if configs else {}
    print(f"exp-6: {s['verdict']} — S = {rate} rows/s; {first.get('config')} drains "
          f"{first.get('drain_rows_per_s')} rows/s, flat up to {first.get('flat_up_to_rows_per_s')}, "
          f"oldest row max {first.get('oldest_max_s')} s ({mode}; {res}/summary.json)")
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
