//! Command-line/environment settings shared by every binary, meant to be
//! `#[command(flatten)]`ed into each binary's own clap struct.

use std::time::Duration;

use clap::Args;

/// PostgreSQL connection settings.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// PostgreSQL connection URL, as the service's own role (`make up` writes
    /// one per service to .stack/env: ORDERS_DATABASE_URL, ...). Never logged.
    #[arg(long, env = crate::contract::env::DATABASE_URL, hide_env_values = true)]
    pub database_url: String,

    /// Maximum connections in this process's pool.
    #[arg(long, env = "DB_MAX_CONNECTIONS", default_value_t = 32)]
    pub db_max_connections: u32,

    /// How long a request may wait for a free pooled connection before it fails
    /// with "unavailable" (e.g. 503), in milliseconds.
    #[arg(long, env = "DB_ACQUIRE_TIMEOUT_MS", default_value_t = 5_000)]
    pub db_acquire_timeout_ms: u64,

    /// Check each pooled connection with a round trip before handing it out
    /// (sqlx's default): a connection the server dropped is replaced
    /// unseen, at the cost of one round trip per acquire. `false` skips it;
    /// the first statement on a dropped connection then fails, and is
    /// retried as any lost connection is.
    #[arg(long, env = "DB_TEST_BEFORE_ACQUIRE", default_value_t = true, action = clap::ArgAction::Set)]
    pub db_test_before_acquire: bool,

    /// How long a service starting up keeps trying to reach PostgreSQL while
    /// it is unavailable (refused, no primary behind the proxy mid-failover,
    /// shutting down, in recovery), in milliseconds, before it exits with the
    /// last error; 0: one try. Any other error (a wrong password, no such
    /// database) fails at once.
    #[arg(long, env = "DB_CONNECT_PATIENCE_MS", default_value_t = 30_000)]
    pub db_connect_patience_ms: u64,

    /// Apply the embedded migrations at start-up (safe with several processes:
    /// the migrator takes an advisory lock). Only for a DATABASE_URL of the
    /// schemas' owner: the services' own roles may not change the schema, so
    /// migrating is a step of its own (`orders --migrate-only`, `make migrate`).
    #[arg(long, env = "DB_MIGRATE", default_value_t = false, action = clap::ArgAction::Set)]
    pub db_migrate: bool,

    /// Longest one statement may run before the server cancels it, in
    /// milliseconds (0: no limit). Each service has its own default.
    #[arg(long, env = "DB_STATEMENT_TIMEOUT_MS")]
    pub db_statement_timeout_ms: Option<u64>,

    /// Longest a session may sit idle inside an open transaction before the
    /// server ends it, releasing its locks, in milliseconds (0: no limit). A
    /// process that hangs (SIGSTOP, a stuck thread) mid-transaction then
    /// loses what it held within this bound. Each service has its own
    /// default.
    #[arg(long, env = crate::contract::env::DB_IDLE_IN_TRANSACTION_TIMEOUT_MS)]
    pub db_idle_in_transaction_timeout_ms: Option<u64>,
}

/// A service's own defaults for the session limits of [`DbArgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// `statement_timeout`.
    pub statement_timeout: Duration,
    /// `idle_in_transaction_session_timeout`.
    pub idle_in_transaction_timeout: Duration,
    /// `plan_cache_mode = force_custom_plan`: plan every execution of a
    /// prepared statement for its parameters and the table's current
    /// statistics. For a service that reads a queue table whose size swings
    /// from empty to a backlog: PostgreSQL switches a prepared statement to a
    /// generic plan after five executions, and a generic plan made while the
    /// table was empty stays in use until the next ANALYZE (FINDINGS §13).
    pub custom_plans: bool,
    /// The outbox trigger's `NOTIFY` is off for this session's inserts
    /// ([`crate::outbox::NOTIFY_SETTING`]): the service wakes the relay
    /// itself, outside its write transactions ([`crate::outbox::Notifier`]).
    pub defer_outbox_notify: bool,
    /// `synchronous_commit = off`: a commit returns before its WAL reaches
    /// the disk, and a crash of the server (not of the client) may undo the
    /// last few. Only for a session no client and no consumer offset relies
    /// on, whose lost commits are work done again: the relay's marks.
    pub asynchronous_commit: bool,
    /// `enable_bitmapscan = off`: for a session that reads a queue's
    /// oldest rows by walking its pending index in order (the relay). With
    /// the statistics of a queue that is nearly empty, the planner prefers a
    /// bitmap scan and a sort; a bitmap scan reads every entry of the index,
    /// those of rows already published included (only an ordered index scan
    /// marks them dead as it passes), so each read grew with the rows
    /// published since the last vacuum: 1,600–1,900 entries and 5,600–6,500
    /// heap pages to return 3–5 rows per shard at 1,000 orders/s
    /// (FINDINGS.md §26).
    pub ordered_reads: bool,
}

impl DbArgs {
    /// Settings for `url` with the defaults above; handy in tests.
    pub fn for_url(url: impl Into<String>) -> Self {
        Self {
            database_url: url.into(),
            db_max_connections: 32,
            db_acquire_timeout_ms: 5_000,
            db_test_before_acquire: true,
            db_connect_patience_ms: 30_000,
            db_migrate: false,
            db_statement_timeout_ms: None,
            db_idle_in_transaction_timeout_ms: None,
        }
    }

    /// The session limits: the flags when given, else `defaults`.
    pub fn limits(&self, defaults: SessionLimits) -> SessionLimits {
        SessionLimits {
            statement_timeout: self
                .db_statement_timeout_ms
                .map_or(defaults.statement_timeout, Duration::from_millis),
            idle_in_transaction_timeout: self
                .db_idle_in_transaction_timeout_ms
                .map_or(defaults.idle_in_transaction_timeout, Duration::from_millis),
            custom_plans: defaults.custom_plans,
            defer_outbox_notify: defaults.defer_outbox_notify,
            asynchronous_commit: defaults.asynchronous_commit,
            ordered_reads: defaults.ordered_reads,
        }
    }

    /// The pool acquire timeout as a [`Duration`].
    pub fn acquire_timeout(&self) -> Duration {
        Duration::from_millis(self.db_acquire_timeout_ms)
    }

    /// [`Self::db_connect_patience_ms`].
    pub fn connect_patience(&self) -> Duration {
        Duration::from_millis(self.db_connect_patience_ms)
    }
}

/// The async runtime every service runs its work on.
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    /// Threads that run the service's tasks (requests, batches, the
    /// database's and the broker's I/O); 0: one per CPU core (tokio's
    /// default, which also reads TOKIO_WORKER_THREADS). Where the service
    /// shares a few cores with PostgreSQL and the brokers, 1 spends less
    /// CPU per order: no thread wakes another to steal a task (on 2 cores,
    /// orders' CPU per order 11-22% less; FINDINGS §15). The embedded
    /// stack sets 1.
    #[arg(long, env = "WORKER_THREADS", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub worker_threads: u16,
}

impl RuntimeArgs {
    /// A multi-threaded runtime with I/O and timers, of `--worker-threads`.
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.enable_all();
        if self.worker_threads > 0 {
            builder.worker_threads(usize::from(self.worker_threads));
        }
        builder.build()
    }
}

/// Kafka settings shared by the relay (producer) and payments (consumer).
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers (written to .stack/env by `make up`).
    #[arg(
        long,
        env = "KAFKA_BOOTSTRAP_SERVERS",
        default_value = "127.0.0.1:9092"
    )]
    pub kafka_bootstrap_servers: String,

    /// A file of librdkafka properties (`key=value` lines) for every Kafka
    /// client the service makes: TLS and SASL (`security.protocol=SASL_SSL`,
    /// `sasl.mechanism`, `sasl.username`, `sasl.password`,
    /// `ssl.ca.location`), or any other property. It holds a password, so it
    /// is refused when other users may read it (chmod 600). The embedded
    /// stack writes one per principal in .stack/kafka/clients/ (relay,
    /// payments, admin).
    #[arg(long, env = "KAFKA_CLIENT_CONFIG", value_name = "FILE")]
    pub kafka_client_config: Option<std::path::PathBuf>,

    /// The topic order events are published to.
    #[arg(long, env = "KAFKA_TOPIC", default_value = "order.events")]
    pub kafka_topic: String,

    /// Run on a topic that cannot keep what `acks=all` acknowledges: a
    /// replication factor under 2, or `min.insync.replicas` under 2 (an ack
    /// is then one copy, and losing its broker loses events the outbox
    /// already marked published). At start-up the relay and payments read
    /// both from the brokers and refuse such a topic, naming the setting,
    /// unless this is set: for a single-node stack or a test. A
    /// `min.insync.replicas` over the replication factor is refused
    /// whatever this says (every produce would fail with
    /// NOT_ENOUGH_REPLICAS).
    #[arg(long, env = crate::contract::env::KAFKA_ALLOW_UNDER_REPLICATED_TOPIC)]
    pub allow_under_replicated_topic: bool,
}

/// The text of the file at `path`, which must be its owner's alone (it
/// holds a key, a secret or a token: no group or other permission bits);
/// the error names the file and what is wrong, never its content.
pub fn read_private(path: &std::path::Path) -> Result<String, String> {
    let shown = path.display();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|e| format!("{shown}: {e}"))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(format!(
                "{shown}: other users may read it (mode {:o}): chmod 600 {shown}",
                mode & 0o777
            ));
        }
    }
    std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::RuntimeArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        runtime: RuntimeArgs,
    }

    fn workers(args: &[&str]) -> Result<usize, String> {
        let cli = Cli::try_parse_from(std::iter::once("svc").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        let runtime = cli.runtime.runtime().map_err(|e| e.to_string())?;
        Ok(runtime.metrics().num_workers())
    }

    #[test]
    fn worker_threads_sets_the_runtime_s_workers_and_zero_is_one_per_core() {
        assert_eq!(workers(&["--worker-threads", "1"]), Ok(1));
        assert_eq!(workers(&["--worker-threads", "3"]), Ok(3));
        let per_core = workers(&["--worker-threads", "0"]).expect("runtime");
        assert!(per_core >= 1);
        assert!(workers(&["--worker-threads", "1025"]).is_err());
        assert!(workers(&["--worker-threads", "-1"]).is_err());
    }
}
