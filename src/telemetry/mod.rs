//! kvpick's own observability: Prometheus metrics (with bounded request-derived labels, and
//! llm-d's names beside GIE's: [`llmd`]) and gRPC health. The HTTP servers that expose them
//! (and the debug views) are in [`crate::admin`], above every layer they report on.

pub mod health;
pub mod labels;
pub mod llmd;
mod metrics;
mod stages;
mod ttft;

pub use metrics::{DEFAULT_FAIRNESS_ID, EppMetrics, RequestLabels};
pub use stages::{Stage, StageMetrics};
pub use ttft::TtftMetrics;

/// The (metric family, value of `label`) of every series in `registry` that carries `label`
/// (for tests that check which endpoints' series exist).
#[cfg(test)]
pub(crate) fn series_with_label(
    registry: &prometheus::Registry,
    label: &str,
) -> std::collections::BTreeSet<(String, String)> {
    let mut named = std::collections::BTreeSet::new();
    for family in registry.gather() {
        for metric in family.get_metric() {
            for pair in metric.get_label() {
                if pair.name() == label {
                    named.insert((family.name().to_owned(), pair.value().to_owned()));
                }
            }
        }
    }
    named
}
