#!/usr/bin/env bash
# Experiment 8: infrastructure faults under load — PostgreSQL crashed, a
# Kafka node killed, two of three killed (quorum loss), a node paused out of
# the ISR, the relay hung past its session limit, the consumer group's
# offsets reset — mixed with kill -9 at every crash point and duplicate
# delivery. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-8-infra-faults
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

# pg-crash and broker-kill crash the stack itself: the embedded one through
# scripts/stack.sh; another stack needs CHAOS_STACK_SCRIPT (see README.md).
ALL_FAULTS=pg-crash,broker-kill,broker-quorum-loss,broker-pause,relay-pause,offset-reset
ALL_POINTS=commit,publish,claim,effect
if [ "$MODE" = quick ]; then
  # 180 s: a Kafka node killed -9 recovers every partition it holds before it
  # serves again: ~25 s under this load on a fresh cluster, ~50 s with the
  # thousand-odd test topics `make test` leaves behind (CI).
  RATE=${EXP_RATE:-200} MIXED_DURATION=${EXP_DURATION:-180}
  MIXED=(--fault "$ALL_FAULTS" --fault-count 6 --fault-interval-ms 2000..3000
         --relay-pause-ms 4000 --fault-down-ms 1000 --broker-pause-ms 12000
         --crash-point "$ALL_POINTS" --crash-probability 0.01)
  MIN_KILLS=4 MIN_PER_FAULT=1
else
  # On the 3-node cluster a round of the six faults took 128 s alone and
  # 275 s in the mixed run when a killed node served again after ~30 s, but
  # 190 s and 260 s in a run where it took 52-78 s (FINDINGS §10): 1,000 s
  # and 1,650 s then fit 5 and 4-5 rounds, under the minimums of 6 and 5.
  # A fixed length fits a varying number of rounds; chaos should keep the
  # load on until --fault-count faults have recovered (not done yet).
  RATE=${EXP_RATE:-300} MIXED_DURATION=${EXP_DURATION:-1650}
  # Part 1: each fault again and again, nothing else, for clean recovery times.
  exp_chaos each-fault --rate "$RATE" --duration "${EXP_EACH_DURATION:-1000}" --retry-rate 0.15 \
    --protocol mixed --seed 8 --fault "$ALL_FAULTS" --fault-count 60 --fault-interval-ms 2000..4000 \
    --relay-pause-ms 8000 --fault-down-ms 2000 \
    --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=1000 || true
  # Part 2: the long run — every crash point, random kills of every service,
  # every infrastructure fault and duplicates, all at once.
  MIXED=(--fault "$ALL_FAULTS" --fault-interval-ms 15000..30000 --relay-pause-ms 8000 --fault-down-ms 2000
         --crash-point "$ALL_POINTS" --crash-probability 0.01
         --random-kill orders,relay,payments --kill-interval-ms 1500..4000)
  MIN_KILLS=1000 MIN_PER_FAULT=5
fi

exp_chaos mixed --rate "$RATE" --duration "$MIXED_DURATION" --retry-rate 0.15 --protocol mixed --seed 8 \
  --dup-rate 0.05 "${MIXED[@]}" --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=1000 || true

python3 "$ROOT/experiments/lib/exp8.py" "$RES" "$MODE" "$MIN_KILLS" "$MIN_PER_FAULT"
