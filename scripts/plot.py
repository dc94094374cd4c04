#!/usr/bin/env python3
"""Renders PNG plots from the project's results files. Needs matplotlib from
the project venv: `make plot-deps`, then run it with .tools/venv/bin/python.

Subcommands (each writes PNGs; `--help` on each lists its options):

  orders SUMMARY.json [-o DIR]
      a `make bench-orders` run (bench/results/orders-*/summary.json): writes
      latency.png (p50/p99 vs offered rate, per mode, the 25 ms p99 SLO) and
      throughput.png (achieved vs offered, per mode) next to it or into DIR.

  curve FILE.json|FILE.csv -o OUT.png --x FIELD --y FIELD[,FIELD...]
        [--points KEY] [--group FIELD] [--logy] [--identity] [--hline Y[:LABEL]]
      y against x, one line per y field and group: the generic form of the two
      above, for any experiment's list of points (a JSON list, a list under
      KEY, e.g. `points`, or CSV rows).

  series FILE.csv -o OUT.png [--x second] [--y sent,ok,errors] [--y2 p99_ms]
      a time series, e.g. loadgen --csv (second,sent,ok,errors,p99_ms): the
      --y columns on the left axis, the --y2 columns on a right axis.

  bars FILE.csv|FILE.json -o OUT.png --category FIELD --y FIELD[,FIELD...]
       [--points KEY] [--logy]
      grouped bars: one group per row (labelled by --category), one bar per
      --y field in each, e.g. a p99 per key class for each configuration.
"""

import argparse
import csv
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def number(v):
    """A float from a JSON/CSV cell; NaN for an empty or non-numeric cell."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def load_rows(path, points_key=None):
    """Rows (dicts) from a CSV file, a JSON list, or a list under `points_key`."""
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".csv"):
            return list(csv.DictReader(f))
        data = json.load(f)
    if points_key:
        for key in points_key.split("."):
            data = data[key]
    if not isinstance(data, list):
        sys.exit(f"{path}: expected a list of points (use --points KEY)")
    return data


def save(fig, out):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(out)


def curve(rows, out, x, ys, group=None, title=None, xlabel=None, ylabel=None,
          logy=False, identity=False, hlines=()):
    fig, ax = plt.subplots(figsize=(8, 5))
    groups = sorted({str(r.get(group)) for r in rows}) if group else [None]
    for g in groups:
        sel = [r for r in rows if group is None or str(r.get(group)) == g]
        sel.sort(key=lambda r: number(r.get(x)))
        xs = [number(r.get(x)) for r in sel]
        for y in ys:
            label = " ".join(p for p in (g, y if len(ys) > 1 or not g else None) if p)
            ax.plot(xs, [number(r.get(y)) for r in sel], marker="o", label=label or y)
    if identity:
        lo = min(number(r.get(x)) for r in rows)
        hi = max(number(r.get(x)) for r in rows)
        ax.plot([lo, hi], [lo, hi], linestyle=":", color="grey", label="y = x")
    for value, label in hlines:
        ax.axhline(value, linestyle="--", color="red", linewidth=1, label=label)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or ", ".join(ys))
    ax.set_title(title or f"{', '.join(ys)} vs {x}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(fig, out)


def series(rows, out, x, ys, y2s, title=None):
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = [number(r[x]) for r in rows]
    for i, y in enumerate(ys):
        # The first series (e.g. sent) is drawn wide and pale, so an identical
        # second one (ok) stays visible on top of it.
        style = {"linewidth": 4, "alpha": 0.4} if i == 0 and len(ys) > 1 else {}
        ax.plot(xs, [number(r[y]) for r in rows], label=y, **style)
    ax.set_xlabel(x)
    ax.set_ylabel(", ".join(ys))
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if y2s:
        ax2 = ax.twinx()
        for i, y in enumerate(y2s):
            ax2.plot(xs, [number(r[y]) for r in rows], label=y, linestyle="--", color=f"C{len(ys) + i}")
        ax2.set_ylabel(", ".join(y2s))
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper left")
    ax.set_title(title or os.path.basename(out))
    save(fig, out)


def bars(rows, out, category, ys, title=None, ylabel=None, logy=False):
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) * len(ys) / 2 + 2), 5))
    width = 0.8 / max(1, len(ys))
    for i, y in enumerate(ys):
        xs = [j + (i - (len(ys) - 1) / 2) * width for j in range(len(rows))]
        values = [number(r.get(y)) for r in rows]
        drawn = ax.bar(xs, values, width=width, label=y)
        ax.bar_label(drawn, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([str(r.get(category)) for r in rows], rotation=15, ha="right")
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel or ", ".join(ys))
    ax.set_title(title or os.path.basename(out))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    save(fig, out)


def hline(spec):
    value, _, label = spec.partition(":")
    return float(value), label or f"y = {value}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    o = sub.add_parser("orders", help="latency.png and throughput.png of a bench-orders summary.json")
    o.add_argument("summary")
    o.add_argument("-o", "--out-dir", help="default: the summary's folder")

    c = sub.add_parser("curve", help="y fields against an x field, per group")
    c.add_argument("file")
    c.add_argument("-o", "--out", required=True)
    c.add_argument("--x", required=True)
    c.add_argument("--y", required=True, help="comma-separated fields")
    c.add_argument("--points", help="JSON key (dotted) of the list of points")
    c.add_argument("--group", help="one line per value of this field")
    c.add_argument("--title")
    c.add_argument("--xlabel")
    c.add_argument("--ylabel")
    c.add_argument("--logy", action="store_true")
    c.add_argument("--identity", action="store_true", help="draw y = x")
    c.add_argument("--hline", action="append", default=[], type=hline, help="Y[:LABEL], repeatable")

    s = sub.add_parser("series", help="a per-second CSV such as loadgen --csv")
    s.add_argument("file")
    s.add_argument("-o", "--out", required=True)
    s.add_argument("--x", default="second")
    s.add_argument("--y", default="sent,ok,errors", help="left axis, comma-separated")
    s.add_argument("--y2", default="p99_ms", help="right axis, comma-separated ('' for none)")
    s.add_argument("--title")

    b = sub.add_parser("bars", help="grouped bars: one group per row, one bar per y field")
    b.add_argument("file")
    b.add_argument("-o", "--out", required=True)
    b.add_argument("--category", required=True, help="the field that labels each group")
    b.add_argument("--y", required=True, help="comma-separated fields")
    b.add_argument("--points", help="JSON key (dotted) of the list of rows")
    b.add_argument("--title")
    b.add_argument("--ylabel")
    b.add_argument("--logy", action="store_true")

    args = ap.parse_args()
    if args.cmd == "orders":
        with open(args.summary, encoding="utf-8") as f:
            summary = json.load(f)
        points = summary["points"]
        out = args.out_dir or os.path.dirname(os.path.abspath(args.summary))
        run = os.path.basename(os.path.dirname(os.path.abspath(args.summary)))
        # Sends offered (retries included); summaries before the sweep had "offered".
        x = "offered_sends" if points and "offered_sends" in points[0] else "offered"
        curve(points, os.path.join(out, "latency.png"), x, ["p50_ms", "p99_ms"], group="mode",
              title=f"POST /orders latency vs offered rate ({run})", xlabel="offered (sends/s)",
              ylabel="latency (ms)", logy=True, hlines=[(25, "p99 SLO 25 ms")])
        hlines = []
        if summary.get("pgbench_tps"):
            hlines.append((summary["pgbench_tps"], f"pgbench, a transaction per request: {summary['pgbench_tps']} tps"))
        if summary.get("pgbench_batch64_orders_per_sec"):
            b = summary["pgbench_batch64_orders_per_sec"]
            hlines.append((b, f"pgbench, 64 requests per transaction: {b} orders/s"))
        curve(points, os.path.join(out, "throughput.png"), x, ["achieved"], group="mode",
              title=f"POST /orders throughput ({run})", xlabel="offered (sends/s)",
              ylabel="achieved (answered req/s, retries included)", identity=True, hlines=hlines)
    elif args.cmd == "curve":
        rows = load_rows(args.file, args.points)
        curve(rows, args.out, args.x, args.y.split(","), group=args.group, title=args.title,
              xlabel=args.xlabel, ylabel=args.ylabel, logy=args.logy, identity=args.identity,
              hlines=args.hline)
    elif args.cmd == "bars":
        rows = load_rows(args.file, args.points)
        bars(rows, args.out, args.category, args.y.split(","), title=args.title, ylabel=args.ylabel,
             logy=args.logy)
    else:
        rows = load_rows(args.file)
        series(rows, args.out, args.x, args.y.split(","), [y for y in args.y2.split(",") if y],
               title=args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
