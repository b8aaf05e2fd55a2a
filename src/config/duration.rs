//! Human durations for flags (`250ms`, `2s`, `1m`), parsed once at start-up.

use std::time::Duration;

/// Why a duration flag was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DurationError {
    /// The value has no unit or an unknown one.
    #[error("duration `{0}` needs a unit: ms, s or m (e.g. `250ms`, `2s`)")]
    Unit(String),
    /// The number part is not a non-negative integer.
    #[error("duration `{0}` is not a whole number followed by a unit")]
    Number(String),
}

/// Parses `N ms|s|m` into a [`Duration`].
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| DurationError::Unit(text.to_owned()))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| DurationError::Number(text.to_owned()))?;
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "s" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number.saturating_mul(60))),
        _ => Err(DurationError::Unit(text.to_owned())),
    }
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
    fn rejects_missing_or_unknown_units() {
        assert!(matches!(parse_duration("10"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration("10h"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration("s"), Err(DurationError::Number(_))));
        assert!(matches!(
            parse_duration("-1s"),
            Err(DurationError::Number(_))
        ));
    }
}
