//! `recon --intents` against what the real loadgen wrote, with the real
//! orders: a key orders answered 408 for and committed all the same is
//! ambiguous (0 or 1 order), not drift; a key the client was refused that
//! has an order is drift; two authenticated callers sending the same keys
//! make two intents of each, each checked in its caller's scope.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, eventually, free_port, workspace_bin};
use sqlx::PgPool;
use tokio::process::{Child, Command};

/// One orders process on a fresh port, its routes giving up after
/// `request_timeout_ms`; killed when dropped.
async fn start_orders(db: &TestDb, request_timeout_ms: u64) -> (String, Child) {
    start_orders_with(db, request_timeout_ms, None).await
}

/// [`start_orders`], with `--auth-tokens-file tokens` when given.
async fn start_orders_with(
    db: &TestDb,
    request_timeout_ms: u64,
    tokens: Option<&Path>,
) -> (String, Child) {
    let (http, grpc) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let mut orders = Command::new(workspace_bin("orders"));
    if let Some(tokens) = tokens {
        orders.env("ORDERS_AUTH_TOKENS_FILE", tokens);
    }
    let child = orders
        .env("DATABASE_URL", db.url_as(ServiceRole::Orders))
        .env("ORDERS_HTTP_ADDR", &http)
        .env("ORDERS_GRPC_ADDR", &grpc)
        .env("ORDERS_METRICS_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("ORDERS_REQUEST_TIMEOUT_MS", request_timeout_ms.to_string())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn orders");
    let up = eventually(Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(&http).await.is_ok()
    })
    .await;
    assert!(up, "orders at {http} came up");
    (format!("http://{http}"), child)
}

/// A scratch directory of the test's own.
fn scratch(db: &TestDb) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("recon-intents-{}", db.name));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Whether `key` has its key row (and so its order: one transaction).
async fn committed(pool: &PgPool, key: &str) -> bool {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM fx.idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .is_ok_and(|n| n == 1)
}

fn report(json: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(json).expect("loadgen report")).expect("json")
}

#[tokio::test]
async fn a_key_answered_408_and_committed_is_ambiguous_not_drift() {
    let db = TestDb::create().await;
    // The route gives up after 300 ms; the writer does not.
    let (http, _orders) = start_orders(&db, 300).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let dir = scratch(&db);
    let (json, intents) = (dir.join("run.json"), dir.join("intents.txt"));

    // Hold the key table against writes: the writer takes the create into a
    // batch and its INSERT waits, past the route's timeout.
    let mut hold = pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE fx.idempotency_keys IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .expect("lock the key table");
    // One intent (rate 1 for 1 s), no retry of any kind, a client timeout
    // far beyond the route's: the answer it gets is the route's 408.
    let loadgen = Command::new(workspace_bin("loadgen"))
        .args(["--http-url", &http, "--protocol", "http"])
        .args(["--rate", "1", "--duration", "1", "--zipf-s", "0"])
        .args(["--retry-rate", "0", "--retry-on-error", "0"])
        .args([
            "--timeout-ms",
            "20000",
            "--key-prefix",
            "late",
            "--seed",
            "1",
        ])
        .args(["--progress", "off"])
        .arg("--json")
        .arg(&json)
        .arg("--intents")
        .arg(&intents)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn loadgen");
    let waiting = eventually(Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks
             WHERE NOT granted AND relation = 'fx.idempotency_keys'::regclass
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&pool)
        .await
        .is_ok_and(|n| n > 0)
    })
    .await;
    assert!(waiting, "the writer's INSERT waits on the held key table");
    let out = loadgen.wait_with_output().await.expect("run loadgen");
    // The answer is out; now let the batch commit.
    hold.commit().await.expect("release the key table");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "loadgen: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let run = report(&json);
    assert_eq!(run["http_status"]["408"], 1, "{stdout}");
    assert!(
        eventually(Duration::from_secs(30), || committed(&pool, "late-1")).await,
        "orders committed the create it answered 408"
    );

    // loadgen files the key as ambiguous: the 408 may hide a commit.
    assert_eq!(run["keys"]["succeeded"], 0, "{stdout}");
    assert_eq!(run["keys"]["ambiguous"], 1, "{stdout}");
    assert_eq!(run["keys"]["failed"], 0, "{stdout}");
    let mut ambiguous = intents.clone().into_os_string();
    ambiguous.push(".ambiguous");
    assert_eq!(
        std::fs::read_to_string(&ambiguous).expect("ambiguous file"),
        "late-1\n"
    );

    // recon: the key's order is one an ambiguous key may have, not drift.
    let client = recon::cli::read_intents(&intents).expect("read intents");
    let checked = recon::check_intents(&pool, &client)
        .await
        .expect("check intents");
    assert!(checked.is_clean(), "{}", checked.table());
    assert_eq!(
        (
            checked.client_succeeded,
            checked.client_ambiguous,
            checked.ambiguous_committed,
            checked.client_failed
        ),
        (0, 1, 1, 0),
        "{}",
        checked.table()
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_refused_key_that_has_an_order_is_drift() {
    let db = TestDb::create().await;
    let (http, _orders) = start_orders(&db, 30_000).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // Two orders, keys `ok-1` and `refused-1`.
    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for (key, amount) in [("ok-1", 100), ("refused-1", 200)] {
        let resp = client
            .post(format!("{http}/orders"))
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(format!(r#"{{"account_id": 7, "amount_cents": {amount}}}"#))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 201);
        let body: serde_json::Value = resp.json().await.expect("json");
        ids.push(body["order_id"].as_str().expect("order_id").to_owned());
    }

    // The files as loadgen writes them, for a client that saw `ok-1`
    // succeed, never learnt the fate of `lost-1` (ambiguous, no order: fine)
    // and was refused `refused-1` and `never-1` (`refused-1` has an order
    // all the same: drift).
    let dir = scratch(&db);
    let intents = dir.join("intents.txt");
    std::fs::write(&intents, format!("ok-1\t{}\n", ids[0])).expect("write intents");
    std::fs::write(dir.join("intents.txt.ambiguous"), "lost-1\n").expect("write ambiguous");
    std::fs::write(dir.join("intents.txt.failed"), "never-1\nrefused-1\n").expect("write failed");
    let client = recon::cli::read_intents(&intents).expect("read intents");
    let checked = recon::check_intents(&pool, &client)
        .await
        .expect("check intents");
    assert!(!checked.is_clean(), "{}", checked.table());
    assert_eq!(
        (
            checked.matched,
            checked.client_ambiguous,
            checked.ambiguous_committed,
            checked.client_failed,
            checked.failed_committed
        ),
        (1, 1, 0, 2, 1),
        "{}",
        checked.table()
    );
    assert!(checked.table().contains("DRIFT"), "{}", checked.table());

    // Without the refused key that has an order, clean again.
    std::fs::write(dir.join("intents.txt.failed"), "never-1\n").expect("write failed");
    let client = recon::cli::read_intents(&intents).expect("read intents");
    let checked = recon::check_intents(&pool, &client)
        .await
        .expect("check intents");
    assert!(checked.is_clean(), "{}", checked.table());
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `orders new-token CALLER --append-to tokens`: the token, in a file of its
/// own (0600) for loadgen.
async fn mint(tokens: &Path, caller: &str, dir: &Path) -> PathBuf {
    let out = Command::new(workspace_bin("orders"))
        .args(["new-token", caller, "--append-to"])
        .arg(tokens)
        .output()
        .await
        .expect("run orders new-token");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).expect("utf-8");
    assert!(token.starts_with(&format!("{caller}.")), "{token}");
    let file = dir.join(format!("{caller}.token"));
    std::fs::write(&file, token).expect("write token");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let mode = std::fs::metadata(tokens)
            .expect("tokens")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "new-token makes the tokens file 0600");
    }
    file
}

/// One loadgen run against `http`: 40 intents, retries of a third of them,
/// keys `same-1..`, with `token` when given; its output.
async fn send_as(http: &str, token: Option<&Path>, intents: &Path) -> std::process::Output {
    let mut loadgen = Command::new(workspace_bin("loadgen"));
    if let Some(token) = token {
        loadgen.arg("--token-file").arg(token);
    }
    loadgen
        .args(["--http-url", http, "--protocol", "http"])
        .args(["--rate", "40", "--duration", "1", "--zipf-s", "0"])
        .args(["--retry-rate", "0.3", "--key-prefix", "same", "--seed", "7"])
        .args(["--progress", "off"])
        .arg("--intents")
        .arg(intents)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output()
        .await
        .expect("run loadgen")
}

#[tokio::test]
async fn two_callers_with_the_same_keys_are_two_intents_each_checked_in_its_scope() {
    let db = TestDb::create().await;
    let dir = scratch(&db);
    let tokens = dir.join("tokens");
    let shop = mint(&tokens, "shop", &dir).await;
    let billing = mint(&tokens, "billing", &dir).await;
    let (http, _orders) = start_orders_with(&db, 30_000, Some(&tokens)).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");

    // No token: loadgen's probe is refused (401), and it says so.
    let anonymous = send_as(&http, None, &dir.join("anonymous.txt")).await;
    assert!(!anonymous.status.success());
    let stderr = String::from_utf8_lossy(&anonymous.stderr);
    assert!(stderr.contains("401"), "{stderr}");

    // The same keys and bodies from two callers.
    let mut checked = Vec::new();
    for (caller, token) in [("shop", &shop), ("billing", &billing)] {
        let intents = dir.join(format!("{caller}.txt"));
        let out = send_as(&http, Some(token), &intents).await;
        assert!(
            out.status.success(),
            "{caller}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(&intents).expect("intents");
        assert!(
            text.lines().all(|l| l.ends_with(&format!("\t{caller}"))),
            "every line names its caller:\n{text}"
        );
        let client = recon::cli::read_intents(&intents).expect("read intents");
        let report = recon::check_intents(&pool, &client)
            .await
            .expect("check intents");
        assert!(report.is_clean(), "{caller}:\n{}", report.table());
        assert!(report.matched >= 30, "{}", report.table());
        checked.push((client, report));
    }
    // Two intents per key: two key rows, two orders.
    let (keys, scopes, orders): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT scope),
                (SELECT count(*) FROM orders.orders)
         FROM fx.idempotency_keys WHERE key LIKE 'same-%'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    let succeeded = checked[0].1.matched + checked[1].1.matched;
    assert_eq!(scopes, 2);
    assert_eq!(keys, orders, "one order per key row");
    assert!(
        keys >= succeeded,
        "{keys} key rows for {succeeded} successes"
    );

    // One caller's successes read in the other's scope: every one of them
    // maps to another order. The scope is what tells them apart.
    let mut crossed = checked[0].0.clone();
    for (key, _) in &mut crossed.succeeded {
        key.scope = "billing".into();
    }
    let wrong = recon::check_intents(&pool, &crossed)
        .await
        .expect("check intents");
    assert!(!wrong.is_clean());
    assert!(wrong.wrong_order > 0, "{}", wrong.table());
    assert_eq!(
        wrong.wrong_order + wrong.missing_in_db,
        checked[0].1.matched,
        "{}",
        wrong.table()
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
