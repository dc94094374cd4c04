//! Connection pool and the embedded migrations (`migrations/` at the repo root).

use anyhow::Context;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgPoolOptions;

use std::str::FromStr;
use std::time::Duration;

use effectively::retry::Backoff;

use sqlx::postgres::PgConnectOptions;

use crate::config::{DbArgs, SessionLimits};

/// All migrations of the pipeline (both schemas), embedded at compile time.
/// They run as the owner of the schemas (`orders --migrate-only` with the
/// owner's URL), never with a service's role.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// The schema the library ([`effectively::store`]) is installed in, in the
/// pipeline's database: orders' idempotency keys live there
/// (`fx.idempotency_keys`). Not the library's default (`effectively`): that
/// name was the pipeline's schema of helper functions first.
pub const LIBRARY_SCHEMA: &str = "fx";

/// The library on the pipeline's database, in [`LIBRARY_SCHEMA`].
pub fn library(pool: PgPool) -> effectively::store::Effectively {
    effectively::store::Effectively::postgres(pool)
        .schema(LIBRARY_SCHEMA)
        .expect("LIBRARY_SCHEMA is a valid schema name")
}

/// Applies every migration, as the owner: the library's schema first
/// ([`LIBRARY_SCHEMA`], its own ledger), then the pipeline's ([`MIGRATOR`],
/// whose later versions grant on and move data into the library's tables).
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    library(pool.clone())
        .migrate()
        .await
        .context("install the library's schema")?;
    MIGRATOR.run(pool).await.context("apply migrations")?;
    Ok(())
}

/// The PostgreSQL login role of each service, with what the migrations grant
/// it (migrations/20261123000001_roles.sql): least privilege, each service
/// refused outside its own tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServiceRole {
    /// Writes the orders schema: idempotency keys, orders, outbox rows.
    Orders,
    /// Reads the outbox and marks its rows published or failed.
    Relay,
    /// Writes the payments schema: inbox, charges, ledger, dead letters.
    Payments,
    /// Reads both schemas, writes nothing.
    Recon,
}

impl ServiceRole {
    /// Every role.
    pub const ALL: [Self; 4] = [Self::Orders, Self::Relay, Self::Payments, Self::Recon];

    /// The role's name on the server.
    pub fn name(self) -> &'static str {
        match self {
            Self::Orders => "effectively_orders",
            Self::Relay => "effectively_relay",
            Self::Payments => "effectively_payments",
            Self::Recon => "effectively_recon",
        }
    }

    /// The variable of the stack's env file that holds the service's URL
    /// (`ORDERS_DATABASE_URL`, ...); launchers pass it to the service as its
    /// `DATABASE_URL`.
    pub fn url_var(self) -> &'static str {
        match self {
            Self::Orders => "ORDERS_DATABASE_URL",
            Self::Relay => "RELAY_DATABASE_URL",
            Self::Payments => "PAYMENTS_DATABASE_URL",
            Self::Recon => "RECON_DATABASE_URL",
        }
    }
}

/// Opens a pool per `args` and, when `args.db_migrate`, applies the
/// migrations (on a connection of their own, without the session limits: a
/// migration on a large table may rightly take long).
///
/// Every pooled session sets its own limits, whatever the server's defaults:
/// READ COMMITTED (the isolation the transactions of this crate are written
/// for), `statement_timeout` and `idle_in_transaction_session_timeout` from
/// `args` or the service's `defaults`, and TCP keepalives (30 s idle, 10 s
/// interval, 3 probes) so the server notices a client that vanished; and,
/// when the service asks for them, a custom plan for every statement
/// ([`SessionLimits::custom_plans`]), the outbox trigger's `NOTIFY` off
/// ([`SessionLimits::defer_outbox_notify`]) and commits that do not wait for
/// their WAL's flush ([`SessionLimits::asynchronous_commit`]), and bitmap
/// scans off ([`SessionLimits::ordered_reads`]).
pub async fn connect(args: &DbArgs, defaults: SessionLimits) -> anyhow::Result<PgPool> {
    let base = PgConnectOptions::from_str(&args.database_url).context("parse DATABASE_URL")?;
    let patience = args.connect_patience();
    if args.db_migrate {
        let migrating = patiently(patience, || {
            PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(args.acquire_timeout())
                .connect_with(base.clone())
        })
        .await
        .context("connect to postgres to migrate (is the stack up? `make up`)")?;
        migrate(&migrating).await?;
        migrating.close().await;
    }
    let limits = args.limits(defaults);
    let statement = limits.statement_timeout.as_millis().to_string();
    let idle = limits.idle_in_transaction_timeout.as_millis().to_string();
    let mut options = base.options([
        // sqlx writes these as `-c key=value` into the startup `options`
        // unescaped; the server splits that on spaces unless escaped.
        ("default_transaction_isolation", r"read\ committed"),
        ("statement_timeout", statement.as_str()),
        ("idle_in_transaction_session_timeout", idle.as_str()),
        ("tcp_keepalives_idle", "30"),
        ("tcp_keepalives_interval", "10"),
        ("tcp_keepalives_count", "3"),
    ]);
    if limits.custom_plans {
        options = options.options([("plan_cache_mode", "force_custom_plan")]);
    }
    if limits.defer_outbox_notify {
        options = options.options([(crate::outbox::NOTIFY_SETTING, "off")]);
    }
    if limits.asynchronous_commit {
        options = options.options([("synchronous_commit", "off")]);
    }
    if limits.ordered_reads {
        options = options.options([("enable_bitmapscan", "off")]);
    }
    patiently(patience, || {
        PgPoolOptions::new()
            .max_connections(args.db_max_connections)
            .acquire_timeout(args.acquire_timeout())
            .test_before_acquire(args.db_test_before_acquire)
            .connect_with(options.clone())
    })
    .await
    .context("connect to postgres (is the stack up? `make up`)")
}

/// `attempt` again while it fails with an error [`is_unavailable`] calls
/// retryable, for up to `patience` (backing off from 100 ms to 2 s), then
/// its last error: a service started while the database fails over or
/// restarts waits for it instead of exiting. Any other error at once.
pub async fn patiently<T, F, Fut>(patience: Duration, attempt: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let unavailable = |error: &sqlx::Error| {
        let unavailable = is_unavailable(error);
        if unavailable {
            tracing::warn!(%error, "postgres unavailable");
        }
        unavailable
    };
    Backoff::between(Duration::from_millis(100), Duration::from_secs(2))
        .retry_within(patience, unavailable, attempt)
        .await
}

/// What a failed database call says about retrying the same work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The input: the same statement with the same data fails again (a data
    /// exception such as a NUL in `text`, a constraint violation, a value past
    /// a limit). Retrying it forever stalls everything behind it: isolate the
    /// offending input, record it, go on.
    Deterministic,
    /// Anything else: a lost connection, a serialization failure or deadlock,
    /// too many connections, an administrator shutdown, a statement timeout,
    /// and also errors no input causes (a missing privilege, a schema that is
    /// behind). Retry with backoff; nothing is skipped.
    Transient,
}

/// PostgreSQL's words when a standby is asked what only a primary can
/// answer (`pg_current_wal_lsn()`, SQLSTATE `55000`).
const RECOVERY_IN_PROGRESS: &str = "recovery is in progress";

/// How sqlx words a TLS request the stream's end answered.
const SSL_REQUEST_UNANSWERED: &str = "unexpected response from SSLRequest: 0x00";

/// Whether `error` says the database is unreachable or refusing work for
/// now, rather than anything about the request: the connection is lost or
/// cannot be made (I/O, TLS, closed before it answered the TLS request,
/// SQLSTATE class `08`), the pool is exhausted or
/// closed, the server is out of resources (`53`), shutting down or restarting
/// (`57P01`..`57P03`), a standby (`25006`, or `55000` "recovery is in
/// progress" for a function only a primary runs: a session still on the
/// node a switchover demoted, until the proxy moves it), or the transaction lost a
/// serialization or deadlock race (`40001`, `40P01`). A request that failed
/// so can be retried as is: nothing of it committed.
pub fn is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        // The stream ended before the server answered the TLS request: sqlx
        // reads the end of it as a 0x00 answer. A proxy with no primary to
        // send the connection to (HAProxy mid-failover) closes it so.
        sqlx::Error::Protocol(message) => message.starts_with(SSL_REQUEST_UNANSWERED),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08")
                || code.starts_with("53")
                || ["57P01", "57P02", "57P03", "25006", "40001", "40P01"].contains(&code.as_ref())
                // The class is broad; the server's words for a standby are not.
                || (code == "55000" && db.message() == RECOVERY_IN_PROGRESS)
        }),
        _ => false,
    }
}

/// Classifies a database error by its SQLSTATE class: `22` data exception,
/// `23` integrity constraint violation and `54` program limit exceeded are
/// [`ErrorClass::Deterministic`], as is a value sqlx could not encode;
/// everything else is [`ErrorClass::Transient`].
pub fn classify(error: &sqlx::Error) -> ErrorClass {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) if ["22", "23", "54"].iter().any(|c| code.starts_with(c)) => {
                ErrorClass::Deterministic
            }
            _ => ErrorClass::Transient,
        },
        sqlx::Error::Encode(_) => ErrorClass::Deterministic,
        _ => ErrorClass::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn refused() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
    }

    #[tokio::test(start_paused = true)]
    async fn an_unavailable_database_is_tried_again_until_it_answers_or_patience_ends() {
        let tries = Cell::new(0);
        let attempt = || {
            tries.set(tries.get() + 1);
            let n = tries.get();
            async move { if n < 4 { Err(refused()) } else { Ok(n) } }
        };
        assert_eq!(
            patiently(Duration::from_secs(30), attempt)
                .await
                .expect("answers"),
            4
        );

        tries.set(0);
        let always = || {
            tries.set(tries.get() + 1);
            async { Err::<(), _>(refused()) }
        };
        let started = tokio::time::Instant::now();
        let error = patiently(Duration::from_secs(5), always)
            .await
            .expect_err("never answers");
        assert!(is_unavailable(&error), "{error}");
        assert!(
            started.elapsed() <= Duration::from_secs(5),
            "within its patience"
        );
        assert!(tries.get() > 3, "tried again: {}", tries.get());

        tries.set(0);
        assert!(patiently(Duration::ZERO, always).await.is_err());
        assert_eq!(tries.get(), 1, "no patience: one try");
    }

    #[tokio::test(start_paused = true)]
    async fn any_other_error_fails_at_once() {
        let tries = Cell::new(0);
        let wrong = || {
            tries.set(tries.get() + 1);
            async { Err::<(), _>(sqlx::Error::Configuration("no such database".into())) }
        };
        assert!(patiently(Duration::from_secs(30), wrong).await.is_err());
        assert_eq!(tries.get(), 1);
    }
}
