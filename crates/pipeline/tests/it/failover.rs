//! What a service's write meets while the PostgreSQL cluster fails over, as
//! [`pipeline::db::is_unavailable`] reads it, against the real server.
//! Right after a switchover, until the proxy moves its connections, a
//! session can still be on the demoted node, now a standby: every write
//! there fails with SQLSTATE 25006 (read_only_sql_transaction), nothing of
//! it committed. That is "the database cannot take writes now", to be
//! retried as is (orders answers 503), not an error of the request.

use pipeline::db::{ErrorClass, ServiceRole, classify, is_unavailable};
use pipeline::testing::TestDb;
use sqlx::{Connection, PgConnection};

#[tokio::test]
async fn a_write_a_standby_refuses_is_unavailable_and_retryable() {
    let db = TestDb::create().await;
    let mut conn = PgConnection::connect(&db.url_as(ServiceRole::Orders))
        .await
        .expect("connect as orders");
    // A hot standby answers every write so; a read-only session is the same
    // refusal with the same SQLSTATE on a server that can be the primary.
    sqlx::query("SET default_transaction_read_only = on")
        .execute(&mut conn)
        .await
        .expect("read-only session");
    let error = sqlx::query(
        "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
         VALUES (gen_random_uuid(), 1, 100, 'created')",
    )
    .execute(&mut conn)
    .await
    .expect_err("a read-only session refuses the write");
    let code = error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("25006"), "{error}");
    assert!(
        is_unavailable(&error),
        "a standby's refusal is retryable: {error}"
    );
    assert_eq!(classify(&error), ErrorClass::Transient);

    // A function only a primary runs, asked of a standby (the WAL relay's
    // read of its slot): the server's own error, raised here as a standby
    // raises it. The same class with other words is not.
    for (words, unavailable) in [
        ("recovery is in progress", true),
        ("cannot do that in this state", false),
    ] {
        let error = sqlx::query(&format!(
            "DO $$ BEGIN RAISE EXCEPTION '{words}' USING ERRCODE = '55000'; END $$"
        ))
        .execute(&mut conn)
        .await
        .expect_err("raised");
        assert_eq!(is_unavailable(&error), unavailable, "{error}");
    }

    // A request's own fault on the same session stays what it is.
    sqlx::query("SET default_transaction_read_only = off")
        .execute(&mut conn)
        .await
        .expect("read-write again");
    let error = sqlx::query("INSERT INTO orders.orders (order_id) VALUES (NULL)")
        .execute(&mut conn)
        .await
        .expect_err("not null");
    assert!(
        !is_unavailable(&error),
        "a constraint violation is not: {error}"
    );
    assert_eq!(classify(&error), ErrorClass::Deterministic);
}

/// HAProxy with no primary to send a connection to (mid-failover) accepts
/// it and closes it: the client's TLS request is answered by the end of the
/// stream. That is the database unreachable, not a broken server: retryable
/// (orders answered 500 to it in experiment 11 until it was).
#[tokio::test]
async fn a_connection_the_proxy_closes_before_tls_is_unavailable() {
    use sqlx::ConnectOptions;
    use sqlx::postgres::{PgConnectOptions, PgSslMode};
    use tokio::io::AsyncReadExt;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let proxy = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            // It reads what the client sent (the 8-byte SSLRequest), finds
            // no server for it, and closes.
            let mut request = [0u8; 8];
            let _ = stream.read_exact(&mut request).await;
            drop(stream);
        }
    });
    for mode in [PgSslMode::Require, PgSslMode::VerifyFull, PgSslMode::Prefer] {
        let error = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port)
            .username("orders")
            .ssl_mode(mode)
            .connect()
            .await
            .expect_err("the proxy closes every connection");
        assert!(
            is_unavailable(&error),
            "{mode:?}: a connection closed before TLS is unavailable: {error:?}"
        );
        assert_eq!(classify(&error), ErrorClass::Transient);
    }
    proxy.abort();
}
