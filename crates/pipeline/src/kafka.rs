//! Kafka pieces every client of the pipeline shares: topic creation (never
//! rely on broker auto-create), the start-up check that a topic keeps what
//! `acks=all` acknowledges ([`check_topic`]), and the handling of a client's
//! fatal state.

use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::admin::{
    AdminClient, AdminOptions, ConfigEntry, ConfigSource, NewTopic, ResourceSpecifier,
    TopicReplication,
};
use rdkafka::client::{Client, DefaultClientContext};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

mod client;
pub use client::{ClientProperties, ClientPropertiesError, client_config, servers_of};

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
/// every receive error and on a timer ([`FatalState::watch_producer`]).
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
    client: &ClientConfig,
    topic: &str,
    partitions: i32,
    replication: i32,
    configs: &[(&str, String)],
) -> anyhow::Result<TopicState> {
    let bootstrap_servers = servers_of(client);
    let admin: AdminClient<DefaultClientContext> =
        client.create().context("create kafka admin client")?;
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
    client: &ClientConfig,
    topic: &str,
    keys: &[&str],
) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    Ok(topic_config_entries(client, topic, keys)
        .await?
        .into_iter()
        .filter_map(|e| e.value.map(|v| (e.name, v)))
        .collect())
}

/// The config entries a broker reports for `topic` (only `keys`), with
/// where each value comes from (the topic's own, or the brokers' default).
async fn topic_config_entries(
    client: &ClientConfig,
    topic: &str,
    keys: &[&str],
) -> anyhow::Result<Vec<ConfigEntry>> {
    let bootstrap_servers = servers_of(client);
    let admin: AdminClient<DefaultClientContext> =
        client.create().context("create kafka admin client")?;
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
        .collect())
}

/// The fewest replicas `acks=all` needs of a partition, and the smallest
/// `min.insync.replicas`, for an acknowledged record to survive the loss of
/// one broker: with one replica, or an in-sync set allowed to shrink to the
/// leader alone, `acks=all` is acked by one copy, and that node's loss loses
/// records the relay has already marked published.
pub const DURABLE_REPLICAS: i32 = 2;

/// Kafka's own default `min.insync.replicas`, taken when the broker does not
/// report the key.
const KAFKA_DEFAULT_MIN_INSYNC_REPLICAS: i32 = 1;

/// What the brokers say about a topic that bears on whether an `acks=all`
/// ack means the record is kept: its replicas and `min.insync.replicas`,
/// and whose clock stamps its records (`message.timestamp.type`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicSettings {
    /// The topic.
    pub topic: String,
    /// Its partitions.
    pub partitions: usize,
    /// The fewest replicas of any of its partitions.
    pub replication_factor: i32,
    /// `min.insync.replicas`, the topic's or the brokers' default.
    pub min_insync_replicas: i32,
    /// Where `min.insync.replicas` comes from, for the message: `set on the
    /// topic`, `the brokers' default`, or Kafka's default when not reported.
    pub min_insync_source: &'static str,
    /// `message.timestamp.type` (`CreateTime`, `LogAppendTime`), when reported.
    pub timestamp_type: Option<String>,
}

/// The flag (and its environment variable) that lets a service run on a
/// topic [`TopicSettings::durability_problem`] finds under-replicated.
pub const ALLOW_UNDER_REPLICATED_FLAG: &str =
    "--allow-under-replicated-topic (KAFKA_ALLOW_UNDER_REPLICATED_TOPIC=true)";

impl TopicSettings {
    /// Why an `acks=all` ack on this topic would not mean the record is kept
    /// ([`Problem::UnderReplicated`]) or would never come
    /// ([`Problem::Unusable`]), naming the setting, its value and what is
    /// required; `None` when the topic is fine.
    pub fn durability_problem(&self) -> Option<Problem> {
        let topic = &self.topic;
        let (rf, isr) = (self.replication_factor, self.min_insync_replicas);
        let required = format!(
            "acks=all needs replication factor >= {DURABLE_REPLICAS} and \
             {DURABLE_REPLICAS} <= min.insync.replicas <= replication factor"
        );
        if isr > rf {
            return Some(Problem::Unusable(format!(
                "topic {topic}: min.insync.replicas is {isr} ({}), more than its replication \
                 factor {rf}: every acks=all produce would fail with NOT_ENOUGH_REPLICAS. \
                 {required}. Recreate the topic with more replicas, or lower min.insync.replicas \
                 on it (kafka-configs --alter --entity-type topics --entity-name {topic} \
                 --add-config min.insync.replicas={})",
                self.min_insync_source,
                rf.max(1)
            )));
        }
        if rf < DURABLE_REPLICAS {
            return Some(Problem::UnderReplicated(format!(
                "topic {topic}: replication factor is {rf} (the fewest replicas of its {} \
                 partitions): acks=all is then acknowledged by a single copy, and losing its \
                 broker loses events already marked published. {required}. Recreate the topic \
                 with 3 replicas (kafka-tool create --replication 3), or, for a single-node \
                 stack or a test, run with {ALLOW_UNDER_REPLICATED_FLAG}",
                self.partitions
            )));
        }
        if isr < DURABLE_REPLICAS {
            return Some(Problem::UnderReplicated(format!(
                "topic {topic}: min.insync.replicas is {isr} ({}), with replication factor {rf}: \
                 acks=all is then acknowledged by the leader alone once its followers fall \
                 behind, and losing it loses events already marked published. {required}. Set \
                 it on the topic (kafka-configs --alter --entity-type topics --entity-name \
                 {topic} --add-config min.insync.replicas={DURABLE_REPLICAS}), or, for a \
                 single-node stack or a test, run with {ALLOW_UNDER_REPLICATED_FLAG}",
                self.min_insync_source
            )));
        }
        None
    }

    /// Whether the producer's clock stamps the records (`CreateTime`, Kafka's
    /// default): the broker then refuses a record stamped further ahead of
    /// its own clock than `message.timestamp.after.max.ms` (1 h in Kafka 4)
    /// with `INVALID_TIMESTAMP`, and expires a record stamped behind it
    /// early. `LogAppendTime` makes the broker stamp them.
    pub fn producer_stamps(&self) -> bool {
        self.timestamp_type.as_deref() != Some("LogAppendTime")
    }
}

/// What is wrong with a topic for `acks=all`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// An ack may be one copy: refused unless [`ALLOW_UNDER_REPLICATED_FLAG`].
    UnderReplicated(String),
    /// `min.insync.replicas` over the replication factor: nothing could be
    /// produced; refused whatever the flag.
    Unusable(String),
}

/// A service refused to start on its topic ([`check_topic`]); the message
/// names the topic, the setting, its value and what is required. The
/// binaries exit with status 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TopicRefusal(pub String);

/// How [`check_topic`] ended when it did not refuse.
#[derive(Debug)]
pub enum TopicCheck {
    /// The topic was read, and passed (or its problem is allowed by the
    /// flag, which was logged).
    Passed(TopicSettings),
    /// The topic could not be read (it does not exist yet, the brokers do
    /// not answer): nothing is known.
    Unreadable(anyhow::Error),
}

/// Reads `topic`'s settings from the brokers: every partition's replicas
/// (metadata) and its `min.insync.replicas` and `message.timestamp.type`
/// (the configs).
pub async fn topic_settings(client: &ClientConfig, topic: &str) -> anyhow::Result<TopicSettings> {
    let (base, name) = (client.clone(), topic.to_owned());
    // rd_kafka_metadata blocks its thread.
    let replicas = tokio::task::spawn_blocking(move || -> anyhow::Result<(usize, i32)> {
        let servers = servers_of(&base);
        let client: BaseProducer = base.create().context("create kafka metadata client")?;
        let metadata = client
            .client()
            .fetch_metadata(Some(&name), Duration::from_secs(15))
            .with_context(|| format!("read the metadata of {name} on {servers}"))?;
        let found = metadata
            .topics()
            .iter()
            .find(|t| t.name() == name)
            .with_context(|| format!("the brokers returned no metadata for {name}"))?;
        if let Some(error) = found.error() {
            anyhow::bail!("topic {name}: {}", RDKafkaErrorCode::from(error));
        }
        let partitions = found.partitions();
        let fewest = partitions.iter().map(|p| p.replicas().len()).min();
        match fewest {
            Some(n) => Ok((partitions.len(), i32::try_from(n).unwrap_or(i32::MAX))),
            None => anyhow::bail!("topic {name}: no partitions in its metadata"),
        }
    })
    .await
    .context("read the topic's metadata (task)")??;
    let entries = topic_config_entries(
        client,
        topic,
        &["min.insync.replicas", "message.timestamp.type"],
    )
    .await?;
    let entry = |key: &str| entries.iter().find(|e| e.name == key);
    let (min_insync_replicas, min_insync_source) = match entry("min.insync.replicas")
        .and_then(|e| e.value.as_deref().map(|v| (v, &e.source)))
    {
        Some((value, source)) => (
            value.trim().parse::<i32>().with_context(|| {
                format!("topic {topic}: min.insync.replicas {value:?} is not a number")
            })?,
            match source {
                ConfigSource::DynamicTopic => "set on the topic",
                _ => "the brokers' default",
            },
        ),
        None => (
            KAFKA_DEFAULT_MIN_INSYNC_REPLICAS,
            "not reported by the brokers: Kafka's default",
        ),
    };
    Ok(TopicSettings {
        topic: topic.to_owned(),
        partitions: replicas.0,
        replication_factor: replicas.1,
        min_insync_replicas,
        min_insync_source,
        timestamp_type: entry("message.timestamp.type").and_then(|e| e.value.clone()),
    })
}

/// A service's start-up check of its topic (`kafka`'s): refuses a topic on
/// which an `acks=all` ack may be a single copy ([`TopicSettings::durability_problem`])
/// unless `--allow-under-replicated-topic`, and one on which nothing could
/// be produced whatever the flag. An unreadable topic is for the caller to
/// wait for or to check again.
pub async fn check_topic(
    service: &str,
    kafka: &crate::config::KafkaArgs,
) -> Result<TopicCheck, TopicRefusal> {
    let client = match kafka.client_config() {
        Ok(client) => client,
        Err(error) => return Err(TopicRefusal(format!("{service}: {error:#}"))),
    };
    let settings = match topic_settings(&client, &kafka.kafka_topic).await {
        Ok(settings) => settings,
        Err(error) => return Ok(TopicCheck::Unreadable(error)),
    };
    judge_topic(service, kafka.allow_under_replicated_topic, settings)
}

/// [`check_topic`]'s verdict on `settings` read from the brokers.
pub fn judge_topic(
    service: &str,
    allow_under_replicated: bool,
    settings: TopicSettings,
) -> Result<TopicCheck, TopicRefusal> {
    match settings.durability_problem() {
        None => {
            tracing::info!(
                topic = %settings.topic,
                replication_factor = settings.replication_factor,
                min_insync_replicas = settings.min_insync_replicas,
                "the topic keeps what acks=all acknowledges"
            );
            Ok(TopicCheck::Passed(settings))
        }
        Some(Problem::UnderReplicated(message)) if allow_under_replicated => {
            tracing::warn!("--allow-under-replicated-topic: {message}");
            Ok(TopicCheck::Passed(settings))
        }
        Some(Problem::UnderReplicated(message) | Problem::Unusable(message)) => {
            Err(TopicRefusal(format!("{service} refuses {message}")))
        }
    }
}

pub use effectively::store::rejects_the_record;

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(rf: i32, isr: i32, timestamps: Option<&str>) -> TopicSettings {
        TopicSettings {
            topic: "t".into(),
            partitions: 6,
            replication_factor: rf,
            min_insync_replicas: isr,
            min_insync_source: "the brokers' default",
            timestamp_type: timestamps.map(str::to_owned),
        }
    }

    fn refusal(rf: i32, isr: i32, allow: bool) -> Option<String> {
        judge_topic("relay", allow, settings(rf, isr, None))
            .err()
            .map(|r| r.0)
    }

    #[test]
    fn acks_all_needs_two_replicas_and_two_in_sync_at_most_the_replicas() {
        assert_eq!(refusal(3, 2, false), None, "the stack's topic");
        assert_eq!(refusal(2, 2, false), None);
        let one = refusal(1, 1, false).expect("one replica");
        assert!(
            one.starts_with("relay refuses topic t: replication factor is 1"),
            "{one}"
        );
        assert!(one.contains("--allow-under-replicated-topic"), "{one}");
        let isr = refusal(3, 1, false).expect("min.insync.replicas 1");
        assert!(
            isr.contains("min.insync.replicas is 1 (the brokers' default)"),
            "{isr}"
        );
        assert_eq!(refusal(1, 1, true), None, "the flag allows it");
        assert_eq!(refusal(3, 1, true), None, "the flag allows it");
        let over = refusal(2, 3, true).expect("refused whatever the flag");
        assert!(over.contains("NOT_ENOUGH_REPLICAS"), "{over}");
        assert!(over.contains("min.insync.replicas is 3"), "{over}");
    }

    #[test]
    fn only_log_append_time_keeps_the_producers_clock_out() {
        assert!(settings(3, 2, Some("CreateTime")).producer_stamps());
        assert!(settings(3, 2, None).producer_stamps(), "Kafka's default");
        assert!(!settings(3, 2, Some("LogAppendTime")).producer_stamps());
    }

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
