"""Lays the client's per-second latency beside what the sampler saw
(sampler.py), to find what goes with the seconds over the SLO: autovacuum
on a table, a checkpoint writing, the machine's CPU running out, the page
cache writing a burst of dirty data back. Also sums where the CPU went, per
process group.

This shows association, not cause: a condition whose seconds are over the
SLO far more often than the others' is a suspect to test by removing it.
"""
import os

import sampler
import writeback
from common import number, read_csv


def parse_samples(rows):
    """The sampler's CSV rows with numbers parsed (a sample covers the
    interval since the previous one; its vacuum/analyze columns are what ran
    at the sample)."""
    out = []
    for r in rows:
        s = {k: number(v) for k, v in r.items() if k not in ("vacuum", "analyze")}
        s["vacuum"] = [t for t in (r.get("vacuum") or "").split("+") if t]
        s["analyze"] = [t for t in (r.get("analyze") or "").split("+") if t]
        if s.get("unix_s") is not None:
            out.append(s)
    return out


def conditions(prev, cur, busy_share):
    """The conditions that held over the interval (PREV, CUR] of two samples."""
    found = set()
    for s in (prev, cur):
        for t in s["vacuum"]:
            found.update({"autovacuum (any table)", f"vacuum {t}"})
        for t in s["analyze"]:
            found.update({"autovacuum (any table)", f"analyze {t}"})
    if (cur.get("ckpt_buffers") or 0) > 0:
        found.add("checkpoint writing")
    if (cur.get("machine_busy") or 0) >= busy_share:
        found.add(f"machine CPU >= {busy_share:.0%} busy")
    if (cur.get("dirty_fall_mb") or 0) >= writeback.BURST_MB:
        found.add(f"writeback burst (dirty data -{writeback.BURST_MB} MB within 1 s)")
    return found


def analyse(seconds, started_unix_s, samples, slo_ms, from_s=60, busy_share=0.95):
    """For each condition: seconds under it and the share of them over SLO_MS,
    against the seconds without it. SECONDS are loadgen's per-second rows
    (second, p99_ms), second N covering [start + N, start + N + 1); only those
    from FROM_S on count (the first minute is start-up)."""
    samples = sorted(samples, key=lambda s: s["unix_s"])
    marked = []  # (over the SLO?, conditions)
    j = 1
    for r in seconds:
        sec, p99 = number(r.get("second")), number(r.get("p99_ms"))
        if sec is None or p99 is None or sec < from_s:
            continue
        mid = started_unix_s + sec + 0.5
        while j < len(samples) and samples[j]["unix_s"] < mid:
            j += 1
        if j >= len(samples):
            break
        marked.append((p99 >= slo_ms, conditions(samples[j - 1], samples[j], busy_share)))
    total, over = len(marked), sum(1 for o, _ in marked if o)
    rows = []
    for c in sorted({c for _, cs in marked for c in cs}):
        inside = [o for o, cs in marked if c in cs]
        outside = [o for o, cs in marked if c not in cs]
        rows.append({"condition": c, "seconds": len(inside),
                     "over_slo_share": round(sum(inside) / len(inside), 3) if inside else None,
                     "seconds_without": len(outside),
                     "over_slo_share_without": round(sum(outside) / len(outside), 3) if outside else None})
    rows.sort(key=lambda x: -(x["over_slo_share"] or 0))
    return {"from_s": from_s, "seconds": total, "seconds_over_slo": over,
            "over_slo_share": round(over / total, 3) if total else None, "conditions": rows}


def cpu(samples, started_unix_s, from_s=60):
    """Mean cores used per process group, and the machine's busy/iowait/steal
    shares, over the samples from FROM_S after the start."""
    use = [s for s in samples if s["unix_s"] >= started_unix_s + from_s]
    out = {}
    for k in sorted({k for s in use for k in s if k.startswith(("cpu_", "machine_"))}):
        vals = [s[k] for s in use if s.get(k) is not None]
        if vals:
            out[k] = round(sum(vals) / len(vals), 3)
    named = sum(v for k, v in out.items() if k.startswith("cpu_"))
    if "machine_busy" in out:
        # Cores busy on anything the sampler does not name (the kernel, other processes).
        out["cpu_other"] = round(max(0.0, out["machine_busy"] * (os.cpu_count() or 1) - named), 3)
    return out


def cpu_per_order(samples, started_unix_s, cores, from_s=60):
    """CPU-microseconds per applied order for each process group: its mean cores (CORES, from
    cpu()) over the orders applied a second from FROM_S after the start (payments' effect count
    in the samples). Empty when nothing was applied in that span."""
    use = [s for s in samples if s["unix_s"] >= started_unix_s + from_s and s.get("effects") is not None]
    if len(use) < 2 or use[-1]["unix_s"] <= use[0]["unix_s"]:
        return {}
    rate = (use[-1]["effects"] - use[0]["effects"]) / (use[-1]["unix_s"] - use[0]["unix_s"])
    out = sampler.cpu_us_per({k[4:]: v for k, v in cores.items() if k.startswith("cpu_")}, rate)
    if out:
        out["applied_per_s"] = round(rate, 1)
    return out


def from_files(seconds_csv, samples_csv, started_unix_s, slo_ms, from_s=60):
    """analyse() and cpu() from the two CSV files; None when either is missing."""
    try:
        seconds, samples = read_csv(seconds_csv), parse_samples(read_csv(samples_csv))
    except OSError:
        return None
    if not samples:  # none with a time: a sampler from before the CPU columns
        return None
    cores = cpu(samples, started_unix_s, from_s)
    return {"latency": analyse(seconds, started_unix_s, samples, slo_ms, from_s),
            "cpu_cores": cores, "cpu_us_per_order": cpu_per_order(samples, started_unix_s, cores, from_s)}


def print_report(r):
    if not r:
        return
    a = r["latency"]
    print(f"seconds over the SLO from {a['from_s']} s on: {a['seconds_over_slo']} of {a['seconds']} "
          f"({a['over_slo_share']})")
    print(f"{'condition':<48}{'seconds':>9}{'over SLO':>10}{'without':>9}{'over SLO':>10}")
    for c in a["conditions"]:
        print(f"{c['condition']:<48}{c['seconds']:>9}{str(c['over_slo_share']):>10}"
              f"{c['seconds_without']:>9}{str(c['over_slo_share_without']):>10}")
    print("cores used (mean): " + ", ".join(f"{k}={v}" for k, v in r["cpu_cores"].items()))
    per = dict(r.get("cpu_us_per_order") or {})
    if per:
        rate = per.pop("applied_per_s")
        print(f"CPU-microseconds per applied order ({rate}/s): " + ", ".join(f"{k}={v}" for k, v in per.items()))
