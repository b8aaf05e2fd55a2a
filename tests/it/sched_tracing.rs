//! Scheduler observability end to end, through a real Envoy, the real kvpick binary and real
//! HTTP backends on loopback: plugin timings labelled like GIE's.

use crate::support;

use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::send;
use support::kvpick::Kvpick;

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// Plugins whose instance names differ from their types, so the labels can tell them apart.
const NAMED_PLUGINS: &str = "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: not-full
  type: saturation-filter
  parameters: {queueDepthThreshold: 100}
- name: queue
  type: queue-scorer
- name: prefix
  type: prefix-cache-scorer
- name: best
  type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: not-full
  - pluginRef: queue
    weight: 1
  - pluginRef: prefix
    weight: 2
  - pluginRef: best
";

/// The sample lines of `family` whose labels include every `(key, value)`.
fn samples<'m>(metrics: &'m str, family: &str, labels: &[(&str, &str)]) -> Vec<&'m str> {
    metrics
        .lines()
        .filter(|line| line.starts_with(&format!("{family}{{")))
        .filter(|line| {
            labels
                .iter()
                .all(|(k, v)| line.contains(&format!("{k}=\"{v}\"")))
        })
        .collect()
}

#[tokio::test]
async fn plugin_timings_carry_gie_labels_extension_point_type_and_name() {
    let backend = Backend::start("127.0.0.1").await;
    let kvpick = Kvpick::start(&pool_yaml(&[&backend]), &["--config-text", NAMED_PLUGINS]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    for _ in 0..3 {
        let reply = send(
            "POST",
            &envoy.url("/v1/completions"),
            &[("content-type", "application/json")],
            BODY.to_vec(),
        )
        .await
        .expect("request");
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let metrics = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    let family = "inference_extension_plugin_duration_seconds_count";
    for (point, plugin_type, name) in [
        ("Filter", "saturation-filter", "not-full"),
        ("Scorer", "queue-scorer", "queue"),
        ("Scorer", "prefix-cache-scorer", "prefix"),
        ("Picker", "max-score-picker", "best"),
    ] {
        let found = samples(
            &metrics,
            family,
            &[
                ("extension_point", point),
                ("plugin_type", plugin_type),
                ("plugin_name", name),
            ],
        );
        assert_eq!(found.len(), 1, "{point}/{plugin_type}/{name}: {found:?}");
        assert!(
            found[0].ends_with(" 3"),
            "three picks timed for {name}: {}",
            found[0]
        );
    }
    // Exactly GIE's label set: nothing more, nothing less.
    for line in samples(&metrics, family, &[]) {
        let labels = line
            .split_once('{')
            .and_then(|(_, rest)| rest.split_once('}'))
            .map(|(inside, _)| inside)
            .expect("labels");
        let mut keys: Vec<&str> = labels
            .split(',')
            .filter_map(|pair| pair.split_once('=').map(|(k, _)| k))
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["extension_point", "plugin_name", "plugin_type"]);
    }
}

#[tokio::test]
async fn emitted_scores_reach_the_model_server_and_forged_copies_do_not() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    // No fallbacks: the destination header is then exactly the picked endpoint.
    let kvpick = Kvpick::start(
        &pool_yaml(&[&a, &b]),
        &["--emit-endpoint-scores", "--max-fallbacks", "0"],
    )
    .await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let reply = send(
        "POST",
        &envoy.url("/v1/completions"),
        &[
            ("content-type", "application/json"),
            ("x-kvpick-endpoint-scores", "6.6.6.6:1=99"),
            ("x-prefiller-host-port", "6.6.6.6:1"),
        ],
        BODY.to_vec(),
    )
    .await
    .expect("request");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen: Vec<_> = a.seen().into_iter().chain(b.seen()).collect();
    assert_eq!(seen.len(), 1);
    let headers = &seen[0].headers;
    let destination = headers["x-gateway-destination-endpoint"]
        .to_str()
        .expect("ascii");
    let all: Vec<_> = headers.get_all("x-kvpick-endpoint-scores").iter().collect();
    assert_eq!(all.len(), 1, "one value, kvpick's: {all:?}");
    let scores = all[0].to_str().expect("ascii");
    let entries: Vec<&str> = scores.split(';').collect();
    assert_eq!(entries.len(), 2, "{scores}");
    assert!(
        entries[0].starts_with(&format!("{destination}=")),
        "{scores} vs {destination}"
    );
    assert!(!scores.contains("6.6.6.6"));
    assert!(
        headers["x-kvpick-scorer-scores"]
            .to_str()
            .expect("ascii")
            .contains("queue-scorer:")
    );
    assert!(headers.get("x-prefiller-host-port").is_none());
}

#[tokio::test]
async fn the_decode_pod_behind_envoy_receives_the_prefill_pod_in_x_prefiller_host_port() {
    let (decode, prefill) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    // Roles come from the endpoints file's labels.
    let pool = format!(
        "endpoints:\n  - address: {}\n    labels: {{llm-d.ai/role: decode}}\n  - address: {}\n    labels: {{llm-d.ai/role: prefill}}\n",
        decode.addr, prefill.addr
    );
    let config = include_str!("../../deploy/config/pd-disaggregation.yaml")
        .replace("threshold: 256", "threshold: 0");
    let kvpick = Kvpick::start(&pool, &["--config-text", &config]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let reply = send(
        "POST",
        &envoy.url("/v1/completions"),
        &[
            ("content-type", "application/json"),
            ("x-prefiller-host-port", "6.6.6.6:1"),
        ],
        BODY.to_vec(),
    )
    .await
    .expect("request");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        prefill.seen().is_empty(),
        "the gateway routes to decode only"
    );
    let seen = decode.seen();
    assert_eq!(seen.len(), 1);
    let values: Vec<_> = seen[0]
        .headers
        .get_all("x-prefiller-host-port")
        .iter()
        .map(|v| v.to_str().expect("ascii").to_owned())
        .collect();
    assert_eq!(values, [prefill.addr.to_string()]);
}
