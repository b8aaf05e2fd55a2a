//! The real `kvpick` binary as a child process.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::log_tail::LogTail;
use super::{ready_or_exited, workspace_bin};

/// The kvpick binary: cargo's own path in kvpick's tests, else the workspace's build of it.
fn kvpick_bin() -> PathBuf {
    option_env!("CARGO_BIN_EXE_kvpick")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_bin("kvpick"))
}

/// Runs `kvpick serve <args>` (with `envs` set) and returns its stderr, after checking that
/// it refused to start.
pub fn serve_refused(args: &[&str], envs: &[(&str, &str)]) -> String {
    let output = Command::new(kvpick_bin())
        .arg("serve")
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("run kvpick");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{args:?} must not start");
    stderr
}

pub struct Kvpick {
    pub child: Child,
    log: LogTail,
    pub grpc_port: u16,
    pub health_port: u16,
    pub metrics_port: u16,
    pub debug_port: u16,
    pub pool_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl Kvpick {
    /// Starts kvpick on free ports with `pool_yaml` as its endpoints file and waits until
    /// it reports ready. Every server binds 127.0.0.1 unless `extra_args` names
    /// `--bind-address` (the debug server keeps its loopback default either way).
    ///
    /// Every port is the kernel's pick (port 0), read back from kvpick's log.
    pub async fn start(pool_yaml: &str, extra_args: &[&str]) -> Kvpick {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool_file = dir.path().join("pool.yaml");
        std::fs::write(&pool_file, pool_yaml).expect("write pool");
        let source = [
            "--endpoints-file".to_owned(),
            pool_file.display().to_string(),
            "--endpoints-reload-interval".to_owned(),
            "100ms".to_owned(),
        ];
        Self::launch(dir, pool_file, &source, extra_args, &[], "readiness").await
    }

    /// Starts kvpick with Kubernetes discovery against the API server `kubeconfig` points
    /// at (`source_args`: `--pool-name …` or `--endpoint-selector …`), and waits only until
    /// it is live: readiness depends on what the API holds.
    pub async fn start_kube(
        kubeconfig: &std::path::Path,
        source_args: &[&str],
        extra_args: &[&str],
    ) -> Kvpick {
        Self::start_kube_env(kubeconfig, source_args, extra_args, &[]).await
    }

    /// [`Kvpick::start_kube`] with more environment variables (e.g. `POD_NAME`).
    pub async fn start_kube_env(
        kubeconfig: &std::path::Path,
        source_args: &[&str],
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Kvpick {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool_file = dir.path().join("unused-pool.yaml");
        let source: Vec<String> = source_args.iter().map(|s| (*s).to_owned()).collect();
        let mut all = vec![("KUBECONFIG", kubeconfig.display().to_string())];
        all.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
        Self::launch(dir, pool_file, &source, extra_args, &all, "liveness").await
    }

    async fn launch(
        dir: tempfile::TempDir,
        pool_file: PathBuf,
        source_args: &[String],
        extra_args: &[&str],
        env: &[(&str, String)],
        wait_for: &'static str,
    ) -> Kvpick {
        // NOTE: a port a test passes itself (`--kv-events-bind`, found free) can be taken
        // by another test's process before kvpick binds it; kvpick then exits at once and
        // is started again (a few times) instead of failing the test.
        for _ in 0..4 {
            let mut command = Command::new(kvpick_bin());
            command.arg("serve");
            if !extra_args.contains(&"--bind-address") {
                command.args(["--bind-address", "127.0.0.1"]);
            }
            // Port 0 for kvpick's own servers: the kernel picks ports no other process
            // holds, and kvpick's "kvpick listening" line says which (a port found free and
            // passed in can be taken by another test's process first, and a readiness probe
            // would then reach that one).
            let mut child = command
                .args(["--grpc-port", "0"])
                .args(["--grpc-health-port", "0"])
                .args(["--metrics-port", "0"])
                .args(["--debug-port", "0"])
                .args(source_args)
                .args(extra_args)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .env("RUST_LOG", "kvpick=debug,info")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn kvpick");
            let log = LogTail::default();
            if let Some(stderr) = child.stderr.take() {
                log.follow(stderr);
            }
            let mut line = None;
            let listening = ready_or_exited(
                "kvpick's listening line",
                &mut child,
                Duration::from_secs(20),
                || {
                    line = log.find(&["kvpick listening"]);
                    std::future::ready(line.is_some())
                },
            )
            .await;
            let ports = match line {
                Some(line) if listening => Ports::read(&line),
                _ => {
                    exited_for_a_taken_port(&log).await;
                    continue;
                }
            };
            let ready =
                ready_or_exited(
                    "kvpick readiness",
                    &mut child,
                    Duration::from_secs(20),
                    || async move {
                        health(ports.health, wait_for).await == Some(ServingStatus::Serving)
                    },
                )
                .await;
            if !ready {
                exited_for_a_taken_port(&log).await;
                continue;
            }
            return Kvpick {
                child,
                log,
                grpc_port: ports.grpc,
                health_port: ports.health,
                metrics_port: ports.metrics,
                debug_port: ports.debug,
                pool_file,
                _dir: dir,
            };
        }
        panic!("kvpick did not start in 4 attempts");
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let pid = self.child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits (bounded) for the process to exit and returns its exit code.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("kvpick did not exit within {limit:?}");
    }

    pub fn metrics_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.metrics_port)
    }

    /// Replaces the pool file in one step (a sibling file renamed over it, as editors and
    /// ConfigMap updates do), so kvpick's watcher never reads it half-written.
    pub fn write_pool(&self, yaml: &str) {
        let staged = self.pool_file.with_extension("yaml.new");
        std::fs::write(&staged, yaml).expect("stage pool file");
        std::fs::rename(&staged, &self.pool_file).expect("replace pool file");
    }

    /// kvpick's `/metrics` page.
    pub async fn metrics_text(&self) -> String {
        super::http::send("GET", &self.metrics_url("/metrics"), &[], Vec::new())
            .await
            .expect("/metrics")
            .text()
    }

    /// The value of a metric series (`name{labels}` exactly as exposed), 0 when absent.
    pub async fn metric(&self, series: &str) -> f64 {
        self.metrics_text()
            .await
            .lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    /// A `/proc/PID/status` figure of kvpick (`VmHWM:` peak, `VmRSS:` now), in KiB.
    pub fn status_kib(&self, key: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect(key)
    }

    /// Waits (bounded) for a log line holding every one of `needles` and returns it.
    pub async fn wait_log(&self, needles: &[&str]) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(line) = self.log.find(needles) {
                return line;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no kvpick log line holds all of {needles:?}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Whether a log line holding every one of `needles` has been written so far.
    pub fn logged(&self, needles: &[&str]) -> bool {
        self.log.find(needles).is_some()
    }

    /// A URL on the debug server (`/debug/*`).
    pub fn debug_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.debug_port)
    }
}

impl Drop for Kvpick {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The gRPC health status of `service` on `port`, or `None` when unreachable.
pub async fn health(port: u16, service: &str) -> Option<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut client = HealthClient::new(channel);
    let response = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(response.into_inner().status).ok()
}

/// The ports kvpick's servers listen on, from its "kvpick listening" line.
#[derive(Clone, Copy)]
struct Ports {
    grpc: u16,
    health: u16,
    metrics: u16,
    debug: u16,
}

impl Ports {
    fn read(line: &str) -> Ports {
        let port = |name: &str| {
            listening_port(line, name).unwrap_or_else(|| panic!("no {name} address in {line:?}"))
        };
        Ports {
            grpc: port("grpc"),
            health: port("health"),
            metrics: port("metrics"),
            debug: port("debug"),
        }
    }
}

/// Returns when kvpick's log (read to its end: the process has exited) says a port was
/// taken; panics on any other reason to exit.
async fn exited_for_a_taken_port(log: &LogTail) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if log.find(&["Address already in use"]).is_some() {
            eprintln!("kvpick: a port was taken; starting it again");
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("kvpick exited while starting (its log is above)");
}

/// The port of `name`'s address in kvpick's "kvpick listening" line, in either log format:
/// `grpc=127.0.0.1:9002` (text) or `"grpc":"127.0.0.1:9002"` (JSON).
fn listening_port(line: &str, name: &str) -> Option<u16> {
    let text = format!(" {name}=");
    let json = format!("\"{name}\":\"");
    let start = line
        .find(&text)
        .map(|at| at + text.len())
        .or_else(|| line.find(&json).map(|at| at + json.len()))?;
    let address = line[start..]
        .split(|c: char| c.is_whitespace() || c == '"' || c == ',')
        .next()?;
    address
        .parse::<std::net::SocketAddr>()
        .ok()
        .map(|a| a.port())
}
