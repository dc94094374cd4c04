//! Destination specs sealed at rest: `orders.webhook_destinations.spec`
//! holds a destination's signing secrets, so it is stored encrypted with an
//! AEAD (XChaCha20-Poly1305, a random 192-bit nonce per seal), under a key
//! the database never sees, and bound to its row (the destination's name is
//! the associated data: a sealed spec copied onto another row does not
//! open).
//!
//! The keys come from a key file (`--webhook-secrets-key-file`) or the
//! environment (`RELAY_WEBHOOK_SECRETS_KEY`, never a flag: a process's
//! arguments are visible to every user of the host): one key per line,
//! `ID:BASE64` (32 bytes), the first the current one (every seal), the
//! others kept so that what they sealed still opens during a rotation.
//! Rotating: put a new key first, keep the old one after it, run
//! `relay webhooks rekey` (every spec sealed again under the current key),
//! then drop the old line. `relay webhooks keygen` prints a new key line.
//!
//! A stored spec is `sealed:v1:ID:BASE64(nonce || ciphertext)`; a spec
//! without the prefix is one written before sealing existed (or with
//! `--unsafe-plaintext-webhook-secrets`): it is read as it is, and `rekey`
//! seals it.

use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};

/// The environment variable that may hold the keys instead of a file.
pub const KEY_ENV: &str = "RELAY_WEBHOOK_SECRETS_KEY";

const PREFIX: &str = "sealed:v1:";
const NONCE: usize = 24;
const KEY: usize = 32;

/// Where the relay takes its sealing keys from.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SecretsArgs {
    /// A file of the keys that seal the destinations' specs (their signing
    /// secrets) in `orders.webhook_destinations`: one `ID:BASE64` key of 32
    /// bytes per line, the first the current one, the others still
    /// readable (a rotation: `relay webhooks rekey`). Refused when other
    /// users may read it. `relay webhooks keygen` prints a key line; the
    /// keys may instead be in RELAY_WEBHOOK_SECRETS_KEY (lines separated by
    /// newlines or spaces). The embedded stack makes one
    /// (.stack/secrets/webhook-secrets.key).
    #[arg(long, env = "RELAY_WEBHOOK_SECRETS_KEY_FILE", value_name = "FILE")]
    pub webhook_secrets_key_file: Option<PathBuf>,

    /// Store the destinations' secrets in plaintext when no key is given
    /// (any database reader then has them): for a throwaway test only.
    #[arg(long, env = "RELAY_UNSAFE_PLAINTEXT_WEBHOOK_SECRETS")]
    pub unsafe_plaintext_webhook_secrets: bool,
}

/// The sealing keys: the current one first.
#[derive(Clone)]
pub struct Keyring {
    keys: Vec<(String, XChaCha20Poly1305)>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field(
                "ids",
                &self.keys.iter().map(|(id, _)| id).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A spec that could not be sealed or opened; never holds the spec.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// No key was given (and plaintext was not asked for).
    #[error(
        "the destinations' secrets are sealed at rest and no key was given: \
         --webhook-secrets-key-file FILE or RELAY_WEBHOOK_SECRETS_KEY \
         (`relay webhooks keygen` prints one), or --unsafe-plaintext-webhook-secrets"
    )]
    NoKey,
    /// The keys could not be read or parsed.
    #[error("webhook secrets key: {0}")]
    Keys(String),
    /// The spec is sealed under a key the relay does not have.
    #[error(
        "destination {destination}: its spec is sealed under key {id:?}, which the relay does not \
         have (its keys: {have}); add that key's line to the key file"
    )]
    UnknownKey {
        /// The destination.
        destination: String,
        /// The key it is sealed under.
        id: String,
        /// The relay's keys' ids.
        have: String,
    },
    /// The sealed spec did not open: corrupted, or moved from another row.
    #[error(
        "destination {0}: its sealed spec does not open (corrupted, or sealed for another destination)"
    )]
    Corrupt(String),
}

impl Keyring {
    /// Parses key lines (`ID:BASE64`, newlines or spaces between them,
    /// `#` comments).
    ///
    /// # Errors
    /// A line that is not `ID:BASE64` of 32 bytes, or an id twice.
    pub fn parse(text: &str) -> Result<Self, SealError> {
        let mut keys: Vec<(String, XChaCha20Poly1305)> = Vec::new();
        let words = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or_default())
            .flat_map(str::split_whitespace);
        for (n, word) in words.enumerate() {
            let (id, b64) = word
                .split_once(':')
                .ok_or_else(|| SealError::Keys(format!("key {}: expected ID:BASE64", n + 1)))?;
            if id.is_empty()
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(SealError::Keys(format!(
                    "key {}: its id must be letters, digits, '-' or '_'",
                    n + 1
                )));
            }
            let bytes = STANDARD
                .decode(b64)
                .ok()
                .filter(|b| b.len() == KEY)
                .ok_or_else(|| {
                    SealError::Keys(format!("key {id}: expected {KEY} bytes in base64"))
                })?;
            if keys.iter().any(|(k, _)| k == id) {
                return Err(SealError::Keys(format!("key {id} is given twice")));
            }
            keys.push((
                id.to_owned(),
                XChaCha20Poly1305::new(Key::from_slice(&bytes)),
            ));
        }
        if keys.is_empty() {
            return Err(SealError::Keys("no key in it".into()));
        }
        Ok(Self { keys })
    }

    /// Reads the key file at `path`.
    ///
    /// # Errors
    /// When it cannot be read, other users may read it, or it does not parse.
    pub fn load(path: &Path) -> Result<Self, SealError> {
        let text = read_private(path).map_err(SealError::Keys)?;
        Self::parse(&text).map_err(|e| match e {
            SealError::Keys(why) => SealError::Keys(format!("{}: {why}", path.display())),
            other => other,
        })
    }

    /// A new key line, `ID:BASE64`, for a key file.
    pub fn generate_line(id: &str) -> String {
        let key: [u8; KEY] = rand::random();
        format!("{id}:{}", STANDARD.encode(key))
    }

    /// The current key's id.
    pub fn current(&self) -> &str {
        &self.keys[0].0
    }

    fn ids(&self) -> String {
        self.keys
            .iter()
            .map(|(id, _)| id.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `spec` sealed under the current key, bound to `destination`.
    pub fn seal(&self, destination: &str, spec: &str) -> String {
        let (id, cipher) = &self.keys[0];
        let nonce: [u8; NONCE] = rand::random();
        let sealed = cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: spec.as_bytes(),
                    aad: aad(destination).as_bytes(),
                },
            )
            .unwrap_or_default();
        let mut out = Vec::with_capacity(NONCE + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        format!("{PREFIX}{id}:{}", STANDARD.encode(out))
    }

    /// The spec `stored` holds for `destination`: opened when sealed, as it
    /// is when written in plaintext.
    ///
    /// # Errors
    /// A key the ring lacks, or a sealed spec that does not open.
    pub fn open(&self, destination: &str, stored: &str) -> Result<String, SealError> {
        let Some(rest) = stored.strip_prefix(PREFIX) else {
            return Ok(stored.to_owned());
        };
        let corrupt = || SealError::Corrupt(destination.to_owned());
        let (id, b64) = rest.split_once(':').ok_or_else(corrupt)?;
        let cipher = self
            .keys
            .iter()
            .find(|(k, _)| k == id)
            .map(|(_, c)| c)
            .ok_or_else(|| SealError::UnknownKey {
                destination: destination.to_owned(),
                id: id.to_owned(),
                have: self.ids(),
            })?;
        let bytes = STANDARD.decode(b64).map_err(|_| corrupt())?;
        if bytes.len() < NONCE {
            return Err(corrupt());
        }
        let (nonce, sealed) = bytes.split_at(NONCE);
        let plain = cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: aad(destination).as_bytes(),
                },
            )
            .map_err(|_| corrupt())?;
        String::from_utf8(plain).map_err(|_| corrupt())
    }

    /// Whether `stored` is sealed under the current key (`rekey` leaves it).
    pub fn is_current(&self, stored: &str) -> bool {
        stored
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once(':'))
            .is_some_and(|(id, _)| id == self.current())
    }
}

/// The text of the file at `path`, which must be its owner's alone
/// ([`pipeline::config::read_private`]).
pub(super) fn read_private(path: &Path) -> Result<String, String> {
    pipeline::config::read_private(path)
}

/// Whether `stored` is sealed at all.
pub fn is_sealed(stored: &str) -> bool {
    stored.starts_with(PREFIX)
}

fn aad(destination: &str) -> String {
    format!("effectively webhook destination\0{destination}")
}

/// How the relay stores the destinations' specs: sealed under its keys, or
/// (only when asked, with no key) in plaintext.
#[derive(Debug, Clone)]
pub enum Specs {
    /// Sealed.
    Sealed(Keyring),
    /// In plaintext (`--unsafe-plaintext-webhook-secrets`); sealed specs
    /// cannot be read.
    Plaintext,
}

impl Specs {
    /// From the relay's settings: the key file, else the environment's
    /// keys, else plaintext if asked for.
    ///
    /// # Errors
    /// No key and no plaintext asked for, or keys that do not load.
    pub fn from_args(args: &SecretsArgs) -> Result<Self, SealError> {
        if let Some(path) = args
            .webhook_secrets_key_file
            .as_deref()
            .filter(|p| !p.as_os_str().is_empty())
        {
            return Keyring::load(path).map(Self::Sealed);
        }
        if let Ok(text) = std::env::var(KEY_ENV)
            && !text.trim().is_empty()
        {
            return Keyring::parse(&text)
                .map(Self::Sealed)
                .map_err(|e| match e {
                    SealError::Keys(why) => SealError::Keys(format!("{KEY_ENV}: {why}")),
                    other => other,
                });
        }
        if args.unsafe_plaintext_webhook_secrets {
            return Ok(Self::Plaintext);
        }
        Err(SealError::NoKey)
    }

    /// `spec` as it is stored.
    pub fn seal(&self, destination: &str, spec: &str) -> String {
        match self {
            Self::Sealed(ring) => ring.seal(destination, spec),
            Self::Plaintext => spec.to_owned(),
        }
    }

    /// The spec `stored` holds.
    ///
    /// # Errors
    /// As [`Keyring::open`]; with no key, a sealed spec.
    pub fn open(&self, destination: &str, stored: &str) -> Result<String, SealError> {
        match self {
            Self::Sealed(ring) => ring.open(destination, stored),
            Self::Plaintext if is_sealed(stored) => Err(SealError::NoKey),
            Self::Plaintext => Ok(stored.to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(lines: &[&str]) -> Keyring {
        Keyring::parse(&lines.join("\n")).expect("keys")
    }

    #[test]
    fn a_sealed_spec_opens_only_for_its_destination_and_hides_the_secret() {
        let k1 = Keyring::generate_line("k1");
        let keys = ring(&[&k1]);
        let spec = "payments=https://example.com/h,secret=whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0";
        let sealed = keys.seal("payments", spec);
        assert!(sealed.starts_with("sealed:v1:k1:"), "{sealed}");
        assert!(
            !sealed.contains("whsec_") && !sealed.contains("example.com"),
            "{sealed}"
        );
        assert_ne!(
            sealed,
            keys.seal("payments", spec),
            "a fresh nonce each time"
        );
        assert_eq!(keys.open("payments", &sealed).expect("opens"), spec);
        assert!(
            matches!(keys.open("billing", &sealed), Err(SealError::Corrupt(_))),
            "bound to its row"
        );
        let mut flipped = sealed.clone().into_bytes();
        let last = flipped.len() - 3;
        flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(flipped).expect("ascii");
        assert!(matches!(
            keys.open("payments", &flipped),
            Err(SealError::Corrupt(_))
        ));
        assert_eq!(
            keys.open("payments", spec).expect("plaintext"),
            spec,
            "an older plaintext row"
        );
        let other = ring(&[&Keyring::generate_line("k2")]);
        let missing = other.open("payments", &sealed).expect_err("another ring");
        assert!(missing.to_string().contains("\"k1\""), "{missing}");
        assert!(!missing.to_string().contains("whsec_"));
    }

    #[test]
    fn a_rotation_reads_the_old_key_and_seals_under_the_new() {
        let (old, new) = (Keyring::generate_line("old"), Keyring::generate_line("new"));
        let before = ring(&[&old]);
        let sealed = before.seal("d", "spec");
        let during = ring(&[&new, &old]);
        assert_eq!(
            during.open("d", &sealed).expect("the old key opens it"),
            "spec"
        );
        assert!(!during.is_current(&sealed));
        let resealed = during.seal("d", "spec");
        assert!(during.is_current(&resealed));
        let after = ring(&[&new]);
        assert_eq!(after.open("d", &resealed).expect("the new key"), "spec");
        assert!(matches!(
            after.open("d", &sealed),
            Err(SealError::UnknownKey { .. })
        ));
    }

    #[test]
    fn bad_keys_are_refused_without_quoting_them() {
        for (text, wanted) in [
            ("", "no key"),
            ("nocolon", "ID:BASE64"),
            ("k1:AAAA", "32 bytes"),
            ("bad id:AAAA", "ID:BASE64"),
            ("k!:AAAA", "letters"),
        ] {
            let error = Keyring::parse(text).expect_err(text).to_string();
            assert!(error.contains(wanted), "{text:?}: {error}");
        }
        let line = Keyring::generate_line("k1");
        let twice = Keyring::parse(&format!("{line}\n{line}"))
            .expect_err("twice")
            .to_string();
        assert!(
            twice.contains("twice") && !twice.contains(&line[3..]),
            "{twice}"
        );
        let commented = Keyring::parse(&format!("# the current one\n{line}  # since today\n"))
            .expect("comments");
        assert_eq!(commented.current(), "k1");
    }

    #[test]
    fn no_key_is_refused_unless_plaintext_is_asked_for_and_a_key_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let args = SecretsArgs::default();
        if std::env::var_os(KEY_ENV).is_none() {
            assert!(matches!(Specs::from_args(&args), Err(SealError::NoKey)));
            let plain = Specs::from_args(&SecretsArgs {
                unsafe_plaintext_webhook_secrets: true,
                ..args.clone()
            })
            .expect("asked for");
            assert_eq!(plain.seal("d", "spec"), "spec");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("webhook-secrets.key");
        std::fs::write(&path, Keyring::generate_line("k1")).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        let exposed = Keyring::load(&path).expect_err("0640").to_string();
        assert!(exposed.contains("chmod 600"), "{exposed}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let specs = Specs::from_args(&SecretsArgs {
            webhook_secrets_key_file: Some(path),
            unsafe_plaintext_webhook_secrets: false,
        })
        .expect("loads");
        let sealed = specs.seal("d", "spec");
        assert!(is_sealed(&sealed));
        assert_eq!(specs.open("d", &sealed).expect("opens"), "spec");
        assert!(matches!(
            Specs::Plaintext.open("d", &sealed),
            Err(SealError::NoKey)
        ));
    }
}
