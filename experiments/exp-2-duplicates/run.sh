#!/usr/bin/env bash
# Experiment 2: duplicate delivery at 5% and 30% on the consumer, under load,
# then the consumer's throughput at each duplicate rate on the same events.
# See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-2-duplicates
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-15}
else
  RATE=${EXP_RATE:-800} DURATION=${EXP_DURATION:-75}
fi
RATES="0.05 0.30"
DRAIN_RATES="0 0.05 0.30"

# --- A: under load, duplicates injected both ways, recon must stay clean.
for p in $RATES; do # each verdict is read from its chaos summary below
  exp_chaos "dup-${p#0.}" --rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed \
    --dup-rate "$p" --dup-kind both --seed 2 || true
done

# --- B: consumer throughput at each duplicate rate, side by side: the last
# run's topic (every event of that run) drained by a fresh payments (fresh
# group) into a fresh database, per configuration and repetition, in turns.
# Effects/s are timed in SQL, from the first to the last charge transaction,
# so the group join is not counted. 30% is also run with one kind of
# duplicate at a time, to see which costs what.
TOPIC=$KAFKA_TOPIC
LAST=$RES/dup-${RATES##* 0.}.json
# Every event of the last run (0 when it left no summary: its verdict fails below).
N=$(exp_json "$LAST" '((d.get("recon") or {}).get("report") or {}).get("outbox_rows", 0)' 2>/dev/null || echo 0)
CONFIGS="0:both 0.05:both 0.30:both 0.30:reprocess 0.30:redeliver"
if [ "$MODE" = quick ]; then REPS=1; else REPS=${EXP_REPS:-3}; fi
say "consumer drain of $N events from $TOPIC: $CONFIGS, $REPS repetition(s) each"
EXP2=$ROOT/experiments/lib/exp2.py
python3 "$EXP2" drain-header >"$RES/drain-runs.csv"
drain() { # RATE KIND REP
  local p=$1 kind=$2 rep=$3 logs db url pid ok n metrics span doubles consumed injected
  logs=$RES/logs/drain-$p-$kind-$rep
  db=exp_drain_${p//./_}_$kind
  mkdir -p "$logs"
  pipeline_db "$db"
  url=$DB_URL
  KAFKA_TOPIC=$TOPIC PAYMENTS_DUP_RATE=$p PAYMENTS_DUP_KIND=$kind RUST_LOG=warn \
    pipeline_payments "$logs" 127.0.0.1:22102 "payments-drain-$p-$kind-$rep-$(date +%s)" || true # a failed start fails the drain
  pid=${PIPELINE_PIDS[-1]}
  ok=0
  for _ in $(seq 1 1200); do
    n=$(psql "$url" -qAt -c "SELECT count(*) FROM fx.partitioned_inbox WHERE consumer = 'payments'")
    if [ "$n" -ge "$N" ]; then ok=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.25
  done
  sleep 1 # let the injected duplicates of the last batches arrive
  metrics=$(curl -fs http://127.0.0.1:22102/metrics || true)
  pipeline_stop
  [ $ok = 1 ] || echo "exp-2: drain $p $kind did not finish; see $logs/payments.log" >&2
  m() { awk -v k="$1" '$1==k {print $2}' <<<"$metrics"; }
  # The drain's database has charges but no orders, so recon's diff does not
  # apply: its span and doubles are read here.
  read -r span doubles < <(psql "$url" -qAt -F ' ' -c \
    "SELECT extract(epoch FROM max(created_at) - min(created_at)),
            (SELECT count(*) FROM (SELECT order_id FROM payments.ledger GROUP BY 1 HAVING count(*) > 1) d)
     FROM payments.charges")
  consumed=$(m payments_consumed_total)
  injected=$(awk '/^payments_injected_duplicates_total/ {s += $2} END {print s + 0}' <<<"$metrics")
  python3 "$EXP2" drain-row "$p" "$kind" "$rep" "$N" "$span" "$consumed" "$(m payments_dedup_hits_total)" \
    "$(m payments_dedup_misses_total)" "$injected" "$doubles" >>"$RES/drain-runs.csv"
}
for rep in $(seq 1 "$REPS"); do
  for c in $CONFIGS; do drain "${c%%:*}" "${c##*:}" "$rep"; done
done
# Medians per configuration.
python3 "$EXP2" drain-table "$RES"
column -s, -t <"$RES/drain.csv" >&2

if [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; then
  "$ROOT/.tools/venv/bin/python" "$ROOT/scripts/plot.py" curve "$RES/drain.csv" -o "$RES/throughput.png" \
    --x dup_rate --y effects_per_s,consumed_per_s --group kind --title "payments: throughput by duplicate rate (exp-2, $MODE)" \
    --xlabel "injected duplicate rate" --ylabel "per second" || echo "exp-2: plot failed (results are in drain.csv)" >&2
fi

python3 "$EXP2" verdict "$RES" "$MODE" "$RATES"
