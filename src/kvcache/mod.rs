//! The precise prefix index: kvpick's own block keys, which pods hold them, prefix matching.
//!
//! Why its own keys: the engine's hash depends on its algorithm, version and seed; kvpick keys
//! blocks by a chained xxh3-64 of their token ids (seeded by model, LoRA and cache salt) so a
//! request's prefix is keyed the same way from its own tokens ([`key`]). The index
//! ([`index`]) is fed typed batches by [`crate::kvevents`] and answers, per candidate pod, how
//! many leading blocks of a request it holds. Concurrency rules: see [`index`].

mod holders;
pub mod index;
pub mod key;

pub use index::{ApplyStats, IndexConfig, PrefixIndex, PrefixMatch, TierWeights};
pub use key::{BlockKey, KeyContext, block_keys};
