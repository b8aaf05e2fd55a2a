//! The precise prefix index: kvpick's own block keys, which pods hold them, prefix matching.
//!
//! Why its own keys: the engine's hash depends on its algorithm, version and seed; kvpick keys
//! blocks by a chained xxh3-64 of their token ids (seeded by model, LoRA and cache salt) so a
//! request's prefix is keyed the same way from its own tokens ([`key`]). The index
//! ([`index`]) is fed typed batches by [`crate::kvevents`] and answers, per candidate pod, how
//! many leading blocks of a request it holds ([`matching`]). Requests kvpick routes are
//! recorded too: as short-lived speculative holders on pods that publish events (so a burst
//! of one prefix does not scatter before the events arrive), or in a per pod LRU set for pods
//! without events (the approximate mode; `record`); a pod whose events are subscribed to
//! but that has not published yet gets both, so its first batch (which drops what was
//! learned approximately) does not forget the requests just routed to it. A request's tokens
//! and block keys are one [`PromptKeys`], keyed lazily and shared by its lookup and its
//! record. Concurrency rules: see [`index`] (and `prompt_keys` for the keys' lock order).
//!
//! Why matching is fast on long prompts: holders carry their place in a *span* (a chain the
//! pod stored one block after another, see `span`) and routing records write speculative
//! *runs*, both with an intact length; a walk proves with one probe that every candidate
//! still on its run holds many blocks ahead, and gallops (`matching`).

mod apply;
mod approx;
mod blockmap;
mod exchange;
mod homes;
pub mod index;
pub mod key;
pub mod matching;
pub mod metrics;
mod prompt_keys;
mod record;
mod shards;
mod span;
mod speculative;
#[cfg(test)]
mod test_rng;

pub use exchange::ForeignRecord;
pub use homes::PrefixHome;
pub use index::{ApplyStats, IndexConfig, PrefixIndex, RouteSink, TierWeights};
pub use key::{BlockKey, KeyContext, block_keys};
pub use matching::{DebugPrefix, DebugPrefixPod, PrefixLookup, PrefixMatch};
pub use metrics::IndexMetrics;
pub use prompt_keys::PromptKeys;
