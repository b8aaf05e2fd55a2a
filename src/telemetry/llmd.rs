//! llm-d's `llm_d_epp_*` metric names beside GIE's `inference_*` ones (DESIGN §9).
//!
//! llm-d-router renamed the EPP's metrics and still emits the old names beside the new, so a
//! team's dashboards and alerts use either. kvpick does the same at `/metrics`: each family
//! of [`ALIASES`] is emitted a second time under its llm-d name, with the same series,
//! labels and values (one source of truth, so the two can never disagree). Request-derived
//! labels (`model_name`, `target_model_name`) are therefore capped exactly as the original's
//! are (256 bytes, 1,000 distinct values: [`super::labels`]).
//!
//! NOTE: llm-d's request metrics also carry `fairness_id` and `priority` labels; kvpick's
//! carry the labels its `inference_*` series have, so `sum by (model_name)` style queries
//! work on both, while a query selecting on `priority` finds nothing.

use prometheus::proto::MetricFamily;

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

/// `families` plus a copy of each [`ALIASES`] family under its llm-d name.
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
    families.extend(copies);
    families
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{Encoder, IntCounterVec, Opts, Registry, TextEncoder};

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
