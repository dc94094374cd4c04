//! The `recon` command: its flags, the read-only pool, the optional wait for
//! the pipeline to drain, the diff, the client's intents, and the report as a
//! table or as JSON (which chaos and the experiments read).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use pipeline::config::DbArgs;
use sqlx::ConnectOptions;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::{ClientIntents, CommittedReport, IntentsReport, Policy, Report};

/// Recon: prove distinct effects == distinct intents with one SQL diff.
///
/// Read-only. Exit status 0 when clean (no missing, double or orphan effect,
/// amounts equal), 1 on drift, 2 on error.
#[derive(Debug, Parser)]
#[command(name = "recon", version)]
pub struct Config {
    /// The database (read-only role).
    #[command(flatten)]
    pub db: DbArgs,

    /// First wait (up to this many seconds) until no outbox row is pending and
    /// every event is in the inbox; report anyway when the time is up.
    #[arg(long, env = "RECON_WAIT_DRAINED", value_name = "SECONDS")]
    pub wait_drained: Option<f64>,

    /// Also check the client's ground truth: loadgen's `--intents` file
    /// (key<TAB>order_id of every key that got a success). Every such key must
    /// have exactly its order. Keys in `<FILE>.ambiguous` (no answer, or a
    /// 408/5xx: they may have committed) may have 0 or 1 order and are
    /// counted; keys in `<FILE>.failed` (refused) must have none.
    #[arg(long, value_name = "FILE")]
    pub intents: Option<PathBuf>,

    /// Also check the consumer's side: the messages payments' consumer group
    /// has committed past, as `kafka-tool offsets committed-past --group G`
    /// lists them. The group will never be given them again, so each must be
    /// recorded (its msg_id in the inbox, a dead letter at its position, or
    /// parked); one that is not is a lost effect. List them after the
    /// pipeline has drained (`--drain-only` waits for that).
    #[arg(long, value_name = "FILE")]
    pub committed_past: Option<PathBuf>,

    /// Only wait as --wait-drained does (its SECONDS, 0 without it), then
    /// exit: 0 drained, 1 not. No diff.
    #[arg(long)]
    pub drain_only: bool,

    /// Report failed outbox rows and dead letters without counting them as
    /// drift (for runs that feed bad input on purpose). Without it they are
    /// drift: each is an intent that did not reach its effect.
    #[arg(long, env = "RECON_ALLOW_DEAD_LETTERS")]
    pub allow_dead_letters: bool,

    /// The relay leaves the outbox rows it publishes unmarked (Debezium's
    /// connector streams them and writes nothing back): the pipeline is
    /// drained once every outbox row's event is in the inbox or
    /// dead-lettered, and rows still pending are not drift. An event not
    /// consumed still is.
    #[arg(long, env = "RECON_UNMARKED_OUTBOX")]
    pub unmarked_outbox: bool,

    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,

    /// Print the exact SQL of the diff (run it with psql to check by hand:
    /// `$1` and `$2` bound a range of ids; the nil and the max UUID cover
    /// all).
    #[arg(long)]
    pub show_sql: bool,

    /// Check the orders in this many id ranges side by side, one database
    /// connection each, all reading one snapshot (default: the number of
    /// CPUs). 1 runs the diff as one statement.
    #[arg(long, env = "RECON_JOBS", value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: Option<u16>,
}

/// Exit status on drift.
pub const EXIT_DRIFT: u8 = 1;
/// Exit status on an error (recon could not tell).
pub const EXIT_ERROR: u8 = 2;

/// Runs recon as the command line asked and prints its report; `true` when
/// clean.
pub async fn run(config: Config) -> anyhow::Result<bool> {
    if config.show_sql {
        print!("{}", show_sql());
    }
    let jobs = config.jobs.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    );
    let pool = connect(&config.db.database_url, jobs).await?;
    let policy = Policy {
        allow_dead_letters: config.allow_dead_letters,
        unmarked_outbox: config.unmarked_outbox,
    };
    let mut drained = None;
    if config.drain_only {
        let secs = config.wait_drained.unwrap_or(0.0);
        let done =
            crate::wait_drained(&pool, Duration::from_secs_f64(secs.max(0.0)), policy).await?;
        if !done {
            eprintln!("recon: pipeline not drained after {secs} s");
        }
        return Ok(done);
    }
    // Read before the diff, so a file that cannot be read costs no diff.
    let committed = match &config.committed_past {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("read {}", path.display()))?;
            Some(
                crate::parse_committed(&text)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
            )
        }
    };
    if let Some(secs) = config.wait_drained {
        drained =
            Some(crate::wait_drained(&pool, Duration::from_secs_f64(secs.max(0.0)), policy).await?);
        if drained == Some(false) {
            eprintln!("recon: pipeline not drained after {secs} s; reporting the current state");
        }
    }
    let started = Instant::now();
    let report = crate::reconcile_in_parts(&pool, jobs)
        .await
        .context("run the diff")?;
    let diff_seconds = started.elapsed().as_secs_f64();
    let intents = match &config.intents {
        None => None,
        Some(path) => Some(
            crate::check_intents(&pool, &read_intents(path)?)
                .await
                .context("check intents")?,
        ),
    };
    let committed = match committed {
        None => None,
        Some(messages) => Some(
            crate::check_committed(&pool, &messages)
                .await
                .context("check the committed offsets")?,
        ),
    };
    let findings = Findings {
        report,
        policy,
        diff_seconds,
        jobs,
        drained,
        intents,
        committed,
    };
    if config.json {
        println!("{}", serde_json::to_string_pretty(&findings.json())?);
    } else {
        print!("{}", findings.text());
    }
    Ok(findings.is_clean())
}

/// What `--show-sql` prints: the diff, the stored responses read, the
/// dead-letter count and the drain check, each as psql takes it.
pub fn show_sql() -> String {
    format!(
        "-- the floors of the stores that expire ($3, $4 and the greater of outbox and inbox: $5)\n{};\n\n\
         -- the diff of the ids $1 to $2 (the whole: $1 = '00000000-0000-0000-0000-000000000000', \
         $2 = 'ffffffff-ffff-ffff-ffff-ffffffffffff')\n{};\n\n\
         -- the stored responses of the same ids, compared by recon row by row\n{};\n\n\
         -- dead letters\n{};\n\n-- drained?\n{};\n\n\
         -- what the consumer group committed past (--committed-past)\n{};\n\n",
        crate::FLOORS_SQL.trim_end(),
        crate::PART_SQL.trim_end(),
        crate::RESPONSES_SQL.trim_end(),
        crate::DEAD_LETTERS_SQL.trim_end(),
        crate::DRAINED_SQL.trim_end(),
        crate::COMMITTED_SQL.trim_end()
    )
}

/// A pool of `jobs` (at least 2) read-only connections to `database_url`.
pub async fn connect(database_url: &str, jobs: usize) -> anyhow::Result<PgPool> {
    // Read-only: never migrate, never write. The diff is one long statement
    // by design: sqlx's slow-statement warning would only repeat it.
    let options = PgConnectOptions::from_str(database_url)
        .context("parse DATABASE_URL")?
        .disable_statement_logging();
    PgPoolOptions::new()
        .max_connections(jobs.max(2) as u32)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query!("SET default_transaction_read_only = on")
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .context("connect to postgres")
}

/// loadgen's intents file at `path` and, if they are there, its
/// `<path>.ambiguous` and `<path>.failed` beside it (an older loadgen wrote
/// no `.failed`).
pub fn read_intents(path: &Path) -> anyhow::Result<ClientIntents> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let beside = |suffix: &str| {
        let mut name = path.to_path_buf().into_os_string();
        name.push(suffix);
        std::fs::read_to_string(&name).ok()
    };
    let (ambiguous, failed) = (beside(".ambiguous"), beside(".failed"));
    ClientIntents::parse(&text, ambiguous.as_deref(), failed.as_deref())
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Everything one recon run found, ready to print.
#[derive(Debug, Clone)]
pub struct Findings {
    /// The diff.
    pub report: Report,
    /// What counts as drift.
    pub policy: Policy,
    /// How long the diff took.
    pub diff_seconds: f64,
    /// The id ranges checked side by side.
    pub jobs: usize,
    /// Whether the pipeline drained (`None`: not waited for).
    pub drained: Option<bool>,
    /// The client's intents against the database, when given.
    pub intents: Option<IntentsReport>,
    /// What the consumer group committed past against the database, when
    /// given.
    pub committed: Option<CommittedReport>,
}

impl Findings {
    /// No drift in the diff and, when checked, none in the client's intents.
    pub fn is_clean(&self) -> bool {
        self.report.is_clean(self.policy)
            && self.intents.as_ref().is_none_or(|i| i.is_clean())
            && self.committed.as_ref().is_none_or(|c| c.is_clean())
    }

    /// The `--json` report.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "report": self.report,
            "deltas": self.report.deltas(self.policy),
            "drift": self.report.drift(self.policy),
            "diff_seconds": self.diff_seconds,
            "jobs": self.jobs,
            "drained": self.drained,
            "intents": self.intents,
            "committed": self.committed,
            "clean": self.is_clean(),
        })
    }

    /// The human report: the diff's table, its time, the intents' table.
    pub fn text(&self) -> String {
        let mut out = self.report.table(self.policy);
        out.push_str(&format!(
            "(the diff took {:.2} s; --jobs {})\n",
            self.diff_seconds, self.jobs
        ));
        if let Some(intents) = &self.intents {
            out.push_str(&intents.table());
        }
        if let Some(committed) = &self.committed {
            out.push_str(&committed.table());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClientKey;

    fn findings(intents: Option<IntentsReport>) -> Findings {
        Findings {
            report: Report::default(),
            policy: Policy::default(),
            diff_seconds: 0.25,
            jobs: 4,
            drained: Some(true),
            intents,
            committed: None,
        }
    }

    #[test]
    fn json_has_the_keys_chaos_and_the_experiments_read() {
        let clean = findings(None).json();
        let keys: Vec<&str> = clean
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "clean",
                "committed",
                "deltas",
                "diff_seconds",
                "drained",
                "drift",
                "intents",
                "jobs",
                "report"
            ]
        );
        assert_eq!(clean["clean"], true);
        assert_eq!(clean["drained"], true);
        assert_eq!(clean["jobs"], 4);
        assert_eq!(clean["intents"], serde_json::Value::Null);
        assert_eq!(clean["report"]["distinct_orders"], 0);

        let lost = findings(Some(IntentsReport {
            client_succeeded: 2,
            matched: 1,
            missing_in_db: 1,
            ..IntentsReport::default()
        }));
        let json = lost.json();
        assert_eq!(json["clean"], false);
        assert_eq!(json["intents"]["missing_in_db"], 1);
    }

    #[test]
    fn text_is_the_tables_and_the_time() {
        let text = findings(Some(IntentsReport::default())).text();
        assert!(text.starts_with(&Report::default().table(Policy::default())));
        assert!(
            text.contains("(the diff took 0.25 s; --jobs 4)\n"),
            "{text}"
        );
        assert!(text.ends_with(&IntentsReport::default().table()), "{text}");
    }

    #[test]
    fn intents_are_read_with_their_ambiguous_file() {
        let dir = std::env::temp_dir().join(format!("recon-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("intents.txt");
        let id = uuid::Uuid::now_v7();
        std::fs::write(&path, format!("k-1\t{id}\n")).expect("write intents");
        let alone = read_intents(&path).expect("intents alone");
        assert_eq!(alone.succeeded, vec![(ClientKey::shared("k-1"), id)]);
        assert!(alone.ambiguous.is_empty());
        std::fs::write(dir.join("intents.txt.ambiguous"), "k-2\n").expect("write ambiguous");
        let both = read_intents(&path).expect("both");
        assert_eq!(both.ambiguous, vec![ClientKey::shared("k-2")]);
        assert!(both.failed.is_empty());
        std::fs::write(dir.join("intents.txt.failed"), "k-3\n").expect("write failed");
        let all = read_intents(&path).expect("all three");
        assert_eq!(all.failed, vec![ClientKey::shared("k-3")]);
        std::fs::write(&path, "no tab\n").expect("write garbage");
        let error = read_intents(&path).expect_err("garbage").to_string();
        assert!(error.starts_with(&path.display().to_string()), "{error}");
        assert!(read_intents(&dir.join("absent")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
