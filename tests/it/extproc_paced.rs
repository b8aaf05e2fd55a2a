//! The shipped Envoy config's observing filter on a cluster of its own, whose connections
//! kvpick reads at a pace (`--observe-read-pace`, src/app/paced_socket.rs): through a real
//! Envoy, the real kvpick binary and a real backend, held responses are followed to their
//! end over the paced connection, and kvpick counts the gateway's connections by what they
//! carried.

use crate::support;

use std::time::Duration;

use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::post_json;
use support::kvpick::Kvpick;

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

#[tokio::test]
async fn observing_streams_have_paced_connections_of_their_own_and_follow_responses_to_their_end() {
    let a = Backend::start("127.0.0.1").await;
    // A pace far above the default, so that a message the pace lost would show.
    let kvpick = Kvpick::start(&pool_yaml(&[&a]), &["--observe-read-pace", "50ms"]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let in_flight = format!(
        "kvpick_endpoint_in_flight_requests{{endpoint=\"{}\"}}",
        a.addr
    );

    // Three responses held open after their first chunk: each counts on the pod until its
    // observing stream sees it end.
    let url = envoy.url("/hold");
    let held: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post_json(&url, BODY).await })
        })
        .collect();
    support::wait_until(
        "the three held requests at the backend",
        Duration::from_secs(10),
        || {
            let a = a.clone();
            async move { a.seen().len() == 3 }
        },
    )
    .await;
    assert_eq!(kvpick.metric(&in_flight).await, 3.0);
    // Envoy (one worker) holds one connection per cluster: the routing filter's and the
    // observing filter's, the latter paced. (Waited for: Envoy does not wait for kvpick to
    // read an observing message before it forwards the request.)
    let connections = || async {
        let routing = kvpick
            .metric("kvpick_extproc_connections{carried=\"routing\"}")
            .await;
        let observing = kvpick
            .metric("kvpick_extproc_connections{carried=\"observing\"}")
            .await;
        (routing, observing)
    };
    support::wait_until(
        "a routing and an observing connection",
        Duration::from_secs(5),
        || async { connections().await == (1.0, 1.0) },
    )
    .await;

    a.release();
    for request in held {
        let reply = request.await.expect("join");
        assert_eq!(reply.status, 200);
        assert_eq!(reply.text(), "data: first\n\ndata: [DONE]\n\n");
    }
    support::wait_until(
        "every response's end observed",
        Duration::from_secs(5),
        || async { kvpick.metric(&in_flight).await == 0.0 },
    )
    .await;
    assert_eq!(
        kvpick
            .metric("kvpick_extproc_observed_streams_total{result=\"observed\"}")
            .await,
        3.0
    );
}
