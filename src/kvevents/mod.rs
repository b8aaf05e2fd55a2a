//! vLLM KV-cache events in: ZMQ subscriptions, wire decoding, sequencing and replay.
//!
//! Pipeline: [`subscriber`] (one SUB per pod, or one central bound SUB, over our bounded
//! ZMTP [`transport`]) → `stream` (decode,
//! seq per (pod, dp rank), gap → [`replay`], restart → clear) → one bounded channel → the
//! index writer in [`manager`] → [`crate::kvcache::PrefixIndex`]. [`KvEventsManager::sync`]
//! follows the pool; [`status`] and [`metrics`] report per pod.
//!
//! Why this is separate from [`crate::kvcache`]: the index must not know about ZMQ, msgpack or
//! vLLM's layouts; it consumes typed [`decode::EventBatch`]es. Everything here treats the
//! network as hostile (see DESIGN §3 for the facts the decoder agrees with). Concurrency and
//! ordering rules: see [`manager`] and the `stream` module.

pub mod decode;

pub use decode::{
    BlockExtra, BlockRemoved, BlockStored, DecodeError, EngineHash, EventBatch, KvEvent, Tier,
    Topic, decode_payload, decode_seq, parse_topic, split_frames,
};
pub mod manager;
pub mod metrics;
pub mod replay;
pub mod sequence;
mod shared;
pub mod status;
mod stream;
pub mod subscriber;
pub mod transport;

pub use manager::{KvEventsConfig, KvEventsError, KvEventsManager};
pub use status::{KvEventsStatus, PodIndexStatus};
