//! Kafka administration the stack and the tests need: create a topic
//! explicitly (never rely on broker auto-create).

use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

/// Whether [`ensure_topic`] created the topic or found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicState {
    /// Created now.
    Created,
    /// Existed already (its partition count is left as it is).
    Existed,
}

/// Creates `topic` with `partitions` partitions and `replication` replicas
/// unless it exists.
pub async fn ensure_topic(
    bootstrap_servers: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
) -> anyhow::Result<TopicState> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers)
        .create()
        .context("create kafka admin client")?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(15)));
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
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
