"""Where the CPU goes, from /proc: the benchmarks' per-process accounting.

    python3 scripts/lib/cpu.py snap [DATABASE_URL [DATABASE]] > A.json
    ... the work ...
    python3 scripts/lib/cpu.py snap [DATABASE_URL [DATABASE]] > B.json
    python3 scripts/lib/cpu.py diff A.json B.json SECONDS

A snapshot holds each live process's user+system CPU seconds (not its
reaped children's) with its command name and, with a DATABASE_URL, for a
PostgreSQL server process the role of its session (the roles are per
service: effectively_orders, effectively_relay, ...; a background process
counts under its type). `diff` prints one JSON object: cores per
command name and per PostgreSQL role over SECONDS, the busiest first, and
the machine's busy fraction (from /proc/stat, as the experiments' sampler
counts it: neither idle, iowait nor steal). Take the second snapshot
while the processes measured are still alive: a process that exited between
the two is missing from the second.

With a DATABASE_URL on a server that preloads pg_stat_statements (the
stack's does) and has its view in that database (`scripts/stack.sh up`
creates it in the admin one), a snapshot also holds every statement's
counters, and `diff` adds what the statements did over the span, a second:
per role (`statements_by_role`: calls, rows, execution ms, WAL records and
bytes) and the statements that took the most time (`statements_top`). The
times are wall time: on a busy machine they include waiting for a CPU.

For a Kafka node (a JVM) a snapshot also holds its JIT compiler threads'
seconds, and `diff` gives them as `kafka_jit_cores` (a part of the kafka
cores): the brokers compile their hot paths for a minute or two after they
start and under a new load, and those cores are warm-up, not the load's
steady cost.

With a DATABASE (its name), the sessions and statements of the other
databases on the server do not count under their roles: their sessions
count as `other databases` and their statements not at all. So tests run
against the same server beside a benchmark do not add to its roles' figures
(their sessions use the same roles and statements).
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "experiments", "lib"))
import sampler  # noqa: E402  (the experiments' /proc reading)

TICK = os.sysconf("SC_CLK_TCK")


def query(url, sql):
    """One query's rows, each a list of its fields (psql unaligned, split at
    tabs); None when psql or the query failed."""
    out = subprocess.run(
        ["psql", url, "-AtF", "\t", "-v", "ON_ERROR_STOP=1", "-c", sql],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return [line.split("\t") for line in out.stdout.splitlines()]


def literal(text):
    """TEXT as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def pg_roles(url, database=None):
    """pid → the role (or backend type) of each PostgreSQL server process;
    a replication connection's is `walsender:ROLE` (a logical slot's decoding
    is its work, not its role's statements'); with DATABASE, a session in
    another database is `other databases`."""
    role = "CASE WHEN backend_type = 'walsender' THEN 'walsender:' || usename ELSE coalesce(usename, backend_type) END"
    if database is not None:
        role = f"CASE WHEN datname IS NULL OR datname = {literal(database)} THEN {role} ELSE 'other databases' END"
    rows = query(url, f"SELECT pid, {role} FROM pg_stat_activity") or []
    return {f[0]: f[1] for f in rows if len(f) == 2}


STATEMENTS = """SELECT r.rolname, s.dbid, s.queryid, s.calls, s.total_exec_time, s.rows, s.wal_records,
       s.wal_bytes, regexp_replace(left(s.query, 200), '\\s+', ' ', 'g')
FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid WHERE s.toplevel"""

# A statement's counters, as statements() keeps them.
COUNTERS = ("calls", "exec_ms", "rows", "wal_records", "wal_bytes")


def statements(url, database=None):
    """(role, database, query id) → the statement's counters and the head of
    its text (with DATABASE, only that database's statements); None when the
    server keeps no statistics (pg_stat_statements not preloaded, or its view
    missing)."""
    sql = STATEMENTS
    if database is not None:
        sql += f" AND s.dbid = (SELECT oid FROM pg_database WHERE datname = {literal(database)})"
    rows = query(url, sql)
    if rows is None:
        return None
    stmts = {}
    for f in rows:
        if len(f) != 9:
            continue
        try:
            stmts["|".join(f[0:3])] = {
                "role": f[0], "calls": int(f[3]), "exec_ms": float(f[4]), "rows": int(f[5]),
                "wal_records": int(f[6]), "wal_bytes": float(f[7]), "query": f[8],
            }
        except ValueError:
            continue
    return stmts


def statements_diff(a, b, seconds, top=8):
    """What the statements did between two snapshots of statements(), a
    second: summed per role, and the `top` that took the most time. A
    statement first seen in B counts whole; one whose calls went down (the
    statistics were reset, or its entry evicted and made again) is left out."""
    spans = []
    for key, s in b.items():
        before = a.get(key, {})
        delta = {c: s[c] - before.get(c, 0) for c in COUNTERS}
        if delta["calls"] <= 0:
            continue
        spans.append((s["role"], s["query"], delta))
    by_role = {}
    for role, _, d in spans:
        r = by_role.setdefault(role, dict.fromkeys(COUNTERS, 0))
        for c in COUNTERS:
            r[c] += d[c]

    def per_s(d):
        return {c: round(d[c] / seconds, 1) for c in COUNTERS}

    ranked = sorted(spans, key=lambda x: -x[2]["exec_ms"])[:top]
    return {
        "statements_by_role": {k: per_s(v) for k, v in sorted(by_role.items(), key=lambda kv: -kv[1]["exec_ms"])},
        "statements_top": [dict(role=role, query=q, **per_s(d)) for role, q, d in ranked],
    }


def name(comm, pid=None):
    """The group a process counts in: its command name, every kernel worker
    in one (a kworker's name changes with the work it is doing), a JVM
    running Kafka Connect (scripts/debezium.sh's worker) as `kafka-connect`
    apart from the brokers."""
    if comm == "java" and pid is not None and is_connect(pid):
        return "kafka-connect"
    return "kworker" if comm.startswith("kworker/") else sampler.COMM_GROUPS.get(comm, comm)


def is_connect(pid):
    """Whether process PID is a Kafka Connect worker (its main class)."""
    try:
        with open(os.path.join("/proc", pid, "cmdline"), "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"org.apache.kafka.connect.cli.Connect" in cmdline


def jit_ticks(pid):
    """The clock ticks of process PID's JIT compiler threads (a JVM's
    "C1 CompilerThread0", "C2 CompilerThre"...: comm keeps 15 characters)."""
    total = 0
    for _tid, comm, ticks in sampler.process_ticks(os.path.join("/proc", pid, "task")):
        if "CompilerThre" in comm:
            total += ticks
    return total


def snap(url=None, database=None):
    """Every process but this one (its name, CPU seconds, and a PostgreSQL
    server process's role), and the machine's busy and total seconds; with
    DATABASE, only that database's sessions and statements under their
    roles."""
    roles = pg_roles(url, database) if url else {}
    me = str(os.getpid())
    procs = {}
    for pid, comm, ticks in sampler.process_ticks():
        if pid == me:
            continue
        procs[pid] = {"name": name(comm, pid), "seconds": ticks / TICK}
        if procs[pid]["name"] == "kafka":
            procs[pid]["jit_seconds"] = jit_ticks(pid) / TICK
        if comm == "postgres":
            procs[pid]["role"] = roles.get(pid, "other")
    m = sampler.machine_ticks()
    out = {"processes": procs, "machine": {"busy": m.get("busy", 0) / TICK, "total": m.get("total", 0) / TICK}}
    if url:
        out["statements"] = statements(url, database)
    return out


def diff(a, b, seconds):
    """Per process alive at B: its seconds since A (all of them if it started
    after A), summed per name and per PostgreSQL role."""

    def cores(x):
        return round(x / seconds, 3)

    by_name, roles, jit = {}, {}, None
    for pid, p in b["processes"].items():
        before = a["processes"].get(pid, {})
        spent = p["seconds"] - before.get("seconds", 0.0)
        by_name[p["name"]] = by_name.get(p["name"], 0.0) + spent
        if "jit_seconds" in p:
            jit = (jit or 0.0) + p["jit_seconds"] - before.get("jit_seconds", 0.0)
        if "role" in p:
            roles[p["role"]] = roles.get(p["role"], 0.0) + spent
    comm = {k: cores(v) for k, v in by_name.items()}
    total = b["machine"]["total"] - a["machine"]["total"]
    busy = b["machine"]["busy"] - a["machine"]["busy"]

    def top(d):
        return {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.005}

    out = {
        "seconds": seconds,
        "machine_busy": round(busy / total, 3) if total > 0 else None,
        "cores": top(comm),
        "postgres_cores_by_role": top({k: cores(v) for k, v in roles.items()}),
    }
    if jit is not None:
        out["kafka_jit_cores"] = cores(jit)
    if a.get("statements") is not None and b.get("statements") is not None:
        out.update(statements_diff(a["statements"], b["statements"], seconds))
    return out


def main(argv):
    if 2 <= len(argv) <= 4 and argv[1] == "snap":
        json.dump(snap(*argv[2:]), sys.stdout)
    elif len(argv) == 5 and argv[1] == "diff":
        with open(argv[2]) as fa, open(argv[3]) as fb:
            print(json.dumps(diff(json.load(fa), json.load(fb), float(argv[4]))))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
