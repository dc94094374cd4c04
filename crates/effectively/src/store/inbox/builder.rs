//! An inbox's settings, each set by a method that takes and returns it
//! (retention, partitions, clock skew), and what it is (its consumer, its kind).

use std::time::Duration;

use super::{Inbox, Kind};

impl Inbox {
    /// The same inbox keeping rows for `retention` after their message was
    /// sent (default [`DEFAULT_RETENTION`]). It should cover the sender's
    /// horizon, the longest time from a message's mint time (for an id
    /// that is not a UUIDv7, its first send) to the last copy that may
    /// arrive: for events of this library's outbox over Kafka, how long the
    /// outbox keeps a row that may be published again (the relay's
    /// [`super::Relay::keep_published`], a week by default) + the producer's delivery
    /// timeout + the topic's `retention.ms` + its `segment.ms`; for
    /// webhooks, how long a row may wait before its first send + the
    /// sender's retry span. A shorter one never applies a copy twice; it
    /// dead-letters copies that come after it as too old.
    ///
    /// The partitions of a partitioned inbox are shared by the consumers of
    /// its schema: one is dropped once it is older than the longest
    /// retention any of them last maintained with.
    ///
    /// [`super::Relay::keep_published`]: crate::store::Relay::keep_published
    /// [`DEFAULT_RETENTION`]: super::DEFAULT_RETENTION
    pub fn retention(self, retention: Duration) -> Self {
        Self { retention, ..self }
    }

    /// Partitioned inbox only (a row inbox ignores it): the span of one
    /// partition (default [`DEFAULT_PARTITION`], at least a second), aligned
    /// to the Unix epoch. Rows are dropped a partition at a time, so they
    /// stay up to a partition longer than the retention.
    ///
    /// [`DEFAULT_PARTITION`]: super::DEFAULT_PARTITION
    pub fn partition(mut self, granule: Duration) -> Self {
        if let Kind::Partitions(p) = &mut self.kind {
            p.granule = granule.max(Duration::from_secs(1));
        }
        self
    }

    /// Partitioned inbox only: how far past the database's clock
    /// [`Inbox::maintain_once`] makes partitions (default two partitions
    /// and the clock skew). A message minted past them is
    /// [`InboxClaim::Early`] until they reach it.
    ///
    /// [`InboxClaim::Early`]: super::InboxClaim::Early
    pub fn ahead(mut self, ahead: Duration) -> Self {
        if let Kind::Partitions(p) = &mut self.kind {
            p.ahead = Some(ahead);
        }
        self
    }

    /// Partitioned inbox only: how far ahead of the database's clock a
    /// sender's clock may be (default [`DEFAULT_CLOCK_SKEW`]). A message
    /// minted further ahead is [`InboxClaim::Unrecordable`], not
    /// [`InboxClaim::Early`]: it would otherwise hold up the messages behind
    /// it until the partitions reached it.
    ///
    /// [`DEFAULT_CLOCK_SKEW`]: super::DEFAULT_CLOCK_SKEW
    /// [`InboxClaim::Early`]: super::InboxClaim::Early
    /// [`InboxClaim::Unrecordable`]: super::InboxClaim::Unrecordable
    pub fn clock_skew(mut self, skew: Duration) -> Self {
        if let Kind::Partitions(p) = &mut self.kind {
            p.clock_skew = skew;
        }
        self
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Whether this is a partitioned inbox.
    pub fn is_partitioned(&self) -> bool {
        matches!(self.kind, Kind::Partitions(_))
    }
}
