// --- traces in the pipeline's words ---------------------------------------------

use std::fmt::Write as _;

use stateright::{Model, Path};

use crate::config::Consume;
use crate::state::{Action, Kind, PayStage, Phase, RelayStage, Stage, State, u};
use crate::steps::Pipeline;

fn key(k: u8) -> String {
    format!("k{}", k + 1)
}

fn order(o: u8) -> String {
    format!("o{}", o + 1)
}

fn event(s: &State, msg: u8) -> String {
    let m = s.msgs[usize::from(msg)];
    let kind = match m.kind {
        Kind::Created => "order.created",
        Kind::Cancelled => "order.cancelled",
    };
    format!("{} {kind} (msg {})", order(m.order), msg + 1)
}

/// One step in the pipeline's words, from the state it is taken in.
pub fn narrate(model: &Pipeline, s: &State, action: Action) -> String {
    let cfg = model.cfg();
    let next = model.next_state(s, action);
    let next = next.as_ref().unwrap_or(s);
    match action {
        Action::Send(k) => format!("client sends {}", key(k)),
        Action::Retry(k) => {
            let why = if s.clients[usize::from(k)].phase == Phase::Failed {
                "after an error"
            } else {
                "after a timeout (the first still in flight)"
            };
            format!("client retries {} {why}", key(k))
        }
        Action::Commit(i) => {
            let r = s.reqs[usize::from(i)];
            let after = next
                .reqs
                .iter()
                .find(|x| x.key == r.key && x.stage != Stage::Received);
            match (s.keys[usize::from(r.key)], after.map(|x| x.stage)) {
                (Some(o), _) => format!(
                    "orders finds {} taken: replays the stored response for {}",
                    key(r.key),
                    order(o)
                ),
                (None, Some(Stage::Published { msg, .. })) => {
                    let p = next.partition(cfg, msg);
                    format!(
                        "orders publishes {} at partition {p} offset {} before committing (dual write)",
                        event(next, msg),
                        next.log[p].len() - 1,
                    )
                }
                (None, Some(Stage::Saved { order: o })) => format!(
                    "orders commits order {} for {} (no outbox row; the publish comes after)",
                    order(o),
                    key(r.key)
                ),
                (None, _) => {
                    let o = next.keys[usize::from(r.key)].unwrap_or_default();
                    format!(
                        "orders commits key {} + order {} + outbox row {} in one transaction",
                        key(r.key),
                        order(o),
                        next.outbox.len()
                    )
                }
            }
        }
        Action::SecondWrite(i) => match s.reqs[usize::from(i)].stage {
            Stage::Published { order: o, .. } => {
                match s.keys[usize::from(s.reqs[usize::from(i)].key)] {
                    Some(taken) => format!(
                        "orders finds the key taken by {}: {} never commits",
                        order(taken),
                        order(o)
                    ),
                    None => format!("orders commits order {} after its publish", order(o)),
                }
            }
            Stage::Saved { .. } => {
                let msg = u(next.msgs.len() - 1);
                format!(
                    "orders publishes {} after the commit, at offset {}",
                    event(next, msg),
                    next.log[next.partition(cfg, msg)].len() - 1
                )
            }
            _ => "orders: nothing".into(),
        },
        Action::Answer(i) => {
            let r = s.reqs[usize::from(i)];
            match r.stage {
                Stage::Committed { order: o } => {
                    format!("orders answers {}: 201 {}", key(r.key), order(o))
                }
                _ => "orders answers".into(),
            }
        }
        Action::OrdersCrash => {
            let committed = s
                .reqs
                .iter()
                .any(|r| matches!(r.stage, Stage::Committed { .. } | Stage::Saved { .. }));
            let published = s
                .reqs
                .iter()
                .any(|r| matches!(r.stage, Stage::Published { .. }));
            if published {
                "orders crashes (kill -9 after its publish, before its commit); its clients get an error".into()
            } else if committed {
                "orders crashes (kill -9 at 'commit': committed, before the answer); its clients get an error".into()
            } else {
                "orders crashes (kill -9 before the commit); its clients get an error".into()
            }
        }
        Action::Cancel(k) => {
            let msg = u(next.msgs.len() - 1);
            format!(
                "client cancels its order ({}): orders writes {} as outbox row {}",
                key(k),
                event(next, msg),
                next.outbox.len()
            )
        }
        Action::Acquire(r) => format!("relay {r} takes the shard's lease (epoch {})", next.epoch),
        Action::Claim(r) => match next.relays[usize::from(r)] {
            RelayStage::Claimed { row, .. } => format!(
                "relay {r} claims row {} ({})",
                row + 1,
                event(s, s.outbox[usize::from(row)].msg)
            ),
            _ => format!("relay {r} claims"),
        },
        Action::Publish(r) => match (s.relays[usize::from(r)], next.relays[usize::from(r)]) {
            (RelayStage::Claimed { row, epoch }, RelayStage::Published { .. }) => {
                let msg = s.outbox[usize::from(row)].msg;
                let p = s.partition(cfg, msg);
                let stale = if s.lease != Some((r, epoch)) {
                    format!(
                        " (its lease, epoch {epoch}, has expired: the publish is not fenced, only the mark)"
                    )
                } else {
                    String::new()
                };
                format!(
                    "relay {r} publishes row {} at partition {p} offset {}{stale}",
                    row + 1,
                    s.log[p].len()
                )
            }
            (RelayStage::Claimed { row, epoch }, _) => format!(
                "relay {r}'s publish of row {} is fenced off (epoch {epoch} is stale: its transactional producer is fenced)",
                row + 1
            ),
            _ => format!("relay {r} publishes"),
        },
        Action::Mark(r) => match s.relays[usize::from(r)] {
            RelayStage::Published { row, epoch } => {
                if s.lease != Some((r, epoch)) {
                    format!(
                        "relay {r}'s mark of row {} is fenced off (epoch {epoch} is stale: its transaction was aborted)",
                        row + 1
                    )
                } else {
                    format!("relay {r} marks row {} published", row + 1)
                }
            }
            _ => format!("relay {r} marks"),
        },
        Action::RelayCrash(r) => match s.relays[usize::from(r)] {
            RelayStage::Published { row, .. } => format!(
                "relay {r} crashes (kill -9 at 'publish': row {} acked, not marked)",
                row + 1
            ),
            _ => format!("relay {r} crashes (kill -9 after the claim, before the publish)"),
        },
        Action::LeaseExpire => match s.lease {
            Some((h, e)) => format!("relay {h}'s lease (epoch {e}) expires while it is paused"),
            None => "a lease expires".into(),
        },
        Action::Apply(p) => {
            let pi = usize::from(p);
            let off = s.position[pi];
            let msg = s.log[pi][usize::from(off)];
            let what = match (cfg.consume, next.pay) {
                (Consume::OffsetsFirst, _) => {
                    "commits the offset past it first (before its transaction)".to_owned()
                }
                (Consume::SplitInboxFirst, PayStage::Half { .. }) => {
                    "claims its inbox row (tx 1 of 2, committed)".to_owned()
                }
                (Consume::SplitEffectFirst, PayStage::Half { .. }) => {
                    "applies its effect (tx 1 of 2, committed)".to_owned()
                }
                _ if next.effects.len() > s.effects.len() => {
                    "claims the inbox row and applies the effect in one transaction".to_owned()
                }
                _ => "finds it in the inbox: a duplicate, skipped".to_owned(),
            };
            format!(
                "payments reads {} at partition {p} offset {off}: {what}",
                event(s, msg)
            )
        }
        Action::Finish => match s.pay {
            PayStage::Half { msg } => match cfg.consume {
                Consume::SplitInboxFirst => {
                    format!(
                        "payments applies the effect of {} (tx 2 of 2)",
                        event(s, msg)
                    )
                }
                _ => format!(
                    "payments claims the inbox row of {} (tx 2 of 2)",
                    event(s, msg)
                ),
            },
            PayStage::Fetched { msg } => {
                format!(
                    "payments applies {} (inbox + effect, one transaction)",
                    event(s, msg)
                )
            }
            PayStage::Idle => "payments: nothing".into(),
        },
        Action::CommitOffsets => format!("payments commits offsets {:?}", next.committed),
        Action::PaymentsCrash => match s.pay {
            PayStage::Half { .. } => {
                "payments crashes (kill -9 at 'split', between its two transactions)".into()
            }
            PayStage::Fetched { .. } => {
                "payments crashes (after the offset commit, before the transaction)".into()
            }
            PayStage::Idle => format!(
                "payments crashes (after its transaction, before the offset commit); it resumes at offsets {:?}",
                s.committed
            ),
        },
        Action::Redeliver(p) => format!(
            "partition {p} is delivered again from offset {} (seek back)",
            s.log_start[usize::from(p)]
        ),
        Action::LogRetention(p) => format!(
            "the broker deletes partition {p} offset {} (retention)",
            s.log_start[usize::from(p)]
        ),
        Action::InboxExpire(m) => {
            if cfg.inbox_covers_horizon {
                format!(
                    "the inbox row of {} expires (beyond the redelivery horizon)",
                    event(s, m)
                )
            } else {
                format!(
                    "the inbox row of {} expires (retention shorter than the horizon)",
                    event(s, m)
                )
            }
        }
        Action::KeyExpire(k) => format!("key {} expires (its client no longer retries)", key(k)),
    }
}

/// A path as numbered lines in the pipeline's words.
pub fn narrate_path(model: &Pipeline, path: &Path<State, Action>) -> Vec<String> {
    path.clone()
        .into_vec()
        .into_iter()
        .filter_map(|(s, a)| a.map(|a| narrate(model, &s, a)))
        .collect()
}

/// `lines` numbered, one per line.
pub fn numbered(lines: &[String]) -> String {
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        let _ = writeln!(out, "  {:>2}. {l}", i + 1);
    }
    out
}
