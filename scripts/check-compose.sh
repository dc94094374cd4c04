#!/usr/bin/env bash
# make check-compose: the compose stack's security, run without Docker.
#
# docker-compose.yml secures PostgreSQL and Kafka with the project's own
# scripts (scripts/compose/: secrets.sh, pg-init.sh, pg_hba.conf,
# kafka-node.sh) and the settings written in the compose file itself. This
# runs those scripts, and the compose file's own command lines and
# environments (read from it: PostgreSQL's flags, kafka-init's ACL and topic
# commands, the nodes' healthcheck, each service's environment), with each
# container a network namespace that resolves the others by their compose
# names (postgres, kafka-1..3; the services share one, `app`), on this
# machine's PostgreSQL 15 and Kafka jars (scripts/stack.sh paths). A path
# under /secrets or /opt/kafka in the compose file is read as that
# container's folder of the secrets or the local Kafka. Then it checks:
#   - every secrets folder is 0700 and its files 0600, owned by the user of
#     its container, and the Kafka data volumes the nodes' user's;
#   - PostgreSQL refuses a plaintext connection, a role without its
#     password and one with another role's, and takes each role with TLS
#     verified (verify-full) and its own folder's password file;
#   - the three nodes form their quorum over SASL_SSL; an unauthenticated
#     client is refused; payments cannot produce; the relay cannot read;
#   - the pipeline: migrate, orders, relay and payments with the compose
#     environments, loadgen's orders, and recon CLEAN.
# What it cannot check without Docker: the images themselves (their users'
# ids, the entrypoint's first-start order) and the published host ports.
#
# Needs root (namespaces) and a debug build (cargo build; CARGO_TARGET_DIR).
# Removes what it made when it exits. Run: scripts/check-compose.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[ "$(id -u)" = 0 ] || { echo "check-compose: needs root (network namespaces)" >&2; exit 2; }
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug
for b in orders relay payments recon loadgen kafka-tool; do
  [ -x "$BIN/$b" ] || { echo "check-compose: $BIN/$b is missing: cargo build first" >&2; exit 2; }
done
PY=$(scripts/tools.sh venv)
eval "$(scripts/stack.sh paths 2>/dev/null | grep -E '^(PG_BIN|KAFKA_LIBS)=')"

PREFIX=${CHECK_COMPOSE_NET_PREFIX:-10.213.9}  # the stack's netns mode uses 10.213.7
WORK=$(mktemp -d /tmp/check-compose.XXXXXX)
chmod 0755 "$WORK"
BR=effcmpbr
NSS="postgres kafka-1 kafka-2 kafka-3 app"
declare -A IP=([postgres]=$PREFIX.10 [kafka-1]=$PREFIX.11 [kafka-2]=$PREFIX.12 [kafka-3]=$PREFIX.13 [app]=$PREFIX.20)
PIDS=()

say() { printf '\n== %s\n' "$*"; }
fail() { echo "check-compose: FAIL: $*" >&2; exit 1; }
ns() { echo "effcmp-$1"; }
in_ns() { local n=$1; shift; ip netns exec "$(ns "$n")" "$@"; }

cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ -f "$WORK/pgdata/postmaster.pid" ] && runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/pgdata" -m immediate stop >/dev/null 2>&1 || true
  sleep 1
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done; done
  net_remove
  if [ "${CHECK_COMPOSE_KEEP:-0}" = 1 ]; then echo "check-compose: kept $WORK" >&2; else rm -rf "$WORK"; fi
}

# net_remove: every process still in the namespaces (a service a subshell
# started), the namespaces, veth pairs and bridge (an earlier run's too).
net_remove() {
  local n i=0 pids
  for n in $NSS; do
    pids=$(ip netns pids "$(ns "$n")" 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || { kill -9 $pids 2>/dev/null || true; sleep 0.5; }
  done
  for n in $NSS; do
    i=$((i + 1))
    ip netns del "$(ns "$n")" 2>/dev/null || true
    ip link del "effcmp$i" 2>/dev/null || true
    rm -rf "/etc/netns/$(ns "$n")"
  done
  ip link del "$BR" 2>/dev/null || true
}
net_remove
trap cleanup EXIT

# compose FIELD SERVICE [CONTAINER_SECRETS]: a field of a service of
# docker-compose.yml (merges resolved, `$$` read as `$`): `env` as
# KEY=VALUE lines, `command` and `healthcheck` as one shell line; /secrets
# read as CONTAINER_SECRETS, /opt/kafka as the local Kafka, /compose as
# scripts/compose.
compose() {
  "$PY" - "$@" <<'PY'
import shlex, sys, yaml
field, service = sys.argv[1], sys.argv[2]
secrets = sys.argv[3] if len(sys.argv) > 3 else "/secrets"
svc = yaml.safe_load(open("docker-compose.yml"))["services"][service]
import os
def local(text):
    text = text.replace("$$", "$").replace("/secrets", secrets)
    return text.replace("/opt/kafka", os.environ["KAFKA_HOME"]).replace("/compose/", os.environ["COMPOSE_DIR"] + "/")
if field == "env":
    for k, v in svc.get("environment", {}).items():
        print(f"{k}={local(str(v))}")
elif field == "command":
    c = svc["command"]
    print(local(c if isinstance(c, str) else (c[0] if len(c) == 1 else shlex.join(c))))
elif field == "healthcheck":
    print(local(svc["healthcheck"]["test"][1]))
PY
}
export KAFKA_HOME=$WORK/kafka-home COMPOSE_DIR=$ROOT/scripts/compose

say "network: a namespace per container on $PREFIX.0/24"
ip route get "$PREFIX.1" 2>/dev/null | grep -q "dev lo\|local" && fail "$PREFIX.1 is an address of this machine; set CHECK_COMPOSE_NET_PREFIX"
ip link add "$BR" type bridge
ip addr add "$PREFIX.1/24" dev "$BR"
ip link set "$BR" up
i=0
for n in $NSS; do
  i=$((i + 1))
  ip netns add "$(ns "$n")"
  ip link add "effcmp$i" type veth peer name eth0 netns "$(ns "$n")"
  ip link set "effcmp$i" master "$BR" up
  ip -n "$(ns "$n")" addr add "${IP[$n]}/24" dev eth0
  ip -n "$(ns "$n")" link set eth0 up
  ip -n "$(ns "$n")" link set lo up
  mkdir -p "/etc/netns/$(ns "$n")"
  # The machine's own name too (a container's is its service's): Kafka
  # resolves it for its wildcard listeners.
  { echo "127.0.0.1 localhost"; echo "${IP[$n]} $(hostname)"; for m in $NSS; do echo "${IP[$m]} $m"; done; } \
    >"/etc/netns/$(ns "$n")/hosts"
done

say "secrets (scripts/compose/secrets.sh)"
PG_UID=$(id -u postgres)
for n in 1 2 3; do mkdir -p "$WORK/kafka-$n/data" "$WORK/kafka-$n/conf"; done
SECRETS_DIR=$WORK/secrets HOST_UID=$(id -u) COMPOSE_PG_UID=$PG_UID KAFKA_SECRETS_AT=$WORK/secrets/kafka \
  KAFKA_VOLUMES="$WORK/kafka-1/data $WORK/kafka-2/data $WORK/kafka-3/data" scripts/compose/secrets.sh
S=$WORK/secrets
for dir in postgres kafka grafana migrate orders relay payments recon host; do
  [ "$(stat -c %a "$S/$dir")" = 700 ] || fail "$S/$dir is not 0700"
  for f in "$S/$dir"/*; do
    case $f in */ca.crt) continue ;; esac
    [ "$(stat -c %a "$f")" = 600 ] || fail "$f is not 0600"
  done
done
[ "$(stat -c %u "$S/postgres/postgres.key")" = "$PG_UID" ] || fail "the server's key is not the postgres user's"
[ "$(stat -c %u "$S/relay/pgpass")" = 10001 ] || fail "the relay's password file is not the app user's"
[ "$(stat -c %u "$WORK/kafka-2/data")" = 1000 ] || fail "a Kafka data volume is not the nodes' user's"
grep -q effectively_relay "$S/orders/pgpass" && fail "orders' folder holds the relay's password"
echo "folders 0700, files 0600, each its container's user's; a service's folder holds its own role only"

say "postgresql with the compose command line"
install -d -o postgres -m 0700 "$WORK/pgdata" "$WORK/pgsock"
runuser -u postgres -- "$PG_BIN/initdb" -D "$WORK/pgdata" -U postgres --pwfile="$S/postgres/postgres.password" \
  --auth-local=peer --auth-host=scram-sha-256 >"$WORK/initdb.log" 2>&1 || { cat "$WORK/initdb.log"; fail "initdb"; }
# The image's command, without its first word; the image's own defaults
# added for a server outside it (listen on every address, the socket's folder).
read -ra PG_ARGS <<<"$(compose command postgres "$S/postgres" | cut -d' ' -f2-)"
in_ns postgres runuser -u postgres -- "$PG_BIN/postgres" -D "$WORK/pgdata" "${PG_ARGS[@]//\'/}" \
  -c listen_addresses='*' -c unix_socket_directories="$WORK/pgsock" -c max_connections=100 >"$WORK/postgres.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 50); do in_ns postgres runuser -u postgres -- pg_isready -q -h "$WORK/pgsock" && break; sleep 0.2; done
in_ns postgres runuser -u postgres -- env SECRETS="$S/postgres" PGHOST="$WORK/pgsock" POSTGRES_DB=postgres scripts/compose/pg-init.sh \
  || fail "pg-init.sh"
in_ns postgres runuser -u postgres -- psql -h "$WORK/pgsock" -U postgres -qc "CREATE DATABASE effectively"

psql_as() { # ROLE PASSFILE SSLMODE
  in_ns app env -i PATH="$PATH" PGPASSFILE="$2" PGSSLMODE="$3" PGSSLROOTCERT="$S/orders/ca.crt" PGCONNECT_TIMEOUT=5 \
    psql "postgres://$1@postgres:5432/effectively" -qAtc "SELECT current_user || ' ' || (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid())" 2>&1
}
out=$(psql_as effectively_orders "$S/orders/pgpass" disable) && fail "a plaintext connection was let in: $out"
echo "plaintext: refused ($(grep -o 'no pg_hba.conf entry[^,]*' <<<"$out" | head -1))"
out=$(psql_as effectively_orders /dev/null verify-full) && fail "a role without a password was let in: $out"
echo "no password: refused"
out=$(psql_as effectively_relay "$S/orders/pgpass" verify-full) && fail "the relay's role was let in with orders' folder: $out"
echo "another role's folder: refused"
for role in orders relay payments recon; do
  out=$(psql_as "effectively_$role" "$S/$role/pgpass" verify-full) || fail "effectively_$role could not sign in: $out"
  [ "$out" = "effectively_$role true" ] || fail "effectively_$role: $out"
done
echo "each role with its own folder, TLS verified: in"

say "kafka: three nodes from scripts/compose/kafka-node.sh"
mkdir -p "$KAFKA_HOME/bin" "$KAFKA_HOME/config"
ln -s "$KAFKA_LIBS" "$KAFKA_HOME/libs"
shim() { # NAME CLASS
  printf '#!/bin/sh\nexec java -Xmx256m -Dlog4j2.configurationFile=%s -cp "%s/*" %s "$@"\n' \
    "$ROOT/scripts/kafka/tools-log4j2.properties" "$KAFKA_LIBS" "$2" >"$KAFKA_HOME/bin/$1"
  chmod +x "$KAFKA_HOME/bin/$1"
}
shim kafka-acls.sh org.apache.kafka.tools.AclCommand
shim kafka-topics.sh org.apache.kafka.tools.TopicCommand
shim kafka-broker-api-versions.sh org.apache.kafka.tools.BrokerApiVersionsCommand
printf '#!/bin/sh\nexec java $KAFKA_HEAP_OPTS -Dlog4j2.configurationFile=%s -cp "%s/*" kafka.Kafka "$@"\n' \
  "$ROOT/scripts/kafka/tools-log4j2.properties" "$KAFKA_LIBS" >"$KAFKA_HOME/bin/kafka-server-start.sh"
chmod +x "$KAFKA_HOME/bin/kafka-server-start.sh"
for n in 1 2 3; do
  mapfile -t env < <(compose env "kafka-$n" "$S/kafka")
  in_ns "kafka-$n" env -i PATH="$PATH" "${env[@]}" KAFKA_HEAP_OPTS="-Xms256m -Xmx256m" \
    KAFKA_HOME="$KAFKA_HOME" KAFKA_DATA="$WORK/kafka-$n/data" KAFKA_CONF="$WORK/kafka-$n/conf" SECRETS="$S/kafka" \
    GROUP_SESSIONS="$ROOT/scripts/kafka/group-sessions.properties" \
    bash scripts/compose/kafka-node.sh >"$WORK/kafka-$n.log" 2>&1 &
  PIDS+=($!)
done
health=$(compose healthcheck kafka-1 "$S/kafka")
for n in 1 2 3; do
  ok=0
  for _ in $(seq 1 90); do
    if in_ns "kafka-$n" bash -c "$health"; then ok=1; break; fi
    kill -0 "${PIDS[$n]}" 2>/dev/null || break
    sleep 1
  done
  [ "$ok" = 1 ] || { tail -20 "$WORK/kafka-$n.log"; fail "kafka-$n did not pass its healthcheck"; }
done
echo "three nodes healthy (the compose healthcheck, as admin over SASL_SSL)"
grep -q "sasl.password\|password=" "$WORK"/kafka-*.log && fail "a node's log shows a password"

say "kafka-init: the compose file's ACLs and topic"
in_ns app bash -c "$(compose command kafka-init "$S/kafka")" >"$WORK/kafka-init.log" 2>&1 || { cat "$WORK/kafka-init.log"; fail "kafka-init"; }
grep -q "PartitionCount: 6" "$WORK/kafka-init.log" || fail "kafka-init made no topic of 6 partitions"
echo "ACLs granted, order.events made"

servers=kafka-1:29092,kafka-2:29092,kafka-3:29092
(umask 077; printf 'security.protocol=plaintext\n' >"$WORK/plain.properties"; printf 'security.protocol=ssl\nssl.ca.location=%s\n' "$S/host/ca.crt" >"$WORK/tls-only.properties")
for who in plain.properties tls-only.properties; do
  out=$(in_ns app timeout 20 "$BIN/kafka-tool" --bootstrap-servers "$servers" --client-config "$WORK/$who" produce \
    --topic order.events --key forged --value '{"forged":true}' 2>&1) && fail "a client with $who produced: $out"
done
echo "no SASL (plaintext, TLS only): refused"
out=$(in_ns app timeout 20 "$BIN/kafka-tool" --bootstrap-servers "$servers" --client-config "$S/payments/kafka.properties" produce \
  --topic order.events --key forged --value '{"forged":true}' 2>&1) && fail "payments produced: $out"
echo "payments producing: refused"
out=$(in_ns app timeout 20 "$BIN/kafka-tool" --bootstrap-servers "$servers" --client-config "$S/relay/kafka.properties" tail \
  --topic order.events --max 1 --timeout 10 2>&1) || true
grep -q TopicAuthorizationFailed <<<"$out" || fail "the relay was not refused reading: $out"
echo "the relay reading: refused (TopicAuthorizationFailed)"
out=$(in_ns app timeout 30 "$BIN/kafka-tool" --bootstrap-servers "$servers" --client-config "$S/host/admin.properties" tail \
  --topic order.events --from start --until-end --timeout 20 2>&1) || fail "the admin could not read order.events: $out"
grep -q "key=forged" <<<"$out" && fail "a forged message is in order.events: $out"
echo "order.events, read by the admin: no forged message in it"

say "the pipeline with the compose environments"
run_service() { # SERVICE COMMAND... (the compose environment of SERVICE, its folder as /secrets)
  local svc=$1
  shift
  local env
  mapfile -t env < <(compose env "$svc" "$S/$svc")
  in_ns app env -i PATH="$PATH" "${env[@]}" "$@"
}
run_service migrate "$BIN/orders" --migrate-only >"$WORK/migrate.log" 2>&1 || { tail "$WORK/migrate.log"; fail "migrate"; }
run_service orders "$BIN/orders" >"$WORK/orders.log" 2>&1 &
PIDS+=($!)
run_service relay "$BIN/relay" >"$WORK/relay.log" 2>&1 &
PIDS+=($!)
run_service payments "$BIN/payments" >"$WORK/payments.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do in_ns app curl -fsS -o /dev/null http://127.0.0.1:9100/metrics 2>/dev/null && break; sleep 0.2; done
in_ns app env -i PATH="$PATH" "$BIN/loadgen" --http-url http://127.0.0.1:8080 --grpc-url http://127.0.0.1:50051 \
  --rate 100 --duration 5 --progress off >"$WORK/loadgen.log" 2>&1 || { tail "$WORK/loadgen.log"; fail "loadgen"; }
run_service recon "$BIN/recon" --wait-drained 60 >"$WORK/recon.log" 2>&1 || { tail -30 "$WORK/recon.log" "$WORK/relay.log" "$WORK/payments.log"; fail "recon"; }
grep -q CLEAN "$WORK/recon.log" || { cat "$WORK/recon.log"; fail "recon is not CLEAN"; }
echo "recon: CLEAN, $(awk '/distinct orders/ {print $NF; exit}' "$WORK/recon.log") distinct orders"
echo
echo "check-compose: ok"
