//! Idempotency keys for the synchronous edge, as values: a validated key, a
//! request's fingerprint and the response stored with the key.
//!
//! A client sends a key with each request; the first request with that key
//! claims it and stores the response it got; every later request with the
//! same key and the same fingerprint gets that response back, verbatim; the
//! same key with another fingerprint is refused. [`store::Keys`] claims
//! them in the caller's transaction, `store::Idempotent` (feature `http`) on
//! an axum route.
//!
//! [`store::Keys`]: crate::store::Keys

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1..=255 visible ASCII characters (0x21..=0x7E).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a raw key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key is absent.
    #[error("the Idempotency-Key header is required")]
    Missing,
    /// The key is the empty string.
    #[error("the idempotency key must not be empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {0} bytes long; at most {MAX_KEY_LEN} are allowed")]
    TooLong(usize),
    /// The key holds a byte outside visible ASCII.
    #[error("the idempotency key must be visible ASCII (0x21..0x7E); byte {position} is not")]
    InvalidByte {
        /// Zero-based offset of the first offending byte.
        position: usize,
    },
}

impl IdempotencyKey {
    /// Validates a raw key.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(raw.len()));
        }
        if let Some(position) = raw.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidByte { position });
        }
        // Every byte is ASCII, so this cannot fail; map instead of unwrap anyway.
        String::from_utf8(raw.to_vec())
            .map(Self)
            .map_err(|_| KeyError::InvalidByte { position: 0 })
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A BLAKE3 hash of the canonical form of a request, so that a key reused with
/// a different request is detected. Callers hash a canonical encoding (typed
/// fields, fixed order), never raw bytes, so two JSON texts that differ only in
/// whitespace or key order are the same request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Hashes `canonical` under `context` (e.g. `"orders.create v1"`), which
    /// separates operations and versions of the canonical form.
    pub fn new(context: &str, canonical: &[u8]) -> Self {
        let mut hasher = blake3::Hasher::new_derive_key(context);
        hasher.update(canonical);
        Self(*hasher.finalize().as_bytes())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// A response stored with its key and replayed verbatim to every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// Status code (HTTP semantics, whatever protocol carried the request).
    pub status: u16,
    /// Headers in order, names in lowercase.
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// The value of header `name` (lowercase), if stored.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_visible_ascii_of_bounded_length() {
        assert!(IdempotencyKey::parse(b"a").is_ok());
        assert!(IdempotencyKey::parse(&[b'k'; MAX_KEY_LEN]).is_ok());
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse(&[b'k'; MAX_KEY_LEN + 1]),
            Err(KeyError::TooLong(256))
        );
        assert_eq!(
            IdempotencyKey::parse(b"ab c"),
            Err(KeyError::InvalidByte { position: 2 })
        );
        assert_eq!(
            IdempotencyKey::parse("é".as_bytes()),
            Err(KeyError::InvalidByte { position: 0 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"x\x7f"),
            Err(KeyError::InvalidByte { position: 1 })
        );
    }

    #[test]
    fn fingerprints_separate_contexts_and_inputs() {
        let a = Fingerprint::new("ctx v1", b"abc");
        assert_eq!(a, Fingerprint::new("ctx v1", b"abc"));
        assert_ne!(a, Fingerprint::new("ctx v2", b"abc"));
        assert_ne!(a, Fingerprint::new("ctx v1", b"abd"));
    }
}
