//! Bounds on Prometheus label values that come from requests (model names, fairness ids).
//!
//! A client chooses its `model` string and its `x-gateway-inference-fairness-id` header, so a
//! label taken from either is hostile input: eleven
//! 1 MB model names made `/metrics` 411 MB, and a million distinct names would be a million
//! series held forever. Each such value is cut to [`MAX_LABEL_BYTES`] (on a char boundary),
//! and only the first [`MAX_LABEL_VALUES`] distinct values get series of their own (llm-d's
//! cap, per label kind: model names and fairness ids each have their own); later ones are
//! counted under [`OVERFLOW_LABEL`]. Both are counted in
//! `kvpick_metric_label_values_bounded_total`.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// What the values are, for the log line (`model names`, `fairness ids`).
    kind: &'static str,
    max_bytes: usize,
    max_values: usize,
    seen: Mutex<HashSet<Box<str>>>,
    /// Whether the once-only "too many distinct values" line was logged.
    warned: AtomicBool,
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
            kind: "model names",
            max_bytes,
            max_values,
            seen: Mutex::new(HashSet::new()),
            warned: AtomicBool::new(false),
            truncated: counter.with_label_values(&["truncated"]),
            collapsed: counter.with_label_values(&["collapsed"]),
        })
    }

    /// A limiter for another kind of value (its own distinct-value set, at most `max_values`
    /// of them, the same length bound), counting into the same
    /// `kvpick_metric_label_values_bounded_total`.
    pub fn for_kind(&self, kind: &'static str, max_values: usize) -> Self {
        Self {
            kind,
            max_bytes: self.max_bytes,
            max_values,
            seen: Mutex::new(HashSet::new()),
            warned: AtomicBool::new(false),
            truncated: self.truncated.clone(),
            collapsed: self.collapsed.clone(),
        }
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
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                limit = self.max_values,
                "too many distinct {} for metric labels; counting the rest as `{OVERFLOW_LABEL}`",
                self.kind
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

/// A metric vector some of whose labels are request-derived, each passing its
/// [`LabelLimiter`]; the rest (fixed sets such as error codes) are used as given.
#[derive(Clone)]
pub struct BoundedVec<V> {
    inner: V,
    /// (label position, the limiter its values pass).
    bounds: Vec<(usize, std::sync::Arc<LabelLimiter>)>,
}

impl<V> std::fmt::Debug for BoundedVec<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let positions: Vec<usize> = self.bounds.iter().map(|(i, _)| *i).collect();
        f.debug_struct("BoundedVec")
            .field("bounded", &positions)
            .finish_non_exhaustive()
    }
}

impl<P: MetricVecBuilder> BoundedVec<MetricVec<P>> {
    /// Wraps `inner`, bounding its first `bounded` labels with `limiter`.
    pub fn new(limiter: std::sync::Arc<LabelLimiter>, bounded: usize, inner: MetricVec<P>) -> Self {
        Self {
            inner,
            bounds: (0..bounded)
                .map(|i| (i, std::sync::Arc::clone(&limiter)))
                .collect(),
        }
    }

    /// Also bounds the label at `position` with `limiter`.
    pub fn bounding(mut self, position: usize, limiter: std::sync::Arc<LabelLimiter>) -> Self {
        self.bounds.push((position, limiter));
        self
    }

    /// The metric for `values` (request-derived ones bounded first).
    pub fn with_label_values(&self, values: &[&str]) -> P::M {
        let labels: Vec<Cow<'_, str>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| match self.bounds.iter().find(|(at, _)| *at == i) {
                Some((_, limiter)) => limiter.bound(v),
                None => Cow::Borrowed(*v),
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

    #[test]
    fn another_kind_has_its_own_distinct_values_and_shares_the_counters() {
        let registry = Registry::new();
        let models = LabelLimiter::with_bounds(&registry, 5, 1).expect("limiter");
        let tenants = models.for_kind("fairness ids", 1);
        assert_eq!(models.bound("m"), "m");
        assert_eq!(
            tenants.bound("t"),
            "t",
            "a model name does not use a tenant's slot"
        );
        assert_eq!(tenants.bound("u"), OVERFLOW_LABEL);
        assert_eq!(models.bound("n"), OVERFLOW_LABEL);
        assert_eq!(models.collapsed.get(), 2, "one counter for both kinds");
        // A limit of 0 counts every value as `other` (llm-d's
        // `--fairness-id-metric-label-limit=0`).
        let none = models.for_kind("fairness ids", 0);
        assert_eq!(none.bound("t"), OVERFLOW_LABEL);
    }
}
