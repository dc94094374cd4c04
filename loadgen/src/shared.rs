//! The state one run shares between the scheduler, the send tasks and the
//! progress display: its own module so that [`crate::run`] (which owns the
//! run) and [`crate::progress`] (which only reads it) both import it and
//! neither imports the other.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::keys::KeySpace;
use crate::stats::Collector;
use crate::targets::Targets;

/// State shared by the scheduler, the send tasks and the progress display.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Keys and bodies.
    pub(crate) keys: KeySpace,
    /// The orders instances, with a client each.
    pub(crate) targets: Targets,
    /// Per-request timeout.
    pub(crate) timeout: Duration,
    /// The clock's zero.
    pub(crate) start: Instant,
    /// After this instant nothing is sent and outstanding sends are abandoned.
    pub(crate) hard_stop: Instant,
    /// Sends outstanding.
    pub(crate) in_flight: AtomicUsize,
    /// Signalled when `in_flight` drops to 0.
    pub(crate) idle: Notify,
    /// First attempts handed out by the scheduler (sent or dropped).
    pub(crate) first_handed_out: AtomicU64,
    /// Sends that went out.
    pub(crate) sent: AtomicU64,
    /// Sends dropped at the in-flight bound.
    pub(crate) dropped: AtomicU64,
    /// `--retry-on-error`: how often a send that got no definitive answer
    /// is sent again.
    pub(crate) retry_on_error: u32,
    /// `--retry-on-error`: the pause before each of those sends.
    pub(crate) retry_on_error_delay: Duration,
    /// Extra sends made by `--retry-on-error`.
    pub(crate) error_retries: AtomicU64,
    /// Everything the sends found.
    pub(crate) collector: Mutex<Collector>,
}

impl Shared {
    /// The collector. A panic while it was held cannot leave it inconsistent
    /// in a way that matters for counting, so a poisoned lock is taken anyway.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Collector> {
        self.collector
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
