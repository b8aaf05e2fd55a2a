//! Durations for flags in Go's syntax (`250ms`, `2s`, `1m30s`, `1.5h`), as the llm-d EPP's
//! flags take them (`time.ParseDuration`), parsed once at start-up.

use std::time::Duration;

/// Why a duration flag was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DurationError {
    /// A number has no unit or an unknown one.
    #[error("duration `{0}` needs a unit: ns, us, ms, s, m or h (e.g. `250ms`, `2s`, `1m30s`)")]
    Unit(String),
    /// A number part is not a non-negative decimal number.
    #[error("duration `{0}` is not a sequence of non-negative numbers each followed by a unit")]
    Number(String),
    /// The duration does not fit.
    #[error("duration `{0}` is too long")]
    Overflow(String),
}

/// Parses a Go duration (`300ms`, `1.5s`, `2m30s`, `1h`; units ns, us/µs, ms, s, m, h; a
/// bare `0`) into a [`Duration`]. Negative durations are refused.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    // Go takes a sign; a negative duration is refused below (its `-` is not a number).
    let text = text.strip_prefix('+').unwrap_or(text);
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let number_error = || DurationError::Number(text.to_owned());
    if text.is_empty() {
        return Err(number_error());
    }
    let mut total_ns: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(number_error());
        }
        let unit_ns: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(DurationError::Unit(text.to_owned())),
        };
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| number_error())?
        };
        let mut part = whole
            .checked_mul(unit_ns)
            .ok_or_else(|| DurationError::Overflow(text.to_owned()))?;
        // Digits past nanoseconds cannot count; 20 keeps 10^digits within u128.
        let mut scale: u128 = 1;
        for digit in fraction.chars().take(20) {
            scale *= 10;
            let digit = u128::from(digit.to_digit(10).ok_or_else(number_error)?);
            part += digit * unit_ns / scale;
        }
        total_ns = total_ns
            .checked_add(part)
            .ok_or_else(|| DurationError::Overflow(text.to_owned()))?;
        rest = after;
    }
    let secs = u64::try_from(total_ns / 1_000_000_000)
        .map_err(|_| DurationError::Overflow(text.to_owned()))?;
    let nanos = u32::try_from(total_ns % 1_000_000_000).unwrap_or(0);
    Ok(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
    }

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration(".5ms"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(
            parse_duration("1h2m3s4ms5us6ns"),
            Ok(Duration::new(3723, 4_005_006))
        );
        assert_eq!(parse_duration("300\u{b5}s"), Ok(Duration::from_micros(300)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("+1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(
            parse_duration("0.1234567891s"),
            Ok(Duration::from_nanos(123_456_789))
        );
    }

    #[test]
    fn rejects_missing_or_unknown_units() {
        assert!(matches!(parse_duration("10"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration("10d"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration("1s5"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration(""), Err(DurationError::Number(_))));
        assert!(matches!(parse_duration("."), Err(DurationError::Number(_))));
        assert!(matches!(
            parse_duration("1..5s"),
            Err(DurationError::Number(_))
        ));
        assert!(matches!(
            parse_duration("99999999999999999999999h"),
            Err(DurationError::Overflow(_))
        ));
        assert!(matches!(parse_duration("s"), Err(DurationError::Number(_))));
        assert!(matches!(
            parse_duration("-1s"),
            Err(DurationError::Number(_))
        ));
    }
}
