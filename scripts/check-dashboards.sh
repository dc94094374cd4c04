#!/usr/bin/env bash
# make check-dashboards: proves every Grafana panel's query returns data, with
# no Docker. Runs scripts/check-config.sh first, then a short real run:
#
#   1. the embedded stack (scripts/stack.sh up), a fresh database and topic;
#   2. orders, relay, payments from target/$CHECK_PROFILE on 127.0.0.1
#      (HTTP 18380, gRPC 15351, relay metrics 19301, payments metrics 19302);
#   3. Prometheus (Debian's package, run directly, data in .stack/) on
#      127.0.0.1:19090, scraping them every second (prometheus/check.yml);
#   4. loadgen: $CHECK_RATE orders/s for $CHECK_SECONDS s, 15% retried;
#   5. scripts/eval-dashboards.py evaluates every expression of every panel of
#      grafana/dashboards/*.json at a moment inside the load (rate windows of
#      15 s) and fails, naming panel and expression, on an error, no series or
#      only NaN.
#
# Settings (env): CHECK_PROFILE (debug: reuses the test build; or release),
# CHECK_RATE (200), CHECK_SECONDS (25, at least 20). Logs, the loadgen
# JSON/CSV and Prometheus' data go to .stack/check-dashboards/ (replaced per run).
# Stops everything it started; leaves the embedded stack running.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROFILE=${CHECK_PROFILE:-debug}
RATE=${CHECK_RATE:-200}
SECS=${CHECK_SECONDS:-25}
WINDOW=15s                 # what $__rate_interval becomes: 15 samples at 1 s scrapes
PROM_ADDR=127.0.0.1:19090
HTTP_ADDR=127.0.0.1:18380  # these four must match prometheus/check.yml (orders metrics: port+1)
GRPC_ADDR=127.0.0.1:15351
RELAY_ADDR=127.0.0.1:19301
PAYMENTS_ADDR=127.0.0.1:19302
OUT=$ROOT/.stack/check-dashboards
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"

say() { printf '\n== %s\n' "$*"; }
die() { printf 'check-dashboards: error: %s\n' "$*" >&2; exit 1; }
port_open() { (exec 3<>"/dev/tcp/${1%:*}/${1#*:}") 2>/dev/null; }
[ "$SECS" -ge 20 ] || die "CHECK_SECONDS must be at least 20 (rate windows are $WINDOW)"

say "configs: compose schema, promtool"
scripts/check-config.sh

for addr in $PROM_ADDR $HTTP_ADDR $GRPC_ADDR $RELAY_ADDR $PAYMENTS_ADDR; do
  port_open "$addr" && die "$addr is taken by another process"
done

say "stack up, build ($PROFILE)"
scripts/stack.sh up >/dev/null
# shellcheck source=/dev/null
. .stack/env
pipeline_build "$PROFILE"

rm -rf "$OUT"
mkdir -p "$OUT"
RUN=check-$(date +%Y%m%d-%H%M%S)
pipeline_fresh check_dashboards "$RUN"
trap pipeline_stop EXIT

say "start orders, relay, payments, prometheus (logs in $OUT)"
pipeline_start "$OUT" "$HTTP_ADDR" "$GRPC_ADDR" "$RELAY_ADDR" "$PAYMENTS_ADDR" "payments-$RUN"

# Debian's binary, run directly (no systemd unit); its data is thrown away.
prometheus --config.file=prometheus/check.yml --web.listen-address=$PROM_ADDR \
  --storage.tsdb.path="$OUT/prometheus-data" --storage.tsdb.retention.time=1h \
  >"$OUT/prometheus.log" 2>&1 &
pipeline_track $!
wait_http "http://$PROM_ADDR/-/ready" prometheus $! "$OUT"
for _ in $(seq 1 100); do
  [ "$(curl -fs "http://$PROM_ADDR/api/v1/query" --data-urlencode 'query=count(up == 1)' \
       | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)')" = 3 ] && break
  sleep 0.2
done

say "load: $RATE orders/s for $SECS s, 15% retried 1-3x, HTTP and gRPC"
START=$(date +%s)
"$BIN/loadgen" --http-url "http://$HTTP_ADDR" --grpc-url "http://$GRPC_ADDR" --rate "$RATE" \
  --duration "$SECS" --retry-rate 0.15 --zipf-s 0 --protocol mixed --progress off \
  --json "$OUT/loadgen.json" --csv "$OUT/loadgen.csv" >"$OUT/loadgen.txt" 2>&1 \
  || { cat "$OUT/loadgen.txt"; die "loadgen failed"; }
cat "$OUT/loadgen.txt"
sleep 2 # one more scrape of everything after the evaluation moment below

# Evaluate 3 s before the scheduled end: the 15 s windows then lie inside the
# load, so every rate, ratio and quantile has samples to work on.
AT=$((START + SECS - 3))
say "evaluate every panel expression at $(date -u -d "@$AT" +%H:%M:%SZ) (window $WINDOW)"
python3 scripts/eval-dashboards.py --prometheus "http://$PROM_ADDR" --time "$AT" --window "$WINDOW" \
  grafana/dashboards/*.json
