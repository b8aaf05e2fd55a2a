//! The identity and static description of one model-server endpoint.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// A model-server endpoint as the gateway dials it: `ip:port`.
///
/// This is the key for everything kvpick knows about a pod (its index entries, metrics,
/// in-flight load); two ports of one pod are two endpoints, as in GIE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(pub SocketAddr);

impl PodId {
    /// The socket address the gateway dials.
    pub fn addr(&self) -> SocketAddr {
        self.0
    }
}

impl fmt::Display for PodId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for PodId {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.trim().parse().map(PodId)
    }
}

/// Label that names the serving engine of an endpoint (`vllm`, `sglang`, `trtllm`).
pub const ENGINE_TYPE_LABEL: &str = "inference.networking.k8s.io/engine-type";

/// One endpoint of the pool, as discovery describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// What the gateway dials.
    pub id: PodId,
    /// The pod's KV-event PUB endpoint (`tcp://host:port`), when it publishes events.
    pub kv_events: Option<String>,
    /// The pod's KV-event replay ROUTER endpoint.
    pub kv_replay: Option<String>,
    /// Free-form labels (engine type, role, …).
    pub labels: BTreeMap<String, String>,
}

impl Endpoint {
    /// An endpoint with no event source and no labels.
    pub fn new(id: PodId) -> Self {
        Self {
            id,
            kv_events: None,
            kv_replay: None,
            labels: BTreeMap::new(),
        }
    }
}
