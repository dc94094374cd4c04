//! What a destination's answer means: delivered, gone (410) or tried again
//! on the schedule, when, what its body and its `Date` say.

use std::time::{Duration, SystemTime};

use effectively::webhook::{self};
use reqwest::header::{DATE, HeaderMap, RETRY_AFTER};

/// The most of an error answer's body kept in `last_error`.
const ERROR_BODY_BYTES: usize = 256;
/// How far a receiver's clock (its answer's `Date`) may be from the
/// sender's before the sender warns. The receiver refuses a signature whose
/// `webhook-timestamp` is further from its own clock than its tolerance
/// (`webhook::DEFAULT_TOLERANCE`, 5 minutes, in every Standard Webhooks
/// library), answering 401 to every attempt however often it is retried.
/// A `Date` is whole seconds and servers cache it up to a second, so a
/// measured skew is good to about 2 s: 60 s is far above that noise and
/// well inside the tolerance, so the warning comes while signatures still
/// verify, before the clocks drift far enough apart to refuse them all.
pub const CLOCK_SKEW_WARN: Duration = Duration::from_secs(60);

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 2xx.
    Delivered(u16),
    /// Tried again on the schedule (failed after the last attempt): any
    /// status but 2xx and 410 (a 4xx too: see the module docs), or no
    /// answer. With the receiver's `Retry-After`, if any.
    Retry {
        /// The status, if there was an answer.
        status: Option<u16>,
        /// Why, readable.
        error: String,
        /// The receiver's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// 410: the destination is gone.
    Gone(String),
}

/// The outcome of an answer's status (and its `Retry-After`): 2xx
/// delivered, 410 gone, anything else retried. No status fails a delivery
/// at once: a 4xx may be the receiver's passing state (a clock off by more
/// than its signature tolerance, a secret it rotated before the sender, a
/// deploy that broke it) rather than the message's, and the schedule gives
/// it days to recover; a message the receiver will never take fails after
/// its last attempt, visibly, and waits for `relay webhooks replay`.
pub fn judge(status: u16, retry_after: Option<Duration>, body: &str) -> Outcome {
    let error = || {
        let body = body.trim();
        if body.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {body}")
        }
    };
    match status {
        200..=299 => Outcome::Delivered(status),
        410 => Outcome::Gone(error()),
        _ => Outcome::Retry {
            status: Some(status),
            error: error(),
            retry_after,
        },
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not taken: receivers of
/// webhooks send seconds), capped at `webhook::MAX_RETRY_AFTER`.
pub(super) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds).min(webhook::MAX_RETRY_AFTER))
}

/// The receiver's clock minus the sender's, in seconds, from an answer's
/// `Date` (an HTTP-date, whole seconds) and the sender's clock `now` when
/// the answer came; `None` without a readable `Date`.
pub fn clock_skew(headers: &HeaderMap, now: SystemTime) -> Option<f64> {
    let date = httpdate::parse_http_date(headers.get(DATE)?.to_str().ok()?).ok()?;
    Some(match date.duration_since(now) {
        Ok(ahead) => ahead.as_secs_f64(),
        Err(behind) => -behind.duration().as_secs_f64(),
    })
}

/// A hint for the log of an attempt that was not delivered, by status.
pub(super) fn hint(status: Option<u16>) -> &'static str {
    match status {
        Some(401 | 403) => {
            "the receiver refused the request, likely a signature it cannot verify: its clock off \
             by more than its tolerance (relay_webhook_clock_skew_seconds), or a secret it does \
             not hold (a rotation done on one side only)"
        }
        Some(400..=499) => "the receiver refused the request; retried, it may be a passing state",
        Some(300..=399) => "a redirect, not followed: configure the URL it points to",
        Some(500..=599) => "the receiver failed",
        Some(_) => "an unexpected status",
        None => "no answer",
    }
}

/// The wait before the next attempt after `failed` attempts: the schedule's
/// wait × `scale` × a jitter factor in `[JITTER_MIN, JITTER_MAX]` (`jitter`
/// in `[0, 1]` picks it), or the receiver's `Retry-After` if longer.
pub fn next_wait(failed: u32, scale: f64, jitter: f64, retry_after: Option<Duration>) -> Duration {
    let factor =
        webhook::JITTER_MIN + (webhook::JITTER_MAX - webhook::JITTER_MIN) * jitter.clamp(0.0, 1.0);
    let scheduled = webhook::retry_wait(failed).mul_f64(scale.max(0.0) * factor);
    retry_after.map_or(scheduled, |r| scheduled.max(r))
}

/// The start of an error answer's body, for `last_error`: its first
/// `ERROR_BODY_BYTES`, read a chunk at a time and no further (the
/// destination is not trusted: its body may be gigabytes, or endless, and
/// reading it whole held the attempt to its timeout and the body in
/// memory). The rest is not read: dropping the response closes the
/// connection rather than returning it to the pool. A body that fails
/// midway keeps what arrived.
pub(super) async fn error_body(mut response: reqwest::Response) -> String {
    let mut kept = Vec::with_capacity(ERROR_BODY_BYTES);
    while kept.len() < ERROR_BODY_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = ERROR_BODY_BYTES - kept.len();
                kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&kept).into_owned()
}

/// A request error, readable: what failed (connect, timeout, ...).
pub(super) fn describe(error: &reqwest::Error) -> String {
    let kind = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    let mut text = format!("{kind}: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    /// A destination answering 500 with an endless body: the sender reads
    /// `ERROR_BODY_BYTES` of it and stops, at once, not at the attempt's
    /// timeout, and closes the connection (the destination stops sending).
    #[tokio::test]
    async fn an_endless_error_body_is_read_up_to_the_cap_and_no_further() {
        use std::sync::atomic::{AtomicU64, Ordering};
        // 16 KiB a millisecond, without end (paced, so that a sender that
        // reads it all does not fill this machine's memory in the test).
        const CHUNK: usize = 16 * 1024;
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let endless = move || {
            let counter = counter.clone();
            async move {
                let chunks = futures::stream::unfold(counter, |counter| async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    counter.fetch_add(CHUNK as u64, Ordering::Relaxed);
                    let chunk = bytes::Bytes::from(vec![b'x'; CHUNK]);
                    Some((Ok::<_, std::convert::Infallible>(chunk), counter))
                });
                (
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    axum::body::Body::from_stream(chunks),
                )
            }
        };
        let app = axum::Router::new().route("/hook", axum::routing::post(endless));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client");

        let response = client.post(url).send().await.expect("an answer");
        assert_eq!(response.status().as_u16(), 500);
        let started = Instant::now();
        let body = tokio::time::timeout(Duration::from_secs(5), error_body(response))
            .await
            .expect("the read stops at the cap, long before the attempt's 60 s timeout");
        assert_eq!(body, "x".repeat(ERROR_BODY_BYTES));
        assert!(started.elapsed() < Duration::from_secs(1));
        // The connection is closed: the destination's writes fail and it
        // stops, having sent what the sockets' buffers took.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stopped_at = sent.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            sent.load(Ordering::Relaxed),
            stopped_at,
            "the destination stopped"
        );
        assert!(
            stopped_at < 64 * 1024 * 1024,
            "{stopped_at} bytes sent: no more than the sockets' buffers"
        );
        server.abort();
    }

    #[test]
    fn the_answer_decides_delivered_gone_or_retried_and_no_status_fails_at_once() {
        assert_eq!(judge(200, None, ""), Outcome::Delivered(200));
        assert_eq!(judge(204, None, ""), Outcome::Delivered(204));
        assert!(matches!(judge(410, None, ""), Outcome::Gone(_)));
        // Every 4xx but 410 too: a 401 from a receiver whose clock or secret
        // disagrees with the sender's is retried, never failed at once.
        for status in [
            400, 401, 403, 404, 408, 409, 413, 415, 422, 425, 429, 451, 499, 500, 502, 503, 504,
            599, 301, 302, 304, 100,
        ] {
            assert_eq!(
                judge(status, Some(Duration::from_secs(3)), "no"),
                Outcome::Retry {
                    status: Some(status),
                    error: format!("HTTP {status}: no"),
                    retry_after: Some(Duration::from_secs(3)),
                },
                "{status} is retried"
            );
        }
        let Outcome::Retry {
            retry_after, error, ..
        } = judge(429, Some(Duration::from_secs(7)), " slow down ")
        else {
            panic!("429 is retried");
        };
        assert_eq!(retry_after, Some(Duration::from_secs(7)));
        assert_eq!(error, "HTTP 429: slow down");
    }

    #[test]
    fn the_clock_skew_is_the_receivers_date_minus_the_senders_clock() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut headers = HeaderMap::new();
        assert_eq!(clock_skew(&headers, now), None, "no Date");
        for (off, text) in [
            (0, "Fri, 15 Jan 2027 08:00:00 GMT"),
            (600, "Fri, 15 Jan 2027 08:10:00 GMT"),
            (-90, "Fri, 15 Jan 2027 07:58:30 GMT"),
        ] {
            headers.insert(DATE, text.parse().expect("value"));
            assert_eq!(clock_skew(&headers, now), Some(f64::from(off)), "{text}");
        }
        let later = now + Duration::from_millis(400);
        let skew = clock_skew(&headers, later).expect("a skew");
        assert!(
            (skew + 90.4).abs() < 1e-9,
            "the sender's clock to the sub-second: {skew}"
        );
        headers.insert(DATE, "yesterday".parse().expect("value"));
        assert_eq!(clock_skew(&headers, now), None, "not an HTTP-date");
        assert!(
            CLOCK_SKEW_WARN < webhook::DEFAULT_TOLERANCE,
            "the warning comes before signatures fail"
        );
    }

    #[test]
    fn waits_follow_the_schedule_with_jitter_and_honour_a_longer_retry_after() {
        let s = |secs: f64| Duration::from_secs_f64(secs);
        assert_eq!(next_wait(1, 1.0, 0.0, None), s(4.0), "5 s x 0.8");
        assert_eq!(next_wait(1, 1.0, 1.0, None), s(6.0), "5 s x 1.2");
        assert_eq!(next_wait(2, 1.0, 0.5, None), s(30.0));
        assert_eq!(next_wait(5, 1.0, 0.5, None), s(4.0 * 3600.0));
        assert_eq!(
            next_wait(7, 1.0, 0.5, None),
            s(4.0 * 3600.0),
            "the last repeats"
        );
        assert_eq!(
            next_wait(3, 0.01, 0.5, None),
            s(3.0),
            "scaled for experiments"
        );
        assert_eq!(
            next_wait(1, 1.0, 0.5, Some(s(60.0))),
            s(60.0),
            "a longer Retry-After wins"
        );
        assert_eq!(
            next_wait(4, 1.0, 0.5, Some(s(60.0))),
            s(1800.0),
            "a shorter one does not"
        );
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, "999999".parse().expect("value"));
        assert_eq!(
            retry_after(&headers),
            Some(webhook::MAX_RETRY_AFTER),
            "capped"
        );
        headers.insert(
            RETRY_AFTER,
            "Wed, 21 Oct 2026 07:28:00 GMT".parse().expect("value"),
        );
        assert_eq!(retry_after(&headers), None, "dates are not taken");
    }
}
