//! A tolerant parser for the Prometheus text exposition format (what model servers serve at
//! `/metrics`).
//!
//! Scraped text is hostile input: a bad line is skipped and counted, never fatal, so one odd
//! series (or a body cut off mid-line) cannot blind kvpick to the rest. Handles comments,
//! label values with escapes, `NaN`/`±Inf`, optional timestamps, and histogram/summary
//! series (as plain samples).

use std::borrow::Cow;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name (`vllm:num_requests_waiting`, `…_bucket`, …).
    pub name: &'a str,
    /// Labels in line order; values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value.
    pub value: f64,
    /// Optional timestamp, milliseconds since the epoch.
    pub timestamp_ms: Option<i64>,
}

impl Sample<'_> {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Why a line was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// The metric name is missing or has characters outside `[a-zA-Z0-9_:]`.
    #[error("bad metric name")]
    Name,
    /// The label set is malformed or unterminated.
    #[error("bad label set")]
    Labels,
    /// The value is not a float.
    #[error("bad value")]
    Value,
    /// The timestamp is not an integer.
    #[error("bad timestamp")]
    Timestamp,
    /// Text after the timestamp.
    #[error("trailing text")]
    Trailing,
}

/// A parsed exposition: the samples that parsed and how many lines did not.
#[derive(Debug, Default)]
pub struct Exposition<'a> {
    /// Samples in text order.
    pub samples: Vec<Sample<'a>>,
    /// Lines skipped as malformed.
    pub bad_lines: usize,
    /// The first malformed line (1-based) and why, for the log.
    pub first_error: Option<(usize, LineError)>,
}

/// Parses exposition text.
pub fn parse(text: &str) -> Exposition<'_> {
    parse_lines(text, |_| true)
}

/// Parses the samples of the metrics named in `wanted` (names of metric characters only:
/// no `{`, no whitespace); every other line is skipped unread (not parsed, so not counted as
/// bad either).
///
/// NOTE: a vLLM engine exposes ~500 samples (histogram buckets for the most part) of which
/// scheduling reads a handful, 20 times a second per pod. A line is matched against each
/// wanted name by the byte after where that name would end (`{` or a blank) before any
/// comparison, so an unwanted line costs a few byte loads per name instead of finding where
/// its name ends (`cargo bench --bench scrape`).
pub fn parse_wanted<'a>(text: &'a str, wanted: &[&str]) -> Exposition<'a> {
    parse_lines(text, |line| names_one_of(line, wanted))
}

/// Whether `line`'s metric name (up to its first `{` or blank) is one of `names`.
fn names_one_of(line: &str, names: &[&str]) -> bool {
    let line = line.as_bytes();
    names.iter().any(|name| {
        let name = name.as_bytes();
        match line.get(name.len()) {
            Some(&after) => {
                (after == b'{' || after.is_ascii_whitespace()) && &line[..name.len()] == name
            }
            None => line == name,
        }
    })
}

fn parse_lines<'a>(text: &'a str, wanted: impl Fn(&str) -> bool) -> Exposition<'a> {
    let mut exposition = Exposition::default();
    for (index, line) in lines(text).enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || !wanted(line) {
            continue;
        }
        match parse_line(line) {
            Ok(sample) => exposition.samples.push(sample),
            Err(error) => {
                exposition.bad_lines += 1;
                exposition.first_error.get_or_insert((index + 1, error));
            }
        }
    }
    exposition
}

/// `text`'s lines exactly as [`str::lines`] cuts them (at `\n`, a `\r` before it dropped, no
/// empty line after a final `\n`), found by `memchr` (what `str::lines` does per character is
/// a third of a scrape's parse).
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        // `\n` is ASCII, so cutting there (and before a `\r`) keeps UTF-8 boundaries.
        let line = match memchr::memchr(b'\n', rest.as_bytes()) {
            Some(end) => {
                let line = &rest[..end];
                rest = &rest[end + 1..];
                line.strip_suffix('\r').unwrap_or(line)
            }
            None => std::mem::take(&mut rest),
        };
        Some(line)
    })
}

fn is_name_char(c: u8, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':' || (!first && c.is_ascii_digit())
}

fn parse_line(line: &str) -> Result<Sample<'_>, LineError> {
    let bytes = line.as_bytes();
    let name_end = bytes
        .iter()
        .enumerate()
        .find(|&(i, &c)| !is_name_char(c, i == 0))
        .map(|(i, _)| i)
        .unwrap_or(bytes.len());
    if name_end == 0 {
        return Err(LineError::Name);
    }
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = parse_labels(after_brace, &mut labels)?;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next().ok_or(LineError::Value)?)?;
    let timestamp_ms = match fields.next() {
        Some(ts) => Some(ts.parse::<i64>().map_err(|_| LineError::Timestamp)?),
        None => None,
    };
    if fields.next().is_some() {
        return Err(LineError::Trailing);
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp_ms,
    })
}

/// Parses `k="v",…}` and returns the text after the closing brace.
fn parse_labels<'a>(
    mut text: &'a str,
    labels: &mut Vec<(&'a str, Cow<'a, str>)>,
) -> Result<&'a str, LineError> {
    loop {
        text = text.trim_start();
        if let Some(after) = text.strip_prefix('}') {
            return Ok(after);
        }
        let eq = text.find('=').ok_or(LineError::Labels)?;
        let key = text[..eq].trim();
        if key.is_empty()
            || !key
                .bytes()
                .enumerate()
                .all(|(i, c)| is_name_char(c, i == 0))
        {
            return Err(LineError::Labels);
        }
        let after_eq = text[eq + 1..].trim_start();
        let quoted = after_eq.strip_prefix('"').ok_or(LineError::Labels)?;
        let (value, after_value) = parse_quoted(quoted)?;
        labels.push((key, value));
        text = after_value.trim_start();
        if let Some(after_comma) = text.strip_prefix(',') {
            text = after_comma;
        } else if !text.starts_with('}') {
            return Err(LineError::Labels);
        }
    }
}

/// Reads a label value up to its closing quote, unescaping `\\`, `\"` and `\n`.
fn parse_quoted(text: &str) -> Result<(Cow<'_, str>, &str), LineError> {
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut owned: Option<String> = None;
    let mut plain_start = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let value = match owned {
                    Some(mut s) => {
                        s.push_str(&text[plain_start..i]);
                        Cow::Owned(s)
                    }
                    None => Cow::Borrowed(&text[..i]),
                };
                return Ok((value, &text[i + 1..]));
            }
            b'\\' => {
                let s = owned.get_or_insert_with(String::new);
                s.push_str(&text[plain_start..i]);
                match bytes.get(i + 1) {
                    Some(b'n') => s.push('\n'),
                    Some(b'\\') => s.push('\\'),
                    Some(b'"') => s.push('"'),
                    _ => return Err(LineError::Labels),
                }
                i += 2;
                plain_start = i;
            }
            _ => i += 1,
        }
    }
    Err(LineError::Labels)
}

fn parse_value(text: &str) -> Result<f64, LineError> {
    match text {
        "NaN" => Ok(f64::NAN),
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        _ => text.parse::<f64>().map_err(|_| LineError::Value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_labels_and_specials() {
        let text = "# HELP x help\n# TYPE x gauge\nx 1\ny{a=\"1\",b=\"two words\",} 2.5 1700000000000\n\
                    z{esc=\"q\\\"uote\\\\back\\nline\"} NaN\nh_bucket{le=\"+Inf\"} +Inf\nneg -Inf\n\n";
        let exp = parse(text);
        assert_eq!(exp.bad_lines, 0);
        assert_eq!(exp.samples.len(), 5);
        assert_eq!(exp.samples[0].name, "x");
        assert_eq!(exp.samples[0].value, 1.0);
        assert_eq!(exp.samples[1].label("b"), Some("two words"));
        assert_eq!(exp.samples[1].timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(exp.samples[2].label("esc"), Some("q\"uote\\back\nline"));
        assert!(exp.samples[2].value.is_nan());
        assert_eq!(exp.samples[3].value, f64::INFINITY);
        assert_eq!(exp.samples[4].value, f64::NEG_INFINITY);
    }

    #[test]
    fn bad_lines_are_skipped_and_counted() {
        let text = "ok 1\n9bad 1\nlabels{a=1} 2\nunterminated{a=\"x 3\nnovalue\nval x\nts 1 notanint\nextra 1 2 3\nok2 2";
        let exp = parse(text);
        assert_eq!(exp.samples.len(), 2);
        assert_eq!(exp.bad_lines, 7);
        assert_eq!(exp.first_error, Some((2, LineError::Name)));
    }

    #[test]
    fn only_wanted_lines_are_read_and_only_they_can_be_bad() {
        let text =
            "ok 1\n9bad 1\nwanted{a=\"x\"} 2\nwanted{a=1} 3\nskipped{a=\"y\"} 4\nwanted_too 5";
        let exp = parse_wanted(text, &["wanted", "wanted_too"]);
        let read: Vec<_> = exp.samples.iter().map(|s| (s.name, s.value)).collect();
        assert_eq!(read, [("wanted", 2.0), ("wanted_too", 5.0)]);
        assert_eq!(
            exp.bad_lines, 1,
            "the bad `wanted` line; the unwanted bad one is unread"
        );
        assert_eq!(exp.first_error, Some((4, LineError::Labels)));
    }

    #[test]
    fn a_wanted_name_matches_whole_names_only() {
        let text = "wanted_total 1\nwante 2\n  wanted\t3\nwanted\nwanted{} 4\r\nwanted:x 5\n";
        let exp = parse_wanted(text, &["wanted"]);
        let read: Vec<_> = exp.samples.iter().map(|s| (s.name, s.value)).collect();
        assert_eq!(read, [("wanted", 3.0), ("wanted", 4.0)]);
        assert_eq!(exp.first_error, Some((4, LineError::Value)), "a name alone");
        assert_eq!(exp.bad_lines, 1);
    }

    /// The filter as it was written first: find where the name ends, then look it up.
    fn parse_wanted_by_name_end<'a>(text: &'a str, wanted: &[&str]) -> Exposition<'a> {
        parse_lines(text, |line| {
            let end = line
                .bytes()
                .position(|c| c == b'{' || c.is_ascii_whitespace())
                .unwrap_or(line.len());
            wanted.contains(&&line[..end])
        })
    }

    proptest::proptest! {
        #[test]
        fn lines_are_cut_as_str_lines_cuts_them(text in "[a\\r\\n ]{0,12}") {
            proptest::prop_assert_eq!(lines(&text).collect::<Vec<_>>(), text.lines().collect::<Vec<_>>());
        }

        #[test]
        fn matching_by_the_byte_after_a_name_reads_what_finding_the_name_end_reads(
            lines in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["", " ", "#", "\t"]),
                    proptest::sample::select(vec!["a", "ab", "a:b", "abc", "b", "9", "a-b", ""]),
                    proptest::sample::select(vec!["", " ", "\t", "{", "{x=\"1\"}", "{x=1}", "_", "b"]),
                    proptest::sample::select(vec!["", " 1", " NaN", " x", "1", " 1 2", " 1 2 3", "\r"]),
                ),
                0..24,
            )
        ) {
            let text: String = lines
                .iter()
                .map(|(lead, name, after, value)| format!("{lead}{name}{after}{value}\n"))
                .collect();
            let wanted = ["a", "ab", "a:b"];
            let fast = parse_wanted(&text, &wanted);
            let reference = parse_wanted_by_name_end(&text, &wanted);
            // (Debug text: NaN values are equal there.)
            proptest::prop_assert_eq!(format!("{:?}", fast.samples), format!("{:?}", reference.samples));
            proptest::prop_assert_eq!(fast.bad_lines, reference.bad_lines);
            proptest::prop_assert_eq!(fast.first_error, reference.first_error);
        }
    }

    #[test]
    fn a_body_cut_mid_line_keeps_the_complete_lines() {
        let text = "a 1\nb{x=\"1\"} 2\nc{x=\"";
        let exp = parse(text);
        assert_eq!(exp.samples.len(), 2);
        assert_eq!(exp.bad_lines, 1);
    }

    #[test]
    fn parses_every_line_of_real_vllm_metrics() {
        for file in ["metrics-idle.txt", "metrics-load.txt", "metrics-final.txt"] {
            let path = crate::test_paths::fixtures()
                .join("vllm-0.32-kv-events")
                .join(file);
            let text = std::fs::read_to_string(path).expect("fixture");
            let exp = parse(&text);
            assert_eq!(exp.bad_lines, 0, "{file}: {:?}", exp.first_error);
            let samples = text
                .lines()
                .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
                .count();
            assert_eq!(exp.samples.len(), samples, "{file}");
        }
    }
}
