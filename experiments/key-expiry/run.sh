#!/usr/bin/env bash
# Idempotency keys expiring under load: the pipeline at 1,000 orders/s for
# 5 minutes with a key retention of 1 minute, recon's diff taken every 15 s
# during the run and once after it. Recon must never call the expiry drift:
# the key counts (distinct_orders - intents, intents without an order,
# orders without a key or with many) are 0 in every snapshot, and the run
# ends CLEAN. See README.md beside this file.
#
# Settings (env): QUICK=1 (a minute at 200/s, retention 20 s), EXP_PROFILE
# (release), EXP_RATE, EXP_DURATION, EXP_RETENTION (seconds), EXP_EVERY
# (seconds between snapshots).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/key-expiry
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

# Quick mode runs 90 s: orders' second expiry pass (a minute after its
# start) is the first that finds keys past a 20 s retention.
if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-200} DURATION=${EXP_DURATION:-90} RETENTION=${EXP_RETENTION:-20} EVERY=${EXP_EVERY:-10}
else
  RATE=${EXP_RATE:-1000} DURATION=${EXP_DURATION:-300} RETENTION=${EXP_RETENTION:-60} EVERY=${EXP_EVERY:-15}
fi
# orders expires keys once a minute (pipeline::lifecycle::INTERVAL).
EXPIRE_EVERY=60

# One snapshot (PHASE: load|drained): recon's diff as it is, then the keys
# below the key floor (the ones recon before the fix counted as intents
# without their orders), read right after it in a snapshot of its own: an
# expiry pass between the two shows as keys below a floor recon had not
# seen yet.
snapshot() {
  local report below
  report=$(DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --json --jobs 1 2>/dev/null || true)
  below=$(psql "$RECON_DATABASE_URL" -qAt -c \
    "SELECT count(*) FROM fx.idempotency_keys WHERE reference < (SELECT floor::text FROM orders.key_policy)" \
    2>/dev/null || echo "")
  [ -n "$report" ] || return 0
  python3 -c 'import json,sys,time; d=json.loads(sys.argv[1]); print(json.dumps({"at": time.time(), "phase": sys.argv[3], "keys_below_floor": int(sys.argv[2]) if sys.argv[2] else None, "report": d["report"], "deltas": d["deltas"]}))' \
    "$report" "$below" "$1" >>"$RES/snapshots.jsonl" || true
}

# On the fresh database, before chaos starts the services: the short
# retention, then the snapshots in the background until the run ends.
prepare() {
  psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 \
    -c "UPDATE orders.key_policy SET retention = make_interval(secs => $RETENTION)"
  ( end=$(( $(date +%s) + DURATION + 60 ))
    while [ "$(date +%s)" -lt "$end" ]; do
      sleep "$EVERY"
      snapshot load
    done ) &
  SNAPSHOTS=$!
}
export EXP_PREPARE=prepare
exp_chaos key-expiry --rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed --seed 21 || true
unset EXP_PREPARE
kill "$SNAPSHOTS" 2>/dev/null || true
wait "$SNAPSHOTS" 2>/dev/null || true
# And one after the drain (chaos's own recon ran then too).
snapshot drained

python3 "$ROOT/experiments/lib/keyexpiry.py" "$RES" "$MODE" "$RETENTION" "$EXPIRE_EVERY"
