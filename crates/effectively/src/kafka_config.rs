//! A Kafka client's settings from a file (feature `kafka`): the librdkafka
//! properties a deployment gives a service, TLS and SASL above all
//! (`security.protocol=sasl_ssl`, `sasl.mechanism`, `sasl.username`,
//! `sasl.password`, `ssl.ca.location`), or any other property.
//!
//! The file holds a password, so [`ClientProperties::load`] refuses one that
//! other users may read or write, and nothing here ever shows a value: not
//! `Debug`, not an error (librdkafka's own errors quote the value, so only
//! their kind is kept). Read the file at each client's creation and a
//! rotated password is picked up by the next client.
//!
//! ```
//! use effectively::kafka_config::ClientProperties;
//!
//! let properties = ClientProperties::parse(
//!     "# the relay's\nsecurity.protocol=sasl_ssl\nsasl.mechanism=SCRAM-SHA-512\n\
//!      sasl.username=relay\nsasl.password=s3cret\n",
//! )?;
//! let mut config = properties.client_config("127.0.0.1:9092");
//! config.set("enable.idempotence", "true"); // the service's own settings win
//! assert_eq!(config.get("sasl.username"), Some("relay"));
//! assert!(!format!("{properties:?}").contains("s3cret"));
//! # Ok::<(), effectively::kafka_config::ClientPropertiesError>(())
//! ```

use std::path::{Path, PathBuf};

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaConfRes;

/// The librdkafka properties of a client config file, in file order.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClientProperties(Vec<(String, String)>);

impl std::fmt::Debug for ClientProperties {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The keys only: the values may be secrets.
        f.debug_list().entries(self.keys()).finish()
    }
}

/// Why a client config file was refused; never holds a value of the file.
#[derive(Debug, thiserror::Error)]
pub enum ClientPropertiesError {
    /// It could not be read.
    #[error("kafka client config {shown}: {source}", shown = .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Other users may read or write it.
    #[error(
        "kafka client config {shown}: other users may read or write it (mode {mode:o}); it may \
         hold a password: chmod 600 {shown}",
        shown = .path.display()
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A line of it is refused.
    #[error("{}line {line}: {why}", .path.as_ref().map(|p| format!("kafka client config {}: ", p.display())).unwrap_or_default())]
    Line {
        /// The file, when read from one.
        path: Option<PathBuf>,
        /// Its line number, from 1.
        line: usize,
        /// What is wrong, naming the key, never the value.
        why: String,
    },
}

/// Properties a file may not set: the service sets them itself, from its
/// own settings.
const RESERVED: &[&str] = &["bootstrap.servers", "metadata.broker.list"];

impl ClientProperties {
    /// Reads `path`: one `key=value` per line (a Java `.properties` file
    /// without continuations or escapes), blank lines and lines starting
    /// with `#` or `!` skipped, spaces around the key and the value trimmed,
    /// the value everything after the first `=`.
    ///
    /// A relative path in a `*.location` property (`ssl.ca.location=ca.crt`)
    /// is relative to the file's own folder, not to the working directory,
    /// so one file works wherever its folder is mounted (compose gives the
    /// same folder to a container and to the host).
    ///
    /// # Errors
    /// When the file cannot be read, other users may read or write it
    /// (group access is the operator's call), or a line is refused
    /// ([`Self::parse`]).
    pub fn load(path: &Path) -> Result<Self, ClientPropertiesError> {
        let io = |source| ClientPropertiesError::Io {
            path: path.to_owned(),
            source,
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path).map_err(io)?.permissions().mode();
            if mode & 0o007 != 0 {
                return Err(ClientPropertiesError::Exposed {
                    path: path.to_owned(),
                    mode: mode & 0o777,
                });
            }
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let mut properties = Self::parse(&text).map_err(|e| match e {
            ClientPropertiesError::Line { line, why, .. } => ClientPropertiesError::Line {
                path: Some(path.to_owned()),
                line,
                why,
            },
            other => other,
        })?;
        let folder = path.parent().unwrap_or(Path::new("."));
        for (key, value) in &mut properties.0 {
            if let Some(resolved) = relative_location(folder, key, value) {
                *value = resolved;
            }
        }
        Ok(properties)
    }

    /// [`Self::load`]'s parser, on the text of a file.
    ///
    /// # Errors
    /// A line that is not `key=value`, a key set twice, `bootstrap.servers`
    /// (the service's own setting), or a property librdkafka does not know
    /// or refuses the value of: by its line number and key.
    pub fn parse(text: &str) -> Result<Self, ClientPropertiesError> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let refuse = |why: String| ClientPropertiesError::Line {
                path: None,
                line: n + 1,
                why,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(refuse("expected key=value".into()));
            };
            let (key, value) = (key.trim(), value.trim());
            if key.is_empty() {
                return Err(refuse("no key before '='".into()));
            }
            if RESERVED.contains(&key) {
                return Err(refuse(format!(
                    "{key} is the service's own setting, not this file's"
                )));
            }
            if out.iter().any(|(k, _)| k == key) {
                return Err(refuse(format!("{key} is set twice")));
            }
            if let Err(error) = ClientConfig::new().set(key, value).create_native_config() {
                let why = match error {
                    KafkaError::ClientConfig(RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, ..) => {
                        "no such property"
                    }
                    KafkaError::ClientConfig(RDKafkaConfRes::RD_KAFKA_CONF_INVALID, ..) => {
                        "an invalid value"
                    }
                    _ => "refused",
                };
                return Err(refuse(format!("librdkafka refuses {key}: {why}")));
            }
            out.push((key.to_owned(), value.to_owned()));
        }
        Ok(Self(out))
    }

    /// The keys, in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    /// A client configuration of `bootstrap_servers` and these properties;
    /// what the caller sets on it afterwards wins.
    pub fn client_config(&self, bootstrap_servers: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", bootstrap_servers);
        for (key, value) in &self.0 {
            config.set(key, value);
        }
        config
    }
}

/// `value` of `key` resolved against `folder` when it is a path property
/// (`ssl.ca.location`, `ssl.key.location`, ...) holding a relative path;
/// `None` otherwise (`ssl.ca.location=probe` is librdkafka's word for the
/// system's CAs, not a file).
fn relative_location(folder: &Path, key: &str, value: &str) -> Option<String> {
    if !key.ends_with(".location") || value.is_empty() || value == "probe" {
        return None;
    }
    let path = Path::new(value);
    if path.is_absolute() {
        return None;
    }
    Some(folder.join(path).to_string_lossy().into_owned())
}

/// The base configuration of a client of `bootstrap_servers`, with the
/// properties of the client config file at `file` (none when `None` or
/// empty: an empty `KAFKA_CLIENT_CONFIG` is no file).
///
/// # Errors
/// As [`ClientProperties::load`].
pub fn client_config(
    bootstrap_servers: &str,
    file: Option<&Path>,
) -> Result<ClientConfig, ClientPropertiesError> {
    Ok(match file.filter(|p| !p.as_os_str().is_empty()) {
        Some(path) => ClientProperties::load(path)?,
        None => ClientProperties::default(),
    }
    .client_config(bootstrap_servers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(text: &str) -> String {
        ClientProperties::parse(text)
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn a_file_of_properties_comments_and_blank_lines() {
        let p = ClientProperties::parse(
            "# the relay's\n\n! also a comment\n security.protocol = SASL_SSL\n\
             sasl.mechanism=SCRAM-SHA-512\nsasl.username=relay\nsasl.password=a=b c\n",
        )
        .expect("parsed");
        assert_eq!(
            p.keys().collect::<Vec<_>>(),
            [
                "security.protocol",
                "sasl.mechanism",
                "sasl.username",
                "sasl.password"
            ]
        );
        let config = p.client_config("h:1");
        assert_eq!(config.get("bootstrap.servers"), Some("h:1"));
        assert_eq!(config.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(
            config.get("sasl.password"),
            Some("a=b c"),
            "split at the first '='"
        );
        assert!(
            !format!("{p:?}").contains("a=b c"),
            "Debug hides the values"
        );
    }

    #[test]
    fn bad_lines_are_named_by_number_and_key_never_by_value() {
        assert_eq!(
            refusal("security.protocol=SSL\nnonsense\n"),
            "line 2: expected key=value"
        );
        assert_eq!(refusal("=x"), "line 1: no key before '='");
        assert_eq!(refusal("acks=all\nacks=1"), "line 2: acks is set twice");
        assert!(refusal("bootstrap.servers=h:1").contains("the service's own setting"));
        let unknown = refusal("sasl.pasword=hunter2");
        assert_eq!(
            unknown,
            "line 1: librdkafka refuses sasl.pasword: no such property"
        );
        let invalid = refusal("security.protocol=hunter2");
        assert_eq!(
            invalid,
            "line 1: librdkafka refuses security.protocol: an invalid value"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_file_others_may_read_is_refused_and_errors_name_the_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("effectively-kafka-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("client.properties");
        std::fs::write(&path, "sasl.username=relay\n").expect("write");
        let chmod = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode));
        chmod(0o644).expect("chmod");
        let refused = ClientProperties::load(&path).expect_err("0644").to_string();
        assert!(
            refused.contains("mode 644") && refused.contains("chmod 600"),
            "{refused}"
        );
        chmod(0o640).expect("chmod");
        assert!(
            ClientProperties::load(&path).is_ok(),
            "group access is the operator's call"
        );
        std::fs::write(&path, "sasl.username=relay\nlinger.ms\n").expect("write");
        let line = ClientProperties::load(&path)
            .expect_err("bad line")
            .to_string();
        assert_eq!(
            line,
            format!(
                "kafka client config {}: line 2: expected key=value",
                path.display()
            )
        );
        std::fs::write(
            &path,
            "ssl.ca.location=ca.crt\nssl.key.location=/abs/client.key\nssl.crl.location=probe\n",
        )
        .expect("write");
        let config = ClientProperties::load(&path)
            .expect("relative paths")
            .client_config("h:1");
        assert_eq!(
            config.get("ssl.ca.location"),
            Some(dir.join("ca.crt").to_str().expect("utf-8")),
            "relative to the file's folder"
        );
        assert_eq!(config.get("ssl.key.location"), Some("/abs/client.key"));
        assert_eq!(config.get("ssl.crl.location"), Some("probe"));
        let missing = ClientProperties::load(&dir.join("nope"))
            .expect_err("missing")
            .to_string();
        assert!(missing.contains("nope"), "{missing}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
