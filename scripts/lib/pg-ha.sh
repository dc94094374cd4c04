# PostgreSQL with high availability (STACK_PG=ha), sourced by
# scripts/stack.sh (which sets STACK_DIR, PG_PORT, PG_BIN, LOGS, as_pg, log,
# die, port_open, and sources scripts/lib/pg-security.sh and tls.sh first).
#
# Three PostgreSQL 15 nodes, each run by Debian's Patroni (the failover
# manager: it starts, stops, promotes and re-clones its node), their leader
# key in one etcd, all on 127.0.0.1; HAProxy in front on the stack's port
# (PG_PORT, 25432: the URLs in .stack/env do not change) sends every
# connection to the node whose Patroni REST API answers 200 on /primary, and
# closes the connections of a node that stops being it. Why a proxy and not
# a multi-host URL (target_session_attrs=read-write): sqlx connects to one
# host, and psql, the services and the scripts then all follow the primary
# the same way.
#
#   node N (1..3)   PostgreSQL 127.0.0.1:2544N, Patroni REST 127.0.0.1:2800N
#   etcd            127.0.0.1:22379 (client), 22380 (peer)
#   HAProxy         127.0.0.1:PG_PORT -> the primary
#
# STACK_PG_SYNC=on (the default): synchronous replication in Patroni's
# synchronous mode: a commit returns once the synchronous standby has it, and
# Patroni promotes only that standby, so no acknowledged commit is lost.
# STACK_PG_SYNC=off: asynchronous, the counter-example (a promoted standby
# may lack commits the old primary acknowledged), and availability first:
# Patroni may promote a replica up to 1 GiB of WAL behind the last position
# it saw of the primary (maximum_lag_on_failover; synchronous, it keeps its
# default, 1 MiB). Each `up` sets the mode on the running cluster.
#
# Security as the single node's (pg-security.sh): SCRAM passwords over TLS
# only, the superuser over each node's Unix socket as the OS user postgres;
# replication as the role `replicator` (its password in
# $STACK_DIR/secrets/replicator.password). Patroni's configuration holds the
# superuser's and the replicator's passwords: 0600, in 0700 directories.
#
# Fencing: there is no watchdog device on these machines, so a primary cut
# off from etcd is fenced by Patroni itself (it demotes its node when it
# cannot renew the leader key within the TTL) and by HAProxy (it sends no
# connection to a node that does not answer /primary with 200).

HA_DIR=$STACK_DIR/ha
HA_NODES=3
HA_PG_BASE=${STACK_HA_PG_PORT:-25441}
HA_REST_BASE=${STACK_HA_REST_PORT:-28001}
HA_ETCD_PORT=${STACK_HA_ETCD_PORT:-22379}
HA_SYNC=${STACK_PG_SYNC:-$(cat "$HA_DIR/sync" 2>/dev/null || echo on)}
case $HA_SYNC in
  on | off) ;;
  *) echo "stack: error: STACK_PG_SYNC must be on or off, got '$HA_SYNC'" >&2; exit 2 ;;
esac

# ha_max_lag: the most bytes of WAL a replica may be behind and still be
# promoted (see STACK_PG_SYNC above).
ha_max_lag() { if [ "$HA_SYNC" = on ]; then echo 1048576; else echo 1073741824; fi; }

ha_pg_port() { echo $((HA_PG_BASE + $1 - 1)); }
ha_rest_port() { echo $((HA_REST_BASE + $1 - 1)); }
ha_node_dir() { echo "$HA_DIR/pg$1"; }
ha_sock() { echo "$(ha_node_dir "$1")/sock"; }

# ha_pid FILE: the pid in FILE if that process runs and is the cluster's
# (its command line names a file under HA_DIR: a pid reused by another
# process, or a zombie not yet reaped, whose command line is empty, is not).
ha_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF "$HA_DIR/" && echo "$pid"
}

# ha_spawn LOG CMD...: CMD in the background as the OS user postgres, its
# output appended to LOG; $! is CMD's own pid (every step execs the next).
# Without the caller's libpq settings (PGSSLROOTCERT, PGPASSFILE, ...: make
# exports another stack's, and Patroni's pg_rewind then checked the leader's
# certificate against that stack's CA): its configuration says all it needs.
# With CGROUP (a directory under the cgroup v2 root), CMD runs in that
# group, and so does every process it starts, with every socket they open.
ha_spawn() {
  local cgroup=$1 log=$2 unset=() v
  shift 2
  for v in $(compgen -e); do
    case $v in PG*) unset+=(-u "$v") ;; esac
  done
  if [ "$(id -u)" = 0 ]; then
    (
      if [ -n "$cgroup" ]; then echo "$BASHPID" >"$cgroup/cgroup.procs"; fi
      exec env "${unset[@]}" setpriv --reuid=postgres --regid=postgres --init-groups -- "$@" >>"$log" 2>&1
    ) &
  else
    (exec env "${unset[@]}" "$@" >>"$log" 2>&1) &
  fi
}

ensure_ha_installed() {
  local missing=()
  command -v patroni >/dev/null 2>&1 || missing+=(patroni)
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
  command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
  [ ${#missing[@]} = 0 ] && return
  [ "$(id -u)" = 0 ] || die "STACK_PG=ha needs ${missing[*]} (apt-get install ${missing[*]})"
  apt_install "${missing[@]}"
}

ha_etcd_up() {
  if ha_pid "$HA_DIR/etcd.pid" >/dev/null; then return; fi
  mkdir -p "$HA_DIR/etcd"
  chmod 0700 "$HA_DIR/etcd"
  etcd --name stack --data-dir "$HA_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$HA_ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$HA_ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((HA_ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((HA_ETCD_PORT + 1))" \
    --initial-cluster "stack=http://127.0.0.1:$((HA_ETCD_PORT + 1))" >>"$LOGS/etcd.log" 2>&1 &
  echo $! >"$HA_DIR/etcd.pid"
  for _ in $(seq 1 100); do
    ETCDCTL_API=3 etcdctl --endpoints "127.0.0.1:$HA_ETCD_PORT" endpoint health >/dev/null 2>&1 && {
      log "etcd on 127.0.0.1:$HA_ETCD_PORT"
      return
    }
    sleep 0.1
  done
  die "etcd did not start, see $LOGS/etcd.log"
}

# ha_config N: node N's Patroni configuration.
ha_config() {
  local n=$1 dir
  dir=$(ha_node_dir "$n")
  local host=hostssl
  [ "$SECURITY" = plaintext ] && host=host
  local ssl=off
  [ "$SECURITY" = tls ] && ssl=on
  cat <<YAML
# Written by scripts/stack.sh at each \`up\` (STACK_PG=ha, STACK_SECURITY=$SECURITY).
scope: effectively
name: pg$n
# INFO: Patroni's own decisions and pg_rewind's output (a failed rewind says
# why only there), a line per node every loop at most.
log:
  level: INFO
restapi:
  listen: 127.0.0.1:$(ha_rest_port "$n")
  connect_address: 127.0.0.1:$(ha_rest_port "$n")
etcd3:
  hosts: 127.0.0.1:$HA_ETCD_PORT
bootstrap:
  dcs:
    # The leader key's TTL (Patroni's documented minimum is 20 s); a loop
    # every 2 s; 5 s to retry etcd or PostgreSQL before demoting.
    ttl: 20
    loop_wait: 2
    retry_timeout: 5
    synchronous_mode: $([ "$HA_SYNC" = on ] && echo true || echo false)
    maximum_lag_on_failover: $(ha_max_lag)
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_level: logical
        wal_log_hints: 'on'
        hot_standby: 'on'
        max_connections: 400
        max_replication_slots: 64
        max_wal_senders: 64
        max_slot_wal_keep_size: 2GB
        max_wal_size: 4GB
        checkpoint_timeout: 15min
        # A standby retries the primary's WAL every second, not 5 (a
        # promotion waited for it).
        wal_retrieve_retry_interval: 1s
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
    - auth-local: peer
    - auth-host: scram-sha-256
postgresql:
  listen: 127.0.0.1:$(ha_pg_port "$n")
  connect_address: 127.0.0.1:$(ha_pg_port "$n")
  data_dir: $dir/data
  bin_dir: $(dirname "$(readlink -f "$PG_BIN/pg_ctl")")
  pgpass: $dir/pgpass
  use_unix_socket: true
  # A node whose rewind fails, or whose timeline forked off the leader's
  # before its own position, is re-cloned from the leader instead of being
  # left stopped (the cluster a node short, nothing saying so).
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
  # A re-clone asks the primary for an immediate checkpoint: the default, a
  # spread one, waits up to checkpoint_timeout (15 min) before copying a byte.
  basebackup:
    - checkpoint: fast
  authentication:
    # The superuser over TCP: pg_rewind's connection to the new primary.
    superuser:
      username: postgres
      password: '$(cat "$PG_SECRETS/postgres.password")'
      sslmode: $([ "$SECURITY" = tls ] && echo verify-full || echo disable)
      sslrootcert: $TLS_CA
    replication:
      username: replicator
      password: '$(cat "$PG_SECRETS/replicator.password")'
      sslmode: $([ "$SECURITY" = tls ] && echo verify-full || echo disable)
      sslrootcert: $TLS_CA
  parameters:
    unix_socket_directories: '$dir/sock'
    unix_socket_permissions: '0700'
    password_encryption: scram-sha-256
    shared_buffers: 256MB
    shared_preload_libraries: pg_stat_statements
    recovery_init_sync_method: syncfs
    log_min_messages: warning
    ssl: '$ssl'
    ssl_cert_file: '$TLS_DIR/postgres.crt'
    ssl_key_file: '$TLS_DIR/postgres.key'
    ssl_min_protocol_version: TLSv1.2
  pg_hba:
    - local all postgres peer map=stack
    - local replication postgres peer map=stack
    - $host replication replicator 127.0.0.1/32 scram-sha-256
    - $host replication effectively_relay 127.0.0.1/32 scram-sha-256
    - $host all all 127.0.0.1/32 scram-sha-256
  pg_ident:
    - stack postgres postgres
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
  nosync: false
YAML
}

ha_haproxy_config() {
  cat <<CFG
# Written by scripts/stack.sh (STACK_PG=ha): every connection to the primary.
global
  maxconn 4000
  pidfile $HA_DIR/haproxy.pid
defaults
  mode tcp
  timeout connect 2s
  timeout client 60m
  timeout server 60m
  timeout check 1s
listen primary
  bind 127.0.0.1:$PG_PORT
  option httpchk GET /primary
  http-check expect status 200
  default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
CFG
  local n
  for n in $(seq 1 "$HA_NODES"); do
    echo "  server pg$n 127.0.0.1:$(ha_pg_port "$n") check port $(ha_rest_port "$n")"
  done
}

# Node N's cgroup: a v2 group of its own for its Patroni, its PostgreSQL and
# every process they start, which `pg partition` matches in its firewall
# rules (iptables -m cgroup --path). Root only; none without a cgroup v2
# hierarchy (the partition then says so).
ha_cgroup() { echo "eff-$NET_ID-pg$1"; }
cgroup2_root() {
  awk '{ for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup2") { print $5; exit } break } }' /proc/self/mountinfo
}
# ha_cgroup_make N: node N's cgroup made; prints its directory.
ha_cgroup_make() {
  local root dir
  [ "$(id -u)" = 0 ] || return 1
  root=$(cgroup2_root)
  [ -n "$root" ] || return 1
  dir=$root/$(ha_cgroup "$1")
  mkdir -p "$dir" 2>/dev/null || return 1
  echo "$dir"
}
# ha_cgroups_remove: the nodes' cgroups gone (those no process is left in).
ha_cgroups_remove() {
  local root n
  root=$(cgroup2_root)
  [ -n "$root" ] || return 0
  for n in $(seq 1 "$HA_NODES"); do rmdir "$root/$(ha_cgroup "$n")" 2>/dev/null || true; done
}

# ha_node_up N: node N's Patroni, if it does not run.
ha_node_up() {
  local n=$1 dir
  dir=$(ha_node_dir "$n")
  mkdir -p "$dir/sock"
  chmod 0700 "$dir" "$dir/sock"
  (umask 077 && ha_config "$n" >"$dir/patroni.yml")
  if [ "$(id -u)" = 0 ]; then chown -R postgres "$dir"; fi
  if ha_pid "$dir/patroni.pid" >/dev/null; then
    # The configuration as written now (pg_hba, parameters).
    kill -HUP "$(cat "$dir/patroni.pid")"
    return
  fi
  # HOME: libpq looks for client certificates under ~/.postgresql, and root's
  # is not the postgres user's to read.
  local cgroup=""
  cgroup=$(ha_cgroup_make "$n") || cgroup=""
  ha_spawn "$cgroup" "$LOGS/patroni-$n.log" env HOME="$dir" patroni "$dir/patroni.yml"
  echo $! >"$dir/patroni.pid"
}

# ha_leader: the number of the node that is the primary now.
ha_leader() {
  local n
  for n in $(seq 1 "$HA_NODES"); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$(ha_rest_port "$n")/primary")" = 200 ]; then
      echo "$n"
      return
    fi
  done
  return 1
}

# ha_wait_primary SECONDS: until a node is the primary and accepts writes
# through HAProxy.
ha_wait_primary() {
  local deadline=$(($(date +%s) + $1)) n
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if n=$(ha_leader) && [ "$(as_pg psql -h "$(ha_sock "$n")" -p "$(ha_pg_port "$n")" -U postgres -d postgres -qAt \
      -c 'SELECT NOT pg_is_in_recovery()' 2>/dev/null)" = t ]; then
      return
    fi
    sleep 0.5
  done
  return 1
}

ha_running() { ha_leader >/dev/null; }

# ha_any: whether any process of the cluster runs (etcd, HAProxy, a Patroni).
ha_any() {
  local f
  for f in "$HA_DIR/etcd.pid" "$HA_DIR/haproxy.pid" "$HA_DIR"/pg*/patroni.pid; do
    ha_pid "$f" >/dev/null && return 0
  done
  return 1
}

ha_up() {
  ensure_postgres_installed
  ensure_pg_user
  ensure_ha_installed
  mkdir -p "$HA_DIR" "$LOGS"
  chmod 0700 "$HA_DIR"
  if [ "$(id -u)" = 0 ]; then chown postgres "$HA_DIR" "$LOGS"; fi
  echo "$HA_SYNC" >"$HA_DIR/sync"
  echo "$SECURITY" >"$STACK_DIR/security"
  pg_secrets
  [ -s "$PG_SECRETS/replicator.password" ] ||
    (umask 077 && openssl rand -hex 24 >"$PG_SECRETS/replicator.password") || die "openssl could not make a password"
  pg_tls_files
  # The single node and the cluster share the port: one at a time.
  if pg_single_running; then
    log "stopping the single-node postgres: STACK_PG=ha runs the cluster on 127.0.0.1:$PG_PORT"
    pg_single_down
  fi
  ha_etcd_up
  local n
  for n in $(seq 1 "$HA_NODES"); do ha_node_up "$n"; done
  (umask 077 && ha_haproxy_config >"$HA_DIR/haproxy.cfg")
  if ha_pid "$HA_DIR/haproxy.pid" >/dev/null; then
    # A soft reload: the new process takes the port, the old one finishes.
    haproxy -f "$HA_DIR/haproxy.cfg" -D -sf "$(cat "$HA_DIR/haproxy.pid")" || die "haproxy did not reload"
  else
    haproxy -f "$HA_DIR/haproxy.cfg" -D || die "haproxy did not start"
  fi
  ha_wait_primary 120 || die "no primary within 120 s, see $LOGS/patroni-*.log"
  # The mode on the running cluster (bootstrap.dcs applies at its first
  # start only).
  local rest
  rest="http://127.0.0.1:$(ha_rest_port "$(ha_leader)")/config"
  curl -fs -o /dev/null -X PATCH -H 'Content-Type: application/json' \
    -d "{\"synchronous_mode\": $([ "$HA_SYNC" = on ] && echo true || echo false), \"maximum_lag_on_failover\": $(ha_max_lag)}" "$rest" ||
    die "could not set synchronous_mode on $rest"
  log "postgres: 3 nodes under Patroni (leader pg$(ha_leader), synchronous $HA_SYNC), HAProxy on 127.0.0.1:$PG_PORT"
}

ha_down() {
  local n pid
  if pid=$(ha_pid "$HA_DIR/haproxy.pid"); then kill "$pid"; fi
  for n in $(seq 1 "$HA_NODES"); do
    # Patroni stops its PostgreSQL (fast) on SIGTERM.
    if pid=$(ha_pid "$(ha_node_dir "$n")/patroni.pid"); then kill "$pid"; fi
  done
  for n in $(seq 1 "$HA_NODES"); do
    for _ in $(seq 1 300); do
      ha_pid "$(ha_node_dir "$n")/patroni.pid" >/dev/null || break
      sleep 0.1
    done
  done
  if pid=$(ha_pid "$HA_DIR/etcd.pid"); then
    kill "$pid"
    for _ in $(seq 1 100); do
      ha_pid "$HA_DIR/etcd.pid" >/dev/null || break
      sleep 0.1
    done
  fi
  ha_cgroups_remove
  log "postgres cluster stopped"
}

# --- the cluster's faults (scripts/stack.sh pg ..., chaos --fault pg-*) -------

# ha_postmaster_pid N: node N's postmaster, if it runs.
ha_postmaster_pid() {
  local pid
  pid=$(head -1 "$(ha_node_dir "$1")/data/postmaster.pid" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# ha_kill_node N: kill -9 node N's Patroni and its postmaster at once (the
# machine lost, as far as the cluster can tell): nothing restarts it.
ha_kill_node() {
  local n=$1 pids=() pid
  if pid=$(ha_pid "$(ha_node_dir "$n")/patroni.pid"); then pids+=("$pid"); fi
  if pid=$(ha_postmaster_pid "$n"); then pids+=("$pid"); fi
  [ "${#pids[@]}" -gt 0 ] || die "pg$n is not running"
  kill -9 "${pids[@]}"
}

# ha_member ROLE...: the number of the first node Patroni's /cluster (asked
# of the primary) lists in one of ROLEs (leader, sync_standby, replica).
ha_member() {
  local n
  n=$(curl -fs "http://127.0.0.1:$(ha_rest_port "$(ha_leader)")/cluster" 2>/dev/null | python3 -c '
import json, sys
roles = sys.argv[1:]
for m in json.load(sys.stdin).get("members", []):
    if m.get("role") in roles:
        print(m["name"].removeprefix("pg")); break' "$@" 2>/dev/null) && [ -n "$n" ] && echo "$n"
}

# ha_sync_standby: the number of the node Patroni holds as the synchronous
# standby now (fails when there is none: asynchronous, or none chosen yet).
ha_sync_standby() { ha_member sync_standby; }

# ha_wait_sync SECONDS: until Patroni holds a node as the synchronous standby.
ha_wait_sync() {
  local deadline=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    ha_sync_standby >/dev/null && return
    sleep 0.5
  done
  return 1
}

# ha_streaming COUNT SECONDS [N]: until COUNT replicas stream from the
# primary (with N: until node N does).
ha_streaming() {
  local want=$1 deadline=$(($(date +%s) + $2)) only="" leader
  [ -z "${3:-}" ] || only=" AND application_name = 'pg$3'"
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if leader=$(ha_leader) && [ "$(ha_psql "$leader" \
      "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'$only" 2>/dev/null)" -ge "$want" ]; then
      return
    fi
    sleep 0.5
  done
  return 1
}

# ha_new_primary OLD: until a node other than OLD is the primary and takes
# writes (at most 120 s); prints its number.
ha_new_primary() {
  local old=$1 new deadline=$(($(date +%s) + 120))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if new=$(ha_leader) && [ "$new" != "$old" ] && ha_wait_primary 1; then
      echo "$new"
      return
    fi
    sleep 0.2
  done
  return 1
}

# ha_patroni N FIELD...: those fields of node N's Patroni (`GET /patroni`:
# role; state: running, creating replica, starting, stopped, ...), on one
# line; fails when its Patroni does not answer.
ha_patroni() {
  local n=$1
  shift
  curl -fs --max-time 2 "http://127.0.0.1:$(ha_rest_port "$n")/patroni" 2>/dev/null |
    python3 -c 'import json, sys; d = json.load(sys.stdin); print(*(d.get(f, "?") for f in sys.argv[1:]))' "$@" 2>/dev/null
}

# ha_rejoin N START: node N streams from the primary, waited for (after a
# fault: `pg check`, which chaos runs after each of the cluster's faults, so
# that none leaves the cluster a node short without a word). Patroni rewinds
# a former primary; when the rewind fails (the WAL it needs already recycled)
# or its timeline forked before its own position, Patroni re-clones it itself
# (remove_data_directory_on_*), which under load takes minutes: that is
# waited for, never interrupted. A node that neither streams within 120 s nor
# is being re-cloned is re-cloned by hand (patronictl reinit): a replica
# that runs but was ahead of the standby a failover promoted (its WAL forks
# off the new timeline before its own position), which Patroni 3.0.2 does
# not rewind while it runs. At most HA_REJOIN_S (900 s) in all; START (date
# +%s.%N) is when the wait began, for the refusal's words. Prints how the
# node came back when it was re-cloned (" (re-cloned by Patroni)"), else
# nothing.
ha_rejoin() {
  local n=$1 start=$2 leader said how="" deadline state
  leader=$(ha_leader) || die "pg$n: no primary to rejoin, see $LOGS/patroni-*.log"
  [ "$leader" != "$n" ] || return 0
  deadline=$(($(date +%s) + ${HA_REJOIN_S:-900}))
  if ! ha_streaming 1 120 "$n"; then
    state=$(ha_patroni "$n" state) || state=unreachable
    if [ "$state" = "creating replica" ]; then
      how=" (re-cloned by Patroni)"
      log "pg$n is being re-cloned by its Patroni (its rewind failed or its timeline forked): waiting for it"
    else
      how=" (re-cloned by hand, patronictl reinit)"
      leader=$(ha_leader) || die "pg$n: no primary to rejoin, see $LOGS/patroni-*.log"
      log "pg$n ($state) does not stream from pg$leader 120 s after: re-cloned from it (patronictl reinit)"
      said=$(patronictl -c "$(ha_node_dir "$leader")/patroni.yml" reinit effectively "pg$n" --force 2>&1) ||
        die "pg$n: patronictl reinit failed: $said"
      echo "$said" >>"$LOGS/patronictl.log"
    fi
    ha_streaming 1 $((deadline - $(date +%s))) "$n" ||
      die "pg$n does not stream from the primary ${HA_REJOIN_S:-900} s after $(date -d "@${start%.*}" +%T)$how, see $LOGS/patroni-$n.log"
  fi
  [ -z "$how" ] || echo "pg$n$how"
}

# ha_psql N SQL: SQL on node N as the superuser, over its socket; one value.
ha_psql() {
  as_pg psql -h "$(ha_sock "$1")" -p "$(ha_pg_port "$1")" -U postgres -d postgres -qAt -c "$2"
}

# ha_lost_wal OLD_LSN: how many bytes of the old primary's WAL (up to
# OLD_LSN, its position when it was lost) the new primary never had: its
# timeline's history file says where the old timeline ended for it.
ha_lost_wal() {
  local new tli switch
  new=$(ha_leader) || return 1
  tli=$(ha_psql "$new" "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)") || return 1
  switch=$(ha_psql "$new" "SELECT pg_read_file('pg_wal/$tli.history')" | awk '$1 ~ /^[0-9]+$/ { l = $2 } END { print l }')
  [[ $switch =~ ^[0-9A-F]+/[0-9A-F]+$ ]] || return 1
  ha_psql "$new" "SELECT greatest(pg_wal_lsn_diff('$1', '$switch'), 0)::bigint"
}

# ha_elapsed START: the seconds since START (date +%s.%N), to a tenth.
ha_elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# ha_failover DOWN_MS [LAG_MS]: the primary lost (its Patroni and postmaster
# kill -9'd) until another node is the primary and takes writes (after the
# leader key's TTL) and for DOWN_MS at least; then its Patroni started again:
# it rewinds its node and follows the new primary. Prints "pgOLD -> pgNEW".
# With LAG_MS: first the primary's WAL senders to its standbys are stopped
# (SIGSTOP) for LAG_MS, so the standbys fall that far behind, then the
# primary is lost with them. Synchronous, no commit returns meanwhile (each
# waits for a standby that hears nothing); asynchronous, the primary goes on
# acknowledging commits no standby has, and the note says how many bytes of
# WAL the new primary never had.
ha_failover() {
  local down_s=$1 lag_s=${2:-0} old new start senders=() lsn="" lost
  old=$(ha_leader) || die "pg failover: no primary to lose"
  start=$(date +%s.%N)
  if awk -v l="$lag_s" 'BEGIN { exit !(l > 0) }'; then
    mapfile -t senders < <(ha_psql "$old" "SELECT pid FROM pg_stat_replication WHERE usename = 'replicator'")
    [ "${#senders[@]}" -gt 0 ] || die "pg failover: no WAL sender on pg$old to stall"
    kill -STOP "${senders[@]}"
    log "pg$old's WAL senders to its standbys stopped for $lag_s s"
    sleep "$lag_s"
    lsn=$(ha_psql "$old" "SELECT pg_current_wal_lsn()") || lsn=""
  fi
  ha_kill_node "$old"
  # A stopped process dies of SIGKILL too; the senders do not notice their
  # postmaster's death while stopped.
  [ "${#senders[@]}" -eq 0 ] || kill -9 "${senders[@]}" 2>/dev/null || true
  log "pg$old (the primary) kill -9'd with its Patroni"
  if ! new=$(ha_new_primary "$old"); then
    # Its node back, so the cluster is not left without a primary for good.
    ha_node_up "$old"
    die "pg failover: no new primary within 120 s (pg$old started again), see $LOGS/patroni-*.log"
  fi
  log "pg$new is the primary $(ha_elapsed "$start") s after"
  sleep "$(awk -v a="$start" -v b="$(date +%s.%N)" -v d="$down_s" 'BEGIN { r = d - (b - a); printf "%.3f", (r > 0 ? r : 0) }')"
  local said="pg$old -> pg$new"
  if [ -n "$lsn" ] && lost=$(ha_lost_wal "$lsn"); then
    said+=", replication stalled $lag_s s first: $lost bytes of pg$old's WAL not on pg$new"
  fi
  ha_node_up "$old"
  echo "$said"
}

# ha_switchover: a planned switchover (patronictl) to the synchronous standby
# (or to any replica, asynchronous); until the new primary takes writes.
# Prints "pgOLD -> pgNEW".
ha_switchover() {
  local old new
  old=$(ha_leader) || die "pg switchover: no primary"
  ha_streaming 1 60 || die "pg switchover: no replica streams to switch to"
  # Synchronous: Patroni switches over to the synchronous standby only, and
  # refuses (412) until it has named one.
  if [ "$HA_SYNC" = on ]; then ha_wait_sync 60 || die "pg switchover: no synchronous standby within 60 s"; fi
  local said
  # patronictl exits 0 when Patroni refuses: its words say.
  said=$(patronictl -c "$(ha_node_dir "$old")/patroni.yml" switchover --leader "pg$old" --force 2>&1) ||
    die "pg switchover: patronictl failed: $said"
  echo "$said" >>"$LOGS/patronictl.log"
  if grep -q "Switchover failed" <<<"$said"; then die "pg switchover: $(grep "Switchover failed" <<<"$said")"; fi
  new=$(ha_new_primary "$old") || die "pg switchover: no new primary within 120 s, see $LOGS/patroni-*.log"
  echo "pg$old -> pg$new"
}

# ha_standby_loss DOWN_MS: the synchronous standby lost (kill -9 with its
# Patroni; asynchronous: a replica) for DOWN_MS, then started again.
# Meanwhile commits wait for a standby until Patroni names the other replica
# synchronous. Prints "pgN (standby) lost; synchronous meanwhile: pgM" (none
# if Patroni named none before it came back).
ha_standby_loss() {
  local down_s=$1 lost n next=none
  lost=$(ha_sync_standby) || lost=$(ha_member replica) || die "pg standby-loss: no standby to lose"
  ha_kill_node "$lost"
  log "pg$lost (the $([ "$HA_SYNC" = on ] && echo synchronous || echo asynchronous) standby) kill -9'd with its Patroni; down for $down_s s"
  sleep "$down_s"
  if n=$(ha_sync_standby) && [ "$n" != "$lost" ]; then next=pg$n; fi
  ha_node_up "$lost"
  echo "pg$lost (standby) lost; synchronous meanwhile: $next"
}

# ha_primary_lsn N: node N's WAL position if it runs as a primary now, else
# a failure (asked over its socket, which no firewall rule touches; libpq
# gives up on a node that does not answer within 2 s).
ha_primary_lsn() {
  local lsn
  lsn=$(PGCONNECT_TIMEOUT=2 ha_psql "$1" \
    "SELECT CASE WHEN pg_is_in_recovery() THEN '' ELSE pg_current_wal_lsn()::text END" 2>/dev/null) &&
    [ -n "$lsn" ] && echo "$lsn"
}

# ha_partition CUT_S: the primary cut off from etcd and the other nodes for
# CUT_S, still running and still reached by HAProxy (the clients' side).
# Firewall rules in a chain of their own on the nodes' cgroups, marking each
# connection between the primary's processes and the others' (either way)
# so that its packets drop both ways: Patroni there can no longer renew the
# leader key and demotes its node (retry_timeout, 5 s); once the key's TTL
# runs out the others promote the synchronous standby. Meanwhile every node
# is asked every quarter second (over its socket) whether it is a primary:
# two at once would be a split brain. After CUT_S the rules go, the old node
# rewinds and follows. Prints "pgOLD -> pgNEW, cut off S s: pgOLD no longer
# a primary after A s, pgNEW the primary after B s, two primaries in K of N
# looks, W bytes of pgOLD's WAL not on pgNEW" (W: what it wrote that the new
# primary never had; synchronous, none of it acknowledged to a client).
ha_partition() {
  local cut_s=$1 old cgroup pid chain=$NET_CHAIN-PG mark ports=() n
  old=$(ha_leader) || die "pg partition: no primary to cut off"
  ensure_net_tools
  cgroup=$(ha_cgroup "$old")
  pid=$(ha_pid "$(ha_node_dir "$old")/patroni.pid") || die "pg partition: pg$old's Patroni does not run"
  grep -qx "0::/$cgroup" "/proc/$pid/cgroup" ||
    die "pg partition: pg$old's Patroni runs outside its cgroup $cgroup (started by an older stack.sh, or without a cgroup v2 hierarchy): scripts/stack.sh down, then STACK_PG=ha scripts/stack.sh up"
  # A mark of this partition's own: connections an earlier one marked keep
  # their mark, and no rule drops them any more. Marking rules do not end
  # the chain, so their order is free; the drop comes last.
  mark=$(printf '0x%x' $(((RANDOM << 15 | RANDOM) | 1)))
  chain_hook "" "$chain"
  for n in $(seq 1 "$HA_NODES"); do
    [ "$n" = "$old" ] && continue
    ports+=("$(ha_pg_port "$n")" "$(ha_rest_port "$n")")
    ipt "" -A "$chain" -m cgroup --path "$(ha_cgroup "$n")" -p tcp -m multiport \
      --dports "$(ha_pg_port "$old"),$(ha_rest_port "$old")" -j CONNMARK --set-mark "$mark"
  done
  ipt "" -A "$chain" -m cgroup --path "$cgroup" -p tcp -m multiport \
    --dports "$HA_ETCD_PORT,$(IFS=,; echo "${ports[*]}")" -j CONNMARK --set-mark "$mark"
  ipt "" -A "$chain" -m connmark --mark "$mark" -j DROP
  log "pg$old (the primary) cut off from etcd and the other nodes for $cut_s s; HAProxy still reaches it"
  local start t looks=0 both=0 fenced="" promoted="" new="" lsn="" at writers
  start=$(date +%s.%N)
  while :; do
    t=$(ha_elapsed "$start")
    awk -v t="$t" -v c="$cut_s" 'BEGIN { exit !(t < c) }' || break
    writers=0
    for n in $(seq 1 "$HA_NODES"); do
      if [ "$n" = "$old" ]; then
        if at=$(ha_primary_lsn "$n"); then lsn=$at writers=$((writers + 1)); else fenced=${fenced:-$t}; fi
      elif ha_primary_lsn "$n" >/dev/null; then
        writers=$((writers + 1))
        [ -n "$promoted" ] || promoted=$t new=$n
      fi
    done
    looks=$((looks + 1))
    [ "$writers" -lt 2 ] || both=$((both + 1))
    sleep 0.25
  done
  chain_drop "" "$chain"
  log "pg$old back on the network"
  ha_wait_primary 120 || die "pg partition: no primary within 120 s of the heal, see $LOGS/patroni-*.log"
  local said="pg$old -> pg$(ha_leader), cut off $cut_s s:" lost
  if [ -n "$fenced" ]; then said+=" pg$old no longer a primary after $fenced s,"; else said+=" pg$old a primary throughout,"; fi
  if [ -n "$new" ]; then said+=" pg$new the primary after $promoted s,"; else said+=" no other node promoted,"; fi
  said+=" two primaries in $both of $looks looks"
  if [ -n "$new" ] && [ -n "$lsn" ] && lost=$(ha_lost_wal "$lsn"); then said+=", $lost bytes of pg$old's WAL not on pg$new"; fi
  echo "$said"
}

# ha_check: the cluster whole: a primary, every replica streaming from it
# (each waited for as ha_rejoin says: a node rewinding or being re-cloned
# after a fault) and (synchronous) a synchronous standby. Prints "the
# cluster whole, S s waited", with each node re-cloned on the way.
ha_check() {
  ha_wait_primary 30 || die "pg check: no primary (STACK_PG=ha scripts/stack.sh up)"
  local start n leader how="" said
  start=$(date +%s.%N)
  leader=$(ha_leader) || die "pg check: no primary"
  for n in $(seq 1 "$HA_NODES"); do
    [ "$n" != "$leader" ] || continue
    said=$(ha_rejoin "$n" "$start") || exit 1
    how+=${said:+, $said}
  done
  if [ "$HA_SYNC" = on ]; then ha_wait_sync 60 || die "pg check: no synchronous standby within 60 s"; fi
  echo "the cluster whole, $(ha_elapsed "$start") s waited$how"
}

# ha_status: one line per node, as Patroni sees it.
ha_status() {
  local n role
  for n in $(seq 1 "$HA_NODES"); do
    role=$(ha_patroni "$n" role state) || role="stopped"
    echo "postgres pg$n: $role on 127.0.0.1:$(ha_pg_port "$n")"
  done
}
