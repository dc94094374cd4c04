//! The NOTIFY that wakes the poll loops and the webhook fan-out when orders
//! commits an outbox row; a lost LISTEN connection comes back with backoff,
//! and the loops poll meanwhile. A NOTIFY that names its rows' shards
//! (orders' [`effectively::outbox::Notifier`]) wakes only those shards'
//! loops: the others would claim nothing, a transaction each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use effectively::outbox::{ALL_SHARDS, shards_of_payload};
use effectively::retry::Backoff;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;
use crate::outbox::SHARDS;

/// The relay's wake-ups: one per shard, for its poll loops, and one for a
/// row of any shard, for the webhook fan-out. Each is a generation number a
/// loop waits to see change.
#[derive(Debug)]
pub(crate) struct Wakes {
    shards: Vec<watch::Sender<u64>>,
    any: watch::Sender<u64>,
}

impl Wakes {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            shards: (0..SHARDS).map(|_| watch::channel(0).0).collect(),
            any: watch::channel(0).0,
        })
    }

    /// What wakes the loops of `shard`.
    pub(crate) fn shard(&self, shard: i16) -> watch::Receiver<u64> {
        let i = usize::try_from(shard)
            .unwrap_or(0)
            .min(self.shards.len() - 1);
        self.shards[i].subscribe()
    }

    /// What wakes on a row of any shard.
    pub(crate) fn any(&self) -> watch::Receiver<u64> {
        self.any.subscribe()
    }

    /// Wakes the shards of `mask` (bit `s`: shard `s`) and the waiters on any.
    pub(crate) fn wake(&self, mask: u16) {
        for (s, tx) in self.shards.iter().enumerate() {
            if mask & (1 << s) != 0 {
                tx.send_modify(|g| *g = g.wrapping_add(1));
            }
        }
        self.any.send_modify(|g| *g = g.wrapping_add(1));
    }
}

/// Wakes the workers on every `NOTIFY orders_outbox` (sent on commit), the
/// shards its payload names. A lost connection is re-established with
/// [`Backoff`] (reset once a LISTEN succeeds); the workers poll meanwhile.
pub(crate) async fn listen(
    pool: PgPool,
    wake: Arc<Wakes>,
    metrics: Arc<RelayMetrics>,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new();
    loop {
        let started = Instant::now();
        match listen_once(&pool, &wake, &cancel).await {
            Ok(()) => return, // cancelled
            Err((error, listened)) => {
                metrics
                    .relay_errors_total
                    .with_label_values(&["listen"])
                    .inc();
                // A LISTEN that held a while starts the schedule again; one
                // cut right after it is established keeps backing off.
                if listened && started.elapsed() >= LISTEN_HELD {
                    backoff.reset();
                }
                tracing::warn!(%error, retry_in_ms = backoff.next().as_millis() as u64, "LISTEN lost; polling meanwhile");
                if !backoff.wait(&cancel).await {
                    return;
                }
            }
        }
    }
}

/// How long a LISTEN connection must have lived for its loss to restart the
/// reconnect backoff from its first delay.
const LISTEN_HELD: Duration = Duration::from_secs(5);

/// One LISTEN connection until it breaks (`Err`, with whether the LISTEN
/// itself had succeeded) or `cancel` fires (`Ok`). The listener does not
/// reconnect by itself: a lost connection ends it, and the caller opens a new
/// one after its backoff — whose first pass finds the rows whose NOTIFY was
/// lost meanwhile.
async fn listen_once(
    pool: &PgPool,
    wake: &Wakes,
    cancel: &CancellationToken,
) -> Result<(), (sqlx::Error, bool)> {
    let mut listener = PgListener::connect_with(pool)
        .await
        .map_err(|e| (e, false))?;
    listener.eager_reconnect(false);
    listener
        .listen(effectively::outbox::NOTIFY_CHANNEL)
        .await
        .map_err(|e| (e, false))?;
    // Rows committed while no one listened are found by the next pass.
    wake.wake(ALL_SHARDS);
    loop {
        tokio::select! {
            n = listener.try_recv() => match n {
                Ok(Some(n)) => wake.wake(shards_of_payload(n.payload())),
                Ok(None) => {
                    let lost = std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "the LISTEN connection was lost",
                    );
                    return Err((sqlx::Error::Io(lost), true));
                }
                Err(error) => return Err((error, true)),
            },
            () = cancel.cancelled() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_reaches_the_shards_of_its_mask_and_the_waiters_on_any() {
        let wakes = Wakes::new();
        let mut three = wakes.shard(3);
        let five = wakes.shard(5);
        let mut any = wakes.any();
        wakes.wake(1 << 3);
        assert!(three.has_changed().expect("open"));
        assert!(!five.has_changed().expect("open"));
        assert!(any.has_changed().expect("open"));
        three.borrow_and_update();
        any.borrow_and_update();
        wakes.wake(ALL_SHARDS);
        assert!(three.has_changed().expect("open") && five.has_changed().expect("open"));
        assert!(any.has_changed().expect("open"));
        let last = wakes.shard(SHARDS - 1);
        wakes.wake(1 << (SHARDS - 1));
        assert_eq!(*last.borrow(), 2, "the last shard's bit is its own");
    }
}
