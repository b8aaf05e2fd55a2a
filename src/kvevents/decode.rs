//! Decoding of vLLM KV-event messages (DESIGN §3) into typed batches.
//!
//! The decoder and its event types live in the `kvpick-kvevents-wire` crate
//! (`crates/kvevents-wire`), re-exported here unchanged, so it can be fuzzed without building
//! the rest of kvpick. Only what needs kvpick's own types stays here: the topic as a
//! [`PodId`].

use crate::endpoints::PodId;

pub use kvpick_kvevents_wire::*;

/// A parsed topic `kv@<ip:port>@<model>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topic {
    /// The pod that published it.
    pub pod: PodId,
    /// The served model name (may itself contain `@`).
    pub model: String,
}

/// Parses `kv@<ip:port>@<model>` defensively (see [`split_topic`]: the pod is the first
/// `@`-separated part after the prefix that parses as a socket address, the model everything
/// after it). `None` when no part is an address.
pub fn parse_topic(topic: &[u8]) -> Option<Topic> {
    let (addr, model) = split_topic(topic)?;
    Some(Topic {
        pod: PodId(addr),
        model: model.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_parse_into_pods() {
        let t = parse_topic(b"kv@[::1]:80@org@model@v2").unwrap();
        assert_eq!(t.pod.to_string(), "[::1]:80");
        assert_eq!(t.model, "org@model@v2");
        assert!(parse_topic(b"kv@no-address@m").is_none());
    }
}
