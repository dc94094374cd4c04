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
