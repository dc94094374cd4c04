#!/usr/bin/env bash
# make bench-recon: recon's time on a consistent pipeline of N orders
# (orders, outbox, inbox, charges, ledger: crates/recon/src/seed.sql; the
# keys with their stored responses: crates/recon/examples/seed.rs, which
# runs both), for
# each size in BENCH_RECON_SIZES ("1000000 10000000"), BENCH_RECON_REPS (3)
# runs each: median, min and max of the diff's own time (`recon --json`'s
# diff_seconds), the seeding time and the database size. Every run must be
# CLEAN (exit 0), or the benchmark fails.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SIZES=${BENCH_RECON_SIZES:-1000000 10000000}
REPS=${BENCH_RECON_REPS:-3}
RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results/recon-$RUN
mkdir -p "$OUT"
BIN=$ROOT/target/release
log() { printf 'bench: %s\n' "$*" >&2; }

STACK_KAFKA=0 scripts/stack.sh up >/dev/null
. .stack/env
log "building (release)"
cargo build -q --release -p orders -p recon
cargo build -q --release -p recon --example seed
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"

printf 'orders\tseed_s\trecon_median_s\trecon_min_s\trecon_max_s\tdb_size\n' >"$OUT/recon.tsv"
for n in $SIZES; do
  pipeline_db bench_recon
  log "seeding $n orders"
  start=$(date +%s.%N)
  "$BIN/examples/seed" "$DB_URL" "$n"
  seed=$(echo "$(date +%s.%N) - $start" | bc)
  times=()
  for r in $(seq 1 "$REPS"); do
    DATABASE_URL=$RECON_DATABASE_URL RUST_LOG=warn "$BIN/recon" --json >"$OUT/recon-$n-$r.json" \
      || { log "recon not CLEAN on the seed of $n orders: $OUT/recon-$n-$r.json"; exit 1; }
    t=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["diff_seconds"])' "$OUT/recon-$n-$r.json")
    log "  $n orders, run $r: diff $t s"
    times+=("$t")
  done
  size=$(psql "$DB_URL" -qAt -c "SELECT pg_size_pretty(pg_database_size(current_database()))")
  stats=$(printf '%s\n' "${times[@]}" | python3 -c 'import sys,statistics as s; v=[float(x) for x in sys.stdin]; print(f"{s.median(v):.2f}\t{min(v):.2f}\t{max(v):.2f}")')
  printf '%s\t%.0f\t%s\t%s\n' "$n" "$seed" "$stats" "$size" >>"$OUT/recon.tsv"
done
psql "$STACK_ADMIN_DATABASE_URL" -qAt -c "DROP DATABASE IF EXISTS bench_recon WITH (FORCE)" >/dev/null
column -t -s $'\t' "$OUT/recon.tsv"
log "results: $OUT/recon.tsv"
