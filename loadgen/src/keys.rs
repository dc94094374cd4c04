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

/// The class of a key index: `--hot-keys N` makes 1..=N the hot class and
/// every other index cold (with N = 0 every index is cold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyClass {
    /// An index in 1..=N.
    Hot,
    /// Any other index.
    Cold,
}

impl KeyClass {
    /// The class of `index` when the hot class is 1..=`hot_keys`.
    pub(crate) fn of(index: u64, hot_keys: u64) -> Self {
        if index <= hot_keys {
            Self::Hot
        } else {
            Self::Cold
        }
    }
}

/// One way of drawing an index in 1..=n (before any offset).
#[derive(Debug, Clone)]
enum Draw {
    /// 1, 2, 3, ... so every draw is an index of its own.
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
    /// Uniform over 1..=keys.
    Uniform {
        /// Upper bound of the indexes.
        keys: u64,
    },
}

impl Draw {
    /// Zipf(`keys`, `zipf_s`); `keys` must be at least 1.
    fn zipf(zipf_s: f64, keys: u64) -> anyhow::Result<Self> {
        // u64 → f64 rounds above 2^53; the clamp in `next` keeps draws in range.
        #[allow(clippy::cast_precision_loss)]
        let n = keys as f64;
        match Zipf::new(n, zipf_s) {
            Ok(dist) => Ok(Self::Zipf { dist, keys }),
            Err(e) => bail!("zipf(keys={keys}, s={zipf_s}): {e}"),
        }
    }

    /// The next index.
    fn next<R: Rng + ?Sized>(&mut self, rng: &mut R) -> u64 {
        match self {
            Self::Sequential { next } => {
                let index = *next;
                *next = next.saturating_add(1);
                index
            }
            Self::Zipf { dist, keys } => {
                let x: f64 = dist.sample(rng);
                // Float-to-int `as` saturates (NaN → 0), then the clamp fixes the range.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let index = x as u64;
                index.clamp(1, *keys)
            }
            Self::Uniform { keys } => rng.random_range(1..=*keys),
        }
    }
}

/// The hot class of `--hot-keys N --hot-share F`.
#[derive(Debug, Clone)]
struct HotClass {
    /// N: the hot indexes are 1..=N.
    keys: u64,
    /// F: the probability that an intent is hot.
    share: f64,
    /// Draws within 1..=N: Zipf(N, s) when s > 0, else uniform.
    draw: Draw,
}

/// Draws the key index of each new intent.
///
/// Without a hot class (`--hot-keys 0`): sequential indexes 1, 2, 3, ... when
/// `zipf_s` is 0, else Zipf over 1..=keys. With `--hot-keys N`: each intent
/// is hot with probability `--hot-share` and draws an index in 1..=N (Zipf(N,
/// s), or uniform when s is 0), else it is cold and draws as without a hot
/// class, offset by N so that the classes never share a key.
#[derive(Debug, Clone)]
pub(crate) struct KeyPicker {
    /// The hot class, when there is one.
    hot: Option<HotClass>,
    /// The cold draw, before the offset of N.
    cold: Draw,
}

impl KeyPicker {
    /// Cold draws sequential when `zipf_s` is 0, otherwise Zipf(`keys`,
    /// `zipf_s`); with `hot_keys` > 0, a share `hot_share` of the intents
    /// drawn from the hot class 1..=`hot_keys` instead.
    pub(crate) fn new(
        zipf_s: f64,
        keys: u64,
        hot_keys: u64,
        hot_share: f64,
    ) -> anyhow::Result<Self> {
        if !(zipf_s.is_finite() && zipf_s >= 0.0) {
            bail!("zipf exponent must be a finite number >= 0, got {zipf_s}");
        }
        let cold = if zipf_s == 0.0 {
            Draw::Sequential { next: 1 }
        } else {
            Draw::zipf(zipf_s, keys)?
        };
        if hot_keys == 0 {
            return Ok(Self { hot: None, cold });
        }
        if !(hot_share.is_finite() && (0.0..=1.0).contains(&hot_share)) {
            bail!("hot share must be between 0 and 1, got {hot_share}");
        }
        let draw = if zipf_s == 0.0 {
            Draw::Uniform { keys: hot_keys }
        } else {
            Draw::zipf(zipf_s, hot_keys)?
        };
        Ok(Self {
            hot: Some(HotClass {
                keys: hot_keys,
                share: hot_share,
                draw,
            }),
            cold,
        })
    }

    /// Whether `index`, just drawn, is certainly drawn for the first time (a
    /// sequential cold index), so it need not be remembered to tell.
    pub(crate) fn is_fresh(&self, index: u64) -> bool {
        let hot_keys = self.hot.as_ref().map_or(0, |hot| hot.keys);
        matches!(self.cold, Draw::Sequential { .. })
            && KeyClass::of(index, hot_keys) == KeyClass::Cold
    }

    /// The next intent's key index. Without a hot class this is exactly the
    /// cold draw (the same RNG calls), so a seed gives the same keys as ever.
    pub(crate) fn next<R: Rng + ?Sized>(&mut self, rng: &mut R) -> u64 {
        match &mut self.hot {
            None => self.cold.next(rng),
            Some(hot) => {
                if rng.random_bool(hot.share) {
                    hot.draw.next(rng)
                } else {
                    hot.keys.saturating_add(self.cold.next(rng))
                }
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
        let mut picker = KeyPicker::new(0.0, 10, 0, 0.5).expect("picker");
        let mut rng = StdRng::seed_from_u64(1);
        let drawn: Vec<u64> = (0..1000).map(|_| picker.next(&mut rng)).collect();
        let distinct: HashSet<_> = drawn.iter().collect();
        assert_eq!(distinct.len(), 1000, "--keys is ignored for s = 0");
        assert_eq!(drawn[..3], [1, 2, 3]);
        assert!(drawn.iter().all(|&i| picker.is_fresh(i)));
    }

    #[test]
    fn zipf_draws_are_deterministic_and_hot() {
        let draw = |seed| {
            let mut picker = KeyPicker::new(1.1, 50_000_000, 0, 0.5).expect("picker");
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
        let mut picker = KeyPicker::new(2.0, 3, 0, 0.5).expect("picker");
        let mut rng = StdRng::seed_from_u64(5);
        assert!((0..1000).all(|_| (1..=3).contains(&picker.next(&mut rng))));
        assert!(!picker.is_fresh(1), "a zipf index may be drawn again");
    }

    #[test]
    fn no_hot_class_draws_exactly_as_before() {
        // Before --hot-keys, an intent's index was one Zipf sample, clamped
        // (or the sequence 1, 2, 3, ...). Same seed: same indexes, and the RNG
        // is left in the same state, so the retry and protocol draws that
        // follow are unchanged too.
        for hot_share in [0.0, 0.5, 1.0] {
            let mut picker = KeyPicker::new(1.1, 1_000, 0, hot_share).expect("picker");
            let dist = Zipf::new(1_000.0, 1.1).expect("zipf");
            let mut a = StdRng::seed_from_u64(11);
            let mut b = StdRng::seed_from_u64(11);
            for _ in 0..5_000 {
                let before: f64 = dist.sample(&mut b);
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let before = (before as u64).clamp(1, 1_000);
                assert_eq!(picker.next(&mut a), before);
            }
            assert_eq!(a.random::<u64>(), b.random::<u64>());

            let mut picker = KeyPicker::new(0.0, 1_000, 0, hot_share).expect("picker");
            let mut a = StdRng::seed_from_u64(11);
            let drawn: Vec<u64> = (0..100).map(|_| picker.next(&mut a)).collect();
            assert_eq!(drawn, (1..=100).collect::<Vec<u64>>());
            let mut b = StdRng::seed_from_u64(11);
            assert_eq!(a.random::<u64>(), b.random::<u64>(), "no RNG call at all");
        }
    }

    #[test]
    fn hot_share_is_respected_and_classes_do_not_overlap() {
        const DRAWS: usize = 100_000;
        for zipf_s in [0.0, 1.1] {
            let draw = |seed| {
                let mut picker = KeyPicker::new(zipf_s, 10_000, 100, 0.3).expect("picker");
                let mut rng = StdRng::seed_from_u64(seed);
                (0..DRAWS)
                    .map(|_| picker.next(&mut rng))
                    .collect::<Vec<_>>()
            };
            let drawn = draw(7);
            assert_eq!(drawn, draw(7), "a seed reproduces the draws");
            let (hot, cold): (Vec<u64>, Vec<u64>) = drawn
                .iter()
                .partition(|&&i| KeyClass::of(i, 100) == KeyClass::Hot);
            // Binomial(100000, 0.3): sd ≈ 145, so ±1500 is > 10 sd.
            assert!((28_500..=31_500).contains(&hot.len()), "{}", hot.len());
            assert!(hot.iter().all(|&i| (1..=100).contains(&i)));
            assert!(cold.iter().all(|&i| i > 100), "zipf-s {zipf_s}");
            let mut freq: HashMap<u64, usize> = HashMap::new();
            for &i in &hot {
                *freq.entry(i).or_default() += 1;
            }
            // Every hot key is drawn, many times (concurrent sends of one intent).
            assert_eq!(freq.len(), 100, "zipf-s {zipf_s}");
            let hottest = freq.get(&1).copied().unwrap_or(0);
            if zipf_s == 0.0 {
                // Uniform: about 300 draws each.
                assert!(freq.values().all(|&n| (180..=420).contains(&n)), "{freq:?}");
                // Cold: fresh sequential indexes past the hot class.
                let expected: Vec<u64> = (101..).take(cold.len()).collect();
                assert_eq!(cold, expected);
            } else {
                // Zipf(100, 1.1): index 1 takes about 1/H(100, 1.1) ≈ 23% of the hot draws.
                assert!(cold.iter().all(|&i| i <= 10_100), "N + Zipf(--keys)");
                let share = hottest as f64 / hot.len() as f64;
                assert!((0.19..=0.27).contains(&share), "{share}");
                assert!(freq.get(&100).copied().unwrap_or(0) < hottest / 20);
            }
        }
    }

    #[test]
    fn hot_share_extremes_and_freshness() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut all_hot = KeyPicker::new(0.0, 10, 5, 1.0).expect("picker");
        assert!((0..1000).all(|_| (1..=5).contains(&all_hot.next(&mut rng))));
        assert!(!all_hot.is_fresh(3), "a hot index is drawn again and again");
        let mut all_cold = KeyPicker::new(0.0, 10, 5, 0.0).expect("picker");
        let drawn: Vec<u64> = (0..1000).map(|_| all_cold.next(&mut rng)).collect();
        assert_eq!(drawn[..3], [6, 7, 8]);
        assert!(drawn.iter().all(|&i| all_cold.is_fresh(i)));
        let mut zipf_cold = KeyPicker::new(1.1, 10, 5, 0.0).expect("picker");
        assert!((0..1000).all(|_| (6..=15).contains(&zipf_cold.next(&mut rng))));
        assert!(!zipf_cold.is_fresh(6));
    }

    #[test]
    fn bad_picker_parameters_are_errors() {
        assert!(KeyPicker::new(-1.0, 10, 0, 0.5).is_err());
        assert!(KeyPicker::new(f64::NAN, 10, 0, 0.5).is_err());
        assert!(KeyPicker::new(1.1, 10, 5, 1.5).is_err());
        assert!(KeyPicker::new(1.1, 10, 5, f64::NAN).is_err());
        assert!(
            KeyPicker::new(1.1, 10, 0, 1.5).is_ok(),
            "no hot class: share unused"
        );
        assert_eq!(KeyClass::of(5, 5), KeyClass::Hot);
        assert_eq!(KeyClass::of(6, 5), KeyClass::Cold);
        assert_eq!(KeyClass::of(1, 0), KeyClass::Cold);
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
