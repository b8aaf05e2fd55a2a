//! A real Envoy started from the shipped `deploy/envoy/envoy.yaml`, with only its ports and
//! endpoints substituted (plus optional test-only additions).
//!
//! The `inference-pool` cluster (override_host picks among its hosts) gets the endpoints of
//! kvpick's pool file as it is when Envoy starts, plus [`EnvoyOptions::extra_pool`]; the
//! `inference-pool-fallback` cluster gets [`EnvoyOptions::fallback`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::kvpick::Kvpick;
use super::{ready_or_exited, repo_root};

pub struct Envoy {
    child: Child,
    pub port: u16,
    pub admin_port: u16,
    _dir: tempfile::TempDir,
}

/// Test-only changes to the shipped config.
#[derive(Default)]
pub struct EnvoyOptions {
    /// Endpoints of the FailOpen fallback cluster (replacing the quickstart's 8101/8102).
    pub fallback: Vec<SocketAddr>,
    /// A subset hint an earlier filter puts in `envoy.lb.subset_hint`.
    pub subset_hint: Option<Vec<String>>,
    /// Echo the `envoy.lb` destination metadata back as a response header.
    pub echo_metadata: bool,
    /// Pool endpoints Envoy knows besides those of kvpick's pool file at start (for a pool
    /// that is edited later).
    pub extra_pool: Vec<SocketAddr>,
    /// Echo the upstream host that served and the number of upstream attempts as response
    /// headers ([`UPSTREAM_ECHO_HEADER`], [`ATTEMPTS_ECHO_HEADER`]).
    pub echo_upstream: bool,
    /// Report the upstream host that served in `envoy.lb` metadata
    /// `x-gateway-destination-endpoint-served` and forward it to kvpick with the response
    /// headers, as a gateway running GIE's conformance suite does.
    pub served_endpoint_metadata: bool,
    /// Speak TLS to kvpick's ext-proc port (`--secure-serving`), without verifying its
    /// certificate (as gateways do for the EPP's self-signed one); health checks stay plain.
    pub kvpick_tls: bool,
    /// Send the response through the routing filter (one ext_proc filter, as before the
    /// split; needed to restore a rewritten model name) instead of the shipped observing
    /// filter, with response bodies in `FULL_DUPLEX_STREAMED` mode.
    pub response_in_routing_filter: bool,
    /// The same, with response bodies in `STREAMED` mode (Envoy holds each chunk until
    /// kvpick answers it).
    pub response_body_streamed: bool,
    /// More kvpick replicas in the ext_proc cluster, as (gRPC port, health port): Envoy
    /// balances streams over all of them and health-checks each.
    pub extra_kvpicks: Vec<(u16, u16)>,
    /// The routing filter's request bodies in `BUFFERED` mode (Envoy holds the body and sends
    /// it whole; kvpick's answer carries no body back) instead of `FULL_DUPLEX_STREAMED`.
    pub request_body_buffered: bool,
}

/// Header the test config adds to responses with the `envoy.lb` destination metadata.
pub const METADATA_ECHO_HEADER: &str = "x-test-metadata-destination";
/// Header the test config adds to responses with the upstream host that served.
pub const UPSTREAM_ECHO_HEADER: &str = "x-test-upstream-host";
/// Header the test config adds to responses with the number of upstream attempts.
pub const ATTEMPTS_ECHO_HEADER: &str = "x-test-upstream-attempts";

/// The `address` of every endpoint of a kvpick pool file.
fn pool_addresses(pool_file: &std::path::Path) -> Vec<SocketAddr> {
    let text = std::fs::read_to_string(pool_file).expect("read kvpick's pool file");
    let pool: serde_yaml::Value = serde_yaml::from_str(&text).expect("pool yaml");
    pool["endpoints"]
        .as_sequence()
        .map(|endpoints| {
            endpoints
                .iter()
                .filter_map(|e| e["address"].as_str())
                .map(|a| a.parse().expect("pool address"))
                .collect()
        })
        .unwrap_or_default()
}

/// Drops the observing filter (`kvpick-observe`) and has the routing ext_proc filter send
/// the response, its body in `body_mode`: the one-filter config the shipped file's NOTE
/// describes.
fn response_in_routing_filter(config: &str, body_mode: &str) -> String {
    let mut root: serde_yaml::Value = serde_yaml::from_str(config).expect("envoy.yaml");
    let filters =
        root["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            ["http_filters"]
            .as_sequence_mut()
            .expect("http_filters");
    let before = filters.len();
    filters.retain(|f| f["name"].as_str() != Some("kvpick-observe"));
    assert_eq!(
        filters.len() + 1,
        before,
        "envoy.yaml has a kvpick-observe filter"
    );
    let routing = filters
        .iter_mut()
        .find(|f| f["name"].as_str() == Some("envoy.filters.http.ext_proc"))
        .expect("envoy.yaml has the routing ext_proc filter");
    let mode = &mut routing["typed_config"]["processing_mode"];
    mode["response_header_mode"] = "SEND".into();
    mode["response_body_mode"] = body_mode.into();
    mode["response_trailer_mode"] = "SEND".into();
    serde_yaml::to_string(&root).expect("envoy yaml")
}

/// Makes the `kvpick` cluster speak TLS (ALPN h2) to the ext-proc port while its gRPC
/// health checks, on kvpick's plain health port, select a raw-buffer transport socket.
fn kvpick_over_tls(config: &str) -> String {
    let mut root: serde_yaml::Value = serde_yaml::from_str(config).expect("envoy.yaml");
    let clusters = root["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("clusters");
    let cluster = clusters
        .iter_mut()
        .find(|c| c["name"].as_str() == Some("kvpick"))
        .expect("envoy.yaml has a kvpick cluster");
    cluster["transport_socket_matches"] = serde_yaml::from_str(
        r#"
- name: plain-health-checks
  match: { plain: "true" }
  transport_socket: { name: envoy.transport_sockets.raw_buffer, typed_config: { "@type": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer } }
- name: tls
  match: {}
  transport_socket:
    name: envoy.transport_sockets.tls
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
      common_tls_context: { alpn_protocols: [h2] }
"#,
    )
    .expect("tls yaml");
    cluster["health_checks"][0]["transport_socket_match_criteria"] =
        serde_yaml::from_str(r#"{ plain: "true" }"#).expect("criteria yaml");
    serde_yaml::to_string(&root).expect("envoy yaml")
}

/// Replaces the endpoints of cluster `name` (when it lists endpoints: a cluster without a
/// `load_assignment` is left alone).
fn set_cluster_endpoints(config: &str, name: &str, endpoints: &[SocketAddr]) -> String {
    let mut root: serde_yaml::Value = serde_yaml::from_str(config).expect("envoy.yaml");
    let clusters = root["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("clusters");
    let cluster = clusters
        .iter_mut()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("envoy.yaml has no cluster {name}"));
    if cluster.get("load_assignment").is_some() {
        let lb_endpoints: Vec<serde_yaml::Value> = endpoints
            .iter()
            .map(|a| {
                serde_yaml::from_str(&format!(
                    "endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}",
                    a.ip(),
                    a.port()
                ))
                .expect("endpoint yaml")
            })
            .collect();
        cluster["load_assignment"]["endpoints"] = if lb_endpoints.is_empty() {
            serde_yaml::Value::Sequence(Vec::new())
        } else {
            serde_yaml::from_str::<serde_yaml::Value>("[{lb_endpoints: []}]").expect("yaml")
        };
        if let Some(first) = cluster["load_assignment"]["endpoints"]
            .as_sequence_mut()
            .and_then(|s| s.first_mut())
        {
            first["lb_endpoints"] = serde_yaml::Value::Sequence(lb_endpoints);
        }
    }
    serde_yaml::to_string(&root).expect("envoy yaml")
}

pub fn envoy_binary() -> PathBuf {
    if let Ok(path) = std::env::var("KVPICK_ENVOY") {
        return PathBuf::from(path);
    }
    let venv = repo_root().join(".venv/bin/envoy");
    assert!(
        venv.exists(),
        "no Envoy at {}: run scripts/setup-envoy.sh (scripts/test.sh does) or set KVPICK_ENVOY",
        venv.display()
    );
    venv
}

fn replace_once(config: &mut String, from: &str, to: &str) {
    assert!(
        config.contains(from),
        "envoy.yaml no longer contains `{from}`"
    );
    *config = config.replacen(from, to, 1);
}

impl Envoy {
    pub async fn start(kvpick: &Kvpick, options: EnvoyOptions) -> Envoy {
        let (kvpick_grpc_port, kvpick_health_port) = (kvpick.grpc_port, kvpick.health_port);
        let mut config = std::fs::read_to_string(repo_root().join("deploy/envoy/envoy.yaml"))
            .expect("read deploy/envoy/envoy.yaml");
        // Ports are the kernel's pick (see below).
        replace_once(&mut config, "port_value: 9901", "port_value: ADMIN_PORT");
        replace_once(
            &mut config,
            "address: 0.0.0.0, port_value: 8081",
            "address: 127.0.0.1, port_value: LISTEN_PORT",
        );
        replace_once(
            &mut config,
            "port_value: 9002",
            &format!("port_value: {kvpick_grpc_port}"),
        );
        replace_once(
            &mut config,
            "port_value: 9003",
            &format!("port_value: {kvpick_health_port}"),
        );
        for (grpc, health) in &options.extra_kvpicks {
            let last = format!(
                "                  health_check_config: {{ port_value: {kvpick_health_port} }}\n"
            );
            replace_once(
                &mut config,
                &last,
                &format!(
                    "{last}              - endpoint:\n                  address:\n                    socket_address: {{ address: 127.0.0.1, port_value: {grpc} }}\n                  health_check_config: {{ port_value: {health} }}\n"
                ),
            );
        }
        if options.request_body_buffered {
            replace_once(
                &mut config,
                "request_body_mode: FULL_DUPLEX_STREAMED",
                "request_body_mode: BUFFERED",
            );
        }
        let fallback = if options.fallback.is_empty() {
            // Nothing listens here: a request that reaches the fallback fails visibly.
            vec!["127.0.0.1:1".parse().expect("addr")]
        } else {
            options.fallback.clone()
        };
        let mut pool = pool_addresses(&kvpick.pool_file);
        pool.extend(options.extra_pool.iter().copied());
        if let Some(subset) = &options.subset_hint {
            let list = subset
                .iter()
                .map(|s| format!("\"{s}\""))
                .collect::<Vec<_>>()
                .join(", ");
            replace_once(
                &mut config,
                "                  - name: envoy.filters.http.ext_proc\n",
                &format!(
                    "                  - name: envoy.filters.http.set_metadata\n                    typed_config:\n                      \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n                      metadata:\n                        - metadata_namespace: envoy.lb.subset_hint\n                          value: {{ x-gateway-destination-endpoint-subset: [{list}] }}\n                  - name: envoy.filters.http.ext_proc\n"
                ),
            );
        }
        let mut echoed = Vec::new();
        if options.echo_metadata {
            echoed.push(format!("                        - header: {{ key: {METADATA_ECHO_HEADER}, value: \"%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%\" }}\n"));
        }
        if options.echo_upstream {
            echoed.push(format!("                        - header: {{ key: {UPSTREAM_ECHO_HEADER}, value: \"%UPSTREAM_HOST%\" }}\n"));
            echoed.push(format!("                        - header: {{ key: {ATTEMPTS_ECHO_HEADER}, value: \"%UPSTREAM_REQUEST_ATTEMPT_COUNT%\" }}\n"));
        }
        if options.served_endpoint_metadata {
            // The router adds the route's response headers before the filters above it see
            // the response: header_to_metadata (between ext_proc and the router) moves the
            // header into `envoy.lb`, and ext_proc forwards that namespace to kvpick.
            echoed.push("                        - header: { key: x-gateway-destination-endpoint-served, value: \"%UPSTREAM_HOST%\" }\n".to_owned());
            replace_once(
                &mut config,
                "                  - name: envoy.filters.http.router\n",
                "                  - name: envoy.filters.http.header_to_metadata\n                    typed_config:\n                      \"@type\": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config\n                      response_rules:\n                        - header: x-gateway-destination-endpoint-served\n                          on_header_present: { metadata_namespace: envoy.lb, key: x-gateway-destination-endpoint-served, type: STRING }\n                          remove: true\n                  - name: envoy.filters.http.router\n",
            );
            replace_once(
                &mut config,
                "untyped: [\"envoy.lb.subset_hint\"]",
                "untyped: [\"envoy.lb.subset_hint\", \"envoy.lb\"]",
            );
        }
        if !echoed.is_empty() {
            replace_once(
                &mut config,
                "                      domains: [\"*\"]\n",
                &format!(
                    "                      domains: [\"*\"]\n                      response_headers_to_add:\n{}",
                    echoed.concat()
                ),
            );
        }
        // The served-endpoint echo is a response header kvpick sets: only a filter that
        // waits for kvpick's answer can carry it.
        if options.response_body_streamed {
            config = response_in_routing_filter(&config, "STREAMED");
        } else if options.response_in_routing_filter || options.served_endpoint_metadata {
            config = response_in_routing_filter(&config, "FULL_DUPLEX_STREAMED");
        }
        // Endpoints last: the edits above are on the file's text, these on its structure.
        let config = set_cluster_endpoints(&config, "inference-pool", &pool);
        let config = set_cluster_endpoints(&config, "inference-pool-fallback", &fallback);
        let config = if options.kvpick_tls {
            kvpick_over_tls(&config)
        } else {
            config
        };
        // Port 0 for both: the kernel picks ports no other process holds. Envoy writes its
        // admin address to a file, and its admin API says which port the listener got (a
        // port found free and passed in can be taken by another test's process first, and
        // the readiness probe would then reach that one).
        let config = config
            .replacen("ADMIN_PORT", "0", 1)
            .replacen("LISTEN_PORT", "0", 1);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("envoy.yaml");
        let admin_file = dir.path().join("admin-address");
        std::fs::write(&path, &config).expect("write envoy config");
        let mut child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&path)
            .arg("--admin-address-path")
            .arg(&admin_file)
            .args([
                "--disable-hot-restart",
                "-l",
                "warning",
                "--concurrency",
                "1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn envoy");
        let mut admin: Option<SocketAddr> = None;
        let found = ready_or_exited(
            "envoy's admin address",
            &mut child,
            Duration::from_secs(30),
            || {
                admin = std::fs::read_to_string(&admin_file)
                    .ok()
                    .and_then(|text| text.trim().parse().ok());
                std::future::ready(admin.is_some())
            },
        )
        .await;
        assert!(found, "envoy exited before it listened");
        let admin_port = admin.expect("admin address").port();
        let ready = format!("http://127.0.0.1:{admin_port}/ready");
        let started = ready_or_exited(
            "envoy readiness",
            &mut child,
            Duration::from_secs(30),
            || {
                let ready = ready.clone();
                async move {
                    matches!(super::http::send("GET", &ready, &[], Vec::new()).await, Ok(r) if r.status == 200)
                }
            },
        )
        .await;
        assert!(started, "envoy exited before it was ready");
        let port = listener_port(admin_port, "inference").await;
        Envoy {
            child,
            port,
            admin_port,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port Envoy's listener `name` is bound to, from the admin API's `/listeners`.
async fn listener_port(admin_port: u16, name: &str) -> u16 {
    let url = format!("http://127.0.0.1:{admin_port}/listeners?format=json");
    let reply = super::http::send("GET", &url, &[], Vec::new())
        .await
        .expect("envoy /listeners");
    let listeners: serde_json::Value = serde_json::from_str(&reply.text()).expect("JSON");
    listeners["listener_statuses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|status| status["name"] == name)
        .and_then(|status| status["local_address"]["socket_address"]["port_value"].as_u64())
        .and_then(|port| u16::try_from(port).ok())
        .unwrap_or_else(|| panic!("no listener {name} in {listeners}"))
}
