//! The webhook tables' statements: destinations recorded, read and removed,
//! due deliveries claimed for an attempt, delivered ones expired.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use super::destination::Destination;
use super::sealed::{Keyring, Specs};

/// A delivery claimed for one attempt.
#[derive(Debug, Clone)]
pub(super) struct Claimed {
    pub(super) outbox_id: i64,
    pub(super) msg_id: Uuid,
    pub(super) body: Vec<u8>,
    /// This attempt's number (1 for the first; a replay starts over).
    pub(super) attempts: i32,
    /// The replay this attempt belongs to (0: the first run).
    pub(super) replays: i32,
    pub(super) created_at: DateTime<Utc>,
}

/// Deletes up to `batch` deliveries delivered longer ago than the outbox
/// retention (`orders.outbox_policy`), with their attempts; returns how
/// many. Pending and failed deliveries are never deleted (a failed one waits
/// for `relay webhooks replay` or an operator).
pub async fn expire(pool: &PgPool, batch: i32) -> sqlx::Result<i32> {
    let n = sqlx::query_scalar!(
        r#"WITH gone AS (
             DELETE FROM orders.webhook_deliveries d
             WHERE (d.destination, d.outbox_id) IN (
               SELECT e.destination, e.outbox_id FROM orders.webhook_deliveries e
               WHERE e.delivered_at < now() - (SELECT p.retention FROM orders.outbox_policy p)
               LIMIT $1)
             RETURNING d.destination, d.outbox_id),
           a AS (
             DELETE FROM orders.webhook_attempts t USING gone
             WHERE t.destination = gone.destination AND t.outbox_id = gone.outbox_id)
           SELECT count(*) AS "n!" FROM gone"#,
        i64::from(batch)
    )
    .fetch_one(pool)
    .await?;
    Ok(i32::try_from(n).unwrap_or(i32::MAX))
}

/// What [`add_missing`] did with a relay's `--webhook-destination` flags.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Added {
    /// Destinations the database did not have: added.
    pub added: Vec<String>,
    /// Destinations it has with another spec (an operator rotated a secret
    /// or changed the URL since): the database's is kept.
    pub differing: Vec<String>,
    /// Destinations an operator removed: they stay removed.
    pub removed: Vec<String>,
}

/// A relay's `--webhook-destination` flags at its start: each destination
/// `orders.webhook_destinations` does not have is added; one it has is left
/// as it is. The database is the one source of truth: a flag never
/// overwrites what `relay webhooks add` or a secret rotation wrote, and
/// never brings back what `relay webhooks remove` removed (before, every
/// relay's start re-applied its flags: a removed destination came back and a
/// rotated secret was reverted). A row an older relay registered by name
/// only (no spec, not removed) takes the flag's spec. The specs are stored
/// sealed (`specs`), so a stored one is compared with its flag here, opened,
/// not in SQL (two seals of one spec differ).
///
/// # Errors
/// The database's, or a stored spec that does not open.
pub async fn add_missing(
    pool: &PgPool,
    specs: &Specs,
    destinations: &[Destination],
) -> anyhow::Result<Added> {
    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
    let sealed: Vec<String> = destinations
        .iter()
        .map(|d| specs.seal(&d.name, &d.spec))
        .collect();
    let added: Vec<String> = sqlx::query_scalar(
        "INSERT INTO orders.webhook_destinations AS w (destination, spec) \
         SELECT * FROM unnest($1::text[], $2::text[]) \
         ON CONFLICT (destination) DO UPDATE SET spec = EXCLUDED.spec, added_at = now() \
           WHERE w.spec IS NULL AND w.removed_at IS NULL \
         RETURNING w.destination",
    )
    .bind(&names)
    .bind(&sealed)
    .fetch_all(pool)
    .await?;
    let kept: Vec<(String, bool, Option<String>)> = sqlx::query_as(
        "SELECT destination, removed_at IS NOT NULL, spec FROM orders.webhook_destinations \
         WHERE destination = ANY($1::text[]) AND destination <> ALL($2::text[]) \
         ORDER BY destination",
    )
    .bind(&names)
    .bind(&added)
    .fetch_all(pool)
    .await?;
    let mut out = Added {
        added,
        ..Added::default()
    };
    for (name, removed, stored) in kept {
        if removed {
            out.removed.push(name);
            continue;
        }
        let flag = destinations
            .iter()
            .find(|d| d.name == name)
            .map(|d| d.spec.as_str());
        let stored = stored.map(|s| specs.open(&name, &s)).transpose()?;
        if stored.as_deref() != flag {
            out.differing.push(name);
        }
    }
    Ok(out)
}

/// `relay webhooks add`, the operator's command: adds `destinations` to
/// `orders.webhook_destinations`, or replaces the spec of those there (a
/// removed one is added again: its later events are fanned out to it; its
/// failed deliveries wait for `relay webhooks replay`). The specs are
/// stored sealed (`specs`).
pub async fn upsert(
    pool: &PgPool,
    specs: &Specs,
    destinations: &[Destination],
) -> sqlx::Result<()> {
    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
    let sealed: Vec<String> = destinations
        .iter()
        .map(|d| specs.seal(&d.name, &d.spec))
        .collect();
    sqlx::query!(
        "INSERT INTO orders.webhook_destinations (destination, spec) \
         SELECT * FROM unnest($1::text[], $2::text[]) \
         ON CONFLICT (destination) DO UPDATE SET spec = EXCLUDED.spec, removed_at = NULL, \
           added_at = CASE WHEN orders.webhook_destinations.removed_at IS NULL \
                                AND orders.webhook_destinations.spec IS NOT NULL \
                           THEN orders.webhook_destinations.added_at ELSE now() END",
        &names as &[&str],
        &sealed as &[String]
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The destinations fanned out to: in `orders.webhook_destinations`, with a
/// spec, not removed. A spec that does not open (a key the relay lacks) or
/// no longer parses (written by another version) is left out with an
/// ERROR.
pub async fn active(pool: &PgPool, specs: &Specs) -> sqlx::Result<Vec<Destination>> {
    let rows = sqlx::query!(
        r#"SELECT destination, spec AS "spec!" FROM orders.webhook_destinations
           WHERE spec IS NOT NULL AND removed_at IS NULL ORDER BY destination"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            let spec = match specs.open(&r.destination, &r.spec) {
                Ok(spec) => spec,
                Err(error) => {
                    tracing::error!(destination = r.destination, %error, "not delivering to it");
                    return None;
                }
            };
            match spec.parse::<Destination>() {
                Ok(d) if d.name == r.destination => Some(d),
                Ok(d) => {
                    tracing::error!(destination = r.destination, named = d.name, "a destination's spec names another destination; not delivering to it");
                    None
                }
                Err(error) => {
                    tracing::error!(destination = r.destination, %error, "a destination's spec does not parse; not delivering to it");
                    None
                }
            }
        })
        .collect())
}

/// The destinations whose specs are stored in plaintext (written before
/// sealing, or with `--unsafe-plaintext-webhook-secrets`).
pub async fn plaintext(pool: &PgPool) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT destination FROM orders.webhook_destinations \
         WHERE spec IS NOT NULL AND spec NOT LIKE 'sealed:v1:%' ORDER BY destination",
    )
    .fetch_all(pool)
    .await
}

/// What [`rekey`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rekeyed {
    /// Specs sealed again under the current key (sealed under an older key,
    /// or in plaintext before).
    pub resealed: Vec<String>,
    /// Specs already under the current key.
    pub current: usize,
}

/// `relay webhooks rekey`: every stored spec not sealed under the current
/// key (an older key's, or plaintext) sealed again under it, in one
/// transaction (the rows locked). Nothing is changed if one does not open.
///
/// # Errors
/// The database's, or a spec no key of the ring opens.
pub async fn rekey(pool: &PgPool, ring: &Keyring) -> anyhow::Result<Rekeyed> {
    let mut tx = pool.begin().await?;
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT destination, spec FROM orders.webhook_destinations \
         WHERE spec IS NOT NULL ORDER BY destination FOR UPDATE",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut out = Rekeyed::default();
    for (name, stored) in rows {
        if ring.is_current(&stored) {
            out.current += 1;
            continue;
        }
        let spec = ring.open(&name, &stored)?;
        sqlx::query("UPDATE orders.webhook_destinations SET spec = $2 WHERE destination = $1")
            .bind(&name)
            .bind(ring.seal(&name, &spec))
            .execute(&mut *tx)
            .await?;
        out.resealed.push(name);
    }
    tx.commit().await?;
    Ok(out)
}

/// Removes `name`: no later event is fanned out to it, and its pending
/// deliveries are marked failed ("the destination was removed"), in one
/// transaction that first locks the destination's row, so no fan-out
/// writes a delivery for it after. Returns how many were pending.
pub async fn remove(pool: &PgPool, name: &str) -> anyhow::Result<u64> {
    let mut tx = pool.begin().await?;
    let found: Option<i32> = sqlx::query_scalar!(
        "SELECT 1 FROM orders.webhook_destinations \
         WHERE destination = $1 AND spec IS NOT NULL AND removed_at IS NULL FOR UPDATE",
        name
    )
    .fetch_optional(&mut *tx)
    .await?
    .flatten();
    if found.is_none() {
        anyhow::bail!("no destination {name:?} (relay webhooks status lists them)");
    }
    sqlx::query!(
        "UPDATE orders.webhook_destinations SET removed_at = now() WHERE destination = $1",
        name
    )
    .execute(&mut *tx)
    .await?;
    let failed = sqlx::query!(
        "UPDATE orders.webhook_deliveries SET failed_at = now(), \
           last_error = 'the destination was removed (relay webhooks remove)' \
         WHERE destination = $1 AND delivered_at IS NULL AND failed_at IS NULL",
        name
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(failed)
}

/// Claims up to `limit` due deliveries of `destination` for one attempt
/// each: none while the destination is disabled (a 410), and only those
/// whose key has no earlier open delivery to it (`OFFSET 0` keeps the
/// `NOT EXISTS` a probe per candidate, as in `outbox::read_shards`). Counts the
/// attempt and moves `next_attempt_at` a lease ahead.
pub(super) async fn claim(
    pool: &PgPool,
    destination: &str,
    limit: usize,
    lease: Duration,
) -> sqlx::Result<Vec<Claimed>> {
    sqlx::query_as!(
        Claimed,
        "UPDATE orders.webhook_deliveries d \
         SET attempts = d.attempts + 1, last_attempt_at = now(), \
             next_attempt_at = now() + $3::float8 * interval '1 millisecond' \
         FROM (SELECT c.destination, c.outbox_id FROM orders.webhook_deliveries c \
               WHERE c.destination = $1 AND c.delivered_at IS NULL AND c.failed_at IS NULL \
                 AND c.next_attempt_at <= now() \
                 AND NOT EXISTS (SELECT 1 FROM orders.webhook_destinations w \
                                 WHERE w.destination = $1 AND w.disabled_at IS NOT NULL) \
                 AND NOT EXISTS (SELECT 1 FROM orders.webhook_deliveries e \
                                 WHERE e.destination = c.destination \
                                   AND e.aggregate_id = c.aggregate_id \
                                   AND e.outbox_id < c.outbox_id \
                                   AND e.delivered_at IS NULL AND e.failed_at IS NULL \
                                 OFFSET 0) \
               ORDER BY c.next_attempt_at, c.outbox_id LIMIT $2 \
               FOR UPDATE OF c SKIP LOCKED) AS picked \
         WHERE d.destination = picked.destination AND d.outbox_id = picked.outbox_id \
         RETURNING d.outbox_id, d.msg_id, d.body, d.attempts, d.replays, d.created_at",
        destination,
        i64::try_from(limit).unwrap_or(i64::MAX),
        lease.as_secs_f64() * 1000.0
    )
    .fetch_all(pool)
    .await
}
