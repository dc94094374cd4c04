//! What one send got back: the [`Outcome`] of a create, the [`Answer`] the
//! service gave, a success with the reply a replay must reproduce. The
//! clients produce these; the collector, the verifier and the report read
//! them.

use std::borrow::Cow;

use bytes::Bytes;
use http::HeaderValue;
use serde::Deserialize;
use tonic::Code;
use uuid::Uuid;

/// How an answer was carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// An HTTP status code.
    Http(u16),
    /// A gRPC status code.
    Grpc(Code),
}

impl Answer {
    /// The status class (`"2xx"` ... `"5xx"`); gRPC codes map to the HTTP
    /// class of their usual HTTP equivalent (e.g. ALREADY_EXISTS → 4xx).
    pub(crate) fn class(self) -> &'static str {
        match self {
            Answer::Http(s) => match s {
                100..=199 => "1xx",
                200..=299 => "2xx",
                300..=399 => "3xx",
                400..=499 => "4xx",
                _ => "5xx",
            },
            Answer::Grpc(code) => match code {
                Code::Ok => "2xx",
                Code::Cancelled
                | Code::InvalidArgument
                | Code::NotFound
                | Code::AlreadyExists
                | Code::PermissionDenied
                | Code::ResourceExhausted
                | Code::FailedPrecondition
                | Code::Aborted
                | Code::OutOfRange
                | Code::Unauthenticated => "4xx",
                Code::Unknown
                | Code::DeadlineExceeded
                | Code::Unimplemented
                | Code::Internal
                | Code::Unavailable
                | Code::DataLoss => "5xx",
            },
        }
    }

    /// Whether this is the "key reused with another request" answer.
    pub(crate) fn is_conflict(self) -> bool {
        matches!(self, Answer::Http(409) | Answer::Grpc(Code::AlreadyExists))
    }

    /// Whether the service may have committed the request although it
    /// answered this error, so the key holds 0 or 1 order and a retry with
    /// the same key is what tells (the book's Orders chapter, docs/book/src/orders.md: "retry with the same key").
    /// orders answers 408 (gRPC CANCELLED "Timeout expired", or
    /// DEADLINE_EXCEEDED) when its route times out, and a create a writer
    /// already took into a batch is still committed; 500 (INTERNAL) and 503
    /// (UNAVAILABLE) when a batch's transaction failed, which includes the
    /// connection lost after COMMIT was sent. 502 and 504 come from a proxy
    /// in front, which cannot know either. Every other 4xx (and gRPC code of
    /// that class) refuses the request before anything is written.
    pub(crate) fn may_have_committed(self) -> bool {
        match self {
            Answer::Http(status) => status == 408 || (500..=599).contains(&status),
            Answer::Grpc(code) => matches!(
                code,
                Code::Cancelled
                    | Code::DeadlineExceeded
                    | Code::Unknown
                    | Code::Internal
                    | Code::Unavailable
                    | Code::DataLoss
            ),
        }
    }
}

/// The canonical gRPC name of a code (as in the gRPC spec).
pub(crate) fn grpc_code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// An HTTP success as received: everything a replay must reproduce byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HttpReply {
    /// Status code.
    pub(crate) status: u16,
    /// Body bytes (shared with hyper's buffer, not copied).
    pub(crate) body: Bytes,
    /// `Location` header.
    pub(crate) location: Option<HeaderValue>,
    /// `ETag` header.
    pub(crate) etag: Option<HeaderValue>,
}

impl HttpReply {
    /// A 128-bit digest of status, body, location and etag (length-prefixed,
    /// so fields cannot run into each other). Kept per key instead of the
    /// bytes themselves, so millions of keys fit in memory.
    pub(crate) fn digest(&self) -> [u8; 16] {
        let mut h = blake3::Hasher::new_derive_key("loadgen http replay v1");
        h.update(&self.status.to_be_bytes());
        for field in [
            Some(self.body.as_ref()),
            self.location.as_ref().map(HeaderValue::as_bytes),
            self.etag.as_ref().map(HeaderValue::as_bytes),
        ] {
            match field {
                Some(bytes) => {
                    h.update(&[1]);
                    h.update(&(bytes.len() as u64).to_be_bytes());
                    h.update(bytes);
                }
                None => {
                    h.update(&[0]);
                }
            }
        }
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        out
    }

    /// A one-line rendering for logs.
    pub(crate) fn describe(&self) -> String {
        let text = |v: &Option<HeaderValue>| {
            v.as_ref()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_else(|| "-".into())
        };
        format!(
            "HTTP {} location={} etag={} body={}",
            self.status,
            text(&self.location),
            text(&self.etag),
            String::from_utf8_lossy(&self.body)
        )
    }
}

/// A successful create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Success {
    /// The order the service says the key maps to.
    pub(crate) order_id: Uuid,
    /// Its status text.
    pub(crate) status: String,
    /// The full HTTP reply, when it came over HTTP.
    pub(crate) http: Option<HttpReply>,
}

impl Success {
    /// A one-line rendering for logs.
    pub(crate) fn describe(&self) -> String {
        match &self.http {
            Some(reply) => reply.describe(),
            None => format!("gRPC OK order_id={} status={}", self.order_id, self.status),
        }
    }
}

/// What one send ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Created (or replayed) with a well-formed answer.
    Ok(Success),
    /// The service answered with an error status.
    Failed(Answer),
    /// The service answered success, but the body is not a created order.
    BadResponse(Answer, String),
    /// No connection could be made: the request never left, nothing can
    /// have been created.
    ConnectError,
    /// The exchange broke after the request may have reached the service:
    /// the key is ambiguous.
    TransportError,
    /// No answer within --timeout-ms: the key is ambiguous.
    Timeout,
    /// Still outstanding at the hard stop: the key is ambiguous.
    Abandoned,
    /// The request could not even be built (an invalid key); not sent.
    NotSent,
}

impl Outcome {
    /// Whether a client that retries errors sends again: no answer, or an
    /// answer that may hide a commit (408, 5xx: [`Answer::may_have_committed`]),
    /// which orders documents as safe to retry with the same key. Any other
    /// 4xx, a success, a malformed success and the hard stop are final.
    pub(crate) fn worth_retrying(&self) -> bool {
        match self {
            Outcome::ConnectError | Outcome::TransportError | Outcome::Timeout => true,
            Outcome::Failed(answer) => answer.may_have_committed(),
            Outcome::Ok(_) | Outcome::BadResponse(..) | Outcome::Abandoned | Outcome::NotSent => {
                false
            }
        }
    }

    /// The answer, if the service gave one.
    pub(crate) fn answer(&self) -> Option<Answer> {
        match self {
            Outcome::Ok(s) => Some(match &s.http {
                Some(reply) => Answer::Http(reply.status),
                None => Answer::Grpc(Code::Ok),
            }),
            Outcome::Failed(a) | Outcome::BadResponse(a, _) => Some(*a),
            _ => None,
        }
    }

    /// Whether the service may have created the key without us seeing it:
    /// no answer after the request may have reached it, an error answer that
    /// may hide a commit ([`Answer::may_have_committed`]), or a success
    /// whose body is not a created order (the service said it created one).
    pub(crate) fn is_ambiguous(&self) -> bool {
        match self {
            Outcome::TransportError
            | Outcome::Timeout
            | Outcome::Abandoned
            | Outcome::BadResponse(..) => true,
            Outcome::Failed(answer) => answer.may_have_committed(),
            Outcome::Ok(_) | Outcome::ConnectError | Outcome::NotSent => false,
        }
    }
}

/// The `{"order_id","status"}` body of a created order, borrowed from the bytes.
#[derive(Deserialize)]
struct CreatedView<'a> {
    #[serde(borrow)]
    order_id: Cow<'a, str>,
    #[serde(borrow)]
    status: Cow<'a, str>,
}

/// Reads the created body; `Err` explains what is wrong with it.
pub(crate) fn parse_created(body: &[u8]) -> Result<(Uuid, String), String> {
    let view: CreatedView<'_> =
        serde_json::from_slice(body).map_err(|e| format!("body is not a created order: {e}"))?;
    let order_id = Uuid::parse_str(&view.order_id)
        .map_err(|e| format!("order_id {:?} is not a UUID: {e}", view.order_id))?;
    Ok((order_id, view.status.into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(body: &'static str, etag: &'static str) -> HttpReply {
        HttpReply {
            status: 201,
            body: Bytes::from_static(body.as_bytes()),
            location: Some(HeaderValue::from_static("/orders/x")),
            etag: Some(HeaderValue::from_static(etag)),
        }
    }

    #[test]
    fn digest_covers_every_field() {
        let a = reply("{}", "\"1\"");
        assert_eq!(a.digest(), reply("{}", "\"1\"").digest());
        assert_ne!(a.digest(), reply("{} ", "\"1\"").digest());
        assert_ne!(a.digest(), reply("{}", "\"2\"").digest());
        let mut b = a.clone();
        b.status = 200;
        assert_ne!(a.digest(), b.digest());
        let mut c = a.clone();
        c.location = None;
        assert_ne!(a.digest(), c.digest());
        // Length prefixes: moving bytes between fields changes the digest.
        let d = HttpReply {
            status: 201,
            body: Bytes::from_static(b"ab"),
            location: Some(HeaderValue::from_static("c")),
            etag: None,
        };
        let e = HttpReply {
            status: 201,
            body: Bytes::from_static(b"a"),
            location: Some(HeaderValue::from_static("bc")),
            etag: None,
        };
        assert_ne!(d.digest(), e.digest());
    }

    #[test]
    fn created_bodies_parse_and_garbage_does_not() {
        let id = Uuid::now_v7();
        let body = format!(r#"{{"order_id":"{id}","status":"created"}}"#);
        assert_eq!(parse_created(body.as_bytes()), Ok((id, "created".into())));
        assert!(parse_created(b"").is_err());
        assert!(parse_created(b"\xff\xfe").is_err());
        assert!(parse_created(br#"{"order_id":"nope","status":"created"}"#).is_err());
        assert!(parse_created(br#"{"error":{"code":"x","message":"y"}}"#).is_err());
    }

    #[test]
    fn only_errors_without_a_definitive_answer_are_retried() {
        assert!(Outcome::ConnectError.worth_retrying());
        assert!(Outcome::TransportError.worth_retrying());
        assert!(Outcome::Timeout.worth_retrying());
        assert!(Outcome::Failed(Answer::Http(503)).worth_retrying());
        assert!(Outcome::Failed(Answer::Grpc(Code::Unavailable)).worth_retrying());
        assert!(Outcome::Failed(Answer::Http(408)).worth_retrying());
        assert!(Outcome::Failed(Answer::Http(500)).worth_retrying());
        assert!(Outcome::Failed(Answer::Grpc(Code::Cancelled)).worth_retrying());
        assert!(Outcome::Failed(Answer::Grpc(Code::DeadlineExceeded)).worth_retrying());
        assert!(!Outcome::Failed(Answer::Grpc(Code::Unimplemented)).worth_retrying());
        assert!(!Outcome::Failed(Answer::Http(409)).worth_retrying());
        assert!(!Outcome::Failed(Answer::Http(400)).worth_retrying());
        assert!(!Outcome::Failed(Answer::Http(429)).worth_retrying());
        assert!(!Outcome::Failed(Answer::Grpc(Code::AlreadyExists)).worth_retrying());
        assert!(!Outcome::Abandoned.worth_retrying());
        assert!(!Outcome::NotSent.worth_retrying());
    }

    #[test]
    fn classes_and_conflicts() {
        assert_eq!(Answer::Http(201).class(), "2xx");
        assert_eq!(Answer::Http(409).class(), "4xx");
        assert_eq!(Answer::Http(503).class(), "5xx");
        assert_eq!(Answer::Http(999).class(), "5xx");
        assert_eq!(Answer::Grpc(Code::AlreadyExists).class(), "4xx");
        assert_eq!(Answer::Grpc(Code::Unavailable).class(), "5xx");
        assert!(Answer::Http(409).is_conflict());
        assert!(Answer::Grpc(Code::AlreadyExists).is_conflict());
        assert!(!Answer::Http(400).is_conflict());
    }

    #[test]
    fn ambiguity() {
        assert!(Outcome::Timeout.is_ambiguous());
        assert!(Outcome::Abandoned.is_ambiguous());
        assert!(Outcome::TransportError.is_ambiguous());
        assert!(!Outcome::ConnectError.is_ambiguous());
        assert!(!Outcome::NotSent.is_ambiguous());
        // Answers orders gives for a request it may still commit: the route's
        // timeout (408) with the create already in a batch, a batch whose
        // COMMIT's answer was lost (500, 503), and what a proxy says.
        for status in [408, 500, 502, 503, 504] {
            assert!(
                Outcome::Failed(Answer::Http(status)).is_ambiguous(),
                "{status}"
            );
        }
        for code in [
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::Unknown,
            Code::Internal,
            Code::Unavailable,
        ] {
            assert!(
                Outcome::Failed(Answer::Grpc(code)).is_ambiguous(),
                "{code:?}"
            );
        }
        // Refused before anything is written.
        for status in [400, 404, 409, 413, 415, 429] {
            assert!(
                !Outcome::Failed(Answer::Http(status)).is_ambiguous(),
                "{status}"
            );
        }
        for code in [
            Code::InvalidArgument,
            Code::AlreadyExists,
            Code::Unimplemented,
        ] {
            assert!(
                !Outcome::Failed(Answer::Grpc(code)).is_ambiguous(),
                "{code:?}"
            );
        }
        // A success status whose body is not a created order: it said created.
        assert!(Outcome::BadResponse(Answer::Http(201), "garbage".into()).is_ambiguous());
    }
}
