#!/usr/bin/env bash
# Experiment 4: kill -9 payments between charge and commit (`effect`) and
# between inbox claim and charge (`claim`): nothing lost, nothing doubled.
# Then the counter-example: inbox and effect in two transactions
# (--unsafe-split-txn), killed between them: inbox-first loses effects,
# effect-first doubles them. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-4-payments-kill
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-15} EVERY=${EXP_CRASH_EVERY:-15} MIN_KILLS=3
else
  RATE=${EXP_RATE:-500} DURATION=${EXP_DURATION:-60} EVERY=${EXP_CRASH_EVERY:-25} MIN_KILLS=10
fi
# Chaos runs payments with static group membership, so a restarted consumer
# takes its partitions back at once. The full mode also runs `effect` without
# it: then every kill waits out the dead member's session (kept at 6 s).
export PAYMENTS_SESSION_TIMEOUT_MS=${PAYMENTS_SESSION_TIMEOUT_MS:-6000}

common=(--rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed --crash-every "$EVERY" --seed 4)
# A run's verdict is read from its chaos summary (recon_exit) below; a DRIFT
# exit must not stop the script, the counter-example expects it.
for run in effect claim; do
  exp_chaos "payments-$run" "${common[@]}" --crash-point "$run" || true
done
if [ "$MODE" = full ]; then
  exp_chaos payments-effect-dynamic "${common[@]}" --crash-point effect --static-membership false || true
fi
for split in inbox-first effect-first; do
  exp_chaos "split-$split" "${common[@]}" --crash-point split --unsafe-split-txn "$split" || true
done

python3 "$ROOT/experiments/lib/exp4.py" "$RES" "$MODE" "$MIN_KILLS"
