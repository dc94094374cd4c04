//! The NOTIFY that wakes the poll loops and the webhook fan-out when orders
//! commits an outbox row; a lost LISTEN connection comes back with backoff,
//! and the loops poll meanwhile.

use std::sync::Arc;
use std::time::{Duration, Instant};

use effectively::retry::Backoff;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;

/// Wakes the workers on every `NOTIFY orders_outbox` (sent on commit). A lost
/// connection is re-established with [`Backoff`] (reset once a LISTEN
/// succeeds); the workers poll meanwhile.
pub(crate) async fn listen(
    pool: PgPool,
    wake: watch::Sender<u64>,
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
    wake: &watch::Sender<u64>,
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
    wake.send_modify(|g| *g = g.wrapping_add(1));
    loop {
        tokio::select! {
            n = listener.try_recv() => match n {
                Ok(Some(_)) => wake.send_modify(|g| *g = g.wrapping_add(1)),
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
