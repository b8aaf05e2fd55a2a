//! Bounds on Prometheus label values that come from requests (the model names).
//!
//! A client chooses its `model` string, so a label taken from it is hostile input: eleven
//! 1 MB model names made `/metrics` 411 MB, and a million distinct names would be a million
//! series held forever. Each such value is cut to [`MAX_LABEL_BYTES`] (on a char boundary),
//! and only the first [`MAX_LABEL_VALUES`] distinct values get series of their own (llm-d's
//! cap); later ones are counted under [`OVERFLOW_LABEL`]. Both are counted in
//! `kvpick_metric_label_values_bounded_total`.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Mutex;

use prometheus::core::{MetricVec, MetricVecBuilder};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

/// Longest label value kept, in bytes.
pub const MAX_LABEL_BYTES: usize = 256;
/// Distinct request-derived values that get series of their own.
pub const MAX_LABEL_VALUES: usize = 1000;
/// The value every later distinct value is counted under.
pub const OVERFLOW_LABEL: &str = "other";

/// Admits at most `max_values` distinct values of at most `max_bytes` bytes each.
#[derive(Debug)]
pub struct LabelLimiter {
    max_bytes: usize,
    max_values: usize,
    seen: Mutex<HashSet<Box<str>>>,
    truncated: IntCounter,
    collapsed: IntCounter,
}

impl LabelLimiter {
    /// A limiter with llm-d's bounds, its counter registered in `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        Self::with_bounds(registry, MAX_LABEL_BYTES, MAX_LABEL_VALUES)
    }

    /// A limiter with explicit bounds.
    pub fn with_bounds(
        registry: &Registry,
        max_bytes: usize,
        max_values: usize,
    ) -> prometheus::Result<Self> {
        let counter = IntCounterVec::new(
            Opts::new(
                "kvpick_metric_label_values_bounded_total",
                "Request-derived label values cut to the length bound (truncated) or counted \
                 under `other` past the distinct-value bound (collapsed).",
            ),
            &["action"],
        )?;
        registry.register(Box::new(counter.clone()))?;
        Ok(Self {
            max_bytes,
            max_values,
            seen: Mutex::new(HashSet::new()),
            truncated: counter.with_label_values(&["truncated"]),
            collapsed: counter.with_label_values(&["collapsed"]),
        })
    }

    /// The label value to record for `value`.
    pub fn bound<'a>(&self, value: &'a str) -> Cow<'a, str> {
        let cut = truncate(value, self.max_bytes);
        if cut.len() < value.len() {
            self.truncated.inc();
        }
        // NOTE: a poisoned lock only means another thread panicked mid-insert; the set is
        // still a valid set, so keep using it rather than dropping every label.
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(cut) {
            return Cow::Borrowed(cut);
        }
        if seen.len() < self.max_values {
            seen.insert(cut.into());
            return Cow::Borrowed(cut);
        }
        drop(seen);
        if self.collapsed.get() == 0 {
            tracing::warn!(
                limit = self.max_values,
                "too many distinct model names for metric labels; counting the rest as `{OVERFLOW_LABEL}`"
            );
        }
        self.collapsed.inc();
        Cow::Borrowed(OVERFLOW_LABEL)
    }
}

/// The longest prefix of `value` of at most `max` bytes that ends on a char boundary.
pub fn truncate(value: &str, max: usize) -> &str {
    if value.len() <= max {
        return value;
    }
    let mut end = max;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

/// A metric vector whose first `bounded` labels are request-derived and pass a
/// [`LabelLimiter`]; the rest (fixed sets such as error codes) are used as given.
#[derive(Clone)]
pub struct BoundedVec<V> {
    inner: V,
    limiter: std::sync::Arc<LabelLimiter>,
    bounded: usize,
}

impl<V> std::fmt::Debug for BoundedVec<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedVec")
            .field("bounded", &self.bounded)
            .finish_non_exhaustive()
    }
}

impl<P: MetricVecBuilder> BoundedVec<MetricVec<P>> {
    /// Wraps `inner`, bounding its first `bounded` labels with `limiter`.
    pub fn new(limiter: std::sync::Arc<LabelLimiter>, bounded: usize, inner: MetricVec<P>) -> Self {
        Self {
            inner,
            limiter,
            bounded,
        }
    }

    /// The metric for `values` (request-derived ones bounded first).
    pub fn with_label_values(&self, values: &[&str]) -> P::M {
        let labels: Vec<Cow<'_, str>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i < self.bounded {
                    self.limiter.bound(v)
                } else {
                    Cow::Borrowed(*v)
                }
            })
            .collect();
        self.inner.with_label_values(&labels)
    }

    /// The wrapped vector (to register it).
    pub fn inner(&self) -> &MetricVec<P> {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_cut_on_a_char_boundary_and_extra_values_collapse() {
        let registry = Registry::new();
        let limiter = LabelLimiter::with_bounds(&registry, 5, 2).expect("limiter");
        assert_eq!(limiter.bound("ab"), "ab");
        assert_eq!(
            limiter.bound("abcd€"),
            "abcd",
            "€ is 3 bytes: cut before it"
        );
        assert_eq!(
            limiter.bound("c"),
            OVERFLOW_LABEL,
            "a third value collapses"
        );
        assert_eq!(limiter.bound("ab"), "ab", "seen values keep their series");
        assert_eq!(limiter.bound("abcd€€"), "abcd", "same cut, same series");
        assert_eq!(limiter.truncated.get(), 2);
        assert_eq!(limiter.collapsed.get(), 1);
    }
}
