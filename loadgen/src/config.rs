//! Command line (every flag is also a `LOADGEN_*` environment variable) and
//! the validated settings a run works from.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use serde::Serialize;

use crate::keys;

/// Which protocol carries the creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Protocol {
    /// `POST /orders` over HTTP/1.1 keep-alive.
    Http,
    /// `orders.v1.Orders/Create` over one HTTP/2 channel.
    Grpc,
    /// Every send (retries included) picks HTTP or gRPC at random, so one
    /// key is seen over both protocols.
    Mixed,
}

/// Which orders instance each send goes to, when there are several
/// (`--http-url` / `--grpc-url` with more than one URL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Spread {
    /// Each protocol's sends take its instances in turn, retries included.
    RoundRobin,
    /// Each send draws an instance uniformly (from the run's seed).
    Random,
}

impl Spread {
    /// The flag's value.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
        }
    }
}

/// How progress is shown on stderr while the run goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ProgressMode {
    /// A bar when stderr is a terminal, else one plain line every 5 s.
    Auto,
    /// Always a bar.
    Bar,
    /// Always one plain line every 5 s (for logs and CI).
    Plain,
    /// Nothing until the summary.
    Off,
}

/// The command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "loadgen",
    version,
    about = "Open-model load generator for the Orders API: fixed rate, retry storm, Zipfian hot keys, replay verification",
    long_about = "Open-model load generator for the Orders API (POST /orders over HTTP, \
        orders.v1.Orders/Create over gRPC).\n\n\
        Request i is sent at start + i/rate whether or not earlier ones finished, and its latency \
        is measured from that scheduled instant (no coordinated omission). A fraction of requests \
        is retried with the same idempotency key and body, concurrently or after a short delay, \
        and every success for a key is checked against the first one: any difference is a \
        replay mismatch, i.e. an idempotency bug in the service.\n\n\
        Keys are `{key-prefix}-{index}`; the body of an index is a pure function of (seed, index), \
        so a re-drawn index is a retry of the same intent, never a conflicting request.\n\n\
        Exit codes: 0 completed run; 1 error (target unreachable at start, output file not \
        writable, ...); 2 bad arguments; 3 replay mismatches were seen; 130 interrupted (Ctrl-C) \
        without mismatches.\n\n\
        SIGUSR1 ends the schedule early: no more first attempts, the retries already planned and \
        the sends in flight finish, and the report is of a complete run over the seconds it ran \
        (`ended_early`). chaos uses it to keep the load on until its faults are done.",
    after_help = "Example: loadgen --http-url http://127.0.0.1:18080 --rate 1000 --duration 10 \
        --zipf-s 0 --intents /tmp/intents.txt --json /tmp/run.json"
)]
pub(crate) struct Config {
    /// Base URL of the HTTP API (plain http only); creates go to `{url}/orders`.
    /// Several orders instances: several URLs, comma-separated or the flag
    /// repeated; each send goes to one of them as --spread says, so one key's
    /// retries reach different instances.
    #[arg(
        long,
        env = "LOADGEN_HTTP_URL",
        default_value = "http://127.0.0.1:8080",
        value_delimiter = ','
    )]
    pub(crate) http_url: Vec<String>,

    /// URL of the gRPC API (plain http/2 only); several, like --http-url.
    #[arg(
        long,
        env = "LOADGEN_GRPC_URL",
        default_value = "http://127.0.0.1:50051",
        value_delimiter = ','
    )]
    pub(crate) grpc_url: Vec<String>,

    /// With several URLs of a protocol: `round-robin` (each protocol's
    /// sends take its instances in turn) or `random` (an instance drawn per
    /// send from the seed). A send retried for want of an answer
    /// (--retry-on-error) goes to the next instance, as behind a balancer.
    #[arg(long, env = "LOADGEN_SPREAD", value_enum, default_value_t = Spread::RoundRobin)]
    pub(crate) spread: Spread,

    /// Protocol of every send; `mixed` picks one at random per send, retries included.
    #[arg(long, env = "LOADGEN_PROTOCOL", value_enum, default_value_t = Protocol::Http)]
    pub(crate) protocol: Protocol,

    /// New intents (first attempts) per second. Retries come on top.
    #[arg(long, env = "LOADGEN_RATE", default_value_t = 1000.0)]
    pub(crate) rate: f64,

    /// How long to send, in seconds (the clock starts after the reachability probe).
    #[arg(long, env = "LOADGEN_DURATION", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub(crate) duration: u64,

    /// Most requests outstanding at once. A send that would exceed it is not
    /// sent and is counted as `dropped` (the client, not the service, is overloaded).
    #[arg(long, env = "LOADGEN_MAX_IN_FLIGHT", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) max_in_flight: u64,

    /// Per-request timeout in milliseconds, from the moment it is actually sent.
    /// A timed-out key is ambiguous: the service may or may not have created it.
    #[arg(long, env = "LOADGEN_TIMEOUT_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub(crate) timeout_ms: u64,

    /// Seconds after the end of --duration before outstanding requests are
    /// abandoned (counted as timeouts, their keys ambiguous). A hard stop.
    #[arg(long, env = "LOADGEN_DRAIN_TIMEOUT", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub(crate) drain_timeout: u64,

    /// Zipf exponent of the key draw. 0: every intent gets a fresh key (unique
    /// keys). > 0: each intent draws its key index from Zipf(--keys, s), so hot
    /// keys are drawn again and again, concurrently; a re-drawn index is the
    /// same intent (same key, same body).
    #[arg(long, env = "LOADGEN_ZIPF_S", default_value_t = 1.1)]
    pub(crate) zipf_s: f64,

    /// Size of the key space the Zipf draw is over (ignored when --zipf-s is 0).
    /// With --hot-keys N, the cold draws cover N+1..=N+keys instead.
    #[arg(long, env = "LOADGEN_KEYS", default_value_t = 50_000_000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000_000_000))]
    pub(crate) keys: u64,

    /// Size of the hot key class: key indexes 1..=N. 0 = no hot class (keys
    /// are drawn as --zipf-s and --keys say). With N > 0, a share --hot-share
    /// of the new intents draws its index from 1..=N (Zipf(N, --zipf-s), or
    /// uniform when --zipf-s is 0): a re-drawn index is the same intent, so
    /// each hot key gets many sends, concurrently. The other intents are cold:
    /// drawn as without a hot class but offset by N (fresh indexes N+1, N+2,
    /// ... when --zipf-s is 0, else N + Zipf(--keys)), so no cold key is ever
    /// hot. The report splits sends, outcomes and latency by class.
    #[arg(long, env = "LOADGEN_HOT_KEYS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000_000_000))]
    pub(crate) hot_keys: u64,

    /// Fraction (0 to 1) of new intents drawn from the hot class 1..=--hot-keys;
    /// the rest are cold. Ignored when --hot-keys is 0.
    #[arg(long, env = "LOADGEN_HOT_SHARE", default_value_t = 0.5)]
    pub(crate) hot_share: f64,

    /// Key prefix; keys are `{prefix}-{index}`. Default: a random 8-hex-digit
    /// run id, so runs against one database never share keys. Reusing a prefix
    /// with the same --seed replays the earlier run's intents; with another
    /// seed, reused keys carry different bodies and get 409.
    #[arg(long, env = "LOADGEN_KEY_PREFIX")]
    pub(crate) key_prefix: Option<String>,

    /// Seed of every random draw (keys, retries, protocol choice) and of the
    /// bodies. Default: random (printed in the summary, to reproduce a run).
    #[arg(long, env = "LOADGEN_SEED")]
    pub(crate) seed: Option<u64>,

    /// Fraction of first attempts that get retried (1 to 3 extra sends with the same key and body).
    #[arg(long, env = "LOADGEN_RETRY_RATE", default_value_t = 0.15)]
    pub(crate) retry_rate: f64,

    /// Each retry is either sent at the original's scheduled instant (probability 1/2)
    /// or after a delay uniform in 0..this many milliseconds, like a proxy timeout.
    #[arg(long, env = "LOADGEN_RETRY_DELAY_MS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub(crate) retry_delay_ms: u64,

    /// Retry a send that got no definitive answer (connection refused or
    /// broken, timeout, 408, 5xx, gRPC CANCELLED/DEADLINE_EXCEEDED/UNAVAILABLE/
    /// INTERNAL/UNKNOWN) with the same key and body, up to this many times,
    /// like a client that retries errors. Other 4xx answers are definitive
    /// and never retried. 0 = off.
    #[arg(long, env = "LOADGEN_RETRY_ON_ERROR", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=20))]
    pub(crate) retry_on_error: u32,

    /// Pause before each retry of an error, in milliseconds.
    #[arg(long, env = "LOADGEN_RETRY_ON_ERROR_DELAY_MS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub(crate) retry_on_error_delay_ms: u64,

    /// Tokio worker threads (1 = a single-threaded runtime; the machine is shared
    /// with the service and Postgres, so keep it small).
    #[arg(long, env = "LOADGEN_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(crate) threads: u64,

    /// Write the summary as JSON (stable field names, parameters included) to this file.
    #[arg(long, env = "LOADGEN_JSON")]
    pub(crate) json: Option<PathBuf>,

    /// Write a per-second CSV `second,sent,ok,errors,p99_ms` to this file. Rows
    /// group sends by the second they were scheduled in; errors are every
    /// non-ok outcome (error status, transport error, timeout).
    #[arg(long, env = "LOADGEN_CSV")]
    pub(crate) csv: Option<PathBuf>,

    /// Write a per-minute CSV `minute,sent,ok,errors,sent_per_s,p50_ms,p99_ms,p999_ms,max_ms`
    /// to this file: the per-second rows merged by minute (scheduled time),
    /// the percentiles from the merged latency histograms (2 significant
    /// digits) of the answered sends.
    #[arg(long, env = "LOADGEN_MINUTE_CSV")]
    pub(crate) minute_csv: Option<PathBuf>,

    /// A file holding the bearer token every request carries (`orders
    /// --auth-tokens-file`; `orders new-token` mints one), readable by its
    /// owner only. The token's caller (`CALLER.SECRET`) scopes the keys:
    /// the --intents, --ambiguous and --failed lines name it, so `recon
    /// --intents` reads each key in its caller's scope.
    #[arg(long, env = "LOADGEN_TOKEN_FILE")]
    pub(crate) token_file: Option<PathBuf>,

    /// Write the client-side ground truth: one line `{key}\t{order_id}` per
    /// distinct key that got a success, sorted by key (byte order); with
    /// --token-file, `{key}\t{order_id}\t{caller}`.
    #[arg(long, env = "LOADGEN_INTENTS")]
    pub(crate) intents: Option<PathBuf>,

    /// Write the ambiguous keys, one per line (`{key}\t{caller}` with
    /// --token-file), sorted: no success, but at
    /// least one send that may have committed (timed out or broke after it
    /// may have reached the service, or answered 408 or 5xx, which orders
    /// may give for a request it commits). Each holds 0 or 1 order.
    /// Default when --intents is given: `{intents}.ambiguous`.
    #[arg(long, env = "LOADGEN_AMBIGUOUS")]
    pub(crate) ambiguous: Option<PathBuf>,

    /// Write the refused keys, one per line (`{key}\t{caller}` with
    /// --token-file), sorted: no success, and every
    /// send refused before anything was written (a 4xx other than 408 and
    /// 409) or never sent. Each must hold no order (`recon --intents`
    /// checks). Default when --intents is given: `{intents}.failed`.
    #[arg(long, env = "LOADGEN_FAILED")]
    pub(crate) failed: Option<PathBuf>,

    /// Progress on stderr.
    #[arg(long, env = "LOADGEN_PROGRESS", value_enum, default_value_t = ProgressMode::Auto)]
    pub(crate) progress: ProgressMode,
}

/// Validated settings, with the defaults that are drawn at random resolved.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// HTTP base URLs (one per orders instance), without a trailing slash.
    pub(crate) http_urls: Vec<String>,
    /// gRPC URLs (one per orders instance).
    pub(crate) grpc_urls: Vec<String>,
    /// How sends are spread over the instances.
    pub(crate) spread: Spread,
    /// Protocol choice.
    pub(crate) protocol: Protocol,
    /// First attempts per second.
    pub(crate) rate: f64,
    /// Send window.
    pub(crate) duration: Duration,
    /// In-flight bound.
    pub(crate) max_in_flight: usize,
    /// Per-request timeout.
    pub(crate) timeout: Duration,
    /// Grace after the send window before the hard stop.
    pub(crate) drain_timeout: Duration,
    /// Zipf exponent (0 = unique keys).
    pub(crate) zipf_s: f64,
    /// Key space size for the Zipf draw.
    pub(crate) keys: u64,
    /// Hot class 1..=hot_keys (0 = none).
    pub(crate) hot_keys: u64,
    /// Fraction of new intents drawn from the hot class.
    pub(crate) hot_share: f64,
    /// Resolved key prefix.
    pub(crate) key_prefix: String,
    /// Resolved seed.
    pub(crate) seed: u64,
    /// Fraction of first attempts retried.
    pub(crate) retry_rate: f64,
    /// Upper bound of a delayed retry's delay.
    pub(crate) retry_delay: Duration,
    /// Retries of a send without a definitive answer.
    pub(crate) retry_on_error: u32,
    /// Pause before each of them.
    pub(crate) retry_on_error_delay: Duration,
    /// Runtime worker threads.
    pub(crate) threads: usize,
    /// Output files.
    pub(crate) json: Option<PathBuf>,
    /// Per-second CSV.
    pub(crate) csv: Option<PathBuf>,
    /// Per-minute CSV.
    pub(crate) minute_csv: Option<PathBuf>,
    /// Successful keys file.
    pub(crate) intents: Option<PathBuf>,
    /// Ambiguous keys file (resolved default).
    pub(crate) ambiguous: Option<PathBuf>,
    /// Refused keys file (resolved default).
    pub(crate) failed: Option<PathBuf>,
    /// Progress display.
    pub(crate) progress: ProgressMode,
    /// The bearer token every request carries.
    pub(crate) token: Option<Token>,
}

/// A bearer token (`CALLER.SECRET`).
#[derive(Clone)]
pub(crate) struct Token {
    /// The whole token.
    pub(crate) value: String,
    /// Its caller: the scope of the keys.
    pub(crate) caller: String,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("caller", &self.caller)
            .finish_non_exhaustive()
    }
}

impl Token {
    /// The token in the file at `path` (its first line, trimmed); the file
    /// must be its owner's alone.
    fn read(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = pipeline::config::read_private(path).map_err(anyhow::Error::msg)?;
        let value = text.lines().next().unwrap_or_default().trim().to_owned();
        let Some(caller) = pipeline::contract::token_caller(&value).map(str::to_owned) else {
            bail!(
                "{}: not a token (CALLER.SECRET on the first line; `orders new-token` mints one)",
                path.display()
            );
        };
        Ok(Self { value, caller })
    }
}

/// The run parameters as written to the JSON report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Params {
    /// Protocol choice.
    pub(crate) protocol: Protocol,
    /// HTTP base URLs.
    pub(crate) http_urls: Vec<String>,
    /// gRPC URLs.
    pub(crate) grpc_urls: Vec<String>,
    /// How sends are spread over the instances.
    pub(crate) spread: Spread,
    /// First attempts per second.
    pub(crate) rate: f64,
    /// Send window in seconds.
    pub(crate) duration_s: u64,
    /// In-flight bound.
    pub(crate) max_in_flight: usize,
    /// Per-request timeout.
    pub(crate) timeout_ms: u64,
    /// Drain grace in seconds.
    pub(crate) drain_timeout_s: u64,
    /// Zipf exponent.
    pub(crate) zipf_s: f64,
    /// Key space size.
    pub(crate) keys: u64,
    /// Hot class 1..=hot_keys (0 = none).
    pub(crate) hot_keys: u64,
    /// Fraction of new intents drawn from the hot class.
    pub(crate) hot_share: f64,
    /// Key prefix.
    pub(crate) key_prefix: String,
    /// Seed.
    pub(crate) seed: u64,
    /// Retry fraction.
    pub(crate) retry_rate: f64,
    /// Retry delay bound.
    pub(crate) retry_delay_ms: u64,
    /// Retries of an error.
    pub(crate) retry_on_error: u32,
    /// Pause before each.
    pub(crate) retry_on_error_delay_ms: u64,
    /// Worker threads.
    pub(crate) threads: usize,
}

impl Config {
    /// Checks the values clap cannot and draws the random defaults.
    pub(crate) fn resolve(self) -> anyhow::Result<Settings> {
        if !(self.rate.is_finite() && self.rate > 0.0 && self.rate <= 1_000_000.0) {
            bail!("--rate must be > 0 and at most 1000000, got {}", self.rate);
        }
        if !(self.zipf_s.is_finite() && self.zipf_s >= 0.0) {
            bail!("--zipf-s must be a finite number >= 0, got {}", self.zipf_s);
        }
        if !(self.hot_share.is_finite() && (0.0..=1.0).contains(&self.hot_share)) {
            bail!(
                "--hot-share must be between 0 and 1, got {}",
                self.hot_share
            );
        }
        if !(self.retry_rate.is_finite() && (0.0..=1.0).contains(&self.retry_rate)) {
            bail!(
                "--retry-rate must be between 0 and 1, got {}",
                self.retry_rate
            );
        }
        let key_prefix = match self.key_prefix {
            Some(prefix) => {
                keys::validate_prefix(&prefix).context("--key-prefix")?;
                prefix
            }
            None => keys::random_prefix(),
        };
        let token = self
            .token_file
            .as_deref()
            .map(Token::read)
            .transpose()
            .context("--token-file")?;
        let http_urls = urls("--http-url", &self.http_url)?;
        let grpc_urls = urls("--grpc-url", &self.grpc_url)?;
        let beside_intents = |suffix: &str| {
            self.intents.as_ref().map(|p| {
                let mut name = p.clone().into_os_string();
                name.push(suffix);
                PathBuf::from(name)
            })
        };
        let ambiguous = self.ambiguous.or_else(|| beside_intents(".ambiguous"));
        let failed = self.failed.or_else(|| beside_intents(".failed"));
        Ok(Settings {
            http_urls,
            grpc_urls,
            spread: self.spread,
            protocol: self.protocol,
            rate: self.rate,
            duration: Duration::from_secs(self.duration),
            max_in_flight: usize::try_from(self.max_in_flight).unwrap_or(usize::MAX),
            timeout: Duration::from_millis(self.timeout_ms),
            drain_timeout: Duration::from_secs(self.drain_timeout),
            zipf_s: self.zipf_s,
            keys: self.keys,
            hot_keys: self.hot_keys,
            hot_share: self.hot_share,
            key_prefix,
            seed: self.seed.unwrap_or_else(rand::random),
            retry_rate: self.retry_rate,
            retry_delay: Duration::from_millis(self.retry_delay_ms),
            retry_on_error: self.retry_on_error,
            retry_on_error_delay: Duration::from_millis(self.retry_on_error_delay_ms),
            threads: usize::try_from(self.threads).unwrap_or(1),
            json: self.json,
            csv: self.csv,
            minute_csv: self.minute_csv,
            intents: self.intents,
            ambiguous,
            failed,
            progress: self.progress,
            token,
        })
    }
}

impl Settings {
    /// Whether HTTP is used at all.
    pub(crate) fn uses_http(&self) -> bool {
        matches!(self.protocol, Protocol::Http | Protocol::Mixed)
    }

    /// Whether gRPC is used at all.
    pub(crate) fn uses_grpc(&self) -> bool {
        matches!(self.protocol, Protocol::Grpc | Protocol::Mixed)
    }

    /// The parameters for the report.
    pub(crate) fn params(&self) -> Params {
        Params {
            protocol: self.protocol,
            http_urls: self.http_urls.clone(),
            grpc_urls: self.grpc_urls.clone(),
            spread: self.spread,
            rate: self.rate,
            duration_s: self.duration.as_secs(),
            max_in_flight: self.max_in_flight,
            timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            drain_timeout_s: self.drain_timeout.as_secs(),
            zipf_s: self.zipf_s,
            keys: self.keys,
            hot_keys: self.hot_keys,
            hot_share: self.hot_share,
            key_prefix: self.key_prefix.clone(),
            seed: self.seed,
            retry_rate: self.retry_rate,
            retry_delay_ms: u64::try_from(self.retry_delay.as_millis()).unwrap_or(u64::MAX),
            retry_on_error: self.retry_on_error,
            retry_on_error_delay_ms: u64::try_from(self.retry_on_error_delay.as_millis())
                .unwrap_or(u64::MAX),
            threads: self.threads,
        }
    }
}

/// Most instances one protocol's sends are spread over.
pub(crate) const MAX_TARGETS: usize = 64;

/// The URLs of one flag, checked: plain `http://`, no trailing slash, at
/// least one, at most [`MAX_TARGETS`], none twice (a repeated instance would
/// take two shares of the load, which is never what was meant).
fn urls(flag: &str, given: &[String]) -> anyhow::Result<Vec<String>> {
    let mut out: Vec<String> = Vec::with_capacity(given.len());
    for url in given {
        let url = url.trim().trim_end_matches('/').to_owned();
        if !url.starts_with("http://") || url.len() == "http://".len() {
            bail!("{flag} must be plain http:// URLs, got {url:?}");
        }
        if out.contains(&url) {
            bail!("{flag} names {url} twice");
        }
        out.push(url);
    }
    if out.is_empty() {
        bail!("{flag} needs at least one URL");
    }
    if out.len() > MAX_TARGETS {
        bail!("{flag}: at most {MAX_TARGETS} URLs, got {}", out.len());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> anyhow::Result<Settings> {
        let mut argv = vec!["loadgen"];
        argv.extend_from_slice(args);
        Config::try_parse_from(argv)?.resolve()
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Config::command().debug_assert();
    }

    #[test]
    fn defaults_resolve() {
        let s = parse(&[]).expect("defaults");
        assert_eq!(s.protocol, Protocol::Http);
        assert_eq!(s.max_in_flight, 4096);
        assert_eq!(s.timeout, Duration::from_millis(2000));
        assert_eq!(s.key_prefix.len(), 8);
        assert!(s.ambiguous.is_none());
        assert!(s.failed.is_none());
        assert_eq!(s.hot_keys, 0, "no hot class by default");
        assert!((s.hot_share - 0.5).abs() < f64::EPSILON);
    }

    #[test]
    fn hot_keys_flags_resolve_and_reach_the_params() {
        let s = parse(&["--hot-keys", "100", "--hot-share", "0.9"]).expect("settings");
        assert_eq!(s.hot_keys, 100);
        assert!((s.hot_share - 0.9).abs() < f64::EPSILON);
        let p = s.params();
        assert_eq!(p.hot_keys, 100);
        let json = serde_json::to_value(&p).expect("json");
        assert_eq!(json["hot_keys"], 100);
        assert_eq!(json["hot_share"], 0.9);
        assert!(parse(&["--hot-keys", "1", "--hot-share", "0"]).is_ok());
        assert!(parse(&["--hot-keys", "1", "--hot-share", "1"]).is_ok());
    }

    #[test]
    fn ambiguous_and_failed_default_next_to_intents() {
        let s = parse(&["--intents", "/tmp/x.txt"]).expect("settings");
        assert_eq!(s.ambiguous, Some(PathBuf::from("/tmp/x.txt.ambiguous")));
        assert_eq!(s.failed, Some(PathBuf::from("/tmp/x.txt.failed")));
        let s = parse(&[
            "--intents",
            "/tmp/x.txt",
            "--ambiguous",
            "/tmp/a",
            "--failed",
            "/tmp/f",
        ])
        .expect("settings");
        assert_eq!(s.ambiguous, Some(PathBuf::from("/tmp/a")));
        assert_eq!(s.failed, Some(PathBuf::from("/tmp/f")));
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(parse(&["--rate", "0"]).is_err());
        assert!(parse(&["--rate", "NaN"]).is_err());
        assert!(parse(&["--zipf-s", "-1"]).is_err());
        assert!(parse(&["--retry-rate", "1.5"]).is_err());
        assert!(parse(&["--hot-share", "1.5"]).is_err());
        assert!(parse(&["--hot-share", "-0.1"]).is_err());
        assert!(parse(&["--hot-share", "NaN"]).is_err());
        assert!(parse(&["--hot-keys", "-1"]).is_err());
        assert!(parse(&["--hot-keys", "1000000000001"]).is_err());
        assert!(parse(&["--key-prefix", "has space"]).is_err());
        assert!(parse(&["--http-url", "https://x"]).is_err());
        assert!(parse(&["--duration", "0"]).is_err());
        assert!(parse(&["--http-url", "http://h:1/"]).is_ok_and(|s| s.http_urls == ["http://h:1"]));
    }

    #[test]
    fn several_instances_are_listed_or_repeated_and_checked() {
        let s = parse(&[
            "--http-url",
            "http://a:1,http://b:2/",
            "--grpc-url",
            "http://c:3",
        ])
        .expect("settings");
        assert_eq!(s.http_urls, ["http://a:1", "http://b:2"]);
        assert_eq!(s.grpc_urls, ["http://c:3"]);
        assert_eq!(s.spread, Spread::RoundRobin);
        let s = parse(&[
            "--http-url",
            "http://a:1",
            "--http-url",
            "http://b:2",
            "--spread",
            "random",
        ])
        .expect("repeated");
        assert_eq!(s.http_urls, ["http://a:1", "http://b:2"]);
        assert_eq!(s.spread, Spread::Random);
        let json = serde_json::to_value(s.params()).expect("json");
        assert_eq!(json["http_urls"][1], "http://b:2");
        assert_eq!(json["spread"], "random");
        for bad in [
            "http://a:1,http://a:1/",
            "http://a:1,https://b:2",
            "http://a:1,",
            "http://",
        ] {
            let err = parse(&["--http-url", bad]).expect_err(bad).to_string();
            assert!(err.contains("--http-url"), "{bad}: {err}");
        }
        let many: Vec<String> = (0..=MAX_TARGETS).map(|i| format!("http://h:{i}")).collect();
        assert!(parse(&["--grpc-url", &many.join(",")]).is_err());
    }
}
