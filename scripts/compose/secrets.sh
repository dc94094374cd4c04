#!/usr/bin/env bash
# The compose stack's secrets, made by its one-shot `secrets` service
# (docker-compose.yml) before anything else starts, as scripts/stack.sh
# makes the embedded stack's: a CA and the servers' certificates
# (scripts/lib/tls.sh), a password per PostgreSQL role and per Kafka
# principal (192 random bits), the key that seals the webhook destinations,
# and for each consumer a folder of its own with only what it needs:
#
#   postgres/  the server's certificate and key, the roles' passwords
#              (compose/pg-init.sh sets them on the first start)
#   kafka/     the nodes' PEM key store, the broker, controller and SCRAM
#              principals' passwords, admin-java.properties (kafka-init)
#   migrate/   pgpass (the owner)             orders/, recon/  pgpass (its role)
#   relay/     pgpass, kafka.properties (principal relay), webhook-secrets.key
#   payments/  pgpass, kafka.properties (principal payments)
#   grafana/   admin.password (Grafana's admin)
#   host/      what the host's binaries use (compose.env): pgpass of every role
#              on 127.0.0.1:15432, admin/relay/payments.properties, the
#              webhook key, Grafana's admin password
#
# Each folder holds ca.crt. Files are 0600 and owned by the user their
# container runs as (PostgreSQL 999, Kafka 1000, Grafana 472, the
# project's image 10001; host/ by the owner of the checkout), folders 0700. A client
# properties file names its CA relatively (ssl.ca.location=ca.crt), which
# the services resolve against the file's folder, so one file serves a
# container and the host. Kept across `up`s: a secret is made only when
# missing. Rotating one: delete its file under passwords/ and `docker compose
# down -v && docker compose up` (the cluster's credentials are written when
# it is formatted, the roles' when the database is made).
#
# Run by compose as root in the project's image (openssl):
#   SECRETS_DIR=/secrets KAFKA_VOLUMES="/volumes/kafka1 ..." scripts/compose/secrets.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SECRETS_DIR=${SECRETS_DIR:-/secrets}
PG_UID=${COMPOSE_PG_UID:-999}
KAFKA_UID=${COMPOSE_KAFKA_UID:-1000}
GRAFANA_UID=${COMPOSE_GRAFANA_UID:-472}
APP_UID=${COMPOSE_APP_UID:-10001}
# The checkout's owner, for host/: the owner of this script's folder.
HOST_UID=${HOST_UID:-$(stat -c %u "$HERE")}

log() { printf 'secrets: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# tls.sh keeps the CA and the certificates in $STACK_DIR/tls.
STACK_DIR=$SECRETS_DIR
# shellcheck source=../lib/tls.sh
. "$HERE/../lib/tls.sh"

PASSWORDS=$SECRETS_DIR/passwords
PG_ROLES="postgres effectively_orders effectively_relay effectively_payments effectively_recon"
# The Kafka principals, their passwords (passwords/kafka-<principal>.password)
# and client properties as the embedded stack makes them: kafka-security.sh's
# kafka_secrets, librdkafka_properties and java_admin_properties.
PG_SECRETS=$PASSWORDS SECURITY=tls KAFKA_DIR=$SECRETS_DIR/kafka
# shellcheck source=../lib/kafka-security.sh
. "$HERE/../lib/kafka-security.sh"

umask 077
mkdir -p "$SECRETS_DIR" "$PASSWORDS"
chmod 0755 "$SECRETS_DIR"
chmod 0700 "$PASSWORDS"

password() { cat "$PASSWORDS/$1.password"; }

make_secrets() {
  local name
  kafka_secrets
  for name in $PG_ROLES grafana-admin; do
    [ -s "$PASSWORDS/$name.password" ] && continue
    openssl rand -hex 24 >"$PASSWORDS/$name.password" || die "openssl could not make a password"
  done
  if [ ! -s "$PASSWORDS/webhook-secrets.key" ]; then
    { echo "# ID:BASE64, the first line seals (relay --webhook-secrets-key-file)"
      printf 'k1:%s\n' "$(openssl rand -base64 32)"; } >"$PASSWORDS/webhook-secrets.key"
  fi
  tls_issue postgres postgres "DNS:postgres,DNS:localhost,IP:127.0.0.1"
  tls_issue kafka "effectively kafka" "DNS:kafka-1,DNS:kafka-2,DNS:kafka-3,DNS:localhost,IP:127.0.0.1"
}

# folder NAME: $SECRETS_DIR/NAME, with ca.crt. Its files are replaced one
# by one (put), never the folder: a running container has it mounted.
folder() {
  mkdir -p "$SECRETS_DIR/$1"
  put "$1/ca.crt" <"$TLS_CA"
}

# put PATH: standard input into $SECRETS_DIR/PATH, whole or not at all.
put() {
  local tmp
  tmp=$(mktemp "$SECRETS_DIR/$1.XXXXXX")
  cat >"$tmp" && mv "$tmp" "$SECRETS_DIR/$1"
}

# pgpass HOST PORT ROLE...: libpq's password file lines of ROLEs at HOST:PORT.
pgpass() {
  local host=$1 port=$2 role
  shift 2
  echo "# host:port:database:user:password (libpq's password file, PGPASSFILE)"
  for role in "$@"; do printf '%s:%s:*:%s:%s\n' "$host" "$port" "$role" "$(password "$role")"; done
}

# librdkafka PRINCIPAL: its client properties, the CA beside the file.
librdkafka() { TLS_CA=ca.crt librdkafka_properties "$1"; }

make_folders() {
  local role
  folder postgres
  put postgres/postgres.crt <"$TLS_DIR/postgres.crt"
  put postgres/postgres.key <"$TLS_DIR/postgres.key"
  for role in $PG_ROLES; do put "postgres/$role.password" <"$PASSWORDS/$role.password"; done

  folder kafka
  cat "$TLS_DIR/kafka.key" "$TLS_DIR/kafka.crt" | put kafka/keystore.pem
  for role in $KAFKA_PRINCIPALS; do put "kafka/$role.password" <"$PASSWORDS/kafka-$role.password"; done
  # The Kafka containers mount kafka/ at /secrets (KAFKA_SECRETS_AT: elsewhere).
  TLS_CA=${KAFKA_SECRETS_AT:-/secrets}/ca.crt java_admin_properties | put kafka/admin-java.properties

  folder migrate
  pgpass postgres 5432 postgres | put migrate/pgpass
  for role in orders relay payments recon; do
    folder "$role"
    pgpass postgres 5432 "effectively_$role" | put "$role/pgpass"
  done
  librdkafka relay | put relay/kafka.properties
  librdkafka payments | put payments/kafka.properties
  put relay/webhook-secrets.key <"$PASSWORDS/webhook-secrets.key"

  folder grafana
  put grafana/admin.password <"$PASSWORDS/grafana-admin.password"

  folder host
  # shellcheck disable=SC2086
  pgpass 127.0.0.1 15432 $PG_ROLES | put host/pgpass
  for role in admin relay payments; do librdkafka "$role" | put "host/$role.properties"; done
  put host/webhook-secrets.key <"$PASSWORDS/webhook-secrets.key"
  put host/grafana-admin.password <"$PASSWORDS/grafana-admin.password"

  local dir owner
  for dir in postgres kafka grafana migrate orders relay payments recon host; do
    case $dir in
      postgres) owner=$PG_UID ;;
      grafana) owner=$GRAFANA_UID ;;
      kafka) owner=$KAFKA_UID ;;
      host) owner=$HOST_UID ;;
      *) owner=$APP_UID ;;
    esac
    chmod 0700 "$SECRETS_DIR/$dir"
    chmod 0600 "$SECRETS_DIR/$dir"/*
    chmod 0644 "$SECRETS_DIR/$dir/ca.crt"
    chown -R "$owner:$owner" "$SECRETS_DIR/$dir"
  done
}

# The Kafka nodes' data volumes (KAFKA_VOLUMES, mounted here too) are given
# to the user the nodes run as, whatever user id the image's own owner has.
own_kafka_volumes() {
  local volume
  for volume in ${KAFKA_VOLUMES:-}; do
    [ -d "$volume" ] || die "$volume (a Kafka data volume) is not mounted"
    chown "$KAFKA_UID:$KAFKA_UID" "$volume"
    chmod 0700 "$volume"
  done
}

make_secrets
make_folders
own_kafka_volumes
log "ready in $SECRETS_DIR (CA $(openssl x509 -in "$TLS_CA" -noout -subject -enddate | tr '\n' ' '))"
