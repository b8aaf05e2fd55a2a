//! A real Envoy started from the shipped `deploy/envoy/envoy.yaml`, with only its ports and
//! fallback endpoints substituted (plus optional test-only additions).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::kvpick::Kvpick;
use super::{free_port, ready_or_exited, repo_root};

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
}

/// Header the test config adds to responses with the `envoy.lb` destination metadata.
pub const METADATA_ECHO_HEADER: &str = "x-test-metadata-destination";

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
        // Ports are filled in per start attempt (see below).
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
        let fallback = if options.fallback.is_empty() {
            // Nothing listens here: a request that reaches the fallback fails visibly.
            vec!["127.0.0.1:1".parse().expect("addr")]
        } else {
            options.fallback.clone()
        };
        let endpoints: String = fallback
            .iter()
            .map(|a| {
                format!(
                    "              - endpoint:\n                  address:\n                    socket_address: {{ address: {}, port_value: {} }}\n",
                    a.ip(),
                    a.port()
                )
            })
            .collect();
        let start = config
            .find("              - endpoint:\n                  address:\n                    socket_address: { address: 127.0.0.1, port_value: 8101 }")
            .expect("fallback endpoints in envoy.yaml");
        config.replace_range(start.., &endpoints);
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
        if options.echo_metadata {
            replace_once(
                &mut config,
                "                      domains: [\"*\"]\n",
                &format!(
                    "                      domains: [\"*\"]\n                      response_headers_to_add:\n                        - header: {{ key: {METADATA_ECHO_HEADER}, value: \"%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%\" }}\n"
                ),
            );
        }
        // NOTE: a port found free can be taken by another test's process before Envoy binds
        // it (tests run in parallel); Envoy then exits, and it is started again on other
        // ports (a few times) instead of failing the test.
        for _ in 0..4 {
            let (port, admin_port) = (free_port(), free_port());
            let config = config
                .replacen("ADMIN_PORT", &admin_port.to_string(), 1)
                .replacen("LISTEN_PORT", &port.to_string(), 1);
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("envoy.yaml");
            std::fs::write(&path, &config).expect("write envoy config");
            let mut child = Command::new(envoy_binary())
                .arg("-c")
                .arg(&path)
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
            if started {
                return Envoy {
                    child,
                    port,
                    admin_port,
                    _dir: dir,
                };
            }
        }
        panic!("envoy did not start in 4 attempts");
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
