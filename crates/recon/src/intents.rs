//! The client's side of the story (loadgen's `--intents` and `--ambiguous`
//! files) against the database: every key the client saw succeed must
//! have exactly the order it was given.

use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

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
    /// ... that have exactly their order: key row, same order id, order row;
    /// or, for a key expired by design (its order minted below the keys'
    /// floor, `orders.keys_expire`), the order row the client was given.
    pub matched: i64,
    /// ... of which matched by their order alone: the key expired.
    pub key_expired: i64,
    /// ... whose key is not in the database (a success the database lost),
    /// and not expired (its order above the keys' floor, or missing).
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
            ("    of which the key expired", self.key_expired),
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
    // count(*) is never NULL, but PostgreSQL reports no nullability for an
    // aggregate: hence the "!".
    // A key of an order minted below the keys' floor may have expired by
    // design (orders.keys_expire): the order the client was given must
    // still be there (orders never expire). Without this, every run older
    // than the key retention reported its expired keys as "missing".
    let counts = sqlx::query!(
        r#"SELECT count(*) FILTER (WHERE k.order_id = c.id AND o.order_id IS NOT NULL) AS "matched!",
                  count(*) FILTER (WHERE k.idem_key IS NULL AND c.id < f.floor
                                    AND given.order_id IS NOT NULL) AS "expired!",
                  count(*) FILTER (WHERE k.idem_key IS NULL
                                    AND NOT (c.id < f.floor AND given.order_id IS NOT NULL)) AS "missing!",
                  count(*) FILTER (WHERE k.idem_key IS NOT NULL
                                    AND (k.order_id <> c.id OR o.order_id IS NULL)) AS "wrong!"
           FROM unnest($1::text[], $2::uuid[]) AS c(key, id)
           CROSS JOIN orders.key_policy f
           LEFT JOIN orders.idempotency_keys k ON k.idem_key = c.key
           LEFT JOIN orders.orders o ON o.order_id = k.order_id
           LEFT JOIN orders.orders given ON given.order_id = c.id"#,
        // Borrowed keys encode as text[] like owned ones; the macro's check
        // only knows `&[String]` for text[], so the type is stated.
        &keys as &[&str],
        &ids
    )
    .fetch_one(pool)
    .await?;
    let ambiguous_committed = sqlx::query_scalar!(
        r#"SELECT count(*) AS "committed!" FROM orders.idempotency_keys WHERE idem_key = ANY($1)"#,
        &client.ambiguous
    )
    .fetch_one(pool)
    .await?;
    Ok(IntentsReport {
        client_succeeded: client.succeeded.len() as i64,
        matched: counts.matched + counts.expired,
        key_expired: counts.expired,
        missing_in_db: counts.missing,
        wrong_order: counts.wrong,
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
