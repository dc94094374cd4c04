//! Seeds a consistent pipeline of N orders into a migrated database, as
//! recon's tests do ([`recon::seed::seed`]): `make bench-recon`'s seed.
//!
//! `cargo run --release -p recon --example seed -- DATABASE_URL N` (the
//! owner's URL: it writes).

use anyhow::Context;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(n)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: seed DATABASE_URL N");
    };
    let n: u64 = n.parse().context("N: a number of orders")?;
    let pool = sqlx::PgPool::connect(&url)
        .await
        .context("connect to postgres")?;
    recon::seed::seed(&pool, n).await.context("seed")?;
    Ok(())
}
