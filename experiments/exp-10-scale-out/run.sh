#!/usr/bin/env bash
# Experiment 10: scale-out — every service as several instances on the real
# cluster, the payments consumer group scaled up and down under load (its
# partitions moving with batches in flight), kill -9 of any instance, and
# faults on the network (the cluster in network namespaces). See README.md
# beside this file.
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
  NET_FAULTS=4 NET_FAULT_MS=10000
else
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-300} MAX_DURATION=${EXP_MAX_DURATION:-1200}
  STEPS=16 MIN_KILLS=400 KILL_DURATION=${EXP_KILL_DURATION:-600}
  SCALE_RUNS=(scale-dynamic scale-static)
  NET_FAULTS=12 NET_FAULT_MS=15000
fi

# EXP10_PARTS (a list of scale, instances, matrix, network; default all) runs
# only those parts, e.g. EXP10_PARTS=network EXP_RES_NAME=full-network.
PARTS=${EXP10_PARTS:-scale instances matrix network}
part() { [[ " ${PARTS//,/ } " == *" $1 "* ]]; }

# The scale runs: 2 orders, 2 relays, 6 payments (one per partition of the
# topic); the group scaled 6 -> 1 -> 6 -> 2 -> 6 ... in turn, a member killed
# mid-batch now and then (crash point effect). No kills from outside: a
# killed member's partitions wait out its session (10 s), which would hide
# what a clean step costs.
part scale || SCALE_RUNS=()
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
part instances && exp_chaos instances --orders 2 --relays 3 --payments 3 --rate "$RATE" --duration "$KILL_DURATION" \
  --seed 10 "${CLIENT[@]}" --dup-rate 0.05 \
  --crash-point commit,publish,claim,effect --crash-probability 0.005 \
  --random-kill orders,relay,payments --kill-interval-ms 700..1500 || true

# Side by side, no faults: the same load through 1, 2, 3 and 6 payments
# instances and 1 to 3 relays (RxP: relays x payments); each run's
# commit→effect, order by order, from the outbox row's created_at to its
# charge's (both now() in their transactions), in RES/matrix-*-latency.json.
if [ "$MODE" = quick ]; then
  MATRIX=(1x1 2x3) MATRIX_RATE=${EXP_MATRIX_RATE:-300} MATRIX_S=20
else
  MATRIX=(1x1 1x2 1x3 1x6 2x6 3x6 3x1) MATRIX_RATE=${EXP_MATRIX_RATE:-1000} MATRIX_S=60
fi
part matrix || MATRIX=()
# A warm-up first, not judged: the first load after the cluster (re)started
# ran 2-4x slower on every stage, the relay's included, whatever the
# instances (FINDINGS §12, "Side by side").
if [ ${#MATRIX[@]} -gt 0 ]; then
  exp_chaos matrix-warmup --orders 1 --relays 1 --payments 1 --rate "$MATRIX_RATE" \
    --duration "$((MATRIX_S / 2))" --seed 10 --retry-rate 0.15 --protocol mixed || true
fi
for rp in "${MATRIX[@]}"; do
  exp_chaos "matrix-$rp" --orders 1 --relays "${rp%x*}" --payments "${rp#*x}" --rate "$MATRIX_RATE" \
    --duration "$MATRIX_S" --seed 10 --retry-rate 0.15 --protocol mixed || true
  psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "
    SELECT json_build_object('orders', count(*), 'applied', count(ms),
      'p50_ms', round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1),
      'p99_ms', round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1),
      'max_ms', round(max(ms)::numeric, 1),
      'publish_p50_ms', round(percentile_cont(0.5) WITHIN GROUP (ORDER BY pub_ms)::numeric, 1),
      'publish_p99_ms', round(percentile_cont(0.99) WITHIN GROUP (ORDER BY pub_ms)::numeric, 1),
      'applied_per_s', round((count(ms) / nullif(extract(epoch FROM max(applied) - min(committed)), 0))::numeric, 1))
    FROM (SELECT o.created_at AS committed, c.created_at AS applied,
                 extract(epoch FROM c.created_at - o.created_at) * 1000 AS ms,
                 extract(epoch FROM o.published_at - o.created_at) * 1000 AS pub_ms
          FROM orders.outbox o LEFT JOIN payments.charges c ON c.order_id = o.aggregate_id
          WHERE o.event_type = 'order.created') t" >"$RES/matrix-$rp-latency.json" || true
done

# The network: the Kafka nodes each in a network namespace of its own
# (the cluster restarted there on fresh storage), then faults on the wire
# under load, in turn: a partitioned leader, latency and loss between the
# services and the nodes, a relay cut off from the nodes holding its leases,
# a payments instance cut off from PostgreSQL mid-transaction. The stack goes
# back to the network it was on at the end.
if ! part network; then
  NET_FAULTS=0
elif [ -n "${STACK_ENV_FILE:-}" ]; then
  NET_FAULTS=0
  say "network run skipped: it needs the embedded stack (STACK_ENV_FILE is set)"
else
  exp_netns
  pipeline_stack
  exp_chaos network --orders 1 --relays 2 --payments 3 --rate "$RATE" --duration "$DURATION" \
    --max-duration "$MAX_DURATION" --seed 10 "${CLIENT[@]}" --dup-rate 0.02 \
    --fault broker-partition,net-lag,relay-cut,payments-db-cut --fault-count "$NET_FAULTS" \
    --fault-interval-ms 3000..6000 --net-fault-ms "$NET_FAULT_MS" || true
fi

python3 "$ROOT/experiments/lib/exp10.py" "$RES" "$MODE" "$MIN_KILLS" "$STEPS" "$NET_FAULTS" "${PARTS// /,}"
