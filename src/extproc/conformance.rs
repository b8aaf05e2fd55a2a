//! The hooks GIE's conformance suite steers an endpoint picker with (only with
//! `--enable-conformance-hooks`; DESIGN §9, llm-d-router's test plugins):
//! - request header `test-epp-endpoint-selection: 10.0.0.7,10.0.0.8:3002` restricts the pick
//!   to those endpoints (an `ip` entry matches every port of that IP, an `ip:port` entry
//!   only that port; bracketed IPv6 is accepted);
//! - on the response headers, the endpoint the gateway reports it served the request from
//!   (`envoy.lb` metadata `x-gateway-destination-endpoint-served`) is echoed to the client
//!   as `x-conformance-test-served-endpoint`, or `fail: …` saying what was missing.
//!
//! NOTE: without the header the pick is not restricted (llm-d's test filter would return no
//! endpoint); a conformance test that wants a restriction sends it, and everything else
//! routes normally while the hooks are on.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use crate::pb::envoy::config::core::v3::Metadata;
use crate::pb::google::protobuf::value::Kind;

/// The request header naming the endpoints a conformance test allows.
pub const SELECTION_HEADER: &str = "test-epp-endpoint-selection";
/// The response header the served endpoint is echoed in.
pub const SERVED_ECHO_HEADER: &str = "x-conformance-test-served-endpoint";
/// The filter-metadata namespace the gateway reports the served endpoint in.
pub const SERVED_NAMESPACE: &str = "envoy.lb";
/// The key of the served endpoint in [`SERVED_NAMESPACE`].
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// The endpoints a `test-epp-endpoint-selection` header allows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointSelection {
    ips: HashSet<IpAddr>,
    addrs: HashSet<SocketAddr>,
}

impl EndpointSelection {
    /// Parses the header's comma-separated entries; an entry that is neither `ip` nor
    /// `ip:port` matches nothing.
    pub fn parse(value: &str) -> Self {
        let mut selection = Self::default();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if let Ok(addr) = entry.parse::<SocketAddr>() {
                selection.addrs.insert(addr);
            } else if let Ok(ip) = entry.trim_matches(['[', ']']).parse::<IpAddr>() {
                selection.ips.insert(ip);
            }
        }
        selection
    }

    /// Whether the endpoint at `addr` may be picked.
    pub fn allows(&self, addr: SocketAddr) -> bool {
        self.ips.contains(&addr.ip()) || self.addrs.contains(&addr)
    }
}

/// The value of [`SERVED_ECHO_HEADER`] for a response-headers message's metadata: the served
/// endpoint, or why there is none (llm-d's wording).
pub fn served_echo(metadata: Option<&Metadata>) -> String {
    let Some(namespace) = metadata.and_then(|m| m.filter_metadata.get(SERVED_NAMESPACE)) else {
        return "fail: missing envoy lb metadata".to_owned();
    };
    match namespace
        .fields
        .get(SERVED_KEY)
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StringValue(served)) => served.clone(),
        _ => "fail: missing destination endpoint served metadata".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::google::protobuf::{Struct, Value};

    #[test]
    fn entries_are_ips_or_exact_ip_ports() {
        let selection = EndpointSelection::parse(
            " 10.0.0.7, 10.0.0.8:3002,[fd00::1]:3000,fd00::2,[fd00::3],junk,",
        );
        let allows = |a: &str| selection.allows(a.parse().expect("addr"));
        assert!(
            allows("10.0.0.7:8000") && allows("10.0.0.7:8001"),
            "an IP allows every port"
        );
        assert!(
            allows("10.0.0.8:3002") && !allows("10.0.0.8:3003"),
            "ip:port only that port"
        );
        assert!(allows("[fd00::1]:3000") && !allows("[fd00::1]:3001"));
        assert!(allows("[fd00::2]:1") && allows("[fd00::3]:1"));
        assert!(!allows("10.0.0.9:8000"));
        assert_eq!(
            EndpointSelection::parse("junk"),
            EndpointSelection::default()
        );
    }

    #[test]
    fn the_served_endpoint_is_echoed_or_the_missing_piece_named() {
        let with = |fields: Vec<(&str, &str)>| Metadata {
            filter_metadata: [(
                SERVED_NAMESPACE.to_owned(),
                Struct {
                    fields: fields
                        .into_iter()
                        .map(|(k, v)| {
                            (
                                k.to_owned(),
                                Value {
                                    kind: Some(Kind::StringValue(v.to_owned())),
                                },
                            )
                        })
                        .collect(),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        assert_eq!(
            served_echo(Some(&with(vec![(SERVED_KEY, "10.0.0.7:8000")]))),
            "10.0.0.7:8000"
        );
        assert_eq!(
            served_echo(Some(&with(vec![("other", "x")]))),
            "fail: missing destination endpoint served metadata"
        );
        assert_eq!(served_echo(None), "fail: missing envoy lb metadata");
    }
}
