#!/usr/bin/env bash
# make pg-ha-check: the HA database (STACK_PG=ha, scripts/lib/pg-ha.sh) on a
# stack of its own (.stack/ha-check, its own ports, no Kafka), under a write
# loop through HAProxy, through two faults:
#  1. a planned switchover to the synchronous standby (patronictl);
#  2. a failover: the primary's Patroni and postmaster killed -9 at once,
#     so the leader key expires and Patroni promotes the synchronous standby;
#     the killed node then comes back (`up`) and rejoins as a replica.
# After each: how long no write was accepted, and every write the loop saw
# acknowledged read back from the new primary. With synchronous replication
# (PG_HA_SYNC=on, the default) none may be missing: the check fails if one
# is, or if no primary accepts writes within 60 s. PG_HA_SYNC=off runs the
# same asynchronously and reports what is missing without failing (the
# counter-example: a low write rate may lose nothing, which proves nothing).
# Settings: PG_HA_WRITERS (3 loops), PG_HA_SECONDS (how long the write
# loops run after each fault, 40: past the leader key's 20 s TTL).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export STACK_DIR=$ROOT/.stack/ha-check STACK_KAFKA=0 STACK_PG=ha STACK_PG_SYNC=${PG_HA_SYNC:-on}
export STACK_PG_PORT=26432 STACK_HA_PG_PORT=26441 STACK_HA_REST_PORT=28101 STACK_HA_ETCD_PORT=22479
WRITERS=${PG_HA_WRITERS:-3}
SECONDS_AFTER=${PG_HA_SECONDS:-40}
OUT=$STACK_DIR/check
say() { printf '\n== %s\n' "$*"; }
fail() { echo "pg-ha-check: FAIL: $*" >&2; exit 1; }
stack() { scripts/stack.sh "$@"; }
trap 'stack down >/dev/null 2>&1 || true' EXIT

say "the cluster up (synchronous $STACK_PG_SYNC)"
stack up >/dev/null
# shellcheck source=/dev/null
. "$STACK_DIR/env"
# shellcheck source=scripts/lib/pg-ha.sh
. scripts/lib/pg-ha.sh 2>/dev/null || true
URL=$DATABASE_URL
q() { psql "$URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
wait_for() { # wait_for SECONDS SQL: until SQL answers t
  local deadline=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    [ "$(q "$2" 2>/dev/null)" = t ] && return 0
    sleep 0.5
  done
  return 1
}
wait_for 120 "SELECT count(*) = 2 FROM pg_stat_replication WHERE state = 'streaming'" || fail "two streaming replicas within 120 s"
if [ "$STACK_PG_SYNC" = on ]; then
  wait_for 60 "SELECT count(*) = 1 FROM pg_stat_replication WHERE sync_state = 'sync'" || fail "a synchronous standby within 60 s"
fi
q "SELECT application_name || ' ' || sync_state FROM pg_stat_replication ORDER BY 1" | sed 's/^/  standby /'
q "DROP TABLE IF EXISTS ha_check; CREATE TABLE ha_check (id bigserial PRIMARY KEY, writer int, at timestamptz DEFAULT clock_timestamp())"
rm -rf "$OUT"; mkdir -p "$OUT"

# writers TAG: WRITERS loops of one INSERT per connection (each a new
# connection through HAProxy, as a pool's after a failover), for 3 s and
# SECONDS_AFTER s more; every acknowledged id in OUT/TAG.acked.W (and when,
# in OUT/TAG.times.W), every refused attempt's time in OUT/TAG.refused.W.
writers() {
  local tag=$1 w
  for w in $(seq 1 "$WRITERS"); do
    (
      end=$(($(date +%s) + 3 + SECONDS_AFTER))
      while [ "$(date +%s)" -lt "$end" ]; do
        if id=$(psql "$URL" -qAt -c "INSERT INTO ha_check (writer) VALUES ($w) RETURNING id" 2>/dev/null) && [ -n "$id" ]; then
          echo "$id" >>"$OUT/$tag.acked.$w"
          date +%s.%N >>"$OUT/$tag.times.$w"
        else
          date +%s.%N >>"$OUT/$tag.refused.$w"
          sleep 0.1
        fi
      done
    ) &
  done
}

# judge TAG FAULT_AT: how long after the fault the first write was
# accepted again; every acknowledged id read back.
judge() {
  local tag=$1 at=$2 acked missing gap
  cat "$OUT/$tag".acked.* 2>/dev/null | sort >"$OUT/$tag.acked"
  cat "$OUT/$tag".refused.* 2>/dev/null | sort -g >"$OUT/$tag.refused" || true
  acked=$(wc -l <"$OUT/$tag.acked")
  q "SELECT id FROM ha_check" | sort >"$OUT/$tag.present"
  missing=$(comm -23 "$OUT/$tag.acked" "$OUT/$tag.present" | wc -l)
  # The first write accepted after the last refusal that followed the fault.
  gap=$(cat "$OUT/$tag".times.* | awk -v at="$at" -v last="$(awk -v at="$at" '$1 > at { l = $1 } END { printf "%.6f", l + 0 }' "$OUT/$tag.refused")" '
    $1 > at && $1 > last && (!first || $1 < first) { first = $1 } END { if (!first) print "none"; else printf "%.1f", first - at }')
  [ "$gap" != none ] || fail "no write accepted again within $SECONDS_AFTER s of the $tag"
  printf '  %-11s acknowledged %6d  missing after it %3d  refused %4d  writes accepted again %5s s after the fault  new primary pg%s\n' \
    "$tag" "$acked" "$missing" "$(wc -l <"$OUT/$tag.refused")" "$gap" "$(ha_leader || echo '?')"
  echo "$tag $acked $missing $gap" >>"$OUT/summary.txt"
  if [ "$missing" != 0 ] && [ "$STACK_PG_SYNC" = on ]; then
    fail "$missing acknowledged writes missing after the $tag (synchronous mode)"
  fi
}

say "1. switchover (planned) under $WRITERS write loops"
writers switchover
sleep 3
leader=$(ha_leader)
at=$(date +%s.%N)
patronictl -c "$STACK_DIR/ha/pg$leader/patroni.yml" switchover --leader "pg$leader" --force >"$OUT/switchover.log" 2>&1 ||
  fail "patronictl switchover (see $OUT/switchover.log)"
wait
wait_for 60 "SELECT NOT pg_is_in_recovery()" || fail "no writable primary within 60 s of the switchover"
judge switchover "$at"
wait_for 120 "SELECT count(*) = 2 FROM pg_stat_replication WHERE state = 'streaming'" || fail "the old primary back as a replica within 120 s"

say "2. failover: the primary's Patroni and postmaster killed -9"
writers failover
sleep 3
leader=$(ha_leader)
at=$(date +%s.%N)
kill -9 "$(cat "$STACK_DIR/ha/pg$leader/patroni.pid")" "$(head -1 "$STACK_DIR/ha/pg$leader/data/postmaster.pid")"
wait
wait_for 60 "SELECT NOT pg_is_in_recovery()" || fail "no writable primary within 60 s of the failover"
judge failover "$at"
say "the killed node pg$leader back (stack up): it rejoins as a replica"
stack up >/dev/null
wait_for 120 "SELECT count(*) = 2 FROM pg_stat_replication WHERE state = 'streaming'" || fail "pg$leader back as a replica within 120 s"
q "SELECT application_name || ' ' || sync_state FROM pg_stat_replication ORDER BY 1" | sed 's/^/  standby /'
echo "pg-ha-check: PASS (synchronous $STACK_PG_SYNC; $OUT/summary.txt)"
