//! The redelivery horizon: the longest time after a msg_id was minted that a
//! copy of its event can still reach this consumer, derived from the
//! pipeline's own settings. The inbox must remember a msg_id at least that
//! long; `payments --inbox-retention` shorter than it is refused at start-up.
//!
//! A msg_id is minted (a UUIDv7, the orders host's clock) when its outbox row
//! is written, at time t0. Its last possible arrival:
//!
//! 1. The outbox keeps the row for the outbox retention (`orders.outbox_policy`):
//!    until then it can be published, or re-marked pending by an operator and
//!    published again. Last publish: t0 + outbox retention.
//! 2. The producer retries a send for up to its delivery timeout
//!    ([`RELAY_MAX_MESSAGE_TIMEOUT`], the relay refuses more): the copy can
//!    land that much later.
//! 3. The broker keeps the copy for the topic's `retention.ms`, and deletes
//!    whole segments only, so up to `segment.ms` longer. A consumer group
//!    reset to the earliest offset redelivers anything still there.
//! 4. An allowance for clocks and work in flight (`--clock-skew`): the mint
//!    time is the orders host's clock, expiry uses the database's, and a copy
//!    fetched just before its deletion is still being applied.
//!
//! ```text
//! horizon = outbox retention + delivery timeout + retention.ms + segment.ms + clock skew
//! ```
//!
//! A topic that keeps records forever (`retention.ms` = -1) has no horizon:
//! the inbox must keep every msg_id.
//!
//! Over HTTP (`--source http`) the hop between the outbox and this inbox is
//! the relay's webhook delivery, which retries on its schedule
//! (`effectively::webhook`) and keeps no copy once it gave up: terms 2 and 3
//! become the sender's longest retry span ([`max_retry_span`]: every wait at
//! its most, or a `Retry-After` of 4 h, and every attempt timing out).
//!
//! ```text
//! horizon = outbox retention + sender retry span + clock skew
//! ```
//!
//! The signature's timestamp tolerance (5 minutes) bounds the replay of a
//! captured request, not redelivery: a retry hours later is signed anew.
//!
//! The inbox drops a partition only when every msg_id in it is older than
//! the retention, and refuses any message older than the oldest partition
//! it kept ("after the dedup horizon"), so even a horizon exceeded by an
//! operator's mistake never applies a duplicate silently.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use effectively::webhook::max_retry_span;
use pipeline::contract::RELAY_MAX_MESSAGE_TIMEOUT;

/// Kafka's default `retention.ms` and `segment.ms` (7 days each), assumed for
/// a key the broker does not report.
pub const KAFKA_DEFAULT_MS: u64 = 7 * 24 * 3600 * 1000;

/// How long the broker keeps a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicRetention {
    /// `retention.ms` = -1 (or any negative value): kept forever.
    Forever,
    /// Kept this long after its timestamp.
    For(Duration),
}

/// The topic's settings that bound how long a copy stays readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicLifetime {
    /// `retention.ms`.
    pub retention: TopicRetention,
    /// `segment.ms`: a record can outlive `retention.ms` by this much.
    pub segment: Duration,
    /// Whether a value was assumed (Kafka's default) because the broker did
    /// not report the key.
    pub assumed: bool,
}

impl TopicLifetime {
    /// From the configs the broker reported (`retention.ms`, `segment.ms`);
    /// a missing key is Kafka's default. `Err` for a value that is not a
    /// number.
    pub fn from_configs(configs: &BTreeMap<String, String>) -> Result<Self, String> {
        let ms = |key: &str| -> Result<Option<i64>, String> {
            configs
                .get(key)
                .map(|v| {
                    v.trim()
                        .parse::<i64>()
                        .map_err(|e| format!("the topic's {key} {v:?} is not a number: {e}"))
                })
                .transpose()
        };
        let retention_ms = ms("retention.ms")?;
        let segment_ms = ms("segment.ms")?;
        let retention = match retention_ms {
            Some(v) if v < 0 => TopicRetention::Forever,
            Some(v) => TopicRetention::For(Duration::from_millis(v.unsigned_abs())),
            None => TopicRetention::For(Duration::from_millis(KAFKA_DEFAULT_MS)),
        };
        let segment = match segment_ms {
            Some(v) if v >= 0 => Duration::from_millis(v.unsigned_abs()),
            _ => Duration::from_millis(KAFKA_DEFAULT_MS),
        };
        Ok(Self {
            retention,
            segment,
            assumed: retention_ms.is_none() || segment_ms.is_none(),
        })
    }
}

/// The hop between the outbox and this inbox, and the terms it adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hop {
    /// The relay's producer and the topic.
    Kafka {
        /// The producer's longest delivery timeout.
        delivery_timeout: Duration,
        /// The topic's retention and segment span.
        topic: TopicLifetime,
    },
    /// The relay's webhook delivery.
    Webhook {
        /// The sender's longest retry span.
        retry_span: Duration,
    },
}

/// Every term of the horizon, as read at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sources {
    /// How long the outbox keeps a row (`orders.outbox_policy`).
    pub outbox_retention: Duration,
    /// The hop's terms.
    pub hop: Hop,
    /// Clocks and work in flight.
    pub clock_skew: Duration,
}

impl Sources {
    /// The terms over Kafka, with the producer's delivery timeout of the
    /// contract.
    pub fn new(outbox_retention: Duration, topic: TopicLifetime, clock_skew: Duration) -> Self {
        Self {
            outbox_retention,
            hop: Hop::Kafka {
                delivery_timeout: RELAY_MAX_MESSAGE_TIMEOUT,
                topic,
            },
            clock_skew,
        }
    }

    /// The terms over HTTP, with the sender's retry span of the contract.
    pub fn webhook(outbox_retention: Duration, clock_skew: Duration) -> Self {
        Self {
            outbox_retention,
            hop: Hop::Webhook {
                retry_span: max_retry_span(),
            },
            clock_skew,
        }
    }

    /// The horizon, or `None` when the topic keeps records forever.
    pub fn horizon(&self) -> Option<Duration> {
        let hop = match self.hop {
            Hop::Kafka {
                delivery_timeout,
                topic,
            } => match topic.retention {
                TopicRetention::Forever => return None,
                TopicRetention::For(retention) => delivery_timeout + retention + topic.segment,
            },
            Hop::Webhook { retry_span } => retry_span,
        };
        Some(self.outbox_retention + hop + self.clock_skew)
    }
}

impl fmt::Display for Sources {
    /// The derivation, one term per line, for the log and the refusal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = |d: Duration| humantime::format_duration(d).to_string();
        writeln!(
            f,
            "  outbox retention (orders.outbox_policy)   {}",
            d(self.outbox_retention)
        )?;
        match self.hop {
            Hop::Kafka {
                delivery_timeout,
                topic,
            } => {
                writeln!(
                    f,
                    "+ producer delivery timeout (relay max)     {}",
                    d(delivery_timeout)
                )?;
                let assumed = if topic.assumed {
                    " (not reported by the broker: Kafka's default assumed)"
                } else {
                    ""
                };
                match topic.retention {
                    TopicRetention::Forever => writeln!(
                        f,
                        "+ topic retention.ms                        forever (-1){assumed}"
                    )?,
                    TopicRetention::For(r) => writeln!(
                        f,
                        "+ topic retention.ms                        {}{assumed}",
                        d(r)
                    )?,
                }
                writeln!(
                    f,
                    "+ topic segment.ms                          {}",
                    d(topic.segment)
                )?;
            }
            Hop::Webhook { retry_span } => writeln!(
                f,
                "+ webhook sender's retry span (8 attempts)  {}",
                d(retry_span)
            )?,
        }
        writeln!(
            f,
            "+ clock skew and work in flight             {}",
            d(self.clock_skew)
        )?;
        match self.horizon() {
            Some(h) => write!(f, "= redelivery horizon                      {}", d(h)),
            None => write!(f, "= redelivery horizon                      unbounded"),
        }
    }
}

/// How long the inbox keeps a msg_id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Never expire.
    Forever,
    /// Drop a partition once all its msg_ids are older than this.
    For(Duration),
}

impl Retention {
    /// `forever`, or a duration such as `16d`, `36h`, `90m`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("forever") {
            return Ok(Self::Forever);
        }
        let d = humantime::parse_duration(s)
            .map_err(|e| format!("{s:?}: {e} (a duration such as 16d, 36h, 90m, or `forever`)"))?;
        if d.is_zero() {
            return Err("a retention of zero would forget every msg_id at once".into());
        }
        Ok(Self::For(d))
    }

    /// Whether this retention covers `horizon` (`None`: unbounded).
    pub fn covers(self, horizon: Option<Duration>) -> bool {
        match (self, horizon) {
            (Self::Forever, _) => true,
            (Self::For(_), None) => false,
            (Self::For(r), Some(h)) => r >= h,
        }
    }
}

impl fmt::Display for Retention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Forever => f.write_str("forever"),
            Self::For(d) => write!(f, "{}", humantime::format_duration(*d)),
        }
    }
}

/// A duration flag (5m, 1h, 1d): `humantime`, with an example in the error.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?}: {e} (e.g. 5m, 1h, 1d)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn configs(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_embedded_stack_and_compose_horizon_is_15_days_10_minutes() {
        // The topic as this project creates it (contract), the outbox's
        // default retention (7 days), the default skew (5 minutes).
        let configs = configs(&[("retention.ms", "604800000"), ("segment.ms", "86400000")]);
        let topic = TopicLifetime::from_configs(&configs).expect("configs");
        assert!(!topic.assumed);
        let sources = Sources::new(7 * DAY, topic, Duration::from_secs(300));
        assert_eq!(
            sources.horizon(),
            Some(15 * DAY + Duration::from_secs(600)),
            "7 d outbox + 5 min delivery + 7 d retention + 1 d segment + 5 min skew"
        );
        assert!(
            Retention::parse("16d")
                .expect("16d")
                .covers(sources.horizon())
        );
        assert!(
            !Retention::parse("15d")
                .expect("15d")
                .covers(sources.horizon())
        );
        let text = sources.to_string();
        assert!(
            text.ends_with("= redelivery horizon                      15days 10m"),
            "{text}"
        );
    }

    #[test]
    fn over_http_the_horizon_is_the_outbox_plus_the_senders_retry_span() {
        let sources = Sources::webhook(7 * DAY, Duration::from_secs(300));
        let span = Duration::from_secs(30 * 3600 + 24 * 60 + 4 * 60);
        assert_eq!(
            max_retry_span(),
            span,
            "30h24m of waits, 8 x 30 s of attempts"
        );
        assert_eq!(
            sources.horizon(),
            Some(8 * DAY + Duration::from_secs(6 * 3600 + 33 * 60)),
            "7 d outbox + 30h28m sender + 5 min skew"
        );
        assert!(
            Retention::parse("16d")
                .expect("16d")
                .covers(sources.horizon()),
            "the default inbox retention covers it"
        );
        let text = sources.to_string();
        assert!(text.contains("retry span"), "{text}");
        assert!(!text.contains("retention.ms"), "{text}");
        assert!(
            text.ends_with("= redelivery horizon                      8days 6h 33m"),
            "{text}"
        );
    }

    #[test]
    fn unreported_keys_are_kafka_defaults_and_negative_retention_is_forever() {
        let topic = TopicLifetime::from_configs(&BTreeMap::new()).expect("empty");
        assert!(topic.assumed);
        assert_eq!(topic.retention, TopicRetention::For(7 * DAY));
        assert_eq!(topic.segment, 7 * DAY);
        let sources = Sources::new(7 * DAY, topic, Duration::ZERO);
        assert_eq!(
            sources.horizon(),
            Some(21 * DAY + RELAY_MAX_MESSAGE_TIMEOUT)
        );
        assert!(sources.to_string().contains("Kafka's default assumed"));

        let forever = TopicLifetime::from_configs(&configs(&[("retention.ms", "-1")])).expect("-1");
        assert_eq!(forever.retention, TopicRetention::Forever);
        let sources = Sources::new(7 * DAY, forever, Duration::ZERO);
        assert_eq!(sources.horizon(), None);
        assert!(!Retention::parse("365d").expect("365d").covers(None));
        assert!(Retention::Forever.covers(None));

        let bad = TopicLifetime::from_configs(&configs(&[("retention.ms", "a week")]));
        assert!(bad.is_err_and(|e| e.contains("retention.ms")));
    }

    #[test]
    fn retention_parses_durations_and_forever_and_refuses_zero() {
        assert_eq!(Retention::parse("forever"), Ok(Retention::Forever));
        assert_eq!(
            Retention::parse(" 36h "),
            Ok(Retention::For(Duration::from_secs(36 * 3600)))
        );
        assert!(Retention::parse("0s").is_err());
        assert!(Retention::parse("soon").is_err_and(|e| e.contains("16d")));
        assert_eq!(Retention::For(16 * DAY).to_string(), "16days");
    }
}
