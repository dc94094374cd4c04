//! Connection pool and the embedded migrations (`migrations/` at the repo root).

use anyhow::Context;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgPoolOptions;

use crate::config::DbArgs;

/// All migrations of the pipeline (both schemas), embedded at compile time.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// Opens a pool per `args` and, when `args.db_migrate`, applies the migrations.
pub async fn connect(args: &DbArgs) -> anyhow::Result<PgPool> {
    let pool = PgPoolOptions::new()
        .max_connections(args.db_max_connections)
        .acquire_timeout(args.acquire_timeout())
        .connect(&args.database_url)
        .await
        .context("connect to postgres (is the stack up? `make up`)")?;
    if args.db_migrate {
        MIGRATOR.run(&pool).await.context("apply migrations")?;
    }
    Ok(pool)
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
