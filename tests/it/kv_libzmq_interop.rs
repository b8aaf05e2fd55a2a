//! kvpick's own ZMTP transport against real libzmq (pyzmq 27.3 in the project venv, the
//! library vLLM publishes with): the real `kvpick` binary subscribes to a libzmq PUB and
//! repairs lost batches from a libzmq ROUTER, ending with the same index as applying the real
//! vLLM capture in order.

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use support::http::send;
use support::kvpick::Kvpick;
use support::{fixtures, free_port, repo_root, wait_until};

/// The libzmq publisher script as a child process; killed on drop.
struct LibzmqPublisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub_endpoint: String,
    router_endpoint: String,
}

impl LibzmqPublisher {
    fn start() -> Self {
        let python = repo_root().join(".venv/bin/python");
        assert!(
            python.exists(),
            "no {}: run scripts/setup-venv.sh (scripts/test.sh does)",
            python.display()
        );
        let mut child = Command::new(python)
            .arg(repo_root().join("tests/support/py/libzmq_publisher.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the libzmq publisher");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut endpoint = |kind: &str| {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read endpoint");
            line.trim()
                .strip_prefix(kind)
                .unwrap_or_else(|| panic!("expected `{kind} …`, got {line:?}"))
                .trim()
                .to_owned()
        };
        let pub_endpoint = endpoint("PUB");
        let router_endpoint = endpoint("ROUTER");
        Self {
            child,
            stdin,
            stdout,
            pub_endpoint,
            router_endpoint,
        }
    }

    /// Publishes the capture folder as seqs 0.., losing `lost` on the wire; returns how many.
    fn publish(&mut self, folder: &str, topic: &str, lost: &[u64]) -> u64 {
        let lost = if lost.is_empty() {
            "-".to_owned()
        } else {
            lost.iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let dir = fixtures().join(folder);
        writeln!(self.stdin, "publish {} {topic} {lost}", dir.display()).expect("command");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("reply");
        line.trim()
            .strip_prefix("published ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected reply {line:?}"))
    }
}

impl Drop for LibzmqPublisher {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn pod_view(kvpick: &Kvpick) -> serde_json::Value {
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("/debug/pods")
        .json();
    pods["pods"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvpick_subscribes_and_replays_over_real_libzmq() {
    let mut publisher = LibzmqPublisher::start();
    let pod = format!("127.0.0.1:{}", free_port());
    let pool = format!(
        "endpoints:\n  - address: {pod}\n    kvEvents: {}\n    kvReplay: {}\n",
        publisher.pub_endpoint, publisher.router_endpoint
    );
    let kvpick = Kvpick::start(&pool, &[]).await;
    wait_until("kvpick subscribed", Duration::from_secs(10), || async {
        pod_view(&kvpick).await["kv_events"]["connected"] == true
    })
    .await;

    // Batches 20–25 and 40 never reach the wire; kvpick must fetch them from the ROUTER.
    let published = tokio::task::block_in_place(|| {
        publisher.publish(
            "vllm-0.32-kv-events",
            &format!("kv@{pod}@tiny"),
            &[20, 21, 22, 23, 24, 25, 40],
        )
    });
    assert_eq!(published, 68);
    wait_until("the capture applied", Duration::from_secs(15), || async {
        let view = pod_view(&kvpick).await;
        view["kv_events"]["last_seq"] == 67 && view["index_blocks"] == 62
    })
    .await;
    let view = pod_view(&kvpick).await;
    let events = &view["kv_events"];
    assert!(events["gaps"].as_u64().unwrap() >= 2, "{view}");
    assert!(events["replays"].as_u64().unwrap() >= 2, "{view}");
    assert_eq!(events["clears"], 0, "replay covered every gap: {view}");
    assert_eq!(events["malformed"], 0, "{view}");
}
