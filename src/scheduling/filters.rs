//! Filters: narrow the candidates before scoring, in profile order.
//!
//! Two kinds: *soft* filters (saturation, fresh metrics, LoRA capacity) express preferences about load and
//! never remove every candidate — when all would go, all stay (a saturated pool still serves,
//! shedding and flow control decide about overload, not the filter). *Hard* filters (label
//! selectors: role, pool partitions) state where a request may go at all and may leave no
//! candidate (→ 503).

use super::SchedulingRequest;
use super::cycle::PodView;
use super::saturation::endpoint_saturation_with;
use super::scorers::lora_has_room;
use super::spec::{FilterKind, SaturationConfig};
use crate::endpoints::PodId;

/// What one filter did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FilterReport {
    /// The filter's instance name.
    pub filter: String,
    /// Endpoints it removed (as `ip:port`).
    pub removed: Vec<String>,
    /// True when it would have removed every candidate and so removed none.
    pub kept_all: bool,
}

/// Applies `filter` to `pods` in place; returns the removed endpoints and whether the filter
/// was overruled because it would have emptied the set.
pub fn apply(
    filter: &FilterKind,
    request: &SchedulingRequest,
    saturation: &SaturationConfig,
    pods: &mut Vec<PodView>,
) -> (Vec<PodId>, bool) {
    let (keep, soft): (Vec<bool>, bool) = match filter {
        FilterKind::Saturation {
            queue_threshold,
            kv_threshold,
        } => {
            let q = queue_threshold.unwrap_or(saturation.queue_depth_threshold);
            let kv = kv_threshold.unwrap_or(saturation.kv_cache_util_threshold);
            (
                pods.iter()
                    .map(|p| endpoint_saturation_with(q, kv, p) < 1.0)
                    .collect(),
                true,
            )
        }
        FilterKind::FreshMetrics => (
            pods.iter()
                .map(|p| p.fresh && p.metrics.is_some())
                .collect(),
            true,
        ),
        FilterKind::LoraCapacity => {
            let adapter = request.key_context().and_then(|c| c.lora_name.as_deref());
            let Some(adapter) = adapter else {
                return (Vec::new(), false);
            };
            (
                pods.iter()
                    .map(|p| {
                        p.metrics
                            .as_ref()
                            .and_then(|m| m.lora.as_ref())
                            .is_some_and(|l| {
                                l.running.iter().chain(&l.waiting).any(|a| a == adapter)
                                    || lora_has_room(l)
                            })
                    })
                    .collect(),
                true,
            )
        }
        FilterKind::LabelSelector { match_labels } => (
            pods.iter()
                .map(|p| {
                    match_labels
                        .iter()
                        .all(|(k, v)| p.endpoint.endpoint.labels.get(k) == Some(v))
                })
                .collect(),
            false,
        ),
        FilterKind::ByLabel {
            label,
            valid_values,
            allows_no_label,
        } => (
            pods.iter()
                .map(|p| match p.endpoint.endpoint.labels.get(label) {
                    Some(v) => valid_values.iter().any(|ok| ok == v),
                    None => *allows_no_label,
                })
                .collect(),
            false,
        ),
    };
    if soft && !keep.iter().any(|k| *k) {
        return (Vec::new(), !pods.is_empty());
    }
    let mut removed = Vec::new();
    let mut flags = keep.into_iter();
    pods.retain(|p| {
        let k = flags.next().unwrap_or(true);
        if !k {
            removed.push(p.id);
        }
        k
    });
    (removed, false)
}

#[cfg(test)]
mod tests {
    use super::super::cycle::test_support::*;
    use super::*;
    use crate::kvcache::{KeyContext, PromptKeys};
    use crate::scrape::PodMetrics;
    use crate::tokenize::PromptTokens;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn ids(pods: &[PodView]) -> Vec<usize> {
        pods.iter()
            .map(|p| {
                usize::from(
                    p.id.addr()
                        .ip()
                        .to_string()
                        .rsplit('.')
                        .next()
                        .and_then(|s| s.parse::<u8>().ok())
                        .unwrap_or(0),
                ) - 1
            })
            .collect()
    }

    #[test]
    fn fresh_metrics_removes_only_stale_and_unscraped_pods_unless_all() {
        let req = SchedulingRequest::default();
        let sat = SaturationConfig::default();
        let mut stale = view(2, Some(metrics(0.0, 0.0, 0.0)), 0);
        stale.fresh = false;
        let mut pods = vec![
            view(0, Some(metrics(50.0, 8.0, 0.99)), 0),
            view(1, None, 0),
            stale,
            view(3, Some(metrics(0.0, 0.0, 0.0)), 0),
        ];
        let (removed, kept_all) = apply(&FilterKind::FreshMetrics, &req, &sat, &mut pods);
        assert_eq!(
            ids(&pods),
            vec![0, 3],
            "a busy pod stays; stale and unscraped go"
        );
        assert_eq!(removed.len(), 2);
        assert!(!kept_all);
        let mut all_stale = vec![view(1, None, 0), view(2, None, 0)];
        let (removed, kept_all) = apply(&FilterKind::FreshMetrics, &req, &sat, &mut all_stale);
        assert!(removed.is_empty() && kept_all);
        assert_eq!(all_stale.len(), 2);
    }

    #[test]
    fn saturation_removes_full_stale_and_failing_unless_all() {
        let req = SchedulingRequest::default();
        let sat = SaturationConfig::default();
        let filter = FilterKind::Saturation {
            queue_threshold: None,
            kv_threshold: None,
        };
        let mut pods = vec![
            view(0, Some(metrics(1.0, 1.0, 0.3)), 0),
            view(1, Some(metrics(6.0, 1.0, 0.3)), 0),
            view(2, Some(metrics(0.0, 1.0, 0.9)), 0),
            view(3, None, 0),
        ];
        let mut stale = view(4, Some(metrics(0.0, 0.0, 0.0)), 0);
        stale.fresh = false;
        pods.push(stale);
        let (removed, kept_all) = apply(&filter, &req, &sat, &mut pods);
        assert_eq!(ids(&pods), vec![0]);
        assert_eq!(removed.len(), 4);
        assert!(!kept_all);

        let mut all_bad = vec![view(1, Some(metrics(9.0, 0.0, 0.0)), 0), view(2, None, 0)];
        let (removed, kept_all) = apply(&filter, &req, &sat, &mut all_bad);
        assert!(removed.is_empty() && kept_all);
        assert_eq!(all_bad.len(), 2, "never empties the candidates");

        let lenient = FilterKind::Saturation {
            queue_threshold: Some(10.0),
            kv_threshold: Some(0.95),
        };
        let mut pods = vec![view(1, Some(metrics(6.0, 1.0, 0.9)), 0)];
        apply(&lenient, &req, &sat, &mut pods);
        assert_eq!(
            pods.len(),
            1,
            "per-filter thresholds override the detector's"
        );
    }

    #[test]
    fn lora_capacity_keeps_pods_that_can_serve_the_adapter() {
        let mut req = SchedulingRequest::default();
        let sat = SaturationConfig::default();
        let with = |l| {
            Some(PodMetrics {
                lora: Some(l),
                ..metrics(0.0, 0.0, 0.0)
            })
        };
        let pods = || {
            vec![
                view(0, with(lora(&["a"], &[], 1)), 0),
                view(1, with(lora(&["b"], &[], 1)), 0),
                view(2, with(lora(&["b"], &[], 2)), 0),
                view(3, None, 0),
            ]
        };
        let mut p = pods();
        apply(&FilterKind::LoraCapacity, &req, &sat, &mut p);
        assert_eq!(p.len(), 4, "base-model requests are not filtered");
        req.prompt = Arc::new(PromptKeys::new(
            PromptTokens::Empty,
            Some(KeyContext {
                lora_name: Some("a".into()),
                ..KeyContext::model("m")
            }),
        ));
        let mut p = pods();
        let (removed, _) = apply(&FilterKind::LoraCapacity, &req, &sat, &mut p);
        assert_eq!(ids(&p), vec![0, 2]);
        assert_eq!(removed.len(), 2);
        req.prompt = Arc::new(PromptKeys::new(
            PromptTokens::Empty,
            Some(KeyContext {
                lora_name: Some("z".into()),
                ..KeyContext::model("m")
            }),
        ));
        let mut p = vec![view(1, with(lora(&["b"], &[], 1)), 0)];
        let (_, kept_all) = apply(&FilterKind::LoraCapacity, &req, &sat, &mut p);
        assert!(kept_all && p.len() == 1);
    }

    #[test]
    fn label_filters_are_hard() {
        let req = SchedulingRequest::default();
        let sat = SaturationConfig::default();
        let labelled = |i, role: Option<&str>| {
            let mut v = view(i, None, 0);
            v.endpoint = match role {
                Some(r) => endpoint_with(i, &[("role", r)]),
                None => endpoint(i),
            };
            v
        };
        let pods = || {
            vec![
                labelled(0, Some("decode")),
                labelled(1, Some("prefill")),
                labelled(2, None),
            ]
        };
        let selector = FilterKind::LabelSelector {
            match_labels: BTreeMap::from([("role".to_owned(), "decode".to_owned())]),
        };
        let mut p = pods();
        apply(&selector, &req, &sat, &mut p);
        assert_eq!(ids(&p), vec![0]);
        let by_label = FilterKind::ByLabel {
            label: "role".into(),
            valid_values: vec!["prefill".into()],
            allows_no_label: true,
        };
        let mut p = pods();
        apply(&by_label, &req, &sat, &mut p);
        assert_eq!(ids(&p), vec![1, 2]);
        let none = FilterKind::LabelSelector {
            match_labels: BTreeMap::from([("role".to_owned(), "other".to_owned())]),
        };
        let mut p = pods();
        let (removed, kept_all) = apply(&none, &req, &sat, &mut p);
        assert!(
            p.is_empty() && removed.len() == 3 && !kept_all,
            "hard filters may empty the set"
        );
    }
}
