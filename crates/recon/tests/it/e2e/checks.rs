//! recon's checks on a seeded database: each corruption is drift and named,
//! the binary exits 1 naming it, the ranges add up to the whole, and a late
//! duplicate dead letter is reported, not drift.

use pipeline::db::ServiceRole;
use pipeline::testing::workspace_bin as bin;
use recon::Policy;

use super::seeded;

/// Each corruption, applied alone to a clean database, is drift and is named.
#[tokio::test]
async fn every_per_order_check_catches_its_corruption() {
    let (_db, pool) = seeded(50).await;
    let mut conn = pool.acquire().await.expect("connect");
    let clean = recon::reconcile(&mut conn).await.expect("recon");
    assert!(
        clean.is_clean(Policy::default()),
        "the seed is clean:\n{}",
        clean.table(Policy::default())
    );
    assert_eq!(clean.distinct_orders, 50);

    let o = |i: u32| format!("'{:032x}'::uuid", i);
    let cases: Vec<(String, &str)> = vec![
        // Sums stay equal: only a per-order comparison sees these.
        (
            format!(
                "UPDATE payments.charges SET amount_cents = CASE WHEN order_id = {a} THEN (SELECT amount_cents FROM payments.charges WHERE order_id = {b}) ELSE (SELECT amount_cents FROM payments.charges WHERE order_id = {a}) END WHERE order_id IN ({a}, {b})",
                a = o(1),
                b = o(2)
            ),
            "charge_mismatches",
        ),
        (
            format!(
                "UPDATE payments.ledger SET amount_cents = CASE WHEN order_id = {a} THEN (SELECT amount_cents FROM payments.ledger WHERE order_id = {b}) ELSE (SELECT amount_cents FROM payments.ledger WHERE order_id = {a}) END WHERE order_id IN ({a}, {b})",
                a = o(3),
                b = o(4)
            ),
            "effect_mismatches",
        ),
        (
            format!(
                "UPDATE payments.charges SET account_id = account_id + 1 WHERE order_id = {}",
                o(5)
            ),
            "charge_mismatches",
        ),
        (
            format!(
                "UPDATE payments.ledger SET account_id = account_id + 1 WHERE order_id = {}",
                o(6)
            ),
            "effect_mismatches",
        ),
        (
            format!(
                "UPDATE payments.charges SET msg_id = (SELECT msg_id FROM orders.outbox WHERE aggregate_id = {}) WHERE order_id = {}",
                o(8),
                o(7)
            ),
            "charges_by_another_event",
        ),
        (
            format!(
                "UPDATE orders.outbox SET payload = convert_to(replace(convert_from(payload, 'UTF8'), '\"amount_cents\":', '\"amount_cents\":9'), 'UTF8') WHERE aggregate_id = {}",
                o(9)
            ),
            "event_payload_mismatches",
        ),
        (
            format!("DELETE FROM fx.idempotency_keys WHERE effectively.uuid_of(reference) = {}", o(10)),
            "orders_without_key",
        ),
        (
            format!(
                "INSERT INTO fx.idempotency_keys (scope, key, request_hash, reference, response_status, response_headers, response_body) SELECT scope, 'another-key', request_hash, reference, response_status, response_headers, response_body FROM fx.idempotency_keys WHERE effectively.uuid_of(reference) = {}",
                o(11)
            ),
            "orders_with_many_keys",
        ),
        (
            format!(
                "UPDATE fx.idempotency_keys SET response_body = (SELECT response_body FROM fx.idempotency_keys WHERE effectively.uuid_of(reference) = {}) WHERE effectively.uuid_of(reference) = {}",
                o(13),
                o(12)
            ),
            "responses_naming_another_order",
        ),
        (
            format!(
                "UPDATE fx.idempotency_keys SET reference = ({})::text WHERE effectively.uuid_of(reference) = {}",
                o(999),
                o(14)
            ),
            "intents_without_order",
        ),
        (
            format!(
                "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) SELECT account_id, order_id, msg_id, amount_cents FROM payments.ledger WHERE order_id = {}",
                o(15)
            ),
            "double_charges",
        ),
        (
            format!("DELETE FROM payments.ledger WHERE order_id = {}", o(16)),
            "charges_without_effect",
        ),
        (
            format!("DELETE FROM payments.charges WHERE order_id = {}", o(17)),
            "orders_without_charge",
        ),
        (
            format!("DELETE FROM orders.outbox WHERE aggregate_id = {}", o(18)),
            "orders_without_event",
        ),
        (
            format!(
                "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) VALUES ({}, gen_random_uuid(), 'order.created', '{{}}', now())",
                o(19)
            ),
            "orders_with_many_events",
        ),
        (
            format!(
                "DELETE FROM fx.partitioned_inbox WHERE consumer = 'payments' AND msg_id = (SELECT msg_id FROM orders.outbox WHERE aggregate_id = {})",
                o(20)
            ),
            "events_not_consumed",
        ),
        (
            "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('payments', effectively.v7_floor(now()), '')".to_owned(),
            "inbox_without_event",
        ),
        (
            format!(
                "UPDATE orders.outbox SET published_at = NULL, failed_at = now(), attempts = 5, last_error = 'too large' WHERE aggregate_id = {}",
                o(21)
            ),
            "failed_rows",
        ),
        (
            "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind) VALUES ('t', 0, 1, 'bad', 'undecodable')".to_owned(),
            "dead_letters - late_duplicates",
        ),
        // Refused after the horizon, and its order has no charge by it: a
        // first delivery that came too late, an effect lost until applied
        // by hand.
        (
            format!(
                "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind, msg_id, order_id) \
                 VALUES ('t', 0, 2, 'late', 'after_horizon', gen_random_uuid(), {})",
                o(22)
            ),
            "dead_letters - late_duplicates",
        ),
        // Over HTTP: a delivery the sender gave up, one still open, and a
        // webhook claimed but not applied.
        (
            format!(
                "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body, failed_at) \
                 SELECT 'd', id, aggregate_id, msg_id, payload, now() FROM orders.outbox WHERE aggregate_id = {}",
                o(23)
            ),
            "failed_deliveries",
        ),
        (
            format!(
                "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
                 SELECT 'd', id, aggregate_id, msg_id, payload FROM orders.outbox WHERE aggregate_id = {}",
                o(24)
            ),
            "open_deliveries",
        ),
        (
            "INSERT INTO payments.webhook_inbox (msg_id, payload, payload_hash) \
             VALUES (effectively.v7_floor(now()), '\\x00', 0)"
                .to_owned(),
            "unprocessed_webhooks",
        ),
    ];
    for (sql, check) in cases {
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query(&sql).execute(&mut *tx).await.expect(&sql);
        let report = recon::reconcile(&mut tx).await.expect("recon");
        let drift = report.drift(Policy::default());
        assert!(
            drift.contains(&check),
            "{check} not named after `{sql}`; drift: {drift:?}\n{}",
            report.table(Policy::default())
        );
        if matches!(
            check,
            "failed_rows" | "dead_letters - late_duplicates" | "failed_deliveries"
        ) {
            let allowed = Policy {
                allow_dead_letters: true,
                ..Policy::default()
            };
            assert!(
                !report.drift(allowed).contains(&check),
                "--allow-dead-letters reports {check} without calling it drift"
            );
        }
        tx.rollback().await.expect("rollback");
    }
}

/// Each key's stored response, replayed verbatim to a retry, must be the
/// one orders stores for the key's own order: status 201, a `Location`
/// naming that order, and the `ETag` orders computes for it. Each
/// corruption alone, committed, is drift named alone, and the binary exits
/// 1 naming it.
#[tokio::test]
async fn a_stored_response_with_another_status_location_or_etag_is_drift() {
    // The header `name` of order `from`'s stored response set to `value`,
    // in place (the other headers and their order kept).
    let set_header = |name: &str, from: u32, value: &str| {
        format!(
            "UPDATE fx.idempotency_keys SET response_headers = \
               (SELECT jsonb_agg(CASE WHEN h->>0 = '{name}' THEN jsonb_build_array('{name}', {value}) ELSE h END ORDER BY n) \
                FROM jsonb_array_elements(response_headers) WITH ORDINALITY AS x(h, n)) \
             WHERE effectively.uuid_of(reference) = '{from:032x}'::uuid"
        )
    };
    let cases = [
        (
            "UPDATE fx.idempotency_keys SET response_status = 500 \
             WHERE effectively.uuid_of(reference) = '00000000000000000000000000000003'::uuid"
                .to_owned(),
            "responses_with_wrong_status",
        ),
        (
            // Another order's Location.
            set_header(
                "location",
                4,
                "'/orders/' || '00000000000000000000000000000005'::uuid",
            ),
            "responses_with_wrong_location",
        ),
        (
            // Another order's ETag: well formed, not this order's.
            set_header(
                "etag",
                6,
                "(SELECT e.pair->>1 FROM fx.idempotency_keys k, jsonb_array_elements(k.response_headers) AS e(pair) \
                  WHERE effectively.uuid_of(k.reference) = '00000000000000000000000000000007'::uuid AND e.pair->>0 = 'etag')",
            ),
            "responses_with_wrong_etag",
        ),
    ];
    // Every case runs; the failures are reported together.
    let mut wrong = Vec::new();
    for (sql, check) in cases {
        let (db, pool) = seeded(10).await;
        let changed = sqlx::query(&sql)
            .execute(&pool)
            .await
            .expect(&sql)
            .rows_affected();
        assert_eq!(changed, 1, "{sql}");
        let mut conn = pool.acquire().await.expect("connect");
        let report = recon::reconcile(&mut conn).await.expect("recon");
        let drift = report.drift(Policy::default());
        if drift != [check] {
            wrong.push(format!("{check}: drift {drift:?} after `{sql}`"));
        }
        let out = std::process::Command::new(bin("recon"))
            .env("DATABASE_URL", db.url_as(ServiceRole::Recon))
            .env("RUST_LOG", "error")
            .output()
            .expect("run recon");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let named = format!("DRIFT — effects != intents ({check})");
        if out.status.code() != Some(1) || !stdout.contains(&named) {
            wrong.push(format!(
                "{check}: the binary exited {:?} without `{named}`",
                out.status.code()
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The binary: exit 0 on the clean seed; exit 1 naming the check once two
/// orders' charged amounts are swapped (the sums still agree).
#[tokio::test]
async fn the_recon_binary_exits_one_and_names_the_check() {
    let (db, pool) = seeded(20).await;
    let run = || {
        std::process::Command::new(bin("recon"))
            .env("DATABASE_URL", db.url_as(ServiceRole::Recon))
            .env("RUST_LOG", "error")
            .output()
            .expect("run recon")
    };
    let out = run();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    sqlx::query(
        "UPDATE payments.charges c SET amount_cents = s.amount_cents \
         FROM (SELECT order_id, CASE WHEN order_id = '00000000000000000000000000000001'::uuid \
                 THEN (SELECT amount_cents FROM payments.charges WHERE order_id = '00000000000000000000000000000002'::uuid) \
                 ELSE (SELECT amount_cents FROM payments.charges WHERE order_id = '00000000000000000000000000000001'::uuid) END AS amount_cents \
               FROM payments.charges WHERE order_id IN ('00000000000000000000000000000001'::uuid, '00000000000000000000000000000002'::uuid)) s \
         WHERE c.order_id = s.order_id",
    )
    .execute(&pool)
    .await
    .expect("swap");
    let out = run();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("DRIFT — effects != intents (charge_mismatches"),
        "{stdout}"
    );
}

/// The diff in order-id ranges side by side (one shared snapshot) adds up
/// to the diff as one statement, whatever the number of ranges, with drift
/// in the middle of the ids and orphans beyond both ends of the orders'
/// ids (which only the first and last range reach).
#[tokio::test]
async fn the_ranges_add_up_to_the_whole() {
    let (_db, pool) = seeded(300).await;
    for sql in [
        // An orphan charge, ledger entry and key above the largest order id.
        "INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
         VALUES (gen_random_uuid(), 'ffffffff-0000-0000-0000-000000000000', gen_random_uuid(), 1, 5)",
        "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         VALUES (1, 'ffffffff-0000-0000-0000-000000000000', gen_random_uuid(), 5)",
        "UPDATE fx.idempotency_keys SET reference = 'fffffffe-0000-0000-0000-000000000000' \
         WHERE effectively.uuid_of(reference) = '00000000000000000000000000000007'::uuid",
        // An orphan event below the smallest.
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) \
         VALUES ('00000000-0000-0000-0000-000000000000', gen_random_uuid(), 'order.created', '{}', now())",
        // Drift in the middle.
        "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         SELECT account_id, order_id, msg_id, amount_cents FROM payments.ledger \
         WHERE order_id = '00000000000000000000000000000096'::uuid",
        "UPDATE payments.charges SET account_id = account_id + 1 \
         WHERE order_id = '000000000000000000000000000000c8'::uuid",
        "UPDATE fx.idempotency_keys SET response_status = 500 \
         WHERE effectively.uuid_of(reference) = '000000000000000000000000000000c9'::uuid",
        "DELETE FROM fx.partitioned_inbox WHERE consumer = 'payments' AND msg_id = \
         (SELECT msg_id FROM orders.outbox WHERE aggregate_id = '00000000000000000000000000000064'::uuid)",
        // (above every msg_id, inside the inbox's oldest partition: 2004)
        "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) \
         VALUES ('payments', '00ffffff-ffff-ffff-ffff-ffffffffffff', '')",
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind) \
         VALUES ('t', 0, 1, 'bad', 'undecodable')",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let mut conn = pool.acquire().await.expect("connect");
    let whole = recon::reconcile(&mut conn).await.expect("recon");
    drop(conn);
    assert_eq!(whole.charges_without_order, 1);
    assert_eq!(whole.effects_without_order, 1);
    assert_eq!(whole.intents_without_order, 1);
    assert_eq!(whole.events_without_order, 1);
    assert_eq!(whole.double_charges, 1);
    assert_eq!(whole.charge_mismatches, 1);
    assert_eq!(
        whole.events_not_consumed, 2,
        "the deleted one and the orphan"
    );
    assert_eq!(whole.inbox_without_event, 1);
    assert_eq!(whole.dead_letters, 1);
    assert_eq!(whole.responses_with_wrong_status, 1);
    assert_eq!(
        (
            whole.responses_with_wrong_location,
            whole.responses_with_wrong_etag
        ),
        (1, 1),
        "the key moved to another order id kept the first order's response"
    );
    for jobs in 1..=7 {
        let parts = recon::reconcile_in_parts(&pool, jobs).await.expect("recon");
        assert_eq!(parts, whole, "--jobs {jobs}");
    }
}

/// A dead letter refused after the dedup horizon whose msg_id is the one
/// that charged the order it names is a late duplicate: reported, not drift.
#[tokio::test]
async fn a_late_duplicate_dead_letter_is_reported_not_drift() {
    let (_db, pool) = seeded(10).await;
    sqlx::query(
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind, msg_id, order_id) \
         SELECT 't', 0, row_number() OVER (ORDER BY order_id), 'late', 'after_horizon', msg_id, order_id \
         FROM payments.charges ORDER BY order_id LIMIT 3",
    )
    .execute(&pool)
    .await
    .expect("late duplicates");
    let mut conn = pool.acquire().await.expect("connect");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!((report.dead_letters, report.late_duplicates), (3, 3));
    assert!(
        report.is_clean(Policy::default()),
        "{}",
        report.table(Policy::default())
    );
    assert!(report.table(Policy::default()).contains("late duplicates"));
    // The same kind naming another msg_id than the charge's is drift.
    sqlx::query(
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind, msg_id, order_id) \
         SELECT 't', 0, 4, 'late', 'after_horizon', gen_random_uuid(), order_id FROM payments.charges \
         ORDER BY order_id LIMIT 1",
    )
    .execute(&pool)
    .await
    .expect("late first delivery");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!((report.dead_letters, report.late_duplicates), (4, 3));
    assert_eq!(
        report.drift(Policy::default()),
        ["dead_letters - late_duplicates"]
    );
}
