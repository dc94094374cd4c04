//! The two clients (one shared HTTP/1.1 keep-alive pool, one shared HTTP/2
//! gRPC channel), each send classified into an [`Outcome`]. Nothing the
//! network returns can panic here: every failure is an [`Outcome`].

use std::error::Error as _;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, ETAG, LOCATION};
use http::{HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use pipeline::contract::IDEMPOTENCY_KEY;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use uuid::Uuid;

use crate::config::Token;
use crate::keys::Body;
use crate::outcome::{Answer, HttpReply, Outcome, Success, grpc_code_name, parse_created};
use crate::proto;
use crate::proto::orders_client::OrdersClient;

/// Largest response body read; a larger one is a transport error, not an
/// unbounded allocation.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// An order id no order has: the reachability probe asks for it.
const PROBE_ORDER_ID: &str = "00000000-0000-0000-0000-000000000000";

/// `POST {base}/orders` over a shared keep-alive pool.
#[derive(Debug, Clone)]
pub(crate) struct HttpTarget {
    client: Client<HttpConnector, Full<Bytes>>,
    orders: Uri,
    probe: Uri,
    authorization: Option<HeaderValue>,
}

/// `Bearer TOKEN`, marked sensitive (kept out of hyper's debug output).
fn bearer(token: &Token) -> anyhow::Result<HeaderValue> {
    let mut value = HeaderValue::from_str(&format!("Bearer {}", token.value))
        .context("--token-file: the token is not a valid header value")?;
    value.set_sensitive(true);
    Ok(value)
}

impl HttpTarget {
    /// A client for `base_url` (no trailing slash), every request carrying
    /// `token` when given.
    pub(crate) fn new(
        base_url: &str,
        connect_timeout: Duration,
        token: Option<&Token>,
    ) -> anyhow::Result<Self> {
        let authorization = token.map(bearer).transpose()?;
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
            authorization,
        })
    }

    /// Sends one create and classifies the result.
    pub(crate) async fn create(&self, key: &str, body: Body) -> Outcome {
        let Ok(key) = HeaderValue::from_str(key) else {
            return Outcome::NotSent;
        };
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(self.orders.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(IDEMPOTENCY_KEY, key);
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        let request = request.body(Full::new(Bytes::from(body.to_json())));
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
        let mut request = Request::builder()
            .method(Method::GET)
            .uri(self.probe.clone());
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        let request = request
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
    authorization: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl GrpcTarget {
    /// Connects to `url` (one HTTP/2 connection; requests multiplex on it).
    /// Fails if the connection cannot be made.
    pub(crate) async fn connect(
        url: &str,
        connect_timeout: Duration,
        max_in_flight: usize,
        token: Option<&Token>,
    ) -> anyhow::Result<Self> {
        let authorization = token
            .map(|token| {
                let mut value = MetadataValue::try_from(format!("Bearer {}", token.value))
                    .context("--token-file: the token is not valid gRPC metadata")?;
                value.set_sensitive(true);
                anyhow::Ok(value)
            })
            .transpose()?;
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
            authorization,
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
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
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
        let mut request = tonic::Request::new(proto::GetOrderRequest {
            order_id: PROBE_ORDER_ID.to_owned(),
        });
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
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
}
