//! Replica peers from the API (`--peer-selector`): the ready pods of kvpick's own
//! Deployment, by label, in its namespace, this pod excluded, each as `podIP:exchange-port`.
//! A peer's exchange port is its container port named `replica` (the chart declares it, and
//! the headless Service's `grpc-replica` targets it), else this replica's own: a rolling
//! update that moves the port keeps old and new replicas talking.
//! The set is published into a `watch` channel the replica exchange follows
//! (`crate::replica`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::KubeError;
use super::pod_endpoints::is_serving;

/// A restartable task: each call makes a fresh run (the supervisor's `Start`).
pub type PeerTask = Box<dyn FnMut() -> futures::future::BoxFuture<'static, ()> + Send>;

/// This pod's name (`POD_NAME` from the downward API, else the host name, which is the pod
/// name in Kubernetes), to leave itself out.
fn own_pod() -> Option<String> {
    std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
}

/// The set of the peer pods' exchange addresses (empty until the first list) and the task
/// that watches them (for the caller to run supervised, stopped by `background`).
pub async fn watch_peers(
    selector: String,
    namespace: String,
    port: u16,
    background: &CancellationToken,
) -> Result<(watch::Receiver<BTreeSet<String>>, PeerTask), KubeError> {
    let client = super::client().await?;
    let api: Api<Pod> = Api::namespaced(client, &namespace);
    let (tx, rx) = watch::channel(BTreeSet::new());
    let tx = Arc::new(tx);
    let own = own_pod();
    let cancel = background.clone();
    tracing::info!(%selector, %namespace, own_pod = own.as_deref(), "replica peers from pods");
    let task: PeerTask = Box::new(move || {
        Box::pin(run(
            api.clone(),
            selector.clone(),
            own.clone(),
            port,
            Arc::clone(&tx),
            cancel.clone(),
        ))
    });
    Ok((rx, task))
}

/// The container port name of the exchange in kvpick's chart.
const EXCHANGE_PORT_NAME: &str = "replica";

/// The exchange port a peer pod declares (a container port named [`EXCHANGE_PORT_NAME`] in
/// 1–65535), else `default` (this replica's own).
fn exchange_port(pod: &Pod, default: u16) -> u16 {
    pod.spec
        .iter()
        .flat_map(|spec| &spec.containers)
        .flat_map(|container| container.ports.iter().flatten())
        .find(|port| port.name.as_deref() == Some(EXCHANGE_PORT_NAME))
        .and_then(|port| u16::try_from(port.container_port).ok())
        .filter(|port| *port != 0)
        .unwrap_or(default)
}

/// The exchange address of a peer pod, when it is one.
fn peer_addr(pod: &Pod, own: Option<&str>, port: u16) -> Option<String> {
    if own.is_some() && pod.metadata.name.as_deref() == own {
        return None;
    }
    if !is_serving(pod) {
        return None;
    }
    let ip: IpAddr = pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()?;
    Some(SocketAddr::new(ip, exchange_port(pod, port)).to_string())
}

async fn run(
    api: Api<Pod>,
    selector: String,
    own: Option<String>,
    port: u16,
    tx: Arc<watch::Sender<BTreeSet<String>>>,
    cancel: CancellationToken,
) {
    let mut stream = super::watch::watch(api, watcher::Config::default().labels(&selector));
    // Peers by pod name; `listing` gathers a (re-)list until it is complete.
    let mut peers: BTreeMap<String, String> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, String>> = None;
    let name = |pod: &Pod| pod.metadata.name.clone().unwrap_or_default();
    loop {
        let event = tokio::select! {
            () = cancel.cancelled() => return,
            event = stream.next() => event,
        };
        match event {
            // The watcher never ends by itself; the supervisor restarts this task if it does.
            None => return,
            Some(Err(error)) => tracing::warn!(%error, "replica peer watch failed; retrying"),
            Some(Ok(Event::Init)) => listing = Some(BTreeMap::new()),
            Some(Ok(Event::InitApply(pod))) => {
                if let (Some(list), Some(addr)) =
                    (listing.as_mut(), peer_addr(&pod, own.as_deref(), port))
                {
                    list.insert(name(&pod), addr);
                }
            }
            Some(Ok(Event::InitDone)) => {
                if let Some(list) = listing.take() {
                    peers = list;
                }
            }
            Some(Ok(Event::Apply(pod))) => match peer_addr(&pod, own.as_deref(), port) {
                Some(addr) => {
                    peers.insert(name(&pod), addr);
                }
                None => {
                    peers.remove(&name(&pod));
                }
            },
            Some(Ok(Event::Delete(pod))) => {
                peers.remove(&name(&pod));
            }
        }
        if listing.is_none() {
            let set: BTreeSet<String> = peers.values().cloned().collect();
            tx.send_if_modified(|current| {
                let changed = *current != set;
                if changed {
                    *current = set;
                }
                changed
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .unwrap_or_else(|e| panic!("pod: {e}"))
    }

    #[test]
    fn peers_are_the_other_ready_pods_with_an_ip() {
        let own = Some("kvpick-a");
        assert_eq!(
            peer_addr(&pod("kvpick-b", Some("10.0.0.2"), true), own, 9010).as_deref(),
            Some("10.0.0.2:9010")
        );
        assert_eq!(
            peer_addr(&pod("kvpick-c", Some("fd00::3"), true), own, 9010).as_deref(),
            Some("[fd00::3]:9010")
        );
        assert_eq!(
            peer_addr(&pod("kvpick-a", Some("10.0.0.1"), true), own, 9010),
            None
        );
        assert_eq!(
            peer_addr(&pod("kvpick-d", Some("10.0.0.4"), false), own, 9010),
            None
        );
        assert_eq!(peer_addr(&pod("kvpick-e", None, true), own, 9010), None);
        assert_eq!(
            peer_addr(&pod("kvpick-f", Some("not-an-ip"), true), own, 9010),
            None
        );
    }

    #[test]
    fn a_peer_declaring_its_exchange_port_is_reached_there() {
        let with_ports = |ports: serde_json::Value| -> Pod {
            let mut pod = serde_json::to_value(pod("kvpick-b", Some("10.0.0.2"), true))
                .unwrap_or_else(|e| panic!("pod: {e}"));
            pod["spec"] = serde_json::json!({"containers": [{"name": "kvpick", "ports": ports}]});
            serde_json::from_value(pod).unwrap_or_else(|e| panic!("pod: {e}"))
        };
        let declared = with_ports(serde_json::json!([
            {"name": "grpc", "containerPort": 9002},
            {"name": "replica", "containerPort": 9011}
        ]));
        assert_eq!(
            peer_addr(&declared, None, 9010).as_deref(),
            Some("10.0.0.2:9011")
        );
        // No such port, or one out of range: this replica's own port.
        for ports in [
            serde_json::json!([{"name": "grpc", "containerPort": 9002}]),
            serde_json::json!([{"name": "replica", "containerPort": 70000}]),
            serde_json::json!([{"name": "replica", "containerPort": -1}]),
            serde_json::json!([{"name": "replica", "containerPort": 0}]),
        ] {
            assert_eq!(
                peer_addr(&with_ports(ports.clone()), None, 9010).as_deref(),
                Some("10.0.0.2:9010"),
                "{ports}"
            );
        }
    }
}
