//! Text taken from untrusted input, made storable.
//!
//! PostgreSQL refuses a NUL character in `text` (SQLSTATE 22021) and anything
//! that is not valid UTF-8. A dead-letter reason or a relay error often
//! quotes the input that caused it (a uuid parser quotes the bad character),
//! so a reason written verbatim can make the very write that records the
//! failure fail, and a consumer that retries that write never moves on.
//! Every string that reaches a `text` column from the network goes through
//! [`storable`] (the raw bytes, when kept, go to a `bytea` column as they are).

/// The most bytes of a stored reason; longer text is cut at a character
/// boundary and marked.
pub const MAX_STORED_TEXT: usize = 2_000;

/// `text` with NUL and every other control character except newline and tab
/// written as a `\u{…}` escape, cut to [`MAX_STORED_TEXT`] bytes. Always
/// accepted by a PostgreSQL `text` column (UTF-8 database).
pub fn storable(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_STORED_TEXT) + 16);
    for c in text.chars() {
        let escaped = c.is_control() && c != '\n' && c != '\t';
        let width = if escaped { 10 } else { c.len_utf8() };
        if out.len() + width > MAX_STORED_TEXT {
            out.push_str("…[truncated]");
            return out;
        }
        if escaped {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// [`storable`] for bytes that may not be UTF-8: invalid sequences become
/// U+FFFD first.
pub fn storable_bytes(bytes: &[u8]) -> String {
    storable(&String::from_utf8_lossy(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_and_controls_are_escaped_newlines_kept() {
        assert_eq!(storable("a\0b"), "a\\u{0}b");
        assert_eq!(storable("x\u{1b}[31m"), "x\\u{1b}[31m");
        assert_eq!(storable("line\nnext\tcol"), "line\nnext\tcol");
        assert_eq!(storable("ünïcödé ✓"), "ünïcödé ✓");
        assert!(!storable("\0\0\0").contains('\0'));
    }

    #[test]
    fn invalid_utf8_is_replaced() {
        assert_eq!(storable_bytes(b"ok\xff\xfe\0"), "ok\u{fffd}\u{fffd}\\u{0}");
    }

    #[test]
    fn long_text_is_capped_at_a_char_boundary() {
        let long = "é".repeat(5_000);
        let s = storable(&long);
        assert!(s.len() <= MAX_STORED_TEXT + "…[truncated]".len());
        assert!(s.ends_with("…[truncated]"));
        let nuls = "\0".repeat(5_000);
        let s = storable(&nuls);
        assert!(s.len() <= MAX_STORED_TEXT + "…[truncated]".len());
        assert!(!s.contains('\0'));
    }
}
