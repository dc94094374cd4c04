#!/usr/bin/env bash
# Experiment 11: the database fails over. The pipeline under load on the
# PostgreSQL cluster (STACK_PG=ha: three nodes under Patroni behind HAProxy,
# synchronous replication) through its faults, mixed with kill -9 at every
# crash point and duplicate delivery. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-11-failover
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
# The cluster, synchronous; the stack's PostgreSQL put back after the run (the
# other experiments run on the single node).
exp_pg_cluster on
exp_init "$HERE"
"$ROOT/scripts/stack.sh" pg check

POINTS=commit,publish,claim,effect
# Every run's load lasts until its faults are done (each injected and
# recovered): a failover waits out the leader key's 20 s TTL.
# Quick mode leaves the lagged failover to the asynchronous run: two
# outages of 20-28 s 3-5 s apart pile the client's resends past its
# --max-in-flight on a slow machine, and a dropped send leaves its key
# ambiguous, which the synchronous run does not allow.
if [ "$MODE" = quick ]; then
  FAULTS=pg-failover,pg-switchover,pg-standby-loss,pg-partition,pg-crash
  RATE=${EXP_RATE:-150} DURATION=${EXP_DURATION:-60} MAX_DURATION=${EXP_MAX_DURATION:-480}
  COUNT=5 INTERVAL=3000..5000 MIN_KILLS=2 MIN_PER_FAULT=1
  ASYNC_DURATION=${EXP_DURATION:-45} ASYNC_COUNT=2 WAL_DURATION=${EXP_DURATION:-45} WAL_COUNT=3
else
  FAULTS=pg-failover,pg-lagged-failover,pg-switchover,pg-standby-loss,pg-partition,pg-crash
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-900} MAX_DURATION=${EXP_MAX_DURATION:-2700}
  COUNT=30 INTERVAL=15000..30000 MIN_KILLS=20 MIN_PER_FAULT=5
  ASYNC_DURATION=${EXP_DURATION:-300} ASYNC_COUNT=5 WAL_DURATION=${EXP_DURATION:-300} WAL_COUNT=9
fi
# pg-lagged-failover: the primary's WAL senders stopped this long first.
LAG_MS=2000
# pg-partition: the primary cut off this long, past the leader key's 20 s
# TTL, so that another node is promoted while it still runs.
PARTITION_MS=30000
# The WAL relay's run: a switch of each kind that moves the primary or
# restarts it.
WAL_FAULTS=pg-failover,pg-switchover,pg-crash

# The synchronous run: no acknowledged commit may be lost, so recon must be
# CLEAN and every key the client saw succeed must have its one order.
exp_chaos sync --rate "$RATE" --duration "$DURATION" --max-duration "$MAX_DURATION" --retry-rate 0.15 \
  --protocol mixed --seed 11 --dup-rate 0.05 --fault "$FAULTS" --fault-count "$COUNT" \
  --fault-interval-ms "$INTERVAL" --fault-down-ms 5000 --pg-lag-ms "$LAG_MS" --pg-partition-ms "$PARTITION_MS" --crash-point "$POINTS" \
  --crash-probability 0.01 \
  --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=2000 || true

# The WAL relay through the cluster's switches (synchronous): its slot is on
# the primary only (PostgreSQL 15 keeps no logical slot on a standby, and
# Patroni drops the slots it does not manage when a node restarts), so after
# each switch the relay makes a new slot on the new primary and first
# publishes, by the poll path, every row that primary holds as pending: the
# marks are commits like the rows, replicated the same way, so nothing is
# skipped. Recon must be CLEAN.
RELAY_MODE=wal exp_chaos wal --rate "$RATE" --duration "$WAL_DURATION" --max-duration "$MAX_DURATION" \
  --retry-rate 0.15 --protocol mixed --seed 13 --dup-rate 0.05 --fault "$WAL_FAULTS" --fault-count "$WAL_COUNT" \
  --fault-interval-ms "$INTERVAL" --fault-down-ms 5000 --crash-point publish --crash-probability 0.01 \
  --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=2000 || true

# The asynchronous counter-example: the same cluster with synchronous mode
# off and Patroni free to promote a replica that is behind, the same client,
# and only the lagged failover (no kill -9, no duplicates: whatever recon and
# the intents check find is the failover's). It must lose acknowledged
# orders, and recon must name what that did downstream.
exp_pg_cluster off
"$ROOT/scripts/stack.sh" up >/dev/null
"$ROOT/scripts/stack.sh" pg check
exp_chaos async --rate "$RATE" --duration "$ASYNC_DURATION" --max-duration "$MAX_DURATION" --retry-rate 0.15 \
  --protocol mixed --seed 12 --fault pg-lagged-failover --fault-count "$ASYNC_COUNT" \
  --fault-interval-ms "$INTERVAL" --fault-down-ms 5000 --pg-lag-ms "$LAG_MS" --drain-timeout 60 \
  --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=2000 || true

python3 "$ROOT/experiments/lib/exp11.py" "$RES" "$MODE" "$MIN_KILLS" "$MIN_PER_FAULT"
