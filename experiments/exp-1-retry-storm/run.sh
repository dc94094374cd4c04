#!/usr/bin/env bash
# Experiment 1: the retry storm. README.md beside this file says what it tests
# and how to read the results.
#
# For each offered rate, three runs, side by side, each on a fresh database:
#   pipeline  orders (idempotency check on) + relay + payments, loadgen, then
#             recon --wait-drained --intents: must be CLEAN, 0 replay mismatches;
#   check     orders alone, check on: the latency of the write path;
#   nocheck   orders alone with --no-idempotency (UNSAFE baseline): the same
#             write path without the key claim. Retries make duplicate orders
#             here; the count of orders > keys proves the check was off.
# Load: loadgen open model, --protocol mixed, --retry-rate 0.15, --zipf-s 1.1.
#
# Settings (env): QUICK=1 (two short points, <= 2 min once built; default:
# the full sweep), EXP_PROFILE (release), STACK_ENV_FILE (a stack env file
# such as compose.env or another checkout's .stack/env; unset: scripts/stack.sh
# up), EXP1_RATES and EXP1_SECONDS (override the sweep; the results say so).
set -euo pipefail
EXP_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$EXP_DIR/../.." && pwd)
cd "$ROOT"
started=$(date +%s)

if [ "${QUICK:-0}" = 1 ]; then
  MODE=quick
  RATES=${EXP1_RATES:-500 1500}
  SECS=${EXP1_SECONDS:-5}
  DRAIN=60
else
  MODE=full
  RATES=${EXP1_RATES:-1000 2000 3000 4000 5000 6000 7000 8000}
  SECS=${EXP1_SECONDS:-20}
  DRAIN=120
fi
PROFILE=${EXP_PROFILE:-release}
RETRY_RATE=0.15
ZIPF_S=1.1
HTTP=127.0.0.1:21080
GRPC=127.0.0.1:21051
RELAY_METRICS=127.0.0.1:21101
PAYMENTS_METRICS=127.0.0.1:21102
OUT=$EXP_DIR/results/$MODE
LOGS=$OUT/logs
RUN=$(date +%Y%m%d-%H%M%S)

# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
say() { printf '\n== exp-1: %s\n' "$*"; }

rm -rf "$OUT"
mkdir -p "$LOGS"
# Whatever stops the run early still ends with the verdict line.
summary_done=0
on_exit() {
  local rc=$?
  pipeline_stop
  if [ "$summary_done" = 0 ]; then echo "exp-1: FAIL aborted (exit $rc) before the summary; logs in $LOGS"; fi
}
trap on_exit EXIT

pipeline_stack

say "build ($PROFILE)"
pipeline_build "$PROFILE"
export RUST_LOG=${RUST_LOG:-warn}

# fresh_db DB: (re)creates and migrates DB, exports DATABASE_URL (the
# owner's) and the services' URLs (no topic: the orders-only runs publish
# nothing).
fresh_db() {
  pipeline_db "$1"
  export DATABASE_URL=$DB_URL
}

drop_db() {
  PGOPTIONS='-c client_min_messages=warning' psql "$STACK_ADMIN_DATABASE_URL" -qAt -c "DROP DATABASE IF EXISTS $1 WITH (FORCE)" >/dev/null
}

# orders_alone LOGDIR [ARGS...]: orders on the experiment's ports, tracked so
# pipeline_stop stops it.
orders_alone() {
  local logs=$1
  shift
  DATABASE_URL=$ORDERS_DATABASE_URL ORDERS_HTTP_ADDR=$HTTP ORDERS_GRPC_ADDR=$GRPC "$BIN/orders" "$@" >"$logs/orders.log" 2>&1 &
  pipeline_track $!
  wait_http "http://$HTTP/metrics" orders $! "$logs"
}

# cpu_jiffies: "busy total" CPU time of the whole machine so far (/proc/stat).
cpu_jiffies() { awk '/^cpu /{t=0; for (i = 2; i <= 9; i++) t += $i; print t - $5 - $6, t}' /proc/stat; }

# load LOGDIR RATE: the storm. The same seed and key prefix for every mode of
# one rate, so the three runs send the same requests at the same instants.
load() {
  local rc=0 cpu0 top_pid
  cpu0=$(cpu_jiffies)
  # Halfway through the load, what else runs on the machine (a shared one).
  (sleep $((SECS / 2)); top -b -c -n 2 -d 2 -w 400 >"$1/top.txt" 2>&1) &
  top_pid=$!
  "$BIN/loadgen" --http-url "http://$HTTP" --grpc-url "http://$GRPC" --protocol mixed \
    --rate "$2" --duration "$SECS" --retry-rate "$RETRY_RATE" --zipf-s "$ZIPF_S" \
    --seed "$2" --key-prefix "exp1r$2" --progress off \
    --json "$1/loadgen.json" --csv "$1/loadgen.csv" --intents "$1/intents.txt" \
    >"$1/loadgen.txt" 2>&1 || rc=$?
  echo "$rc" >"$1/loadgen.rc"
  echo "$cpu0 $(cpu_jiffies)" >"$1/cpu.txt"
  wait "$top_pid" || true
  grep -E '^  (rate|outcomes|replay|all) ' "$1/loadgen.txt" || true
}

# table_counts LOGDIR: orders, outbox rows and idempotency keys as stored.
table_counts() {
  psql "$DATABASE_URL" -qAt -F ' ' -c "SELECT (SELECT count(*) FROM orders.orders), \
    (SELECT count(*) FROM orders.outbox), (SELECT count(*) FROM orders.idempotency_keys)" >"$1/counts.txt"
}

for rate in $RATES; do
  # 1. The whole pipeline, check on, recon's proof.
  dir=$LOGS/$rate-pipeline
  mkdir -p "$dir"
  say "$rate intents/s, pipeline (orders + relay + payments), $SECS s, then recon"
  pipeline_fresh "exp1_pipeline_$rate" "exp1-$RUN-$rate"
  pipeline_start "$dir" "$HTTP" "$GRPC" "$RELAY_METRICS" "$PAYMENTS_METRICS" "payments-exp1-$RUN-$rate"
  load "$dir" "$rate"
  rc=0
  DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --wait-drained "$DRAIN" --intents "$dir/intents.txt" --json >"$dir/recon.json" 2>"$dir/recon.err" || rc=$?
  echo "$rc" >"$dir/recon.rc"
  table_counts "$dir"
  curl -fs "http://$PAYMENTS_METRICS/metrics" >"$dir/payments.metrics" || true
  pipeline_stop
  # A drifting database stays for a look (the next run's pipeline_fresh drops it).
  [ "$rc" = 0 ] && drop_db "exp1_pipeline_$rate"
  echo "  recon       exit $rc ($([ "$rc" = 0 ] && echo CLEAN || echo "NOT CLEAN: $dir/recon.json"))"

  # 2. and 3. Orders alone, with and without the check.
  for mode in check nocheck; do
    dir=$LOGS/$rate-$mode
    mkdir -p "$dir"
    args=()
    [ "$mode" = nocheck ] && args=(--no-idempotency)
    say "$rate intents/s, orders alone ${args[*]:-(check on)}, $SECS s"
    fresh_db "exp1_${mode}_$rate"
    orders_alone "$dir" "${args[@]}"
    load "$dir" "$rate"
    table_counts "$dir"
    pipeline_stop
    drop_db "exp1_${mode}_$rate"
  done
done

say "summary"
set +e
(python3 - "$OUT" "$MODE" "$SECS" "$RETRY_RATE" "$ZIPF_S" "$RATES" "$DRAIN" "$(($(date +%s) - started))" "$BIN" <<'PY'
import csv, json, os, sys

out, mode, secs, retry, zipf, rates, drain, elapsed, root_target = sys.argv[1:10]
logs = os.path.join(out, "logs")
LABELS = {
    "pipeline": "with check, full pipeline (recon)",
    "check": "with check, orders alone",
    "nocheck": "no check (--no-idempotency), orders alone",
}
CRITERION = {"achieved_min_pct": 99.0, "errors_max_pct": 0.1, "p99_max_ms": 25.0, "replay_mismatches": 0}


def read(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return default


def machine_busy(d):
    """Busy share of all cores over the load (100 = every core busy)."""
    try:
        b0, t0, b1, t1 = (int(x) for x in read(os.path.join(d, "cpu.txt"), "").split())
        return round(100.0 * (b1 - b0) / (t1 - t0), 1)
    except ValueError:
        return None


def others_cpu(d):
    """%CPU (100 = one core) of processes that are not this run's, halfway
    through the load: another user's builds and services on the shared
    machine. This run's binaries, PostgreSQL (shared, not attributable) and
    the broker are left out."""
    text = read(os.path.join(d, "top.txt"))
    if not text:
        return None
    last = text.split("top - ")[-1].splitlines()
    total, seen = 0.0, False
    for line in last:
        f = line.split(None, 11)
        if len(f) == 12 and f[0] == "PID":
            seen = True
            continue
        if not seen or len(f) < 12:
            continue
        cmd = f[11]
        if root_target in cmd or cmd.startswith(("postgres", "top ", "/usr/lib/postgresql")) or "nisshi" in cmd:
            continue
        try:
            total += float(f[8])
        except ValueError:
            pass
    return round(total, 1)


points, problems = [], []
for rate in [int(r) for r in rates.split()]:
    for m in ("pipeline", "check", "nocheck"):
        d = os.path.join(logs, f"{rate}-{m}")
        text = read(os.path.join(d, "loadgen.json"))
        if text is None:
            problems.append(f"{rate} {m}: no loadgen report (see {d}/loadgen.txt)")
            continue
        r = json.loads(text)
        s, o, lat = r["sends"], r["outcomes"], r["latency_ms"]["all"]
        offered_sends = s["sent"] + s["dropped"]
        errors = (o["completed"] - o["ok"]) + s["dropped"] + r["unfinished"]
        orders, outbox, keys = (int(x) for x in read(os.path.join(d, "counts.txt"), "-1 -1 -1").split())
        p = {
            "mode": m, "label": LABELS[m], "offered": rate,
            "offered_sends_per_s": round(r["rates"]["offered_sends"], 1),
            "achieved_per_s": round(r["rates"]["achieved"], 1),
            "achieved_pct": round(100.0 * o["responses"] / offered_sends, 2) if offered_sends else 0.0,
            "ok_per_s": round(r["rates"]["ok"], 1),
            "sent": s["sent"], "retries_sent": s["retries_sent"], "repeat_intents": s["repeat_intents"],
            "errors": errors, "error_pct": round(100.0 * errors / offered_sends, 3) if offered_sends else 0.0,
            "status_5xx": o["server_errors"], "timeouts": o["timeouts"], "dropped": s["dropped"],
            "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "p999_ms": lat["p999_ms"], "max_ms": lat["max_ms"],
            "replay_mismatches": r["replay"]["mismatches"], "replays_compared": r["replay"]["compared"],
            "keys_succeeded": r["keys"]["succeeded"], "keys_ambiguous": r["keys"]["ambiguous"],
            "orders": orders, "outbox_rows": outbox, "idempotency_keys": keys,
            "loadgen_exit": int(read(os.path.join(d, "loadgen.rc"), "-1")),
            "machine_busy_pct": machine_busy(d), "others_cpu_pct": others_cpu(d),
        }
        p["sustainable"] = (p["achieved_pct"] >= CRITERION["achieved_min_pct"]
                            and p["error_pct"] <= CRITERION["errors_max_pct"]
                            and p["p99_ms"] < CRITERION["p99_max_ms"]
                            and (m == "nocheck" or p["replay_mismatches"] == 0))
        if m == "pipeline":
            rc = int(read(os.path.join(d, "recon.rc"), "-1"))
            rj = json.loads(read(os.path.join(d, "recon.json"), "null") or "null")
            intents = (rj or {}).get("intents") or {}
            rep = (rj or {}).get("report") or {}
            p.update({
                "recon_exit": rc, "recon_clean": bool(rj and rj.get("clean")) and rc == 0,
                "recon_drained": bool(rj and rj.get("drained")),
                "distinct_orders": rep.get("distinct_orders"), "intents_in_db": rep.get("intents"),
                "charges": rep.get("distinct_charges"), "ledger_effects": rep.get("charge_effects"),
                "client_keys_matched": intents.get("matched"),
                "ambiguous_committed": intents.get("ambiguous_committed"),
            })
            # distinct orders == distinct keys that succeeded (+ the ambiguous
            # keys that did commit: a timeout after the commit is not a loss).
            p["orders_equal_keys"] = (p["distinct_orders"] is not None and p["distinct_orders"]
                                      == p["keys_succeeded"] + (p["ambiguous_committed"] or 0))
            if not p["recon_clean"]:
                problems.append(f"{rate} pipeline: recon not CLEAN (exit {rc}; {d}/recon.json)")
            if not p["orders_equal_keys"]:
                problems.append(f"{rate} pipeline: distinct orders {p['distinct_orders']} != keys that "
                                f"succeeded {p['keys_succeeded']} + ambiguous committed {p['ambiguous_committed']}")
            p["sustainable"] = p["sustainable"] and p["recon_clean"]
        if m in ("pipeline", "check") and p["replay_mismatches"]:
            problems.append(f"{rate} {m}: {p['replay_mismatches']} replay mismatches with the check on")
        if m == "check" and orders != keys:
            problems.append(f"{rate} check: {orders} orders != {keys} idempotency keys")
        if m == "nocheck":
            # Evidence that the baseline really skipped the check.
            p["duplicate_orders"] = orders - p["keys_succeeded"]
            if not (orders > p["keys_succeeded"] and keys == 0):
                problems.append(f"{rate} nocheck: {orders} orders, {p['keys_succeeded']} keys, "
                                f"{keys} idempotency rows: the check was not off")
        points.append(p)

by = {(p["offered"], p["mode"]): p for p in points}
comparison = []
for rate in sorted({p["offered"] for p in points}):
    c, n, pl = by.get((rate, "check")), by.get((rate, "nocheck")), by.get((rate, "pipeline"))
    if not (c and n):
        continue
    comparison.append({
        "offered": rate,
        "p99_ms_pipeline": pl["p99_ms"] if pl else None,
        "p99_ms_check": c["p99_ms"], "p99_ms_nocheck": n["p99_ms"],
        "p99_ratio_check_over_nocheck": round(c["p99_ms"] / n["p99_ms"], 2) if n["p99_ms"] else None,
        "p50_ms_check": c["p50_ms"], "p50_ms_nocheck": n["p50_ms"],
        "p50_ratio_check_over_nocheck": round(c["p50_ms"] / n["p50_ms"], 2) if n["p50_ms"] else None,
        "orders_check": c["orders"], "orders_nocheck": n["orders"],
        "keys_succeeded_nocheck": n["keys_succeeded"],
    })


def best(mode):
    return max((p["offered"] for p in points if p["mode"] == mode and p["sustainable"]), default=0)


highest = {m: best(m) for m in LABELS}
# The headline ratio: at the highest rate both orders-alone modes sustain.
both = [c for c in comparison if by[(c["offered"], "check")]["sustainable"] and by[(c["offered"], "nocheck")]["sustainable"]]
headline = both[-1] if both else (comparison[0] if comparison else None)
verdict = "PASS" if not problems else "FAIL"
summary = {
    "experiment": "exp-1-retry-storm", "mode": mode,
    "command": ("QUICK=1 " if mode == "quick" else "") + "experiments/exp-1-retry-storm/run.sh",
    "parameters": {
        "rates": [int(r) for r in rates.split()], "seconds_per_point": int(secs), "retry_rate": float(retry),
        "zipf_s": float(zipf), "keys": 50_000_000, "protocol": "mixed", "loadgen_timeout_ms": 2000,
        "recon_wait_drained_s": int(drain), "fresh_database_per_point": True,
        "orders_defaults": "4 writers, batches <= 128, queue 4096",
    },
    "sustainable_criterion": ("achieved (answered sends) >= 99% of offered sends (first attempts + retries), "
                              "errors (non-ok, dropped, unfinished) <= 0.1%, p99 < 25 ms, 0 replay mismatches; "
                              "for the pipeline mode also recon CLEAN"),
    "highest_sustainable_intents_per_s": highest,
    "headline_comparison": headline,
    "comparison": comparison,
    "points": points,
    "problems": problems,
    "verdict": verdict,
    "elapsed_s": int(elapsed),
}
with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
for name, rows in (("points.csv", points), ("comparison.csv", comparison)):
    if rows:
        with open(os.path.join(out, name), "w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)

print(f"{'offered':>7} {'mode':>8} {'sends/s':>8} {'achvd%':>7} {'err%':>6} {'p50':>7} {'p99':>7} {'p99.9':>7} "
      f"{'mism':>6} {'keys ok':>8} {'orders':>8} {'recon':>6} {'sust':>5} {'busy%':>6} {'others%':>7}")
for p in points:
    recon = ("CLEAN" if p["recon_clean"] else "DRIFT") if p["mode"] == "pipeline" else "-"
    print(f"{p['offered']:>7} {p['mode']:>8} {p['offered_sends_per_s']:>8.0f} {p['achieved_pct']:>7.2f} "
          f"{p['error_pct']:>6.3f} {p['p50_ms']:>7.2f} {p['p99_ms']:>7.2f} {p['p999_ms']:>7.2f} "
          f"{p['replay_mismatches']:>6} {p['keys_succeeded']:>8} {p['orders']:>8} {recon:>6} "
          f"{'yes' if p['sustainable'] else 'no':>5} {p['machine_busy_pct'] if p['machine_busy_pct'] is not None else '-':>6} "
          f"{p['others_cpu_pct'] if p['others_cpu_pct'] is not None else '-':>7}")
for c in comparison:
    print(f"p99 at {c['offered']}/s: with check {c['p99_ms_check']:.2f} ms, without {c['p99_ms_nocheck']:.2f} ms, "
          f"ratio {c['p99_ratio_check_over_nocheck']}; full pipeline {c['p99_ms_pipeline']}")
for problem in problems:
    print(f"problem: {problem}")
ratio = f"p99 check/no-check at {headline['offered']}/s {headline['p99_ratio_check_over_nocheck']}" if headline else "no comparison"
print(f"exp-1: {verdict} highest sustainable: {highest['pipeline']}/s full pipeline (recon CLEAN), "
      f"{highest['check']}/s orders alone with check, {highest['nocheck']}/s without; {ratio}")
sys.exit(0 if verdict == "PASS" else 1)
PY
) >"$OUT/summary.txt"
status=$?
set -e
summary_done=1
if ! tail -n 1 "$OUT/summary.txt" | grep -q '^exp-1: '; then
  echo "exp-1: FAIL the summary could not be made (exit $status)" >>"$OUT/summary.txt"
  status=1
fi
head -n -1 "$OUT/summary.txt"

# The curve is the point: p99 against the offered rate, one line per mode.
if PY=$(scripts/tools.sh venv 2>"$LOGS/venv.log"); then
  "$PY" scripts/plot.py curve "$OUT/summary.json" --points points --x offered --y p99_ms --group label \
    --logy --hline "25:p99 limit 25 ms" -o "$OUT/p99.png" \
    --title "exp-1 retry storm ($MODE): p99 vs offered rate" \
    --xlabel "offered intents/s (plus 15% retried 1-3x, Zipf s=1.1 keys)" --ylabel "p99 latency (ms)" >/dev/null \
    || echo "exp-1: warning: plot failed" >&2
else
  echo "exp-1: warning: no venv for matplotlib (see $LOGS/venv.log); p99.png not drawn" >&2
fi
echo "results: $OUT (took $(($(date +%s) - started)) s)"
tail -n 1 "$OUT/summary.txt"   # the verdict line, last
exit $status
