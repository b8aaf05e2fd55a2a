//! Flag parsing and validation of `kvpick serve`.

use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn parse(args: &[&str]) -> Result<ServeConfig, ConfigError> {
    let mut argv = vec!["kvpick"];
    argv.extend_from_slice(args);
    Cli::parse_from(argv).serve.validate()
}

#[test]
fn gie_defaults() {
    let config = parse(&["--endpoints-file", "pool.yaml"]).expect("valid");
    assert_eq!(config.grpc_addr.port(), 9002);
    assert_eq!(config.health_addr.port(), 9003);
    assert_eq!(config.metrics_addr.port(), 9090);
    assert_eq!(config.debug_addr.to_string(), "127.0.0.1:9091");
    assert!(config.metrics_bearer_token.is_none());
    assert_eq!(config.max_body_bytes, 16 * 1024 * 1024);
    assert_eq!(config.scrape.interval, Duration::from_millis(50));
    assert_eq!(config.scrape.staleness, Duration::from_millis(200));
    assert!(config.tokenizers.default_dir.is_none());
}

#[test]
fn model_rewrite_file_is_validated_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "rules:\n- matches: [alias]\n  targets: [{modelRewrite: real}]\n",
    )
    .expect("write");
    let config = parse(&[
        "--endpoints-file",
        "p",
        "--model-rewrites",
        good.to_str().expect("utf8"),
    ])
    .expect("valid");
    assert_eq!(config.model_rewrites.pick("alias", 0), Some("real"));
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "rules:\n- match: [alias]\n").expect("write");
    let error = parse(&[
        "--endpoints-file",
        "p",
        "--model-rewrites",
        bad.to_str().expect("utf8"),
    ])
    .expect_err("invalid");
    assert!(error.to_string().contains("match"), "{error}");
}

#[test]
fn tokenizer_and_lora_flags() {
    let config = parse(&[
        "--endpoints-file",
        "p",
        "--tokenizer",
        "/nonexistent/default",
        "--tokenizer",
        "llama=/nonexistent/llama",
        "--lora",
        "sql-adapter=llama",
        "--objective",
        "critical=10",
        "--objective",
        "batch=-1",
    ])
    .expect("valid");
    assert_eq!(config.objectives.get("critical"), Some(&10));
    assert_eq!(config.objectives.get("batch"), Some(&-1));
    assert_eq!(
        config.tokenizers.default_dir.as_deref(),
        Some(std::path::Path::new("/nonexistent/default"))
    );
    assert_eq!(config.tokenizers.models.len(), 1);
    assert_eq!(
        config.tokenizers.lora_bases,
        [("sql-adapter".to_owned(), "llama".to_owned())]
    );
}

#[test]
fn exactly_one_endpoint_source() {
    let conflict = parse(&["--endpoints-file", "p", "--pool-name", "pool"]).expect_err("two");
    assert_eq!(
        conflict.to_string(),
        "--endpoints-file and --pool-name are given together: pass exactly one endpoint source"
    );
    let conflict = parse(&[
        "--pool-name",
        "pool",
        "--endpoint-selector",
        "app=x",
        "--endpoint-target-ports",
        "8000",
    ])
    .expect_err("two");
    assert!(
        conflict
            .to_string()
            .contains("--pool-name and --endpoint-selector"),
        "{conflict}"
    );
    let ports_alone = parse(&["--pool-name", "pool", "--endpoint-target-ports", "8000"]);
    assert!(
        ports_alone
            .expect_err("ports need a selector")
            .to_string()
            .contains("--endpoint-target-ports")
    );
    let no_ports = parse(&["--endpoint-selector", "app=x"]).expect_err("ports needed");
    assert!(
        no_ports.to_string().contains("--endpoint-target-ports"),
        "{no_ports}"
    );
    let group = parse(&["--pool-name", "p", "--pool-group", "example.com"]).expect_err("group");
    assert!(group.to_string().contains("--pool-group"), "{group}");
    let config = parse(&[
        "--endpoint-selector",
        "app=vllm,tier=a",
        "--endpoint-target-ports",
        "8000,8001",
        "--pool-namespace",
        "llm",
    ])
    .expect("valid");
    let EndpointSource::Kube(kube) = config.source else {
        panic!("kube source expected");
    };
    assert_eq!(kube.namespace, "llm");
    assert_eq!(kube.stale_after, Duration::from_secs(30));
    let config = parse(&[
        "--pool-name",
        "pool",
        "--pool-group",
        "inference.networking.x-k8s.io",
    ])
    .expect("valid");
    assert_eq!(config.pool_name, "pool");
}

#[test]
fn rejects_missing_source_and_port_clash() {
    assert!(matches!(parse(&[]), Err(ConfigError::NoEndpointSource)));
    let clash = parse(&["--endpoints-file", "p", "--metrics-port", "9002"]);
    assert!(matches!(
        clash,
        Err(ConfigError::PortClash { port: 9002, .. })
    ));
    let small = parse(&["--endpoints-file", "p", "--max-body-bytes", "10"]);
    assert!(matches!(small, Err(ConfigError::TooSmall { .. })));
    let zero = parse(&["--endpoints-file", "p", "--scrape-interval", "0ms"]);
    assert!(matches!(
        zero,
        Err(ConfigError::TooSmall {
            flag: "scrape-interval",
            ..
        })
    ));
}

#[test]
fn background_threads_default_to_half_the_cores_or_all_without_extproc_threads_and_zero_is_refused()
{
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let config = parse(&["--endpoints-file", "p"]).expect("valid");
    assert_eq!(config.background_threads, (cores / 2).max(1));
    // The connections on this runtime too: every core.
    let config = parse(&["--endpoints-file", "p", "--extproc-threads", "0"]).expect("valid");
    assert_eq!(config.background_threads, cores);
    let config = parse(&["--endpoints-file", "p", "--background-threads", "5"]).expect("valid");
    assert_eq!(config.background_threads, 5);
    let zero = Cli::try_parse_from([
        "kvpick",
        "--endpoints-file",
        "p",
        "--background-threads",
        "0",
    ]);
    assert!(zero.is_err(), "0 workers cannot run anything");
}
