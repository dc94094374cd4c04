"""Where the CPU goes, from /proc: the benchmarks' per-process accounting.

    python3 scripts/lib/cpu.py snap [DATABASE_URL] > A.json
    ... the work ...
    python3 scripts/lib/cpu.py snap [DATABASE_URL] > B.json
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
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "experiments", "lib"))
import sampler  # noqa: E402  (the experiments' /proc reading)

TICK = os.sysconf("SC_CLK_TCK")


def pg_roles(url):
    """pid → the role (or backend type) of each PostgreSQL server process."""
    out = subprocess.run(
        ["psql", url, "-Atc", "SELECT pid, coalesce(usename, backend_type) FROM pg_stat_activity"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def name(comm):
    """The group a process counts in: its command name, every kernel worker
    in one (a kworker's name changes with the work it is doing)."""
    return "kworker" if comm.startswith("kworker/") else sampler.COMM_GROUPS.get(comm, comm)


def snap(url=None):
    """Every process but this one (its name, CPU seconds, and a PostgreSQL
    server process's role), and the machine's busy and total seconds."""
    roles = pg_roles(url) if url else {}
    me = str(os.getpid())
    procs = {}
    for pid, comm, ticks in sampler.process_ticks():
        if pid == me:
            continue
        procs[pid] = {"name": name(comm), "seconds": ticks / TICK}
        if comm == "postgres":
            procs[pid]["role"] = roles.get(pid, "other")
    m = sampler.machine_ticks()
    return {"processes": procs, "machine": {"busy": m.get("busy", 0) / TICK, "total": m.get("total", 0) / TICK}}


def diff(a, b, seconds):
    """Per process alive at B: its seconds since A (all of them if it started
    after A), summed per name and per PostgreSQL role."""

    def cores(x):
        return round(x / seconds, 3)

    by_name, roles = {}, {}
    for pid, p in b["processes"].items():
        spent = p["seconds"] - a["processes"].get(pid, {}).get("seconds", 0.0)
        by_name[p["name"]] = by_name.get(p["name"], 0.0) + spent
        if "role" in p:
            roles[p["role"]] = roles.get(p["role"], 0.0) + spent
    comm = {k: cores(v) for k, v in by_name.items()}
    total = b["machine"]["total"] - a["machine"]["total"]
    busy = b["machine"]["busy"] - a["machine"]["busy"]

    def top(d):
        return {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.005}

    return {
        "seconds": seconds,
        "machine_busy": round(busy / total, 3) if total > 0 else None,
        "cores": top(comm),
        "postgres_cores_by_role": top({k: cores(v) for k, v in roles.items()}),
    }


def main(argv):
    if len(argv) >= 2 and argv[1] == "snap":
        json.dump(snap(argv[2] if len(argv) > 2 else None), sys.stdout)
    elif len(argv) == 5 and argv[1] == "diff":
        with open(argv[2]) as fa, open(argv[3]) as fb:
            print(json.dumps(diff(json.load(fa), json.load(fb), float(argv[4]))))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
