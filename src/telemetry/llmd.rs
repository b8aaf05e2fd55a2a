//! llm-d's `llm_d_epp_*` metric names beside GIE's `inference_*` ones (DESIGN §9).
//!
//! llm-d-router renamed the EPP's metrics and still emits the old names beside the new, so a
//! team's dashboards and alerts use either. kvpick does the same at `/metrics`: each family
//! of [`ALIASES`] is emitted a second time under its llm-d name, with the same series,
//! labels and values (one source of truth, so the two can never disagree). Request-derived
//! labels (`model_name`, `target_model_name`) are therefore capped exactly as the original's
//! are (256 bytes, 1,000 distinct values: [`super::labels`]).
//!
//! The per-request families are recorded once with llm-d's labels (`model_name`,
//! `target_model_name`, `fairness_id`, `priority`); their GIE names show them summed over the
//! labels GIE does not have ([`GIE_FOLDED`]: GIE's request counter has `priority`, the rest
//! neither), so each name has exactly its upstream label set and the two always agree.

use std::collections::HashMap;

use prometheus::proto::{Metric, MetricFamily, MetricType};

/// (GIE-named family, labels its GIE name does not carry): the series with only those
/// labels different are summed into one at `/metrics` (llm-d-router `pkg/epp/metrics`).
pub const GIE_FOLDED: &[(&str, &[&str])] = &[
    ("inference_objective_request_total", &["fairness_id"]),
    (
        "inference_objective_request_error_total",
        &["fairness_id", "priority"],
    ),
    (
        "inference_objective_request_sizes",
        &["fairness_id", "priority"],
    ),
    (
        "inference_objective_input_tokens",
        &["fairness_id", "priority"],
    ),
    (
        "inference_objective_output_tokens",
        &["fairness_id", "priority"],
    ),
];

/// (name kvpick exports, llm-d name it is also exported as), from llm-d-router's
/// `pkg/epp/metrics` (each deprecated GIE metric names its replacement; the open-stream
/// gauge is llm-d's `extproc_streams_inflight`, same meaning, no labels).
pub const ALIASES: &[(&str, &str)] = &[
    (
        "inference_objective_request_total",
        "llm_d_epp_request_total",
    ),
    (
        "inference_objective_request_error_total",
        "llm_d_epp_request_error_total",
    ),
    (
        "inference_objective_request_sizes",
        "llm_d_epp_request_size_bytes",
    ),
    (
        "inference_objective_input_tokens",
        "llm_d_epp_request_input_tokens",
    ),
    (
        "inference_objective_output_tokens",
        "llm_d_epp_request_output_tokens",
    ),
    (
        "inference_pool_average_kv_cache_utilization",
        "llm_d_epp_average_kv_cache_utilization",
    ),
    (
        "inference_pool_average_queue_size",
        "llm_d_epp_average_queue_size",
    ),
    ("inference_pool_ready_pods", "llm_d_epp_ready_endpoints"),
    (
        "inference_extension_scheduler_e2e_duration_seconds",
        "llm_d_epp_scheduler_e2e_duration_seconds",
    ),
    (
        "inference_extension_plugin_duration_seconds",
        "llm_d_epp_plugin_duration_seconds",
    ),
    (
        "inference_extension_flow_control_queue_size",
        "llm_d_epp_flow_control_queue_size",
    ),
    (
        "inference_extension_flow_control_request_queue_duration_seconds",
        "llm_d_epp_flow_control_request_queue_duration_seconds",
    ),
    (
        "kvpick_extproc_open_streams",
        "llm_d_epp_extproc_streams_inflight",
    ),
];

/// `families` plus a copy of each [`ALIASES`] family under its llm-d name, with the GIE
/// names' extra labels folded away ([`GIE_FOLDED`]).
pub fn with_llmd_names(mut families: Vec<MetricFamily>) -> Vec<MetricFamily> {
    let copies: Vec<MetricFamily> = families
        .iter()
        .filter_map(|family| {
            let (_, alias) = ALIASES.iter().find(|(gie, _)| *gie == family.name())?;
            let mut copy = family.clone();
            copy.set_name((*alias).to_owned());
            Some(copy)
        })
        .collect();
    for family in &mut families {
        if let Some((_, labels)) = GIE_FOLDED.iter().find(|(gie, _)| *gie == family.name()) {
            fold(family, labels);
        }
    }
    families.extend(copies);
    families
}

/// Drops `labels` from `family`'s series, summing the series that then coincide (counters'
/// values; histograms' counts, sums and buckets, which share their bounds within a family).
fn fold(family: &mut MetricFamily, labels: &[&str]) {
    let kind = family.get_field_type();
    let mut merged: Vec<Metric> = Vec::new();
    let mut at: HashMap<Vec<(String, String)>, usize> = HashMap::new();
    for mut metric in family.take_metric() {
        let kept: Vec<_> = metric
            .take_label()
            .into_iter()
            .filter(|pair| !labels.contains(&pair.name()))
            .collect();
        let key = kept
            .iter()
            .map(|pair| (pair.name().to_owned(), pair.value().to_owned()))
            .collect();
        metric.set_label(kept);
        match at.get(&key) {
            Some(&i) => add(kind, &mut merged[i], &metric),
            None => {
                at.insert(key, merged.len());
                merged.push(metric);
            }
        }
    }
    family.set_metric(merged);
}

/// Adds `from`'s counter or histogram (by the family's type) into `into`'s.
fn add(kind: MetricType, into: &mut Metric, from: &Metric) {
    match kind {
        MetricType::COUNTER => {
            let mut sum = into.get_counter().clone();
            sum.set_value(sum.get_value() + from.get_counter().get_value());
            into.set_counter(sum);
        }
        MetricType::HISTOGRAM => {
            let mut sum = into.get_histogram().clone();
            let more = from.get_histogram();
            sum.set_sample_count(sum.get_sample_count() + more.get_sample_count());
            sum.set_sample_sum(sum.get_sample_sum() + more.get_sample_sum());
            let buckets = sum
                .get_bucket()
                .iter()
                .zip(more.get_bucket())
                .map(|(bucket, other)| {
                    let mut bucket = bucket.clone();
                    bucket
                        .set_cumulative_count(bucket.cumulative_count() + other.cumulative_count());
                    bucket
                })
                .collect();
            sum.set_bucket(buckets);
            into.set_histogram(sum);
        }
        // NOTE: only counters and histograms are folded (GIE_FOLDED); a gauge or summary
        // there would keep its first series rather than be summed wrongly.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{
        Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
    };

    fn text_of(registry: &Registry) -> String {
        let mut text = Vec::new();
        TextEncoder::new()
            .encode(&with_llmd_names(registry.gather()), &mut text)
            .expect("encode");
        String::from_utf8(text).expect("utf8")
    }

    #[test]
    fn gie_names_sum_over_the_labels_gie_lacks_and_llmd_names_keep_them() {
        let registry = Registry::new();
        let labels = ["model_name", "target_model_name", "fairness_id", "priority"];
        let requests = IntCounterVec::new(
            Opts::new("inference_objective_request_total", "Requests."),
            &labels,
        )
        .expect("vec");
        let sizes = HistogramVec::new(
            HistogramOpts::new("inference_objective_request_sizes", "Sizes.").buckets(vec![10.0]),
            &labels,
        )
        .expect("vec");
        registry
            .register(Box::new(requests.clone()))
            .expect("register");
        registry
            .register(Box::new(sizes.clone()))
            .expect("register");
        for (tenant, priority, n, size) in
            [("a", "0", 2, 5.0), ("b", "0", 3, 20.0), ("a", "1", 4, 5.0)]
        {
            requests
                .with_label_values(&["m", "m", tenant, priority])
                .inc_by(n);
            sizes
                .with_label_values(&["m", "m", tenant, priority])
                .observe(size);
        }
        let text = text_of(&registry);
        let line = |prefix: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.starts_with(prefix))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(
            line("inference_objective_request_total{"),
            [
                "inference_objective_request_total{model_name=\"m\",priority=\"0\",target_model_name=\"m\"} 5",
                "inference_objective_request_total{model_name=\"m\",priority=\"1\",target_model_name=\"m\"} 4",
            ],
            "{text}"
        );
        assert_eq!(
            line("inference_objective_request_sizes_bucket{"),
            [
                "inference_objective_request_sizes_bucket{model_name=\"m\",target_model_name=\"m\",le=\"10\"} 2",
                "inference_objective_request_sizes_bucket{model_name=\"m\",target_model_name=\"m\",le=\"+Inf\"} 3",
            ],
            "{text}"
        );
        assert_eq!(
            line("inference_objective_request_sizes_sum{"),
            ["inference_objective_request_sizes_sum{model_name=\"m\",target_model_name=\"m\"} 30"]
        );
        assert_eq!(line("llm_d_epp_request_total{").len(), 3, "{text}");
        assert!(
            text.contains(
                "llm_d_epp_request_total{fairness_id=\"b\",model_name=\"m\",priority=\"0\",target_model_name=\"m\"} 3"
            ),
            "{text}"
        );
        assert_eq!(
            line("llm_d_epp_request_size_bytes_count{").len(),
            3,
            "{text}"
        );
    }

    #[test]
    fn an_aliased_family_is_emitted_twice_with_the_same_series_and_others_once() {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("inference_objective_request_total", "Requests."),
            &["model_name", "target_model_name"],
        )
        .expect("vec");
        let other = IntCounterVec::new(Opts::new("kvpick_x_total", "X."), &["pod"]).expect("vec");
        registry
            .register(Box::new(requests.clone()))
            .expect("register");
        registry
            .register(Box::new(other.clone()))
            .expect("register");
        requests.with_label_values(&["m", "t"]).inc_by(3);
        other.with_label_values(&["p"]).inc();
        let mut text = Vec::new();
        TextEncoder::new()
            .encode(&with_llmd_names(registry.gather()), &mut text)
            .expect("encode");
        let text = String::from_utf8(text).expect("utf8");
        assert!(
            text.contains(
                "inference_objective_request_total{model_name=\"m\",target_model_name=\"t\"} 3"
            ),
            "{text}"
        );
        assert!(
            text.contains("llm_d_epp_request_total{model_name=\"m\",target_model_name=\"t\"} 3"),
            "{text}"
        );
        assert_eq!(
            text.matches("kvpick_x_total{pod=\"p\"} 1").count(),
            1,
            "{text}"
        );
    }
}
