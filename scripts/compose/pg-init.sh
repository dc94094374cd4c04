#!/usr/bin/env bash
# The compose PostgreSQL's first start (an empty volume; the image runs
# /docker-entrypoint-initdb.d/ as the OS user postgres, over the socket):
# each service's login role with its password from /secrets (made by
# compose/secrets.sh). Only the roles: what each may do is granted by the
# migrations (migrations/*_roles.sql), which the `migrate` service applies as
# the owner. The passwords go to psql on stdin (never in a process's
# arguments), not logged and not tracked by pg_stat_statements; the server
# keeps only their SCRAM verifiers (password_encryption=scram-sha-256).
set -euo pipefail
SECRETS=${SECRETS:-/secrets}
sql="SET pg_stat_statements.track_utility = off; SET log_statement = 'none';"
for role in effectively_orders effectively_relay effectively_payments effectively_recon; do
  [ -s "$SECRETS/$role.password" ] || { echo "pg-init: $SECRETS/$role.password is missing" >&2; exit 1; }
  sql+="
CREATE ROLE $role LOGIN PASSWORD '$(cat "$SECRETS/$role.password")';"
done
psql -v ON_ERROR_STOP=1 -q --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" <<<"$sql"
