//! The two clients (one shared HTTP/1.1 keep-alive pool, one shared HTTP/2
//! gRPC channel) and the classification of what each send got back. Nothing
//! the network returns can panic here: every failure is an [`Outcome`].

use std::borrow::Cow;
use std::error::Error as _;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use effectively::contract::IDEMPOTENCY_KEY;
use http::header::{CONTENT_TYPE, ETAG, LOCATION};
use http::{HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use uuid::Uuid;

use crate::keys::Body;
use crate::proto;
use crate::proto::orders_client::OrdersClient;

/// Largest response body read; a larger one is a transport error, not an
/// unbounded allocation.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// An order id no order has: the reachability probe asks for it.
const PROBE_ORDER_ID: &str = "00000000-0000-0000-0000-000000000000";

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
    /// Whether a client that retries errors sends again: no answer, or a
    /// server-side failure (5xx class). A 4xx, a success, a malformed success
    /// and the hard stop are final.
    pub(crate) fn worth_retrying(&self) -> bool {
        match self {
            Outcome::ConnectError | Outcome::TransportError | Outcome::Timeout => true,
            Outcome::Failed(answer) => answer.class() == "5xx",
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

    /// Whether the service may have created the key without us seeing it.
    pub(crate) fn is_ambiguous(&self) -> bool {
        matches!(
            self,
            Outcome::TransportError | Outcome::Timeout | Outcome::Abandoned
        )
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

/// `POST {base}/orders` over a shared keep-alive pool.
#[derive(Debug, Clone)]
pub(crate) struct HttpTarget {
    client: Client<HttpConnector, Full<Bytes>>,
    orders: Uri,
    probe: Uri,
}

impl HttpTarget {
    /// A client for `base_url` (no trailing slash).
    pub(crate) fn new(base_url: &str, connect_timeout: Duration) -> anyhow::Result<Self> {
        let orders: Uri = format!("{base_url}/orders")
            .parse()
            .with_context(|| format!("--http-url {base_url:?} is not a valid URL"))?;
        let probe: Uri = format!("{base_url}/orders/{PROBE_ORDER_ID}")
            .parse()
            .with_context(|| format!("--http-url {base_url:?} is not a valid URL"))?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        // Idle connections are kept (no per-host cap): under an open model the
        // pool grows to the concurrency the service's latency demands.
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            client,
            orders,
            probe,
        })
    }

    /// Sends one create and classifies the result.
    pub(crate) async fn create(&self, key: &str, body: Body) -> Outcome {
        let Ok(key) = HeaderValue::from_str(key) else {
            return Outcome::NotSent;
        };
        let request = Request::builder()
            .method(Method::POST)
            .uri(self.orders.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(IDEMPOTENCY_KEY, key)
            .body(Full::new(Bytes::from(body.to_json())));
        let Ok(request) = request else {
            return Outcome::NotSent;
        };
        let response = match self.client.request(request).await {
            Ok(response) => response,
            Err(e) if e.is_connect() => return Outcome::ConnectError,
            Err(_) => return Outcome::TransportError,
        };
        let (parts, body) = response.into_parts();
        // Read the body even for errors, so the connection goes back to the pool.
        let body = match Limited::new(body, MAX_RESPONSE_BYTES).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => return Outcome::TransportError,
        };
        let status = parts.status.as_u16();
        if !parts.status.is_success() {
            return Outcome::Failed(Answer::Http(status));
        }
        match parse_created(&body) {
            Ok((order_id, status_text)) => Outcome::Ok(Success {
                order_id,
                status: status_text,
                http: Some(HttpReply {
                    status,
                    body,
                    location: parts.headers.get(LOCATION).cloned(),
                    etag: parts.headers.get(ETAG).cloned(),
                }),
            }),
            Err(why) => Outcome::BadResponse(
                Answer::Http(status),
                format!("HTTP {status}: {why}: {}", String::from_utf8_lossy(&body)),
            ),
        }
    }

    /// Checks that the Orders service answers, without creating anything:
    /// `GET /orders/{nil uuid}` must be a 404 (which also proves the service
    /// reaches its database).
    pub(crate) async fn probe(&self, timeout: Duration) -> anyhow::Result<()> {
        let request = Request::builder()
            .method(Method::GET)
            .uri(self.probe.clone())
            .body(Full::new(Bytes::new()))
            .context("build the probe request")?;
        let response = tokio::time::timeout(timeout, self.client.request(request))
            .await
            .with_context(|| format!("no answer from {} within {timeout:?}", self.probe))?
            .with_context(|| format!("cannot reach {}", self.probe))?;
        let status = response.status();
        let body = tokio::time::timeout(
            timeout,
            Limited::new(response.into_body(), MAX_RESPONSE_BYTES).collect(),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .map(|c| c.to_bytes())
        .unwrap_or_default();
        if status != StatusCode::NOT_FOUND {
            bail!(
                "GET {} answered {status} (expected 404 from the Orders service): {}",
                self.probe,
                String::from_utf8_lossy(&body)
            );
        }
        Ok(())
    }
}

/// `orders.v1.Orders/Create` over one shared HTTP/2 channel.
#[derive(Debug, Clone)]
pub(crate) struct GrpcTarget {
    client: OrdersClient<Channel>,
}

impl GrpcTarget {
    /// Connects to `url` (one HTTP/2 connection; requests multiplex on it).
    /// Fails if the connection cannot be made.
    pub(crate) async fn connect(
        url: &str,
        connect_timeout: Duration,
        max_in_flight: usize,
    ) -> anyhow::Result<Self> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .with_context(|| format!("--grpc-url {url:?} is not a valid URL"))?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            // The channel queues requests in front of the connection; size the
            // queue so it never blocks below our own in-flight bound.
            .buffer_size(max_in_flight.max(1024));
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("cannot connect to gRPC {url}"))?;
        Ok(Self {
            client: OrdersClient::new(channel),
        })
    }

    /// Sends one create and classifies the result.
    pub(crate) async fn create(&self, key: &str, body: Body) -> Outcome {
        let mut request = tonic::Request::new(proto::CreateOrderRequest {
            account_id: body.account_id,
            amount_cents: body.amount_cents,
        });
        let Ok(key) = MetadataValue::try_from(key) else {
            return Outcome::NotSent;
        };
        request.metadata_mut().insert(IDEMPOTENCY_KEY, key);
        // Cloning a client clones the channel handle, not the connection.
        let mut client = self.client.clone();
        match client.create(request).await {
            Ok(response) => {
                let message = response.into_inner();
                match Uuid::parse_str(&message.order_id) {
                    Ok(order_id) => Outcome::Ok(Success {
                        order_id,
                        status: message.status,
                        http: None,
                    }),
                    Err(e) => Outcome::BadResponse(
                        Answer::Grpc(Code::Ok),
                        format!(
                            "gRPC OK: order_id {:?} is not a UUID: {e}",
                            message.order_id
                        ),
                    ),
                }
            }
            Err(status) => classify_grpc_error(&status),
        }
    }

    /// Checks that the Orders service answers, without creating anything:
    /// `Get` of the nil UUID must be NOT_FOUND.
    pub(crate) async fn probe(&self, timeout: Duration) -> anyhow::Result<()> {
        let mut client = self.client.clone();
        let request = tonic::Request::new(proto::GetOrderRequest {
            order_id: PROBE_ORDER_ID.to_owned(),
        });
        let result = tokio::time::timeout(timeout, client.get(request))
            .await
            .with_context(|| format!("no gRPC answer within {timeout:?}"))?;
        match result {
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => bail!(
                "gRPC Get answered {} (expected NOT_FOUND from the Orders service): {}",
                grpc_code_name(status.code()),
                status.message()
            ),
            Ok(_) => {
                bail!("gRPC Get of the nil order id returned an order; is this the Orders service?")
            }
        }
    }
}

/// A status the server sent has no source; one tonic made from a local
/// failure carries the underlying error. A failure to connect means nothing
/// was sent; any other local failure may have happened after the request
/// reached the service.
fn classify_grpc_error(status: &tonic::Status) -> Outcome {
    let Some(source) = status.source() else {
        return Outcome::Failed(Answer::Grpc(status.code()));
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source);
    while let Some(err) = cause {
        if err.is::<tonic::ConnectError>() {
            return Outcome::ConnectError;
        }
        cause = err.source();
    }
    Outcome::TransportError
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
        assert!(!Outcome::Failed(Answer::Http(409)).worth_retrying());
        assert!(!Outcome::Failed(Answer::Http(400)).worth_retrying());
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
    fn grpc_errors_from_the_server_are_answers() {
        let server = tonic::Status::unavailable("busy");
        assert_eq!(
            classify_grpc_error(&server),
            Outcome::Failed(Answer::Grpc(Code::Unavailable))
        );
        let connect = tonic::Status::from_error(Box::new(tonic::ConnectError("refused".into())));
        assert_eq!(classify_grpc_error(&connect), Outcome::ConnectError);
        let broken = tonic::Status::from_error("connection reset".into());
        assert_eq!(classify_grpc_error(&broken), Outcome::TransportError);
    }

    #[test]
    fn ambiguity() {
        assert!(Outcome::Timeout.is_ambiguous());
        assert!(Outcome::Abandoned.is_ambiguous());
        assert!(Outcome::TransportError.is_ambiguous());
        assert!(!Outcome::ConnectError.is_ambiguous());
        assert!(!Outcome::Failed(Answer::Http(503)).is_ambiguous());
    }
}
