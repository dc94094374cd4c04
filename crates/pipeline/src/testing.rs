//! Test support (feature `testing`): a fresh database per test on the real
//! PostgreSQL that `make up` started. No mocks: tests run against the stack.

use std::path::{Path, PathBuf};

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::db::ServiceRole;

/// A free TCP port on 127.0.0.1 for a child process to listen on: the
/// system picks it, and it is released before the child binds it.
///
/// # Panics
/// When no port can be bound.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

/// A binary of the workspace, built beside the running test binary
/// (`target/<profile>/deps/<test>-<hash>` → `target/<profile>/<name>`).
///
/// # Panics
/// When it is not there: the workspace's binaries were not built.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} missing: build the workspace first (`cargo build --workspace`)",
        path.display()
    );
    path
}

/// Reads `NAME` from the environment, or else from the stack env file
/// (`.stack/env` at the workspace root) written by `scripts/stack.sh up`.
///
/// # Panics
/// When neither has it: the stack is not up.
pub fn stack_var(name: &str) -> String {
    stack_var_opt(name).unwrap_or_else(|| {
        panic!(
            "{name} is not set and not in {}: start the stack with `make up`",
            stack_env_file().display()
        )
    })
}

/// [`stack_var`], `None` when neither has it.
pub fn stack_var_opt(name: &str) -> Option<String> {
    if let Ok(value) = std::env::var(name) {
        return Some(value);
    }
    let text = std::fs::read_to_string(stack_env_file()).unwrap_or_default();
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("export "))
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

fn stack_env_file() -> PathBuf {
    if let Ok(dir) = std::env::var("STACK_DIR") {
        return Path::new(&dir).join("env");
    }
    // crates/<name> → workspace root
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.stack/env")
}

/// A database created for one test, with the migrations applied.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// Its name.
    pub name: String,
    /// Its connection URL as the owner (the stack's superuser), for a test's
    /// own setup and checks. The services get [`TestDb::url_as`].
    pub url: String,
}

impl TestDb {
    /// Creates `test_<uuid>` on the stack's server and applies the
    /// pipeline's migrations.
    ///
    /// # Panics
    /// When the stack is down or the database cannot be created.
    pub async fn create() -> Self {
        let db = Self::empty().await;
        let pool = sqlx::PgPool::connect(&db.url)
            .await
            .expect("connect test db");
        crate::db::migrate(&pool).await.expect("migrate test db");
        pool.close().await;
        db
    }

    /// Creates `test_<uuid>` on the stack's server, empty: a database of a
    /// service that is not this project's (the library's own tests).
    ///
    /// # Panics
    /// When the stack is down or the database cannot be created.
    pub async fn empty() -> Self {
        require_libpq_env();
        let admin = stack_var("STACK_ADMIN_DATABASE_URL");
        let name = format!("test_{}", Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("connect to {admin}: {e} (is the stack up? `make up`)"));
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut conn)
            .await
            .expect("create test database");
        let _ = conn.close().await;
        let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
        let url = format!("{base}/{name}");
        Self { name, url }
    }

    /// This database's URL as `role`: the stack's URL for the role
    /// (`ORDERS_DATABASE_URL`, ...; compose's carry passwords, the embedded
    /// stack's password file has them) with this database, or, for a stack
    /// env file that has none, the owner's URL with the role's name as the
    /// user and no password (the password file's).
    pub fn url_as(&self, role: ServiceRole) -> String {
        match stack_var_opt(role.url_var()) {
            Some(url) => with_database(&url, &self.name),
            None => with_user(&self.url, role.name()),
        }
    }
}

/// The stack's passwords and CA reach every connection (sqlx's and the
/// services' the tests start) through libpq's environment (`PGPASSFILE`,
/// `PGSSLMODE`, `PGSSLROOTCERT`), which only the process's own environment
/// can give: a test run outside `make test` without `. .stack/env` would
/// fail to sign in, and says so here instead.
fn require_libpq_env() {
    for name in ["PGPASSFILE", "PGSSLMODE", "PGSSLROOTCERT"] {
        if std::env::var_os(name).is_none() && stack_var_opt(name).is_some() {
            panic!(
                "{name} is in {} but not in this process's environment: run the tests with \
                 `make test`, or `set -a; . .stack/env; set +a` first",
                stack_env_file().display()
            );
        }
    }
}

/// `url` with its path (the database) replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let base = url.rsplit_once('/').map_or(url, |(b, _)| b);
    format!("{base}/{database}")
}

/// `url` with its user info replaced by `user` (no password).
fn with_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{user}@{host}{path}")
}

/// One message read back from a topic.
#[cfg(feature = "kafka")]
#[derive(Debug, Clone)]
pub struct TopicMessage {
    /// Partition.
    pub partition: i32,
    /// Key bytes.
    pub key: Option<Vec<u8>>,
    /// Value bytes.
    pub value: Option<Vec<u8>>,
    /// Headers, in order (a header without a value has an empty one).
    pub headers: Vec<(String, Vec<u8>)>,
}

/// A topic created for one test on the stack's broker (feature `kafka`).
#[cfg(feature = "kafka")]
#[derive(Debug, Clone)]
pub struct TestTopic {
    /// Its name.
    pub name: String,
    /// The broker.
    pub bootstrap_servers: String,
}

/// A principal of the stack's Kafka cluster, each with its client config
/// file (TLS, SASL) in the stack's env file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaPrincipal {
    /// The tools' (a super user): `KAFKA_CLIENT_CONFIG`.
    Admin,
    /// The relay's (writes the `order.events` topics): `RELAY_KAFKA_CLIENT_CONFIG`.
    Relay,
    /// Payments' (reads them, in its groups): `PAYMENTS_KAFKA_CLIENT_CONFIG`.
    Payments,
}

impl KafkaPrincipal {
    /// The env file's variable naming its client config file.
    pub fn variable(self) -> &'static str {
        match self {
            Self::Admin => "KAFKA_CLIENT_CONFIG",
            Self::Relay => "RELAY_KAFKA_CLIENT_CONFIG",
            Self::Payments => "PAYMENTS_KAFKA_CLIENT_CONFIG",
        }
    }

    /// Its client config file; `None` on a stack whose brokers take
    /// anyone (`STACK_SECURITY=plaintext`).
    pub fn client_config_file(self) -> Option<PathBuf> {
        stack_var_opt(self.variable()).map(PathBuf::from)
    }

    /// A client configuration of the stack's brokers as this principal.
    ///
    /// # Panics
    /// When the stack is not up, or its client config file is refused.
    #[cfg(feature = "kafka")]
    pub fn client(self) -> rdkafka::ClientConfig {
        let file = self.client_config_file();
        crate::kafka::client_config(&stack_var("KAFKA_BOOTSTRAP_SERVERS"), file.as_deref())
            .unwrap_or_else(|e| panic!("{self:?}'s kafka client config: {e:#}"))
    }
}

#[cfg(feature = "kafka")]
impl TestTopic {
    /// Creates `test-<uuid>` with `partitions` partitions.
    ///
    /// # Panics
    /// When the broker is down.
    pub async fn create(partitions: i32) -> Self {
        // The brokers' default.replication.factor: 3 on the 3-node stack.
        Self::create_with(partitions, -1, &[]).await
    }

    /// [`Self::create`] with `replication` replicas (-1: the brokers'
    /// default) and `configs` added to the contract's topic configs (a key
    /// given replaces the contract's).
    ///
    /// # Panics
    /// When the broker is down.
    pub async fn create_with(partitions: i32, replication: i32, configs: &[(&str, &str)]) -> Self {
        Self::create_named(
            format!("test-{}", Uuid::new_v4().simple()),
            partitions,
            replication,
            configs,
        )
        .await
    }

    /// [`Self::create`] under the name the services' principals are granted
    /// (`order.events.test-<uuid>`: the relay may write it, payments read
    /// it), for tests of the ACLs.
    ///
    /// # Panics
    /// When the broker is down.
    pub async fn create_for_services(partitions: i32) -> Self {
        let name = format!("order.events.test-{}", Uuid::new_v4().simple());
        Self::create_named(name, partitions, -1, &[]).await
    }

    async fn create_named(
        name: String,
        partitions: i32,
        replication: i32,
        configs: &[(&str, &str)],
    ) -> Self {
        let bootstrap_servers = stack_var("KAFKA_BOOTSTRAP_SERVERS");
        let mut all: Vec<(&str, String)> = crate::contract::order_events_topic_configs()
            .into_iter()
            .filter(|(k, _)| !configs.iter().any(|(given, _)| given == k))
            .collect();
        all.extend(configs.iter().map(|(k, v)| (*k, (*v).to_owned())));
        crate::kafka::ensure_topic(
            &KafkaPrincipal::Admin.client(),
            &name,
            partitions,
            replication,
            &all,
        )
        .await
        .unwrap_or_else(|e| panic!("create topic {name}: {e:#} (is the stack up? `make up`)"));
        Self {
            name,
            bootstrap_servers,
        }
    }

    /// Kafka settings pointing at this topic, as the admin principal (a
    /// super user, so a test's topic and groups need no ACL).
    pub fn kafka_args(&self) -> crate::config::KafkaArgs {
        self.kafka_args_as(KafkaPrincipal::Admin)
    }

    /// [`Self::kafka_args`] as `principal`.
    pub fn kafka_args_as(&self, principal: KafkaPrincipal) -> crate::config::KafkaArgs {
        crate::config::KafkaArgs {
            kafka_bootstrap_servers: self.bootstrap_servers.clone(),
            kafka_client_config: principal.client_config_file(),
            kafka_topic: self.name.clone(),
            // A single-node stack's topics have one replica; it says so in
            // its env file.
            allow_under_replicated_topic: stack_var_opt(
                crate::contract::env::KAFKA_ALLOW_UNDER_REPLICATED_TOPIC,
            )
            .is_some_and(|v| v == "true"),
        }
    }

    /// A client configuration of the topic's brokers as the admin principal.
    pub fn client(&self) -> rdkafka::ClientConfig {
        KafkaPrincipal::Admin.client()
    }

    /// Reads every message of the topic from the beginning until `count`
    /// have arrived or `timeout` passes, in per-partition order.
    pub async fn read_all(&self, count: usize, timeout: std::time::Duration) -> Vec<TopicMessage> {
        use rdkafka::consumer::{Consumer, StreamConsumer};
        use rdkafka::message::{Headers, Message};
        let consumer: StreamConsumer = self
            .client()
            .set("group.id", format!("reader-{}", Uuid::new_v4().simple()))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("create reader");
        consumer.subscribe(&[&self.name]).expect("subscribe");
        let mut out = Vec::with_capacity(count.min(100_000));
        let deadline = tokio::time::Instant::now() + timeout;
        while out.len() < count {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(m)) => out.push(TopicMessage {
                    partition: m.partition(),
                    key: m.key().map(<[u8]>::to_vec),
                    value: m.payload().map(<[u8]>::to_vec),
                    headers: m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                                .collect()
                        })
                        .unwrap_or_default(),
                }),
                Ok(Err(e)) => panic!("read {}: {e}", self.name),
                Err(_) => break,
            }
        }
        out
    }
}

/// The value of `series` (a metric name, with its labels if it has any, as
/// exposed: `payments_errors_total{stage="db"}`) in a Prometheus text
/// exposition; `None` when the series is not there.
///
/// # Panics
/// When the series' value is not a number.
pub fn series_value(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|e| panic!("{series}: {v:?} is not a number: {e}"))
        })
}

/// A service's `run` in a test: on a metrics listener bound to a free port,
/// in a task of its own, its `/metrics` scraped, stopped with a deadline.
/// The services' tests share it (`orders`, `relay` and `payments` each have
/// a `run(config, metrics_listener, cancel)`).
pub struct Service {
    name: &'static str,
    metrics_url: String,
    cancel: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Service {
    /// Binds a listener on 127.0.0.1 and spawns `run(listener, cancel)`;
    /// `name` is for the panics.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn spawn<F, Fut>(name: &'static str, run: F) -> Self
    where
        F: FnOnce(tokio::net::TcpListener, tokio_util::sync::CancellationToken) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a metrics listener");
        let metrics_url = format!(
            "http://{}/metrics",
            listener.local_addr().expect("listener address")
        );
        let cancel = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(run(listener, cancel.clone()));
        Self {
            name,
            metrics_url,
            cancel,
            task,
        }
    }

    /// Its `/metrics` URL.
    pub fn metrics_url(&self) -> &str {
        &self.metrics_url
    }

    /// The value of `series` in its metrics now (see [`series_value`]); 0
    /// when the series is not exposed yet.
    ///
    /// # Panics
    /// When the scrape fails.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = reqwest::get(&self.metrics_url)
            .await
            .unwrap_or_else(|e| panic!("scrape {}: {e}", self.name))
            .text()
            .await
            .unwrap_or_else(|e| panic!("read {}'s metrics: {e}", self.name));
        series_value(&text, series).unwrap_or(0.0)
    }

    /// Whether its task has ended (by itself: an error, or a fatal state).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits, without cancelling it, for its `run` to end by itself (an
    /// error, a fatal state) and returns how.
    ///
    /// # Panics
    /// When it is still running after `within`, or its task panicked.
    pub async fn ended(self, within: std::time::Duration) -> anyhow::Result<()> {
        tokio::time::timeout(within, self.task)
            .await
            .unwrap_or_else(|_| panic!("{} still runs after {within:?}", self.name))
            .unwrap_or_else(|e| panic!("{}'s task: {e}", self.name))
    }

    /// Cancels it and returns how its `run` ended.
    ///
    /// # Panics
    /// When it does not stop within 30 s, or its task panicked.
    pub async fn stop_with_result(self) -> anyhow::Result<()> {
        self.cancel.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(30), self.task)
            .await
            .unwrap_or_else(|_| panic!("{} did not stop within 30 s", self.name))
            .unwrap_or_else(|e| panic!("{}'s task: {e}", self.name))
    }

    /// Cancels it; it must stop within 30 s without an error.
    ///
    /// # Panics
    /// When it does not, with the error.
    pub async fn stop(self) {
        let name = self.name;
        if let Err(error) = self.stop_with_result().await {
            panic!("{name} ended with an error: {error:#}");
        }
    }
}

/// A case count from the environment variable `var` (property tests'
/// `PROPS_*_CASES`), or `default` when it is not set.
///
/// # Panics
/// When the variable is set but not a count.
pub fn cases_from_env(var: &str, default: u32) -> u32 {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|e| panic!("{var}={v:?} is not a count: {e}")),
        Err(_) => default,
    }
}

/// Polls `check` every 100 ms until it returns true or `timeout` passes;
/// returns the last answer. Tests await conditions instead of sleeping.
pub async fn eventually<F, Fut>(timeout: std::time::Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Slow clients, for the tests of what one client can hold on a server
/// (`serve::Limits`, request timeouts): connections that send their bytes
/// a byte a second, and how and when the server closed them.
pub mod slow {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// How a slow client's connection ended.
    #[derive(Debug)]
    pub struct SlowEnd {
        /// From connect to the server closing it; `None`: still open at the
        /// client's deadline.
        pub closed_after: Option<Duration>,
        /// What the server sent.
        pub received: Vec<u8>,
    }

    /// A client on `stream` (connected at `opened`) that sends `head` at once,
    /// then `trickle` a byte a second, and reads what the server sends, until
    /// the server closes the connection (a read of 0 bytes or an error, or a
    /// write refused) or `deadline` passes.
    pub async fn slow_client(
        mut stream: TcpStream,
        opened: Instant,
        head: &'static [u8],
        trickle: &'static [u8],
        deadline: Instant,
    ) -> SlowEnd {
        let mut received = Vec::new();
        let closed = |received| SlowEnd {
            closed_after: Some(opened.elapsed()),
            received,
        };
        if stream.write_all(head).await.is_err() {
            return closed(received);
        }
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut sent = 0;
        let mut buf = [0u8; 1024];
        loop {
            tokio::select! {
                read = stream.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return closed(received),
                    Ok(n) => received.extend_from_slice(&buf[..n]),
                },
                _ = tick.tick(), if sent < trickle.len() => {
                    if stream.write_all(&trickle[sent..=sent]).await.is_err() {
                        return closed(received);
                    }
                    sent += 1;
                }
                () = tokio::time::sleep_until(deadline.into()) => {
                    return SlowEnd { closed_after: None, received };
                }
            }
        }
    }

    /// Opens `count` connections to `addr` at once, each a [`slow_client`]
    /// with `head` and `trickle` and `patience` to be closed.
    pub async fn slow_clients(
        addr: SocketAddr,
        count: usize,
        head: &'static [u8],
        trickle: &'static [u8],
        patience: Duration,
    ) -> Vec<tokio::task::JoinHandle<SlowEnd>> {
        let mut clients = Vec::with_capacity(count);
        for _ in 0..count {
            let stream = TcpStream::connect(addr).await.expect("connect");
            let opened = Instant::now();
            clients.push(tokio::spawn(slow_client(
                stream,
                opened,
                head,
                trickle,
                opened + patience,
            )));
        }
        clients
    }

    /// Waits for `clients`; asserts every one was closed by the server, no
    /// sooner than `timeout` after it opened and within `patience`.
    pub async fn all_closed(
        what: &str,
        clients: Vec<tokio::task::JoinHandle<SlowEnd>>,
        timeout: Duration,
        patience: Duration,
    ) -> Vec<SlowEnd> {
        let mut ends = Vec::with_capacity(clients.len());
        for client in clients {
            ends.push(client.await.expect("slow client"));
        }
        let open = ends.iter().filter(|e| e.closed_after.is_none()).count();
        assert_eq!(
            open,
            0,
            "{open} of {} {what} still open {patience:?} after they connected (timeout {timeout:?})",
            ends.len()
        );
        let early = ends
            .iter()
            .filter_map(|e| e.closed_after)
            .filter(|after| *after < timeout.mul_f64(0.9))
            .count();
        assert_eq!(early, 0, "{early} {what} were closed before the timeout");
        ends
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_urls() {
        assert_eq!(
            with_user(
                "postgres://postgres:pw@127.0.0.1:5432/test_1",
                "effectively_relay"
            ),
            "postgres://effectively_relay@127.0.0.1:5432/test_1"
        );
        assert_eq!(
            with_user("postgres://postgres@h/db", "r"),
            "postgres://r@h/db"
        );
        assert_eq!(
            with_database("postgres://r:p@h:1/effectively", "test_2"),
            "postgres://r:p@h:1/test_2"
        );
    }
}
