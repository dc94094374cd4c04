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
# may lack commits the old primary acknowledged). Each `up` sets the mode on
# the running cluster.
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

ha_pg_port() { echo $((HA_PG_BASE + $1 - 1)); }
ha_rest_port() { echo $((HA_REST_BASE + $1 - 1)); }
ha_node_dir() { echo "$HA_DIR/pg$1"; }
ha_sock() { echo "$(ha_node_dir "$1")/sock"; }

# ha_pid FILE: the pid in FILE if that process runs.
ha_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# ha_spawn LOG CMD...: CMD in the background as the OS user postgres, its
# output appended to LOG; $! is CMD's own pid (every step execs the next).
ha_spawn() {
  local log=$1
  shift
  if [ "$(id -u)" = 0 ]; then
    (exec setpriv --reuid=postgres --regid=postgres --init-groups -- "$@" >>"$log" 2>&1) &
  else
    (exec "$@" >>"$log" 2>&1) &
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
log:
  level: WARNING
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
  authentication:
    superuser:
      username: postgres
      password: '$(cat "$PG_SECRETS/postgres.password")'
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
  ha_spawn "$LOGS/patroni-$n.log" env HOME="$dir" patroni "$dir/patroni.yml"
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
    -d "{\"synchronous_mode\": $([ "$HA_SYNC" = on ] && echo true || echo false)}" "$rest" ||
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
  if pid=$(ha_pid "$HA_DIR/etcd.pid"); then kill "$pid"; fi
  log "postgres cluster stopped"
}

# ha_status: one line per node, as Patroni sees it.
ha_status() {
  local n role
  for n in $(seq 1 "$HA_NODES"); do
    role=$(curl -fs "http://127.0.0.1:$(ha_rest_port "$n")/patroni" 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("role","?"), d.get("state","?"))' 2>/dev/null) ||
      role="stopped"
    echo "postgres pg$n: $role on 127.0.0.1:$(ha_pg_port "$n")"
  done
}
