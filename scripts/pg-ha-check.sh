#!/usr/bin/env bash
# make pg-ha-check: the HA database (STACK_PG=ha, scripts/lib/pg-ha.sh) on a
# stack of its own (.stack/ha-check, its own ports, no Kafka), under a write
# loop through HAProxy, through three faults (after a check of what ends a
# commit's wait for its standby, on a throwaway server: syncrep_wait below):
#  1. a planned switchover to the synchronous standby (patronictl);
#  2. a failover: the primary's Patroni and postmaster killed -9 at once,
#     so the leader key expires and Patroni promotes the synchronous standby;
#     the killed node then comes back and rejoins as a replica;
#  3. the synchronous standby killed -9 with its Patroni for
#     PG_HA_STANDBY_DOWN_MS (15 s): commits wait until Patroni names the
#     other replica synchronous (the longest stall is printed);
#  4. (as root) the primary cut off from etcd and the other nodes for
#     PG_HA_PARTITION_MS (25 s) while HAProxy still reaches it: it demotes
#     itself, the synchronous standby is promoted, and after the heal the
#     old primary must stream again (rewound, or re-cloned when the rewind
#     fails).
# After each, `stack.sh pg check` must find the cluster whole again (the
# node the fault took away streaming), and says after how long.
# After each: how long no write was accepted, and every write the loop saw
# acknowledged read back from the new primary. With synchronous replication
# (PG_HA_SYNC=on, the default) none may be missing: the check fails if one
# is, or if no primary accepts writes within 60 s. PG_HA_SYNC=off runs the
# same asynchronously and reports what is missing without failing (the
# counter-example: a low write rate may lose nothing, which proves nothing).
# Settings: PG_HA_WRITERS (3 loops), PG_HA_SECONDS (how long the write
# loops run after each fault, 40: past the leader key's 20 s TTL),
# PG_HA_STANDBY_DOWN_MS, PG_HA_PARTITION_MS.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export STACK_DIR=$ROOT/.stack/ha-check STACK_KAFKA=0 STACK_PG=ha STACK_PG_SYNC=${PG_HA_SYNC:-on}
export STACK_PG_PORT=26432 STACK_HA_PG_PORT=26441 STACK_HA_REST_PORT=28101 STACK_HA_ETCD_PORT=22479
WRITERS=${PG_HA_WRITERS:-3}
SECONDS_AFTER=${PG_HA_SECONDS:-40}
STANDBY_DOWN_MS=${PG_HA_STANDBY_DOWN_MS:-15000}
PARTITION_MS=${PG_HA_PARTITION_MS:-25000}
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
  local tag=$1 at=$2 acked missing gap stall
  cat "$OUT/$tag".acked.* 2>/dev/null | sort >"$OUT/$tag.acked"
  cat "$OUT/$tag".refused.* 2>/dev/null | sort -g >"$OUT/$tag.refused" || true
  acked=$(wc -l <"$OUT/$tag.acked")
  q "SELECT id FROM ha_check" | sort >"$OUT/$tag.present"
  missing=$(comm -23 "$OUT/$tag.acked" "$OUT/$tag.present" | wc -l)
  # The first write accepted after the last refusal that followed the fault.
  gap=$(cat "$OUT/$tag".times.* | awk -v at="$at" -v last="$(awk -v at="$at" '$1 > at { l = $1 } END { printf "%.6f", l + 0 }' "$OUT/$tag.refused")" '
    $1 > at && $1 > last && (!first || $1 < first) { first = $1 } END { if (!first) print "none"; else printf "%.1f", first - at }')
  [ "$gap" != none ] || fail "no write accepted again within $SECONDS_AFTER s of the $tag"
  # The longest wait between two acknowledgements, any loop's, after the
  # fault (a commit waiting for a standby is refused by nothing: it stalls).
  stall=$(cat "$OUT/$tag".times.* | sort -g | awk -v at="$at" '$1 > at { if (prev && $1 - prev > m) m = $1 - prev; prev = $1 } END { printf "%.1f", m }')
  printf '  %-12s acknowledged %6d  missing after it %3d  refused %4d  writes accepted again %5s s after the fault  longest stall %5s s  primary pg%s\n' \
    "$tag" "$acked" "$missing" "$(wc -l <"$OUT/$tag.refused")" "$gap" "$stall" "$(ha_leader || echo '?')"
  echo "$tag $acked $missing $gap $stall" >>"$OUT/summary.txt"
  if [ "$missing" != 0 ] && [ "$STACK_PG_SYNC" = on ]; then
    fail "$missing acknowledged writes missing after the $tag (synchronous mode)"
  fi
}

# whole TAG: after the fault, the cluster whole again (`stack.sh pg check`:
# the node it took away streaming, rewound or re-cloned), and said when.
whole() {
  stack pg check >"$OUT/$1.whole.log" 2>&1 || fail "the cluster not whole after the $1: $(tail -1 "$OUT/$1.whole.log")"
  [ "$(q "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")" = 2 ] ||
    fail "pg check passed but not two replicas stream after the $1"
  echo "  $(tail -1 "$OUT/$1.whole.log")"
}

# syncrep_wait: what ends a commit's wait for its synchronous standby, on a
# server of its own whose synchronous standby never comes (so every commit
# waits): the services' statement and idle-in-transaction timeouts do not
# (PostgreSQL stops the statement's timer before it commits); a cancel does,
# and reports the commit done, only committed locally (the hazard: no
# service sends one, sqlx has no cancel request); a terminate closes the
# connection with no COMMIT acknowledged (the client sees an ambiguous
# failure and retries with its key).
syncrep_wait() {
  local dir=$STACK_DIR/syncrep bin
  bin=$(dirname "$(readlink -f "$(ls /usr/lib/postgresql/*/bin/pg_ctl | sort -V | tail -1)")")
  rm -rf "$dir"; mkdir -p "$dir"; chmod 0700 "$dir"; chown postgres "$dir"
  runuser -u postgres -- "$bin/initdb" -D "$dir/data" -A trust -U postgres >"$dir/initdb.log" 2>&1 || fail "initdb (see $dir/initdb.log)"
  runuser -u postgres -- "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w -o \
    "-p 26499 -k $dir -c listen_addresses='' -c synchronous_standby_names=nobody" start >/dev/null || fail "the throwaway server (see $dir/log)"
  local P=(psql -h "$dir" -p 26499 -U postgres -d postgres -X)
  local rc1 rc3
  PGOPTIONS='-c synchronous_commit=local' "${P[@]}" -qc "CREATE TABLE w (id int)"
  # 1. The services' session limits, at 1 s: the commit still waits at 4 s.
  timeout 4 "${P[@]}" -c "SET statement_timeout = '1s'" -c "SET idle_in_transaction_session_timeout = '1s'" \
    -c "BEGIN" -c "INSERT INTO w VALUES (1)" -c "COMMIT" >"$dir/timeouts.out" 2>&1 && rc1=0 || rc1=$?
  # 2. A cancel (pg_cancel_backend) of a waiting commit.
  "${P[@]}" -c "BEGIN" -c "INSERT INTO w VALUES (2)" -c "COMMIT" >"$dir/cancel.out" 2>&1 &
  local waiter=$!
  sleep 1.5
  PGOPTIONS='-c synchronous_commit=local' "${P[@]}" -qAtc "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'" >/dev/null
  wait "$waiter" || true
  # 3. A terminate (pg_terminate_backend) of a waiting commit.
  "${P[@]}" -c "BEGIN" -c "INSERT INTO w VALUES (3)" -c "COMMIT" >"$dir/terminate.out" 2>&1 &
  waiter=$!
  sleep 1.5
  PGOPTIONS='-c synchronous_commit=local' "${P[@]}" -qAtc "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'" >/dev/null
  wait "$waiter" && rc3=0 || rc3=$?
  runuser -u postgres -- "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null
  { [ "$rc1" = 124 ] && ! grep -qx COMMIT "$dir/timeouts.out"; } ||
    fail "a commit waiting for its standby returned (exit $rc1) under 1 s statement and idle-in-transaction timeouts: $(cat "$dir/timeouts.out")"
  echo "  statement_timeout, idle_in_transaction_session_timeout 1 s: the commit still waits at 4 s"
  { grep -qx COMMIT "$dir/cancel.out" && grep -q "canceling wait for synchronous replication" "$dir/cancel.out"; } ||
    fail "PostgreSQL no longer acknowledges a cancelled wait as a commit (docs/book/src/failover.md says it does): $(cat "$dir/cancel.out")"
  echo "  pg_cancel_backend: COMMIT acknowledged, only committed locally (WARNING: $(grep -o 'canceling wait[^.]*' "$dir/cancel.out"))"
  { [ "$rc3" != 0 ] && ! grep -qx COMMIT "$dir/terminate.out"; } ||
    fail "a terminated wait acknowledged its commit: $(cat "$dir/terminate.out")"
  echo "  pg_terminate_backend: the connection closed, no COMMIT acknowledged (exit $rc3)"
}

say "0. what ends a commit's wait for its synchronous standby"
syncrep_wait

say "1. switchover (planned) under $WRITERS write loops"
writers switchover
sleep 3
at=$(date +%s.%N)
stack pg switchover >"$OUT/switchover.log" 2>&1 || fail "stack.sh pg switchover (see $OUT/switchover.log)"
wait
wait_for 60 "SELECT NOT pg_is_in_recovery()" || fail "no writable primary within 60 s of the switchover"
judge switchover "$at"
whole switchover

say "2. failover: the primary's Patroni and postmaster killed -9"
writers failover
sleep 3
at=$(date +%s.%N)
# The old primary is started again once another took over (stack.sh pg failover).
stack pg failover 0 >"$OUT/failover.log" 2>&1 || fail "stack.sh pg failover (see $OUT/failover.log)"
wait
wait_for 60 "SELECT NOT pg_is_in_recovery()" || fail "no writable primary within 60 s of the failover"
judge failover "$at"
whole failover
q "SELECT application_name || ' ' || sync_state FROM pg_stat_replication ORDER BY 1" | sed 's/^/  standby /'

say "3. the synchronous standby killed -9 with its Patroni, down ${STANDBY_DOWN_MS} ms"
writers standby-loss
sleep 3
at=$(date +%s.%N)
stack pg standby-loss "$STANDBY_DOWN_MS" >"$OUT/standby-loss.log" 2>&1 || fail "stack.sh pg standby-loss (see $OUT/standby-loss.log)"
sed 's/^/  /' "$OUT/standby-loss.log" | tail -1
wait
judge standby-loss "$at"
whole standby-loss

if [ "$(id -u)" = 0 ]; then
  say "4. the primary cut off from etcd and the other nodes for ${PARTITION_MS} ms, still reached by HAProxy"
  writers partition
  sleep 3
  at=$(date +%s.%N)
  stack pg partition "$PARTITION_MS" >"$OUT/partition.log" 2>&1 || fail "stack.sh pg partition (see $OUT/partition.log)"
  sed 's/^/  /' "$OUT/partition.log" | tail -1
  wait
  judge partition "$at"
  whole partition
  q "SELECT application_name || ' ' || sync_state FROM pg_stat_replication ORDER BY 1" | sed 's/^/  standby /'
else
  say "4. the partition: skipped (firewall rules need root)"
fi
echo "pg-ha-check: PASS (synchronous $STACK_PG_SYNC; $OUT/summary.txt)"
