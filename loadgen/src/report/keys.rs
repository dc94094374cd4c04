//! The ground-truth key files: every key's outcome as the client saw it, for
//! `recon --intents`.

use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;

use super::create;
use crate::keys::KeySpace;
use crate::stats::Collector;

/// The ground-truth files' lines, each sorted by key (byte order, like
/// `LC_ALL=C sort`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KeyLines {
    /// `key\torder_id` of every key that got a success: exactly that order.
    pub(crate) intents: Vec<String>,
    /// Keys without a success with a send that may have committed: 0 or 1 order.
    pub(crate) ambiguous: Vec<String>,
    /// Keys refused before anything was written, or never sent: no order.
    pub(crate) failed: Vec<String>,
}

/// The ground truth of the run: every key in the file its fate puts it in
/// (a key answered 409 in none: it belongs to another request). With
/// `caller` (the token's), each line ends with a tab and it: the scope of
/// the keys.
pub(crate) fn key_lines(collector: &Collector, keys: &KeySpace, caller: Option<&str>) -> KeyLines {
    let mut lines = KeyLines::default();
    let scoped = |line: String| match caller {
        Some(caller) => format!("{line}\t{caller}"),
        None => line,
    };
    for (&index, state) in &collector.keys {
        if let Some(order_id) = state.order_id() {
            lines
                .intents
                .push(scoped(format!("{}\t{order_id}", keys.key(index))));
        } else if state.is_ambiguous() {
            lines.ambiguous.push(scoped(keys.key(index)));
        } else if state.is_refused() {
            lines.failed.push(scoped(keys.key(index)));
        }
    }
    lines.intents.sort_unstable();
    lines.ambiguous.sort_unstable();
    lines.failed.sort_unstable();
    lines
}

/// Writes lines to `path`.
pub(crate) fn write_lines(path: &Path, lines: &[String]) -> anyhow::Result<()> {
    let mut w = BufWriter::new(create(path)?);
    for line in lines {
        w.write_all(line.as_bytes())
            .and_then(|()| w.write_all(b"\n"))
            .with_context(|| format!("write {}", path.display()))?;
    }
    w.flush()
        .with_context(|| format!("write {}", path.display()))
}
