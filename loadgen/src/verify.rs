//! Replay verification: the first success of a key is the truth, and every
//! later success of that key, over either protocol, must match it.
//!
//! Over HTTP a replay must be byte-identical (status, body, `Location`,
//! `ETag`). Across protocols only what both carry can be compared: the order
//! id and its status text.

use uuid::Uuid;

use crate::outcome::Success;

/// Which protocol produced a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// HTTP.
    Http,
    /// gRPC.
    Grpc,
}

impl Success {
    /// The protocol that carried it.
    pub(crate) fn via(&self) -> Via {
        if self.http.is_some() {
            Via::Http
        } else {
            Via::Grpc
        }
    }
}

/// The first success of a key, compactly (about 60 bytes per key with the
/// map entry, instead of the full response, so long runs fit in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct First {
    order_id: Uuid,
    status: u64,
    via: Via,
}

/// What is known of one key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KeyState {
    first: Option<First>,
    /// Digest of the first HTTP success (which may come after a gRPC first).
    http: Option<[u8; 16]>,
    /// A send of this key may have been committed without our seeing it
    /// (no answer after it may have been received, or a 408/5xx).
    ambiguous: bool,
    /// A send of this key was answered 409 / ALREADY_EXISTS: the key is
    /// bound to another request.
    conflicted: bool,
}

/// The result of checking one success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The key's first success: it becomes the reference.
    First,
    /// A replay that matches the reference.
    Match {
        /// The reference came over the other protocol.
        cross_protocol: bool,
    },
    /// A replay that differs: an idempotency violation.
    Mismatch {
        /// What differs.
        reason: String,
        /// The reference came over the other protocol.
        cross_protocol: bool,
    },
}

/// A 64-bit hash of a status text, stable within the process.
fn status_hash(status: &str) -> u64 {
    let hash = blake3::hash(status.as_bytes());
    let mut out = [0u8; 8];
    out.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(out)
}

impl KeyState {
    /// Whether the key got at least one success.
    pub(crate) fn succeeded(&self) -> bool {
        self.first.is_some()
    }

    /// The order id of the key's first success.
    pub(crate) fn order_id(&self) -> Option<Uuid> {
        self.first.map(|f| f.order_id)
    }

    /// No success, but a send whose fate is unknown: the key holds 0 or 1
    /// order. Sticky, not only the last answer: a later refusal that does
    /// not read the key (a 503 shed at once, a connection refused) says
    /// nothing of what an earlier send committed.
    pub(crate) fn is_ambiguous(&self) -> bool {
        self.first.is_none() && self.ambiguous
    }

    /// No success, and every send was refused before anything was written
    /// or never left: the key must hold no order. A key answered 409 is
    /// not one of them (it is bound to another request's order).
    pub(crate) fn is_refused(&self) -> bool {
        self.first.is_none() && !self.ambiguous && !self.conflicted
    }

    /// Notes a send whose fate is unknown.
    pub(crate) fn mark_ambiguous(&mut self) {
        self.ambiguous = true;
    }

    /// Notes a 409 / ALREADY_EXISTS answer.
    pub(crate) fn mark_conflicted(&mut self) {
        self.conflicted = true;
    }

    /// Checks `success` against the reference (or makes it the reference).
    pub(crate) fn check(&mut self, success: &Success) -> Verdict {
        let via = success.via();
        let http_digest = success.http.as_ref().map(|reply| reply.digest());
        let Some(first) = self.first else {
            self.first = Some(First {
                order_id: success.order_id,
                status: status_hash(&success.status),
                via,
            });
            self.http = http_digest;
            return Verdict::First;
        };
        let cross_protocol = first.via != via;
        let mut problems = Vec::new();
        if first.order_id != success.order_id {
            problems.push(format!(
                "order_id {} differs from the first success's {}",
                success.order_id, first.order_id
            ));
        }
        if first.status != status_hash(&success.status) {
            problems.push(format!(
                "status {:?} differs from the first success's",
                success.status
            ));
        }
        if let Some(digest) = http_digest {
            match self.http {
                Some(reference) if reference != digest => problems.push(
                    "HTTP reply (status, body, location, etag) differs from the first HTTP success"
                        .to_owned(),
                ),
                Some(_) => {}
                None => self.http = Some(digest),
            }
        }
        if problems.is_empty() {
            Verdict::Match { cross_protocol }
        } else {
            Verdict::Mismatch {
                reason: problems.join("; "),
                cross_protocol,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::HeaderValue;

    use super::*;
    use crate::outcome::HttpReply;

    fn http(order_id: Uuid, etag: &str) -> Success {
        let body = format!(r#"{{"order_id":"{order_id}","status":"created"}}"#);
        Success {
            order_id,
            status: "created".into(),
            http: Some(HttpReply {
                status: 201,
                body: Bytes::from(body),
                location: HeaderValue::from_str(&format!("/orders/{order_id}")).ok(),
                etag: HeaderValue::from_str(etag).ok(),
            }),
        }
    }

    fn grpc(order_id: Uuid, status: &str) -> Success {
        Success {
            order_id,
            status: status.into(),
            http: None,
        }
    }

    #[test]
    fn identical_replays_match() {
        let id = Uuid::now_v7();
        let mut state = KeyState::default();
        assert!(!state.succeeded());
        assert_eq!(state.check(&http(id, "\"e\"")), Verdict::First);
        assert!(state.succeeded());
        assert_eq!(state.order_id(), Some(id));
        assert_eq!(
            state.check(&http(id, "\"e\"")),
            Verdict::Match {
                cross_protocol: false
            }
        );
        assert_eq!(
            state.check(&grpc(id, "created")),
            Verdict::Match {
                cross_protocol: true
            }
        );
    }

    #[test]
    fn another_order_id_is_a_mismatch() {
        let mut state = KeyState::default();
        state.check(&http(Uuid::now_v7(), "\"e\""));
        let verdict = state.check(&grpc(Uuid::now_v7(), "created"));
        assert!(
            matches!(verdict, Verdict::Mismatch { cross_protocol: true, ref reason } if reason.contains("order_id")),
            "{verdict:?}"
        );
    }

    #[test]
    fn http_replays_must_be_byte_identical() {
        let id = Uuid::now_v7();
        let mut state = KeyState::default();
        state.check(&http(id, "\"e\""));
        let verdict = state.check(&http(id, "\"other\""));
        assert!(
            matches!(verdict, Verdict::Mismatch { cross_protocol: false, ref reason } if reason.contains("HTTP reply")),
            "{verdict:?}"
        );
    }

    #[test]
    fn grpc_first_then_http_sets_the_http_reference() {
        let id = Uuid::now_v7();
        let mut state = KeyState::default();
        assert_eq!(state.check(&grpc(id, "created")), Verdict::First);
        assert_eq!(
            state.check(&http(id, "\"e\"")),
            Verdict::Match {
                cross_protocol: true
            }
        );
        // The first HTTP success is now the reference for HTTP replays.
        assert!(matches!(
            state.check(&http(id, "\"f\"")),
            Verdict::Mismatch { .. }
        ));
        assert!(matches!(
            state.check(&grpc(id, "cancelled")),
            Verdict::Mismatch { ref reason, .. } if reason.contains("status")
        ));
    }

    #[test]
    fn ambiguity_only_without_success() {
        let mut state = KeyState::default();
        assert!(state.is_refused());
        state.mark_ambiguous();
        assert!(state.is_ambiguous());
        assert!(!state.is_refused());
        state.check(&grpc(Uuid::now_v7(), "created"));
        assert!(!state.is_ambiguous());
        assert!(!state.is_refused());

        let mut conflict = KeyState::default();
        conflict.mark_conflicted();
        assert!(!conflict.is_refused() && !conflict.is_ambiguous());
    }
}
