//! Recon: the ground-truth diff. Read-only; one SQL statement, so every
//! number comes from one snapshot, and `--show-sql` prints it so anyone can
//! run the diff by hand.
//!
//! The invariant: for every accepted intent (idempotency key) exactly one
//! order, one outbox event, one inbox msg_id, one charge and one ledger
//! effect, with equal amounts — no missing, double or orphan effect.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

/// The diff, one statement. Every column is a count or a sum.
pub const RECON_SQL: &str = r#"SELECT
  (SELECT count(*) FROM orders.idempotency_keys)                                   AS intents,
  (SELECT count(*) FROM orders.orders)                                             AS distinct_orders,
  (SELECT count(*) FROM orders.idempotency_keys k
     WHERE NOT EXISTS (SELECT 1 FROM orders.orders o WHERE o.order_id = k.order_id)) AS intents_without_order,
  (SELECT count(*) FROM orders.outbox)                                             AS outbox_rows,
  (SELECT count(*) FROM orders.outbox WHERE published_at IS NOT NULL)              AS published_rows,
  (SELECT count(*) FROM orders.outbox WHERE published_at IS NULL)                  AS pending_rows,
  (SELECT count(*) FROM orders.outbox WHERE failed_at IS NOT NULL)                 AS failed_rows,
  (SELECT count(*) FROM orders.orders o
     WHERE NOT EXISTS (SELECT 1 FROM orders.outbox x WHERE x.aggregate_id = o.order_id)) AS orders_without_event,
  (SELECT count(*) FROM payments.inbox)                                            AS inbox_msg_ids,
  (SELECT count(*) FROM orders.outbox x
     WHERE NOT EXISTS (SELECT 1 FROM payments.inbox i WHERE i.msg_id = x.msg_id))    AS events_not_consumed,
  (SELECT count(DISTINCT order_id) FROM payments.charges)                          AS distinct_charges,
  (SELECT count(*) FROM payments.ledger)                                           AS charge_effects,
  (SELECT count(*) FROM (SELECT order_id FROM payments.ledger
     GROUP BY order_id HAVING count(*) > 1) d)                                     AS double_charges,
  (SELECT count(*) FROM orders.orders o
     WHERE NOT EXISTS (SELECT 1 FROM payments.charges c WHERE c.order_id = o.order_id)) AS orders_without_charge,
  (SELECT count(*) FROM payments.charges c
     WHERE NOT EXISTS (SELECT 1 FROM orders.orders o WHERE o.order_id = c.order_id)) AS charges_without_order,
  (SELECT count(*) FROM payments.ledger l
     WHERE NOT EXISTS (SELECT 1 FROM orders.orders o WHERE o.order_id = l.order_id)) AS effects_without_order,
  (SELECT count(*) FROM payments.dead_letters)                                     AS dead_letters,
  (SELECT COALESCE(sum(amount_cents), 0)::int8 FROM orders.orders)                 AS order_amount_cents,
  (SELECT COALESCE(sum(amount_cents), 0)::int8 FROM payments.charges)              AS charge_amount_cents,
  (SELECT COALESCE(sum(amount_cents), 0)::int8 FROM payments.ledger)               AS effect_amount_cents"#;

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
    /// msg_ids in the inbox.
    pub inbox_msg_ids: i64,
    /// Outbox events whose msg_id is not in the inbox.
    pub events_not_consumed: i64,
    /// Orders with a charge.
    pub distinct_charges: i64,
    /// Effects applied (ledger entries).
    pub charge_effects: i64,
    /// Orders with more than one effect.
    pub double_charges: i64,
    /// Orders with no charge.
    pub orders_without_charge: i64,
    /// Charges with no order.
    pub charges_without_order: i64,
    /// Effects with no order.
    pub effects_without_order: i64,
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

impl Report {
    /// Every difference the invariant requires to be zero.
    pub fn deltas(&self) -> Vec<Delta> {
        let d = |name, value| Delta { name, value };
        vec![
            d(
                "distinct_orders - intents",
                self.distinct_orders - self.intents,
            ),
            d("intents_without_order", self.intents_without_order),
            d(
                "outbox_rows - distinct_orders",
                self.outbox_rows - self.distinct_orders,
            ),
            d("orders_without_event", self.orders_without_event),
            d("pending_rows", self.pending_rows),
            d("failed_rows", self.failed_rows),
            d("events_not_consumed", self.events_not_consumed),
            d(
                "inbox_msg_ids - outbox_rows",
                self.inbox_msg_ids - self.outbox_rows,
            ),
            d(
                "distinct_charges - distinct_orders",
                self.distinct_charges - self.distinct_orders,
            ),
            d(
                "charge_effects - distinct_charges",
                self.charge_effects - self.distinct_charges,
            ),
            d("double_charges", self.double_charges),
            d("orders_without_charge", self.orders_without_charge),
            d("charges_without_order", self.charges_without_order),
            d("effects_without_order", self.effects_without_order),
            d(
                "charge_amount - order_amount",
                self.charge_amount_cents - self.order_amount_cents,
            ),
            d(
                "effect_amount - order_amount",
                self.effect_amount_cents - self.order_amount_cents,
            ),
        ]
    }

    /// Effects == intents with nothing missing, doubled or orphaned.
    pub fn is_clean(&self) -> bool {
        self.deltas().iter().all(|d| d.value == 0)
    }

    /// The human table.
    pub fn table(&self) -> String {
        let rows: [(&str, i64); 20] = [
            ("intents (idempotency keys)", self.intents),
            ("distinct orders", self.distinct_orders),
            ("intents without order", self.intents_without_order),
            ("outbox rows", self.outbox_rows),
            ("published rows", self.published_rows),
            ("pending rows", self.pending_rows),
            ("failed outbox rows", self.failed_rows),
            ("orders without event", self.orders_without_event),
            ("inbox msg_ids", self.inbox_msg_ids),
            ("events not consumed", self.events_not_consumed),
            ("distinct charges", self.distinct_charges),
            ("charge effects (ledger)", self.charge_effects),
            ("double charges", self.double_charges),
            ("orders without charge", self.orders_without_charge),
            ("charges without order", self.charges_without_order),
            ("effects without order", self.effects_without_order),
            ("dead letters", self.dead_letters),
            ("order amount (cents)", self.order_amount_cents),
            ("charge amount (cents)", self.charge_amount_cents),
            ("effect amount (cents)", self.effect_amount_cents),
        ];
        let mut out = String::from("recon: effects vs intents\n");
        for (name, value) in rows {
            out.push_str(&format!("  {name:<36} {value:>14}\n"));
        }
        out.push_str("deltas (all must be 0):\n");
        for delta in self.deltas() {
            let mark = if delta.value == 0 { "ok" } else { "DRIFT" };
            out.push_str(&format!(
                "  {:<36} {:>14}  {mark}\n",
                delta.name, delta.value
            ));
        }
        out.push_str(if self.is_clean() {
            "result: CLEAN — distinct effects == distinct intents\n"
        } else {
            "result: DRIFT — effects != intents\n"
        });
        out
    }
}

/// Runs the diff.
pub async fn reconcile(pool: &PgPool) -> sqlx::Result<Report> {
    sqlx::query_as(RECON_SQL).fetch_one(pool).await
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
