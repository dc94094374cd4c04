#!/usr/bin/env bash
# Experiment 9: the pipeline over webhooks (relay --sink http -> payments
# --source http) against a failing receiver: down, answering 500, slower
# than the sender's timeout, killed mid-load; then deliveries that failed
# for good, replayed to delivered. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-9-webhooks
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

# The retry schedule is scaled so that a run of minutes sees all of it (the
# jitter and the per-key order are the real ones), and the outages are kept
# short beside its span, as 30 s is beside the real 12 h 35 min: quick x0.002
# (10 ms, 60 ms, 600 ms, 3.6 s, then 28.8 s: 8 attempts span 1.5 min)
# against outages of 5 s, 3-4 s apart, all over within 25 s, so that no
# delivery meets a fault after its 5th attempt (the 6th comes >= 23 s after
# the 5th); full x0.005 (25 ms, 150 ms, 1.5 s, 9 s, then 72 s: 8 attempts
# span 3 min 47 s) against outages of 30 s, 20-25 s apart. (Quick at x0.001,
# 14.4 s, against 8 s outages spanning 32 s: in six runs 416-554 deliveries
# reached a 7th attempt and up to 4 an 8th, each one failed attempt, such as
# a receiver just killed, from being given up.)
if [ "$MODE" = quick ]; then
  SCALE=${EXP_SCALE:-0.002}
  RATE=${EXP_RATE:-150} DURATION=${EXP_DURATION:-35} DOWN_MS=5000 INTERVAL=3000..4000
  TIMEOUT_MS=1000 MIN_KILLS=2 DRAIN=120
  # `effect` passes once per processor transaction: a 35 s run has too few
  # of them for it to fire reliably at this probability, so quick arms the
  # two points of the HTTP hop only.
  POINTS=respond,deliver
else
  SCALE=${EXP_SCALE:-0.005}
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-180} DOWN_MS=30000 INTERVAL=20000..25000
  TIMEOUT_MS=2000 MIN_KILLS=5 DRAIN=400 POINTS=respond,deliver,effect
fi

# Run 1: each receiver fault once, in turn (down for DOWN_MS, then 500s, then
# slower than the timeout), and the receiver and the sender killed at their
# crash points (after the receiver's commit, before its answer; after the
# 2xx, before the sender's mark; in the inbox processor, between the charge
# and the processed mark, in their one transaction).
exp_chaos faults --transport http --webhook-schedule-scale "$SCALE" --webhook-timeout-ms "$TIMEOUT_MS" \
  --fault receiver-down,receiver-errors,receiver-slow --fault-count 3 --fault-down-ms "$DOWN_MS" \
  --fault-interval-ms "$INTERVAL" --crash-point "$POINTS" --crash-probability 0.002 \
  --rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed --seed 9 --drain-timeout "$DRAIN" || true
# Every attempt, for the schedule actually observed (read before the next run
# drops the database).
psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "\copy (SELECT a.outbox_id, a.attempt, \
  extract(epoch FROM a.started_at)::float8 AS started_s, a.duration_ms, a.status, a.outcome \
  FROM orders.webhook_attempts a ORDER BY a.outbox_id, a.attempt) TO '$RES/attempts.csv' CSV HEADER"

# Run 2: the receiver answers 500 for long enough that deliveries exhaust
# their (two) attempts and fail. Chaos's recon must call them drift
# (failed_deliveries); then the operator replays them to a working receiver.
# One secret for chaos's services and the ones started after it (through the
# environment: exp_chaos prints its flags).
SECRET=whsec_$(head -c 32 /dev/urandom | base64)
export CHAOS_WEBHOOK_SECRET=$SECRET
exp_chaos replay --transport http --webhook-max-attempts 2 \
  --webhook-schedule-scale "$SCALE" --webhook-timeout-ms "$TIMEOUT_MS" \
  --fault receiver-errors --fault-count 1 --fault-down-ms 3000 --fault-interval-ms 2000..2000 \
  --rate "$RATE" --duration 8 --retry-rate 0 --protocol http --seed 9 || true
unset CHAOS_WEBHOOK_SECRET
# A delivery the relay gave up on can still have been applied: an attempt
# that timed out at the sender after the receiver had committed, its later
# attempts then answered 500. Recon counts the failed deliveries and the
# orders without their charge apart; the difference is these (read before
# the replay changes them).
psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "SELECT count(*) FROM orders.webhook_deliveries w \
  WHERE w.failed_at IS NOT NULL AND EXISTS (SELECT 1 FROM payments.charges c WHERE c.order_id = w.aggregate_id)" \
  >"$RES/replay-applied.txt"
say "replay the failed deliveries to a working receiver"
LOGS=$RES/logs/replay-after
mkdir -p "$LOGS"
trap pipeline_stop EXIT
pipeline_webhooks "$LOGS" 127.0.0.1:18411 127.0.0.1:18412 127.0.0.1:18413 "$SECRET"
# The receiver listens elsewhere now: the operator points the destination at
# it (a relay's --webhook-destination flag adds a missing destination and
# never replaces one the database has), then replays.
DATABASE_URL=$RELAY_DATABASE_URL "$BIN/relay" webhooks add \
  "payments=http://127.0.0.1:18413/webhooks/orders,secret=$SECRET,allow-http" | tee "$RES/replay-add.txt"
sleep 3 # running relays re-read the destinations every 2 s (DESTINATIONS_REFRESH)
DATABASE_URL=$RELAY_DATABASE_URL "$BIN/relay" webhooks status | tee "$RES/replay-status-before.txt"
DATABASE_URL=$RELAY_DATABASE_URL "$BIN/relay" webhooks replay --failed | tee "$RES/replay.txt"
set +e
DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --wait-drained 60 --json >"$RES/replay-recon.json"
set -e
DATABASE_URL=$RELAY_DATABASE_URL "$BIN/relay" webhooks status | tee "$RES/replay-status-after.txt"
pipeline_stop
trap - EXIT

python3 "$ROOT/experiments/lib/exp9.py" "$RES" "$MODE" "$MIN_KILLS" "$SCALE" && status=0 || status=$?

# The schedule observed beside the scheduled one (needs the project venv).
if [ -s "$RES/schedule.csv" ] && { [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; }; then
  "$ROOT/.tools/venv/bin/python" "$ROOT/scripts/plot.py" curve "$RES/schedule.csv" -o "$RES/schedule.png" \
    --x failed_attempts --y earliest_ms,latest_ms,observed_min_ms,observed_p50_ms,observed_max_ms --logy \
    --title "exp-9: the wait before each retry, scheduled (x$SCALE, jitter 0.8-1.2) and observed ($MODE)" \
    || echo "exp-9: plot failed (see schedule.csv)" >&2
fi
exit "$status"
