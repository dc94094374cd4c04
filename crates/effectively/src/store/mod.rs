//! The library on a schema of the user's choosing: the outbox, the inbox and
//! the idempotency keys of a service that is not this project's pipeline.
//!
//! One [`Effectively`] value names the PostgreSQL schema that holds every
//! table, function, index and `NOTIFY` channel of the library. Its
//! [`migrate`](Effectively::migrate) installs or upgrades them, recording
//! each version in the schema's own ledger (`<schema>.migrations`), never in
//! sqlx's `_sqlx_migrations`, so the user's own migrations and the library's
//! never meet. The same SQL is text for users of other migration tools
//! ([`Effectively::migrations`]). No role, grant or publication is created:
//! [`Effectively::grants`] writes the statements for the user to read and
//! apply.
//!
//! Every query is checked at run time against the schema (the statements
//! are built once per store, with its name), so the crate needs no database
//! when it compiles; the integration tests run each one against a real
//! server.
//!
//! ```no_run
//! use effectively::store::{Effectively, Event};
//!
//! # async fn run(pool: sqlx::PgPool) -> anyhow::Result<()> {
//! let fx = Effectively::postgres(pool.clone()).schema("shop_fx")?;
//! fx.migrate().await?;
//!
//! // The business row and its event commit together, or neither does.
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO carts (id) VALUES (1)").execute(&mut *tx).await?;
//! let event = Event::json("cart.events", "cart-1", "cart.checked_out", &serde_json::json!({"cart": 1}))?;
//! fx.outbox().enqueue(&mut *tx, &event).await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "kafka")]
mod consume;
mod handle;
#[cfg(feature = "http")]
mod http;
mod inbox;
#[cfg(feature = "kafka")]
mod kafka;
mod keys;
mod outbox;
#[cfg(feature = "http")]
mod receive;
mod relay;
mod source;
#[cfg(feature = "webhooks")]
mod webhook;

use std::fmt;
use std::sync::Arc;

use sqlx::{Connection, Executor, PgPool};

pub use crate::idempotency::{Fingerprint, IdempotencyKey};
#[cfg(feature = "kafka")]
pub use consume::{DEFAULT_BATCH, consume, consume_batches, msg_id_of, record_of};
pub use handle::{Handled, Handler, HandlerError, Record, handle, handle_batch};
#[cfg(feature = "http")]
pub use http::{IDEMPOTENCY_KEY_HEADER, Idempotent, Principal};
pub use inbox::{
    Applied, DEFAULT_CLOCK_SKEW, DEFAULT_PARTITION, DEFAULT_RETENTION, Inbox, InboxClaim,
    Maintained, Message, MessageError, MessageId, Window,
};
#[cfg(feature = "kafka")]
pub use kafka::{HEADER_CONTENT_TYPE, KafkaSink, rejects_the_record};
pub use keys::{ClaimRow, KeyClaim, KeyRequest, Keys, StoredResponse};
pub use outbox::{Backlog, Event, EventError, Failed, Outbox, Payload, SHARDS, shard_of};
#[cfg(feature = "http")]
pub use receive::WebhookReceiver;
pub use relay::{
    MAX_SHARD_DEPTH, Outgoing, Pass, Relay, RelayHooks, RelayStats, SendError, Sink, Stage,
};
pub use source::{Claimed, DEFAULT_KEEP_PUBLISHED, OutboxSource, Sent, Settled, Source};
#[cfg(feature = "webhooks")]
pub use webhook::{DestinationError, WebhookSink};

/// The header that carries an event's message id on every Kafka record the
/// library's relay publishes, and that its consumer reads the id from.
pub const HEADER_MSG_ID: &str = "msg_id";
/// The header that carries an event's type.
pub const HEADER_EVENT_TYPE: &str = "event_type";
/// The header Debezium's Outbox Event Router puts an outbox row's event id
/// in; the library's consumer reads the message id from it when a record
/// has no [`HEADER_MSG_ID`], so it works behind a Debezium connector whose
/// router takes the event id from the outbox's `msg_id`.
pub const HEADER_ROUTER_ID: &str = "id";

/// The default schema: `effectively`.
pub const DEFAULT_SCHEMA: &str = "effectively";

/// One version of the library's schema: its number, its name and its SQL,
/// `@schema@` standing for the quoted schema name.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

/// Every version, in order. A released version is never edited: a change is
/// a new version.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox_inbox_keys",
        sql: include_str!("sql/0001_outbox_inbox_keys.sql"),
    },
    Migration {
        version: 2,
        name: "dead_letters",
        sql: include_str!("sql/0002_dead_letters.sql"),
    },
    Migration {
        version: 3,
        name: "outbox_expiry",
        sql: include_str!("sql/0003_outbox_expiry.sql"),
    },
    Migration {
        version: 4,
        name: "keys_batch_claim",
        sql: include_str!("sql/0004_keys_batch_claim.sql"),
    },
    Migration {
        version: 5,
        name: "partitioned_inbox",
        sql: include_str!("sql/0005_partitioned_inbox.sql"),
    },
];

/// A schema name the library accepts: 1 to 48 characters of `a-z`, `0-9`
/// and `_`, not starting with a digit and not `pg_…` (PostgreSQL's own).
/// Short enough that every index and channel name built from it stays under
/// PostgreSQL's 63 bytes; lowercase so that the quoted and unquoted
/// spellings are the same schema.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

/// Why a schema name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "schema name {name:?} is not accepted: {why} (1 to 48 characters of a-z, 0-9 and _, \
     not starting with a digit or pg_)"
)]
pub struct SchemaNameError {
    /// The name given.
    pub name: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl SchemaName {
    /// Checks `name`.
    pub fn new(name: &str) -> Result<Self, SchemaNameError> {
        let refuse = |why| {
            Err(SchemaNameError {
                name: name.to_owned(),
                why,
            })
        };
        if name.is_empty() {
            return refuse("it is empty");
        }
        if name.len() > 48 {
            return refuse("it is longer than 48 characters");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return refuse("it holds a character other than a-z, 0-9 and _");
        }
        if name.as_bytes()[0].is_ascii_digit() {
            return refuse("it starts with a digit");
        }
        if name.starts_with("pg_") {
            return refuse("pg_ names are PostgreSQL's own");
        }
        Ok(Self(name.to_owned()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted as an SQL identifier.
    pub fn quoted(&self) -> String {
        // Only [a-z0-9_]: nothing to escape.
        format!("\"{}\"", self.0)
    }

    /// `sql` with every `@schema@` replaced by the quoted name.
    fn apply(&self, sql: &str) -> String {
        sql.replace("@schema@", &self.quoted())
    }
}

impl fmt::Display for SchemaName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The library on one schema of one database: a cheap handle to clone and
/// share. [`Effectively::outbox`], [`Effectively::inbox`] and
/// [`Effectively::keys`] give the three parts; each statement is built once,
/// here, with the schema's name.
#[derive(Clone)]
pub struct Effectively {
    pool: PgPool,
    schema: Arc<SchemaName>,
}

impl fmt::Debug for Effectively {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Effectively")
            .field("schema", &self.schema.as_str())
            .finish_non_exhaustive()
    }
}

/// A version of the schema's ledger that this library does not have, or has
/// with other SQL: the database was migrated by another build of it.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The ledger records a version newer than this library knows.
    #[error(
        "schema {schema} is at version {found}, newer than this build of the library knows \
         (its last is {known}): run a build at least as new"
    )]
    Newer {
        /// The schema.
        schema: String,
        /// The newest version in the ledger.
        found: i32,
        /// The newest this library has.
        known: i32,
    },
    /// A version in the ledger was applied from other SQL than this
    /// library's.
    #[error(
        "schema {schema}'s version {version} ({name}) was applied from other SQL than this \
         build of the library has (checksum differs): it was edited, or another library \
         owns the schema"
    )]
    Changed {
        /// The schema.
        schema: String,
        /// The version.
        version: i32,
        /// Its name.
        name: String,
    },
    /// The database.
    #[error("migrate schema {schema}: {source}")]
    Database {
        /// The schema.
        schema: String,
        /// What the database said.
        #[source]
        source: sqlx::Error,
    },
}

/// What [`Effectively::migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrated {
    /// The versions it applied, in order (empty: the schema was current).
    pub applied: Vec<i32>,
    /// The schema's version now.
    pub version: i32,
}

impl Effectively {
    /// The library on `pool`'s database, in schema [`DEFAULT_SCHEMA`].
    pub fn postgres(pool: PgPool) -> Self {
        Self {
            pool,
            schema: Arc::new(SchemaName(DEFAULT_SCHEMA.to_owned())),
        }
    }

    /// The same, in schema `name` ([`SchemaName`] says which names go).
    pub fn schema(self, name: &str) -> Result<Self, SchemaNameError> {
        Ok(Self {
            schema: Arc::new(SchemaName::new(name)?),
            ..self
        })
    }

    /// The schema's name.
    pub fn schema_name(&self) -> &SchemaName {
        &self.schema
    }

    /// The pool it was made with.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox.
    pub fn outbox(&self) -> Outbox {
        Outbox::new(&self.schema)
    }

    /// The inbox of consumer `consumer` (its messages' ids are its own: two
    /// consumers may apply the same message each once). `consumer` must not
    /// be empty.
    pub fn inbox(&self, consumer: &str) -> Inbox {
        Inbox::new(&self.schema, consumer)
    }

    /// The partitioned inbox of consumer `consumer`: for messages whose ids
    /// are UUIDv7 (every [`Event`]'s msg_id), partitioned by mint time, so
    /// that its rows expire by dropping whole partitions (no delete, no
    /// vacuum; what a consumer of millions of messages a day needs). Run
    /// [`Inbox::maintain`] beside it: its first round makes the partitions
    /// (until a round has, every claim is [`InboxClaim::Early`]), and later
    /// ones keep them ahead of the clock and drop the expired ones. Its rows
    /// are its own: a message
    /// claimed in the row inbox ([`Effectively::inbox`]) is new here.
    /// `consumer` must not be empty.
    pub fn partitioned_inbox(&self, consumer: &str) -> Inbox {
        Inbox::partitioned(&self.schema, consumer)
    }

    /// The idempotency keys.
    pub fn keys(&self) -> Keys {
        Keys::new(&self.schema)
    }

    /// Every version's SQL for this schema, in order, as `(version, name,
    /// sql)`: what [`Effectively::migrate`] runs, for a user who applies it
    /// with another tool (who then records the versions in
    /// `<schema>.migrations` as [`Effectively::migrate`] would, or never
    /// calls it).
    pub fn migrations(&self) -> Vec<(i32, &'static str, String)> {
        MIGRATIONS
            .iter()
            .map(|m| (m.version, m.name, self.schema.apply(m.sql)))
            .collect()
    }

    /// Installs the schema, or upgrades it to this library's last version,
    /// in one transaction: the schema and its ledger when missing, then each
    /// version the ledger lacks, recorded with its checksum. Two processes
    /// migrating at once take turns (an advisory lock on the schema's name).
    /// A ledger with a version this library does not have, or with other
    /// SQL for one it has, is refused ([`MigrateError`]) and nothing runs.
    ///
    /// Needs the right to create the schema (or to create in it, when it
    /// exists); the services that only use it need less
    /// ([`Effectively::grants`]).
    pub async fn migrate(&self) -> Result<Migrated, MigrateError> {
        let schema = self.schema.as_str().to_owned();
        let db = |source| MigrateError::Database {
            schema: schema.clone(),
            source,
        };
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtextextended('effectively.migrate:' || $1, 0))",
        )
        .bind(&schema)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        let q = self.schema.quoted();
        // Several statements: sent as one simple query (no parameters).
        // Through `Executor::execute`, not `sqlx::raw_sql(..).execute(..)`,
        // whose `async fn` made this future fail rustc's `Send` proof inside
        // a spawned service's future.
        let ledger = format!(
            "CREATE SCHEMA IF NOT EXISTS {q}; \
             CREATE TABLE IF NOT EXISTS {q}.migrations ( \
                 version    integer     PRIMARY KEY, \
                 name       text        NOT NULL, \
                 checksum   bytea       NOT NULL, \
                 applied_at timestamptz NOT NULL DEFAULT now())"
        );
        (&mut *tx).execute(ledger.as_str()).await.map_err(db)?;
        let done: Vec<(i32, String, Vec<u8>)> = sqlx::query_as(&format!(
            "SELECT version, name, checksum FROM {q}.migrations ORDER BY version"
        ))
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let known = MIGRATIONS.last().map_or(0, |m| m.version);
        if let Some(&(found, _, _)) = done.iter().rev().find(|(v, _, _)| *v > known) {
            return Err(MigrateError::Newer {
                schema,
                found,
                known,
            });
        }
        for (version, name, checksum) in &done {
            let ours = MIGRATIONS.iter().find(|m| m.version == *version);
            if ours.is_none_or(|m| checksum_of(m.sql) != checksum.as_slice()) {
                return Err(MigrateError::Changed {
                    schema,
                    version: *version,
                    name: name.clone(),
                });
            }
        }
        let mut applied = Vec::new();
        for m in MIGRATIONS
            .iter()
            .filter(|m| !done.iter().any(|(v, _, _)| *v == m.version))
        {
            let sql = self.schema.apply(m.sql);
            (&mut *tx).execute(sql.as_str()).await.map_err(db)?;
            sqlx::query(&format!(
                "INSERT INTO {q}.migrations (version, name, checksum) VALUES ($1, $2, $3)"
            ))
            .bind(m.version)
            .bind(m.name)
            .bind(checksum_of(m.sql).to_vec())
            .execute(&mut *tx)
            .await
            .map_err(db)?;
            applied.push(m.version);
        }
        tx.commit().await.map_err(db)?;
        if !applied.is_empty() {
            tracing::info!(schema = %self.schema, ?applied, "effectively: schema migrated");
        }
        Ok(Migrated {
            applied,
            version: known,
        })
    }

    /// The statements that give each role what its part needs on this
    /// schema, and nothing more, for the user to read and apply (the library
    /// creates no role and grants nothing itself). A `None` role is left
    /// out.
    ///
    /// - `writer` (the service that enqueues events and claims keys):
    ///   inserts into the outbox; reads, inserts, updates and deletes keys.
    /// - `relay`: reads the outbox and marks its rows.
    /// - `consumer`: claims, reads and expires its inbox rows (in either
    ///   inbox: the partitioned one's partitions are made and dropped by
    ///   functions that run as the schema's owner); writes and reads dead
    ///   letters.
    pub fn grants(
        &self,
        writer: Option<&str>,
        relay: Option<&str>,
        consumer: Option<&str>,
    ) -> String {
        let q = self.schema.quoted();
        let mut sql = String::new();
        let role = |r: &str| format!("\"{}\"", r.replace('"', "\"\""));
        for r in [writer, relay, consumer].into_iter().flatten() {
            sql.push_str(&format!("GRANT USAGE ON SCHEMA {q} TO {};\n", role(r)));
        }
        if let Some(r) = writer {
            let r = role(r);
            sql.push_str(&format!(
                "GRANT INSERT ON {q}.outbox TO {r};\n\
                 GRANT SELECT, INSERT, UPDATE, DELETE ON {q}.idempotency_keys TO {r};\n"
            ));
        }
        if let Some(r) = relay {
            let r = role(r);
            sql.push_str(&format!(
                "GRANT SELECT, UPDATE (published_at, failed_at, error), DELETE ON {q}.outbox TO {r};\n"
            ));
        }
        if let Some(r) = consumer {
            let r = role(r);
            sql.push_str(&format!(
                "GRANT SELECT, INSERT, DELETE ON {q}.inbox TO {r};\n\
                 GRANT SELECT, INSERT ON {q}.partitioned_inbox TO {r};\n\
                 GRANT SELECT ON {q}.partitioned_inbox_parts TO {r};\n\
                 GRANT EXECUTE ON FUNCTION {q}.partitioned_inbox_extend(timestamptz, interval, uuid), \
                 {q}.partitioned_inbox_expire(text, interval) TO {r};\n\
                 GRANT SELECT, INSERT ON {q}.dead_letters TO {r};\n"
            ));
        }
        sql
    }
}

/// Runs `delete` (a statement that deletes at most its last parameter's
/// rows, given by `delete(limit)`) until it deletes fewer than `batch` (at
/// least 1), each run its own transaction; returns how many it deleted.
async fn delete_in_batches<'q>(
    pool: &PgPool,
    batch: u32,
    delete: impl Fn(i64) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Result<u64, sqlx::Error> {
    let limit = i64::from(batch.max(1));
    let mut deleted = 0;
    loop {
        let n = delete(limit).execute(pool).await?.rows_affected();
        deleted += n;
        if n < limit as u64 {
            return Ok(deleted);
        }
    }
}

/// A version's checksum: SHA-256 of its SQL as the library holds it (with
/// `@schema@`, so the same version has one checksum in every schema).
fn checksum_of(sql: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(sql.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_lowercase_identifiers() {
        for ok in ["effectively", "shop_fx", "a", "_x1", &"s".repeat(48)] {
            assert_eq!(SchemaName::new(ok).map(|s| s.0), Ok(ok.to_owned()), "{ok}");
        }
        for bad in [
            "",
            "Shop",
            "shop-fx",
            "1shop",
            "pg_shop",
            "shop fx",
            "shop\"; DROP TABLE x; --",
            &"s".repeat(49),
        ] {
            assert!(SchemaName::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_statement_of_a_version_names_the_schema_it_is_for() {
        let name = SchemaName::new("shop_fx").expect("valid");
        for m in MIGRATIONS {
            let sql = name.apply(m.sql);
            assert!(!sql.contains("@schema@"), "version {}", m.version);
            for line in sql.lines().filter(|l| {
                let l = l.trim_start();
                l.starts_with("CREATE TABLE") || l.starts_with("CREATE FUNCTION")
            }) {
                assert!(
                    line.contains("\"shop_fx\"."),
                    "version {}: {line}",
                    m.version
                );
            }
        }
    }

    #[test]
    fn versions_are_numbered_one_up_in_order() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i as i32 + 1, "{}", m.name);
        }
    }
}
