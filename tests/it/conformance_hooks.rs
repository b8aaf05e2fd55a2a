//! GIE's conformance hooks through real Envoy and the real kvpick binary
//! (`--enable-conformance-hooks`): `test-epp-endpoint-selection` steers the pick, and the
//! endpoint Envoy reports it served from comes back as `x-conformance-test-served-endpoint`.

use crate::support;

use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::send;
use support::kvpick::Kvpick;

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

async fn post(url: &str, selection: Option<&str>) -> support::http::Reply {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(selection) = selection {
        headers.push(("test-epp-endpoint-selection", selection));
    }
    send("POST", url, &headers, BODY.to_vec())
        .await
        .expect("request")
}

fn served(reply: &support::http::Reply) -> &str {
    reply
        .headers
        .get("x-conformance-test-served-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_selection_header_steers_the_pick_and_the_served_endpoint_is_echoed() {
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    let kvpick = Kvpick::start(
        &pool_yaml(&backends.iter().collect::<Vec<_>>()),
        &["--enable-conformance-hooks"],
    )
    .await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            served_endpoint_metadata: true,
            ..Default::default()
        },
    )
    .await;
    let url = envoy.url("/v1/completions");
    let (one, two) = (backends[1].addr, backends[2].addr);

    for i in 0..6 {
        let reply = post(&url, Some(&one.to_string())).await;
        assert_eq!(reply.status, 200, "request {i}: {}", reply.text());
        assert_eq!(served(&reply), one.to_string(), "request {i}");
    }
    assert_eq!(
        backends[1].seen().len(),
        6,
        "every request went to the one selected"
    );

    // Two selected (one as a bare IP would be every backend here, so both as ip:port).
    let pair = format!(" {one} ,{two}");
    for i in 0..6 {
        let reply = post(&url, Some(&pair)).await;
        assert_eq!(reply.status, 200, "request {i}: {}", reply.text());
        let at = served(&reply);
        assert!(
            at == one.to_string() || at == two.to_string(),
            "served by {at}"
        );
    }
    assert!(
        backends[0].seen().is_empty(),
        "the unselected backend got requests"
    );

    // Nothing live selected: 503, saying why.
    let reply = post(&url, Some("127.0.0.1:1")).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(
        reply.text().contains("test-epp-endpoint-selection"),
        "{}",
        reply.text()
    );

    // Without the header the whole pool is eligible, and the echo still comes.
    let reply = post(&url, None).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        backends
            .iter()
            .any(|b| served(&reply) == b.addr.to_string()),
        "echo `{}`",
        served(&reply)
    );
}
