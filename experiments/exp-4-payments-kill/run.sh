#!/usr/bin/env bash
# Experiment 4: kill -9 payments between charge and commit (`effect`) and
# between inbox claim and charge (`claim`): nothing lost, nothing doubled.
# Then the counter-example: inbox and effect in two transactions
# (--unsafe-split-txn), killed between them: inbox-first loses effects,
# effect-first doubles them. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-4-payments-kill
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-15} EVERY=${EXP_CRASH_EVERY:-15} MIN_KILLS=3
else
  RATE=${EXP_RATE:-500} DURATION=${EXP_DURATION:-60} EVERY=${EXP_CRASH_EVERY:-25} MIN_KILLS=10
fi
# Chaos runs payments with static group membership, so a restarted consumer
# takes its partitions back at once. The full mode also runs `effect` without
# it: then every kill waits out the dead member's session (kept at 6 s).
export PAYMENTS_SESSION_TIMEOUT_MS=${PAYMENTS_SESSION_TIMEOUT_MS:-6000}

common=(--rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed --crash-every "$EVERY" --seed 4)
# A run's verdict is read from its chaos summary (recon_exit) below; a DRIFT
# exit must not stop the script, the counter-example expects it.
for run in effect claim; do
  exp_chaos "payments-$run" "${common[@]}" --crash-point "$run" || true
done
if [ "$MODE" = full ]; then
  exp_chaos payments-effect-dynamic "${common[@]}" --crash-point effect --static-membership false || true
fi
for split in inbox-first effect-first; do
  exp_chaos "split-$split" "${common[@]}" --crash-point split --unsafe-split-txn "$split" || true
done

python3 - "$RES" "$MODE" "$MIN_KILLS" <<'PY'
import json, sys
res, mode, min_kills = sys.argv[1], sys.argv[2], int(sys.argv[3])
def row(tag, point):
    """One run's numbers from its chaos summary (recon_exit is chaos's exit status)."""
    c = json.load(open(f"{res}/{tag}.json"))
    r = (c.get("recon") or {}).get("report") or {}
    pay = c["services"]["payments"]
    return {
        "recon_exit": c["recon_exit"],
        "payments_kills": pay["deaths"].get(f"crash_point:{point}", 0),
        "recovery_ms": pay["recovery_ms"],
        "distinct_orders": r.get("distinct_orders"),
        "distinct_charges": r.get("distinct_charges"),
        "effects": r.get("charge_effects"),
        "lost_effects": r.get("orders_without_charge"),
        "double_charged_orders": r.get("double_charges"),
        "extra_effects": (r.get("charge_effects") or 0) - (r.get("distinct_charges") or 0),
        "extra_cents": (r.get("effect_amount_cents") or 0) - (r.get("order_amount_cents") or 0),
        "inbox_hits": pay["counters"].get("inbox_hits", 0),
    }

checks = {}
rows = {tag: row(tag, point) for tag, point in [
    ("payments-effect", "effect"), ("payments-claim", "claim"),
    ("split-inbox-first", "split"), ("split-effect-first", "split")]}
for tag in ("payments-effect", "payments-claim"):
    x = rows[tag]
    checks[f"{tag}: killed at least {min_kills} times"] = x["payments_kills"] >= min_kills
    checks[f"{tag}: recon CLEAN (zero lost, zero double)"] = x["recon_exit"] == 0 and x["lost_effects"] == 0 and x["double_charged_orders"] == 0
x = rows["split-inbox-first"]
checks["split inbox-first: killed between its transactions"] = x["payments_kills"] >= 1
checks["split inbox-first: recon DRIFT with lost effects and no double"] = x["recon_exit"] == 1 and (x["lost_effects"] or 0) > 0 and x["double_charged_orders"] == 0
x = rows["split-effect-first"]
checks["split effect-first: killed between its transactions"] = x["payments_kills"] >= 1
checks["split effect-first: recon DRIFT with doubled effects, still one charge row per order"] = (
    x["recon_exit"] == 1 and (x["double_charged_orders"] or 0) > 0 and x["lost_effects"] == 0
    and x["distinct_charges"] == x["distinct_orders"])
if mode == "full":
    rows["payments-effect-dynamic"] = row("payments-effect-dynamic", "effect")
    checks["payments-effect-dynamic (no static membership): recon CLEAN"] = (
        rows["payments-effect-dynamic"]["recon_exit"] == 0)
summary = {"experiment": "exp-4-payments-kill", "mode": mode, "runs": rows, "checks": checks,
           "verdict": "PASS" if all(checks.values()) else "FAIL"}
json.dump(summary, open(f"{res}/summary.json", "w"), indent=2)
print(f"\n{'run':<24} {'kills':>5} {'orders':>7} {'charged':>7} {'effects':>7} {'lost':>5} {'doubled':>7} {'recon':>6} {'death→work p50/max ms':>22}")
for tag, x in rows.items():
    rec = x["recovery_ms"]["to_progress"]
    print(f"{tag:<24} {x['payments_kills']:>5} {x['distinct_orders']!s:>7} {x['distinct_charges']!s:>7} "
          f"{x['effects']!s:>7} {x['lost_effects']!s:>5} {x['double_charged_orders']!s:>7} "
          f"{['CLEAN','DRIFT','ERROR'][min(x['recon_exit'],2)]:>6} {str(rec['p50']) + '/' + str(rec['max']):>22}")
for k, v in checks.items():
    print(f"  [{'ok' if v else 'FAILED'}] {k}")
l, d = rows["split-inbox-first"], rows["split-effect-first"]
print(f"exp-4: {summary['verdict']} — safe: {rows['payments-effect']['payments_kills']} kills at effect, "
      f"{rows['payments-claim']['payments_kills']} at claim, 0 lost, 0 doubled; unsafe split: inbox-first lost "
      f"{l['lost_effects']} of {l['distinct_orders']}, effect-first doubled {d['double_charged_orders']} of "
      f"{d['distinct_orders']} ({mode}; {res}/summary.json)")
sys.exit(0 if summary["verdict"] == "PASS" else 1)
PY
