//! The deployable package (Dockerfile, deploy/kubernetes, deploy/helm/kvpick,
//! deploy/monitoring): every manifest, and the chart rendered by the real Helm engine for
//! each values file of deploy/helm/kvpick/ci/, parses into its Kubernetes type (k8s-openapi)
//! or validates against its CRD's schema with no unknown field; the chart's values schema
//! rejects typos and knows every kvpick flag; the committed manifests are what the chart
//! renders; the Dockerfile passes hadolint and builds as the README does.

use crate::deploy_schema::{against_schema, typed};
use crate::support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;

const VALUES: [&str; 5] = ["default", "ha", "leader-election", "standalone", "tls"];

fn repo() -> PathBuf {
    support::repo_root()
}

/// Runs a project script (they install their tools into .venv/ themselves).
fn script(args: &[&str]) -> std::process::Output {
    Command::new(repo().join(args[0]))
        .args(&args[1..])
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", args[0]))
}

/// The chart rendered by scripts/helm-render.py (the real Helm engine) with these values
/// files (paths relative to the repository), as one object per document; panics with Helm's
/// message if the render fails.
pub fn render(values: &[&str]) -> Vec<Value> {
    match try_render(values) {
        Ok(docs) => docs,
        Err(message) => panic!("helm render with {values:?} failed: {message}"),
    }
}

/// The chart rendered with `values`, or Helm's error message.
pub fn try_render(values: &[&str]) -> Result<Vec<Value>, String> {
    let setup = script(&["scripts/setup-deploy-tools.sh"]);
    assert!(
        setup.status.success(),
        "scripts/setup-deploy-tools.sh: {}",
        String::from_utf8_lossy(&setup.stderr)
    );
    let mut command = Command::new(repo().join(".venv/bin/python"));
    command.arg(repo().join("scripts/helm-render.py")).args([
        "--name",
        "kvpick",
        "--namespace",
        "llm",
    ]);
    for file in values {
        command.arg("-f").arg(repo().join(file));
    }
    let out = command.output().expect("run scripts/helm-render.py");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(documents(&String::from_utf8(out.stdout).expect("utf-8")))
}

/// The values file of deploy/helm/kvpick/ci/ for `name`.
pub fn values_file(name: &str) -> String {
    format!("deploy/helm/kvpick/ci/{name}-values.yaml")
}

/// Every non-empty document of a YAML stream, as JSON values.
pub fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| serde_yaml::Value::deserialize(doc).expect("valid YAML"))
        .filter(|doc| !doc.is_null())
        .map(|doc| serde_json::to_value(doc).expect("YAML as JSON"))
        .collect()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml") {
            out.push(path);
        }
    }
}

/// The schemas of kvpick's own CRDs, by (apiVersion, kind).
fn crd_schemas() -> BTreeMap<(String, String), Value> {
    let mut files = Vec::new();
    yaml_files(&repo().join("deploy/kubernetes/crds"), &mut files);
    let mut schemas = BTreeMap::new();
    for file in files {
        for crd in documents(&std::fs::read_to_string(&file).expect("read CRD")) {
            let group = crd["spec"]["group"].as_str().expect("group");
            let kind = crd["spec"]["names"]["kind"].as_str().expect("kind");
            for version in crd["spec"]["versions"].as_array().expect("versions") {
                let name = version["name"].as_str().expect("version name");
                schemas.insert(
                    (format!("{group}/{name}"), kind.to_owned()),
                    version["schema"]["openAPIV3Schema"].clone(),
                );
            }
        }
    }
    schemas
}

/// The schema of a third-party kind (tests/fixtures/deploy-schemas), if there is one.
fn fixture_schema(api_version: &str, kind: &str) -> Option<Value> {
    let name = format!("{}_{kind}.yaml", api_version.replace('/', "_"));
    let path = repo().join("tests/fixtures/deploy-schemas").join(name);
    let text = std::fs::read_to_string(path).ok()?;
    documents(&text).into_iter().next()
}

/// Every problem of one object: its type or schema, or that it has neither.
fn check(object: &Value, crds: &BTreeMap<(String, String), Value>) -> Vec<String> {
    use k8s_openapi::api::{apps, core, policy, rbac};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let api_version = object["apiVersion"].as_str().unwrap_or("");
    let kind = object["kind"].as_str().unwrap_or("");
    match (api_version, kind) {
        ("v1", "Service") => typed::<core::v1::Service>(object),
        ("v1", "ServiceAccount") => typed::<core::v1::ServiceAccount>(object),
        ("v1", "ConfigMap") => typed::<core::v1::ConfigMap>(object),
        ("apps/v1", "Deployment") => typed::<apps::v1::Deployment>(object),
        ("policy/v1", "PodDisruptionBudget") => typed::<policy::v1::PodDisruptionBudget>(object),
        ("rbac.authorization.k8s.io/v1", "Role") => typed::<rbac::v1::Role>(object),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => typed::<rbac::v1::RoleBinding>(object),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            typed::<CustomResourceDefinition>(object)
        }
        _ => match crds.get(&(api_version.to_owned(), kind.to_owned())) {
            Some(schema) => against_schema(object, schema),
            None => match fixture_schema(api_version, kind) {
                Some(schema) => against_schema(object, &schema),
                None => vec![format!("no type or schema for {api_version} {kind}")],
            },
        },
    }
}

fn name_of(object: &Value) -> String {
    format!(
        "{} {}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

fn assert_valid(what: &str, objects: &[Value]) {
    let crds = crd_schemas();
    let problems: Vec<String> = objects
        .iter()
        .flat_map(|o| {
            check(o, &crds)
                .into_iter()
                .map(move |p| format!("{what}: {}: {p}", name_of(o)))
        })
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn args(objects: &[Value]) -> Vec<String> {
    let deployment = of_kind(objects, "Deployment")[0];
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_owned())
        .collect()
}

#[test]
fn every_manifest_under_deploy_is_a_valid_object_with_no_unknown_field() {
    let mut files = Vec::new();
    yaml_files(&repo().join("deploy/kubernetes"), &mut files);
    files.push(repo().join("deploy/monitoring/kvpick-monitoring.yaml"));
    assert!(files.len() >= 11, "{files:?}");
    for file in &files {
        let objects = documents(&std::fs::read_to_string(file).expect("read manifest"));
        assert!(!objects.is_empty(), "{} holds no object", file.display());
        assert_valid(&file.display().to_string(), &objects);
    }
    // The alerts file is a Prometheus rules file: the spec of a PrometheusRule.
    let rules = documents(
        &std::fs::read_to_string(repo().join("deploy/monitoring/alerts.yaml")).expect("alerts"),
    );
    let schema = fixture_schema("monitoring.coreos.com/v1", "PrometheusRule").expect("schema");
    assert_eq!(
        against_schema(&rules[0], &schema["properties"]["spec"]),
        Vec::<String>::new()
    );
}

#[test]
fn the_chart_renders_valid_objects_for_every_values_file() {
    for name in VALUES {
        let objects = render(&[&values_file(name)]);
        assert_valid(name, &objects);
        let mut names: Vec<String> = objects.iter().map(name_of).collect();
        names.sort();
        let unique = names.len();
        names.dedup();
        assert_eq!(unique, names.len(), "{name}: an object is rendered twice");
    }
}

#[test]
fn the_chart_renders_each_mode_as_its_values_say() {
    let default = render(&[&values_file("default")]);
    let kinds: Vec<&str> = default.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "InferencePool",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "ConfigMap",
    ] {
        assert!(
            kinds.contains(&kind),
            "default renders no {kind}: {kinds:?}"
        );
    }
    let pool = of_kind(&default, "InferencePool")[0];
    assert_eq!(pool["spec"]["endpointPickerRef"]["name"], "kvpick-epp");
    assert_eq!(pool["spec"]["endpointPickerRef"]["port"]["number"], 9002);
    assert_eq!(pool["spec"]["endpointPickerRef"]["failureMode"], "FailOpen");
    let services = of_kind(&default, "Service");
    assert!(
        services.iter().any(|s| s["spec"]["clusterIP"] == "None"),
        "no headless Service"
    );
    let default_args = args(&default);
    assert!(!default_args.contains(&"--ha-enable-leader-election".to_owned()));
    assert!(
        default_args
            .windows(2)
            .any(|w| w == ["--pool-name", "kvpick"])
    );

    let leader = render(&[&values_file("leader-election")]);
    assert!(args(&leader).contains(&"--ha-enable-leader-election".to_owned()));
    assert_eq!(
        of_kind(&leader, "Deployment")[0]["spec"]["strategy"]["type"],
        "Recreate"
    );
    assert_eq!(
        of_kind(&leader, "DestinationRule")[0]["spec"]["trafficPolicy"]["tls"]["mode"],
        "DISABLE"
    );

    let ha = render(&[&values_file("ha")]);
    assert_eq!(of_kind(&ha, "Deployment")[0]["spec"]["replicas"], 3);
    assert!(!args(&ha).contains(&"--ha-enable-leader-election".to_owned()));
    assert!(args(&ha).contains(&"--tokenizer=/models/tokenizer".to_owned()));
    // Active-active: the replicas exchange routing records with the Deployment's own pods.
    let ha_args = args(&ha);
    assert!(
        ha_args
            .windows(2)
            .any(|w| w == ["--replica-exchange-port", "9010"])
            && ha_args
                .windows(2)
                .any(|w| w == ["--peer-selector", "llm-d-router-gateway=kvpick-epp"]),
        "{ha_args:?}"
    );
    assert!(!default_args.iter().any(|a| a.starts_with("--replica")));
    for kind in ["ServiceMonitor", "PrometheusRule", "HTTPRoute"] {
        assert_eq!(of_kind(&ha, kind).len(), 1, "HA renders one {kind}");
    }

    let standalone = render(&[&values_file("standalone")]);
    assert!(of_kind(&standalone, "InferencePool").is_empty());
    let standalone_args = args(&standalone);
    assert!(
        standalone_args.windows(2).any(|w| w
            == [
                "--endpoint-selector",
                "app=vllm-llama3-8b,llm-d.ai/inference-serving=true"
            ]),
        "{standalone_args:?}"
    );
    assert!(
        standalone_args
            .windows(2)
            .any(|w| w == ["--endpoint-target-ports", "8000,8001"])
    );

    let tls = render(&[&values_file("tls")]);
    let tls_args = args(&tls);
    assert!(tls_args.contains(&"--secure-serving=true".to_owned()));
    assert!(
        tls_args
            .windows(2)
            .any(|w| w == ["--cert-path", "/etc/kvpick/tls"])
    );
    let pod = &of_kind(&tls, "Deployment")[0]["spec"]["template"]["spec"];
    assert!(
        pod["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .any(|v| v["secret"]["secretName"] == "kvpick-tls")
    );
    let policy = of_kind(&tls, "EnvoyExtensionPolicy")[0];
    assert_eq!(
        policy["spec"]["extProc"][0]["processingMode"]["request"]["body"],
        "FullDuplexStreamed"
    );
    // Envoy Gateway's own rule (a CEL validation of its CRD): no failOpen with full duplex.
    assert_eq!(policy["spec"]["extProc"][0]["failOpen"], false);
}

#[test]
fn every_rendered_deployment_is_locked_down_and_probed_on_the_health_port() {
    for name in VALUES {
        let objects = render(&[&values_file(name)]);
        let pod = &of_kind(&objects, "Deployment")[0]["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        for container in pod["containers"].as_array().expect("containers") {
            let security = &container["securityContext"];
            assert_eq!(security["readOnlyRootFilesystem"], true, "{name}");
            assert_eq!(security["allowPrivilegeEscalation"], false, "{name}");
            assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
            assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
            for (probe, service) in [
                ("startupProbe", "liveness"),
                ("livenessProbe", "liveness"),
                ("readinessProbe", "readiness"),
            ] {
                assert_eq!(container[probe]["grpc"]["port"], 9003, "{name} {probe}");
                assert_eq!(
                    container[probe]["grpc"]["service"], service,
                    "{name} {probe}"
                );
            }
            assert!(container["resources"]["requests"]["cpu"].is_string());
            assert!(container["resources"]["limits"]["memory"].is_string());
        }
    }
}

#[test]
fn a_typo_in_the_values_fails_the_render_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (yaml, named) in [
        ("router:\n  epp:\n    replcas: 2\n", "replcas"),
        (
            "router:\n  epp:\n    flags:\n      max-falbacks: 0\n",
            "max-falbacks",
        ),
        (
            "router:\n  inferencePool:\n    failureMode: Open\n",
            "failureMode",
        ),
    ] {
        let file = dir.path().join("typo.yaml");
        std::fs::write(&file, yaml).expect("write values");
        let error =
            try_render(&[&values_file("default"), file.to_str().expect("path")]).expect_err(yaml);
        assert!(error.contains(named), "{yaml}: {error}");
    }
}

#[test]
fn the_values_schema_knows_exactly_kvpicks_flags() {
    let help = Command::new(env!("CARGO_BIN_EXE_kvpick"))
        .args(["serve", "--help"])
        .output()
        .expect("kvpick serve --help");
    let help = String::from_utf8(help.stdout).expect("utf-8");
    let mut flags: Vec<String> = help
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let line = line
                .strip_prefix("-")
                .and_then(|l| l.split_once(", "))
                .map_or(line, |(_, l)| l);
            let flag = line.strip_prefix("--")?;
            Some(flag.split([' ', '=', '[']).next()?.to_owned())
        })
        .filter(|flag| flag != "help")
        .collect();
    // Other names of a flag (`[alias: --refresh-metrics-interval]`) are flags too.
    for line in help.lines() {
        let line = line.trim();
        if let Some(names) = line
            .strip_prefix("[alias: ")
            .or_else(|| line.strip_prefix("[aliases: "))
            .and_then(|l| l.strip_suffix(']'))
        {
            flags.extend(
                names
                    .split(", ")
                    .filter_map(|name| name.strip_prefix("--"))
                    .map(str::to_owned),
            );
        }
    }
    flags.sort();
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/helm/kvpick/values.schema.json"))
            .expect("schema"),
    )
    .expect("schema JSON");
    let mut listed: Vec<String> = schema["properties"]["router"]["properties"]["epp"]["properties"]
        ["flags"]["propertyNames"]["enum"]
        .as_array()
        .expect("flags enum")
        .iter()
        .map(|f| f.as_str().expect("flag").to_owned())
        .collect();
    listed.sort();
    assert_eq!(
        listed, flags,
        "values.schema.json router.epp.flags vs kvpick serve --help"
    );
}

#[test]
fn the_committed_manifests_are_what_the_chart_renders() {
    let out = script(&["scripts/render-manifests.sh", "--check"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_dockerfile_passes_hadolint_and_builds_as_the_readme_does() {
    let out = script(&["scripts/lint-dockerfile.sh"]);
    assert!(
        out.status.success(),
        "hadolint: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    let build = dockerfile
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with("cargo build"))
        .expect("a cargo build step");
    let build = build.trim_end_matches('\\').trim();
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README");
    assert!(
        readme.lines().any(|line| line.trim() == build),
        "README.md has no line `{build}`"
    );
    for stage in ["AS build", "AS kvpick", "AS kvpick-sim"] {
        assert!(dockerfile.contains(stage), "no stage {stage}");
    }
    assert!(dockerfile.contains("USER 65532:65532"));
}

#[test]
fn the_crds_reject_what_upstream_validation_rejects() {
    let crds = crd_schemas();
    let pool = |spec: Value| {
        serde_json::json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"}, "spec": spec})
    };
    let good = pool(
        serde_json::json!({"selector": {"matchLabels": {"app": "vllm"}},
        "targetPorts": [{"number": 8000}], "endpointPickerRef": {"name": "kvpick-epp",
        "port": {"number": 9002}, "failureMode": "FailOpen"}}),
    );
    assert_eq!(check(&good, &crds), Vec::<String>::new());
    let nine: Vec<Value> = (8000..8009)
        .map(|p| serde_json::json!({"number": p}))
        .collect();
    for (spec, why) in [
        (
            serde_json::json!({"selector": {"matchLabels": {"app": "v"}}, "targetPorts": nine}),
            "size 9",
        ),
        (
            serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}),
            "size 0",
        ),
        (
            serde_json::json!({"selector": {"matchLabels": {"a": "v"}}, "targetPorts": [{"number": 0}]}),
            "out of bounds",
        ),
        (
            serde_json::json!({"selector": {"matchLabels": {"a": "v"}}, "targetPorts": [{"number": 1}],
            "endpointPickerRef": {"name": "e", "failureMode": "Open"}}),
            "not one of",
        ),
        (
            serde_json::json!({"selector": {"matchLabels": {"a": "v"}}}),
            "missing required field targetPorts",
        ),
    ] {
        let errors = check(&pool(spec.clone()), &crds).join("; ");
        assert!(errors.contains(why), "{spec}: {errors}");
    }
    for group in ["llm-d.ai", "inference.networking.x-k8s.io"] {
        let rewrite = serde_json::json!({"apiVersion": format!("{group}/v1alpha2"),
            "kind": "InferenceModelRewrite", "metadata": {"name": "r"},
            "spec": {"poolRef": {"name": "p"}, "rules": [{"targets": [{"modelRewrite": "m", "weight": 0}]}]}});
        assert!(
            check(&rewrite, &crds).join(";").contains("out of bounds"),
            "{group}"
        );
        let objective = serde_json::json!({"apiVersion": format!("{group}/v1alpha2"),
            "kind": "InferenceObjective", "metadata": {"name": "o"}, "spec": {"priority": 1}});
        assert!(
            check(&objective, &crds)
                .join(";")
                .contains("missing required field poolRef"),
            "{group}"
        );
    }
    // The two groups serve the same API.
    for kind in ["InferenceObjective", "InferenceModelRewrite"] {
        assert_eq!(
            crds[&("llm-d.ai/v1alpha2".to_owned(), kind.to_owned())],
            crds[&(
                "inference.networking.x-k8s.io/v1alpha2".to_owned(),
                kind.to_owned()
            )],
            "{kind}"
        );
    }
}

#[test]
fn the_chart_passes_strict_helm_lint_for_every_values_file() {
    for name in VALUES {
        let out = Command::new(repo().join(".venv/bin/python"))
            .arg(repo().join("scripts/helm-render.py"))
            .arg("--lint")
            .arg("-f")
            .arg(repo().join(values_file(name)))
            .output()
            .expect("helm lint");
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
