//! Leader election (`--ha-enable-leader-election`) through real `kvpick serve` replicas and
//! one fake API server holding the Lease: exactly one replica reports ready (the others stay
//! live), a killed leader is replaced within the lease duration, and a leader that shuts
//! down releases the Lease so a standby takes over at once.

use crate::fake_kube;
use crate::k8s_discovery::{NS, V1, pod, pool_v1};
use crate::support;

use std::time::{Duration, Instant};

use fake_kube::{FakeKube, LEASES, pool_resource};
use support::kvpick::{Kvpick, health};
use tonic_health::pb::health_check_response::ServingStatus;

const LEASE: &str = "epp-llm-pool.llm-d.ai";
const LEASE_DURATION: Duration = Duration::from_secs(3);
const RETRY: Duration = Duration::from_millis(300);

async fn replica(fake: &FakeKube) -> Kvpick {
    Kvpick::start_kube(
        &fake.kubeconfig(NS),
        &["--pool-name", "pool", "--pool-namespace", NS],
        &[
            "--ha-enable-leader-election",
            "--ha-lease-duration",
            "3s",
            "--ha-renew-deadline",
            "2s",
            "--ha-retry-period",
            "300ms",
            "--drain-timeout",
            "1s",
        ],
    )
    .await
}

async fn ready(kvpick: &Kvpick) -> bool {
    health(kvpick.health_port, "readiness").await == Some(ServingStatus::Serving)
}

/// Which replicas report ready now.
async fn serving(replicas: &[&Kvpick]) -> Vec<usize> {
    let mut ready_ones = Vec::new();
    for (i, kvpick) in replicas.iter().enumerate() {
        if ready(kvpick).await {
            ready_ones.push(i);
        }
    }
    ready_ones
}

/// Waits until exactly one replica is ready and returns it, then checks that it stays the
/// only one for a few retry periods.
async fn one_leader(replicas: &[&Kvpick], step: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(15);
    let leader = loop {
        let now = serving(replicas).await;
        if let [one] = now.as_slice() {
            break *one;
        }
        assert!(Instant::now() < deadline, "{step}: ready replicas {now:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let stable = Instant::now() + RETRY * 5;
    while Instant::now() < stable {
        assert_eq!(serving(replicas).await, vec![leader], "{step}: one leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (i, kvpick) in replicas.iter().enumerate() {
        assert_eq!(
            health(kvpick.health_port, "liveness").await,
            Some(ServingStatus::Serving),
            "{step}: every replica stays live"
        );
        let want = if i == leader { 1.0 } else { 0.0 };
        assert_eq!(
            leader_gauge(kvpick).await,
            Some(want),
            "{step}: kvpick_leader of replica {i}"
        );
    }
    leader
}

/// `kvpick_leader` from the replica's /metrics.
async fn leader_gauge(kvpick: &Kvpick) -> Option<f64> {
    let text = support::http::send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .ok()?
        .text();
    text.lines()
        .find_map(|line| line.strip_prefix("kvpick_leader ")?.parse().ok())
}

fn holder(fake: &FakeKube) -> Option<String> {
    fake.object(LEASES, NS, LEASE)?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_and_a_standby_takes_over_when_it_dies_or_leaves() {
    let fake = FakeKube::start().await;
    fake.apply("pods", pod("a", Some("127.0.0.2"), "vllm", true));
    fake.apply(&pool_resource(V1), pool_v1("vllm", &[8000]));
    let mut a = replica(&fake).await;
    let b = replica(&fake).await;

    let first = one_leader(&[&a, &b], "two replicas").await;
    let lease = fake.object(LEASES, NS, LEASE).expect("the Lease exists");
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 3);
    let first_holder = holder(&fake).expect("a holder");

    // Kill the leader (no release): the standby takes over once the lease has gone
    // unrenewed for its duration, as it observed it.
    let (mut leader, standby) = if first == 0 { (a, b) } else { (b, a) };
    let killed = Instant::now();
    leader.child.kill().expect("kill the leader");
    let _ = leader.child.wait();
    support::wait_until("the standby takes over", LEASE_DURATION * 3, || async {
        ready(&standby).await
    })
    .await;
    let takeover = killed.elapsed();
    assert!(
        takeover >= LEASE_DURATION - RETRY * 2,
        "took over after {takeover:?}, before the lease could expire"
    );
    assert!(
        takeover <= LEASE_DURATION + RETRY * 4,
        "took over after {takeover:?}, lease duration {LEASE_DURATION:?}"
    );
    let second_holder = holder(&fake).expect("a holder");
    assert_ne!(second_holder, first_holder);
    assert_eq!(
        fake.object(LEASES, NS, LEASE).expect("lease")["spec"]["leaseTransitions"],
        1
    );

    // A third replica stays standby; the leader shuts down gracefully and releases the
    // Lease, so the standby takes over well before the lease duration.
    a = replica(&fake).await;
    let mut old_leader = standby;
    assert_eq!(one_leader(&[&old_leader, &a], "a new standby").await, 0);
    let released = Instant::now();
    old_leader.terminate();
    support::wait_until("the new standby takes over", LEASE_DURATION * 2, || async {
        ready(&a).await
    })
    .await;
    let takeover = released.elapsed();
    assert!(
        takeover < LEASE_DURATION - RETRY,
        "took over after {takeover:?}: the Lease was not released"
    );
    assert_eq!(old_leader.wait_exit(Duration::from_secs(15)).await, Some(0));
    assert_ne!(holder(&fake), Some(second_holder));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_finds_another_holder_steps_back_until_that_lease_expires() {
    let fake = FakeKube::start().await;
    fake.apply("pods", pod("a", Some("127.0.0.2"), "vllm", true));
    fake.apply(&pool_resource(V1), pool_v1("vllm", &[8000]));
    let kvpick = replica(&fake).await;
    assert_eq!(one_leader(&[&kvpick], "alone").await, 0);

    // Another writer takes the Lease behind kvpick's back (its cached resourceVersion is
    // now stale: its next renewal conflicts, or its next read sees the other holder).
    let mut lease = fake.object(LEASES, NS, LEASE).expect("lease");
    lease["spec"]["holderIdentity"] = serde_json::json!("intruder");
    lease["spec"]["renewTime"] = serde_json::json!("2026-01-01T00:00:00.000000Z");
    fake.apply(LEASES, lease);
    let taken = Instant::now();
    support::wait_until("kvpick steps back", RETRY * 10, || async {
        !ready(&kvpick).await
    })
    .await;
    // The intruder never renews: kvpick takes the Lease back after the lease duration of
    // its own clock (not the record's old renewTime).
    support::wait_until("kvpick leads again", LEASE_DURATION * 3, || async {
        ready(&kvpick).await
    })
    .await;
    assert!(
        taken.elapsed() >= LEASE_DURATION - RETRY,
        "took the lease back after {:?}",
        taken.elapsed()
    );
    assert_ne!(holder(&fake).as_deref(), Some("intruder"));
}

#[test]
fn leader_election_flags_are_validated_at_start() {
    let pool = ["--pool-name", "pool", "--ha-enable-leader-election=true"];
    let cases: [(Vec<&str>, &str); 4] = [
        (
            vec![
                "--endpoints-file",
                "pool.yaml",
                "--ha-enable-leader-election",
            ],
            "--ha-enable-leader-election: applies to Kubernetes discovery",
        ),
        (
            [&pool[..], &["--ha-renew-deadline", "20s"]].concat(),
            "--ha-renew-deadline: must be less than --ha-lease-duration",
        ),
        (
            [&pool[..], &["--ha-lease-duration", "1500ms"]].concat(),
            "--ha-lease-duration: must be whole seconds",
        ),
        (
            [&pool[..], &["--ha-retry-period", "9s"]].concat(),
            "--ha-retry-period",
        ),
    ];
    for (args, want) in cases {
        let stderr = support::kvpick::serve_refused(&args, &[("KUBECONFIG", "/nonexistent")]);
        assert!(stderr.contains(want), "{args:?}: stderr {stderr}");
    }
}
