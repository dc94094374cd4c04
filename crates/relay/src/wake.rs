//! The NOTIFY that wakes the poll loops and the webhook fan-out when orders
//! commits an outbox row; a lost LISTEN connection comes back with backoff,
//! and the loops poll meanwhile. A NOTIFY that names its rows' shards
//! (orders' [`pipeline::outbox::Notifier`]) wakes only those shards'
//! loops: the others would claim nothing, a transaction each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use effectively::retry::Backoff;
use pipeline::outbox::{ALL_SHARDS, shards_of_payload};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;
use crate::outbox::SHARDS;

/// The relay's wake-ups: one per group of shards (`--shard-groups`), for
/// its poll loops, and one for a row of any shard, for the webhook fan-out.
/// Each is a generation number a loop waits to see change.
#[derive(Debug)]
pub(crate) struct Wakes {
    groups: Vec<watch::Sender<u64>>,
    any: watch::Sender<u64>,
}

impl Wakes {
    /// Wake-ups for `groups` groups of shards (at least 1, at most
    /// [`SHARDS`]): shard `s` is in group `s % groups`.
    pub(crate) fn new(groups: u8) -> Arc<Self> {
        let groups = i16::from(groups).clamp(1, SHARDS);
        Arc::new(Self {
            groups: (0..groups).map(|_| watch::channel(0).0).collect(),
            any: watch::channel(0).0,
        })
    }

    /// The shards of each group, in group order.
    pub(crate) fn groups(&self) -> Vec<Vec<i16>> {
        let n = self.groups.len();
        (0..n)
            .map(|g| {
                (0..SHARDS)
                    .filter(|s| usize::try_from(*s).unwrap_or(0) % n == g)
                    .collect()
            })
            .collect()
    }

    /// What wakes the loops of `group`.
    pub(crate) fn group(&self, group: usize) -> watch::Receiver<u64> {
        self.groups[group.min(self.groups.len() - 1)].subscribe()
    }

    /// What wakes on a row of any shard.
    pub(crate) fn any(&self) -> watch::Receiver<u64> {
        self.any.subscribe()
    }

    /// Wakes the groups of the shards of `mask` (bit `s`: shard `s`) and the
    /// waiters on any.
    pub(crate) fn wake(&self, mask: u16) {
        let n = self.groups.len();
        for (g, tx) in self.groups.iter().enumerate() {
            if (0..SHARDS).any(|s| mask & (1 << s) != 0 && usize::try_from(s).unwrap_or(0) % n == g)
            {
                tx.send_modify(|n| *n = n.wrapping_add(1));
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
        .listen(pipeline::outbox::NOTIFY_CHANNEL)
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
        let wakes = Wakes::new(SHARDS as u8);
        let mut three = wakes.group(3);
        let five = wakes.group(5);
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
        let last = wakes.group(usize::try_from(SHARDS - 1).expect("positive"));
        wakes.wake(1 << (SHARDS - 1));
        assert_eq!(*last.borrow(), 2, "the last shard's bit is its own");
    }

    #[test]
    fn a_group_holds_every_shard_congruent_to_it_and_wakes_for_any_of_them() {
        let wakes = Wakes::new(4);
        let groups = wakes.groups();
        assert_eq!(groups[1], vec![1, 5, 9, 13]);
        assert_eq!(
            groups.concat().len(),
            usize::try_from(SHARDS).expect("positive")
        );
        let mut one = wakes.group(1);
        let two = wakes.group(2);
        wakes.wake(1 << 13);
        assert!(one.has_changed().expect("open"));
        assert!(!two.has_changed().expect("open"));
        one.borrow_and_update();
        wakes.wake(1 << 14);
        assert!(!one.has_changed().expect("open") && two.has_changed().expect("open"));
        assert_eq!(
            Wakes::new(0).groups(),
            vec![(0..SHARDS).collect::<Vec<_>>()]
        );
        assert_eq!(
            Wakes::new(200).groups().len(),
            usize::try_from(SHARDS).expect("positive")
        );
    }
}
