#!/usr/bin/env bash
# Experiment 2: duplicate delivery at 5% and 30% on the consumer, under load,
# then the consumer's throughput at each duplicate rate on the same events.
# See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-2-duplicates
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-15}
else
  RATE=${EXP_RATE:-800} DURATION=${EXP_DURATION:-75}
fi
RATES="0.05 0.30"
DRAIN_RATES="0 0.05 0.30"

# --- A: under load, duplicates injected both ways, recon must stay clean.
for p in $RATES; do # each verdict is read from its chaos summary below
  exp_chaos "dup-${p#0.}" --rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed \
    --dup-rate "$p" --dup-kind both --seed 2 || true
done

# --- B: consumer throughput at each duplicate rate, side by side: the last
# run's topic (every event of that run) drained by a fresh payments (fresh
# group) into a fresh database, per configuration and repetition, in turns.
# Effects/s are timed in SQL, from the first to the last charge transaction,
# so the group join is not counted. 30% is also run with one kind of
# duplicate at a time, to see which costs what.
TOPIC=$KAFKA_TOPIC
N=$(psql "$DATABASE_URL" -qAt -c "SELECT count(*) FROM orders.outbox")
CONFIGS="0:both 0.05:both 0.30:both 0.30:reprocess 0.30:redeliver"
if [ "$MODE" = quick ]; then REPS=1; else REPS=${EXP_REPS:-3}; fi
say "consumer drain of $N events from $TOPIC: $CONFIGS, $REPS repetition(s) each"
echo "dup_rate,kind,rep,events,span_s,effects_per_s,consumed,consumed_per_s,inbox_hits,inbox_misses,injected,doubles" >"$RES/drain-runs.csv"
drain() { # RATE KIND REP
  local p=$1 kind=$2 rep=$3 db url pid ok n metrics span doubles consumed injected
  db=exp_drain_${p//./_}_$kind
  pipeline_db "$db"
  url=$DB_URL
  DATABASE_URL=$PAYMENTS_DATABASE_URL KAFKA_TOPIC=$TOPIC PAYMENTS_GROUP_ID=drain-$p-$kind-$rep-$(date +%s) \
    PAYMENTS_DUP_RATE=$p PAYMENTS_DUP_KIND=$kind \
    PAYMENTS_METRICS_ADDR=127.0.0.1:22102 RUST_LOG=warn \
    "$BIN/payments" >>"$RES/logs/drain-$p-$kind.log" 2>&1 &
  pid=$!
  ok=0
  for _ in $(seq 1 1200); do
    n=$(psql "$url" -qAt -c "SELECT count(*) FROM payments.inbox")
    if [ "$n" -ge "$N" ]; then ok=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  sleep 1 # let the injected duplicates of the last batches arrive
  metrics=$(curl -fs http://127.0.0.1:22102/metrics || true)
  kill $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  [ $ok = 1 ] || echo "exp-2: drain $p $kind did not finish; see $RES/logs/drain-$p-$kind.log" >&2
  m() { awk -v k="$1" '$1==k {print $2}' <<<"$metrics"; }
  read -r span doubles < <(psql "$url" -qAt -F ' ' -c \
    "SELECT extract(epoch FROM max(created_at) - min(created_at)),
            (SELECT count(*) FROM (SELECT order_id FROM payments.ledger GROUP BY 1 HAVING count(*) > 1) d)
     FROM payments.charges")
  consumed=$(m payments_consumed_total)
  injected=$(awk '/^payments_injected_duplicates_total/ {s += $2} END {print s + 0}' <<<"$metrics")
  python3 - "$p" "$kind" "$rep" "$N" "$span" "$consumed" "$(m payments_dedup_hits_total)" \
    "$(m payments_dedup_misses_total)" "$injected" "$doubles" >>"$RES/drain-runs.csv" <<'PY'
import sys
p, kind, rep, n, span, consumed, hits, misses, injected, doubles = sys.argv[1:11]
n, span, consumed = int(n), float(span or 0), float(consumed or 0)
print(f"{p},{kind},{rep},{n},{span:.3f},{n / span if span else 0:.0f},{consumed:.0f},"
      f"{consumed / span if span else 0:.0f},{float(hits or 0):.0f},{float(misses or 0):.0f},"
      f"{float(injected or 0):.0f},{doubles}")
PY
}
for rep in $(seq 1 "$REPS"); do
  for c in $CONFIGS; do drain "${c%%:*}" "${c##*:}" "$rep"; done
done
# Medians per configuration.
python3 - "$RES" <<'PY'
import csv, statistics, sys
res = sys.argv[1]
rows = list(csv.DictReader(open(f"{res}/drain-runs.csv")))
out = []
for key in dict.fromkeys((r["dup_rate"], r["kind"]) for r in rows):
    rs = [r for r in rows if (r["dup_rate"], r["kind"]) == key]
    med = lambda f: statistics.median(float(r[f]) for r in rs)
    out.append({"dup_rate": key[0], "kind": key[1], "reps": len(rs), "events": rs[0]["events"],
                "effects_per_s": round(med("effects_per_s")), "consumed_per_s": round(med("consumed_per_s")),
                "effects_per_s_min": min(int(r["effects_per_s"]) for r in rs),
                "effects_per_s_max": max(int(r["effects_per_s"]) for r in rs),
                "injected": round(med("injected")), "inbox_hits": round(med("inbox_hits")),
                "inbox_misses_min": min(int(r["inbox_misses"]) for r in rs),
                "doubles_max": max(int(r["doubles"]) for r in rs)})
w = csv.DictWriter(open(f"{res}/drain.csv", "w", newline=""), fieldnames=list(out[0]))
w.writeheader(); w.writerows(out)
PY
column -s, -t <"$RES/drain.csv" >&2

if [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; then
  "$ROOT/.tools/venv/bin/python" "$ROOT/scripts/plot.py" curve "$RES/drain.csv" -o "$RES/throughput.png" \
    --x dup_rate --y effects_per_s,consumed_per_s --group kind --title "payments: throughput by duplicate rate (exp-2, $MODE)" \
    --xlabel "injected duplicate rate" --ylabel "per second" || echo "exp-2: plot failed (results are in drain.csv)" >&2
fi

python3 - "$RES" "$MODE" "$RATES" <<'PY'
import csv, json, sys
res, mode, rates = sys.argv[1], sys.argv[2], sys.argv[3].split()
runs, checks = {}, {}
for p in rates:
    c = json.load(open(f"{res}/dup-{p[2:]}.json"))
    r = (c.get("recon") or {}).get("report") or {}
    t = c["totals"]
    hits, misses = t.get("inbox_hits", 0), t.get("inbox_misses", 0)
    runs[p] = {
        "recon_exit": c["recon_exit"], "distinct_orders": r.get("distinct_orders"),
        "distinct_charges": r.get("distinct_charges"), "double_charges": r.get("double_charges"),
        "injected_reprocess": t.get("injected_reprocess", 0), "injected_redeliver": t.get("injected_redeliver", 0),
        "inbox_hits": hits, "inbox_misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "consumed": t.get("consumed", 0),
        "load": {k: c["load"].get(k) for k in ("rates", "outcomes")} if c.get("load") else None,
    }
    x = runs[p]
    inj = x["injected_reprocess"] + x["injected_redeliver"]
    checks[f"dup {p}: recon CLEAN, distinct_charges == distinct_orders, zero doubles"] = (
        x["recon_exit"] == 0 and x["distinct_charges"] == x["distinct_orders"] and x["double_charges"] == 0)
    checks[f"dup {p}: duplicates of both kinds injected and every one absorbed (inbox hits >= injected)"] = (
        x["injected_reprocess"] > 0 and x["injected_redeliver"] > 0 and hits >= inj)
drain = list(csv.DictReader(open(f"{res}/drain.csv")))
for d in drain:
    checks[f"drain at dup {d['dup_rate']} ({d['kind']}): every event charged once in every repetition"] = (
        int(d["inbox_misses_min"]) == int(d["events"]) and int(d["doubles_max"]) == 0)
summary = {"experiment": "exp-2-duplicates", "mode": mode, "under_load": runs, "consumer_drain": drain,
           "consumer_drain_runs": list(csv.DictReader(open(f"{res}/drain-runs.csv"))),
           "checks": checks, "verdict": "PASS" if all(checks.values()) else "FAIL"}
json.dump(summary, open(f"{res}/summary.json", "w"), indent=2)
for k, v in checks.items():
    print(f"  [{'ok' if v else 'FAILED'}] {k}")
parts = [f"dup {p}: {x['distinct_orders']} orders, {x['injected_reprocess'] + x['injected_redeliver']:.0f} injected, "
         f"hit ratio {x['hit_ratio']:.3f}" for p, x in runs.items() if x["hit_ratio"] is not None]
parts += [f"drain {d['dup_rate']} {d['kind']}: {d['effects_per_s']} effects/s" for d in drain]
print(f"exp-2: {summary['verdict']} — " + "; ".join(parts) + f" ({mode}; {res}/summary.json)")
sys.exit(0 if summary["verdict"] == "PASS" else 1)
PY
