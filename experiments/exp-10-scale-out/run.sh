#!/usr/bin/env bash
# Experiment 10: scale-out — every service as several instances on the real
# cluster, the payments consumer group scaled up and down under load (its
# partitions moving with batches in flight), kill -9 of any instance. See
# README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-10-scale-out
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

# The load's client retries what got no answer (an orders instance killed
# mid-request), on the next instance.
CLIENT=(--retry-rate 0.15 --protocol mixed --loadgen-arg=--retry-on-error --loadgen-arg=10
        --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=500)
if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-150} DURATION=${EXP_DURATION:-30} MAX_DURATION=${EXP_MAX_DURATION:-240}
  STEPS=4 MIN_KILLS=20 KILL_DURATION=${EXP_KILL_DURATION:-40}
  SCALE_RUNS=(scale-dynamic)
else
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-300} MAX_DURATION=${EXP_MAX_DURATION:-1200}
  STEPS=16 MIN_KILLS=400 KILL_DURATION=${EXP_KILL_DURATION:-600}
  SCALE_RUNS=(scale-dynamic scale-static)
fi

# The scale runs: 2 orders, 2 relays, 6 payments (one per partition of the
# topic); the group scaled 6 -> 1 -> 6 -> 2 -> 6 ... in turn, a member killed
# mid-batch now and then (crash point effect). No kills from outside: a
# killed member's partitions wait out its session (10 s), which would hide
# what a clean step costs.
for tag in "${SCALE_RUNS[@]}"; do
  static=false
  [ "$tag" = scale-static ] && static=true
  exp_chaos "$tag" --orders 2 --relays 2 --payments 6 --static-membership "$static" \
    --rate "$RATE" --duration "$DURATION" --max-duration "$MAX_DURATION" --seed 10 "${CLIENT[@]}" \
    --fault payments-scale --payments-scale 1,6,2,6 --fault-count "$STEPS" --fault-interval-ms 3000..6000 \
    --crash-point effect --crash-probability 0.0005 || true
done

# Every service as several instances, every instance open to kill -9 (its
# crash points and from outside), duplicates injected.
exp_chaos instances --orders 2 --relays 3 --payments 3 --rate "$RATE" --duration "$KILL_DURATION" \
  --seed 10 "${CLIENT[@]}" --dup-rate 0.05 \
  --crash-point commit,publish,claim,effect --crash-probability 0.005 \
  --random-kill orders,relay,payments --kill-interval-ms 700..1500 || true

python3 "$ROOT/experiments/lib/exp10.py" "$RES" "$MODE" "$MIN_KILLS" "$STEPS"
