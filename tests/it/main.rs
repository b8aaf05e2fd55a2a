//! kvpick's integration tests, one binary: each module is one former test file (its name says
//! what it covers), sharing `tests/support` (real Envoy, the kvpick binary, stand-in model
//! servers, KV-event peers). One binary links the library once instead of once per file,
//! which is most of an incremental test build on two cores (docs/benchmarks.md).

#[path = "../support/mod.rs"]
mod support;
// The fake Kubernetes API (only the discovery tests use it; crates/kvpick-e2e shares
// support/ but not this).
#[path = "../support/fake_kube.rs"]
mod fake_kube;
// Random-token prompts (the tokenizer tests; benches/tokenize.rs includes it too).
#[path = "../support/random_text.rs"]
mod random_text;
// Truncations and mutations of real payloads (the KV-event decoder tests; crates/kvpick-e2e
// shares support/ but not this, nor its fastrand).
#[path = "../support/hostile_bytes.rs"]
mod hostile_bytes;

mod app_reliability;
mod conformance_hooks;
mod deploy_manifests;
mod deploy_monitoring;
mod deploy_rbac;
mod deploy_schema;
mod envoy_e2e;
mod extproc_buffered;
mod extproc_large_bodies;
mod extproc_rewrite;
mod extproc_server;
mod extproc_split;
mod extproc_stream;
mod faults_gateway;
mod faults_kv_events;
mod k8s_discovery;
mod k8s_leader;
mod k8s_policy;
mod kv_decode_fixtures;
mod kv_decode_hostile;
mod kv_decode_reader;
mod kv_index_fixtures;
mod kv_index_gallop;
mod kv_index_proptest;
mod kv_libzmq_interop;
mod kv_speculative;
mod kv_subscriber;
mod layering;
mod llmd_flags;
mod mem_concurrency;
mod quickstart;
mod replica_exchange;
mod replica_tls;
mod req_long_strings;
mod sched_config;
mod sched_extproc;
mod sched_saturation;
mod sched_scheduler;
mod sched_tracing;
mod scrape_by_name;
mod telemetry_admin;
mod telemetry_labels;
mod tls_extproc;
mod tok_api_captures;
mod tok_fast_bpe;
mod tok_fixtures;
mod tok_huge_prompts;
mod tok_prefix_cache;
mod tok_request;
mod tok_template;
