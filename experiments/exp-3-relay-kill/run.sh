#!/usr/bin/env bash
# Experiment 3: kill -9 the relay between "broker acked" and "marked
# published", many times under load. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-3-relay-kill
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-300} DURATION=${EXP_DURATION:-25} EVERY=${EXP_CRASH_EVERY:-40} MIN_KILLS=3
  ORDERS_DURATION=15 ORDERS_EVERY=300
else
  RATE=${EXP_RATE:-1000} DURATION=${EXP_DURATION:-120} EVERY=${EXP_CRASH_EVERY:-40} MIN_KILLS=20
  ORDERS_DURATION=60 ORDERS_EVERY=600
fi

# Each verdict is read from its chaos summary (recon_exit) below.
exp_chaos relay-publish --rate "$RATE" --duration "$DURATION" --retry-rate 0.15 --protocol mixed \
  --crash-point publish --crash-every "$EVERY" --seed 3 || true

# The other crash on the publish side: orders SIGKILLed after its write
# transaction committed and before the responses went out. The client sees
# an error and retries the same key (loadgen --retry-on-error).
exp_chaos orders-commit --rate "$RATE" --duration "$ORDERS_DURATION" --retry-rate 0.15 --protocol mixed \
  --crash-point commit --crash-every "$ORDERS_EVERY" --seed 3 \
  --loadgen-arg=--retry-on-error --loadgen-arg=5 || true

python3 - "$RES" "$MODE" "$MIN_KILLS" <<'PY'
import json, sys
res, mode, min_kills = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = json.load(open(f"{res}/relay-publish.json"))
relay, pay = c["services"]["relay"], c["services"]["payments"]
r = (c.get("recon") or {}).get("report") or {}
kills = relay["deaths"].get("crash_point:publish", 0)
hits = pay["counters"].get("inbox_hits", 0)
orders = r.get("distinct_orders", 0)
checks = {
    "recon CLEAN (every committed order published and charged once; client intents match)": c["recon_exit"] == 0,
    f"relay killed at crash point publish at least {min_kills} times": kills >= min_kills,
    "re-published events reached payments and were absorbed (inbox hits > 0)": hits > 0,
    "no double effect": r.get("double_charges", -1) == 0,
    "no lost effect": r.get("orders_without_charge", -1) == 0,
}
o = json.load(open(f"{res}/orders-commit.json"))
orr = (o.get("recon") or {}).get("report") or {}
oi = (o.get("recon") or {}).get("intents") or {}
orders_kills = o["services"]["orders"]["deaths"].get("crash_point:commit", 0)
oload = o.get("load") or {}
error_retries = (oload.get("sends") or {}).get("error_retries_sent", 0)
checks.update({
    "orders-commit: recon CLEAN": o["recon_exit"] == 0,
    f"orders-commit: orders killed after commit at least {min_kills} times": orders_kills >= min_kills,
    "orders-commit: the client retried errors, and every key ended with exactly one order (0 ambiguous)": (
        error_retries > 0 and oi.get("client_ambiguous", -1) == 0
        and oi.get("matched") == oi.get("client_succeeded") == orr.get("distinct_orders")),
})
summary = {
    "experiment": "exp-3-relay-kill",
    "mode": mode,
    "params": c["params"],
    "load": {k: c["load"].get(k) for k in ("rates", "outcomes", "replay")} if c.get("load") else None,
    "relay_kills": kills,
    "relay_lives": relay["lives"],
    "recovery_ms": relay["recovery_ms"],
    "distinct_orders": orders,
    # Deliveries beyond one per event: the re-publishes that reached payments
    # (payments is never killed here, so its counters are exact).
    "duplicate_deliveries": pay["counters"].get("consumed", 0) - orders,
    "inbox_hits": hits,
    "inbox_misses": pay["counters"].get("inbox_misses", 0),
    "recon": r,
    "orders_commit": {
        "orders_kills": orders_kills,
        "recovery_ms": o["services"]["orders"]["recovery_ms"],
        "load": {k: oload.get(k) for k in ("rates", "sends", "outcomes", "replay")},
        "client_intents": oi,
        "distinct_orders": orr.get("distinct_orders"),
        "double_charges": orr.get("double_charges"),
        "recon_exit": o["recon_exit"],
    },
    "checks": checks,
    "verdict": "PASS" if all(checks.values()) else "FAIL",
}
json.dump(summary, open(f"{res}/summary.json", "w"), indent=2)
for k, v in checks.items():
    print(f"  [{'ok' if v else 'FAILED'}] {k}")
rr = relay["recovery_ms"]
print(f"exp-3: {summary['verdict']} — {kills} relay kills at publish, {orders} orders, each charged once; "
      f"inbox hits {hits:.0f} (re-published duplicates absorbed); relay death→working again "
      f"p50 {rr['to_progress']['p50']} ms, max {rr['to_progress']['max']} ms; {orders_kills} orders kills at "
      f"commit, {error_retries} errors retried, {orr.get('distinct_orders')} orders = keys, 0 ambiguous "
      f"({mode}; {res}/summary.json)")
sys.exit(0 if summary["verdict"] == "PASS" else 1)
PY
