//! The start-up check of the relay's topic: it must keep what `acks=all`
//! acknowledges (`effectively::kafka::check_topic`; the relay marks a row
//! published on that ack and the outbox then forgets it). A topic that
//! cannot be read at start-up (not created yet, brokers down) is checked
//! again while the relay runs.

use effectively::config::KafkaArgs;
use effectively::kafka::{TopicCheck, TopicRefusal, check_topic};
use effectively::retry::Backoff;
use tokio_util::sync::CancellationToken;

/// Checks the topic once: `Ok(None)` when it passed (or is allowed by the
/// flag), `Ok(Some(error))` when it could not be read, `Err` when refused.
pub(crate) async fn check(kafka: &KafkaArgs) -> Result<Option<anyhow::Error>, TopicRefusal> {
    match check_topic("relay", kafka).await? {
        TopicCheck::Passed(_) => Ok(None),
        TopicCheck::Unreadable(error) => Ok(Some(error)),
    }
}

/// Checks the topic again, with backoff, until it can be read or `cancel`
/// fires: the refusal, if it is refused then. The relay runs meanwhile: its
/// sends to a topic that does not exist fail and the rows stay pending.
pub(crate) async fn recheck(kafka: KafkaArgs, cancel: CancellationToken) -> Option<TopicRefusal> {
    let mut backoff = Backoff::new();
    loop {
        if !backoff.wait(&cancel).await {
            return None;
        }
        match check(&kafka).await {
            Ok(None) => return None,
            Ok(Some(error)) => {
                tracing::debug!(error = %format!("{error:#}"), "the topic is still unreadable")
            }
            Err(refusal) => return Some(refusal),
        }
    }
}
