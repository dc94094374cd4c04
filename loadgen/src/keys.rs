//! Idempotency keys and request bodies.
//!
//! An intent is a key index. Its key is `{prefix}-{index}` and its body is a
//! pure function of (seed, index), so every send of an index (a retry, or a
//! Zipf re-draw) is the same request: the service must answer it with the
//! first response, never 409.

use anyhow::bail;
use rand::Rng;
use rand_distr::{Distribution, Zipf};

/// Longest key the service accepts, in bytes.
const MAX_KEY_LEN: usize = 255;
/// Room left for `-{index}` after the prefix: a dash and up to 20 digits of a u64.
const INDEX_SUFFIX_LEN: usize = 21;
/// Accounts the bodies spread over.
const ACCOUNTS: u64 = 100_000;
/// Largest amount a body carries, in cents (well inside the service's limit).
const MAX_AMOUNT_CENTS: u64 = 100_000;

/// One step of SplitMix64. Used instead of `DefaultHasher` or a `rand` RNG
/// because its output is fixed forever: the body of (seed, index) is the same
/// in every build, so reusing a prefix and seed later replays the same intents.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A create-order request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Body {
    /// Account to charge, 1..=100_000.
    pub(crate) account_id: i64,
    /// Amount, 1..=100_000 cents.
    pub(crate) amount_cents: i64,
}

impl Body {
    /// The JSON text sent over HTTP.
    pub(crate) fn to_json(self) -> String {
        format!(
            "{{\"account_id\":{},\"amount_cents\":{}}}",
            self.account_id, self.amount_cents
        )
    }
}

/// Maps key indexes to keys and bodies for one run.
#[derive(Debug, Clone)]
pub(crate) struct KeySpace {
    prefix: String,
    seed: u64,
}

impl KeySpace {
    /// Keys `{prefix}-{index}`, bodies derived from `seed`.
    pub(crate) fn new(prefix: String, seed: u64) -> Self {
        Self { prefix, seed }
    }

    /// The idempotency key of `index`.
    pub(crate) fn key(&self, index: u64) -> String {
        format!("{}-{index}", self.prefix)
    }

    /// The body of `index`: the same for every send of it.
    pub(crate) fn body(&self, index: u64) -> Body {
        let hash = splitmix64(self.seed ^ splitmix64(index));
        Body {
            // Both values are < 2^17, so the conversions cannot fail.
            account_id: i64::try_from(index % ACCOUNTS + 1).unwrap_or(1),
            amount_cents: i64::try_from(hash % MAX_AMOUNT_CENTS + 1).unwrap_or(1),
        }
    }
}

/// Draws the key index of each new intent.
#[derive(Debug, Clone)]
pub(crate) enum KeyPicker {
    /// `--zipf-s 0`: 1, 2, 3, ... so every intent has a key of its own.
    Sequential {
        /// The next index to hand out.
        next: u64,
    },
    /// Zipf over 1..=keys: index 1 is the hottest.
    Zipf {
        /// The distribution.
        dist: Zipf<f64>,
        /// Upper bound of the indexes, to clamp float rounding.
        keys: u64,
    },
}

impl KeyPicker {
    /// Sequential when `zipf_s` is 0, otherwise Zipf(`keys`, `zipf_s`).
    pub(crate) fn new(zipf_s: f64, keys: u64) -> anyhow::Result<Self> {
        if zipf_s == 0.0 {
            return Ok(Self::Sequential { next: 1 });
        }
        // u64 → f64 rounds above 2^53; the clamp in `next` keeps draws in range.
        #[allow(clippy::cast_precision_loss)]
        let n = keys as f64;
        match Zipf::new(n, zipf_s) {
            Ok(dist) => Ok(Self::Zipf { dist, keys }),
            Err(e) => bail!("zipf(keys={keys}, s={zipf_s}): {e}"),
        }
    }

    /// Whether every draw is a fresh index.
    pub(crate) fn is_unique(&self) -> bool {
        matches!(self, Self::Sequential { .. })
    }

    /// The next intent's key index.
    pub(crate) fn next<R: Rng + ?Sized>(&mut self, rng: &mut R) -> u64 {
        match self {
            Self::Sequential { next } => {
                let index = *next;
                *next += 1;
                index
            }
            Self::Zipf { dist, keys } => {
                let x: f64 = dist.sample(rng);
                // Float-to-int `as` saturates (NaN → 0), then the clamp fixes the range.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let index = x as u64;
                index.clamp(1, *keys)
            }
        }
    }
}

/// A fresh run id of 8 hex digits from the OS RNG (never from --seed, so two
/// runs with one seed still use distinct keys).
pub(crate) fn random_prefix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// A prefix must keep every key within the service's rules: visible ASCII
/// (0x21..=0x7E) and at most 255 bytes with the `-{index}` suffix.
pub(crate) fn validate_prefix(prefix: &str) -> anyhow::Result<()> {
    if prefix.is_empty() {
        bail!("must not be empty");
    }
    if prefix.len() + INDEX_SUFFIX_LEN > MAX_KEY_LEN {
        bail!(
            "must be at most {} bytes long",
            MAX_KEY_LEN - INDEX_SUFFIX_LEN
        );
    }
    if let Some(b) = prefix.bytes().find(|b| !(0x21..=0x7e).contains(b)) {
        bail!("must be visible ASCII (0x21..0x7E); found byte 0x{b:02x}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn bodies_are_a_pure_function_of_seed_and_index() {
        let a = KeySpace::new("p".into(), 7);
        let b = KeySpace::new("other".into(), 7);
        let c = KeySpace::new("p".into(), 8);
        for index in [1, 2, 99_999, 100_000, u64::MAX] {
            assert_eq!(a.body(index), a.body(index));
            assert_eq!(a.body(index), b.body(index), "prefix must not matter");
            let body = a.body(index);
            assert!((1..=100_000).contains(&body.account_id));
            assert!((1..=100_000).contains(&body.amount_cents));
        }
        assert_eq!(a.body(1).account_id, 2);
        // Another seed gives other amounts (for almost every index).
        let differ = (1..100).filter(|&i| a.body(i) != c.body(i)).count();
        assert!(differ > 90, "{differ}");
    }

    #[test]
    fn body_json_is_what_the_service_expects() {
        let body = Body {
            account_id: 12,
            amount_cents: 345,
        };
        assert_eq!(body.to_json(), r#"{"account_id":12,"amount_cents":345}"#);
        let parsed: serde_json::Value = serde_json::from_str(&body.to_json()).expect("json");
        assert_eq!(parsed["amount_cents"], 345);
    }

    #[test]
    fn splitmix_is_stable() {
        // Reference values of SplitMix64; they must never change (see above).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(1), 0x910A_2DEC_8902_5CC1);
    }

    #[test]
    fn keys_are_prefix_dash_index() {
        let space = KeySpace::new("ab12cd34".into(), 1);
        assert_eq!(space.key(42), "ab12cd34-42");
    }

    #[test]
    fn zipf_s_zero_gives_unique_keys() {
        let mut picker = KeyPicker::new(0.0, 10).expect("picker");
        assert!(picker.is_unique());
        let mut rng = StdRng::seed_from_u64(1);
        let drawn: Vec<u64> = (0..1000).map(|_| picker.next(&mut rng)).collect();
        let distinct: HashSet<_> = drawn.iter().collect();
        assert_eq!(distinct.len(), 1000, "--keys is ignored for s = 0");
        assert_eq!(drawn[..3], [1, 2, 3]);
    }

    #[test]
    fn zipf_draws_are_deterministic_and_hot() {
        let draw = |seed| {
            let mut picker = KeyPicker::new(1.1, 50_000_000).expect("picker");
            let mut rng = StdRng::seed_from_u64(seed);
            (0..10_000)
                .map(|_| picker.next(&mut rng))
                .collect::<Vec<_>>()
        };
        let a = draw(42);
        assert_eq!(a, draw(42));
        assert_ne!(a, draw(43));
        assert!(a.iter().all(|&i| (1..=50_000_000).contains(&i)));
        let mut freq: HashMap<u64, usize> = HashMap::new();
        for &i in &a {
            *freq.entry(i).or_default() += 1;
        }
        // Index 1 carries about 1/zeta(1.1) ≈ 9.5% of the draws.
        let hottest = freq.get(&1).copied().unwrap_or(0);
        assert!((500..=1500).contains(&hottest), "{hottest}");
    }

    #[test]
    fn zipf_respects_small_key_spaces() {
        let mut picker = KeyPicker::new(2.0, 3).expect("picker");
        let mut rng = StdRng::seed_from_u64(5);
        assert!((0..1000).all(|_| (1..=3).contains(&picker.next(&mut rng))));
    }

    #[test]
    fn prefixes_are_validated() {
        assert!(validate_prefix("run-1").is_ok());
        assert!(validate_prefix("").is_err());
        assert!(validate_prefix("a b").is_err());
        assert!(validate_prefix("é").is_err());
        assert!(validate_prefix(&"x".repeat(234)).is_ok());
        assert!(validate_prefix(&"x".repeat(235)).is_err());
        let random = random_prefix();
        assert_eq!(random.len(), 8);
        assert!(validate_prefix(&random).is_ok());
    }
}
