//! Kafka pieces every client of the pipeline shares: topic creation (never
//! rely on broker auto-create) and the handling of a client's fatal state.

use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::{Client, DefaultClientContext};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// A Kafka client's fatal state, for its `ClientContext::error` callback.
///
/// librdkafka reports a fatal error when the client can no longer do its
/// job (an idempotent producer that cannot keep its ordering and
/// no-duplicate guarantees, a static consumer fenced by another process with
/// its `group.instance.id`); it then produces or consumes nothing again. A
/// process in that state must end with an error so that its supervisor
/// starts a fresh client, instead of living on doing nothing. Clones share
/// the state.
///
/// The error callback alone does not see every fatal error: with the event
/// API rust-rdkafka uses, a fatal error reaches `ClientContext::error` with
/// its underlying code (e.g. `FencedInstanceId`), not `Fatal`. So the owner
/// of the client also asks the client itself ([`FatalState::check`]), after
/// every receive error and on a timer ([`FatalState::watch`]).
#[derive(Debug, Clone, Default)]
pub struct FatalState {
    fired: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
}

impl FatalState {
    /// Not fired.
    pub fn new() -> Self {
        Self::default()
    }

    /// The body of `ClientContext::error`: a fatal error fires the state
    /// (keeping the first reason); any other error is logged, and the client
    /// retries it by itself.
    pub fn on_error(&self, client: &'static str, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
            self.fire(client, format!("{error}: {reason}"));
        } else {
            tracing::warn!(client, %error, reason, "kafka client error");
        }
    }

    /// Fires the state with `reason` (the first reason is kept).
    pub fn fire(&self, client: &'static str, reason: String) {
        tracing::error!(client, reason, "kafka client in a fatal state; exiting");
        if let Ok(mut r) = self.reason.lock() {
            r.get_or_insert(reason);
        }
        self.fired.cancel();
    }

    /// Asks `handle` whether it is in a fatal state (librdkafka's
    /// `rd_kafka_fatal_error`), and fires if so; whether the state has fired.
    pub fn check<C: ClientContext>(&self, client: &'static str, handle: &Client<C>) -> bool {
        if let Some((code, reason)) = handle.fatal_error()
            && !self.fired.is_cancelled()
        {
            self.fire(client, format!("{code}: {reason}"));
        }
        self.fired.is_cancelled()
    }

    /// [`Self::check`]s `producer` every `every` until the state fires or
    /// `stop` is cancelled.
    pub fn watch_producer<C: ClientContext + 'static>(
        &self,
        producer: FutureProducer<C>,
        every: Duration,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let state = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = stop.cancelled() => return,
                    () = state.fired() => return,
                }
                if state.check("producer", producer.client()) {
                    return;
                }
            }
        })
    }

    /// Completes once the state has fired.
    pub async fn fired(&self) {
        self.fired.cancelled().await;
    }

    /// The fatal error, once fired.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

/// Whether [`ensure_topic`] created the topic or found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicState {
    /// Created now.
    Created,
    /// Existed already (its partition count is left as it is).
    Existed,
}

/// Creates `topic` with `partitions` partitions, `replication` replicas and
/// the topic `configs` (e.g. [`crate::contract::order_events_topic_configs`])
/// unless it exists; an existing topic is left as it is.
pub async fn ensure_topic(
    bootstrap_servers: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
    configs: &[(&str, String)],
) -> anyhow::Result<TopicState> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers)
        .create()
        .context("create kafka admin client")?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(15)));
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
    for (key, value) in configs {
        new = new.set(key, value);
    }
    let results = admin
        .create_topics(&[new], &options)
        .await
        .with_context(|| format!("create topic {topic} on {bootstrap_servers}"))?;
    match results.into_iter().next() {
        Some(Ok(_)) => Ok(TopicState::Created),
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok(TopicState::Existed),
        Some(Err((name, code))) => anyhow::bail!("create topic {name}: {code}"),
        None => anyhow::bail!("create topic {topic}: the broker returned no result"),
    }
}

/// The configs a broker reports for `topic` (only `keys`), as strings. A
/// key the broker does not report is absent: Kafka reports every key with
/// its default, the embedded broker only the ones set on the topic.
pub async fn topic_configs(
    bootstrap_servers: &str,
    topic: &str,
    keys: &[&str],
) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers)
        .create()
        .context("create kafka admin client")?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(15)));
    let results = admin
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &options)
        .await
        .with_context(|| format!("describe the configs of {topic} on {bootstrap_servers}"))?;
    let resource = match results.into_iter().next() {
        Some(Ok(resource)) => resource,
        Some(Err(code)) => anyhow::bail!("describe the configs of {topic}: {code}"),
        None => anyhow::bail!("describe the configs of {topic}: the broker returned no result"),
    };
    Ok(resource
        .entries
        .into_iter()
        .filter(|e| keys.contains(&e.name.as_str()))
        .filter_map(|e| e.value.map(|v| (e.name, v)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_fatal_error_fires_and_the_first_reason_stays() {
        let state = FatalState::new();
        let shared = state.clone();
        state.on_error(
            "test",
            KafkaError::Global(RDKafkaErrorCode::BrokerTransportFailure),
            "broker down",
        );
        assert!(
            shared.reason().is_none(),
            "a transient error is the client's to retry"
        );
        state.on_error(
            "test",
            KafkaError::Global(RDKafkaErrorCode::Fatal),
            "static consumer fenced",
        );
        state.on_error("test", KafkaError::Global(RDKafkaErrorCode::Fatal), "later");
        assert!(shared.reason().is_some_and(|r| r.contains("fenced")));
        assert!(shared.fired.is_cancelled());
    }
}
