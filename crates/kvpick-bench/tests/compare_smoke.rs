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
    assert!(log.contains("Ran 28 tests"), "{log}");
    // The venv has inference-perf, so the seeded-arrivals test must have run, not skipped.
    assert!(!log.contains("skipped"), "{log}");
}

/// `--mode smoke`: 2 pods with full caches (together they hold 60% of the groups' prefixes),
/// round robin, kvpick (recommended profile) and smg cache_aware (the approximate router),
/// one Poisson stage.
#[test]
fn smoke_run_serves_every_request_and_kvpick_hits_at_least_as_often_as_the_approximate_router() {
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
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("compare-smoke");
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = Command::new(bench_python())
        .arg("bench/compare.py")
        .args(["--mode", "smoke"])
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
    let rows = summary["rows"].as_array().expect("rows");
    let row = |system: &str| {
        rows.iter()
            .find(|r| r["system"] == system)
            .unwrap_or_else(|| panic!("no row for {system}: {log}"))
    };
    // Requests the pods finished, summed over `requests_per_pod` (a row's or a system's).
    let finished = |r: &serde_json::Value| -> u64 {
        r["requests_per_pod"]
            .as_array()
            .expect("requests_per_pod")
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .sum()
    };
    let (rr, kvpick, smg) = (
        row("round-robin"),
        row("kvpick-recommended"),
        row("smg-cache-aware"),
    );
    for r in [rr, kvpick, smg] {
        let requests = r["requests"].as_u64().expect("requests");
        // One 10 s stage at 8 req/s: about 80 Poisson arrivals (the seeded draw is the same
        // for every system).
        assert!(requests >= 40, "{r}");
        assert_eq!(r["failures"], 0, "every request succeeded: {r}");
        assert_eq!(
            finished(r),
            requests,
            "the pods finished every request: {r}"
        );
    }
    assert_eq!(
        rr["requests"], kvpick["requests"],
        "the same seeded workload"
    );
    // The pods' request logs saw every request of the 7 groups (each group's first is not a
    // repeat), and smg never moves a group it has placed.
    let systems = summary["systems"].as_array().expect("systems");
    for system in systems {
        let placement = &system["placement"];
        let requests = finished(system);
        assert_eq!(placement["prefixes"], 7, "{system}");
        assert_eq!(
            placement["repeat_requests"].as_u64(),
            Some(requests - 7),
            "{system}"
        );
        if system["system"] == "smg-cache-aware" {
            assert_eq!(placement["prefix_moves"], 0, "{system}");
        }
    }
    assert_eq!(
        smg["requests"], kvpick["requests"],
        "the same seeded workload"
    );
    let hit = |r: &serde_json::Value| r["engine_hit_rate"].as_f64().expect("engine_hit_rate");
    assert!(
        hit(kvpick) > hit(rr),
        "kvpick's engine-side prefix hit rate {} must beat round robin's {}",
        hit(kvpick),
        hit(rr)
    );
    // kvpick knows what each pod holds; smg guesses from its own routing history and keeps
    // each group on the pod it first chose (a fixed 4 + 3 split of the 7 groups, whose 4-group
    // pod thrashes). Measured here with 80 requests (session 10, five runs, two of them with
    // two busy cores beside): kvpick 0.597–0.640, smg 0.585 every time. With 40 requests it
    // was a coin toss (kvpick 0.49–0.58, smg 0.54–0.58, a CI run failed on 0.49 vs 0.54):
    // the first pass over the 28 prompts, cold for every router, was a third of the run.
    // With coldDecodeWeight 1 (session 10's default, three runs): kvpick 0.618–0.662. But a
    // CI run beside the rest of the suite gave 0.5625, and session 11 measured 0.56–0.64 on
    // a quiet machine (evicted groups wandered: 10–13 moves). With prefix homes (an evicted
    // prefix returns where it was routed) and this test running alone (.config/nextest.toml):
    // kvpick 0.60–0.64 in nine runs, 0–3 moves.
    // NOTE: the bound allows one request's worth of queries (1/requests): kvpick's placement
    // depends on when KV events and first bytes arrive, so a request may land differently
    // from run to run.
    let one_request = 1.0 / kvpick["requests"].as_f64().expect("requests");
    assert!(
        hit(kvpick) >= hit(smg) - one_request,
        "kvpick's engine-side prefix hit rate {} must be at least smg cache_aware's {}",
        hit(kvpick),
        hit(smg)
    );
    for plot in [
        "ttft_cdf.png",
        "ttft_p90_vs_rate.png",
        "output_tps_vs_rate.png",
    ] {
        let bytes = std::fs::read(out_dir.join(plot)).expect(plot);
        assert!(bytes.starts_with(b"\x89PNG"), "{plot} is a PNG");
    }
}
