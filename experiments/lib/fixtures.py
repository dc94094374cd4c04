"""Small hand-made inputs for the verdicts' tests: a chaos summary with the
fields the verdicts read."""
import copy


def recon(orders=100, charges=None, lost=0, doubled=0, effects=None, outbox=None, keys=None,
          intents=True, ambiguous=0, clean=None):
    """A `recon --json` output for ORDERS orders, LOST orders without their
    charge and DOUBLED orders charged twice."""
    charges = orders - lost if charges is None else charges
    effects = charges + doubled if effects is None else effects
    report = {
        "intents": orders if keys is None else keys, "distinct_orders": orders,
        "outbox_rows": orders if outbox is None else outbox, "pending_rows": 0, "events_not_consumed": 0,
        "distinct_charges": charges, "orders_without_charge": lost, "double_charges": doubled,
        "charge_effects": effects, "order_amount_cents": 100 * orders, "effect_amount_cents": 100 * effects,
    }
    out = {"report": report, "drained": None,
           "clean": (lost == 0 and doubled == 0) if clean is None else clean, "intents": None}
    if intents:
        out["intents"] = {"client_succeeded": orders, "matched": orders, "client_ambiguous": ambiguous,
                          "ambiguous_committed": 0, "missing_in_db": 0, "wrong_order": 0}
    return out


def lives(deaths=None, counters=None):
    """One service's part of a chaos summary."""
    rec = {"count": 1, "p50": 900, "p99": 1200, "max": 1200}
    return {"deaths": deaths or {}, "counters": counters or {}, "lives": 1 + sum((deaths or {}).values()),
            "recovery_ms": {"to_progress": dict(rec), "to_ready": dict(rec)}}


def chaos(recon_exit=0, rec=None, orders=None, relay=None, payments=None, totals=None, load=None, **extra):
    """A chaos summary (`effectively.chaos.v1`) with the given parts."""
    c = {
        "schema": "effectively.chaos.v1", "params": {"rate": 300}, "elapsed_s": 30.0, "kills_total": 0,
        "recon_exit": recon_exit, "recon": copy.deepcopy(rec if rec is not None else recon()),
        "services": {"orders": orders or lives(), "relay": relay or lives(), "payments": payments or lives()},
        "totals": totals or {"inbox_hits": 0, "inbox_misses": 100, "consumed": 100},
        "load": load if load is not None else loadgen(),
    }
    c.update(extra)
    return c


def loadgen(sent=1000, dropped=0, responses=None, ok=None, completed=None, unfinished=0, p99=5.0,
            mismatches=0, keys_succeeded=800, ambiguous=0, error_retries=0):
    """A loadgen report (`loadgen.report.v1`): SENT sends, all answered and ok
    unless told otherwise."""
    responses = sent if responses is None else responses
    completed = responses if completed is None else completed
    ok = completed if ok is None else ok
    return {
        "schema": "loadgen.report.v1", "exit_code": 0, "unfinished": unfinished,
        "sends": {"sent": sent, "dropped": dropped, "retries_sent": sent // 10, "repeat_intents": sent // 5,
                  "error_retries_sent": error_retries},
        "outcomes": {"completed": completed, "ok": ok, "responses": responses, "server_errors": completed - ok,
                     "timeouts": 0},
        "rates": {"offered_sends": sent / 10, "achieved": responses / 10, "ok": ok / 10},
        "latency_ms": {"all": {"p50_ms": 1.0, "p99_ms": p99, "p999_ms": p99 * 2, "max_ms": p99 * 3}},
        "replay": {"mismatches": mismatches, "compared": sent // 10},
        "keys": {"succeeded": keys_succeeded, "ambiguous": ambiguous},
    }
