#!/usr/bin/env bash
# The embedded stack: a throwaway PostgreSQL and a real Apache Kafka cluster
# (3 KRaft nodes, each broker and controller) on 127.0.0.1, or each in its own
# network namespace (STACK_NET=netns), no Docker needed.
#
#   scripts/stack.sh up      start (idempotent; restarts a node that died),
#                            write .stack/env, print it
#   scripts/stack.sh down    stop (idempotent)
#   scripts/stack.sh status  say what runs
#   scripts/stack.sh fetch   install and download what `up` needs, start nothing
#   scripts/stack.sh paths   where fetch put PostgreSQL's binaries and Kafka's jars (PG_BIN=, KAFKA_LIBS=)
#   scripts/stack.sh clean   remove what tests and benchmarks leave behind: the
#                            tests' databases (test_*) and the tests' and
#                            benchmarks' topics (test-*, bench.*). Left there,
#                            hundreds of topics made the brokers 2.6x as
#                            expensive per message (FINDINGS §15). Not while
#                            tests or a benchmark run.
#   scripts/stack.sh crash postgres|broker [DOWN_MS [NODE]]
#                            crash one the hard way (pg_ctl -m immediate;
#                            kill -9 of Kafka node NODE, by default the leader
#                            of most of the topic's partitions), keep it down
#                            DOWN_MS (2000), start it again and wait until it
#                            serves: chaos --fault pg-crash|broker-kill
#   scripts/stack.sh crash quorum [DOWN_MS]
#                            kill -9 two of the three Kafka nodes at once (the
#                            busiest leader and the next), start both again:
#                            chaos --fault broker-quorum-loss
#                            (STACK_PG=ha: kill -9 of the primary's postmaster;
#                            its Patroni restarts it in place, no failover)
#   scripts/stack.sh pg failover [DOWN_MS [LAG_MS]]
#                            STACK_PG=ha: kill -9 the primary's Patroni and
#                            postmaster; once a standby is promoted and takes
#                            writes (and DOWN_MS is over), start the old node
#                            again as a replica: chaos --fault pg-failover.
#                            LAG_MS: first stop the primary's WAL senders for
#                            that long, the standbys falling behind: chaos
#                            --fault pg-lagged-failover
#   scripts/stack.sh pg switchover
#                            STACK_PG=ha: a planned switchover (patronictl):
#                            chaos --fault pg-switchover
#   scripts/stack.sh pg standby-loss [DOWN_MS]
#                            STACK_PG=ha: kill -9 the synchronous standby (and
#                            its Patroni) for DOWN_MS: chaos --fault
#                            pg-standby-loss
#   scripts/stack.sh pg partition [MS]
#                            STACK_PG=ha: cut the primary off from etcd and
#                            the other nodes for MS (30000), still running
#                            and reached by HAProxy; say when it stopped
#                            being a primary, when another was promoted, and
#                            whether two were ever primaries at once: chaos
#                            --fault pg-partition (root: firewall rules on
#                            the nodes' cgroups)
#   scripts/stack.sh pg check
#                            STACK_PG=ha: the cluster whole: a primary, every
#                            replica streaming (a node rewinding or re-cloned
#                            by Patroni after a fault waited for, up to
#                            HA_REJOIN_S, 900 s; one that neither streams nor
#                            is being re-cloned re-cloned by patronictl
#                            reinit), a synchronous standby (STACK_PG_SYNC=on);
#                            prints after how long: chaos runs it before the
#                            cluster's faults and after each
#   scripts/stack.sh pause broker [MS [NODE]]
#                            SIGSTOP a Kafka node for MS (15000), SIGCONT:
#                            chaos --fault broker-pause (the ISR shrinks)
#   scripts/stack.sh net partition|lag|cut|heal|check|status ...
#                            network faults (chaos --fault broker-partition,
#                            net-lag, relay-cut, payments-db-cut): see
#                            scripts/lib/net.sh
#
# PostgreSQL is the machine's own server (apt's postgresql-15, installed when
# missing and root). Kafka is the version scripts/kafka/pom.xml pins, resolved
# from Maven Central by mvn once per machine into TOOLS_CACHE (java and mvn
# from apt when missing and root).
#
# Data lives in .stack/ (git-ignored). Settings, all optional:
#   STACK_DIR      where data, logs and the env file go   (default: <repo>/.stack)
#   STACK_PG_PORT  PostgreSQL port on 127.0.0.1           (default: 25432)
#   STACK_DB       the database `make up` creates         (default: effectively)
#   STACK_KAFKA    0 to run without Kafka                 (default: 1)
#   STACK_KAFKA_NODES  Kafka nodes, 3 or 1 (a small machine) (default: 3)
#   STACK_KAFKA_PORT   node N's client port is this + N-1 (default: 29092)
#   STACK_KAFKA_CONTROLLER_PORT  node N's quorum port is this + N-1 (default: 29192)
#   STACK_KAFKA_HEAP   each node's JVM heap               (default: 512m)
#   STACK_KAFKA_JVM_OPTS more JVM flags for each node      (default: none;
#                      -XX:TieredStopAtLevel=1 removes the first minute's warm-up)
#   STACK_NET      loopback, or netns: each Kafka node in its own network
#                  namespace on its own address (root; scripts/lib/net.sh)
#                  (default: the cluster's current mode, at first loopback)
#   STACK_NET_PREFIX   the netns subnet's first three octets (10.213.7)
#   STACK_SECURITY tls: PostgreSQL takes SCRAM passwords over TLS only; or
#                  plaintext: the same passwords without TLS, to measure what
#                  TLS costs (scripts/lib/pg-security.sh) (default: the
#                  stack's current mode, at first tls)
#   STACK_PG       single: one PostgreSQL node; or ha: three under Patroni
#                  (etcd, synchronous replication) behind HAProxy on the
#                  same port (scripts/lib/pg-ha.sh) (default: the stack's
#                  current mode, at first single)
#   STACK_PG_SYNC  ha only: on (synchronous mode, no acknowledged commit
#                  lost at failover) or off (asynchronous, the
#                  counter-example) (default: the cluster's current mode, at
#                  first on)
#   KAFKA_TOPIC, KAFKA_TOPIC_PARTITIONS  the topic `up` creates (order.events, 6)
#   STACK_KAFKA_TOOL   a built kafka-tool to create it with (default: build
#                      the debug one on first use)
#   TOOLS_CACHE    machine-wide cache of tools and jars   (default: ~/.cache/effectively)
# The default ports lie below Linux's ephemeral range (32768-60999): under
# load, a client's own connection could otherwise hold the port in TIME-WAIT
# and keep a broker from binding it again after a restart.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
PG_PORT=${STACK_PG_PORT:-25432}
DB=${STACK_DB:-effectively}
PGDATA=$STACK_DIR/pg
SOCK=$STACK_DIR/sock
LOGS=$STACK_DIR/log
ENV_FILE=$STACK_DIR/env
WITH_KAFKA=${STACK_KAFKA:-1}
KAFKA_NODES=${STACK_KAFKA_NODES:-3}
KAFKA_PORT=${STACK_KAFKA_PORT:-29092}
KAFKA_CONTROLLER_PORT=${STACK_KAFKA_CONTROLLER_PORT:-29192}
KAFKA_HEAP=${STACK_KAFKA_HEAP:-512m}
# With the JIT's first tier only (-XX:TieredStopAtLevel=1) the first
# minute's load took 0.60 of 2 cores instead of 0.93 and the client's p99 that
# minute was 21 ms instead of 47, for 15% more broker CPU once warm; not the
# default yet: with it one payments test failed in two of three CI runs
# (FINDINGS §13, "The warm-up").
KAFKA_JVM_OPTS=${STACK_KAFKA_JVM_OPTS:-}
TOPIC=${KAFKA_TOPIC:-order.events}
PARTITIONS=${KAFKA_TOPIC_PARTITIONS:-6}
TOOLS_CACHE=${TOOLS_CACHE:-$HOME/.cache/effectively}
KAFKA_POM=$ROOT/scripts/kafka/pom.xml
KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$KAFKA_POM")
KAFKA_DIR=$STACK_DIR/kafka
[[ $KAFKA_NODES =~ ^[13]$ ]] || { echo "stack: error: STACK_KAFKA_NODES must be 1 or 3, got '$KAFKA_NODES'" >&2; exit 2; }

log() { printf 'stack: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
ms_to_s() { awk -v ms="$1" 'BEGIN { printf "%.3f", ms / 1000 }'; }

# apt_install PACKAGE…: Debian's packages, for what the stack needs and the
# machine lacks (root only; each caller checks the result its own way).
apt_install() {
  log "installing $* from apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq "$@" >/dev/null
}

# shellcheck source=scripts/lib/net.sh
. "$ROOT/scripts/lib/net.sh"
net_check_request
net_load
# shellcheck source=scripts/lib/tls.sh
. "$ROOT/scripts/lib/tls.sh"
# shellcheck source=scripts/lib/pg-security.sh
. "$ROOT/scripts/lib/pg-security.sh"
# shellcheck source=scripts/lib/pg-ha.sh
. "$ROOT/scripts/lib/pg-ha.sh"
# shellcheck source=scripts/lib/kafka-security.sh
. "$ROOT/scripts/lib/kafka-security.sh"

# PostgreSQL refuses to run as root; run its binaries as the `postgres` user then.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

find_pg_bin() {
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    PG_BIN=$(dirname "$(command -v pg_ctl)")
    return
  fi
  for d in /usr/lib/postgresql/15/bin /usr/lib/postgresql/*/bin; do
    if [ -x "$d/pg_ctl" ]; then PG_BIN=$d; return; fi
  done
  return 1
}

ensure_postgres_installed() {
  if find_pg_bin; then return; fi
  [ "$(id -u)" = 0 ] || die "PostgreSQL server binaries not found; install postgresql-15"
  apt_install postgresql-15 postgresql-client-15
  find_pg_bin || die "postgresql-15 installed but pg_ctl not found"
}

ensure_pg_user() {
  [ "$(id -u)" = 0 ] || return 0
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
}

pg_single_running() {
  [ -f "$PGDATA/postmaster.pid" ] && as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1
}

# Which PostgreSQL the stack runs: `single` (one node, the default) or `ha`
# (three under Patroni behind HAProxy: scripts/lib/pg-ha.sh). `up` records
# it; a command without STACK_PG keeps it.
PG_MODE=${STACK_PG:-$(cat "$STACK_DIR/pg-mode" 2>/dev/null || echo single)}
case $PG_MODE in
  single | ha) ;;
  *) echo "stack: error: STACK_PG must be single or ha, got '$PG_MODE'" >&2; exit 2 ;;
esac

pg_running() { if [ "$PG_MODE" = ha ]; then ha_running; else pg_single_running; fi; }

# psql ARGS... as the superuser, to the server's database `postgres`, stopping
# at the first error, unaligned and tuples only: over the Unix socket as the
# OS user that runs the server (the only way in without a password:
# scripts/lib/pg-security.sh).
admin_psql() {
  if [ "$PG_MODE" = ha ]; then
    local n
    n=$(ha_leader) || die "no primary in the cluster (scripts/stack.sh status)"
    as_pg psql -h "$(ha_sock "$n")" -p "$(ha_pg_port "$n")" -U postgres -d postgres -v ON_ERROR_STOP=1 -qAt "$@"
  else
    as_pg psql -h "$SOCK" -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qAt "$@"
  fi
}

# pg_up: the stack's PostgreSQL (the single node or the cluster) running,
# its roles' passwords set, the database there.
pg_up() {
  if [ "$PG_MODE" = ha ]; then
    ha_up
  else
    if ha_any; then
      log "stopping the postgres cluster: STACK_PG=single runs one node on 127.0.0.1:$PG_PORT"
      ha_down
    fi
    pg_single_up
  fi
  echo "$PG_MODE" >"$STACK_DIR/pg-mode"
  pg_set_passwords
  if [ "$(admin_psql -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
    admin_psql -c "CREATE DATABASE \"$DB\"" >/dev/null
    log "created database $DB"
  fi
  # The view over pg_stat_statements, in the admin database the benchmarks
  # read it from (it shows every database's statements). A server started
  # before the library was preloaded answers without it until restarted.
  admin_psql -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null 2>&1 || true
}

pg_down() {
  if ha_any; then ha_down; fi
  pg_single_down
}

pg_single_up() {
  ensure_postgres_installed
  ensure_pg_user
  mkdir -p "$STACK_DIR" "$SOCK" "$LOGS"
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    log "initdb $PGDATA"
    mkdir -p "$PGDATA"
    if [ "$(id -u)" = 0 ]; then chown postgres "$PGDATA"; fi
    as_pg "$PG_BIN/initdb" -D "$PGDATA" -U postgres --auth-local=peer --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >"$LOGS/initdb.log" 2>&1 \
      || die "initdb failed, see $LOGS/initdb.log"
  fi
  if [ "$(id -u)" = 0 ]; then chown postgres "$SOCK" "$LOGS"; fi
  # In postgresql.conf, not on the command line, so that ALTER SYSTEM can
  # override it for a while (scripts/wal-slot-lost.sh) and RESET restores it.
  grep -q '^max_slot_wal_keep_size' "$PGDATA/postgresql.conf" \
    || echo "max_slot_wal_keep_size = 2GB  # scripts/stack.sh: the WAL a relay's slot may hold" >>"$PGDATA/postgresql.conf"
  pg_configure
  if pg_single_running; then
    log "postgres already running on 127.0.0.1:$PG_PORT"
    # pg_hba.conf and TLS as written now (a server an older stack.sh
    # started trusted everyone).
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" reload >/dev/null
    if [ "$(admin_psql -c 'SHOW wal_level' 2>/dev/null)" != logical ]; then
      log "postgres runs with wal_level other than logical (started by an older stack.sh): relay --mode wal needs it; restart the stack (scripts/stack.sh down; scripts/stack.sh up)"
    fi
    if [ "$(admin_psql -c 'SHOW track_commit_timestamp' 2>/dev/null)" != on ]; then
      log "postgres runs without track_commit_timestamp (started by an older stack.sh): make bench-cdc needs it; restart the stack (scripts/stack.sh down; scripts/stack.sh up)"
    fi
  else
    # A kill -9 leaves postmaster.pid behind; pg_ctl said nothing runs, so it is stale.
    rm -f "$PGDATA/postmaster.pid"
    log "starting postgres on 127.0.0.1:$PG_PORT"
    # recovery_init_sync_method=syncfs: after a crash (exp-8's pg-crash) the
    # server syncs its data directory before redo; one fsync per file took
    # 73 s for the ~46,000 files of a CI run's test databases while the disk
    # was busy, past pg_ctl's 60 s; one syncfs() per file system does not
    # grow with the file count.
    # wal_level=logical: the WAL relay (relay --mode wal) streams the outbox
    # from a logical replication slot; max_slot_wal_keep_size bounds the WAL
    # a slot whose relay is down can hold (past it the server invalidates
    # the slot and the relay says what to do: ARCHITECTURE.md §6).
    # pg_stat_statements: what each service's statements cost (calls, time,
    # WAL), read by the benchmarks around each load (scripts/lib/cpu.py).
    # track_commit_timestamp: each transaction's commit time, from which
    # make bench-cdc measures commit→consume (pg_xact_commit_timestamp).
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t 60 -o \
      "-c port=$PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$SOCK \
       -c max_connections=400 -c shared_buffers=512MB -c max_wal_size=4GB \
       -c shared_preload_libraries=pg_stat_statements \
       -c wal_level=logical -c max_replication_slots=64 -c max_wal_senders=64 \
       -c track_commit_timestamp=on -c checkpoint_timeout=15min -c recovery_init_sync_method=syncfs -c log_min_messages=warning" start >/dev/null \
      || die "postgres did not start, see $LOGS/postgres.log"
  fi
}

pg_single_down() {
  find_pg_bin || return 0
  if pg_single_running; then
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -m fast -w -t 60 stop >/dev/null
    log "postgres stopped"
  else
    rm -f "$PGDATA/postmaster.pid" 2>/dev/null || true
    log "postgres not running"
  fi
}


# --- the broker ------------------------------------------------------------

# Apache Kafka from Maven Central: scripts/kafka/pom.xml pins the version; its
# jars are resolved once per machine into the cache (keyed by the pom's hash,
# so a new pin resolves anew) and never committed.
kafka_libs_dir() {
  local hash
  hash=$(sha256sum "$KAFKA_POM" | cut -c1-12)
  echo "$TOOLS_CACHE/kafka-$KAFKA_VERSION-$hash/libs"
}

ensure_java() {
  if command -v java >/dev/null 2>&1 && command -v mvn >/dev/null 2>&1; then return; fi
  [ "$(id -u)" = 0 ] || die "java and mvn are needed for the embedded Kafka; install openjdk-17-jre-headless and maven"
  apt_install openjdk-17-jre-headless maven
  command -v java >/dev/null 2>&1 && command -v mvn >/dev/null 2>&1 || die "java or mvn still missing after apt-get install"
}

ensure_kafka() {
  ensure_java
  KAFKA_LIBS=$(kafka_libs_dir)
  [ -f "$KAFKA_LIBS/kafka_2.13-$KAFKA_VERSION.jar" ] && return
  local tmp=$KAFKA_LIBS.tmp.$$
  log "resolving Apache Kafka $KAFKA_VERSION from Maven Central once for this machine (~50 MB)"
  mkdir -p "$tmp"
  mvn -B -q -f "$KAFKA_POM" \
    org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$tmp" >"$TOOLS_CACHE/kafka-resolve.log" 2>&1 \
    || { rm -rf "$tmp"; die "mvn could not resolve Kafka $KAFKA_VERSION, see $TOOLS_CACHE/kafka-resolve.log"; }
  rm -rf "$KAFKA_LIBS" && mv "$tmp" "$KAFKA_LIBS"
}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# Node N (1-based) serves clients on KAFKA_PORT+N-1 and the KRaft quorum on
# KAFKA_CONTROLLER_PORT+N-1.
client_port() { echo $((KAFKA_PORT + $1 - 1)); }
controller_port() { echo $((KAFKA_CONTROLLER_PORT + $1 - 1)); }
node_dir() { echo "$KAFKA_DIR/node-$1"; }
bootstrap_servers() {
  local n out=
  for n in $(seq 1 "$KAFKA_NODES"); do out+=${out:+,}$(node_host "$n"):$(client_port "$n"); done
  echo "$out"
}

node_pid() {
  local pid
  pid=$(cat "$(node_dir "$1")/pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q kafka.Kafka "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

# One combined broker+controller per node, every node a voter of a static
# quorum. Sized for a 2-core machine that also runs PostgreSQL, the services
# and the load: few network and I/O threads per node, one replica fetcher,
# 6 partitions for the group coordinator's offsets topic (50 by default;
# RF 3 x 50 is 150 replicas to start for a handful of groups).
# replica.lag.time.max.ms is 10 s (30 s by default) so that a broker paused
# longer than that leaves the ISR within a fault's span (chaos broker-pause).
# Consumer group sessions may be as short as 1 s (Kafka's floors are 6 s for
# the classic protocol and 45 s for KIP-848's): the lab's members are killed
# -9 every few seconds, and a group may choose its own (payments
# --session-timeout-ms; KIP-848 groups by `kafka.sh configs --entity-type
# groups`). KIP-848 groups default to a 10 s session, as payments' classic
# one, with a heartbeat of 1 s (Kafka's 45 s and 5 s suit clouds; here a
# member's partitions move on the heartbeat).
write_node_config() {
  local n=$1 dir voters= v rf=$KAFKA_NODES isr=$(( KAFKA_NODES >= 3 ? 2 : 1 ))
  dir=$(node_dir "$n")
  for v in $(seq 1 "$KAFKA_NODES"); do voters+=${voters:+,}$v@$(node_host "$v"):$(controller_port "$v"); done
  # The node's directory and its config (which holds the brokers' and the
  # quorum's passwords) are the stack user's alone.
  (umask 077; mkdir -p "$dir")
  chmod 0700 "$dir"
  (umask 077; cat >"$dir/server.properties") <<PROPS
# Written by scripts/stack.sh (node $n of $KAFKA_NODES); edits are overwritten.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
$(kafka_security_props "$n")
log.dirs=$dir/data
num.network.threads=2
num.io.threads=4
num.replica.fetchers=1
background.threads=4
num.recovery.threads.per.data.dir=1
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=6
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=6
replica.lag.time.max.ms=10000
$(grep -v '^#' "$ROOT/scripts/kafka/group-sessions.properties")
auto.create.topics.enable=false
PROPS
}

java_props() { echo "-Dlog4j2.configurationFile=$1 -Djava.awt.headless=true"; }

# The heap holds metadata, request buffers and the coordinators' state, not
# the log (that is the page cache's): 512 MB per node, fixed (-Xms = -Xmx,
# no resizing), G1 with short pauses as Kafka's own scripts set it (they
# give 1 GB; three nodes of 1 GB on 24 GB would fit too, but nothing here
# needs it). STACK_KAFKA_HEAP overrides it.
start_node() {
  local n=$1 dir log offset pid
  dir=$(node_dir "$n")
  log=$LOGS/kafka-$n.log
  rm -f "$dir/pid" # stale after a kill -9
  port_open "$(node_host "$n")" "$(client_port "$n")" && die "port $(client_port "$n") is taken by another process; set STACK_KAFKA_PORT"
  touch "$log"
  offset=$(stat -c %s "$log")
  echo "$offset" >"$dir/log-offset"
  # shellcheck disable=SC2046,SC2086 # java_props, node_exec and the JVM options are word-split on purpose
  nohup $(node_exec "$n") java -Xms"$KAFKA_HEAP" -Xmx"$KAFKA_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent $KAFKA_JVM_OPTS \
    $(java_props "$ROOT/scripts/kafka/log4j2.properties") \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$dir/server.properties" >>"$log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$dir/pid"
  log "started kafka node $n (pid $pid) on $(node_host "$n"):$(client_port "$n")"
}

# A node is ready once it logged "Kafka Server started" since its last start:
# in KRaft that comes after it caught up with the metadata log and the
# controller unfenced it.
wait_node_ready() {
  local n=$1 timeout_s=${2:-90} dir log offset i pid
  dir=$(node_dir "$n")
  log=$LOGS/kafka-$n.log
  offset=$(cat "$dir/log-offset" 2>/dev/null || echo 0)
  for i in $(seq 1 $((timeout_s * 5))); do
    tail -c +"$((offset + 1))" "$log" 2>/dev/null | grep -q 'Kafka Server started' && return 0
    pid=$(cat "$dir/pid" 2>/dev/null) || true
    kill -0 "$pid" 2>/dev/null || die "kafka node $n exited at start, see $log"
    sleep 0.2
  done
  die "kafka node $n not ready within ${timeout_s} s, see $log"
}

kafka_up() {
  ensure_kafka
  local want=${STACK_NET:-$NET} want_prefix=${STACK_NET_PREFIX:-$NET_PREFIX}
  if [ "$want $want_prefix" != "$NET $NET_PREFIX" ] && [ -f "$KAFKA_DIR/cluster-id" ]; then
    log "the cluster runs on $NET, STACK_NET asks for $want: restarting it there on fresh storage"
    kafka_down
    [ "$NET" = netns ] && net_down
    rm -rf "$KAFKA_DIR"/node-* "$KAFKA_DIR/cluster-id" "$KAFKA_DIR/nodes" "$KAFKA_DIR/acls"
  fi
  # The SCRAM credentials and the ACLs live in the metadata log: another
  # mode (or a cluster from before this script secured it) is formatted again.
  if [ -f "$KAFKA_DIR/cluster-id" ] && [ "$(cat "$KAFKA_DIR/security" 2>/dev/null || echo plaintext)" != "$SECURITY" ]; then
    log "the cluster was formatted for STACK_SECURITY=$(cat "$KAFKA_DIR/security" 2>/dev/null || echo plaintext), the stack runs $SECURITY: formatting it again (its topics are lost)"
    kafka_down
    rm -rf "$KAFKA_DIR"/node-* "$KAFKA_DIR/cluster-id" "$KAFKA_DIR/nodes" "$KAFKA_DIR/acls"
  fi
  NET=$want NET_PREFIX=$want_prefix
  mkdir -p "$KAFKA_DIR" "$LOGS"
  echo "$NET $NET_PREFIX" >"$KAFKA_DIR/net"
  net_up
  kafka_secrets
  [ "$SECURITY" = plaintext ] || kafka_certs
  kafka_client_files
  if [ -f "$KAFKA_DIR/nodes" ] && [ "$(cat "$KAFKA_DIR/nodes")" != "$KAFKA_NODES" ]; then
    die "$KAFKA_DIR holds a cluster of $(cat "$KAFKA_DIR/nodes") nodes, STACK_KAFKA_NODES asks for $KAFKA_NODES; stop the stack and delete $KAFKA_DIR to change it"
  fi
  local n started=() id
  if [ ! -f "$KAFKA_DIR/cluster-id" ]; then
    # shellcheck disable=SC2046
    id=$(java $(java_props "$ROOT/scripts/kafka/tools-log4j2.properties") -cp "$KAFKA_LIBS/*" kafka.tools.StorageTool random-uuid) \
      || die "kafka.tools.StorageTool random-uuid failed"
    echo "$id" >"$KAFKA_DIR/cluster-id"
    echo "$KAFKA_NODES" >"$KAFKA_DIR/nodes"
    echo "$SECURITY" >"$KAFKA_DIR/security"
  fi
  id=$(cat "$KAFKA_DIR/cluster-id")
  for n in $(seq 1 "$KAFKA_NODES"); do
    write_node_config "$n"
    if node_pid "$n" >/dev/null; then continue; fi
    if [ ! -f "$(node_dir "$n")/data/meta.properties" ]; then
      # Every node of a static quorum is formatted with the same cluster id
      # (no --standalone: the voters are in controller.quorum.voters).
      # The SCRAM principals' passwords go in an argument file (java
      # @file), never in a process's arguments.
      local argfile
      argfile=$(umask 077; mktemp "$KAFKA_DIR/format-args.XXXXXX")
      printf '%s\n' kafka.tools.StorageTool format -t "$id" -c "$(node_dir "$n")/server.properties" >"$argfile"
      kafka_format_scram "$argfile"
      # shellcheck disable=SC2046
      java $(java_props "$ROOT/scripts/kafka/tools-log4j2.properties") -cp "$KAFKA_LIBS/*" @"$argfile" >>"$LOGS/kafka-format.log" 2>&1 \
        || { rm -f "$argfile"; die "formatting kafka node $n failed, see $LOGS/kafka-format.log"; }
      rm -f "$argfile"
    fi
    start_node "$n"
    started+=("$n")
  done
  for n in "${started[@]}"; do wait_node_ready "$n"; done
  if [ "${#started[@]}" = 0 ]; then log "kafka: $KAFKA_NODES nodes already running ($(bootstrap_servers))"; fi
  kafka_acls
  # Its own line: a build failure inside $(…) exits only the subshell.
  local tool
  tool=$(kafka_tool_bin) || exit 1
  # Replication -1 takes the brokers' default.replication.factor (every
  # node), min.insync.replicas the brokers' (2 of 3): what the relay and
  # payments require of it. kafka-tool's default configs make the brokers
  # stamp its records (LogAppendTime). Retried: a node that just started may
  # not be unfenced everywhere yet.
  local tries=0
  until KAFKA_BOOTSTRAP_SERVERS=$(bootstrap_servers) KAFKA_CLIENT_CONFIG=$KAFKA_CLIENTS/admin.properties "$tool" create --topic "$TOPIC" --partitions "$PARTITIONS"; do
    tries=$((tries + 1))
    [ "$tries" -lt 60 ] || die "could not create topic $TOPIC within 30 s"
    sleep 0.5
  done
}

# The project's own Kafka tool (rdkafka): STACK_KAFKA_TOOL when it names one
# (make demo passes its release build's), else built on first use (debug
# profile: the test build shares it), where cargo puts it (CARGO_TARGET_DIR).
kafka_tool_bin() {
  if [ -n "${STACK_KAFKA_TOOL:-}" ]; then
    [ -x "$STACK_KAFKA_TOOL" ] || die "STACK_KAFKA_TOOL=$STACK_KAFKA_TOOL is not an executable"
    echo "$STACK_KAFKA_TOOL"
    return
  fi
  local dir=${CARGO_TARGET_DIR:-target}
  case $dir in /*) ;; *) dir=$ROOT/$dir ;; esac # cargo runs in ROOT below
  local bin=$dir/debug/kafka-tool
  if [ ! -x "$bin" ] || [ -n "$(find "$ROOT/crates/effectively/src" "$ROOT/crates/pipeline/src" -newer "$bin" -print -quit)" ]; then
    (cd "$ROOT" && cargo build -q -p pipeline --features kafka --bin kafka-tool) >&2 || die "building kafka-tool failed"
  fi
  echo "$bin"
}

stop_node() {
  local n=$1 pid
  if pid=$(node_pid "$n"); then
    # SIGTERM: a controlled shutdown (leadership moved off the node first).
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    log "kafka node $n stopped"
  fi
  rm -f "$(node_dir "$n")/pid"
}

kafka_down() {
  local n any=0 stopping=()
  for n in $(seq 1 "$KAFKA_NODES"); do
    node_pid "$n" >/dev/null && any=1
    # In parallel: the last two nodes of three wait for each other's quorum.
    stop_node "$n" &
    stopping+=($!)
  done
  # These only: this shell may also be the parent of the PostgreSQL
  # cluster's daemons it started in the same `up`, which never exit.
  wait "${stopping[@]}"
  [ "$any" = 1 ] || log "kafka not running"
}

# The node that leads most partitions of $TOPIC (Kafka's own kafka-topics
# --describe), or node 1 when that cannot be read.
busiest_leader() {
  # shellcheck disable=SC2046
  java $(java_props "$ROOT/scripts/kafka/tools-log4j2.properties") -cp "$KAFKA_LIBS/*" org.apache.kafka.tools.TopicCommand \
    --bootstrap-server "$(bootstrap_servers)" --command-config "$KAFKA_CLIENTS/admin-java.properties" \
    --describe --topic "$TOPIC" 2>/dev/null \
    | grep -o 'Leader: [0-9]*' | awk '{c[$2]++} END {best=1; for (k in c) if (c[k] > c[best]) best=k; print best}' \
    || echo 1
}

# The key that seals the webhook destinations' specs (their signing secrets)
# in orders.webhook_destinations (relay --webhook-secrets-key-file): 32
# random bytes, made once, 0600. Rotating: put a new line first
# (`relay webhooks keygen --id k2`), keep the old one after it, run `relay
# webhooks rekey`, then drop the old line.
WEBHOOK_KEY_FILE=$PG_SECRETS/webhook-secrets.key
webhook_secrets_key() {
  (umask 077; mkdir -p "$PG_SECRETS")
  [ -s "$WEBHOOK_KEY_FILE" ] && return
  local tmp
  tmp=$(umask 077; mktemp "$PG_SECRETS/webhook-secrets.XXXXXX")
  { echo "# Written by scripts/stack.sh: ID:BASE64, the first line seals (relay --webhook-secrets-key-file)"
    printf 'k1:%s\n' "$(openssl rand -base64 32)"; } >"$tmp" || die "openssl could not make the webhook secrets key"
  mv "$tmp" "$WEBHOOK_KEY_FILE"
}

# DATABASE_URL is the owner's (the superuser's): migrations and the scripts'
# own queries. Each service runs as its own role with the URL of its
# *_DATABASE_URL (migrations/*_roles.sql grants the roles their tables). No
# URL carries a password or TLS settings: libpq's environment does
# (PGPASSFILE, PGSSLMODE, PGSSLROOTCERT: scripts/lib/pg-security.sh), so a
# script may swap a URL's database (${URL%/*}/other) and keep both.
write_env() {
  local base=127.0.0.1:$PG_PORT/$DB
  cat >"$ENV_FILE" <<ENV
# Written by scripts/stack.sh; source it (. $ENV_FILE) or let the Makefile include it.
# DATABASE_URL: the owner's, for migrations; each service runs with its own *_DATABASE_URL.
export DATABASE_URL=postgres://postgres@$base
export STACK_ADMIN_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres
export ORDERS_DATABASE_URL=postgres://effectively_orders@$base
export RELAY_DATABASE_URL=postgres://effectively_relay@$base
export PAYMENTS_DATABASE_URL=postgres://effectively_payments@$base
export RECON_DATABASE_URL=postgres://effectively_recon@$base
# The services share this machine's cores with PostgreSQL and the Kafka nodes:
# one thread each for their tasks (--worker-threads) spent less CPU per order.
export WORKER_THREADS=1
ENV
  pg_security_env >>"$ENV_FILE"
  webhook_secrets_key
  cat >>"$ENV_FILE" <<ENV
# The relay seals the webhook destinations' signing secrets at rest with this key (0600).
export RELAY_WEBHOOK_SECRETS_KEY_FILE=$WEBHOOK_KEY_FILE
ENV
  if [ "$WITH_KAFKA" = 1 ] || node_pid 1 >/dev/null; then
    cat >>"$ENV_FILE" <<ENV
export KAFKA_BOOTSTRAP_SERVERS=$(bootstrap_servers)
export KAFKA_TOPIC=$TOPIC
ENV
    kafka_security_env >>"$ENV_FILE"
    # One node: every topic has one replica, which the relay and payments
    # refuse unless told this is a single-node stack.
    if [ "$KAFKA_NODES" = 1 ]; then
      echo "export KAFKA_ALLOW_UNDER_REPLICATED_TOPIC=true" >>"$ENV_FILE"
    fi
  fi
  cat "$ENV_FILE"
}

# kill -9 Kafka nodes N…, and wait until they are gone.
kill_nodes() {
  local n pid pids=()
  for n in "$@"; do
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$KAFKA_NODES" ] || die "NODE must be 1..$KAFKA_NODES, got '$n'"
    pid=$(node_pid "$n") || die "kafka node $n is not running"
    pids+=("$pid")
  done
  kill -9 "${pids[@]}"
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  done
  log "kafka node(s) $* killed (kill -9 ${pids[*]}); down for ${down_ms} ms"
}

# A Kafka node SIGSTOPped for MS milliseconds (longer than
# replica.lag.time.max.ms, it leaves its partitions' ISR), then SIGCONTed:
# chaos --fault broker-pause. NODE defaults to the busiest leader.
pause() {
  local what=${1:-} ms=${2:-15000} n=${3:-} pid
  [ "$what" = broker ] || die "pause what? broker, got '$what'"
  [[ $ms =~ ^[0-9]+$ ]] || die "MS must be a number of milliseconds, got '$ms'"
  ensure_kafka
  [ -n "$n" ] || n=$(busiest_leader)
  pid=$(node_pid "$n") || die "kafka node $n is not running"
  kill -STOP "$pid"
  log "kafka node $n paused (SIGSTOP $pid) for $ms ms"
  sleep "$(ms_to_s "$ms")"
  kill -CONT "$pid"
  log "kafka node $n continued (SIGCONT $pid)"
}

# An infrastructure fault for chaos: crash one component the hard way, keep it
# down, start it again the way `up` does. Returns once it serves again.
crash() {
  local what=${1:-} down_ms=${2:-2000} lag_ms=${3:-0}
  [[ $down_ms =~ ^[0-9]+$ ]] || die "DOWN_MS must be a number of milliseconds, got '$down_ms'"
  [[ $lag_ms =~ ^[0-9]+$ ]] || die "LAG_MS must be a number of milliseconds, got '$lag_ms'"
  local down_s
  down_s=$(ms_to_s "$down_ms")
  case "$what" in
    postgres)
      if [ "$PG_MODE" = ha ]; then
        # The primary's postmaster only: its Patroni restarts it in place
        # (no failover: the leader key never expires).
        local leader pid
        leader=$(ha_leader) || die "postgres is not running"
        pid=$(ha_postmaster_pid "$leader") || die "pg$leader's postmaster is not running"
        kill -9 "$pid"
        log "postgres pg$leader (the primary) kill -9'd; its Patroni restarts it"
        sleep "$down_s"
        ha_wait_primary 120 || die "no primary within 120 s of the crash, see $LOGS/patroni-*.log"
        return
      fi
      find_pg_bin && pg_running || die "postgres is not running"
      as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -m immediate -w -t 60 stop >/dev/null
      log "postgres crashed (pg_ctl stop -m immediate); down for ${down_ms} ms"
      sleep "$down_s"
      pg_up ;;
    broker)
      # The node to kill: NODE, or the leader of most of $TOPIC's partitions.
      ensure_kafka
      local n=${3:-}
      [ -n "$n" ] || n=$(busiest_leader)
      kill_nodes "$n"
      sleep "$down_s"
      start_node "$n"
      wait_node_ready "$n" ;;
    quorum)
      # Two of three at once, the busiest leader among them: no partition can
      # reach min.insync.replicas=2 (and the KRaft quorum has lost its
      # majority), so nothing is acked until both are back.
      [ "$KAFKA_NODES" = 3 ] || die "crash quorum needs the 3-node cluster (STACK_KAFKA_NODES=3)"
      ensure_kafka
      local first second
      first=$(busiest_leader)
      second=$(( first % 3 + 1 ))
      kill_nodes "$first" "$second"
      sleep "$down_s"
      start_node "$first"
      start_node "$second"
      wait_node_ready "$first"
      wait_node_ready "$second" ;;
    *) die "crash what? postgres, broker or quorum, got '$what'" ;;
  esac
}

# The cluster's own faults (STACK_PG=ha): see the usage at the top.
pg_cmd() {
  local what=${1:-} down_ms=${2:-2000} lag_ms=${3:-0}
  [[ $down_ms =~ ^[0-9]+$ ]] || die "DOWN_MS must be a number of milliseconds, got '$down_ms'"
  [[ $lag_ms =~ ^[0-9]+$ ]] || die "LAG_MS must be a number of milliseconds, got '$lag_ms'"
  find_pg_bin || die "PostgreSQL is not installed: scripts/stack.sh up"
  [ "$PG_MODE" = ha ] || die "pg $what: the PostgreSQL cluster's faults need STACK_PG=ha (this stack runs one node: STACK_PG=ha scripts/stack.sh up)"
  case "$what" in
    failover) ha_failover "$(ms_to_s "$down_ms")" "$(ms_to_s "$lag_ms")" ;;
    switchover) ha_switchover ;;
    standby-loss) ha_standby_loss "$(ms_to_s "$down_ms")" ;;
    partition) ha_partition "$(ms_to_s "${2:-30000}")" ;;
    check) ha_check ;;
    *) die "pg what? failover, switchover, standby-loss, partition or check, got '$what'" ;;
  esac
}

# What tests and benchmarks leave behind (see the usage at the top).
clean() {
  pg_running || die "postgres is not running: scripts/stack.sh up"
  local dbs n=0
  dbs=$(admin_psql -c "SELECT datname FROM pg_database WHERE datname LIKE 'test\_%'")
  for db in $dbs; do
    admin_psql -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null
    n=$((n + 1))
  done
  log "dropped $n test databases"
  if [ "$WITH_KAFKA" = 1 ] && node_pid 1 >/dev/null; then
    "$ROOT/scripts/kafka.sh" topics --delete --if-exists --topic 'test-.*|order\.events\.test-.*|bench\..*' >/dev/null
    log "deleted the test and benchmark topics; $("$ROOT/scripts/kafka.sh" topics --list 2>/dev/null | grep -vc '^__') topics left"
  fi
}

# The network faults' firewall (chaos, its tests) comes with the stack, as root.
ensure_fault_tools() {
  if [ "$(id -u)" = 0 ] && ! command -v iptables >/dev/null 2>&1; then ensure_net_tools; fi
}

case "${1:-}" in
  up)
    ensure_fault_tools
    pg_up; if [ "$WITH_KAFKA" = 1 ]; then kafka_up; fi; write_env ;;
  fetch)
    # What `up` installs and downloads, without starting anything: make demo
    # runs it beside its build.
    ensure_fault_tools
    ensure_postgres_installed; if [ "$WITH_KAFKA" = 1 ]; then ensure_kafka; fi
    log "fetched: PostgreSQL ${PG_BIN:-installed}${KAFKA_LIBS:+, Kafka $KAFKA_VERSION in $KAFKA_LIBS}" ;;
  paths)
    # Where `fetch` put PostgreSQL's binaries and Kafka's jars, as shell
    # assignments (scripts/check-compose.sh runs them without the stack).
    ensure_postgres_installed; ensure_kafka
    echo "PG_BIN=$PG_BIN"; echo "KAFKA_LIBS=$KAFKA_LIBS" ;;
  clean) find_pg_bin || die "PostgreSQL is not installed: scripts/stack.sh up"; clean ;;
  down)
    # A Debezium worker beside the stack (scripts/debezium.sh) goes first: it reads both.
    if [ -s "$STACK_DIR/debezium/pid" ]; then STACK_DIR=$STACK_DIR "$ROOT/scripts/debezium.sh" down || true; fi
    kafka_down; if [ "$NET" = netns ]; then net_down; else net_heal_all quiet; fi; pg_down ;;
  status)
    if [ "$PG_MODE" = ha ]; then
      ha_status
      if ha_pid "$HA_DIR/haproxy.pid" >/dev/null; then echo "haproxy: 127.0.0.1:$PG_PORT -> pg$(ha_leader || echo '?')"; else echo "haproxy: stopped"; fi
    elif find_pg_bin && pg_running; then echo "postgres: running on 127.0.0.1:$PG_PORT"; else echo "postgres: stopped"; fi
    for n in $(seq 1 "$KAFKA_NODES"); do
      if node_pid "$n" >/dev/null; then echo "kafka node $n: running on $(node_host "$n"):$(client_port "$n")"; else echo "kafka node $n: stopped"; fi
    done
    net_status ;;
  crash) shift; crash "$@" ;;
  pause) shift; pause "$@" ;;
  net) shift; net_cmd "$@" ;;
  pg) shift; pg_cmd "$@" ;;
  *) echo "usage: $0 up|down|status|fetch|paths|clean|crash postgres|broker|quorum [DOWN_MS [NODE]]|pause broker [MS [NODE]]|pg failover [DOWN_MS [LAG_MS]]|switchover|standby-loss [DOWN_MS]|partition [MS]|check|net partition|lag|cut|heal|check|status ..." >&2; exit 2 ;;
esac
