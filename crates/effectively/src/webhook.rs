//! Standard Webhooks (v1.0.0) signing and verification: HMAC-SHA256 over
//! `{webhook-id}.{webhook-timestamp}.{body}`, sent as `v1,<base64>`.
//!
//! Shared by the sender (the relay signs every attempt, with a fresh
//! timestamp) and the receiver (payments verifies before it parses anything).
//! The signature proves the request came from a holder of the secret; the
//! timestamp tolerance bounds how long a captured request can be replayed.
//! It does not deduplicate: a sender's retry arrives hours later with a fresh
//! timestamp and a valid signature, so effectively-once still rests on the
//! receiver's inbox claim of `webhook-id`, whose horizon is the sender's retry
//! span, not this tolerance.
//!
//! The clock is a parameter (`now`), so the tolerance edges are tested
//! exactly and the receiver decides where time comes from.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The header carrying the message id: the same on every attempt of one
/// message (it is the outbox `msg_id`, the receiver's deduplication key).
pub const HEADER_ID: &str = "webhook-id";
/// The header carrying the attempt's time, integer Unix seconds. The spec
/// updates it on every retry, so the sender signs each attempt anew.
pub const HEADER_TIMESTAMP: &str = "webhook-timestamp";
/// The header carrying the space-separated signatures (`v1,<base64>` each):
/// one per active secret, so a secret can be rotated without downtime.
pub const HEADER_SIGNATURE: &str = "webhook-signature";

/// How far a request's timestamp may be from the receiver's clock, either
/// way: the spec's libraries all use 5 minutes. It bounds replay of a captured
/// request and must cover the clock skew between sender and receiver.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// The sender's retry schedule (the seeds'): the wait after the first failed
/// attempt, after the second, and so on; the last wait repeats. Shared by the
/// sender (which schedules by it) and the receiver (whose dedup horizon must
/// cover the whole schedule, see [`max_retry_span`]).
pub const RETRY_SCHEDULE: [Duration; 5] = [
    Duration::from_secs(5),
    Duration::from_secs(30),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(4 * 3600),
];
/// Attempts before a delivery is given up as `failed`.
pub const MAX_ATTEMPTS: u32 = 8;
/// Each scheduled wait is multiplied by a factor drawn uniformly from
/// `[JITTER_MIN, JITTER_MAX]`, so retries of many rows do not arrive together.
pub const JITTER_MIN: f64 = 0.8;
/// See [`JITTER_MIN`].
pub const JITTER_MAX: f64 = 1.2;
/// The longest `Retry-After` the sender honours (a longer one is cut to it):
/// a receiver cannot push a retry past the horizon it must remember.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(4 * 3600);
/// The longest timeout a destination may give one attempt.
pub const MAX_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// The scheduled wait after `failed` attempts (1 after the first), before
/// jitter: [`RETRY_SCHEDULE`], its last entry repeating.
pub fn retry_wait(failed: u32) -> Duration {
    let i = (failed.max(1) as usize - 1).min(RETRY_SCHEDULE.len() - 1);
    RETRY_SCHEDULE[i]
}

/// The longest the sender can take from a message's first attempt to its
/// last: every wait at its most ([`JITTER_MAX`], or a `Retry-After` of
/// [`MAX_RETRY_AFTER`] if longer) and every attempt timing out. A receiver
/// must remember a `webhook-id` at least this long after the message was
/// first sendable, or a late retry of a message it applied looks new.
pub fn max_retry_span() -> Duration {
    let waits: Duration = (1..MAX_ATTEMPTS)
        .map(|failed| retry_wait(failed).mul_f64(JITTER_MAX).max(MAX_RETRY_AFTER))
        .sum();
    waits + MAX_ATTEMPT_TIMEOUT * MAX_ATTEMPTS
}

/// The fewest key bytes a [`Secret`] may have (the spec: "at least 24 bytes").
pub const MIN_SECRET_BYTES: usize = 24;
/// The most key bytes a [`Secret`] may have (the spec: "512 bits maximum").
pub const MAX_SECRET_BYTES: usize = 64;

/// The key bytes [`Secret::generate`] draws: the digest's length (256 bits);
/// a longer key adds no strength to HMAC-SHA256.
const GENERATED_SECRET_BYTES: usize = 32;
/// The prefix that marks a secret in the spec's text form.
const SECRET_PREFIX: &str = "whsec_";
/// The only signature scheme this module signs and checks (symmetric HMAC).
/// Others, such as `v1a` (ed25519), are skipped, as the spec asks.
const SCHEME: &str = "v1";
/// An HMAC-SHA256 tag's length; any other decoded length cannot match.
const TAG_BYTES: usize = 32;

/// A webhook signing key: 24 to 64 bytes.
///
/// `Debug` never shows the bytes, and there is deliberately no `Display`:
/// a secret printed by a `{}` in a log line would be a leak nobody notices.
/// [`Secret::to_whsec`] is the one explicit way to write it out (for a
/// config file or an environment variable).
#[derive(Clone)]
pub struct Secret {
    bytes: Vec<u8>,
}

/// Why a text is not a usable [`Secret`]. The messages never quote the input,
/// so they are safe to log or return from a config check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Not standard (padded) base64 after the optional `whsec_` prefix.
    #[error("the webhook secret is not base64 (expected whsec_<base64>)")]
    NotBase64,
    /// Decoded to too few or too many bytes.
    #[error(
        "the webhook secret is {0} bytes after decoding; {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} are required"
    )]
    Length(usize),
}

impl Secret {
    /// Parses `whsec_<base64>` or bare base64 (the spec's libraries accept
    /// both). Surrounding whitespace is ignored: a secret read from a file or
    /// an environment variable often ends with a newline, and base64 never
    /// contains whitespace.
    pub fn parse(text: &str) -> Result<Secret, SecretError> {
        let text = text.trim();
        let encoded = text.strip_prefix(SECRET_PREFIX).unwrap_or(text);
        let bytes = STANDARD
            .decode(encoded)
            .map_err(|_| SecretError::NotBase64)?;
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&bytes.len()) {
            return Err(SecretError::Length(bytes.len()));
        }
        Ok(Secret { bytes })
    }

    /// A new secret of 32 random bytes from the thread's CSPRNG, for
    /// provisioning a destination.
    pub fn generate() -> Secret {
        let bytes: [u8; GENERATED_SECRET_BYTES] = rand::random();
        Secret {
            bytes: bytes.to_vec(),
        }
    }

    /// The spec's text form, `whsec_<base64>`, which [`Secret::parse`] reads
    /// back. Only for writing the secret where it is meant to be stored.
    pub fn to_whsec(&self) -> String {
        format!("{SECRET_PREFIX}{}", STANDARD.encode(&self.bytes))
    }

    /// A MAC keyed with this secret that has absorbed the signed content.
    fn mac(&self, msg_id: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.bytes).expect("HMAC takes a key of any length");
        mac.update(msg_id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(redacted)")
    }
}

impl FromStr for Secret {
    type Err = SecretError;

    /// [`Secret::parse`], so a `clap` flag or a config field can be a
    /// `Secret` directly.
    fn from_str(text: &str) -> Result<Secret, SecretError> {
        Secret::parse(text)
    }
}

/// The `v1,<base64>` signature of one message attempt.
///
/// `body` must be the exact bytes sent (any bytes, UTF-8 or not): the
/// receiver verifies those same bytes before parsing them.
///
/// `msg_id` should not contain `.`: the signed content joins the fields with
/// dots, so an id with a dot can be split differently (id `a.1`, timestamp 2
/// signs the same bytes as id `a`, timestamp 1, body `2.…`). The spec forbids
/// it; this function signs whatever it is given, like the spec's libraries,
/// and the receiver is the one that checks the id's form (ours are UUIDs).
pub fn sign(secret: &Secret, msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let tag = secret.mac(msg_id, timestamp, body).finalize().into_bytes();
    format!("{SCHEME},{}", STANDARD.encode(tag))
}

/// The `webhook-signature` header value: one [`sign`]ature per secret,
/// space-separated. During a rotation the sender signs with the old and the
/// new secret, so a receiver that knows either one accepts the request.
pub fn signature_header(secrets: &[Secret], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    secrets
        .iter()
        .map(|secret| sign(secret, msg_id, timestamp, body))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Why a request failed verification. Every message is fit for the body of
/// a 401: it names the failed check and nothing else (no expected signature,
/// no secret, no clock reading).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// A header is absent, empty or only whitespace.
    #[error("the webhook-id, webhook-timestamp and webhook-signature headers are required")]
    Missing,
    /// `webhook-timestamp` is not an integer number of Unix seconds.
    #[error("the webhook-timestamp header is not integer Unix seconds")]
    BadTimestamp,
    /// The timestamp is older than the tolerance: possibly a replay.
    #[error("the webhook-timestamp is too old")]
    TooOld,
    /// The timestamp is further ahead than the tolerance.
    #[error("the webhook-timestamp is too far in the future")]
    TooNew,
    /// No `v1` signature matches any secret.
    #[error("no webhook signature matches")]
    BadSignature,
}

/// Verifies one request: `Ok` when its timestamp is within `tolerance` of
/// `now` (Unix seconds; exactly `tolerance` away is accepted) and one `v1`
/// entry of `signature_header` is the signature under one of `secrets`.
///
/// `body` must be the raw request bytes, before any parsing or decoding: a
/// re-serialized body is not what was signed, and parsing unauthenticated
/// input is what verification exists to avoid.
///
/// The timestamp is checked first because it is cheap, and a stale request
/// is rejected whatever its signature. Entries of another scheme (`v1a`,
/// `v2`), undecodable entries and entries of the wrong length are skipped;
/// the rest are compared in constant time (`Mac::verify_slice`), so the
/// response time does not reveal how much of a forged signature was right.
/// An empty `secrets` verifies nothing.
pub fn verify(
    secrets: &[Secret],
    msg_id: &str,
    timestamp_header: &str,
    signature_header: &str,
    body: &[u8],
    now: i64,
    tolerance: Duration,
) -> Result<(), VerifyError> {
    if [msg_id, timestamp_header, signature_header]
        .iter()
        .any(|value| value.trim().is_empty())
    {
        return Err(VerifyError::Missing);
    }
    let timestamp = parse_timestamp(timestamp_header)?;
    check_age(timestamp, now, tolerance)?;
    check_signature(secrets, msg_id, timestamp, signature_header, body)
}

/// Digits only: a sign, a fraction, an exponent or spaces are refused rather
/// than read as something the sender may not have meant. Too many digits
/// for an `i64` is refused too.
fn parse_timestamp(header: &str) -> Result<i64, VerifyError> {
    if !header.bytes().all(|b| b.is_ascii_digit()) {
        return Err(VerifyError::BadTimestamp);
    }
    header.parse().map_err(|_| VerifyError::BadTimestamp)
}

/// Whole seconds, in `i128` so that no header value can overflow the
/// subtraction.
fn check_age(timestamp: i64, now: i64, tolerance: Duration) -> Result<(), VerifyError> {
    let age = i128::from(now) - i128::from(timestamp);
    let tolerance = i128::from(tolerance.as_secs());
    if age > tolerance {
        Err(VerifyError::TooOld)
    } else if -age > tolerance {
        Err(VerifyError::TooNew)
    } else {
        Ok(())
    }
}

/// The body is hashed once per secret; each candidate tag is then compared
/// against every secret's MAC.
fn check_signature(
    secrets: &[Secret],
    msg_id: &str,
    timestamp: i64,
    signature_header: &str,
    body: &[u8],
) -> Result<(), VerifyError> {
    let macs: Vec<HmacSha256> = secrets
        .iter()
        .map(|secret| secret.mac(msg_id, timestamp, body))
        .collect();
    let matches = signature_header
        .split_whitespace()
        .filter_map(v1_tag)
        .any(|tag| is_tag_of_any(&macs, &tag));
    if matches {
        Ok(())
    } else {
        Err(VerifyError::BadSignature)
    }
}

/// Whether `tag` is the tag of one of `macs`, each compared in constant time
/// (`verify_slice` finalizes, hence the clone).
fn is_tag_of_any(macs: &[HmacSha256], tag: &[u8]) -> bool {
    macs.iter().any(|mac| mac.clone().verify_slice(tag).is_ok())
}

/// The decoded tag of a `v1,<base64>` entry of the right length; `None` for
/// anything else. The length check stands before the comparison on purpose:
/// verifiers that compared only up to the shorter length accepted an empty
/// `v1,` as a valid signature.
fn v1_tag(entry: &str) -> Option<Vec<u8>> {
    let (scheme, encoded) = entry.split_once(',')?;
    if scheme != SCHEME {
        return None;
    }
    let tag = STANDARD.decode(encoded).ok()?;
    (tag.len() == TAG_BYTES).then_some(tag)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_schedule_repeats_its_last_wait_and_the_span_bounds_every_path() {
        assert_eq!(
            retry_wait(0),
            Duration::from_secs(5),
            "no failure yet reads as the first"
        );
        assert_eq!(retry_wait(1), Duration::from_secs(5));
        assert_eq!(retry_wait(4), Duration::from_secs(1800));
        assert_eq!(retry_wait(5), Duration::from_secs(4 * 3600));
        assert_eq!(retry_wait(7), Duration::from_secs(4 * 3600));
        // As scheduled, 8 attempts wait 5s + 30s + 5m + 30m + 3 x 4h.
        let scheduled: Duration = (1..MAX_ATTEMPTS).map(retry_wait).sum();
        assert_eq!(scheduled, Duration::from_secs(12 * 3600 + 35 * 60 + 35));
        // At most: each wait the longer of 1.2 x schedule and a 4h Retry-After,
        // each of the 8 attempts timing out at 30 s: 4 x 4h + 3 x 4.8h + 4 min.
        assert_eq!(
            max_retry_span(),
            Duration::from_secs(16 * 3600 + 3 * 17_280 + 8 * 30)
        );
        assert!(max_retry_span() > scheduled.mul_f64(JITTER_MAX));
    }

    /// A message and the signature its secret must give.
    struct Vector {
        secret: &'static str,
        msg_id: &'static str,
        timestamp: i64,
        body: &'static [u8],
        signature: &'static str,
    }

    /// An official vector: standard-webhooks/standard-webhooks,
    /// libraries/go/webhook_test.go (`TestWebhookSign`); the same in
    /// libraries/javascript/src/webhook.test.ts and
    /// libraries/python/tests/test_webhooks.py. A 24-byte secret, the minimum.
    const V1: Vector = Vector {
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        msg_id: "msg_p5jXN8AQM9LWM0D4loKWxJek",
        timestamp: 1614265330,
        body: br#"{"test": 2432232314}"#,
        signature: "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    };

    /// An official vector: standard-webhooks/standard-webhooks,
    /// libraries/rust/src/lib.rs (`test_sign`).
    const V2: Vector = Vector {
        secret: "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
        msg_id: "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
        timestamp: 1649367553,
        body: br#"{"email":"test@example.com","username":"test_user"}"#,
        signature: "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
    };

    /// Not official: an order event as the relay will send it, signed with
    /// V1's secret and computed independently (Python's `hmac`), so our own
    /// id and payload shapes are pinned too.
    const ORDER: Vector = Vector {
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        msg_id: "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        timestamp: 1764000000,
        body: br#"{"order_id":"0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b","account_id":3,"amount_cents":10,"status":"created"}"#,
        signature: "v1,7ki+9LmNKvI263d8B6V7wjKkJjl2nFHb2xElF30V8eA=",
    };

    /// The wrong signature the official libraries' tests use as a decoy.
    const DECOY: &str = "Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=";

    fn secret(text: &str) -> Secret {
        Secret::parse(text).expect("a valid test secret")
    }

    /// Verifies against `v`'s message with `v`'s secret at the signing time
    /// plus `age` seconds.
    fn check(v: &Vector, timestamp: &str, signatures: &str, age: i64) -> Result<(), VerifyError> {
        verify(
            &[secret(v.secret)],
            v.msg_id,
            timestamp,
            signatures,
            v.body,
            v.timestamp + age,
            DEFAULT_TOLERANCE,
        )
    }

    /// [`check`] at the signing time with the vector's own timestamp.
    fn check_at(v: &Vector, signatures: &str) -> Result<(), VerifyError> {
        check(v, &v.timestamp.to_string(), signatures, 0)
    }

    #[test]
    fn signs_and_verifies_the_official_vectors() {
        for v in [&V1, &V2, &ORDER] {
            let key = secret(v.secret);
            assert_eq!(sign(&key, v.msg_id, v.timestamp, v.body), v.signature);
            assert_eq!(check_at(v, v.signature), Ok(()), "{}", v.msg_id);
        }
    }

    #[test]
    fn a_secret_reads_alike_with_or_without_its_prefix() {
        for v in [&V1, &V2] {
            let bare = v.secret.strip_prefix("whsec_").expect("prefixed");
            let key = secret(bare);
            assert_eq!(sign(&key, v.msg_id, v.timestamp, v.body), v.signature);
            assert_eq!(key.to_whsec(), v.secret, "written back with the prefix");
            assert_eq!(secret(&format!("{}\n", v.secret)).to_whsec(), v.secret);
        }
    }

    #[test]
    fn any_matching_v1_entry_verifies() {
        let header = format!("v1,{DECOY} v2,{DECOY} {} v1,{DECOY}", V1.signature);
        assert_eq!(check_at(&V1, &header), Ok(()), "the valid one is third");
        let tabs_and_runs = format!("v1,{DECOY}  \t{}", V1.signature);
        assert_eq!(check_at(&V1, &tabs_and_runs), Ok(()));
    }

    #[test]
    fn decoys_and_other_schemes_alone_fail() {
        let valid = V1.signature.strip_prefix("v1,").expect("v1");
        for header in [
            format!("v1,{DECOY}"),
            format!("v1,{DECOY} v2,{DECOY} v1,{DECOY}"),
            format!("v2,{valid}"),
            format!("v1a,{valid}"),
            format!("V1,{valid}"),
            valid.to_owned(),
        ] {
            assert_eq!(
                check_at(&V1, &header),
                Err(VerifyError::BadSignature),
                "{header}"
            );
        }
    }

    #[test]
    fn empty_truncated_and_malformed_signatures_fail() {
        let valid = V1.signature.strip_prefix("v1,").expect("v1");
        for header in [
            "v1,".to_owned(),
            "v1".to_owned(),
            ",".to_owned(),
            V1.signature[..8].to_owned(),
            format!("v1,{}", &valid[..8]),
            format!("v1,{}", &valid[..valid.len() - 4]),
            format!("v1,{valid}AAAA"),
            format!("v1,{}", valid.trim_end_matches('=')),
            "v1,!!!not base64!!!".to_owned(),
        ] {
            assert_eq!(
                check_at(&V1, &header),
                Err(VerifyError::BadSignature),
                "{header}"
            );
        }
    }

    #[test]
    fn a_changed_body_id_timestamp_or_secret_fails() {
        let mut body = V1.body.to_vec();
        body[3] ^= 1;
        let ts = V1.timestamp.to_string();
        let later = (V1.timestamp + 1).to_string();
        let (key, other) = (vec![secret(V1.secret)], vec![secret(V2.secret)]);
        for (keys, id, ts, body) in [
            (&key, V1.msg_id, &ts, &body[..]),
            (&key, "msg_other", &ts, V1.body),
            (&key, V1.msg_id, &later, V1.body),
            (&other, V1.msg_id, &ts, V1.body),
            (&vec![], V1.msg_id, &ts, V1.body),
        ] {
            let result = verify(
                keys,
                id,
                ts,
                V1.signature,
                body,
                V1.timestamp,
                DEFAULT_TOLERANCE,
            );
            assert_eq!(result, Err(VerifyError::BadSignature), "{id} {ts}");
        }
    }

    #[test]
    fn the_tolerance_edges_are_inclusive() {
        let ts = V1.timestamp.to_string();
        for age in [0, 1, -1, 300, -300] {
            assert_eq!(check(&V1, &ts, V1.signature, age), Ok(()), "age {age}");
        }
        assert_eq!(check(&V1, &ts, V1.signature, 301), Err(VerifyError::TooOld));
        assert_eq!(
            check(&V1, &ts, V1.signature, -301),
            Err(VerifyError::TooNew)
        );
    }

    #[test]
    fn a_replayed_request_is_refused_whatever_its_signature() {
        // Captured and sent again 301 s later: the signature is still valid.
        let ts = V2.timestamp.to_string();
        assert_eq!(check(&V2, &ts, V2.signature, 301), Err(VerifyError::TooOld));
        assert_eq!(
            check(&V2, &ts, V2.signature, 86_400),
            Err(VerifyError::TooOld)
        );
        // The timestamp comes first: a stale request with a bad signature
        // says so without the signature being computed.
        assert_eq!(check(&V2, &ts, "v1,", 301), Err(VerifyError::TooOld));
    }

    #[test]
    fn a_timestamp_must_be_integer_seconds() {
        for ts in [
            "1614265330.5",
            "1614265330000000000000",
            "+1614265330",
            "-1614265330",
            " 1614265330",
            "1614265330 ",
            "1e9",
            "2021-02-25T15:02:10Z",
            "abc",
        ] {
            assert_eq!(
                check(&V1, ts, V1.signature, 0),
                Err(VerifyError::BadTimestamp),
                "{ts:?}"
            );
        }
    }

    #[test]
    fn an_extreme_timestamp_is_out_of_range_not_an_overflow() {
        let max = i64::MAX.to_string();
        assert_eq!(check(&V1, &max, V1.signature, 0), Err(VerifyError::TooNew));
        let key = [secret(V1.secret)];
        let ancient = verify(
            &key,
            V1.msg_id,
            "0",
            V1.signature,
            V1.body,
            i64::MAX,
            DEFAULT_TOLERANCE,
        );
        assert_eq!(ancient, Err(VerifyError::TooOld));
    }

    #[test]
    fn empty_headers_are_missing() {
        let ts = V1.timestamp.to_string();
        let key = [secret(V1.secret)];
        let at = V1.timestamp;
        for (id, ts, sig) in [
            ("", ts.as_str(), V1.signature),
            ("  ", ts.as_str(), V1.signature),
            (V1.msg_id, "", V1.signature),
            (V1.msg_id, ts.as_str(), ""),
            (V1.msg_id, ts.as_str(), " \t"),
        ] {
            let result = verify(&key, id, ts, sig, V1.body, at, DEFAULT_TOLERANCE);
            assert_eq!(result, Err(VerifyError::Missing), "{id:?} {ts:?} {sig:?}");
        }
    }

    #[test]
    fn secrets_outside_24_to_64_bytes_or_not_base64_are_refused() {
        let of = |n: usize| format!("whsec_{}", STANDARD.encode(vec![7u8; n]));
        assert_eq!(Secret::parse(&of(23)).err(), Some(SecretError::Length(23)));
        assert_eq!(Secret::parse(&of(65)).err(), Some(SecretError::Length(65)));
        assert_eq!(Secret::parse("whsec_").err(), Some(SecretError::Length(0)));
        assert!(Secret::parse(&of(24)).is_ok());
        assert!(Secret::parse(&of(64)).is_ok());
        for bad in [
            "whsec_not base64!",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaS",
            "wh_MfKQ",
        ] {
            let err = Secret::parse(bad).err();
            assert_eq!(err, Some(SecretError::NotBase64), "{bad}");
        }
    }

    #[test]
    fn debug_shows_no_key_material() {
        let key = secret(V1.secret);
        // Also when nested, as in a config struct's derived `Debug`.
        let debug = format!("{key:?} {:?}", Some(&key));
        assert_eq!(debug, "Secret(redacted) Some(Secret(redacted))");
        let encoded = V1.secret.strip_prefix("whsec_").expect("prefixed");
        assert!(!debug.contains(encoded) && !debug.contains("MfKQ"));
    }

    #[test]
    fn generated_secrets_are_32_random_bytes_and_round_trip() {
        let a = Secret::generate();
        let b = Secret::generate();
        assert_eq!(a.bytes.len(), 32);
        assert_ne!(a.bytes, b.bytes);
        let back: Secret = a.to_whsec().parse().expect("reads back");
        assert_eq!(back.bytes, a.bytes);
    }

    #[test]
    fn a_non_utf8_body_signs_and_verifies() {
        let key = secret(V1.secret);
        let body = b"\xff\xfe\x00binary\x80";
        let signature = sign(&key, V1.msg_id, V1.timestamp, body);
        let ts = V1.timestamp.to_string();
        let result = verify(
            &[key],
            V1.msg_id,
            &ts,
            &signature,
            body,
            V1.timestamp,
            DEFAULT_TOLERANCE,
        );
        assert_eq!(result, Ok(()));
    }

    #[test]
    fn a_rotation_header_verifies_with_either_secret() {
        let (old, new) = (secret(V1.secret), Secret::generate());
        let header = signature_header(
            &[old.clone(), new.clone()],
            V1.msg_id,
            V1.timestamp,
            V1.body,
        );
        assert_eq!(header.split(' ').next(), Some(V1.signature));
        assert_eq!(header.split(' ').count(), 2);
        let ts = V1.timestamp.to_string();
        let at = V1.timestamp;
        for keys in [
            vec![old.clone()],
            vec![new.clone()],
            vec![Secret::generate(), new],
        ] {
            let result = verify(
                &keys,
                V1.msg_id,
                &ts,
                &header,
                V1.body,
                at,
                DEFAULT_TOLERANCE,
            );
            assert_eq!(result, Ok(()));
        }
        // A receiver holding both verifies a sender that signs with one.
        let both = [Secret::generate(), old];
        let result = verify(
            &both,
            V1.msg_id,
            &ts,
            V1.signature,
            V1.body,
            at,
            DEFAULT_TOLERANCE,
        );
        assert_eq!(result, Ok(()));
        assert_eq!(signature_header(&[], V1.msg_id, V1.timestamp, V1.body), "");
    }

    proptest! {
        #[test]
        fn any_body_round_trips_and_any_flipped_byte_fails(
            body in proptest::collection::vec(any::<u8>(), 0..512),
            flip in any::<proptest::sample::Index>(),
            bit in 0u8..8,
            ts in 0i64..4_000_000_000,
        ) {
            let key = [secret(V2.secret)];
            let header = signature_header(&key, V2.msg_id, ts, &body);
            let stamp = ts.to_string();
            let at = |body: &[u8]| verify(&key, V2.msg_id, &stamp, &header, body, ts, DEFAULT_TOLERANCE);
            prop_assert_eq!(at(&body), Ok(()));
            if !body.is_empty() {
                let mut tampered = body.clone();
                tampered[flip.index(body.len())] ^= 1 << bit;
                prop_assert_eq!(at(&tampered), Err(VerifyError::BadSignature));
            }
        }
    }
}
