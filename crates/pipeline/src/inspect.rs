//! What `kafka-tool` does (feature `kafka`): look at a topic and a consumer
//! group on the broker, and move a group's offsets, with the client the
//! services use (rdkafka). Debian's `kcat` cannot talk to the embedded broker
//! (its librdkafka is too old for the broker's ApiVersions), so the project
//! carries its own.
//!
//! Everything here is blocking (a command-line tool waits anyway) and bounded
//! by a timeout; nothing the broker sends is trusted to be well formed:
//! bytes are shown escaped, absent fields as absent.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

/// How long one request to the broker (metadata, watermarks, a commit) may
/// take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an inspection failed.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// The client or the broker failed.
    #[error("{what}: {source}")]
    Kafka {
        /// What was being done, as a verb phrase.
        what: String,
        /// The client's error.
        #[source]
        source: KafkaError,
    },
    /// The topic is not on the broker.
    #[error("topic {0} does not exist")]
    NoTopic(String),
    /// A partition asked for is not in the topic.
    #[error("topic {topic} has no partition {partition}")]
    NoPartition {
        /// The topic.
        topic: String,
        /// The partition asked for.
        partition: i32,
    },
    /// The group has members, so the broker would not take new offsets for
    /// it (and a member would overwrite them with its next commit).
    #[error(
        "group {group} has {members} live member(s) (state {state}): stop its consumers first, \
         or pass --wait to wait for them to leave"
    )]
    LiveMembers {
        /// The group.
        group: String,
        /// How many members the broker lists.
        members: usize,
        /// The group's state as the broker names it (e.g. `Stable`).
        state: String,
    },
    /// The partitions were not all read up to a bound in time.
    #[error(
        "{partitions} partition(s) of {topic} not read up to group {group}'s committed offsets \
         within {timeout:?}"
    )]
    Incomplete {
        /// The topic.
        topic: String,
        /// The group whose offsets bound the read.
        group: String,
        /// Partitions not read to their bound.
        partitions: usize,
        /// How long it tried.
        timeout: Duration,
    },
    /// Messages were not acknowledged.
    #[error("{failed} of {sent} messages not delivered: {first_error}")]
    Undelivered {
        /// Messages handed to the client.
        sent: usize,
        /// Messages not acknowledged by the broker.
        failed: usize,
        /// The first delivery error seen.
        first_error: String,
    },
}

fn kafka(what: impl Into<String>) -> impl FnOnce(KafkaError) -> InspectError {
    let what = what.into();
    move |source| InspectError::Kafka { what, source }
}

/// A consumer that never joins a group: it reads assigned partitions, and
/// with `group` set it reads and commits that group's offsets from outside.
/// Without one it gets a throwaway group id (librdkafka wants one even for
/// assigned partitions), under which it never commits.
fn outside_consumer(
    client: &ClientConfig,
    group: Option<&str>,
) -> Result<BaseConsumer, InspectError> {
    let throwaway = format!("kafka-tool-{}", uuid::Uuid::new_v4().simple());
    client
        .clone()
        .set("group.id", group.unwrap_or(&throwaway))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .create()
        .map_err(kafka("create the kafka client"))
}

/// The partition ids of `topic`, ascending.
fn partitions(consumer: &BaseConsumer, topic: &str) -> Result<Vec<i32>, InspectError> {
    let metadata = consumer
        .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
        .map_err(kafka(format!("read the metadata of {topic}")))?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Err(InspectError::NoTopic(topic.to_owned()));
    };
    if found.error().is_some() || found.partitions().is_empty() {
        return Err(InspectError::NoTopic(topic.to_owned()));
    }
    let mut ids: Vec<i32> = found.partitions().iter().map(|p| p.id()).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// Where [`tail`] starts in each partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The oldest message kept.
    Beginning,
    /// After the last message: only what arrives from now on.
    End,
}

/// What [`tail`] reads and when it stops.
#[derive(Debug, Clone)]
pub struct TailOptions {
    /// Where to start.
    pub start: Start,
    /// Only this partition (default: all).
    pub partition: Option<i32>,
    /// Stop after this many messages.
    pub max: Option<usize>,
    /// Stop after this long, counted from the start.
    pub timeout: Option<Duration>,
    /// Stop once every partition read is at its end.
    pub until_end: bool,
}

/// One message read by [`tail`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Key, if the message has one.
    pub key: Option<Vec<u8>>,
    /// Headers in order; a header may have no value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// Value, if the message has one (a tombstone has none).
    pub value: Option<Vec<u8>>,
}

impl Record {
    /// A copy of `message`: key, headers in order, value.
    fn of(message: &impl Message) -> Self {
        let headers = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Record {
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            headers,
            value: message.payload().map(<[u8]>::to_vec),
        }
    }

    /// The event's (msg_id, aggregate_id): from the project's envelope (the
    /// value), or else from the record shape of Debezium's Outbox Event
    /// Router (header `id`, the key; what `payments --input-format
    /// outbox-router` reads). `None` for a record that is neither.
    pub fn event_ids(&self) -> Option<(uuid::Uuid, uuid::Uuid)> {
        if let Some(e) = self
            .value
            .as_deref()
            .and_then(|v| crate::envelope::Envelope::decode(v).ok())
        {
            return Some((e.msg_id, e.aggregate_id));
        }
        // Read as payments reads them: UTF-8, a UUID as it stands.
        let uuid = |bytes: &[u8]| {
            std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| uuid::Uuid::parse_str(text).ok())
        };
        // The first `id` header, as payments takes it.
        let (_, id) = self
            .headers
            .iter()
            .find(|(name, _)| name == effectively::store::HEADER_ROUTER_ID)?;
        Some((uuid(id.as_deref()?)?, uuid(self.key.as_deref()?)?))
    }
}

impl std::fmt::Display for Record {
    /// One line: `partition=P offset=O key=K header:NAME=V … value=V`, each
    /// field through [`show`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "partition={} offset={} key={}",
            self.partition,
            self.offset,
            show(self.key.as_deref())
        )?;
        for (name, value) in &self.headers {
            write!(
                f,
                " header:{}={}",
                show(Some(name.as_bytes())),
                show(value.as_deref())
            )?;
        }
        write!(f, " value={}", show(self.value.as_deref()))
    }
}

/// Bytes for one line of text: UTF-8 as it is, with control characters and
/// `\` escaped (`\n`, `\u{1b}`, `\\`); anything else byte by byte (`\xff`);
/// `(none)` when absent and `""` when empty.
pub fn show(bytes: Option<&[u8]>) -> String {
    match bytes {
        None => "(none)".to_owned(),
        Some([]) => "\"\"".to_owned(),
        Some(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => text
                .chars()
                .map(|c| {
                    if c.is_control() || c == '\\' {
                        c.escape_default().to_string()
                    } else {
                        c.to_string()
                    }
                })
                .collect(),
            Err(_) => bytes.escape_ascii().to_string(),
        },
    }
}

/// Reads `topic` from outside any group and hands each message to `each`
/// until `each` returns false or `options` says stop; returns how many were
/// read. Without `max`, `timeout` or `until_end` it follows the topic until
/// the process is stopped.
pub fn tail(
    client: &ClientConfig,
    topic: &str,
    options: &TailOptions,
    mut each: impl FnMut(&Record) -> bool,
) -> Result<usize, InspectError> {
    let consumer = outside_consumer(client, None)?;
    let mut ids = partitions(&consumer, topic)?;
    if let Some(partition) = options.partition {
        if !ids.contains(&partition) {
            return Err(InspectError::NoPartition {
                topic: topic.to_owned(),
                partition,
            });
        }
        ids = vec![partition];
    }
    let start = match options.start {
        Start::Beginning => Offset::Beginning,
        Start::End => Offset::End,
    };
    let mut assignment = TopicPartitionList::new();
    for id in &ids {
        assignment
            .add_partition_offset(topic, *id, start)
            .map_err(kafka("build the assignment"))?;
    }
    consumer
        .assign(&assignment)
        .map_err(kafka(format!("assign the partitions of {topic}")))?;
    let deadline = options.timeout.map(|t| Instant::now() + t);
    let mut at_end = std::collections::HashSet::new();
    let mut read = 0;
    loop {
        if options.max.is_some_and(|max| read >= max) {
            break;
        }
        if options.until_end && at_end.len() == ids.len() {
            break;
        }
        let wait = match deadline {
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                Some(left) => left.min(Duration::from_millis(200)),
                None => break,
            },
            None => Duration::from_millis(200),
        };
        match consumer.poll(wait) {
            None => {}
            Some(Ok(message)) => {
                at_end.remove(&message.partition());
                let record = Record::of(&message);
                read += 1;
                if !each(&record) {
                    break;
                }
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                at_end.insert(partition);
            }
            // The client retries what it can by itself; the tool says so
            // and goes on until its bounds say stop.
            Some(Err(error)) => eprintln!("kafka-tool: {topic}: {error}"),
        }
    }
    Ok(read)
}

/// One message for [`Sender::send`].
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// Key (none: the default partitioner spreads keyless messages).
    pub key: Option<Vec<u8>>,
    /// Headers in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Value.
    pub value: Vec<u8>,
    /// Partition (none: by key).
    pub partition: Option<i32>,
}

/// Counts acknowledgements and keeps the first delivery error.
#[derive(Default)]
struct Deliveries {
    failed: AtomicUsize,
    first_error: Mutex<Option<String>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, (): ()) {
        if let Err((error, _)) = result {
            self.failed.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut first) = self.first_error.lock() {
                first.get_or_insert_with(|| error.to_string());
            }
        }
    }
}

/// Sends messages to one topic; [`Sender::finish`] waits for the broker's
/// acknowledgements.
pub struct Sender {
    producer: ThreadedProducer<Deliveries>,
    topic: String,
    sent: usize,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("topic", &self.topic)
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl Sender {
    /// A producer for `topic` (acks from all in-sync replicas, idempotent,
    /// so a retried send is not written twice). Checks that the topic exists.
    pub fn new(client: &ClientConfig, topic: &str) -> Result<Self, InspectError> {
        partitions(&outside_consumer(client, None)?, topic)?;
        let producer: ThreadedProducer<Deliveries> = client
            .clone()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", "30000")
            .create_with_context(Deliveries::default())
            .map_err(kafka("create the kafka producer"))?;
        Ok(Self {
            producer,
            topic: topic.to_owned(),
            sent: 0,
        })
    }

    /// Queues `message`, waiting while the client's queue is full.
    pub fn send(&mut self, message: &Outgoing) -> Result<(), InspectError> {
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
        for (name, value) in &message.headers {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_slice()),
            });
        }
        let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(&self.topic)
            .payload(message.value.as_slice())
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_slice());
        }
        if let Some(partition) = message.partition {
            record = record.partition(partition);
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err((error, _)) => return Err(kafka("queue a message")(error)),
            }
        }
        self.sent += 1;
        Ok(())
    }

    /// Waits up to `timeout` for every message to be acknowledged; returns
    /// how many were sent.
    pub fn finish(self, timeout: Duration) -> Result<usize, InspectError> {
        let flushed = self.producer.flush(timeout);
        let context = self.producer.context();
        let failed = context.failed.load(Ordering::Relaxed);
        if failed > 0 {
            let first_error = context
                .first_error
                .lock()
                .ok()
                .and_then(|e| e.clone())
                .unwrap_or_default();
            return Err(InspectError::Undelivered {
                sent: self.sent,
                failed,
                first_error,
            });
        }
        flushed.map_err(kafka(format!(
            "wait for the acknowledgements of {} messages",
            self.sent
        )))?;
        Ok(self.sent)
    }
}

/// A consumer group as the broker describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupState {
    /// The broker's name for its state (`Empty`, `Stable`, `PreparingRebalance`, …).
    pub state: String,
    /// How many members it has.
    pub members: usize,
}

/// `group`'s state; `None` when the broker does not know the group.
pub fn group_state(client: &ClientConfig, group: &str) -> Result<Option<GroupState>, InspectError> {
    described(&outside_consumer(client, None)?, group)
}

fn described(consumer: &BaseConsumer, group: &str) -> Result<Option<GroupState>, InspectError> {
    let list = consumer
        .fetch_group_list(Some(group), REQUEST_TIMEOUT)
        .map_err(kafka(format!("describe group {group}")))?;
    Ok(list
        .groups()
        .iter()
        .find(|g| g.name() == group)
        .map(|g| GroupState {
            state: g.state().to_owned(),
            members: g.members().len(),
        })
        .filter(|g| g.state != "Dead"))
}

/// One partition's offsets for a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionOffsets {
    /// Partition.
    pub partition: i32,
    /// The group's committed offset (the next message it will read); none
    /// when the group never committed one for this partition.
    pub committed: Option<i64>,
    /// Low watermark: the oldest offset kept.
    pub low: i64,
    /// High watermark: the offset the next message will get.
    pub high: i64,
}

impl PartitionOffsets {
    /// Messages the group has not consumed yet: from its committed offset (or,
    /// without one, from the low watermark) to the high watermark.
    pub fn lag(&self) -> i64 {
        (self.high - self.committed.unwrap_or(self.low).max(self.low)).max(0)
    }
}

fn watermarks(
    consumer: &BaseConsumer,
    topic: &str,
    partition: i32,
) -> Result<(i64, i64), InspectError> {
    consumer
        .fetch_watermarks(topic, partition, REQUEST_TIMEOUT)
        .map_err(kafka(format!("read the watermarks of {topic}/{partition}")))
}

/// `group`'s committed offsets in `topic` with each partition's watermarks.
pub fn offsets(
    client: &ClientConfig,
    group: &str,
    topic: &str,
) -> Result<Vec<PartitionOffsets>, InspectError> {
    let consumer = outside_consumer(client, Some(group))?;
    let ids = partitions(&consumer, topic)?;
    let mut wanted = TopicPartitionList::new();
    for id in &ids {
        wanted.add_partition(topic, *id);
    }
    let committed = consumer
        .committed_offsets(wanted, REQUEST_TIMEOUT)
        .map_err(kafka(format!("read the offsets of group {group}")))?;
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let (low, high) = watermarks(&consumer, topic, id)?;
        let committed = match committed.find_partition(topic, id).map(|e| e.offset()) {
            Some(Offset::Offset(n)) if n >= 0 => Some(n),
            _ => None,
        };
        out.push(PartitionOffsets {
            partition: id,
            committed,
            low,
            high,
        });
    }
    Ok(out)
}

/// Reads, from outside any group, every message of `topic` that `group` has
/// committed past: in each partition, from the low watermark up to the
/// group's committed offset (nothing of a partition the group never
/// committed in). Hands each to `each` in the order read (offsets ascend
/// within a partition); returns how many were read. These are the messages
/// the group will never be given again, so each must have left its trace
/// where the consumer records what it consumed (`recon --committed-past`).
///
/// # Errors
/// As [`offsets`]; [`InspectError::Incomplete`] when `timeout` passes before
/// every partition is read up to its committed offset.
pub fn committed_past(
    client: &ClientConfig,
    group: &str,
    topic: &str,
    timeout: Duration,
    mut each: impl FnMut(&Record),
) -> Result<usize, InspectError> {
    let mut left: std::collections::HashMap<i32, i64> = offsets(client, group, topic)?
        .into_iter()
        .filter_map(|p| p.committed.filter(|&c| c > p.low).map(|c| (p.partition, c)))
        .collect();
    if left.is_empty() {
        return Ok(0);
    }
    let consumer = outside_consumer(client, None)?;
    let mut assignment = TopicPartitionList::new();
    for &partition in left.keys() {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .map_err(kafka("build the assignment"))?;
    }
    consumer
        .assign(&assignment)
        .map_err(kafka(format!("assign the partitions of {topic}")))?;
    let deadline = Instant::now() + timeout;
    let mut read = 0;
    while !left.is_empty() {
        let Some(wait) = deadline.checked_duration_since(Instant::now()) else {
            return Err(InspectError::Incomplete {
                topic: topic.to_owned(),
                group: group.to_owned(),
                partitions: left.len(),
                timeout,
            });
        };
        match consumer.poll(wait.min(Duration::from_millis(200))) {
            None => {}
            Some(Ok(message)) => {
                let partition = message.partition();
                let Some(&committed) = left.get(&partition) else {
                    continue;
                };
                if message.offset() < committed {
                    read += 1;
                    each(&Record::of(&message));
                }
                // Offsets may skip (a transaction's markers): the partition
                // is done at the last offset below the commit or past it.
                if message.offset() + 1 >= committed {
                    left.remove(&partition);
                }
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                left.remove(&partition);
            }
            Some(Err(error)) => eprintln!("kafka-tool: {topic}: {error}"),
        }
    }
    Ok(read)
}

/// Where [`reset_offsets`] moves a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetTo {
    /// The low watermark: the group reads everything kept again.
    Earliest,
    /// The high watermark: the group skips everything there is now.
    Latest,
}

/// Commits the earliest or latest offset of every partition of `topic` as
/// `group`'s, from outside the group, and returns what it committed.
///
/// The broker takes offsets from outside only for a group without members,
/// and a live member would overwrite them with its next commit anyway: so a
/// group with members is refused ([`InspectError::LiveMembers`]). With `wait`,
/// it waits up to that long for the members to leave, and retries a commit
/// the broker refuses meanwhile (a member that died is counted until its
/// session times out).
pub fn reset_offsets(
    client: &ClientConfig,
    group: &str,
    topic: &str,
    to: ResetTo,
    wait: Option<Duration>,
) -> Result<Vec<(i32, i64)>, InspectError> {
    let consumer = outside_consumer(client, Some(group))?;
    let deadline = Instant::now() + wait.unwrap_or_default();
    loop {
        match described(&consumer, group)? {
            Some(state) if state.members > 0 => {
                if Instant::now() >= deadline {
                    return Err(InspectError::LiveMembers {
                        group: group.to_owned(),
                        members: state.members,
                        state: state.state,
                    });
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            _ => break,
        }
    }
    let mut targets = Vec::new();
    let mut list = TopicPartitionList::new();
    for id in partitions(&consumer, topic)? {
        let (low, high) = watermarks(&consumer, topic, id)?;
        let offset = match to {
            ResetTo::Earliest => low,
            ResetTo::Latest => high,
        };
        list.add_partition_offset(topic, id, Offset::Offset(offset))
            .map_err(kafka("build the offset list"))?;
        targets.push((id, offset));
    }
    loop {
        match consumer.commit(&list, CommitMode::Sync) {
            Ok(()) => return Ok(targets),
            Err(error) if Instant::now() < deadline => {
                tracing::info!(%error, group, "offset commit refused (group not empty yet?); retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(error) => {
                return Err(kafka(format!("commit the offsets of group {group}"))(error));
            }
        }
    }
}

/// A duration as `kafka-tool` takes it: `500ms`, `10s`, `2m`, or a number of
/// seconds (`1.5`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 500ms, 10s, 2m)"))?;
    Duration::try_from_secs_f64(value * unit)
        .map_err(|_| format!("{text:?} is not a duration (e.g. 500ms, 10s, 2m)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_show_as_text_when_they_are_and_escaped_otherwise() {
        assert_eq!(show(None), "(none)");
        assert_eq!(show(Some(b"")), "\"\"");
        assert_eq!(show(Some("{\"a\": 1} é".as_bytes())), "{\"a\": 1} é");
        assert_eq!(show(Some(b"a\nb\\c\x1b")), "a\\nb\\\\c\\u{1b}");
        assert_eq!(show(Some(b"\xff\x00a")), "\\xff\\x00a");
    }

    #[test]
    fn a_record_is_one_line() {
        let record = Record {
            partition: 2,
            offset: 7,
            key: Some(b"k".to_vec()),
            headers: vec![("msg-id".into(), Some(b"1".to_vec())), ("x".into(), None)],
            value: Some(b"line\nbreak".to_vec()),
        };
        assert_eq!(
            record.to_string(),
            "partition=2 offset=7 key=k header:msg-id=1 header:x=(none) value=line\\nbreak"
        );
    }

    #[test]
    fn lag_counts_from_the_commit_or_the_oldest_kept() {
        let p = |committed, low, high| PartitionOffsets {
            partition: 0,
            committed,
            low,
            high,
        };
        assert_eq!(p(Some(5), 0, 9).lag(), 4);
        assert_eq!(p(None, 3, 9).lag(), 6);
        assert_eq!(p(Some(1), 3, 9).lag(), 6, "a commit below the oldest kept");
        assert_eq!(p(Some(9), 0, 9).lag(), 0);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn event_ids_come_from_the_envelope_or_the_outbox_routers_header_and_key() {
        let (msg, agg) = (uuid::Uuid::now_v7(), uuid::Uuid::new_v4());
        let record = |key: Option<&str>, headers: Vec<(&str, Option<&str>)>, value: &[u8]| Record {
            partition: 0,
            offset: 0,
            key: key.map(|k| k.as_bytes().to_vec()),
            headers: headers
                .into_iter()
                .map(|(n, v)| (n.to_owned(), v.map(|v| v.as_bytes().to_vec())))
                .collect(),
            value: Some(value.to_vec()),
        };
        let (m, a) = (msg.to_string(), agg.to_string());
        let router = record(
            Some(&a),
            vec![("id", Some(&m)), ("event_type", Some("order.created"))],
            b"{}",
        );
        assert_eq!(router.event_ids(), Some((msg, agg)));
        // The first id header counts, as payments reads it.
        let twice = record(Some(&a), vec![("id", Some(&m)), ("id", Some("x"))], b"{}");
        assert_eq!(twice.event_ids(), Some((msg, agg)));
        // Neither shape: no id header, an id or key that is no UUID.
        assert_eq!(record(Some(&a), vec![], b"{}").event_ids(), None);
        assert_eq!(
            record(Some(&a), vec![("id", None)], b"{}").event_ids(),
            None
        );
        assert_eq!(
            record(Some("k"), vec![("id", Some(&m))], b"{}").event_ids(),
            None
        );
        assert_eq!(
            record(None, vec![("id", Some(&m))], b"{}").event_ids(),
            None
        );
    }
}
