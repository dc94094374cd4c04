#!/usr/bin/env bash
# Installs the checking and plotting tools the project needs, each only when it
# is missing, into git-ignored places. Used by the Makefile and the check scripts.
#
#   scripts/tools.sh venv            .tools/venv with scripts/requirements-tools.txt
#                                    (matplotlib, jsonschema, PyYAML); prints the python path
#   scripts/tools.sh prometheus      Debian's `prometheus` package (prometheus + promtool),
#                                    installed with apt when absent (needs root); never started
#                                    as a system service
#   scripts/tools.sh compose-schema  the Compose Specification JSON schema, taken from the npm
#                                    package dclint (pinned) into .tools/; prints its path
#   scripts/tools.sh cargo-tools     what `make test` runs besides cargo: cargo-nextest and
#                                    sqlx-cli (pinned; built from crates.io into ~/.cargo/bin
#                                    once per machine, a few minutes each), clippy and rustfmt,
#                                    and OpenSSL's headers for librdkafka (Debian's libssl-dev,
#                                    with apt when absent; needs root)
#   scripts/tools.sh docs-tools      what `make docs` runs: mdBook and its link checker
#                                    (mdbook-linkcheck2), pinned, built from crates.io into
#                                    ~/.cargo/bin once per machine
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS_DIR=$ROOT/.tools
VENV=$TOOLS_DIR/venv
REQUIREMENTS=$ROOT/scripts/requirements-tools.txt
# dclint ships the upstream compose-spec.json as schemas/compose.schema.json.
DCLINT_VERSION=3.1.0
SCHEMA_DIR=$TOOLS_DIR/compose-schema-dclint-$DCLINT_VERSION
SCHEMA=$SCHEMA_DIR/compose.schema.json

log() { printf 'tools: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

venv() {
  local stamp=$VENV/.requirements-installed
  # Reinstall when the pinned requirements changed since the last install.
  if [ ! -x "$VENV/bin/python" ] || [ ! -f "$stamp" ] || [ "$REQUIREMENTS" -nt "$stamp" ]; then
    log "creating $VENV with $(basename "$REQUIREMENTS")"
    python3 -m venv "$VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQUIREMENTS" >&2 \
      || die "pip install -r $REQUIREMENTS failed"
    touch "$stamp"
  fi
  echo "$VENV/bin/python"
}

prometheus() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    return
  fi
  [ "$(id -u)" = 0 ] || die "prometheus/promtool not found; install Debian's prometheus package (needs root)"
  log "installing Debian's prometheus package (prometheus, promtool)"
  export DEBIAN_FRONTEND=noninteractive
  # The package's postinst would start a system-wide Prometheus on :9090; a
  # policy-rc.d that exits 101 tells invoke-rc.d not to start services (the
  # standard Debian switch, as in container images). Created only if absent.
  local policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created=1
  fi
  local rc=0
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >/dev/null || rc=$?
  if [ "$created" = 1 ]; then rm -f "$policy"; fi
  [ "$rc" = 0 ] || die "apt-get install prometheus failed"
  command -v promtool >/dev/null 2>&1 || die "prometheus installed but promtool not found"
}

compose_schema() {
  if [ ! -s "$SCHEMA" ]; then
    command -v npm >/dev/null 2>&1 || die "npm not found (needed to fetch the Compose Specification schema)"
    log "fetching the Compose Specification schema from npm dclint@$DCLINT_VERSION"
    local tmp
    tmp=$(mktemp -d)
    # npm pack downloads the published tarball and checks its integrity hash.
    (cd "$tmp" && npm pack --silent "dclint@$DCLINT_VERSION" >/dev/null 2>&1) \
      || { rm -rf "$tmp"; die "npm pack dclint@$DCLINT_VERSION failed"; }
    mkdir -p "$SCHEMA_DIR"
    tar -xzf "$tmp/dclint-$DCLINT_VERSION.tgz" -C "$tmp" package/schemas/compose.schema.json
    mv "$tmp/package/schemas/compose.schema.json" "$SCHEMA"
    rm -rf "$tmp"
  fi
  echo "$SCHEMA"
}

# cargo install builds from source (crates.io is what these machines reach);
# an installed binary is never rebuilt, so only a machine's first run pays.
SQLX_CLI_VERSION=0.8.6
cargo_tools() {
  # librdkafka (rdkafka-sys, built with the workspace) links the system's
  # OpenSSL for TLS and SASL/SCRAM: its headers come from Debian's libssl-dev.
  if ! pkg-config --exists openssl 2>/dev/null; then
    [ "$(id -u)" = 0 ] || die "OpenSSL's headers not found (pkg-config openssl); install Debian's libssl-dev and pkg-config (needs root)"
    log "installing Debian's libssl-dev and pkg-config (librdkafka's TLS)"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libssl-dev pkg-config; } >/dev/null \
      || die "apt-get install libssl-dev pkg-config failed"
  fi
  if ! command -v cargo-nextest >/dev/null 2>&1; then
    log "installing cargo-nextest from crates.io (once per machine)"
    cargo install cargo-nextest --locked >&2 || die "cargo install cargo-nextest failed"
  fi
  if ! command -v cargo-sqlx >/dev/null 2>&1 || ! cargo sqlx --version 2>/dev/null | grep -q " $SQLX_CLI_VERSION\$"; then
    log "installing sqlx-cli $SQLX_CLI_VERSION from crates.io (once per machine)"
    cargo install sqlx-cli --version "$SQLX_CLI_VERSION" --locked --no-default-features --features rustls,postgres >&2 \
      || die "cargo install sqlx-cli failed"
  fi
  local installed
  installed=$(rustup component list --installed 2>/dev/null || true)
  grep -q '^clippy' <<<"$installed" && grep -q '^rustfmt' <<<"$installed" || rustup component add clippy rustfmt >&2
}

# The book (docs/book): mdBook and the link checker built for its 0.5 line.
MDBOOK_VERSION=0.5.4
MDBOOK_LINKCHECK_VERSION=0.13.0
docs_tools() {
  if ! mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION\$"; then
    log "installing mdbook $MDBOOK_VERSION from crates.io (once per machine)"
    cargo install mdbook --version "$MDBOOK_VERSION" --locked >&2 || die "cargo install mdbook failed"
  fi
  if ! mdbook-linkcheck2 --version 2>/dev/null | grep -q " $MDBOOK_LINKCHECK_VERSION\$"; then
    log "installing mdbook-linkcheck2 $MDBOOK_LINKCHECK_VERSION from crates.io (once per machine)"
    cargo install mdbook-linkcheck2 --version "$MDBOOK_LINKCHECK_VERSION" --locked >&2 ||
      die "cargo install mdbook-linkcheck2 failed"
  fi
}

case "${1:-}" in
  cargo-tools) cargo_tools ;;
  docs-tools) docs_tools ;;
  venv) venv ;;
  prometheus) prometheus ;;
  compose-schema) compose_schema ;;
  *) echo "usage: $0 cargo-tools|docs-tools|venv|prometheus|compose-schema" >&2; exit 2 ;;
esac
