#!/usr/bin/env bash
# The acceptance run: 20 minutes at 5,000 requests/s (3,850 new intents/s
# plus 15% same-key retries, Zipfian hot keys, HTTP and gRPC), the whole
# pipeline on the embedded stack; distinct orders must equal distinct keys
# exactly (recon, with its SQL attached, and the client's own intents), and
# the synchronous p99 must stay under 25 ms. Per minute: rate, p50/p99,
# outbox backlog, commit->publish and commit->effect. See README.md beside
# this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/accept
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-600} DURATION=${EXP_DURATION:-60} WARMUP=${EXP_WARMUP:-20}
else
  RATE=${EXP_RATE:-3850} DURATION=${EXP_DURATION:-1200} WARMUP=${EXP_WARMUP:-120}
fi
[[ $WARMUP =~ ^[0-9]+$ ]] || { echo "accept: EXP_WARMUP must be a whole number of seconds" >&2; exit 2; }
RELAY_METRICS=127.0.0.1:18401 PAYMENTS_METRICS=127.0.0.1:18402
LOGS=$RES/logs/accept
# The client authenticates with a bearer token, as a service adopting orders
# would run it: its keys are its caller's (recon's intents check reads them
# in that scope). EXP_AUTH=off runs it unauthenticated.
[ "${EXP_AUTH:-on}" = off ] || exp_auth accept

# The sampler starts on the fresh database, before chaos starts the services,
# and counts from the moment both answer /metrics (as loadgen starts).
start_sampler() {
  python3 "$ROOT/experiments/lib/sampler.py" --database-url "$DATABASE_URL" \
    --relay "$RELAY_METRICS" --payments "$PAYMENTS_METRICS" --duration "$((DURATION + 30))" --interval 2 \
    --out "$RES/samples.csv" --minutes "$RES/pipeline-minutes.csv" 2>"$RES/logs/sampler.log" &
  SAMPLER=$!
}
# A warm-up first, not judged, on its own database and topic: the same load
# for WARMUP seconds. On freshly started nodes the brokers' JIT takes most of
# a core for the first minutes of load, and the first minute of the run was
# over the SLO for that alone (FINDINGS §13). Its summary is
# RES/accept-warmup.json; nothing of it is judged.
if [ "$WARMUP" -gt 0 ]; then
  exp_chaos accept-warmup --rate "$RATE" --duration "$WARMUP" --retry-rate 0.15 --zipf-s 1.1 \
    --protocol mixed --seed 12 || true
fi
export EXP_PREPARE=start_sampler
mkdir -p "$LOGS"
exp_chaos accept --rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --zipf-s 1.1 --protocol mixed \
  --seed 11 --relay-metrics-addr "$RELAY_METRICS" --payments-metrics-addr "$PAYMENTS_METRICS" \
  --loadgen-arg=--minute-csv --loadgen-arg="$LOGS/loadgen-minutes.csv" || true
unset EXP_PREPARE
kill -TERM "$SAMPLER" 2>/dev/null || true
wait "$SAMPLER" || true

# The SQL diff itself, and recon's verdict with the client's intents, as attachments.
"$BIN/recon" --show-sql >"$RES/recon.sql"
DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --intents "$LOGS/intents.txt" >"$RES/recon.txt" 2>&1 || true

python3 "$ROOT/experiments/lib/accept.py" "$RES" "$MODE" "$DURATION" && status=0 || status=$?

if [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; then
  PY=$ROOT/.tools/venv/bin/python
  "$PY" "$ROOT/scripts/plot.py" series "$RES/minutes.csv" -o "$RES/latency.png" --x minute \
    --y p50_ms,p99_ms,publish_p99_ms,effect_p99_ms --y2 '' \
    --title "acceptance run: latency per minute ($MODE)" || echo "accept: plot failed (see minutes.csv)" >&2
  "$PY" "$ROOT/scripts/plot.py" series "$RES/minutes.csv" -o "$RES/rate.png" --x minute \
    --y sent_per_s --y2 pending_rows_max \
    --title "acceptance run: sends/s and outbox backlog per minute ($MODE)" || echo "accept: plot failed" >&2
fi
exit "$status"
