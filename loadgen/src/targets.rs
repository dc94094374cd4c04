//! The orders instances a run sends to: one client per URL, each probed
//! before the clock starts; which instance a send goes to ([`Spreader`]);
//! and what each instance was sent and answered, for the report.
//!
//! Several instances behind no balancer of ours: the spread is the client's,
//! so one key's first attempt and its retries reach different instances, and
//! the replay check (`verify.rs`) compares answers across them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use rand::Rng;
use rand::rngs::StdRng;
use serde::Serialize;

use effectively::retry::Backoff;

use crate::client::{GrpcTarget, HttpTarget};
use crate::config::{Settings, Spread};
use crate::keys::Body;
use crate::outcome::Outcome;
use crate::verify::Via;

/// Shortest time the reachability probe is given.
const MIN_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long an instance is probed again before the run gives up on it: one
/// that is being restarted (chaos kills and restarts instances from the
/// start of its load) answers within this; one that is down or is not the
/// Orders service fails the run with the last probe's error.
const PROBE_PATIENCE: Duration = Duration::from_secs(10);

/// The pause between two probes of one instance.
const PROBE_PAUSE: Duration = Duration::from_millis(200);

/// Runs `probe` every [`PROBE_PAUSE`] until it succeeds or `patience` has
/// passed; the last error then.
async fn patiently<T, F, Fut>(patience: Duration, probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    Backoff::between(PROBE_PAUSE, PROBE_PAUSE)
        .retry_within(patience, |_| true, probe)
        .await
}

/// One instance's counts.
#[derive(Debug, Default)]
struct Counts {
    sent: AtomicU64,
    ok: AtomicU64,
}

/// Every instance of the protocols the run uses.
#[derive(Debug)]
pub(crate) struct Targets {
    http: Vec<(String, HttpTarget, Counts)>,
    grpc: Vec<(String, GrpcTarget, Counts)>,
}

/// What one instance was sent, in the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct TargetReport {
    /// `http` or `grpc`.
    pub(crate) protocol: &'static str,
    /// Its URL.
    pub(crate) url: String,
    /// Sends that went to it (retries included).
    pub(crate) sent: u64,
    /// Of which answered with a success.
    pub(crate) ok: u64,
}

impl Targets {
    /// Builds a client for every URL of the protocols in use and probes each
    /// (for up to [`PROBE_PATIENCE`]), so an unreachable instance fails the
    /// run clearly before its clock starts.
    pub(crate) async fn connect(settings: &Settings) -> anyhow::Result<Self> {
        let probe_timeout = settings.timeout.max(MIN_PROBE_TIMEOUT);
        let mut http = Vec::new();
        if settings.uses_http() {
            for url in &settings.http_urls {
                let target = HttpTarget::new(url, settings.timeout, settings.token.as_ref())?;
                patiently(PROBE_PATIENCE, || target.probe(probe_timeout))
                    .await
                    .with_context(|| {
                        format!("HTTP target {url} is not reachable or not the Orders service")
                    })?;
                http.push((url.clone(), target, Counts::default()));
            }
        }
        let mut grpc = Vec::new();
        if settings.uses_grpc() {
            for url in &settings.grpc_urls {
                let target = patiently(PROBE_PATIENCE, || {
                    GrpcTarget::connect(
                        url,
                        probe_timeout,
                        settings.max_in_flight,
                        settings.token.as_ref(),
                    )
                })
                .await
                .with_context(|| format!("gRPC target {url} is not reachable"))?;
                patiently(PROBE_PATIENCE, || target.probe(probe_timeout))
                    .await
                    .with_context(|| {
                        format!("gRPC target {url} is not reachable or not the Orders service")
                    })?;
                grpc.push((url.clone(), target, Counts::default()));
            }
        }
        Ok(Self { http, grpc })
    }

    /// How many instances `via` has (0 when the run does not use it).
    pub(crate) fn len(&self, via: Via) -> usize {
        match via {
            Via::Http => self.http.len(),
            Via::Grpc => self.grpc.len(),
        }
    }

    /// Sends one create to instance `index` of `via` (wrapped into range).
    pub(crate) async fn create(&self, via: Via, index: usize, key: &str, body: Body) -> Outcome {
        match via {
            Via::Http => match nth(&self.http, index) {
                Some((_, target, counts)) => counted(counts, target.create(key, body)).await,
                None => Outcome::NotSent,
            },
            Via::Grpc => match nth(&self.grpc, index) {
                Some((_, target, counts)) => counted(counts, target.create(key, body)).await,
                None => Outcome::NotSent,
            },
        }
    }

    /// Each instance's counts, HTTP first, in the order of the flags.
    pub(crate) fn report(&self) -> Vec<TargetReport> {
        let row = |protocol, url: &String, counts: &Counts| TargetReport {
            protocol,
            url: url.clone(),
            sent: counts.sent.load(Ordering::Acquire),
            ok: counts.ok.load(Ordering::Acquire),
        };
        self.http
            .iter()
            .map(|(url, _, c)| row("http", url, c))
            .chain(self.grpc.iter().map(|(url, _, c)| row("grpc", url, c)))
            .collect()
    }
}

/// Instance `index` of `list`, wrapped into range; `None` if it is empty.
fn nth<T>(list: &[T], index: usize) -> Option<&T> {
    list.get(index % list.len().max(1))
}

/// Runs one send to an instance, counting it and its success.
async fn counted(counts: &Counts, send: impl Future<Output = Outcome>) -> Outcome {
    counts.sent.fetch_add(1, Ordering::Relaxed);
    let outcome = send.await;
    if matches!(outcome, Outcome::Ok(_)) {
        counts.ok.fetch_add(1, Ordering::Relaxed);
    }
    outcome
}

/// Picks the instance of each send, in the scheduler (so a seed reproduces
/// the choice): in turn per protocol, or drawn. With one instance nothing is
/// drawn, so a single-instance run's random sequence is what it always was.
#[derive(Debug)]
pub(crate) struct Spreader {
    spread: Spread,
    http: usize,
    grpc: usize,
    next: [usize; 2],
}

impl Spreader {
    /// For `http` HTTP and `grpc` gRPC instances.
    pub(crate) fn new(spread: Spread, http: usize, grpc: usize) -> Self {
        Self {
            spread,
            http,
            grpc,
            next: [0, 0],
        }
    }

    /// The instance of the next send over `via`.
    pub(crate) fn pick(&mut self, via: Via, rng: &mut StdRng) -> usize {
        let (n, slot) = match via {
            Via::Http => (self.http, 0),
            Via::Grpc => (self.grpc, 1),
        };
        if n <= 1 {
            return 0;
        }
        match self.spread {
            Spread::RoundRobin => {
                let index = self.next[slot] % n;
                self.next[slot] = index + 1;
                index
            }
            Spread::Random => rng.random_range(0..n),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[tokio::test]
    async fn an_instance_being_restarted_is_probed_again_and_one_that_stays_down_fails() {
        let mut tries = 0;
        let got = patiently(Duration::from_secs(5), || {
            tries += 1;
            let n = tries;
            async move {
                if n < 3 {
                    anyhow::bail!("connection refused ({n})")
                }
                Ok(n)
            }
        })
        .await;
        assert_eq!(got.expect("up on the third probe"), 3);

        let mut tries = 0;
        let error = patiently(Duration::from_millis(700), || {
            tries += 1;
            let n = tries;
            async move { anyhow::bail!("connection refused ({n})") as anyhow::Result<()> }
        })
        .await
        .expect_err("never up");
        assert!(tries >= 3, "probed again meanwhile: {tries}");
        assert_eq!(
            error.to_string(),
            format!("connection refused ({tries})"),
            "the last error"
        );
    }

    #[test]
    fn round_robin_takes_each_protocols_instances_in_turn() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut s = Spreader::new(Spread::RoundRobin, 3, 2);
        let http: Vec<usize> = (0..7).map(|_| s.pick(Via::Http, &mut rng)).collect();
        assert_eq!(http, [0, 1, 2, 0, 1, 2, 0]);
        let grpc: Vec<usize> = (0..4).map(|_| s.pick(Via::Grpc, &mut rng)).collect();
        assert_eq!(grpc, [0, 1, 0, 1], "each protocol has its own turn");
        assert_eq!(s.pick(Via::Http, &mut rng), 1);
    }

    #[test]
    fn random_covers_every_instance_evenly_and_a_seed_reproduces_it() {
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut s = Spreader::new(Spread::Random, 4, 1);
            (0..4_000)
                .map(|_| s.pick(Via::Http, &mut rng))
                .collect::<Vec<_>>()
        };
        let picks = draw(7);
        assert_eq!(picks, draw(7));
        assert_ne!(picks, draw(8));
        for i in 0..4 {
            let n = picks.iter().filter(|&&p| p == i).count();
            assert!((850..=1150).contains(&n), "instance {i}: {n} of 4000");
        }
    }

    #[test]
    fn one_instance_draws_nothing_from_the_seed() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut s = Spreader::new(Spread::Random, 1, 0);
        assert_eq!(s.pick(Via::Http, &mut rng), 0);
        assert_eq!(s.pick(Via::Grpc, &mut rng), 0);
        let mut fresh = StdRng::seed_from_u64(3);
        assert_eq!(rng.random::<u64>(), fresh.random::<u64>());
    }
}
