//! One `kvpick-sim` process serving one simulated vLLM pod (HTTP, KV events, replay), on
//! ports the kernel picks.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::log_tail::LogTail;
use super::{ready_or_exited, repo_root, workspace_bin};

/// A `kvpick-sim --pods 1` process at 1/100 of real time.
pub struct SimPod {
    child: Child,
    /// Its OpenAI-compatible HTTP server (and `/metrics`).
    pub http: SocketAddr,
    /// Its KV-event PUB port.
    pub events: u16,
    /// Its KV-event replay (ROUTER) port.
    pub replay: u16,
    args: Vec<String>,
}

impl SimPod {
    /// Starts a pod with `args` added to kvpick-sim's (e.g. `--pod-override 0:drop=0.5`).
    ///
    /// Its ports are 0 (the kernel's pick), read back from its "simulated vLLM pod ready"
    /// line: a port found free and passed in can be taken by another test's process first,
    /// and a readiness probe would then reach that one.
    pub async fn start(args: &[&str]) -> SimPod {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let (child, line) = Self::spawn(&args, [0, 0, 0]).await;
        let address = |name: &str| {
            listened(&line, name).unwrap_or_else(|| panic!("no {name} address in {line:?}"))
        };
        SimPod {
            child,
            http: address("http"),
            events: address("events").port(),
            replay: address("replay").port(),
            args,
        }
    }

    /// Spawns kvpick-sim on `ports` (HTTP, events, replay) and waits for its ready line.
    async fn spawn(args: &[String], ports: [u16; 3]) -> (Child, String) {
        let mut child = Command::new(workspace_bin("kvpick-sim"))
            .args(["--pods", "1", "--time-scale", "0.01"])
            .args(["--base-port", &ports[0].to_string()])
            .args(["--events-base-port", &ports[1].to_string()])
            .args(["--replay-base-port", &ports[2].to_string()])
            .arg("--tokenizer")
            .arg(repo_root().join("assets/tokenizer"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvpick-sim");
        // kvpick-sim logs to its standard output.
        let log = LogTail::default();
        if let Some(stdout) = child.stdout.take() {
            log.follow(stdout);
        }
        let mut line = None;
        let ready = ready_or_exited(
            "kvpick-sim's ready line",
            &mut child,
            Duration::from_secs(20),
            || {
                line = log.find(&["simulated vLLM pod ready"]);
                std::future::ready(line.is_some())
            },
        )
        .await;
        match line {
            Some(line) if ready => (child, line),
            _ => panic!("kvpick-sim exited while starting (its log is above)"),
        }
    }

    /// SIGKILL, as a crashed engine: no goodbye on any socket.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill kvpick-sim");
        self.child.wait().expect("reap");
    }

    /// The same pod again, on the same ports.
    pub async fn restart(&mut self) {
        let ports = [self.http.port(), self.events, self.replay];
        self.child = Self::spawn(&self.args, ports).await.0;
    }

    /// Its entry in an endpoints file, as a vLLM engine with KV events and replay.
    pub fn pool_entry(&self) -> String {
        format!(
            "  - address: {}\n    kvEvents: tcp://127.0.0.1:{}\n    kvReplay: tcp://127.0.0.1:{}\n    labels: {{ inference.networking.k8s.io/engine-type: vllm }}\n",
            self.http, self.events, self.replay
        )
    }
}

impl Drop for SimPod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The address of `name` (`http=127.0.0.1:8000` or `events=tcp://127.0.0.1:5557`) in
/// kvpick-sim's ready line.
fn listened(line: &str, name: &str) -> Option<SocketAddr> {
    let key = format!(" {name}=");
    let start = line.find(&key)? + key.len();
    let value = line[start..].split_whitespace().next()?;
    value
        .trim_matches('"')
        .trim_start_matches("tcp://")
        .parse()
        .ok()
}
