//! The wait between retries of the same work after a transient failure.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Exponential backoff, 50 ms doubling to 5 s, cut short by cancellation:
/// the one schedule every retry loop of the pipeline uses (a database that
/// is down, a lost LISTEN connection). [`Backoff::between`] takes other
/// bounds, for a loop whose wait is not a failure's (work another process
/// holds).
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    /// The first wait.
    pub const MIN: Duration = Duration::from_millis(50);
    /// The longest wait.
    pub const MAX: Duration = Duration::from_secs(5);

    /// Starts at [`Backoff::MIN`], doubles up to [`Backoff::MAX`].
    pub fn new() -> Self {
        Self::between(Self::MIN, Self::MAX)
    }

    /// Starts at `min`, doubles up to `max` (at least `min`).
    pub fn between(min: Duration, max: Duration) -> Self {
        Self {
            next: min,
            min,
            max: max.max(min),
        }
    }

    /// The wait [`Backoff::wait`] would sleep now.
    pub fn next(&self) -> Duration {
        self.next
    }

    /// Back to the first wait, after a success.
    pub fn reset(&mut self) {
        self.next = self.min;
    }

    /// Sleeps the current wait, then doubles it (up to the longest).
    /// `false` when `cancel` fired first.
    pub async fn wait(&mut self, cancel: &CancellationToken) -> bool {
        tokio::select! {
            () = tokio::time::sleep(self.next) => {}
            () = cancel.cancelled() => return false,
        }
        self.next = (self.next * 2).min(self.max);
        true
    }

    /// Runs `attempt` until it succeeds, fails with an error `retryable`
    /// does not accept, or the next wait of this schedule would end past
    /// `patience` from now: its last error then. A start-up's wait for a
    /// database or a peer that is being restarted.
    pub async fn retry_within<T, E, F, Fut>(
        mut self,
        patience: Duration,
        retryable: impl Fn(&E) -> bool,
        mut attempt: F,
    ) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        let deadline = tokio::time::Instant::now() + patience;
        let never = CancellationToken::new();
        loop {
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(error)
                    if retryable(&error) && tokio::time::Instant::now() + self.next < deadline =>
                {
                    self.wait(&never).await;
                }
                Err(error) => return Err(error),
            }
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn doubles_to_the_cap_resets_and_stops_on_cancel() {
        let cancel = CancellationToken::new();
        let mut backoff = Backoff::new();
        let mut seen = Vec::new();
        for _ in 0..9 {
            seen.push(backoff.next().as_millis());
            assert!(backoff.wait(&cancel).await);
        }
        assert_eq!(seen, [50, 100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        backoff.reset();
        assert_eq!(backoff.next(), Backoff::MIN);
        cancel.cancel();
        assert!(!backoff.wait(&cancel).await, "a cancelled wait says so");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_within_tries_again_what_may_pass_until_its_patience_ends() {
        let ms = Duration::from_millis;
        let tries = std::cell::Cell::new(0);
        let flaky = || {
            tries.set(tries.get() + 1);
            let n = tries.get();
            async move { if n < 3 { Err("down") } else { Ok(n) } }
        };
        let backoff = Backoff::between(ms(100), ms(100));
        assert_eq!(
            backoff
                .clone()
                .retry_within(ms(1_000), |_| true, flaky)
                .await,
            Ok(3)
        );
        tries.set(0);
        let started = tokio::time::Instant::now();
        let down = || {
            tries.set(tries.get() + 1);
            async { Err::<(), _>("down") }
        };
        assert_eq!(
            backoff.clone().retry_within(ms(450), |_| true, down).await,
            Err("down")
        );
        assert_eq!(tries.get(), 5, "tries at 0, 100, 200, 300 and 400 ms");
        assert_eq!(started.elapsed(), ms(400));
        tries.set(0);
        assert_eq!(
            backoff
                .retry_within(
                    ms(1_000),
                    |e| *e != "refused",
                    || {
                        tries.set(tries.get() + 1);
                        async { Err::<(), _>("refused") }
                    }
                )
                .await,
            Err("refused")
        );
        assert_eq!(tries.get(), 1, "what cannot pass is not tried again");
    }

    #[tokio::test(start_paused = true)]
    async fn other_bounds_double_from_the_first_to_the_longest() {
        let cancel = CancellationToken::new();
        let ms = Duration::from_millis;
        let mut backoff = Backoff::between(ms(5), ms(100));
        let mut seen = Vec::new();
        for _ in 0..7 {
            seen.push(backoff.next().as_millis());
            let started = tokio::time::Instant::now();
            assert!(backoff.wait(&cancel).await);
            assert_eq!(started.elapsed(), ms(*seen.last().expect("a wait") as u64));
        }
        assert_eq!(seen, [5, 10, 20, 40, 80, 100, 100]);
        backoff.reset();
        assert_eq!(backoff.next(), ms(5));
        let mut inverted = Backoff::between(ms(5), ms(1));
        assert!(inverted.wait(&cancel).await);
        assert_eq!(
            inverted.next(),
            ms(5),
            "a longest under the first is the first"
        );
    }
}
