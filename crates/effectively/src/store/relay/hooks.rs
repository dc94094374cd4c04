//! What a relay tells as it goes: its counts ([`RelayStats`]), and the
//! [`RelayHooks`] called at each [`Stage`] of a pass.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::Pass;
use crate::store::source::Sent;

/// A relay's counts since it was made (export them as you export metrics).
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Rows sent and marked published.
    pub published: AtomicU64,
    /// Rows refused and marked failed.
    pub failed: AtomicU64,
    /// Sends to be tried again (the rows stayed pending).
    pub retried: AtomicU64,
    /// Shard passes skipped because another relay held the shard.
    pub busy: AtomicU64,
    /// Passes whose transaction failed (the database): their rows stay
    /// pending.
    pub errors: AtomicU64,
    /// Rows delivered after an earlier row of their key failed in the same
    /// pass (possible only with a sink that has a key's rows in flight
    /// together, [`Sink::send_in_order`]): published ahead of that row.
    ///
    /// [`Sink::send_in_order`]: super::Sink::send_in_order
    pub reordered: AtomicU64,
    /// Published rows expired ([`Relay::keep_published`]).
    ///
    /// [`Relay::keep_published`]: super::Relay::keep_published
    pub expired: AtomicU64,
    /// Passes that claimed rows and committed.
    pub passes: AtomicU64,
    /// Time those passes spent getting a connection, locking their shards
    /// and claiming, in microseconds (divide by `passes` for a pass's
    /// mean).
    pub claim_micros: AtomicU64,
    /// Time those passes spent sending (the sink's answers), in
    /// microseconds.
    pub send_micros: AtomicU64,
    /// Time those passes spent marking their rows and committing, in
    /// microseconds.
    pub mark_micros: AtomicU64,
}

/// The stage of a pass whose transaction failed ([`RelayHooks::pass_failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Beginning, locking the shards, claiming their rows.
    Claim,
    /// Settling what the sends did ([`Source::settle`]).
    ///
    /// [`Source::settle`]: crate::store::Source::settle
    Settle,
    /// Committing.
    Commit,
}

impl Stage {
    /// Its name: `claim`, `settle`, `commit`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Settle => "settle",
            Self::Commit => "commit",
        }
    }
}

/// What a relay tells its user as a pass goes (metrics, logs, crash points
/// for tests): every method does nothing by default. Called on the pass's
/// task: keep them short.
pub trait RelayHooks: Send + Sync + 'static {
    /// A pass begins (it holds a connection from here to its end).
    fn pass_begins(&self) {}

    /// Every send of a pass was answered (in `took`) and its settle is
    /// about to be written: a crash from here to the commit sends the
    /// delivered rows again.
    fn answered(&self, sent: &Sent, took: Duration) {
        let _ = (sent, took);
    }

    /// A pass ended: committed (or found nothing, or every shard busy).
    fn pass_ended(&self, pass: &Pass) {
        let _ = pass;
    }

    /// A pass's transaction failed at `stage`: its rows stay pending.
    fn pass_failed(&self, stage: Stage, error: &sqlx::Error) {
        let _ = (stage, error);
    }

    /// The connection that listens for the source's `NOTIFY` was lost (or
    /// could not be made): the loops poll until it is back.
    fn listen_lost(&self, error: &sqlx::Error) {
        let _ = error;
    }
}
