//! Two orders instances (the workspace's `orders` binary, twice, on one
//! fresh database) and loadgen spreading over both, over both protocols,
//! with hot keys and concurrent retries: each key's sends reach both
//! instances, and still every key has one order and every replay the first
//! answer. The database is the judge: the keys loadgen saw succeed against
//! `fx.idempotency_keys` and `orders.orders`.

use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, eventually, free_port, workspace_bin};
use tokio::process::{Child, Command};

fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// One orders process on its own ports; killed when dropped.
struct Orders {
    http: String,
    grpc: String,
    _child: Child,
}

impl Orders {
    async fn start(db: &TestDb) -> Self {
        let (http, grpc, metrics) = (free_addr(), free_addr(), free_addr());
        let child = Command::new(workspace_bin("orders"))
            .env("DATABASE_URL", db.url_as(ServiceRole::Orders))
            .env("ORDERS_HTTP_ADDR", &http)
            .env("ORDERS_GRPC_ADDR", &grpc)
            .env("ORDERS_METRICS_ADDR", &metrics)
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
        Self {
            http: format!("http://{http}"),
            grpc: format!("http://{grpc}"),
            _child: child,
        }
    }
}

#[tokio::test]
async fn one_keys_sends_spread_over_two_instances_make_one_order() {
    let db = TestDb::create().await;
    let instances = [Orders::start(&db).await, Orders::start(&db).await];
    let http: Vec<&str> = instances.iter().map(|o| o.http.as_str()).collect();
    let grpc: Vec<&str> = instances.iter().map(|o| o.grpc.as_str()).collect();
    let dir = std::env::temp_dir().join(format!("loadgen-spread-{}", db.name));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (json, intents) = (dir.join("run.json"), dir.join("intents.txt"));

    // 400 intents over 60 keys, half of them retried (half of those at the
    // same instant): a hot key is in flight on both instances at once.
    let out = Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(["--http-url", &http.join(","), "--grpc-url", &grpc.join(",")])
        .args(["--protocol", "mixed", "--spread", "random", "--seed", "7"])
        .args(["--rate", "200", "--duration", "2", "--zipf-s", "1.1"])
        .args([
            "--keys",
            "60",
            "--retry-rate",
            "0.5",
            "--retry-delay-ms",
            "50",
        ])
        .args(["--progress", "off", "--key-prefix", "spread"])
        .arg("--json")
        .arg(&json)
        .arg("--intents")
        .arg(&intents)
        .output()
        .await
        .expect("run loadgen");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "loadgen: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("instances   "), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("json");
    let targets = report["targets"].as_array().expect("targets");
    assert_eq!(
        targets.len(),
        4,
        "two instances, two protocols: {targets:?}"
    );
    for t in targets {
        assert!(t["ok"].as_u64() > Some(0), "every instance answered: {t}");
    }
    let sent: u64 = targets.iter().filter_map(|t| t["sent"].as_u64()).sum();
    assert_eq!(Some(sent), report["sends"]["sent"].as_u64());
    let replay = &report["replay"];
    assert_eq!(replay["mismatches"], 0, "{replay}");
    assert!(replay["compared"].as_u64() > Some(100), "{replay}");
    assert!(replay["cross_protocol"].as_u64() > Some(0), "{replay}");

    // The database agrees with what the client saw: one order per key that
    // succeeded, the one it was told; 0 or 1 per key whose fate it could not
    // know (a timeout on a loaded machine, a 408 or 5xx); none for any other.
    let seen: Vec<(String, uuid::Uuid)> = std::fs::read_to_string(&intents)
        .expect("intents")
        .lines()
        .map(|l| {
            let (k, id) = l.split_once('\t').expect("key<TAB>id");
            (k.to_owned(), id.parse().expect("uuid"))
        })
        .collect();
    let succeeded = report["keys"]["succeeded"].as_u64().expect("succeeded");
    assert_eq!(seen.len() as u64, succeeded);
    assert!(
        seen.len() >= 40,
        "most of the 60 keys were drawn: {}",
        seen.len()
    );
    let pool = sqlx::PgPool::connect(&db.url).await.expect("connect");
    let (keys, orders): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM fx.idempotency_keys),
                (SELECT count(*) FROM orders.orders)",
    )
    .fetch_one(&pool)
    .await
    .expect("counts");
    let mut ambiguous_file = intents.clone().into_os_string();
    ambiguous_file.push(".ambiguous");
    let ambiguous: Vec<String> = std::fs::read_to_string(&ambiguous_file)
        .expect("ambiguous keys")
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(keys, orders, "one order per key row");
    assert!(
        (seen.len()..=seen.len() + ambiguous.len()).contains(&(keys as usize)),
        "{keys} keys for {} successes and {} ambiguous",
        seen.len(),
        ambiguous.len()
    );
    let (names, ids): (Vec<String>, Vec<uuid::Uuid>) = seen.into_iter().unzip();
    let unexplained: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fx.idempotency_keys
         WHERE key <> ALL($1::text[]) AND key <> ALL($2::text[])",
    )
    .bind(&names)
    .bind(&ambiguous)
    .fetch_one(&pool)
    .await
    .expect("unexplained keys");
    assert_eq!(
        unexplained, 0,
        "every key row is a success or an ambiguous key"
    );
    let matched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::text[], $2::uuid[]) AS c(key, id)
         JOIN fx.idempotency_keys k ON k.key = c.key AND k.reference = c.id::text
         JOIN orders.orders o ON o.order_id = c.id",
    )
    .bind(&names)
    .bind(&ids)
    .fetch_one(&pool)
    .await
    .expect("matched");
    assert_eq!(
        matched,
        names.len() as i64,
        "every key that succeeded has the order the client was told"
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
