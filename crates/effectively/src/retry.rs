//! The wait between retries of the same work after a transient failure.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Exponential backoff, 50 ms doubling to 5 s, cut short by cancellation:
/// the one schedule every retry loop of the pipeline uses (a database that
/// is down, a lost LISTEN connection).
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    /// The first wait.
    pub const MIN: Duration = Duration::from_millis(50);
    /// The longest wait.
    pub const MAX: Duration = Duration::from_secs(5);

    /// Starts at [`Backoff::MIN`].
    pub fn new() -> Self {
        Self { next: Self::MIN }
    }

    /// The wait [`Backoff::wait`] would sleep now.
    pub fn next(&self) -> Duration {
        self.next
    }

    /// Back to [`Backoff::MIN`], after a success.
    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }

    /// Sleeps the current wait, then doubles it (up to [`Backoff::MAX`]).
    /// `false` when `cancel` fired first.
    pub async fn wait(&mut self, cancel: &CancellationToken) -> bool {
        tokio::select! {
            () = tokio::time::sleep(self.next) => {}
            () = cancel.cancelled() => return false,
        }
        self.next = (self.next * 2).min(Self::MAX);
        true
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
}
