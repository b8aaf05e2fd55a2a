//! The gateway's subset hint: filter metadata
//! `envoy.lb.subset_hint["x-gateway-destination-endpoint-subset"]` = list of `ip:port`.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use crate::pb::envoy::config::core::v3::Metadata;
use crate::pb::google::protobuf::value::Kind;

/// Filter-metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset list inside the namespace.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The IPs the gateway allows for this request. Matching is on IP, as GIE does: a pod's
/// other ports are the same pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubsetHint {
    ips: HashSet<IpAddr>,
}

impl SubsetHint {
    /// Whether an endpoint at `addr` may be picked.
    pub fn allows(&self, addr: SocketAddr) -> bool {
        self.ips.contains(&addr.ip())
    }
}

/// Reads the subset hint; `None` when the gateway sent none (pick from the whole pool).
/// An entry that is neither `ip` nor `ip:port` matches nothing.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<SubsetHint> {
    let namespace = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = namespace.fields.get(SUBSET_KEY)?;
    let entries: Vec<&str> = match value.kind.as_ref()? {
        Kind::ListValue(list) => list
            .values
            .iter()
            .filter_map(|v| match v.kind.as_ref() {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            })
            .collect(),
        // Some gateways send a comma-separated string instead of a list.
        Kind::StringValue(s) => s.split(',').collect(),
        _ => Vec::new(),
    };
    let ips = entries
        .into_iter()
        .filter_map(|entry| {
            let entry = entry.trim();
            entry
                .parse::<SocketAddr>()
                .map(|a| a.ip())
                .or_else(|_| entry.parse::<IpAddr>())
                .ok()
        })
        .collect();
    Some(SubsetHint { ips })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::google::protobuf::{ListValue, Struct, Value};

    fn metadata(kind: Kind) -> Metadata {
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(SUBSET_KEY.to_owned(), Value { kind: Some(kind) });
        let mut filter_metadata = std::collections::HashMap::new();
        filter_metadata.insert(SUBSET_NAMESPACE.to_owned(), Struct { fields });
        Metadata {
            filter_metadata,
            ..Default::default()
        }
    }

    fn list(items: &[&str]) -> Kind {
        Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).to_owned())),
                })
                .collect(),
        })
    }

    #[test]
    fn absent_hint_means_whole_pool() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
    }

    #[test]
    fn matches_on_ip_and_ignores_junk() {
        let hint = subset_hint(Some(&metadata(list(&[
            "10.0.0.1:8000",
            "10.0.0.2",
            "junk",
        ]))))
        .expect("hint");
        assert!(hint.allows("10.0.0.1:9999".parse().expect("addr")));
        assert!(hint.allows("10.0.0.2:8000".parse().expect("addr")));
        assert!(!hint.allows("10.0.0.3:8000".parse().expect("addr")));
        let empty = subset_hint(Some(&metadata(list(&[])))).expect("empty hint");
        assert!(!empty.allows("10.0.0.1:8000".parse().expect("addr")));
        let csv = subset_hint(Some(&metadata(Kind::StringValue(
            "10.0.0.4:1, 10.0.0.5:1".into(),
        ))))
        .expect("csv");
        assert!(csv.allows("10.0.0.5:1".parse().expect("addr")));
    }
}
