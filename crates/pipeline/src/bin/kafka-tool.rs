//! `kafka-tool`: create a topic, tail it, produce to it, show and reset a
//! consumer group's offsets, list what a group has committed past (the
//! operations live in `pipeline::inspect`).

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use pipeline::inspect::{self, Outgoing, ResetTo, Sender, Start, TailOptions, parse_duration};
use pipeline::kafka::{TopicState, ensure_topic};
use rdkafka::ClientConfig;

/// The project's Kafka command-line tool, on the same client as the services
/// (rdkafka), for what Kafka's own tools (`scripts/kafka.sh`) do not do:
/// the pipeline's topic configs by default, a tail that prints headers and
/// bytes as text, offsets reset to a point in time with a wait for the group
/// to empty.
#[derive(Debug, Parser)]
#[command(
    name = "kafka-tool",
    version,
    after_help = "Every flag can also be set by the environment variable shown with it \
        (`. .stack/env` after `make up` sets KAFKA_BOOTSTRAP_SERVERS and KAFKA_TOPIC).\n\n\
        Exit status: 0 done, 1 the operation failed or was refused (the message says why), \
        2 bad usage."
)]
struct Cli {
    /// Kafka bootstrap servers.
    #[arg(
        long,
        global = true,
        env = "KAFKA_BOOTSTRAP_SERVERS",
        default_value = "127.0.0.1:9092"
    )]
    bootstrap_servers: String,

    /// A file of librdkafka properties (`key=value` lines) for the client:
    /// TLS and SASL, e.g. the stack's admin principal
    /// (.stack/kafka/clients/admin.properties, which `. .stack/env` sets).
    /// Refused when other users may read it (it holds a password).
    #[arg(long, global = true, env = "KAFKA_CLIENT_CONFIG", value_name = "FILE")]
    client_config: Option<std::path::PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a topic unless it exists (an existing topic is left as it is).
    Create(CreateArgs),
    /// Print a topic's messages, one line each:
    /// `partition=P offset=O key=K header:NAME=V … value=V`.
    ///
    /// Text is printed as it is (control characters and `\` escaped), other
    /// bytes as `\xNN`; an absent key or value as `(none)`. Reads from outside
    /// any consumer group: no offsets are committed. Without --max, --timeout
    /// or --until-end it follows the topic until interrupted.
    Tail(TailArgs),
    /// Send one message (--value) or one per line of standard input, and wait
    /// for the broker to acknowledge them all.
    Produce(ProduceArgs),
    /// A consumer group's offsets.
    #[command(subcommand)]
    Offsets(OffsetsCommand),
}

#[derive(Debug, Args)]
struct TopicArg {
    /// Topic.
    #[arg(long, env = "KAFKA_TOPIC", default_value = "order.events")]
    topic: String,
}

#[derive(Debug, Args)]
struct CreateArgs {
    #[command(flatten)]
    topic: TopicArg,

    /// Partitions of a new topic.
    #[arg(long, env = "KAFKA_TOPIC_PARTITIONS", default_value_t = 6)]
    partitions: i32,

    /// Replicas of each partition; -1 takes the brokers'
    /// `default.replication.factor` (3 on the embedded 3-node cluster). The
    /// relay and payments refuse a topic with fewer than 2 (or with
    /// `min.insync.replicas` under 2) unless --allow-under-replicated-topic.
    #[arg(long, env = "KAFKA_TOPIC_REPLICATION", default_value_t = -1, allow_negative_numbers = true)]
    replication: i32,

    /// A topic config of the new topic, `KEY=VALUE`, repeatable. By default
    /// the pipeline's own: retention.ms 7 days and segment.ms 1 day, which
    /// payments reads back to derive its redelivery horizon, and
    /// message.timestamp.type LogAppendTime (the brokers stamp the records,
    /// so no producer's clock gets them refused or expired early); a key
    /// given here replaces the default of that key.
    #[arg(long = "config", value_name = "KEY=VALUE", value_parser = parse_config)]
    configs: Vec<(String, String)>,
}

fn parse_config(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StartAt {
    /// The oldest message kept.
    Start,
    /// Only messages that arrive from now on.
    End,
}

#[derive(Debug, Args)]
struct TailArgs {
    #[command(flatten)]
    topic: TopicArg,

    /// Where to start in each partition.
    #[arg(long, value_enum, default_value = "start")]
    from: StartAt,

    /// Only this partition.
    #[arg(long)]
    partition: Option<i32>,

    /// Stop after N messages.
    #[arg(long, value_name = "N")]
    max: Option<usize>,

    /// Stop after this long (500ms, 10s, 2m).
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,

    /// Stop once every partition is read to its end.
    #[arg(long)]
    until_end: bool,
}

#[derive(Debug, Args)]
struct ProduceArgs {
    #[command(flatten)]
    topic: TopicArg,

    /// The message's value (default: one message per line of standard input).
    #[arg(long)]
    value: Option<String>,

    /// The key of every message.
    #[arg(long)]
    key: Option<String>,

    /// A header of every message, NAME=VALUE (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,

    /// Send to this partition (default: by key).
    #[arg(long)]
    partition: Option<i32>,

    /// How long to wait for the acknowledgements.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    timeout: Duration,
}

#[derive(Debug, Subcommand)]
enum OffsetsCommand {
    /// Per partition: the group's committed offset, the low and high
    /// watermarks, and the lag (high minus committed; minus low when the group
    /// has no commit there). Also the group's state and member count.
    Show(ShowArgs),
    /// Commit the earliest or latest offset of every partition as the group's.
    ///
    /// The broker takes offsets from outside a group only while it has no
    /// members, and a live member would overwrite them with its next commit:
    /// a group with members is refused, unless --wait gives them time to leave
    /// (a consumer that died counts as a member until its session times out).
    Reset(ResetArgs),
    /// Print every message the group has committed past, one line each:
    /// `topic<TAB>partition<TAB>offset<TAB>msg_id<TAB>aggregate_id` (`-` for
    /// a message that is no event: neither the envelope nor Debezium's Outbox
    /// Event Router's record), from each partition's low
    /// watermark up to the group's committed offset.
    ///
    /// The group will never be given these again, so each must have left its
    /// trace in the database (an inbox row, a dead letter or a parked event):
    /// `recon --committed-past FILE` checks that they did. Reads from outside
    /// the group; commits nothing.
    CommittedPast(CommittedPastArgs),
}

#[derive(Debug, Args)]
struct CommittedPastArgs {
    #[command(flatten)]
    topic: TopicArg,

    /// Consumer group.
    #[arg(long)]
    group: String,

    /// Give up (exit 1) when not every partition is read up to the group's
    /// offset within this long.
    #[arg(long, value_parser = parse_duration, default_value = "2m")]
    timeout: Duration,
}

#[derive(Debug, Args)]
struct ShowArgs {
    #[command(flatten)]
    topic: TopicArg,

    /// Consumer group.
    #[arg(long)]
    group: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum To {
    /// The oldest message kept: the group reads everything again.
    Earliest,
    /// The end: the group skips everything there is now.
    Latest,
}

#[derive(Debug, Args)]
struct ResetArgs {
    #[command(flatten)]
    topic: TopicArg,

    /// Consumer group.
    #[arg(long)]
    group: String,

    /// Where to.
    #[arg(long, value_enum)]
    to: To,

    /// Wait up to this long for the group's members to leave (and for the
    /// broker to take the commit) instead of refusing at once.
    #[arg(long, value_parser = parse_duration)]
    wait: Option<Duration>,
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{text:?} is not NAME=VALUE"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kafka-tool: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let client =
        pipeline::kafka::client_config(&cli.bootstrap_servers, cli.client_config.as_deref())?;
    match cli.command {
        Command::Create(args) => create(&client, &args),
        Command::Tail(args) => tail(&client, &args),
        Command::Produce(args) => produce(&client, &args),
        Command::Offsets(OffsetsCommand::Show(args)) => show(&client, &args),
        Command::Offsets(OffsetsCommand::Reset(args)) => reset(&client, &args),
        Command::Offsets(OffsetsCommand::CommittedPast(args)) => committed_past(&client, &args),
    }
}

fn committed_past(client: &ClientConfig, args: &CommittedPastArgs) -> anyhow::Result<()> {
    let topic = &args.topic.topic;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut write_error = None;
    let read = inspect::committed_past(client, &args.group, topic, args.timeout, |record| {
        if write_error.is_some() {
            return;
        }
        let ids = record.event_ids().map_or_else(
            || ("-".to_owned(), "-".to_owned()),
            |(msg_id, aggregate_id)| (msg_id.to_string(), aggregate_id.to_string()),
        );
        if let Err(error) = writeln!(
            out,
            "{topic}\t{}\t{}\t{}\t{}",
            record.partition, record.offset, ids.0, ids.1
        ) {
            write_error = Some(error);
        }
    })?;
    if let Some(error) = write_error {
        return Err(error).context("write to standard output");
    }
    out.flush().context("write to standard output")?;
    eprintln!(
        "kafka-tool: {read} messages of {topic} below group {}'s committed offsets",
        args.group
    );
    Ok(())
}

fn create(client: &ClientConfig, args: &CreateArgs) -> anyhow::Result<()> {
    let topic = &args.topic.topic;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the runtime")?;
    let mut configs: Vec<(&str, String)> = pipeline::contract::order_events_topic_configs()
        .into_iter()
        .filter(|(k, _)| !args.configs.iter().any(|(given, _)| given == k))
        .collect();
    configs.extend(args.configs.iter().map(|(k, v)| (k.as_str(), v.clone())));
    match runtime.block_on(ensure_topic(
        client,
        topic,
        args.partitions,
        args.replication,
        &configs,
    ))? {
        TopicState::Created => eprintln!(
            "kafka-tool: created {topic} with {} partitions",
            args.partitions
        ),
        TopicState::Existed => eprintln!("kafka-tool: {topic} exists"),
    }
    Ok(())
}

fn tail(client: &ClientConfig, args: &TailArgs) -> anyhow::Result<()> {
    let options = TailOptions {
        start: match args.from {
            StartAt::Start => Start::Beginning,
            StartAt::End => Start::End,
        },
        partition: args.partition,
        max: args.max,
        timeout: args.timeout,
        until_end: args.until_end,
    };
    let mut out = std::io::stdout().lock();
    let mut write_error = None;
    let read = inspect::tail(client, &args.topic.topic, &options, |record| {
        match writeln!(out, "{record}") {
            Ok(()) => true,
            Err(error) => {
                write_error = Some(error);
                false
            }
        }
    })?;
    match write_error {
        // The reader went away (`| head`): not an error of ours.
        Some(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Some(error) => Err(error).context("write to standard output"),
        None => {
            out.flush().context("write to standard output")?;
            eprintln!("kafka-tool: {read} messages");
            Ok(())
        }
    }
}

fn produce(client: &ClientConfig, args: &ProduceArgs) -> anyhow::Result<()> {
    let topic = &args.topic.topic;
    let mut sender = Sender::new(client, topic)?;
    let message = |value: Vec<u8>| Outgoing {
        key: args.key.as_ref().map(|k| k.as_bytes().to_vec()),
        headers: args
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
            .collect(),
        value,
        partition: args.partition,
    };
    match &args.value {
        Some(value) => sender.send(&message(value.as_bytes().to_vec()))?,
        None => {
            for line in std::io::stdin().lock().split(b'\n') {
                let mut line = line.context("read standard input")?;
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                sender.send(&message(line))?;
            }
        }
    }
    let sent = sender.finish(args.timeout)?;
    eprintln!("kafka-tool: {sent} messages acknowledged by {topic}");
    Ok(())
}

fn show(client: &ClientConfig, args: &ShowArgs) -> anyhow::Result<()> {
    let topic = &args.topic.topic;
    let state = inspect::group_state(client, &args.group)?;
    let offsets = inspect::offsets(client, &args.group, topic)?;
    let mut out = std::io::stdout().lock();
    match state {
        Some(s) => writeln!(
            out,
            "group {}: {}, {} member(s)",
            args.group, s.state, s.members
        )?,
        None => writeln!(out, "group {}: unknown to the broker", args.group)?,
    }
    writeln!(
        out,
        "{:<24} {:>9} {:>12} {:>12} {:>12} {:>10}",
        "topic", "partition", "committed", "low", "high", "lag"
    )?;
    for p in &offsets {
        let committed = p
            .committed
            .map_or_else(|| "-".to_owned(), |c| c.to_string());
        writeln!(
            out,
            "{:<24} {:>9} {:>12} {:>12} {:>12} {:>10}",
            topic,
            p.partition,
            committed,
            p.low,
            p.high,
            p.lag()
        )?;
    }
    writeln!(
        out,
        "total lag {}",
        offsets
            .iter()
            .map(inspect::PartitionOffsets::lag)
            .sum::<i64>()
    )?;
    Ok(())
}

fn reset(client: &ClientConfig, args: &ResetArgs) -> anyhow::Result<()> {
    let to = match args.to {
        To::Earliest => ResetTo::Earliest,
        To::Latest => ResetTo::Latest,
    };
    let topic = &args.topic.topic;
    let done = inspect::reset_offsets(client, &args.group, topic, to, args.wait)?;
    for (partition, offset) in &done {
        println!("{topic} {partition} {offset}");
    }
    eprintln!(
        "kafka-tool: group {} reset to the {} offsets of {} partitions of {topic}",
        args.group,
        match args.to {
            To::Earliest => "earliest",
            To::Latest => "latest",
        },
        done.len()
    );
    Ok(())
}
