# shellcheck shell=bash
# What every experiment script shares (experiments/exp-N-*/run.sh sources
# this after setting ROOT): quick or full mode, the results folder, the stack
# (embedded, or the one STACK_ENV_FILE names, as demo.sh), the build, and one
# chaos run on a fresh database and topic. They work from any directory, on
# the stack STACK_DIR names (default: the checkout's .stack). What the runs
# mean, the verdicts, is code: experiments/lib/expN.py.
#
#   QUICK=1         quick mode (CI: each experiment in about 2 minutes once built)
#   EXP_PROFILE     cargo profile of the binaries (release)
#   EXP_BIN         run the binaries in this directory instead of building
#                   (another build's target/release, for an A/B of two builds)
#   EXP_RES_NAME    the results folder's name under results/ (the mode: quick|full),
#                   to keep a run at other settings beside the committed one
#   STACK_ENV_FILE  use the PostgreSQL and Kafka this file names (e.g. compose.env)

# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"

say() { printf '\n== %s\n' "$*" >&2; }

# exp_init DIR: sets MODE (quick|full), RES (DIR/results/MODE or EXP_RES_NAME, emptied), brings
# the stack up and builds the binaries (BIN).
exp_init() {
  EXP_DIR=$1
  if [ "${QUICK:-0}" = 1 ]; then MODE=quick; else MODE=full; fi
  RES=$EXP_DIR/results/${EXP_RES_NAME:-$MODE}
  rm -rf "$RES"
  mkdir -p "$RES/logs"
  pipeline_stack
  # chaos's pg-crash and broker-kill call this script (its default is relative
  # to the working directory); it honours STACK_DIR like pipeline_stack.
  export CHAOS_STACK_SCRIPT=${CHAOS_STACK_SCRIPT:-$ROOT/scripts/stack.sh}
  if [ -n "${EXP_BIN:-}" ]; then
    say "binaries: $EXP_BIN (EXP_BIN, not built)"
    [ -x "$EXP_BIN/relay" ] || { echo "experiment: EXP_BIN=$EXP_BIN has no relay binary" >&2; exit 2; }
    BIN=$EXP_BIN
  else
    say "build (${EXP_PROFILE:-release})"
    pipeline_build "${EXP_PROFILE:-release}"
  fi
}

# exp_chaos TAG [chaos flags...]: one chaos run on a fresh database and topic
# (exp_TAG, order.events.exp-TAG-<time>), logs in RES/logs/TAG, summary in
# RES/TAG.json. EXP_PREPARE, when set, names a command run on the fresh
# database first (DATABASE_URL is the owner's). Prints chaos's output; returns its exit status (recon's).
exp_chaos() {
  local tag=$1
  shift
  local run
  run=$tag-$(date +%H%M%S)
  pipeline_fresh "exp_${tag//-/_}" "$run"
  export PAYMENTS_GROUP_ID=payments-$run
  # A step of the experiment's own on the fresh database and topic, before
  # chaos (PAYMENTS_GROUP_ID names the run's consumer group).
  if [ -n "${EXP_PREPARE:-}" ]; then "$EXP_PREPARE"; fi
  say "chaos $tag: $*"
  local status=0
  RUST_LOG=${RUST_LOG:-warn} "$BIN/chaos" --out "$RES/logs/$tag" --json "$RES/$tag.json" \
    --loadgen-arg=--progress --loadgen-arg=off "$@" || status=$?
  return $status
}

# exp_auth CALLER: from here on the experiment's orders authenticate their
# callers (ORDERS_AUTH_TOKENS_FILE) and its loadgen sends as CALLER
# (LOADGEN_TOKEN_FILE), with a token minted by `orders new-token` into
# RES/logs/auth (0600, the run's alone). Chaos's children inherit both; the
# intents files name the caller, so recon reads each key in its scope.
exp_auth() {
  local dir=$RES/logs/auth
  mkdir -p "$dir"
  chmod 700 "$dir"
  rm -f "$dir/tokens" "$dir/$1.token"
  (umask 077 && "$BIN/orders" new-token "$1" --append-to "$dir/tokens" >"$dir/$1.token")
  export ORDERS_AUTH_TOKENS_FILE=$dir/tokens LOADGEN_TOKEN_FILE=$dir/$1.token
  say "callers authenticate: loadgen sends as $1 (orders --auth-tokens-file $dir/tokens)"
}

# What the stack is put back to when the experiment exits (exp_restore):
# the settings exp_netns and exp_pg_cluster changed, as they were.
EXP_RESTORE=()

# exp_netns: the Kafka nodes in network namespaces from here on
# (STACK_NET=netns: the next `up` restarts the cluster there, on fresh
# storage, if it runs elsewhere), and the stack back on the network it was on
# when the experiment exits.
exp_netns() {
  local was
  was=$(cut -d' ' -f1 "${STACK_DIR:-$ROOT/.stack}/kafka/net" 2>/dev/null || echo loopback)
  [ "$was" = netns ] || { EXP_RESTORE+=("STACK_NET=$was"); trap exp_restore EXIT; }
  export STACK_NET=netns
}

# exp_pg_cluster [SYNC]: PostgreSQL as the 3-node cluster under Patroni from
# here on (STACK_PG=ha, synchronous replication unless SYNC is off; the next
# `up` sets it), and the stack back to the PostgreSQL it ran, and the
# cluster's mode, when the experiment exits. Called again, it changes the
# mode and still puts back the first one.
exp_pg_cluster() {
  local dir=${STACK_DIR:-$ROOT/.stack}
  if [ -z "${EXP_PG_WAS:-}" ]; then
    EXP_PG_WAS=$(cat "$dir/pg-mode" 2>/dev/null || echo single)
    EXP_PG_SYNC_WAS=$(cat "$dir/ha/sync" 2>/dev/null || echo on)
    [ "$EXP_PG_WAS" = ha ] || EXP_RESTORE+=("STACK_PG=$EXP_PG_WAS")
    trap exp_restore EXIT
  fi
  export STACK_PG=ha STACK_PG_SYNC=${1:-on}
}

exp_restore() {
  if [ -n "${EXP_PG_WAS:-}" ] && [ "${STACK_PG_SYNC:-on}" != "${EXP_PG_SYNC_WAS:-on}" ]; then
    if [ "$EXP_PG_WAS" = ha ]; then
      EXP_RESTORE+=("STACK_PG_SYNC=$EXP_PG_SYNC_WAS")
    else
      # The cluster is stopped: its next `up` without STACK_PG_SYNC starts
      # it in the mode it had before the experiment (the stack keeps it here).
      echo "$EXP_PG_SYNC_WAS" >"${STACK_DIR:-$ROOT/.stack}/ha/sync"
    fi
  fi
  [ "${#EXP_RESTORE[@]}" -gt 0 ] || return 0
  say "stack back to ${EXP_RESTORE[*]}"
  env -u KAFKA_TOPIC "${EXP_RESTORE[@]}" "$ROOT/scripts/stack.sh" up >/dev/null \
    || echo "could not put the stack back to ${EXP_RESTORE[*]}" >&2
}

# exp_json FILE EXPR: a value from a JSON file (python expression over `d`).
exp_json() {
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}
