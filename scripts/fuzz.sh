#!/usr/bin/env bash
# make fuzz: the property tests at fuzzing scale. The same properties as in
# `make test` (crates/orders/tests/it/props.rs: the HTTP router in process on a
# real database; crates/payments/tests/it/props.rs: the message decoder, and
# the dead letters written to a real database), with many more cases:
#   FUZZ_DECODE_CASES       decoder batches, no database      (1,000,000)
#   FUZZ_ROUTER_CASES       requests through the router        (1,000,000)
#   FUZZ_DEAD_LETTER_CASES  batches applied and read back      (20,000)
#   FUZZ_PROFILE            cargo profile: release, or debug (dev) (release)
# Prints each property's count, time and outcomes, then the total; fails on
# the first counter-example (proptest prints it, shrunk). Uses the embedded
# stack (started if needed), or the one whose env file is in $STACK_DIR.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DECODE=${FUZZ_DECODE_CASES:-1000000}
ROUTER=${FUZZ_ROUTER_CASES:-1000000}
DEAD=${FUZZ_DEAD_LETTER_CASES:-20000}
PROFILE=${FUZZ_PROFILE:-release}
if [ "$PROFILE" = debug ]; then PROFILE=dev; fi # cargo's name for the test build
log() { printf 'fuzz: %s\n' "$*" >&2; }

if [ -z "${STACK_DIR:-}" ]; then
  STACK_KAFKA=0 scripts/stack.sh up >/dev/null
fi
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
log "building the property tests ($PROFILE)"
cargo nextest run --cargo-quiet --cargo-profile "$PROFILE" -p orders -p payments --test it --no-run
log "running: $DECODE decoder, $ROUTER router, $DEAD dead-letter cases"
start=$(date +%s)
PROPS_DECODE_CASES=$DECODE PROPS_ROUTER_CASES=$ROUTER PROPS_DEAD_LETTER_CASES=$DEAD \
  cargo nextest run --cargo-quiet --cargo-profile "$PROFILE" -p orders -p payments --test it props:: \
  --success-output final --failure-output final --no-fail-fast >"$OUT" 2>&1 || {
  cat "$OUT"
  log "FAILED after $(($(date +%s) - start)) s"
  exit 1
}
wall=$(($(date +%s) - start))
grep -E '^ *[a-z-]+ property: ' "$OUT" | sed 's/^ *//'
total=$(grep -oE '^ *[a-z-]+ property: [0-9]+ cases' "$OUT" | awk '{ n += $3 } END { print n + 0 }')
log "total: $total cases in ${wall} s wall (the three properties run side by side on $(nproc) cores)"
