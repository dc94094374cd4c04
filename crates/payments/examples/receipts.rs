//! make bench-cdc's consumer: reads a topic from the beginning in a fresh
//! group and writes, per record, when it arrived here, so a relay's
//! commit→consume latency can be taken per event against the commit time in
//! PostgreSQL. It does no other work (no decode past the headers, no
//! database), so the relays it is put behind are compared, not it.
//!
//! cargo run --release -p payments --example receipts -- <topic> <out.tsv>
//!
//! Each line of OUT is `key<TAB>msg_id<TAB>micros`: the record's key as
//! text (the relays key by the order's id), its message id (the header
//! `msg_id`, or the Outbox Event Router's `id`: the library's `msg_id_of`),
//! and the Unix time in microseconds when the record was handed to this
//! consumer. Lines are flushed at least every 200 ms, so a script can count
//! them while it runs; SIGTERM or SIGINT flushes and exits, printing
//! `{"records": N}`. The fetch wait is payments' own
//! (`PAYMENTS_FETCH_WAIT_MAX_MS`, else its default), as a real consumer waits.

use std::io::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::Message as _;

use tokio::signal::unix::{SignalKind, signal};

mod common;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(topic), Some(out)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: receipts <topic> <out.tsv>");
    };
    let consumer = common::fresh_consumer(&topic, "receipts")?;
    let mut file = std::io::BufWriter::with_capacity(
        1 << 20,
        std::fs::File::create(&out).map_err(|e| anyhow::anyhow!("{out}: {e}"))?,
    );
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut flush = tokio::time::interval(Duration::from_millis(200));
    let mut records = 0u64;
    loop {
        tokio::select! {
            message = consumer.recv() => {
                let message = message.map_err(|e| anyhow::anyhow!("consume: {e}"))?;
                let micros = SystemTime::now().duration_since(UNIX_EPOCH)?.as_micros();
                let record = effectively::store::record_of(&message);
                let key = message.key().map(String::from_utf8_lossy).unwrap_or_default();
                writeln!(file, "{key}\t{}\t{micros}", record.msg_id)?;
                records += 1;
            }
            _ = flush.tick() => file.flush()?,
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    file.flush()?;
    println!("{{\"records\": {records}}}");
    Ok(())
}
