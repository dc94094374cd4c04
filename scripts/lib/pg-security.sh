# PostgreSQL without trust, sourced by scripts/stack.sh (which sets
# STACK_DIR, PGDATA, SOCK, PG_PORT, as_pg, admin_psql, log and die, and
# sources scripts/lib/tls.sh).
#
# STACK_SECURITY=tls (the default):
# - every role signs in with SCRAM-SHA-256 and a password of its own, made
#   by the stack on the first `up` (openssl rand, 192 bits) and kept in
#   $STACK_DIR/secrets (0700; each file 0600). The server gets only each
#   password's SCRAM verifier, computed here and sent on psql's stdin, so no
#   password is ever in a process's arguments, the server's log or
#   pg_stat_statements. The clients read them from one libpq password file
#   ($PG_PASSFILE, exported as PGPASSFILE), which psql, libpq and sqlx all
#   read; a deployment gives each service its own line only;
# - TCP connections are TLS only (hostssl), with a server certificate from
#   the stack's CA for 127.0.0.1 and localhost, and the clients verify it
#   (PGSSLMODE=verify-full, PGSSLROOTCERT=the CA): a plaintext connection
#   finds no pg_hba.conf line and is refused;
# - the superuser signs in over the Unix socket only as the OS user that
#   runs the server (peer), and the socket's directory and the data
#   directory are closed to every other user (0700).
# STACK_SECURITY=plaintext: the same passwords, over TCP without TLS: the
# counter-example the cost of TLS is measured against (FINDINGS).
#
# pg_hba.conf, pg_ident.conf and the passwords are written again at every
# `up` (a server made by an older stack.sh, which trusted everyone, is
# closed the same way and reloaded).

PG_SECRETS=$STACK_DIR/secrets
PG_PASSFILE=$PG_SECRETS/pgpass
# The superuser (the owner: migrations, the scripts' queries) and the
# services' roles (migrations/*_roles.sql grants them their tables).
PG_ROLES="postgres effectively_orders effectively_relay effectively_payments effectively_recon"
# The mode is the stack's: `up` records it, and a command without
# STACK_SECURITY (a crash's restart) keeps it.
SECURITY=${STACK_SECURITY:-$(cat "$STACK_DIR/security" 2>/dev/null || echo tls)}
case $SECURITY in
  tls | plaintext) ;;
  *) echo "stack: error: STACK_SECURITY must be tls or plaintext, got '$SECURITY'" >&2; exit 2 ;;
esac

# pg_secrets: a password per role (kept across `up`s), and the password
# file that names them.
pg_secrets() {
  (umask 077; mkdir -p "$PG_SECRETS")
  chmod 0700 "$PG_SECRETS"
  local role tmp
  for role in $PG_ROLES; do
    [ -s "$PG_SECRETS/$role.password" ] && continue
    (umask 077; openssl rand -hex 24 >"$PG_SECRETS/$role.password") || die "openssl could not make a password"
  done
  tmp=$(umask 077; mktemp "$PG_SECRETS/pgpass.XXXXXX")
  {
    echo "# Written by scripts/stack.sh: host:port:database:user:password (libpq's password file)"
    for role in $PG_ROLES; do
      printf '127.0.0.1:%s:*:%s:%s\n' "$PG_PORT" "$role" "$(cat "$PG_SECRETS/$role.password")"
      printf 'localhost:%s:*:%s:%s\n' "$PG_PORT" "$role" "$(cat "$PG_SECRETS/$role.password")"
    done
  } >"$tmp"
  mv "$tmp" "$PG_PASSFILE"
}

# pg_tls_files: with STACK_SECURITY=tls, the server's certificate from the
# stack's CA (for 127.0.0.1 and localhost), its key the server's to read.
pg_tls_files() {
  [ "$SECURITY" = tls ] || return 0
  tls_issue postgres 127.0.0.1 "IP:127.0.0.1,DNS:localhost"
  if [ "$(id -u)" = 0 ]; then chown postgres "$TLS_DIR/postgres.key"; fi
}

# pg_configure: the server's authentication and TLS files, before it starts
# (or before a reload).
pg_configure() {
  echo "$SECURITY" >"$STACK_DIR/security"
  pg_secrets
  pg_tls_files
  local ssl=off
  [ "$SECURITY" = tls ] && ssl=on
  local host=hostssl
  [ "$SECURITY" = plaintext ] && host=host
  as_pg tee "$PGDATA/pg_hba.conf" >/dev/null <<HBA
# Written by scripts/stack.sh at each \`up\` (STACK_SECURITY=$SECURITY): no trust.
# The stack's own administration: the superuser over the Unix socket, and only
# as the OS user that runs the server (the socket's directory is 0700).
local   all          postgres                           peer map=stack
# Everyone else over TCP, with a password (SCRAM)$([ "$host" = hostssl ] && echo " and TLS"); no other line, so
# anything else is refused.
$host all          all                 127.0.0.1/32   scram-sha-256
$host replication  effectively_relay   127.0.0.1/32   scram-sha-256
HBA
  local me
  me=$(id -un)
  as_pg tee "$PGDATA/pg_ident.conf" >/dev/null <<IDENT
# Written by scripts/stack.sh: the OS users that may be the superuser over the socket.
stack  postgres  postgres
$([ "$me" != root ] && [ "$me" != postgres ] && echo "stack  $me  postgres")
IDENT
  as_pg tee "$PGDATA/stack-security.conf" >/dev/null <<CONF
# Written by scripts/stack.sh at each \`up\` (STACK_SECURITY=$SECURITY).
password_encryption = 'scram-sha-256'
unix_socket_permissions = 0700
ssl = $ssl
ssl_cert_file = '$TLS_DIR/postgres.crt'
ssl_key_file = '$TLS_DIR/postgres.key'
ssl_min_protocol_version = 'TLSv1.2'
CONF
  grep -q "^include_if_exists = 'stack-security.conf'" "$PGDATA/postgresql.conf" \
    || echo "include_if_exists = 'stack-security.conf'  # scripts/stack.sh: authentication and TLS" \
      | as_pg tee -a "$PGDATA/postgresql.conf" >/dev/null
  chmod 0700 "$SOCK"
}

# scram_verifier: the SCRAM-SHA-256 verifier (what pg_authid keeps) of the
# password on stdin, as PostgreSQL computes it (RFC 5802, 4096 iterations).
scram_verifier() {
  python3 -c '
import base64, hashlib, hmac, os, sys
password = sys.stdin.read().strip().encode()
salt, iterations = os.urandom(16), 4096
salted = hashlib.pbkdf2_hmac("sha256", password, salt, iterations)
client_key = hmac.new(salted, b"Client Key", "sha256").digest()
server_key = hmac.new(salted, b"Server Key", "sha256").digest()
b64 = lambda b: base64.b64encode(b).decode()
print(f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}")'
}

# pg_set_passwords: each role made (LOGIN) when missing and given its
# password's verifier; statements not tracked, not logged.
pg_set_passwords() {
  local role sql="SET pg_stat_statements.track_utility = off; SET log_statement = 'none';"
  for role in $PG_ROLES; do
    sql+="
DO \$\$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$role') THEN CREATE ROLE $role LOGIN; END IF; END \$\$;
ALTER ROLE $role PASSWORD '$(scram_verifier <"$PG_SECRETS/$role.password")';"
  done
  admin_psql <<<"$sql" >/dev/null || die "could not set the roles' passwords"
}

# pg_security_env: the lines of the env file that point libpq at the
# passwords and the CA.
pg_security_env() {
  local mode=verify-full
  [ "$SECURITY" = plaintext ] && mode=disable
  cat <<ENV
# PostgreSQL (STACK_SECURITY=$SECURITY): every role signs in with SCRAM and its own password,
# read from the password file PGPASSFILE (0600) by psql, libpq and sqlx, never from a URL or argv;
# TCP is TLS only, the server verified against the stack's CA (PGSSLMODE=verify-full).
export STACK_SECURITY=$SECURITY
export PGPASSFILE=$PG_PASSFILE
export PGSSLMODE=$mode
export PGSSLROOTCERT=$TLS_CA
ENV
}
