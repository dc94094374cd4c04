//! The client's side of the story (loadgen's `--intents`, `--ambiguous` and
//! `--failed` files) against the database: every key the client saw succeed
//! must have exactly the order it was given, a key whose fate the client
//! cannot know may have 0 or 1 order, and a key the service refused must
//! have none. A line may end with the caller (a tab, then its name: a
//! client with a bearer token): its key is read in that caller's scope; a
//! line without one, in the shared scope of unauthenticated callers.

use pipeline::contract::KEY_SCOPE;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

/// A client's key in its caller's scope (`fx.idempotency_keys.scope`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKey {
    /// The caller's name, or `''` ([`KEY_SCOPE`]) for a client without one.
    pub scope: String,
    /// The key.
    pub key: String,
}

impl ClientKey {
    /// `key` in the shared scope.
    pub fn shared(key: &str) -> Self {
        Self {
            scope: KEY_SCOPE.to_owned(),
            key: key.to_owned(),
        }
    }

    /// `key` in `caller`'s scope.
    pub fn of(caller: &str, key: &str) -> Self {
        Self {
            scope: caller.to_owned(),
            key: key.to_owned(),
        }
    }

    /// `key[<TAB>caller]`.
    fn parse(line: &str) -> Self {
        match line.split_once('\t') {
            Some((key, caller)) => Self::of(caller.trim(), key),
            None => Self::shared(line),
        }
    }
}

/// The client's side of the story (loadgen `--intents`): keys that got a
/// success, with the order id they were given, keys whose fate the client
/// cannot know (timed out, connection broke, answered 408 or 5xx), and keys
/// the service refused.
#[derive(Debug, Clone, Default)]
pub struct ClientIntents {
    /// (key, order id the client received).
    pub succeeded: Vec<(ClientKey, Uuid)>,
    /// Keys with no success and a send that may have committed: 0 or 1 order.
    pub ambiguous: Vec<ClientKey>,
    /// Keys whose every send was refused before anything was written (a 4xx
    /// other than 408 and 409) or never sent: no order.
    pub failed: Vec<ClientKey>,
}

/// One key per line (`key[<TAB>caller]`), blank lines skipped.
fn key_list(text: Option<&str>) -> Vec<ClientKey> {
    text.map(|text| {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(ClientKey::parse)
            .collect()
    })
    .unwrap_or_default()
}

impl ClientIntents {
    /// Parses loadgen's intents file (`key<TAB>order_id[<TAB>caller]` per
    /// line) and, optionally, its ambiguous and failed files (one
    /// `key[<TAB>caller]` per line).
    pub fn parse(
        intents: &str,
        ambiguous: Option<&str>,
        failed: Option<&str>,
    ) -> Result<Self, String> {
        let mut out = Self::default();
        for (n, line) in intents
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let mut fields = line.trim_end_matches(['\r', '\n']).split('\t');
            let (Some(key), Some(id), caller, None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(format!(
                    "intents line {}: expected key<TAB>order_id[<TAB>caller]",
                    n + 1
                ));
            };
            let id = Uuid::parse_str(id.trim())
                .map_err(|e| format!("intents line {}: order id: {e}", n + 1))?;
            let key = match caller {
                Some(caller) => ClientKey::of(caller.trim(), key),
                None => ClientKey::shared(key),
            };
            out.succeeded.push((key, id));
        }
        out.ambiguous = key_list(ambiguous);
        out.failed = key_list(failed);
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
    /// Keys the client could not know the fate of (0 or 1 order each).
    pub client_ambiguous: i64,
    /// ... of which the database committed an order (a timeout after commit,
    /// a 408 or 503 for a create already in a batch, a crash before the
    /// response: the client should retry them). Distinct orders of the run
    /// = `matched` + this.
    pub ambiguous_committed: i64,
    /// Keys the service refused (or that were never sent).
    pub client_failed: i64,
    /// ... that have an order all the same: a refusal that was not one
    /// (must be 0).
    pub failed_committed: i64,
}

impl IntentsReport {
    /// Every success the client saw has exactly its order, and no key the
    /// service refused has one. Ambiguous keys may have either.
    pub fn is_clean(&self) -> bool {
        self.missing_in_db == 0
            && self.wrong_order == 0
            && self.matched == self.client_succeeded
            && self.failed_committed == 0
    }

    /// The human table.
    pub fn table(&self) -> String {
        let rows = [
            ("client successes (distinct keys)", self.client_succeeded),
            ("  with exactly their order", self.matched),
            ("    of which the key expired", self.key_expired),
            ("  missing in the database", self.missing_in_db),
            ("  mapped to another order", self.wrong_order),
            (
                "client ambiguous keys (0 or 1 order)",
                self.client_ambiguous,
            ),
            ("  of which committed", self.ambiguous_committed),
            ("client refused keys (no order)", self.client_failed),
            ("  of which committed all the same", self.failed_committed),
        ];
        let mut out = String::from("recon: client intents vs database\n");
        for (name, value) in rows {
            out.push_str(&format!("  {name:<36} {value:>14}\n"));
        }
        out.push_str(if self.is_clean() {
            "intents: CLEAN — every key the client saw succeed has exactly its order, none it saw refused has one\n"
        } else {
            "intents: DRIFT — a success the client saw is missing or wrong, or a refused key has an order\n"
        });
        out
    }
}

/// The scopes and the keys of `keys`, as two arrays to bind.
fn columns(keys: &[&ClientKey]) -> (Vec<String>, Vec<String>) {
    keys.iter()
        .map(|k| (k.scope.clone(), k.key.clone()))
        .unzip()
}

/// How many of `keys` the database holds (a key row is written with its
/// order, in one transaction, so a key row is an order).
async fn keys_with_an_order(pool: &PgPool, keys: &[ClientKey]) -> sqlx::Result<i64> {
    let (scopes, keys) = columns(&keys.iter().collect::<Vec<_>>());
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "committed!"
           FROM unnest($1::text[], $2::text[]) AS c(scope, key)
           JOIN fx.idempotency_keys k ON k.scope = c.scope AND k.key = c.key"#,
        &scopes,
        &keys
    )
    .fetch_one(pool)
    .await
}

/// Compares the client's ground truth with the database.
pub async fn check_intents(pool: &PgPool, client: &ClientIntents) -> sqlx::Result<IntentsReport> {
    let (scopes, keys) = columns(&client.succeeded.iter().map(|(k, _)| k).collect::<Vec<_>>());
    let ids: Vec<Uuid> = client.succeeded.iter().map(|(_, id)| *id).collect();
    // count(*) is never NULL, but PostgreSQL reports no nullability for an
    // aggregate: hence the "!".
    // A key of an order minted below the keys' floor may have expired by
    // design (orders.keys_expire): the order the client was given must
    // still be there (orders never expire). Without this, every run older
    // than the key retention reported its expired keys as "missing".
    let counts = sqlx::query!(
        r#"SELECT count(*) FILTER (WHERE k.reference = c.id::text AND o.order_id IS NOT NULL) AS "matched!",
                  count(*) FILTER (WHERE k.key IS NULL AND c.id < f.floor
                                    AND given.order_id IS NOT NULL) AS "expired!",
                  count(*) FILTER (WHERE k.key IS NULL
                                    AND NOT (c.id < f.floor AND given.order_id IS NOT NULL)) AS "missing!",
                  count(*) FILTER (WHERE k.key IS NOT NULL
                                    AND (k.reference IS DISTINCT FROM c.id::text
                                         OR o.order_id IS NULL)) AS "wrong!"
           FROM unnest($1::text[], $2::uuid[], $3::text[]) AS c(key, id, scope)
           CROSS JOIN orders.key_policy f
           LEFT JOIN fx.idempotency_keys k ON k.scope = c.scope AND k.key = c.key
           LEFT JOIN orders.orders o ON o.order_id = effectively.uuid_of(k.reference)
           LEFT JOIN orders.orders given ON given.order_id = c.id"#,
        &keys,
        &ids,
        &scopes
    )
    .fetch_one(pool)
    .await?;
    let ambiguous_committed = keys_with_an_order(pool, &client.ambiguous).await?;
    let failed_committed = keys_with_an_order(pool, &client.failed).await?;
    Ok(IntentsReport {
        client_succeeded: client.succeeded.len() as i64,
        matched: counts.matched + counts.expired,
        key_expired: counts.expired,
        missing_in_db: counts.missing,
        wrong_order: counts.wrong,
        client_ambiguous: client.ambiguous.len() as i64,
        ambiguous_committed,
        client_failed: client.failed.len() as i64,
        failed_committed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_loadgen_files_and_refuses_garbage() {
        let id = Uuid::now_v7();
        let parsed = ClientIntents::parse(
            &format!("p-1\t{id}\n\n"),
            Some("p-2\np-3\n"),
            Some("\np-4\n"),
        )
        .expect("parse");
        assert_eq!(parsed.succeeded, vec![(ClientKey::shared("p-1"), id)]);
        assert_eq!(
            parsed.ambiguous,
            vec![ClientKey::shared("p-2"), ClientKey::shared("p-3")]
        );
        assert_eq!(parsed.failed, vec![ClientKey::shared("p-4")]);
        // A caller's lines: its keys in its scope.
        let scoped = ClientIntents::parse(
            &format!("p-1\t{id}\tshop\n"),
            Some("p-2\tshop\n"),
            Some("p-4\tbilling\n"),
        )
        .expect("parse");
        assert_eq!(scoped.succeeded, vec![(ClientKey::of("shop", "p-1"), id)]);
        assert_eq!(scoped.ambiguous, vec![ClientKey::of("shop", "p-2")]);
        assert_eq!(scoped.failed, vec![ClientKey::of("billing", "p-4")]);
        assert!(ClientIntents::parse("no-tab-here", None, None).is_err());
        assert!(ClientIntents::parse("k\tnot-a-uuid", None, None).is_err());
        assert!(ClientIntents::parse(&format!("k\t{id}\tshop\tmore"), None, None).is_err());
    }

    #[test]
    fn a_refused_key_with_an_order_is_drift_an_ambiguous_one_is_not() {
        let clean = IntentsReport {
            client_succeeded: 2,
            matched: 2,
            client_ambiguous: 3,
            ambiguous_committed: 2,
            client_failed: 1,
            ..IntentsReport::default()
        };
        assert!(clean.is_clean(), "{}", clean.table());
        let refused_committed = IntentsReport {
            failed_committed: 1,
            ..clean
        };
        assert!(!refused_committed.is_clean());
        assert!(refused_committed.table().contains("DRIFT"));
    }
}
