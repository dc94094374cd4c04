//! Installs or upgrades the library's schema from the command line, as the
//! schema's owner:
//!
//! ```text
//! DATABASE_URL=postgres://owner@host/db cargo run -p effectively --example migrate -- SCHEMA
//! ```
//!
//! Prints the versions it applied and the schema's version. `--sql` prints
//! the SQL of every version for that schema instead, touching nothing (for
//! a review, or for another migration tool).

use effectively::store::Effectively;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (print, schema) = match args.as_slice() {
        [schema] => (false, schema),
        [flag, schema] if flag == "--sql" => (true, schema),
        _ => anyhow::bail!("usage: migrate [--sql] SCHEMA (DATABASE_URL names the database)"),
    };
    if print {
        // No connection is made: the pool is lazy and never used.
        let pool = sqlx::PgPool::connect_lazy("postgres://localhost/unused")?;
        for (version, name, sql) in Effectively::postgres(pool).schema(schema)?.migrations() {
            println!("-- version {version}: {name}\n{sql}");
        }
        return Ok(());
    }
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| anyhow::anyhow!("DATABASE_URL is not set: it names the database"))?;
    let pool = sqlx::PgPool::connect(&url).await?;
    let migrated = Effectively::postgres(pool)
        .schema(schema)?
        .migrate()
        .await?;
    println!(
        "schema {schema}: version {}, applied {:?}",
        migrated.version, migrated.applied
    );
    Ok(())
}
