"""make bench-pipeline's summary: reads the measurements the script recorded
(one JSON object a line), writes bench/results/pipeline-RUN.json and prints
it, ending with the two ratio lines. A partial run (stopped early) gives
None for what it did not measure.

    python3 scripts/lib/bench_pipeline.py RAW.jsonl RESULT.json
"""

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "experiments", "lib"))
import sampler  # noqa: E402  (the experiments' CPU accounting)

from cpu import COUNTERS  # noqa: E402  (the statements' counters, as cpu.py keeps them)


def rate(n, seconds):
    return round(n / seconds) if seconds > 0 else None


def ratio(a, b):
    return round(a / b, 2) if a and b else None


def cpu_us_per_order(steady):
    """A steady point's CPU-microseconds per new order: each process group's and each PostgreSQL
    role's cores over the point's rate of new orders a second (its `rate`); and, as cores, the
    machine's busy share and the brokers' JIT's (when the point has it)."""
    cpu, per_s = steady.get("cpu") or {}, steady.get("rate")
    if not per_s:
        return {}
    cores = cpu.get("cores") or {}
    pipeline = sum(cores.get(name, 0.0) for name in PIPELINE)
    out = {"processes": sampler.cpu_us_per(cores, per_s),
           "postgres_by_role": sampler.cpu_us_per(cpu.get("postgres_cores_by_role") or {}, per_s),
           "pipeline": round(pipeline * 1e6 / per_s),
           "machine_busy": cpu.get("machine_busy")}
    if "kafka_jit_cores" in cpu:  # the brokers still compiling: a point not warm
        out["kafka_jit_cores"] = cpu["kafka_jit_cores"]
    return out


def statements_per_order(steady):
    """A steady point's statements per new order, per PostgreSQL role and in all: how many, their
    rows, their execution time (µs, wall) and the WAL they wrote (records, bytes); from cpu.py's
    `statements_by_role`. Empty when the point has none (no pg_stat_statements)."""
    cpu, per_s = steady.get("cpu") or {}, steady.get("rate")
    by_role = cpu.get("statements_by_role")
    if not per_s or not by_role:
        return {}

    def per_order(d):
        return {"statements": round(d["calls"] / per_s, 2), "rows": round(d["rows"] / per_s, 2),
                "exec_us": round(d["exec_ms"] * 1e3 / per_s), "wal_records": round(d["wal_records"] / per_s, 1),
                "wal_bytes": round(d["wal_bytes"] / per_s)}

    total = {c: sum(d[c] for d in by_role.values()) for c in COUNTERS}
    return {"by_role": {role: per_order(d) for role, d in by_role.items()}, "all": per_order(total)}


# The pipeline's own processes: what its CPU per order counts (the broker and
# loadgen are left out; PostgreSQL is in, all of its roles).
PIPELINE = ("orders", "relay", "payments", "postgres")


def summarize(records):
    by = {}
    for r in records:
        by.setdefault(r["what"], []).append(r)
    out = {"command": "make bench-pipeline"}
    out["extra_partitions"] = next((r["partitions"] for r in by.get("extra_partitions", [])), 0)
    # Each build's drains (several with BENCH_DRAIN_ROUNDS, in alternating
    # order): the median rate, and every rate in the order run.
    drains = {}
    for d in by.get("relay_drain", []):
        drains.setdefault(d["build"], []).append(rate(d["rows"], d["seconds"]))
    raw_p = by.get("raw_producer", [{}])[0].get("result", {})
    out["rows"] = next((d["rows"] for d in by.get("relay_drain", [])), None)
    out["relay_rows_per_sec"] = statistics.median(drains["new"]) if "new" in drains else None
    out["relay_drains_rows_per_sec"] = drains
    if "base" in drains:
        out["base_relay_rows_per_sec"] = statistics.median(drains["base"])
        out["relay_vs_base"] = ratio(out["relay_rows_per_sec"], out["base_relay_rows_per_sec"])
    out["raw_producer"] = raw_p
    out["raw_producer_msgs_per_sec"] = raw_p.get("msgs_per_sec")
    out["relay_vs_raw_producer"] = ratio(out["relay_rows_per_sec"], raw_p.get("msgs_per_sec"))

    passes = {c["pass"]: c for c in by.get("consume", [])}
    clocks = {c["pass"]: c for c in by.get("charge_clock", [])}
    raw_c = by.get("raw_consumer", [{}])[0].get("result", {})
    for name, p in passes.items():
        out[f"consumer_{name}_msgs_per_sec"] = rate(p["messages"], p["seconds"])
    for name, c in clocks.items():
        out[f"consumer_{name}_charges_per_sec_sql"] = rate(c["charges"], c["seconds"])
        out[f"consumer_{name}_charges_per_sec_by_tenth"] = [
            rate(t["n"], t["seconds"]) for t in c["tenths"] or []
        ]
    out["raw_consumer"] = raw_c
    out["raw_consumer_msgs_per_sec"] = raw_c.get("msgs_per_sec")
    out["consumer_vs_raw_consumer"] = ratio(out.get("consumer_new_msgs_per_sec"), raw_c.get("msgs_per_sec"))
    min_c = by.get("minimal_consumer", [{}])[0].get("result", {})
    out["minimal_consumer"] = min_c
    out["minimal_consumer_msgs_per_sec"] = min_c.get("msgs_per_sec")
    out["consumer_vs_minimal_consumer"] = ratio(out.get("consumer_new_msgs_per_sec"), min_c.get("msgs_per_sec"))
    out["duplicates_vs_new"] = ratio(out.get("consumer_dup_msgs_per_sec"), out.get("consumer_new_msgs_per_sec"))
    out["steady"] = by.get("steady", [])
    for point in out["steady"]:
        point["cpu_us_per_order"] = cpu_us_per_order(point)
        point["statements_per_order"] = statements_per_order(point)
    return out


def main(argv):
    raw, result = argv[1], argv[2]
    with open(raw) as f:
        records = [json.loads(line) for line in f if line.strip()]
    out = summarize(records)
    with open(result, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(json.dumps(out, indent=2))
    for point in out["steady"]:
        per = point["cpu_us_per_order"]
        if per:
            print(f"CPU-microseconds per new order at {point['rate']}/s ({point.get('build', 'new')} build"
                  f"{'' if point.get('env', '-') == '-' else ', ' + point['env']}): "
                  f"pipeline {per['pipeline']} (orders, relay, payments, PostgreSQL; machine busy {per['machine_busy']}"
                  f"{'' if 'kafka_jit_cores' not in per else ', brokers JIT ' + str(per['kafka_jit_cores']) + ' cores'}); "
                  + ", ".join(f"{k} {v}" for k, v in per["processes"].items())
                  + "; PostgreSQL by role: " + ", ".join(f"{k} {v}" for k, v in per["postgres_by_role"].items()))
        stmts = point.get("statements_per_order")
        if stmts:
            print(f"  statements per new order: {stmts['all']['statements']} (µs of wall time {stmts['all']['exec_us']}, "
                  f"WAL bytes {stmts['all']['wal_bytes']}); by role: "
                  + ", ".join(f"{k} {v['statements']} ({v['exec_us']} µs, {v['wal_bytes']} B WAL)"
                              for k, v in stmts["by_role"].items()))
    print(f"written {result}")
    print(f"relay ratio: {out['relay_vs_raw_producer']}")
    print(f"consumer ratio: {out['consumer_vs_raw_consumer']}")
    print(f"consumer vs minimal writes: {out['consumer_vs_minimal_consumer']}")


if __name__ == "__main__":
    main(sys.argv)
