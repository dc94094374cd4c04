//! Recon: the ground-truth diff. Read-only; one SQL statement, so every
//! number comes from one snapshot, and `--show-sql` prints it so anyone can
//! run the diff by hand.
//!
//! The invariant, checked order by order (not as sums, which two swapped
//! amounts would leave equal): for every accepted intent (idempotency key)
//! exactly one order; for every order exactly one key whose stored response
//! names it, one outbox event whose payload is that order (same id, account
//! and amount), that event's msg_id in the inbox, one charge made by that
//! msg_id for the same account and amount, and one ledger entry, the same
//! again. Nothing missing, doubled, orphaned or different. Failed outbox rows
//! and dead letters are reported and count as drift unless allowed.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{FromRow, PgConnection, PgPool};
use uuid::Uuid;

/// The diff, one statement: one row per order id met anywhere (a full join
/// of orders, keys grouped by order, outbox events grouped by order, charges
/// and ledger entries grouped by order), folded into counts. Each event is
/// compared with its order (the payload carries the order's id, account and
/// amount; byte searches, so no payload can make the statement fail) and with
/// the charge (made by this event's msg_id); each ledger entry with the
/// charge (same msg_id, account, amount); each charge with the order.
pub const RECON_SQL: &str = r#"WITH
k AS (SELECT order_id, count(*) AS n,
             count(*) FILTER (WHERE position(convert_to('"order_id":"' || order_id || '"', 'UTF8')
                                             IN response_body) = 0) AS foreign_responses
      FROM orders.idempotency_keys GROUP BY order_id),
x AS (SELECT e.aggregate_id AS order_id, count(*) AS n,
             count(*) FILTER (WHERE e.published_at IS NULL) AS unpublished,
             count(*) FILTER (WHERE e.failed_at IS NOT NULL) AS failed,
             count(*) FILTER (WHERE c.msg_id = e.msg_id) AS charging,
             count(*) FILTER (WHERE o.order_id IS NOT NULL AND NOT (
                 position(convert_to('"order_id":"' || o.order_id || '"', 'UTF8') IN e.payload) > 0
                 AND (position(convert_to('"account_id":' || o.account_id || ',', 'UTF8') IN e.payload) > 0
                      OR position(convert_to('"account_id":' || o.account_id || '}', 'UTF8') IN e.payload) > 0)
                 AND (position(convert_to('"amount_cents":' || o.amount_cents || ',', 'UTF8') IN e.payload) > 0
                      OR position(convert_to('"amount_cents":' || o.amount_cents || '}', 'UTF8') IN e.payload) > 0))
             ) AS foreign_payloads
      FROM orders.outbox e
      LEFT JOIN orders.orders o ON o.order_id = e.aggregate_id
      LEFT JOIN payments.charges c ON c.order_id = e.aggregate_id
      GROUP BY e.aggregate_id),
l AS (SELECT l.order_id, count(*) AS n, sum(l.amount_cents) AS amount,
             count(*) FILTER (WHERE c.order_id IS NULL OR c.msg_id <> l.msg_id
                              OR c.account_id <> l.account_id OR c.amount_cents <> l.amount_cents) AS foreign_entries
      FROM payments.ledger l LEFT JOIN payments.charges c ON c.order_id = l.order_id
      GROUP BY l.order_id),
j AS (SELECT o.order_id AS o_id, o.account_id, o.amount_cents,
             k.n AS k_n, k.foreign_responses, x.n AS x_n, x.unpublished, x.failed, x.charging,
             x.foreign_payloads, c.order_id AS c_id, c.account_id AS c_account,
             c.amount_cents AS c_amount, l.n AS l_n, l.amount AS l_amount, l.foreign_entries
      FROM orders.orders o
      FULL JOIN k ON k.order_id = o.order_id
      FULL JOIN x ON x.order_id = COALESCE(o.order_id, k.order_id)
      FULL JOIN payments.charges c ON c.order_id = COALESCE(o.order_id, k.order_id, x.order_id)
      FULL JOIN l ON l.order_id = COALESCE(o.order_id, k.order_id, x.order_id, c.order_id))
SELECT
  COALESCE(sum(k_n), 0)::int8                                                  AS intents,
  count(o_id)                                                                  AS distinct_orders,
  COALESCE(sum(k_n) FILTER (WHERE o_id IS NULL), 0)::int8                      AS intents_without_order,
  count(*) FILTER (WHERE o_id IS NOT NULL AND k_n IS NULL)                     AS orders_without_key,
  count(*) FILTER (WHERE k_n > 1)                                              AS orders_with_many_keys,
  COALESCE(sum(foreign_responses), 0)::int8                                    AS responses_naming_another_order,
  COALESCE(sum(x_n), 0)::int8                                                  AS outbox_rows,
  COALESCE(sum(x_n - unpublished), 0)::int8                                    AS published_rows,
  COALESCE(sum(unpublished), 0)::int8                                          AS pending_rows,
  COALESCE(sum(failed), 0)::int8                                               AS failed_rows,
  count(*) FILTER (WHERE o_id IS NOT NULL AND x_n IS NULL)                     AS orders_without_event,
  count(*) FILTER (WHERE o_id IS NULL AND x_n IS NOT NULL)                     AS events_without_order,
  count(*) FILTER (WHERE x_n > 1)                                              AS orders_with_many_events,
  count(*) FILTER (WHERE foreign_payloads > 0)                                 AS event_payload_mismatches,
  (SELECT count(*) FROM payments.inbox)                                        AS inbox_msg_ids,
  (SELECT count(*) FROM orders.outbox e
     WHERE NOT EXISTS (SELECT 1 FROM payments.inbox i WHERE i.msg_id = e.msg_id)) AS events_not_consumed,
  (SELECT count(*) FROM payments.inbox i
     WHERE NOT EXISTS (SELECT 1 FROM orders.outbox e WHERE e.msg_id = i.msg_id)) AS inbox_without_event,
  count(c_id)                                                                  AS distinct_charges,
  count(*) FILTER (WHERE o_id IS NOT NULL AND c_id IS NULL)                    AS orders_without_charge,
  count(*) FILTER (WHERE o_id IS NULL AND c_id IS NOT NULL)                    AS charges_without_order,
  count(*) FILTER (WHERE c_account <> account_id OR c_amount <> amount_cents)  AS charge_mismatches,
  count(*) FILTER (WHERE c_id IS NOT NULL AND COALESCE(charging, 0) = 0)       AS charges_by_another_event,
  COALESCE(sum(l_n), 0)::int8                                                  AS charge_effects,
  count(*) FILTER (WHERE l_n > 1)                                              AS double_charges,
  count(*) FILTER (WHERE c_id IS NOT NULL AND l_n IS NULL)                     AS charges_without_effect,
  count(*) FILTER (WHERE o_id IS NULL AND l_n IS NOT NULL)                     AS effects_without_order,
  count(*) FILTER (WHERE foreign_entries > 0)                                  AS effect_mismatches,
  (SELECT count(*) FROM payments.dead_letters)                                 AS dead_letters,
  COALESCE(sum(amount_cents), 0)::int8                                         AS order_amount_cents,
  COALESCE(sum(c_amount), 0)::int8                                             AS charge_amount_cents,
  COALESCE(sum(l_amount), 0)::int8                                             AS effect_amount_cents
FROM j"#;

/// Pipeline drained: nothing in the outbox that the relay will still
/// publish (rows marked failed, and the later rows of their keys that they
/// hold back, never will), and every published event consumed: in the
/// inbox, or a dead letter.
pub const DRAINED_SQL: &str = r#"SELECT
  NOT EXISTS (SELECT 1 FROM orders.outbox o
              WHERE o.published_at IS NULL AND o.failed_at IS NULL
                AND NOT EXISTS (SELECT 1 FROM orders.outbox f
                                WHERE f.aggregate_id = o.aggregate_id
                                  AND f.published_at IS NULL AND f.failed_at IS NOT NULL
                                  AND f.id < o.id))
  AND NOT EXISTS (SELECT 1 FROM orders.outbox x
                  WHERE x.published_at IS NOT NULL
                    AND NOT EXISTS (SELECT 1 FROM payments.inbox i WHERE i.msg_id = x.msg_id)
                    AND NOT EXISTS (SELECT 1 FROM payments.dead_letters d WHERE d.msg_id = x.msg_id))"#;

/// Every count of the diff.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, Serialize)]
pub struct Report {
    /// Accepted intents: idempotency keys.
    pub intents: i64,
    /// Orders.
    pub distinct_orders: i64,
    /// Keys whose order is missing.
    pub intents_without_order: i64,
    /// Orders no key points at.
    pub orders_without_key: i64,
    /// Orders two or more keys point at.
    pub orders_with_many_keys: i64,
    /// Keys whose stored response names another order than the key's.
    pub responses_naming_another_order: i64,
    /// Outbox rows.
    pub outbox_rows: i64,
    /// Outbox rows marked published.
    pub published_rows: i64,
    /// Outbox rows still pending (failed rows included).
    pub pending_rows: i64,
    /// Outbox rows the relay marked failed (never publishable).
    pub failed_rows: i64,
    /// Orders with no outbox event.
    pub orders_without_event: i64,
    /// Outbox events for no order.
    pub events_without_order: i64,
    /// Orders with more than one outbox event.
    pub orders_with_many_events: i64,
    /// Orders whose published event's payload is not that order (id,
    /// account, amount).
    pub event_payload_mismatches: i64,
    /// msg_ids in the inbox.
    pub inbox_msg_ids: i64,
    /// Outbox events whose msg_id is not in the inbox.
    pub events_not_consumed: i64,
    /// Inbox msg_ids of no outbox event.
    pub inbox_without_event: i64,
    /// Orders with a charge.
    pub distinct_charges: i64,
    /// Orders with no charge.
    pub orders_without_charge: i64,
    /// Charges with no order.
    pub charges_without_order: i64,
    /// Charges whose account or amount differs from their order's.
    pub charge_mismatches: i64,
    /// Charges whose msg_id is not their order's outbox event's.
    pub charges_by_another_event: i64,
    /// Effects applied (ledger entries).
    pub charge_effects: i64,
    /// Orders with more than one effect.
    pub double_charges: i64,
    /// Charges with no ledger entry.
    pub charges_without_effect: i64,
    /// Effects with no order.
    pub effects_without_order: i64,
    /// Orders whose ledger entry differs from the order (account, amount) or
    /// from the charge (msg_id).
    pub effect_mismatches: i64,
    /// Dead-lettered messages.
    pub dead_letters: i64,
    /// Sum of order amounts.
    pub order_amount_cents: i64,
    /// Sum of charge amounts.
    pub charge_amount_cents: i64,
    /// Sum of effect amounts.
    pub effect_amount_cents: i64,
}

/// One named difference that must be zero.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delta {
    /// What is compared.
    pub name: &'static str,
    /// Its value; 0 is clean.
    pub value: i64,
}

/// What counts as drift beyond the invariant itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    /// Failed outbox rows and dead letters are reported but are not drift
    /// (`--allow-dead-letters`): for runs that inject bad input on purpose.
    pub allow_dead_letters: bool,
}

impl Report {
    /// Every difference the invariant requires to be zero, under `policy`.
    pub fn deltas(&self, policy: Policy) -> Vec<Delta> {
        let d = |name, value| Delta { name, value };
        let mut deltas = vec![
            d(
                "distinct_orders - intents",
                self.distinct_orders - self.intents,
            ),
            d("intents_without_order", self.intents_without_order),
            d("orders_without_key", self.orders_without_key),
            d("orders_with_many_keys", self.orders_with_many_keys),
            d(
                "responses_naming_another_order",
                self.responses_naming_another_order,
            ),
            d(
                "outbox_rows - distinct_orders",
                self.outbox_rows - self.distinct_orders,
            ),
            d("orders_without_event", self.orders_without_event),
            d("events_without_order", self.events_without_order),
            d("orders_with_many_events", self.orders_with_many_events),
            d("event_payload_mismatches", self.event_payload_mismatches),
            d("pending_rows", self.pending_rows - self.failed_rows),
            d("events_not_consumed", self.events_not_consumed),
            d("inbox_without_event", self.inbox_without_event),
            d(
                "inbox_msg_ids - outbox_rows",
                self.inbox_msg_ids - self.outbox_rows,
            ),
            d(
                "distinct_charges - distinct_orders",
                self.distinct_charges - self.distinct_orders,
            ),
            d("orders_without_charge", self.orders_without_charge),
            d("charges_without_order", self.charges_without_order),
            d("charge_mismatches", self.charge_mismatches),
            d("charges_by_another_event", self.charges_by_another_event),
            d(
                "charge_effects - distinct_charges",
                self.charge_effects - self.distinct_charges,
            ),
            d("double_charges", self.double_charges),
            d("charges_without_effect", self.charges_without_effect),
            d("effects_without_order", self.effects_without_order),
            d("effect_mismatches", self.effect_mismatches),
            d(
                "charge_amount - order_amount",
                self.charge_amount_cents - self.order_amount_cents,
            ),
            d(
                "effect_amount - order_amount",
                self.effect_amount_cents - self.order_amount_cents,
            ),
        ];
        if !policy.allow_dead_letters {
            deltas.push(d("failed_rows", self.failed_rows));
            deltas.push(d("dead_letters", self.dead_letters));
        }
        deltas
    }

    /// The names of the checks that failed.
    pub fn drift(&self, policy: Policy) -> Vec<&'static str> {
        self.deltas(policy)
            .into_iter()
            .filter(|d| d.value != 0)
            .map(|d| d.name)
            .collect()
    }

    /// Effects == intents, order by order, with nothing missing, doubled,
    /// orphaned or different.
    pub fn is_clean(&self, policy: Policy) -> bool {
        self.drift(policy).is_empty()
    }

    /// The human table.
    pub fn table(&self, policy: Policy) -> String {
        let rows: [(&str, i64); 31] = [
            ("intents (idempotency keys)", self.intents),
            ("distinct orders", self.distinct_orders),
            ("intents without order", self.intents_without_order),
            ("orders without key", self.orders_without_key),
            ("orders with many keys", self.orders_with_many_keys),
            (
                "responses naming another order",
                self.responses_naming_another_order,
            ),
            ("outbox rows", self.outbox_rows),
            ("published rows", self.published_rows),
            ("pending rows", self.pending_rows),
            ("failed outbox rows", self.failed_rows),
            ("orders without event", self.orders_without_event),
            ("events without order", self.events_without_order),
            ("orders with many events", self.orders_with_many_events),
            ("event payload mismatches", self.event_payload_mismatches),
            ("inbox msg_ids", self.inbox_msg_ids),
            ("events not consumed", self.events_not_consumed),
            ("inbox msg_ids without event", self.inbox_without_event),
            ("distinct charges", self.distinct_charges),
            ("orders without charge", self.orders_without_charge),
            ("charges without order", self.charges_without_order),
            ("charge mismatches", self.charge_mismatches),
            ("charges by another event", self.charges_by_another_event),
            ("charge effects (ledger)", self.charge_effects),
            ("double charges", self.double_charges),
            ("charges without effect", self.charges_without_effect),
            ("effects without order", self.effects_without_order),
            ("effect mismatches", self.effect_mismatches),
            ("dead letters", self.dead_letters),
            ("order amount (cents)", self.order_amount_cents),
            ("charge amount (cents)", self.charge_amount_cents),
            ("effect amount (cents)", self.effect_amount_cents),
        ];
        let mut out = String::from("recon: effects vs intents, order by order\n");
        for (name, value) in rows {
            out.push_str(&format!("  {name:<36} {value:>14}\n"));
        }
        out.push_str(if policy.allow_dead_letters {
            "deltas (all must be 0; failed rows and dead letters allowed):\n"
        } else {
            "deltas (all must be 0):\n"
        });
        for delta in self.deltas(policy) {
            let mark = if delta.value == 0 { "ok" } else { "DRIFT" };
            out.push_str(&format!(
                "  {:<36} {:>14}  {mark}\n",
                delta.name, delta.value
            ));
        }
        let drift = self.drift(policy);
        if drift.is_empty() {
            out.push_str("result: CLEAN — distinct effects == distinct intents\n");
        } else {
            out.push_str(&format!(
                "result: DRIFT — effects != intents ({})\n",
                drift.join(", ")
            ));
        }
        out
    }
}

/// Runs the diff on `conn` (a pooled connection, or a transaction: tests
/// corrupt a database inside one and roll it back).
pub async fn reconcile(conn: &mut PgConnection) -> sqlx::Result<Report> {
    sqlx::query_as(RECON_SQL).fetch_one(conn).await
}

/// Waits until the pipeline is drained or `timeout` passes; `true` if drained.
pub async fn wait_drained(pool: &PgPool, timeout: Duration) -> sqlx::Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        let drained: bool = sqlx::query_scalar(DRAINED_SQL).fetch_one(pool).await?;
        if drained {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The client's side of the story (loadgen `--intents`): keys that got a
/// success, with the order id they were given, and keys whose fate the client
/// cannot know (timed out, connection broke).
#[derive(Debug, Clone, Default)]
pub struct ClientIntents {
    /// (key, order id the client received).
    pub succeeded: Vec<(String, Uuid)>,
    /// Keys with no success and a send of unknown fate.
    pub ambiguous: Vec<String>,
}

impl ClientIntents {
    /// Parses loadgen's intents file (`key<TAB>order_id` per line) and,
    /// optionally, its ambiguous file (one key per line).
    pub fn parse(intents: &str, ambiguous: Option<&str>) -> Result<Self, String> {
        let mut out = Self::default();
        for (n, line) in intents
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let (key, id) = line
                .split_once('\t')
                .ok_or_else(|| format!("intents line {}: expected key<TAB>order_id", n + 1))?;
            let id = Uuid::parse_str(id.trim())
                .map_err(|e| format!("intents line {}: order id: {e}", n + 1))?;
            out.succeeded.push((key.to_owned(), id));
        }
        if let Some(text) = ambiguous {
            out.ambiguous = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect();
        }
        Ok(out)
    }
}

/// Client ground truth against the database.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct IntentsReport {
    /// Keys the client saw succeed.
    pub client_succeeded: i64,
    /// ... that have exactly their order: key row, same order id, order row.
    pub matched: i64,
    /// ... whose key is not in the database (a success the database lost).
    pub missing_in_db: i64,
    /// ... whose key maps to another order id, or whose order row is gone.
    pub wrong_order: i64,
    /// Keys the client could not know the fate of.
    pub client_ambiguous: i64,
    /// ... of which the database committed an order (a timeout after commit,
    /// a crash before the response: the client should retry them).
    pub ambiguous_committed: i64,
}

impl IntentsReport {
    /// Every success the client saw has exactly its order.
    pub fn is_clean(&self) -> bool {
        self.missing_in_db == 0 && self.wrong_order == 0 && self.matched == self.client_succeeded
    }

    /// The human table.
    pub fn table(&self) -> String {
        let rows = [
            ("client successes (distinct keys)", self.client_succeeded),
            ("  with exactly their order", self.matched),
            ("  missing in the database", self.missing_in_db),
            ("  mapped to another order", self.wrong_order),
            ("client ambiguous keys (timeouts)", self.client_ambiguous),
            ("  of which committed", self.ambiguous_committed),
        ];
        let mut out = String::from("recon: client intents vs database\n");
        for (name, value) in rows {
            out.push_str(&format!("  {name:<36} {value:>14}\n"));
        }
        out.push_str(if self.is_clean() {
            "intents: CLEAN — every key the client saw succeed has exactly its order\n"
        } else {
            "intents: DRIFT — a success the client saw is missing or wrong\n"
        });
        out
    }
}

/// Compares the client's ground truth with the database.
pub async fn check_intents(pool: &PgPool, client: &ClientIntents) -> sqlx::Result<IntentsReport> {
    let keys: Vec<&str> = client.succeeded.iter().map(|(k, _)| k.as_str()).collect();
    let ids: Vec<Uuid> = client.succeeded.iter().map(|(_, id)| *id).collect();
    let (matched, missing, wrong): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE k.order_id = c.id AND o.order_id IS NOT NULL), \
                count(*) FILTER (WHERE k.idem_key IS NULL), \
                count(*) FILTER (WHERE k.idem_key IS NOT NULL \
                                  AND (k.order_id <> c.id OR o.order_id IS NULL)) \
         FROM unnest($1::text[], $2::uuid[]) AS c(key, id) \
         LEFT JOIN orders.idempotency_keys k ON k.idem_key = c.key \
         LEFT JOIN orders.orders o ON o.order_id = k.order_id",
    )
    .bind(&keys)
    .bind(&ids)
    .fetch_one(pool)
    .await?;
    let ambiguous_committed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM orders.idempotency_keys WHERE idem_key = ANY($1)")
            .bind(&client.ambiguous)
            .fetch_one(pool)
            .await?;
    Ok(IntentsReport {
        client_succeeded: client.succeeded.len() as i64,
        matched,
        missing_in_db: missing,
        wrong_order: wrong,
        client_ambiguous: client.ambiguous.len() as i64,
        ambiguous_committed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_loadgen_files_and_refuses_garbage() {
        let id = Uuid::now_v7();
        let parsed =
            ClientIntents::parse(&format!("p-1\t{id}\n\n"), Some("p-2\np-3\n")).expect("parse");
        assert_eq!(parsed.succeeded, vec![("p-1".to_owned(), id)]);
        assert_eq!(parsed.ambiguous, vec!["p-2".to_owned(), "p-3".to_owned()]);
        assert!(ClientIntents::parse("no-tab-here", None).is_err());
        assert!(ClientIntents::parse("k\tnot-a-uuid", None).is_err());
    }
}
