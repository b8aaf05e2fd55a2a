//! `kvpick-sim`: a vLLM-compatible model-server simulator.
//!
//! Why it exists: everything downstream (the KV-cache index, the scheduler, the benchmarks, the
//! demo) needs a fleet of vLLM-like model servers, and there are no GPUs here. The simulator
//! stands in for the GPU, not for the protocols: block hashes, KV-event payloads, replay and
//! metrics are what vLLM 0.32 sends on the wire (golden-tested against `../shared/fixtures/`).
//! It is deliberately independent of `kvcache/` and `kvevents/`: it is the ground truth they are
//! tested against.
//!
//! Layers, bottom up: [`hashing`] and [`events`] (wire formats), [`block_pool`] and [`engine`]
//! (the deterministic, clock-free engine model), [`pod`] (one async task per pod driving the
//! engine on tokio's clock), [`publisher`] (ZMQ PUB + replay), [`metrics`], [`tokenizer`],
//! [`http`] (the OpenAI surface), [`render`] (vLLM's render and detokenize endpoints), [`request_log`] (`--request-log`) and [`floor`] (its least reachable first-token times), [`fleet`] (many pods per process). See docs/simulator.md.

pub mod block_pool;
pub mod engine;
pub mod events;
pub mod fleet;
pub mod floor;
pub mod hashing;
pub mod http;
pub mod metrics;
pub mod pod;
pub mod publisher;
pub mod render;
pub mod request_log;
pub mod tokenizer;
