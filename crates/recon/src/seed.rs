//! A consistent pipeline of `n` orders, for recon's tests and its benchmark
//! (`make bench-recon`, through `examples/seed.rs`): [`SEED_SQL`], then each
//! order's idempotency key with the response orders stores for it
//! ([`pipeline::contract::created_response`]: its `ETag` is a BLAKE3 hash,
//! which PostgreSQL cannot compute). It writes, as the database's owner; the
//! recon command never calls it (and its role and read-only sessions could
//! not).

use pipeline::contract::created_response;
use sqlx::PgPool;
use uuid::Uuid;

/// The seed's SQL (`src/seed.sql`), all but the keys; `:n` stands for the
/// number of orders.
pub const SEED_SQL: &str = include_str!("seed.sql");

/// Keys written per statement.
const CHUNK: u64 = 50_000;

/// Seeds `n` orders with everything the pipeline would have written for
/// them: [`SEED_SQL`], then the keys (`seed-{i}` for order `i`, whose id is
/// `i` as a UUID, as in the SQL), in order.
pub async fn seed(pool: &PgPool, n: u64) -> sqlx::Result<()> {
    sqlx::raw_sql(&SEED_SQL.replace(":n", &n.to_string()))
        .execute(pool)
        .await?;
    let mut first = 1;
    while first <= n {
        let last = n.min(first + CHUNK - 1);
        let (mut keys, mut ids, mut codes, mut headers, mut bodies) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in first..=last {
            let order_id = Uuid::from_u128(u128::from(i));
            let response = created_response(order_id);
            keys.push(format!("seed-{i}"));
            ids.push(order_id);
            codes.push(i32::from(response.status));
            headers.push(
                serde_json::to_string(&response.headers)
                    .map_err(|e| sqlx::Error::Protocol(format!("the headers as JSON: {e}")))?,
            );
            bodies.push(response.body);
        }
        sqlx::query(
            "INSERT INTO fx.idempotency_keys \
               (scope, key, request_hash, reference, response_status, response_headers, response_body) \
             SELECT '', k, '\\x00'::bytea, o::text, c::int2, h::jsonb, b \
             FROM unnest($1::text[], $2::uuid[], $3::int4[], $4::text[], $5::bytea[]) \
               WITH ORDINALITY AS u(k, o, c, h, b, n) ORDER BY n",
        )
        .bind(&keys)
        .bind(&ids)
        .bind(&codes)
        .bind(&headers)
        .bind(&bodies)
        .execute(pool)
        .await?;
        first = last + 1;
    }
    sqlx::query("ANALYZE fx.idempotency_keys")
        .execute(pool)
        .await?;
    Ok(())
}
