#!/usr/bin/env bash
# Experiment 7: idempotency-key contention on hot keys. Half of the intents go
# to the ten hottest keys (loadgen --hot-keys 10 --hot-share 0.5); orders
# claims keys by INSERT … ON CONFLICT or by an advisory lock on the key's hash
# (--claim-strategy), each with request coalescing (128 requests per write
# transaction) and without (one per transaction). Per key class: latency,
# retries per success; per run: deadlocks (pg_stat_database) and the service's
# write errors by kind; recon in every run. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-7-hot-keys
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-400} DURATION=${EXP_DURATION:-10}
else
  RATE=${EXP_RATE:-600} DURATION=${EXP_DURATION:-60}
fi
HOT_KEYS=${EXP_HOT_KEYS:-10} HOT_SHARE=${EXP_HOT_SHARE:-0.5}
common=(--rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed --seed 7
  --loadgen-arg=--hot-keys --loadgen-arg="$HOT_KEYS" --loadgen-arg=--hot-share --loadgen-arg="$HOT_SHARE"
  --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=100)

for strategy in on-conflict advisory-lock; do
  for coalescing in coalesced single; do
    tag=$strategy-$coalescing
    export ORDERS_CLAIM_STRATEGY=$strategy
    if [ "$coalescing" = coalesced ]; then export ORDERS_WRITE_BATCH_MAX=128; else export ORDERS_WRITE_BATCH_MAX=1; fi
    exp_chaos "$tag" "${common[@]}" || true
    # Deadlocks the database detected in this run's database (a fresh one).
    psql "$DATABASE_URL" -qAt -c "SELECT json_build_object('deadlocks', deadlocks, 'xact_rollback', xact_rollback,
        'xact_commit', xact_commit) FROM pg_stat_database WHERE datname = current_database()" >"$RES/$tag.pg.json"
  done
done
unset ORDERS_CLAIM_STRATEGY ORDERS_WRITE_BATCH_MAX

python3 "$ROOT/experiments/lib/exp7.py" "$RES" "$MODE" "$HOT_KEYS" && status=0 || status=$?

if [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; then
  "$ROOT/.tools/venv/bin/python" "$ROOT/scripts/plot.py" bars "$RES/classes.csv" -o "$RES/p99.png" \
    --category config --y hot_p99_ms,cold_p99_ms \
    --title "create p99 by key class, claim strategy and coalescing (exp-7, $MODE)" \
    --ylabel "p99 ms" || echo "exp-7: plot failed (see classes.csv)" >&2
fi
exit "$status"
