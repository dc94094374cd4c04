//! A destination: its name, URL, secrets, timeout and concurrency, as the
//! `--webhook-destination` flag and `relay webhooks add` parse it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use effectively::webhook::{self, Secret};

/// How often a running relay reads the destinations again.
pub const DESTINATIONS_REFRESH: Duration = Duration::from_secs(2);

/// The default timeout of one attempt.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The default number of attempts in flight to one destination.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// One destination: where, signed with what, how patiently.
#[derive(Clone)]
pub struct Destination {
    /// Its name: the label of its metrics and its rows.
    pub name: String,
    /// The URL posted to.
    pub url: reqwest::Url,
    /// The signing secrets (several during a rotation).
    pub secrets: Vec<Secret>,
    /// One attempt's timeout (at most `webhook::MAX_ATTEMPT_TIMEOUT`).
    pub timeout: Duration,
    /// Attempts in flight at once.
    pub concurrency: usize,
    /// Attempts before a delivery fails (at most `webhook::MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// Plain `http` allowed for it (`,allow-http`): the URL may be
    /// `http://`; without it only `https://` is taken.
    pub allow_http: bool,
    /// The text it was parsed from (secrets included, a `secret-file`
    /// replaced by its secret), as stored, sealed, in
    /// `orders.webhook_destinations.spec`.
    pub(super) spec: String,
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Destination")
            .field("name", &self.name)
            .field("url", &effectively::egress::redacted(&self.url))
            .field("secrets", &self.secrets.len())
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

/// `--webhook-destination`'s syntax, for its errors.
const DESTINATION_SYNTAX: &str = "NAME=URL,secret=whsec_...|secret-file=PATH[,secret=...][,timeout=10s][,concurrency=16][,max-attempts=8][,allow-http]";

/// The secret in the file at `path` (its first line, trimmed), which other
/// users may not read: `secret-file=PATH` keeps the secret out of the
/// command line and the environment.
fn secret_from_file(name: &str, path: &str) -> Result<String, String> {
    let text = super::sealed::read_private(std::path::Path::new(path))
        .map_err(|why| format!("destination {name}: secret-file {why}"))?;
    Ok(text.lines().next().unwrap_or_default().trim().to_owned())
}

impl FromStr for Destination {
    type Err = String;

    /// `NAME=URL,secret=whsec_…[,secret=…][,timeout=10s][,concurrency=16][,max-attempts=8][,allow-http]`,
    /// a secret also as `secret-file=PATH` (read now, the file 0600; the
    /// spec then holds the secret). The URL is `https`, or `http` with
    /// `allow-http`. The errors never quote a secret, nor the URL's
    /// credentials or query.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut parts = text.trim().split(',');
        let head = parts.next().unwrap_or_default();
        let (name, url) = head
            .split_once('=')
            .ok_or_else(|| format!("a destination is {DESTINATION_SYNTAX}"))?;
        let name = name.trim();
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "destination name {name:?}: 1 to 64 letters, digits, '-' or '_'"
            ));
        }
        let url = reqwest::Url::parse(url.trim())
            .map_err(|e| format!("destination {name}: the URL does not parse: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("destination {name}: the URL must be http or https"));
        }
        let mut destination = Destination {
            name: name.to_owned(),
            url,
            secrets: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            concurrency: DEFAULT_CONCURRENCY,
            max_attempts: webhook::MAX_ATTEMPTS,
            allow_http: false,
            spec: head.trim().to_owned(),
        };
        for part in parts {
            if part.trim() == "allow-http" {
                destination.allow_http = true;
                destination.spec.push_str(",allow-http");
                continue;
            }
            let (key, value) = part.split_once('=').ok_or_else(|| {
                format!("destination {name}: {part:?} is not key=value ({DESTINATION_SYNTAX})")
            })?;
            let (key, mut value) = (key.trim(), value.trim().to_owned());
            // The stored spec holds the secret itself: every relay reads it
            // from the database, not from this host's file.
            let key = if key == "secret-file" {
                value = secret_from_file(name, &value)?;
                "secret"
            } else {
                key
            };
            destination.spec.push_str(&format!(",{key}={value}"));
            let value = value.as_str();
            match key {
                "secret" => destination
                    .secrets
                    .push(Secret::parse(value).map_err(|e| format!("destination {name}: {e}"))?),
                "timeout" => {
                    let t = humantime::parse_duration(value)
                        .map_err(|e| format!("destination {name}: timeout {value:?}: {e}"))?;
                    if t.is_zero() || t > webhook::MAX_ATTEMPT_TIMEOUT {
                        return Err(format!(
                            "destination {name}: timeout {value} must be over 0 and at most {}",
                            humantime::format_duration(webhook::MAX_ATTEMPT_TIMEOUT)
                        ));
                    }
                    destination.timeout = t;
                }
                "concurrency" => {
                    destination.concurrency = value
                        .parse()
                        .ok()
                        .filter(|c| (1..=1024).contains(c))
                        .ok_or_else(|| {
                            format!("destination {name}: concurrency {value:?} must be 1 to 1024")
                        })?;
                }
                "max-attempts" => {
                    destination.max_attempts = value
                        .parse()
                        .ok()
                        .filter(|a| (1..=webhook::MAX_ATTEMPTS).contains(a))
                        .ok_or_else(|| {
                            format!(
                                "destination {name}: max-attempts {value:?} must be 1 to {} \
                                 (the receiver's horizon assumes no more)",
                                webhook::MAX_ATTEMPTS
                            )
                        })?;
                }
                other => {
                    return Err(format!(
                        "destination {name}: unknown setting {other:?} ({DESTINATION_SYNTAX})"
                    ));
                }
            }
        }
        if destination.url.scheme() == "http" && !destination.allow_http {
            return Err(format!(
                "destination {name}: the URL is plain http; use https, or add ,allow-http \
                 (the requests and their signatures then cross the network unencrypted)"
            ));
        }
        if destination.secrets.is_empty() {
            return Err(format!(
                "destination {name}: a secret=whsec_... is required (every request is signed)"
            ));
        }
        Ok(destination)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_parses_with_its_defaults_and_refuses_what_is_wrong() {
        let secret = Secret::generate().to_whsec();
        let d: Destination =
            format!("payments=http://127.0.0.1:9103/webhooks/orders,secret={secret},allow-http")
                .parse()
                .expect("parses");
        assert_eq!(d.name, "payments");
        assert_eq!(d.url.as_str(), "http://127.0.0.1:9103/webhooks/orders");
        assert_eq!(
            (
                d.timeout,
                d.concurrency,
                d.max_attempts,
                d.secrets.len(),
                d.allow_http
            ),
            (DEFAULT_TIMEOUT, DEFAULT_CONCURRENCY, 8, 1, true)
        );
        let other = Secret::generate().to_whsec();
        let d: Destination = format!(
            "a_b-1=https://example.com/h,secret={secret},secret={other},timeout=2s,concurrency=4,max-attempts=3"
        )
        .parse()
        .expect("parses");
        assert_eq!(
            (
                d.timeout,
                d.concurrency,
                d.max_attempts,
                d.secrets.len(),
                d.allow_http
            ),
            (Duration::from_secs(2), 4, 3, 2, false)
        );
        assert!(
            !format!("{d:?}").contains(&secret[6..]),
            "no secret in Debug"
        );
        for (text, wanted) in [
            ("payments", "NAME=URL"),
            ("=https://x/,secret=S", "destination name"),
            ("p=ftp://x/,secret=S", "http or https"),
            ("p=not a url,secret=S", "URL"),
            ("p=https://x/", "secret=whsec_"),
            ("p=https://x/,secret=short", "base64"),
            ("p=https://x/,secret=S,timeout=31s", "at most 30s"),
            ("p=https://x/,secret=S,concurrency=0", "concurrency"),
            ("p=https://x/,secret=S,max-attempts=9", "max-attempts"),
            ("p=https://x/,secret=S,colour=blue", "unknown setting"),
            ("p=http://x/,secret=S", "allow-http"),
            ("p=https://u:hunter2@[bad/h,secret=S", "does not parse"),
        ] {
            let text = text.replace("secret=S", &format!("secret={secret}"));
            let error = text.parse::<Destination>().expect_err(&text);
            assert!(error.contains(wanted), "{text}: {error}");
            assert!(
                !error.contains(&secret[6..]) && !error.contains("hunter2"),
                "{text}: the error quotes no secret"
            );
        }
    }

    #[test]
    fn a_secret_file_is_read_into_the_spec_and_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let secret = Secret::generate().to_whsec();
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("payments.secret");
        std::fs::write(&path, format!("{secret}\n")).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let text = format!(
            "p=https://example.com/h, secret-file={} ,timeout=2s",
            path.display()
        );
        let d: Destination = text.parse().expect("parses");
        assert_eq!(d.secrets.len(), 1);
        assert_eq!(
            d.spec,
            format!("p=https://example.com/h,secret={secret},timeout=2s")
        );
        let again: Destination = d.spec.parse().expect("the spec parses again");
        assert_eq!(again.spec, d.spec, "the spec is its own normal form");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let exposed = text.parse::<Destination>().expect_err("0644");
        assert!(
            exposed.contains("chmod 600") && !exposed.contains(&secret[6..]),
            "{exposed}"
        );
        let missing = format!(
            "p=https://example.com/h,secret-file={}/nope",
            dir.path().display()
        )
        .parse::<Destination>()
        .expect_err("missing");
        assert!(missing.contains("nope"), "{missing}");
    }
}
