//! [`WebhookSink`]: the relay's rows delivered as signed HTTP webhooks
//! (Standard Webhooks; feature `webhooks`).

use std::collections::HashMap;

use crate::webhook::{HEADER_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, Secret, signature_header};

use super::relay::{Outgoing, SendError, Sink};

/// Longest part of a refusing answer's body kept in the row's error.
const ERROR_BODY_CHARS: usize = 200;

/// Delivers each row as `POST` to the URL of the destination its
/// `destination` names, signed with that destination's secrets (Standard
/// Webhooks: `webhook-id` is the row's msg_id, `webhook-timestamp` the
/// attempt's time, `webhook-signature` an HMAC-SHA256 per secret), with the
/// row's content type and headers.
///
/// A 2xx answer delivers. 410 Gone refuses the row (the receiver said the
/// endpoint is gone for good), as does a destination name the sink does not
/// know. Anything else (another 4xx, a 5xx, no answer) is tried again: a 4xx
/// is often the receiver's passing state (a clock off, a secret rotated
/// first, a bad deploy), not the message's.
#[derive(Debug, Clone)]
pub struct WebhookSink {
    client: reqwest::Client,
    destinations: HashMap<String, Destination>,
}

#[derive(Debug, Clone)]
struct Destination {
    url: reqwest::Url,
    secrets: Vec<Secret>,
}

/// Why a destination was not added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    /// Not an absolute `http` or `https` URL.
    #[error("destination {name:?}: {url:?} is not an http(s) URL")]
    Url {
        /// The destination.
        name: String,
        /// The URL given.
        url: String,
    },
    /// No secret to sign with.
    #[error("destination {0:?} has no signing secret")]
    NoSecret(String),
}

impl WebhookSink {
    /// A sink with no destination yet, sending with `client` (the user's:
    /// its timeouts, TLS roots, proxy). Give it a timeout: a send holds the
    /// relay's shard until the answer. When the destinations' URLs come
    /// from someone else (a customer's endpoint), build the client with
    /// [`Egress::client_builder`](crate::egress::Egress::client_builder) and
    /// judge each URL with [`Egress::check_url`](crate::egress::Egress::check_url)
    /// first, so no destination reaches the sender's own network.
    pub fn new(client: reqwest::Client) -> Self {
        Self {
            client,
            destinations: HashMap::new(),
        }
    }

    /// The same sink with destination `name` at `url`, signing with
    /// `secrets` (two during a rotation: old and new); a name given again is
    /// replaced.
    pub fn destination(
        mut self,
        name: &str,
        url: &str,
        secrets: Vec<Secret>,
    ) -> Result<Self, DestinationError> {
        let parsed = reqwest::Url::parse(url)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
            .ok_or_else(|| DestinationError::Url {
                name: name.to_owned(),
                url: url.to_owned(),
            })?;
        if secrets.is_empty() {
            return Err(DestinationError::NoSecret(name.to_owned()));
        }
        self.destinations.insert(
            name.to_owned(),
            Destination {
                url: parsed,
                secrets,
            },
        );
        Ok(self)
    }
}

impl Sink for WebhookSink {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        let Some(destination) = self.destinations.get(&row.destination) else {
            return Err(SendError::Reject(format!(
                "no webhook destination named {:?}",
                row.destination
            )));
        };
        let msg_id = row.msg_id.to_string();
        let timestamp = chrono::Utc::now().timestamp();
        let mut request = self
            .client
            .post(destination.url.clone())
            .header(HEADER_ID, &msg_id)
            .header(HEADER_TIMESTAMP, timestamp.to_string())
            .header(
                HEADER_SIGNATURE,
                signature_header(&destination.secrets, &msg_id, timestamp, &row.payload),
            )
            .header(reqwest::header::CONTENT_TYPE, &row.content_type);
        for (name, value) in &row.headers {
            request = request.header(name, value);
        }
        let answer = request
            .body(row.payload.clone())
            .send()
            .await
            .map_err(|e| SendError::Retry(format!("no answer: {e}")))?;
        let status = answer.status().as_u16();
        if answer.status().is_success() {
            return Ok(());
        }
        let body: String = answer
            .text()
            .await
            .unwrap_or_default()
            .chars()
            .take(ERROR_BODY_CHARS)
            .collect();
        let error = format!("HTTP {status}: {}", body.trim());
        if status == 410 {
            Err(SendError::Reject(error))
        } else {
            Err(SendError::Retry(error))
        }
    }
}
