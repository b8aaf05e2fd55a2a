//! EndpointPickerConfig parsing: GIE-style example configs round-trip and validate into the
//! expected typed profile; bad configs fail with errors naming the field.

use std::collections::BTreeMap;
use std::time::Duration;

use kvpick::config::picker_config::{
    EndpointPickerConfig, GIE_DEFAULT_YAML, KVPICK_RECOMMENDED_YAML, PickerConfigError, load,
};
use kvpick::scheduling::{
    FilterKind, PickerSpec, PlacementParams, PrefixMode, ProfileHandlerSpec, SchedulerConfig,
    ScorerSpec,
};

/// GIE-style configs as users write them (GIE docs/llm-d guides shapes).
const EXAMPLES: &[&str] = &[
    GIE_DEFAULT_YAML,
    KVPICK_RECOMMENDED_YAML,
    include_str!("../../deploy/config/gie-default.yaml"),
    // GIE prefix-aware with explicit parameters and a named plugin.
    "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: single-profile-handler
- name: prefix
  type: prefix-cache-scorer
  parameters:
    blockSize: 5
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: max-score-picker
  parameters:
    maxNumOfEndpoints: 3
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: lora-affinity-scorer
  - pluginRef: max-score-picker
",
    // llm-d style: label filter, session affinity, no-hit LRU, weighted random.
    "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: by-label
  name: decode-filter
  parameters:
    label: llm-d.ai/role
    validValues: [decode, both]
    allowsNoLabel: true
- type: by-label-selector
  parameters:
    matchLabels:
      inference.networking.k8s.io/engine-type: vllm
- type: session-affinity-scorer
  parameters: {maxSessions: 1000}
- type: no-hit-lru-scorer
- type: active-request-scorer
- type: precise-prefix-cache-scorer
- type: weighted-random-picker
featureGates: [flowControl, somethingNew]
saturationDetector:
  queueDepthThreshold: 8
  kvCacheUtilThreshold: 0.9
  metricsStalenessThreshold: 500ms
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: by-label-selector
  - pluginRef: session-affinity-scorer
    weight: 10
  - pluginRef: no-hit-lru-scorer
    weight: 0.5
  - pluginRef: active-request-scorer
  - pluginRef: precise-prefix-cache-scorer
    weight: 2
  - pluginRef: weighted-random-picker
",
];

#[test]
fn examples_round_trip_and_validate() {
    for (n, text) in EXAMPLES.iter().enumerate() {
        let parsed =
            EndpointPickerConfig::from_yaml(text).unwrap_or_else(|e| panic!("example {n}: {e}"));
        let validated = parsed
            .validate()
            .unwrap_or_else(|e| panic!("example {n}: {e}"));
        let yaml = parsed.to_yaml().expect("serialize");
        let again = EndpointPickerConfig::from_yaml(&yaml).expect("reparse");
        assert_eq!(again, parsed, "example {n} round-trips:\n{yaml}");
        assert_eq!(
            again.validate().expect("revalidate"),
            validated,
            "example {n}"
        );
    }
}

#[test]
fn examples_resolve_to_typed_profiles() {
    let named = load(Some(EXAMPLES[3])).expect("gie named");
    let s = &named.scheduler;
    assert_eq!(s.scorers.len(), 4);
    assert_eq!(s.scorers[0].name, "prefix");
    assert_eq!(s.scorers[0].weight, 3.0);
    let ScorerSpec::PrefixCache(p) = &s.scorers[0].scorer else {
        panic!("prefix scorer: {:?}", s.scorers[0]);
    };
    assert_eq!(
        (
            p.approx_chunk_chars,
            p.approx_max_chunks,
            p.approx_capacity_per_endpoint
        ),
        (5, 256, 31250)
    );
    assert_eq!(s.scorers[3].scorer, ScorerSpec::LoraAffinity);
    assert_eq!(s.scorers[3].weight, 1.0, "GIE's default weight");
    assert_eq!(
        s.picker,
        PickerSpec::MaxScore {
            max_endpoints: Some(3)
        }
    );
    assert!(!s.flow_control);

    let llmd = load(Some(EXAMPLES[4])).expect("llm-d style");
    let s = &llmd.scheduler;
    assert_eq!(s.profile_name, "decode");
    assert_eq!(
        s.filters[0].filter,
        FilterKind::ByLabel {
            label: "llm-d.ai/role".into(),
            valid_values: vec!["decode".into(), "both".into()],
            allows_no_label: true
        }
    );
    assert_eq!(
        s.filters[1].filter,
        FilterKind::LabelSelector {
            match_labels: BTreeMap::from([(
                "inference.networking.k8s.io/engine-type".to_owned(),
                "vllm".to_owned()
            )])
        }
    );
    let kinds: Vec<_> = s
        .scorers
        .iter()
        .map(|w| (w.scorer.clone(), w.weight))
        .collect();
    assert_eq!(
        kinds[0],
        (ScorerSpec::SessionAffinity { max_sessions: 1000 }, 10.0)
    );
    assert_eq!(
        kinds[1],
        (
            ScorerSpec::NoHitLru {
                max_endpoints: 4096
            },
            0.5
        )
    );
    assert_eq!(kinds[2], (ScorerSpec::InFlight, 1.0));
    assert!(matches!(&kinds[3].0, ScorerSpec::PrefixCache(p) if p.mode == PrefixMode::Precise));
    assert_eq!(
        s.picker,
        PickerSpec::WeightedRandom {
            max_endpoints: None
        }
    );
    assert!(s.flow_control);
    assert_eq!(s.saturation.queue_depth_threshold, 8.0);
    assert_eq!(s.saturation.kv_cache_util_threshold, 0.9);
    assert_eq!(s.saturation.metrics_staleness, Duration::from_millis(500));
    assert!(
        llmd.warnings.iter().any(|w| w.contains("featureGates[1]")),
        "{:?}",
        llmd.warnings
    );
}

#[test]
fn recommended_profile_is_the_placement_scorer_without_flow_control() {
    let rec = SchedulerConfig::kvpick_recommended();
    assert_eq!(rec.scorers.len(), 1);
    assert_eq!(
        rec.scorers[0].scorer,
        ScorerSpec::Placement(PlacementParams::default())
    );
    // Only hung or failing pods are filtered out: no load threshold removes a busy holder.
    assert_eq!(rec.filters.len(), 1);
    assert_eq!(rec.filters[0].filter, FilterKind::FreshMetrics);
    assert!(
        !rec.flow_control,
        "the engines queue; nothing fails in kvpick"
    );
    // Only a placement scorer with a home bias reads prefix homes (the index keeps them then).
    assert!(rec.reads_prefix_homes());
    assert!(!SchedulerConfig::gie_default().reads_prefix_homes());
    let mut no_homes = rec.clone();
    no_homes.scorers[0].scorer = ScorerSpec::Placement(PlacementParams {
        home_bias: 1.0,
        ..PlacementParams::default()
    });
    assert!(!no_homes.reads_prefix_homes());
}

#[test]
fn placement_parameters_are_read_and_checked() {
    let text = format!(
        "{HEAD}plugins:\n- type: kv-placement-scorer\n  parameters: {{holdBias: 2.0, displacementWeight: 0.5, priorPrefillMsPerToken: 0.3, defaultBlockSize: 32, decodeWeight: 0.5, coldDecodeWeight: 2.0, homeBias: 1.5, holdupWeight: 0.5}}\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: kv-placement-scorer\n"
    );
    let parsed = load(Some(&text)).expect("placement config");
    assert_eq!(
        parsed.scheduler.scorers[0].scorer,
        ScorerSpec::Placement(PlacementParams {
            hold_bias: 2.0,
            displacement_weight: 0.5,
            prior_ms_per_token: 0.3,
            default_block_size: 32,
            decode_weight: 0.5,
            cold_decode_weight: 2.0,
            home_bias: 1.5,
            holdup_weight: 0.5,
        })
    );
    let below_one = text.replace("holdBias: 2.0", "holdBias: 0.5");
    let e = error_of(&below_one);
    assert!(
        e.contains("plugins[0].parameters") && e.contains("holdBias"),
        "{e}"
    );
    let home_below_one = text.replace("homeBias: 1.5", "homeBias: 0.9");
    let e = error_of(&home_below_one);
    assert!(e.contains("homeBias must be ≥ 1"), "{e}");
    let negative_holdup = text.replace("holdupWeight: 0.5", "holdupWeight: -1");
    let e = error_of(&negative_holdup);
    assert!(e.contains("holdupWeight"), "{e}");
    let typo = text.replace("holdBias", "holdBais");
    let e = error_of(&typo);
    assert!(e.contains("holdBais"), "{e}");
}

fn error_of(text: &str) -> String {
    match load(Some(text)) {
        Ok(v) => panic!("accepted: {v:?}"),
        Err(e) => e.to_string(),
    }
}

const HEAD: &str =
    "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n";

#[test]
fn errors_name_the_bad_field() {
    let unknown_type = format!(
        "{HEAD}plugins:\n- type: queue-scorer\n- type: magic-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\n"
    );
    let e = error_of(&unknown_type);
    assert!(
        e.contains("plugins[1].type") && e.contains("magic-scorer"),
        "{e}"
    );

    let dangling = format!(
        "{HEAD}plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: prefix\n"
    );
    let e = error_of(&dangling);
    assert!(
        e.contains("schedulingProfiles[0].plugins[1].pluginRef") && e.contains("`prefix`"),
        "{e}"
    );

    let typo_param = format!(
        "{HEAD}plugins:\n- type: max-score-picker\n  parameters: {{maxNumOfEndpoint: 2}}\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: max-score-picker\n"
    );
    let e = error_of(&typo_param);
    assert!(
        e.contains("plugins[0].parameters") && e.contains("maxNumOfEndpoint"),
        "{e}"
    );

    // A parameter of the wrong type is named by its full path.
    let wrong_type = format!(
        "{HEAD}plugins:\n- type: queue-scorer\n- name: p\n  type: prefix-cache-scorer\n  parameters: {{blockSize: sixteen}}\nschedulingProfiles:\n- name: d\n"
    );
    let e = error_of(&wrong_type);
    assert!(
        e.contains("plugins[1].parameters.blockSize:") && e.contains("invalid type"),
        "{e}"
    );

    let top_typo = format!("{HEAD}plugin: []\n");
    let e = error_of(&top_typo);
    assert!(e.contains("unknown field `plugin`"), "{e}");

    let ref_typo = format!(
        "{HEAD}plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginref: queue-scorer\n"
    );
    assert!(error_of(&ref_typo).contains("pluginref"));

    let weight = format!(
        "{HEAD}plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\n    weight: -1\n"
    );
    assert!(error_of(&weight).contains("schedulingProfiles[0].plugins[0].weight"));

    let dup = format!(
        "{HEAD}plugins:\n- type: queue-scorer\n- type: kv-cache-utilization-scorer\n  name: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins: []\n"
    );
    assert!(error_of(&dup).contains("plugins[1].name"));

    let two_pickers = format!(
        "{HEAD}plugins:\n- type: max-score-picker\n- type: random-picker\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: max-score-picker\n  - pluginRef: random-picker\n"
    );
    assert!(error_of(&two_pickers).contains("schedulingProfiles[0].plugins[1].pluginRef"));

    let two_profiles = format!("{HEAD}plugins: []\nschedulingProfiles:\n- name: a\n- name: b\n");
    assert!(error_of(&two_profiles).contains("schedulingProfiles"));

    let stale = format!(
        "{HEAD}plugins: []\nschedulingProfiles:\n- name: a\nsaturationDetector:\n  metricsStalenessThreshold: soon\n"
    );
    assert!(error_of(&stale).contains("saturationDetector.metricsStalenessThreshold"));

    let kind = "apiVersion: v1\nkind: ConfigMap\n";
    assert!(matches!(load(Some(kind)), Err(PickerConfigError::Kind(k)) if k == "ConfigMap"));

    let bad_cost = format!(
        "{HEAD}plugins:\n- type: ttft-cost-scorer\n  parameters: {{prefillMsPerToken: -2}}\nschedulingProfiles:\n- name: a\n"
    );
    assert!(error_of(&bad_cost).contains("prefillMsPerToken"));
}

#[test]
fn profile_without_picker_gets_max_score_and_sections_kvpick_ignores_warn() {
    let text = format!(
        "{HEAD}plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\ndataLayer:\n  sources: []\n"
    );
    let v = load(Some(&text)).expect("valid");
    assert_eq!(
        v.scheduler.picker,
        PickerSpec::MaxScore {
            max_endpoints: None
        }
    );
    assert!(
        v.warnings.iter().any(|w| w.starts_with("dataLayer")),
        "{:?}",
        v.warnings
    );
}

const PD_YAML: &str = include_str!("../../deploy/config/pd-disaggregation.yaml");

fn role(roles: &[&str], allows_no_label: bool) -> FilterKind {
    FilterKind::ByLabel {
        label: "llm-d.ai/role".into(),
        valid_values: roles.iter().map(|r| (*r).to_owned()).collect(),
        allows_no_label,
    }
}

#[test]
fn pd_profile_handler_resolves_decode_and_prefill_profiles() {
    let config = EndpointPickerConfig::from_yaml(PD_YAML).expect("yaml");
    let again = EndpointPickerConfig::from_yaml(&config.to_yaml().expect("to yaml")).expect("rt");
    assert_eq!(config, again, "round trip");
    let v = load(Some(PD_YAML)).expect("valid P/D config");
    assert!(v.warnings.is_empty(), "{:?}", v.warnings);
    let decode = &v.scheduler;
    assert_eq!(
        decode.profile_name, "decode",
        "decode picks the destination"
    );
    assert_eq!(
        decode.filters[0].filter,
        role(
            &["decode", "prefill-decode", "both", "encode-prefill-decode"],
            true
        )
    );
    assert_eq!(decode.filters[0].plugin_type, "decode-filter");
    assert_eq!(decode.scorers.len(), 3);
    let ProfileHandlerSpec::PrefillDecode(pd) = &decode.handler else {
        panic!("not P/D: {:?}", decode.handler);
    };
    assert_eq!(pd.name, "pd-profile-handler");
    assert_eq!(pd.threshold_tokens, 256);
    assert_eq!(pd.prefill.profile_name, "prefill");
    assert_eq!(pd.prefill.handler, ProfileHandlerSpec::Single);
    assert_eq!(
        pd.prefill.filters[0].filter,
        role(
            &[
                "prefill",
                "encode-prefill",
                "prefill-decode",
                "both",
                "encode-prefill-decode"
            ],
            false
        )
    );
    assert_eq!(
        pd.prefill
            .scorers
            .iter()
            .map(|s| (s.name.as_str(), s.weight))
            .collect::<Vec<_>>(),
        [("queue-scorer", 2.0), ("prefix-cache-scorer", 1.0)]
    );
    assert!(pd.needs_prefill(256.0) && !pd.needs_prefill(255.0));

    // Newer llm-d: the threshold from a prefix-based-pd-decider; llm-d's char-block
    // parameters are accepted with a warning; profiles named by default.
    let decider = format!(
        "{HEAD}plugins:\n- type: prefix-based-pd-decider\n  name: decider\n  parameters: {{nonCachedTokens: 32}}\n- type: pd-profile-handler\n  parameters: {{deciderPluginName: decider, hashBlockSize: 64}}\n- type: queue-scorer\nschedulingProfiles:\n- name: decode\n  plugins:\n  - pluginRef: queue-scorer\n- name: prefill\n  plugins:\n  - pluginRef: queue-scorer\n"
    );
    let v = load(Some(&decider)).expect("decider config");
    let ProfileHandlerSpec::PrefillDecode(pd) = &v.scheduler.handler else {
        panic!("not P/D");
    };
    assert_eq!(pd.threshold_tokens, 32);
    assert!(
        v.warnings.iter().any(|w| w.contains("hashBlockSize")),
        "{:?}",
        v.warnings
    );
    let always = format!(
        "{HEAD}plugins:\n- type: pd-profile-handler\nschedulingProfiles:\n- name: prefill\n- name: decode\n"
    );
    let v = load(Some(&always)).expect("defaults");
    let ProfileHandlerSpec::PrefillDecode(pd) = &v.scheduler.handler else {
        panic!("not P/D");
    };
    assert_eq!(pd.threshold_tokens, 0);
    assert!(pd.needs_prefill(0.0), "threshold 0: always");
}

#[test]
fn pd_config_errors_name_the_bad_field() {
    let pd = |params: &str, profiles: &[&str]| {
        let mut text = format!(
            "{HEAD}plugins:\n- type: queue-scorer\n- type: pd-profile-handler\n  parameters: {{{params}}}\nschedulingProfiles:\n"
        );
        for p in profiles {
            text.push_str(&format!(
                "- name: {p}\n  plugins:\n  - pluginRef: queue-scorer\n"
            ));
        }
        error_of(&text)
    };
    let e = pd("decodeProfile: dec", &["decode", "prefill"]);
    assert!(
        e.contains("plugins[1].parameters.decodeProfile") && e.contains("`dec`"),
        "{e}"
    );
    let e = pd("", &["decode"]);
    assert!(
        e.contains("plugins[1].parameters.prefillProfile") && e.contains("`prefill`"),
        "missing prefill profile: {e}"
    );
    let e = pd("", &[]);
    assert!(e.contains("plugins[1].parameters.decodeProfile"), "{e}");
    let e = pd("", &["decode", "prefill", "extra"]);
    assert!(
        e.contains("schedulingProfiles[2].name") && e.contains("never run"),
        "{e}"
    );
    let e = pd("", &["decode", "prefill", "decode"]);
    assert!(
        e.contains("schedulingProfiles[2].name") && e.contains("duplicate"),
        "{e}"
    );
    let e = pd("prefillProfile: decode", &["decode"]);
    assert!(e.contains("plugins[1].parameters.prefillProfile"), "{e}");
    let e = pd("threshold: -1", &["decode", "prefill"]);
    assert!(
        e.contains("plugins[1].parameters") && e.contains("threshold"),
        "{e}"
    );
    let e = pd("primaryPort: 8000", &["decode", "prefill"]);
    assert!(e.contains("primaryPort"), "{e}");
    let e = pd("treshold: 5", &["decode", "prefill"]);
    assert!(
        e.contains("plugins[1].parameters") && e.contains("treshold"),
        "{e}"
    );
    let e = pd("deciderPluginName: nope", &["decode", "prefill"]);
    assert!(
        e.contains("plugins[1].parameters.deciderPluginName") && e.contains("`nope`"),
        "{e}"
    );
    let e = pd("deciderPluginName: queue-scorer", &["decode", "prefill"]);
    assert!(e.contains("not a prefix-based-pd-decider"), "{e}");

    // The single-profile handler keeps the exactly-one rule and its error.
    let single = format!(
        "{HEAD}plugins:\n- type: single-profile-handler\nschedulingProfiles:\n- name: decode\n- name: prefill\n"
    );
    let e = error_of(&single);
    assert!(
        e.contains("schedulingProfiles: kvpick runs exactly one profile"),
        "{e}"
    );
    let two_handlers = format!(
        "{HEAD}plugins:\n- type: single-profile-handler\n- type: pd-profile-handler\nschedulingProfiles:\n- name: decode\n- name: prefill\n"
    );
    let e = error_of(&two_handlers);
    assert!(
        e.contains("plugins[1].type") && e.contains("one profile handler"),
        "{e}"
    );
    let header = format!(
        "{HEAD}plugins:\n- type: prefill-header-handler\n  parameters: {{prefillProfile: pre}}\n- type: pd-profile-handler\nschedulingProfiles:\n- name: decode\n- name: prefill\n"
    );
    let e = error_of(&header);
    assert!(
        e.contains("plugins[0].parameters.prefillProfile") && e.contains("`pre`"),
        "{e}"
    );
}

/// The document's apiVersion as GIE and llm-d have written it (llm-d moved the EPP's config to
/// its own group in 2026): all read the same, without a warning; an unknown one reads as GIE's
/// with a warning that names it.
#[test]
fn every_known_api_version_reads_the_same() {
    let body = "kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\n";
    let reference = load(Some(&format!(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\n{body}"
    )))
    .expect("GIE's version");
    for version in [
        "inference.networking.x-k8s.io/v1alpha1",
        "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
        "llm-d.ai/v1alpha1",
        "llm-d.ai/v1",
    ] {
        let v = load(Some(&format!("apiVersion: {version}\n{body}"))).expect(version);
        assert_eq!(v.scheduler, reference.scheduler, "{version}");
        assert!(
            !v.warnings.iter().any(|w| w.starts_with("apiVersion")),
            "{version}: {:?}",
            v.warnings
        );
    }
    let odd = load(Some(&format!("apiVersion: example.com/v9\n{body}"))).expect("read anyway");
    assert_eq!(odd.scheduler, reference.scheduler);
    assert!(
        odd.warnings
            .iter()
            .any(|w| w.starts_with("apiVersion") && w.contains("example.com/v9")),
        "{:?}",
        odd.warnings
    );
}
