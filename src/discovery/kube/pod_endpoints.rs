//! Pods → endpoints: each ready, non-terminating pod with an IP is one endpoint per target
//! port (`podIP:port`), carrying the pod's labels and its KV-event addresses.
//!
//! KV-event addresses come from the pod's annotations (`kvpick.io/kv-events`,
//! `kvpick.io/kv-replay`: `tcp://host:port`, or a bare port on the pod's IP), else from
//! `--kv-events-port` / `--kv-replay-port` on the pod's IP. With several target ports (data-
//! parallel ranks) rank `i` publishes on the base port + `i`, as vLLM offsets each DP rank's
//! `kv-events-config` endpoint. Pure functions: the watch task calls them on every change.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;

use super::pool_spec::PoolSpec;
use crate::discovery::is_zmq_endpoint;
use crate::endpoints::{Endpoint, PodId};

/// Pod annotation naming its KV-event PUB endpoint.
pub const KV_EVENTS_ANNOTATION: &str = "kvpick.io/kv-events";
/// Pod annotation naming its KV-event replay ROUTER endpoint.
pub const KV_REPLAY_ANNOTATION: &str = "kvpick.io/kv-replay";

/// The flag-given KV-event ports (used when a pod has no annotation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvPorts {
    /// `--kv-events-port`.
    pub events: Option<u16>,
    /// `--kv-replay-port`.
    pub replay: Option<u16>,
}

/// Something wrong with one pod, for a log line and a metric; the pod is used as far as it can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodProblem {
    /// `namespace/name`.
    pub pod: String,
    /// The field (`status.podIP`, `metadata.annotations[kvpick.io/kv-events]`).
    pub field: &'static str,
    /// What is wrong.
    pub reason: String,
}

/// The endpoints of the pool and the problems met building them.
#[derive(Debug, Default)]
pub struct Built {
    /// In pod-name order, then port order.
    pub endpoints: Vec<Endpoint>,
    /// One per problem met.
    pub problems: Vec<PodProblem>,
}

/// Whether the pod may take traffic: Ready, and not on its way out.
pub fn is_serving(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

fn pod_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("?")
    )
}

/// The endpoints of `pods` under `spec`. `previous` (the last published endpoints by id)
/// supplies the last good KV-event address of a pod whose annotation turned bad.
pub fn build(
    spec: &PoolSpec,
    pods: &BTreeMap<String, Pod>,
    ports: KvPorts,
    previous: &HashMap<PodId, Endpoint>,
) -> Built {
    let mut built = Built::default();
    for pod in pods.values() {
        // The server filtered by the selector; check again, since a stale watch (or a
        // selector edit racing the re-watch) can still deliver pods of the old selector.
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        if !spec.selector.matches(&labels) {
            continue;
        }
        if !is_serving(pod) {
            continue;
        }
        let name = pod_name(pod);
        let ip_text = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref());
        let Some(ip) = ip_text.and_then(|t| t.parse::<IpAddr>().ok()) else {
            built.problems.push(PodProblem {
                pod: name,
                field: "status.podIP",
                reason: match ip_text {
                    None => "ready but has no IP".to_owned(),
                    Some(text) => format!("`{text}` is not an IP address"),
                },
            });
            continue;
        };
        let annotations = pod.metadata.annotations.as_ref();
        for (rank, &port) in spec.target_ports.iter().enumerate() {
            let id = PodId(SocketAddr::new(ip, port));
            let last = previous.get(&id);
            let mut address =
                |annotation: &'static str, field, flag: Option<u16>, last: Option<&String>| {
                    kv_address(annotations.and_then(|a| a.get(annotation)), flag, ip, rank)
                        .unwrap_or_else(|reason| {
                            built.problems.push(PodProblem {
                                pod: name.clone(),
                                field,
                                reason,
                            });
                            last.cloned()
                        })
                };
            let kv_events = address(
                KV_EVENTS_ANNOTATION,
                "metadata.annotations[kvpick.io/kv-events]",
                ports.events,
                last.and_then(|e| e.kv_events.as_ref()),
            );
            let kv_replay = address(
                KV_REPLAY_ANNOTATION,
                "metadata.annotations[kvpick.io/kv-replay]",
                ports.replay,
                last.and_then(|e| e.kv_replay.as_ref()),
            );
            built.endpoints.push(Endpoint {
                id,
                kv_events,
                kv_replay,
                labels: labels.clone(),
            });
        }
    }
    built
}

/// The KV-event address of DP rank `rank` from an annotation or the flag's port; `Err` with
/// the reason when the annotation is unusable.
fn kv_address(
    annotation: Option<&String>,
    flag: Option<u16>,
    ip: IpAddr,
    rank: usize,
) -> Result<Option<String>, String> {
    let rank = u16::try_from(rank).unwrap_or(u16::MAX);
    let on_pod = |port: u16| -> Result<Option<String>, String> {
        port.checked_add(rank)
            .map(|p| Some(format!("tcp://{}", SocketAddr::new(ip, p))))
            .ok_or_else(|| format!("port {port} + rank {rank} overflows"))
    };
    let Some(text) = annotation.map(|t| t.trim()) else {
        return flag.map_or(Ok(None), on_pod);
    };
    if let Ok(port) = text.parse::<u16>() {
        if port == 0 {
            return Err("port 0".to_owned());
        }
        return on_pod(port);
    }
    if !is_zmq_endpoint(text) {
        return Err(format!(
            "`{}` is neither tcp://host:port nor a port",
            text.chars().take(128).collect::<String>()
        ));
    }
    if rank == 0 {
        return Ok(Some(text.to_owned()));
    }
    // Offset the port for the rank, as vLLM does.
    let (host, port) = text.rsplit_once(':').unwrap_or((text, "0"));
    let port: u16 = port.parse().map_err(|_| format!("`{text}` has no port"))?;
    port.checked_add(rank)
        .map(|p| Some(format!("{host}:{p}")))
        .ok_or_else(|| format!("port {port} + rank {rank} overflows"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, ip: Option<&str>, ready: bool, annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": "vllm", "llm-d.ai/role": "decode"},
                         "annotations": annotations},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
        }))
        .expect("pod")
    }

    fn spec(ports: &[u16]) -> PoolSpec {
        PoolSpec {
            selector: super::super::LabelSelector::from_labels(
                &[("app".to_owned(), "vllm".to_owned())].into(),
            ),
            target_ports: ports.to_vec(),
        }
    }

    #[test]
    fn ready_pods_times_ports_with_ranked_kv_ports() {
        let pods: BTreeMap<String, Pod> = [
            ("a".to_owned(), pod("a", Some("10.0.0.1"), true, json!({}))),
            ("b".to_owned(), pod("b", Some("10.0.0.2"), false, json!({}))),
            ("c".to_owned(), pod("c", None, true, json!({}))),
            (
                "d".to_owned(),
                pod(
                    "d",
                    Some("10.0.0.4"),
                    true,
                    json!({"kvpick.io/kv-events": "tcp://10.9.9.9:7000"}),
                ),
            ),
        ]
        .into();
        let built = build(
            &spec(&[8000, 8001]),
            &pods,
            KvPorts {
                events: Some(5557),
                replay: None,
            },
            &HashMap::new(),
        );
        let ids: Vec<String> = built.endpoints.iter().map(|e| e.id.to_string()).collect();
        assert_eq!(
            ids,
            [
                "10.0.0.1:8000",
                "10.0.0.1:8001",
                "10.0.0.4:8000",
                "10.0.0.4:8001"
            ]
        );
        assert_eq!(
            built.endpoints[1].kv_events.as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        assert_eq!(
            built.endpoints[3].kv_events.as_deref(),
            Some("tcp://10.9.9.9:7001")
        );
        assert_eq!(
            built.endpoints[0]
                .labels
                .get("llm-d.ai/role")
                .map(String::as_str),
            Some("decode")
        );
        assert_eq!(built.problems.len(), 1);
        assert_eq!(built.problems[0].field, "status.podIP");
    }

    #[test]
    fn a_bad_annotation_keeps_the_last_good_address() {
        let pods: BTreeMap<String, Pod> = [(
            "a".to_owned(),
            pod(
                "a",
                Some("10.0.0.1"),
                true,
                json!({"kvpick.io/kv-events": "garbage"}),
            ),
        )]
        .into();
        let mut last = Endpoint::new("10.0.0.1:8000".parse().expect("id"));
        last.kv_events = Some("tcp://10.0.0.1:5557".to_owned());
        let previous = [(last.id, last)].into();
        let built = build(&spec(&[8000]), &pods, KvPorts::default(), &previous);
        assert_eq!(
            built.endpoints[0].kv_events.as_deref(),
            Some("tcp://10.0.0.1:5557")
        );
        assert_eq!(
            built.problems[0].field,
            "metadata.annotations[kvpick.io/kv-events]"
        );
        let fresh = build(&spec(&[8000]), &pods, KvPorts::default(), &HashMap::new());
        assert_eq!(fresh.endpoints[0].kv_events, None);
    }
}
