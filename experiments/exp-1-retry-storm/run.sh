#!/usr/bin/env bash
# Experiment 1: the retry storm. README.md beside this file says what it tests
# and how to read the results.
#
# For each offered rate, three runs, side by side, each on a fresh database:
#   pipeline  chaos without faults: orders (idempotency check on) + relay +
#             payments, loadgen, then recon --wait-drained --intents (must be
#             CLEAN, 0 replay mismatches);
#   check     orders alone, check on: the latency of the write path;
#   nocheck   orders alone with --no-idempotency (UNSAFE baseline): the same
#             write path without the key claim. Retries make duplicate orders
#             here; the count of orders > keys proves the check was off.
# Load: loadgen open model, --protocol mixed, --retry-rate 0.15, --zipf-s 1.1.
# The summary, the "sustainable" rule and the verdict: experiments/lib/exp1.py.
#
# Settings (env): QUICK=1 (two short points, <= 2 min once built; default:
# the full sweep), EXP_PROFILE (release), STACK_ENV_FILE (a stack env file
# such as compose.env or another checkout's .stack/env; unset: scripts/stack.sh
# up), EXP1_RATES and EXP1_SECONDS (override the sweep; the results say so).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-1-retry-storm
cd "$ROOT"
started=$(date +%s)
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"

# Whatever stops the run early still ends with the verdict line.
summary_done=0
on_exit() {
  local rc=$?
  pipeline_stop
  if [ "$summary_done" = 0 ]; then echo "exp-1: FAIL aborted (exit $rc) before the summary; logs in ${RES:-?}/logs"; fi
}
trap on_exit EXIT
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATES=${EXP1_RATES:-500 1500} SECS=${EXP1_SECONDS:-5} DRAIN=60
else
  RATES=${EXP1_RATES:-1000 2000 3000 4000 5000 6000 7000 8000} SECS=${EXP1_SECONDS:-20} DRAIN=120
fi
RETRY_RATE=0.15
ZIPF_S=1.1
HTTP=127.0.0.1:21080
GRPC=127.0.0.1:21051
ORDERS_METRICS=$(orders_metrics_addr "$HTTP")
RELAY_METRICS=127.0.0.1:21101
PAYMENTS_METRICS=127.0.0.1:21102
LOGS=$RES/logs

# cpu_jiffies: "busy total" CPU time of the whole machine so far (/proc/stat).
cpu_jiffies() { awk '/^cpu /{t=0; for (i = 2; i <= 9; i++) t += $i; print t - $5 - $6, t}' /proc/stat; }

# sample_load LOGDIR URL...: once every URL answers (the services are up, so
# the load starts), what else runs on the machine (a shared one) halfway
# through the load (top.txt), and the machine's CPU time over the load
# (cpu.txt). Runs beside the load.
sample_load() {
  local dir=$1 url cpu0
  shift
  for url in "$@"; do
    for _ in $(seq 1 600); do curl -fs -o /dev/null "$url" && break; sleep 0.1; done
  done
  cpu0=$(cpu_jiffies)
  sleep $((SECS / 2))
  top -b -c -n 2 -d 2 -w 400 >"$dir/top.txt" 2>&1 || true
  sleep $((SECS - SECS / 2 > 2 ? SECS - SECS / 2 - 2 : 0))
  echo "$cpu0 $(cpu_jiffies)" >"$dir/cpu.txt"
}

# The same seed and key prefix for every mode of one rate, so the three runs
# send the same requests at the same instants.
load_args() { # RATE
  echo --seed "$1" --retry-rate "$RETRY_RATE" --zipf-s "$ZIPF_S"
}

for rate in $RATES; do
  # 1. The whole pipeline, check on, recon's proof: chaos with no crash point
  # and no fault.
  tag=$rate-pipeline
  mkdir -p "$LOGS/$tag"
  say "$rate intents/s, pipeline (chaos without faults: orders + relay + payments), $SECS s, then recon"
  sample_load "$LOGS/$tag" "http://$ORDERS_METRICS/metrics" "http://$RELAY_METRICS/metrics" "http://$PAYMENTS_METRICS/metrics" &
  sampler=$!
  rc=0
  # shellcheck disable=SC2046 # load_args is words by design
  exp_chaos "$tag" --rate "$rate" --duration "$SECS" --protocol mixed $(load_args "$rate") \
    --drain-timeout "$DRAIN" --http-addr "$HTTP" --grpc-addr "$GRPC" --orders-metrics-addr "$ORDERS_METRICS" \
    --relay-metrics-addr "$RELAY_METRICS" --payments-metrics-addr "$PAYMENTS_METRICS" \
    --loadgen-arg=--key-prefix --loadgen-arg="exp1r$rate" >"$LOGS/$tag/chaos.txt" 2>&1 || rc=$?
  # Done long before chaos (load < load + drain + recon), unless chaos failed at start.
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  grep -E '^  (rate|outcomes|replay|all) ' "$LOGS/$tag/chaos.txt" || true
  # A drifting database stays for a look (the next run's exp_chaos drops it).
  [ "$rc" = 0 ] && pipeline_drop_db "exp_${tag//-/_}"
  echo "  recon       exit $rc ($([ "$rc" = 0 ] && echo CLEAN || echo "NOT CLEAN: $RES/$tag.json"))"

  # 2. and 3. Orders alone, with and without the check; recon --json counts
  # the orders, outbox rows and keys (its verdict does not apply: nothing is
  # published or charged).
  for m in check nocheck; do
    dir=$LOGS/$rate-$m
    db=exp1_${m}_$rate
    mkdir -p "$dir"
    args=()
    [ "$m" = nocheck ] && args=(--no-idempotency)
    say "$rate intents/s, orders alone ${args[*]:-(check on)}, $SECS s"
    pipeline_db "$db"
    pipeline_orders "$dir" "$HTTP" "$GRPC" "${args[@]}"
    sample_load "$dir" "http://$ORDERS_METRICS/metrics" &
    sampler=$!
    lrc=0
    # shellcheck disable=SC2046
    "$BIN/loadgen" --http-url "http://$HTTP" --grpc-url "http://$GRPC" --protocol mixed \
      --rate "$rate" --duration "$SECS" $(load_args "$rate") --key-prefix "exp1r$rate" --progress off \
      --json "$dir/loadgen.json" --csv "$dir/loadgen.csv" --intents "$dir/intents.txt" \
      >"$dir/loadgen.txt" 2>&1 || lrc=$?
    echo "$lrc" >"$dir/loadgen.rc"
    wait "$sampler" || true
    grep -E '^  (rate|outcomes|replay|all) ' "$dir/loadgen.txt" || true
    DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --json >"$dir/recon.json" 2>"$dir/recon.err" || true
    pipeline_stop
    pipeline_drop_db "$db"
  done
done

say "summary"
status=0
python3 "$ROOT/experiments/lib/exp1.py" "$RES" "$MODE" "$SECS" "$RETRY_RATE" "$ZIPF_S" "$RATES" "$DRAIN" \
  "$(($(date +%s) - started))" "$BIN" >"$RES/summary.txt" || status=$?
summary_done=1
if ! tail -n 1 "$RES/summary.txt" | grep -q '^exp-1: '; then
  echo "exp-1: FAIL the summary could not be made (exit $status)" >>"$RES/summary.txt"
  status=1
fi
head -n -1 "$RES/summary.txt"

# The curve is the point: p99 against the offered rate, one line per mode.
if PY=$(scripts/tools.sh venv 2>"$LOGS/venv.log"); then
  "$PY" scripts/plot.py curve "$RES/summary.json" --points points --x offered --y p99_ms --group label \
    --logy --hline "25:p99 limit 25 ms" -o "$RES/p99.png" \
    --title "exp-1 retry storm ($MODE): p99 vs offered rate" \
    --xlabel "offered intents/s (plus 15% retried 1-3x, Zipf s=1.1 keys)" --ylabel "p99 latency (ms)" >/dev/null \
    || echo "exp-1: warning: plot failed" >&2
else
  echo "exp-1: warning: no venv for matplotlib (see $LOGS/venv.log); p99.png not drawn" >&2
fi
echo "results: $RES (took $(($(date +%s) - started)) s)"
tail -n 1 "$RES/summary.txt"   # the verdict line, last
exit $status
