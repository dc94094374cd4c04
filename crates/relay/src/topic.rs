//! The start-up check of the relay's topic: it must keep what `acks=all`
//! acknowledges (`pipeline::kafka::check_topic`; the relay marks a row
//! published on that ack and the outbox then forgets it), and its records
//! are best stamped by the broker (`message.timestamp.type=LogAppendTime`),
//! so that no clock of the relay's host can get them refused or expired
//! early. A topic that cannot be read at start-up (not created yet, brokers
//! down) is checked again while the relay runs.

use effectively::retry::Backoff;
use pipeline::config::KafkaArgs;
use pipeline::kafka::{TopicCheck, TopicRefusal, TopicSettings, check_topic};
use tokio_util::sync::CancellationToken;

/// Checks the topic once: `Ok(None)` when it passed (or is allowed by the
/// flag), `Ok(Some(error))` when it could not be read, `Err` when refused.
pub(crate) async fn check(kafka: &KafkaArgs) -> Result<Option<anyhow::Error>, TopicRefusal> {
    match check_topic("relay", kafka).await? {
        TopicCheck::Passed(settings) => {
            warn_if_the_producer_stamps(&settings);
            Ok(None)
        }
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

/// A warning when the topic keeps the producer's timestamps: why, and what
/// to set instead. Not a refusal: it loses no acknowledged record (a
/// refused record stays pending, is counted as
/// `relay_errors_total{stage="invalid_timestamp"}` and logged as an error,
/// and goes once the clock is right), and topics made before the project
/// set LogAppendTime have CreateTime.
fn warn_if_the_producer_stamps(settings: &TopicSettings) {
    if settings.producer_stamps() {
        tracing::warn!(
            topic = %settings.topic,
            timestamp_type = settings.timestamp_type.as_deref().unwrap_or("(not reported: CreateTime)"),
            "the topic keeps the relay's timestamps: a relay clock more than the topic's \
             message.timestamp.after.max.ms (1 h) ahead of the brokers' gets every record refused \
             (INVALID_TIMESTAMP), one behind expires records early. Let the brokers stamp them: \
             kafka-configs --alter --entity-type topics --entity-name {} --add-config \
             message.timestamp.type=LogAppendTime",
            settings.topic
        );
    }
}
