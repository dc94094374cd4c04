"""Experiment 2's tables and verdict: duplicates injected under load must leave
recon CLEAN with every duplicate absorbed, and every consumer drain must charge
each event once.

Usage (run.sh calls these; `verdict` alone judges results again):
  exp2.py drain-header         the header line of drain-runs.csv
  exp2.py drain-row RATE KIND REP EVENTS SPAN_S CONSUMED HITS MISSES INJECTED DOUBLES
      one line of drain-runs.csv, from one drain's timing and metrics
  exp2.py drain-table RES      drain.csv: the medians of RES/drain-runs.csv per configuration
  exp2.py verdict RES MODE RATES
      RES/summary.json from the chaos summaries RES/dup-NN.json and drain.csv; exit 0 on PASS
"""
import os
import statistics
import sys

from common import chaos_report, exit_code, load_json, print_checks, read_csv, verdict, write_csv, write_json

DRAIN_RUNS_HEADER = ("dup_rate,kind,rep,events,span_s,effects_per_s,consumed,consumed_per_s,"
                     "inbox_hits,inbox_misses,injected,doubles")


def num(text):
    """A metric's value as scraped (empty when the scrape missed it: 0)."""
    return float(text or 0)


def drain_row(p, kind, rep, n, span, consumed, hits, misses, injected, doubles):
    """One drain-runs.csv line: effects/s over the SQL-timed span of charges."""
    n, span, consumed = int(n), num(span), num(consumed)
    return (f"{p},{kind},{rep},{n},{span:.3f},{n / span if span else 0:.0f},{consumed:.0f},"
            f"{consumed / span if span else 0:.0f},{num(hits):.0f},{num(misses):.0f},"
            f"{num(injected):.0f},{doubles}")


def drain_table(rows):
    """Medians (and min/max where a bound matters) per (dup_rate, kind), in
    the order the configurations first ran."""
    out = []
    for key in dict.fromkeys((r["dup_rate"], r["kind"]) for r in rows):
        rs = [r for r in rows if (r["dup_rate"], r["kind"]) == key]

        def med(f, rs=rs):
            return statistics.median(float(r[f]) for r in rs)
        out.append({"dup_rate": key[0], "kind": key[1], "reps": len(rs), "events": rs[0]["events"],
                    "effects_per_s": round(med("effects_per_s")), "consumed_per_s": round(med("consumed_per_s")),
                    "effects_per_s_min": min(int(r["effects_per_s"]) for r in rs),
                    "effects_per_s_max": max(int(r["effects_per_s"]) for r in rs),
                    "injected": round(med("injected")), "inbox_hits": round(med("inbox_hits")),
                    "inbox_misses_min": min(int(r["inbox_misses"]) for r in rs),
                    "doubles_max": max(int(r["doubles"]) for r in rs)})
    return out


def under_load(c):
    """One under-load run's numbers from its chaos summary C."""
    r = chaos_report(c)
    t = c["totals"]
    hits, misses = t.get("inbox_hits", 0), t.get("inbox_misses", 0)
    return {
        "recon_exit": c["recon_exit"], "distinct_orders": r.get("distinct_orders"),
        "distinct_charges": r.get("distinct_charges"), "double_charges": r.get("double_charges"),
        "injected_reprocess": t.get("injected_reprocess", 0), "injected_redeliver": t.get("injected_redeliver", 0),
        "inbox_hits": hits, "inbox_misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "consumed": t.get("consumed", 0),
        "load": {k: c["load"].get(k) for k in ("rates", "outcomes")} if c.get("load") else None,
    }


def judge(runs, drain, drain_runs, mode):
    """The summary: RUNS (dup rate -> under_load()), DRAIN (drain.csv rows),
    DRAIN_RUNS (drain-runs.csv rows)."""
    checks = {}
    for p, x in runs.items():
        inj = x["injected_reprocess"] + x["injected_redeliver"]
        checks[f"dup {p}: recon CLEAN, distinct_charges == distinct_orders, zero doubles"] = (
            x["recon_exit"] == 0 and x["distinct_charges"] == x["distinct_orders"] and x["double_charges"] == 0)
        checks[f"dup {p}: duplicates of both kinds injected and every one absorbed (inbox hits >= injected)"] = (
            x["injected_reprocess"] > 0 and x["injected_redeliver"] > 0 and x["inbox_hits"] >= inj)
    for d in drain:
        checks[f"drain at dup {d['dup_rate']} ({d['kind']}): every event charged once in every repetition"] = (
            int(d["inbox_misses_min"]) == int(d["events"]) and int(d["doubles_max"]) == 0)
    return {"experiment": "exp-2-duplicates", "mode": mode, "under_load": runs, "consumer_drain": drain,
            "consumer_drain_runs": drain_runs, "checks": checks, "verdict": verdict(checks)}


def verdict_line(s, res):
    """The last line: the verdict and the numbers behind it."""
    parts = [f"dup {p}: {x['distinct_orders']} orders, {x['injected_reprocess'] + x['injected_redeliver']:.0f} "
             f"injected, hit ratio {x['hit_ratio']:.3f}" for p, x in s["under_load"].items()
             if x["hit_ratio"] is not None]
    parts += [f"drain {d['dup_rate']} {d['kind']}: {d['effects_per_s']} effects/s" for d in s["consumer_drain"]]
    return f"exp-2: {s['verdict']} — " + "; ".join(parts) + f" ({s['mode']}; {res}/summary.json)"


def main(argv):
    """The subcommand in ARGV; the exit status."""
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "drain-header" and not args:
        print(DRAIN_RUNS_HEADER)
        return 0
    if cmd == "drain-row" and len(args) == 10:
        print(drain_row(*args))
        return 0
    if cmd == "drain-table" and len(args) == 1:
        rows = drain_table(read_csv(os.path.join(args[0], "drain-runs.csv")))
        write_csv(os.path.join(args[0], "drain.csv"), rows)
        return 0 if rows else 1
    if cmd == "verdict" and len(args) == 3:
        res, mode, rates = args[0], args[1], args[2].split()
        runs = {}
        for p in rates:
            c = load_json(os.path.join(res, f"dup-{p[2:]}.json"))
            if c is None:
                print(f"exp-2: FAIL no chaos summary {res}/dup-{p[2:]}.json (see its logs/)")
                return 1
            runs[p] = under_load(c)
        drain = read_csv(os.path.join(res, "drain.csv"))
        s = judge(runs, drain, read_csv(os.path.join(res, "drain-runs.csv")), mode)
        write_json(os.path.join(res, "summary.json"), s)
        print_checks(s["checks"])
        print(verdict_line(s, res))
        return exit_code(s)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
