//! Who is calling: bearer tokens (`--auth-tokens-file`), whose caller scopes
//! the idempotency keys.
//!
//! A token is `CALLER.SECRET`: the caller's name, a dot, and 256 random bits
//! in unpadded base64url (`orders new-token CALLER` mints one). The service
//! keeps only digests, one line per token in the tokens file:
//!
//! ```text
//! # caller  digest of the whole token
//! shop      sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! ```
//!
//! A caller may have several lines (rotation: add the new token's line,
//! move the caller to it, remove the old line; `SIGHUP` re-reads the file).
//! The digests are compared in constant time. Clients send
//! `Authorization: Bearer TOKEN` (HTTP) or `authorization: Bearer TOKEN`
//! metadata (gRPC).
//!
//! The caller is the scope of its idempotency keys in
//! `fx.idempotency_keys`: the same key from two callers is two intents and
//! makes two orders. Without a tokens file every caller is anonymous and
//! they share one scope, `''` ([`pipeline::contract::KEY_SCOPE`]), which no
//! caller name can be.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

pub use pipeline::contract::{MAX_CALLER_LEN, validate_caller};

/// The caller of one request: the scope of its idempotency keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller(Arc<str>);

impl Caller {
    /// The caller when authentication is off: every request is it, and its
    /// keys share the one scope `''`.
    pub fn anonymous() -> Self {
        Self(Arc::from(pipeline::contract::KEY_SCOPE))
    }

    /// A named caller (a name [`validate_caller`] accepts).
    pub fn named(name: &str) -> Result<Self, String> {
        validate_caller(name)?;
        Ok(Self(Arc::from(name)))
    }

    /// The scope of its keys: its name, or `''` when anonymous.
    pub fn scope(&self) -> &str {
        &self.0
    }
}

/// Why a request was not authenticated: the label of
/// `orders_auth_refusals_total{reason}`. The answer never says which (401
/// `unauthenticated`, gRPC UNAUTHENTICATED).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("no credentials: send Authorization: Bearer TOKEN")]
    Missing,
    /// Not `Bearer CALLER.SECRET`.
    #[error("the credentials are not a bearer token")]
    Malformed,
    /// A well-formed token that is not in the tokens file.
    #[error("the token is not valid")]
    Unknown,
}

impl AuthError {
    /// Every reason, so the metric's series exist before the first refusal.
    pub const ALL: [Self; 3] = [Self::Missing, Self::Malformed, Self::Unknown];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed => "malformed",
            Self::Unknown => "unknown",
        }
    }
}

/// The digest the tokens file keeps of a token.
fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The tokens file's lines: each caller's token digests.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    by_caller: HashMap<String, Vec<[u8; 32]>>,
}

impl Tokens {
    /// Parses the tokens file's text: `CALLER sha256:HEX` per line, `#`
    /// comments and blank lines skipped. An error names the line.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut by_caller: HashMap<String, Vec<[u8; 32]>> = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |what: String| format!("line {}: {what}", n + 1);
            let mut words = line.split_whitespace();
            let (Some(caller), Some(digest), None) = (words.next(), words.next(), words.next())
            else {
                return Err(at("expected `CALLER sha256:HEX`".into()));
            };
            validate_caller(caller).map_err(at)?;
            let hex = digest
                .strip_prefix("sha256:")
                .ok_or_else(|| at("the digest must start with `sha256:`".into()))?;
            let mut bytes = [0u8; 32];
            hex::decode_to_slice(hex, &mut bytes).map_err(|_| {
                at("the digest must be 64 hexadecimal digits after `sha256:`".into())
            })?;
            by_caller.entry(caller.to_owned()).or_default().push(bytes);
        }
        Ok(Self { by_caller })
    }

    /// How many tokens, of how many callers.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.by_caller.values().map(Vec::len).sum(),
            self.by_caller.len(),
        )
    }

    /// The caller whose token `token` is.
    pub fn check(&self, token: &str) -> Result<Caller, AuthError> {
        let name = pipeline::contract::token_caller(token).ok_or(AuthError::Malformed)?;
        let given = digest(token);
        let known = self.by_caller.get(name).ok_or(AuthError::Unknown)?;
        // Every digest of the caller compared, in constant time each.
        let mut found = subtle::Choice::from(0);
        for digest in known {
            found |= digest.ct_eq(&given);
        }
        if bool::from(found) {
            Caller::named(name).map_err(|_| AuthError::Malformed)
        } else {
            Err(AuthError::Unknown)
        }
    }
}

/// Who may call: everyone (authentication off), or the holders of the
/// tokens in a file, re-read on [`Authenticator::reload`].
#[derive(Debug)]
pub struct Authenticator {
    file: Option<(PathBuf, RwLock<Arc<Tokens>>)>,
}

impl Authenticator {
    /// Authentication off: every request is [`Caller::anonymous`].
    pub fn off() -> Self {
        Self { file: None }
    }

    /// The tokens in the file at `path`.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let tokens = load(path)?;
        Ok(Self {
            file: Some((path.to_owned(), RwLock::new(Arc::new(tokens)))),
        })
    }

    /// Whether requests must authenticate.
    pub fn is_on(&self) -> bool {
        self.file.is_some()
    }

    /// The current tokens' counts (tokens, callers); `None` when off.
    pub fn counts(&self) -> Option<(usize, usize)> {
        self.file
            .as_ref()
            .map(|(_, tokens)| current(tokens).counts())
    }

    /// Reads the tokens file again; on an error the tokens in use stay.
    /// Returns the new counts (tokens, callers); `None` when off.
    pub fn reload(&self) -> Result<Option<(usize, usize)>, String> {
        let Some((path, tokens)) = &self.file else {
            return Ok(None);
        };
        let fresh = load(path)?;
        let counts = fresh.counts();
        *tokens
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(fresh);
        Ok(Some(counts))
    }

    /// The caller of a request whose `Authorization` value is
    /// `authorization` (its raw bytes; `None` when absent).
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Caller, AuthError> {
        let Some((_, tokens)) = &self.file else {
            return Ok(Caller::anonymous());
        };
        let value = authorization.ok_or(AuthError::Missing)?;
        let value = std::str::from_utf8(value).map_err(|_| AuthError::Malformed)?;
        let (scheme, token) = value.trim().split_once(' ').ok_or(AuthError::Malformed)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthError::Malformed);
        }
        current(tokens).check(token.trim())
    }
}

fn current(tokens: &RwLock<Arc<Tokens>>) -> Arc<Tokens> {
    tokens
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
}

fn load(path: &Path) -> Result<Tokens, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Tokens::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A new token for `caller`, and its line for the tokens file.
pub fn new_token(caller: &str) -> Result<(String, String), String> {
    validate_caller(caller)?;
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    let token = format!("{caller}.{}", URL_SAFE_NO_PAD.encode(secret));
    let line = format!("{caller} sha256:{}", hex::encode(digest(&token)));
    Ok((token, line))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(lines: &[&str]) -> Tokens {
        Tokens::parse(&lines.join("\n")).expect("tokens")
    }

    #[test]
    fn a_minted_token_is_its_callers_and_no_one_elses() {
        let (token, line) = new_token("shop").expect("token");
        assert!(token.starts_with("shop."));
        assert_eq!(
            token.len(),
            "shop.".len() + 43,
            "256 bits, unpadded base64url"
        );
        let tokens = file_of(&["# a comment", "", &line]);
        assert_eq!(tokens.counts(), (1, 1));
        assert_eq!(
            tokens.check(&token),
            Ok(Caller::named("shop").expect("name"))
        );
        // The secret under another caller's name, a changed secret, a
        // caller with no line, garbage.
        let secret = token.split_once('.').expect("dot").1;
        let (other, other_line) = new_token("billing").expect("token");
        let both = file_of(&[&line, &other_line]);
        assert_eq!(
            both.check(&format!("billing.{secret}")),
            Err(AuthError::Unknown)
        );
        assert_eq!(both.check(&format!("{token}x")), Err(AuthError::Unknown));
        assert_eq!(
            both.check(&other),
            Ok(Caller::named("billing").expect("name"))
        );
        assert_eq!(tokens.check(&other), Err(AuthError::Unknown));
        assert_eq!(tokens.check("no-dot"), Err(AuthError::Malformed));
        assert_eq!(tokens.check("shop."), Err(AuthError::Malformed));
        assert_eq!(tokens.check(".secret"), Err(AuthError::Malformed));
        assert_eq!(tokens.check("sh op.secret"), Err(AuthError::Malformed));
    }

    #[test]
    fn a_caller_may_hold_two_tokens_while_rotating() {
        let (old, old_line) = new_token("shop").expect("token");
        let (new, new_line) = new_token("shop").expect("token");
        let tokens = file_of(&[&old_line, &new_line]);
        assert_eq!(tokens.counts(), (2, 1));
        assert!(tokens.check(&old).is_ok() && tokens.check(&new).is_ok());
        let after = file_of(&[&new_line]);
        assert_eq!(after.check(&old), Err(AuthError::Unknown));
        assert!(after.check(&new).is_ok());
    }

    #[test]
    fn bad_lines_are_named_by_number() {
        for (text, wanted) in [
            ("shop", "line 1: expected"),
            ("\nshop sha256:ab extra", "line 2: expected"),
            ("shop sha1:00", "line 1: the digest must start"),
            ("shop sha256:zz", "line 1: the digest must be 64"),
            (
                &format!("sh.op sha256:{}", "0".repeat(64)),
                "line 1: a caller's name",
            ),
            (
                &format!("{} sha256:{}", "a".repeat(65), "0".repeat(64)),
                "line 1: a caller's name",
            ),
        ] {
            let error = Tokens::parse(text).expect_err(text);
            assert!(error.starts_with(wanted), "{text:?}: {error}");
        }
        assert!(Tokens::parse(&format!("shop sha256:{}", "A".repeat(64))).is_ok());
    }

    #[test]
    fn the_authorization_value_is_a_bearer_token() {
        let (token, line) = new_token("shop").expect("token");
        let dir = std::env::temp_dir().join(format!("orders-auth-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("tokens");
        std::fs::write(&path, format!("{line}\n")).expect("write");
        let auth = Authenticator::from_file(&path).expect("load");
        assert!(auth.is_on());
        let shop = Caller::named("shop").expect("name");
        for value in [format!("Bearer {token}"), format!("bearer  {token} ")] {
            assert_eq!(
                auth.authenticate(Some(value.as_bytes())),
                Ok(shop.clone()),
                "{value}"
            );
        }
        assert_eq!(auth.authenticate(None), Err(AuthError::Missing));
        for value in [token.clone(), format!("Basic {token}"), "Bearer".into()] {
            assert_eq!(
                auth.authenticate(Some(value.as_bytes())),
                Err(AuthError::Malformed),
                "{value}"
            );
        }
        assert_eq!(
            auth.authenticate(Some(&[b'B', 0xff, b' ', b'x'])),
            Err(AuthError::Malformed)
        );
        // Rotated: the old token refused after the reload; a bad file
        // leaves the tokens in use.
        let (fresh, fresh_line) = new_token("shop").expect("token");
        std::fs::write(&path, format!("{fresh_line}\n")).expect("write");
        assert_eq!(auth.reload(), Ok(Some((1, 1))));
        let old = format!("Bearer {token}");
        assert_eq!(
            auth.authenticate(Some(old.as_bytes())),
            Err(AuthError::Unknown)
        );
        std::fs::write(&path, "garbage\n").expect("write");
        assert!(auth.reload().is_err());
        let current = format!("Bearer {fresh}");
        assert_eq!(auth.authenticate(Some(current.as_bytes())), Ok(shop));
        let off = Authenticator::off();
        assert_eq!(off.authenticate(None), Ok(Caller::anonymous()));
        assert_eq!(Caller::anonymous().scope(), "");
        std::fs::remove_dir_all(&dir).ok();
    }
}
