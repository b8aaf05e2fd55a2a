//! One request's prompt and its block keys: [`PromptKeys`].
//!
//! Why one type: the prefix lookup keys a prompt's blocks until the first block no candidate
//! holds, and the routing record that follows the pick keys the rest. Both must key the same
//! tokens, in the same context, at each pod's block size. `PromptKeys` owns the tokens and the
//! context, and keeps one lazily extended chain per block size, so every block is hashed at
//! most once per request and nothing is copied between the steps: the lookup, the record
//! (deferred until after the reply) and an optional warm-up on the preparing thread all share
//! one `Arc<PromptKeys>`.
//!
//! Concurrency: the chains sit behind a mutex that only the steps of one request take, one
//! after the other, so it is never contended. Lock order: a chain's lock may be held while the
//! index takes its own locks (the walk and the record read keys while probing), never the
//! reverse — index code never calls back into a `PromptKeys`.

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::key::{BlockKey, KeyChain, KeyContext};
use crate::tokenize::PromptTokens;

/// A prompt as the model server will see it, the context its blocks are keyed in, and the
/// block keys computed so far (one chain per block size asked for).
#[derive(Debug)]
pub struct PromptKeys {
    prompt: PromptTokens,
    context: Option<KeyContext>,
    chains: Mutex<Vec<KeyChain>>,
}

impl Default for PromptKeys {
    fn default() -> Self {
        Self::new(PromptTokens::Empty, None)
    }
}

impl PromptKeys {
    /// `prompt`, keyed in `context` (`None`: the request named no model; nothing is keyed).
    pub fn new(prompt: PromptTokens, context: Option<KeyContext>) -> Self {
        Self {
            prompt,
            context,
            chains: Mutex::new(Vec::new()),
        }
    }

    /// Exact `tokens` keyed in `context`.
    pub fn exact(context: KeyContext, tokens: Vec<u32>) -> Self {
        Self::new(PromptTokens::Exact(tokens), Some(context))
    }

    /// The prompt (exact tokens, approximate text, or none).
    pub fn prompt(&self) -> &PromptTokens {
        &self.prompt
    }

    /// How the prompt's blocks are keyed (model, LoRA adapter, cache salt).
    pub fn context(&self) -> Option<&KeyContext> {
        self.context.as_ref()
    }

    /// The exact tokens, when the prompt can be keyed (exact tokens and a context).
    pub fn keyable_tokens(&self) -> Option<&[u32]> {
        match (&self.prompt, &self.context) {
            (PromptTokens::Exact(tokens), Some(_)) => Some(tokens),
            _ => None,
        }
    }

    /// The prompt and its context, giving up the keys.
    pub fn into_parts(self) -> (PromptTokens, Option<KeyContext>) {
        (self.prompt, self.context)
    }

    /// Computes every full block's key at `block_size` now (e.g. on the thread that tokenized
    /// the prompt, so the decision finds them ready). Nothing when the prompt is not keyable.
    pub fn warm(&self, block_size: u32) {
        let _ = self.with_keys(block_size, |keys| keys.upto(usize::MAX).len());
    }

    /// Runs `f` over the prompt's keys at `block_size` (extended on demand, and kept for the
    /// next step); `None` when the prompt is not keyable.
    pub(crate) fn with_keys<R>(
        &self,
        block_size: u32,
        f: impl FnOnce(&mut LazyKeys<'_>) -> R,
    ) -> Option<R> {
        let (tokens, context) = match (&self.prompt, &self.context) {
            (PromptTokens::Exact(tokens), Some(context)) => (tokens.as_slice(), context),
            _ => return None,
        };
        let block_size = block_size.max(1);
        let mut chains = self.lock();
        let position = match chains.iter().position(|c| c.block_size() == block_size) {
            Some(position) => position,
            None => {
                chains.push(KeyChain::new(context.seed(), block_size));
                chains.len() - 1
            }
        };
        let chain = chains.get_mut(position)?;
        Some(f(&mut LazyKeys { chain, tokens }))
    }

    /// Blocks keyed so far at `block_size` (for tests of the laziness).
    pub fn keyed_blocks(&self, block_size: u32) -> usize {
        self.lock()
            .iter()
            .find(|c| c.block_size() == block_size.max(1))
            .map_or(0, |c| c.keys().len())
    }

    fn lock(&self) -> MutexGuard<'_, Vec<KeyChain>> {
        // A panic elsewhere while holding the lock leaves the chains valid (each key is
        // pushed whole), so a poisoned lock is used as is.
        self.chains.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A prompt's keys at one block size, computed as far as they are asked for.
pub(crate) struct LazyKeys<'a> {
    chain: &'a mut KeyChain,
    tokens: &'a [u32],
}

impl LazyKeys<'_> {
    /// The block size.
    pub(crate) fn block_size(&self) -> u32 {
        self.chain.block_size()
    }

    /// Full blocks in the prompt.
    pub(crate) fn total_blocks(&self) -> usize {
        self.chain.total_blocks(self.tokens)
    }

    /// The keys of blocks `0..blocks` (fewer when the prompt has fewer).
    pub(crate) fn upto(&mut self, blocks: usize) -> &[BlockKey] {
        self.chain.extend_to(self.tokens, blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvcache::block_keys;

    fn context() -> KeyContext {
        KeyContext::model("m")
    }

    #[test]
    fn keys_match_the_one_shot_keys_and_extend_lazily() {
        let tokens: Vec<u32> = (0..100).collect();
        let keys = PromptKeys::exact(context(), tokens.clone());
        let first = keys.with_keys(16, |k| k.upto(2).to_vec());
        assert_eq!(
            first.as_deref(),
            Some(&block_keys(&context(), &tokens, 16)[..2])
        );
        assert_eq!(keys.keyed_blocks(16), 2);
        let all = keys.with_keys(16, |k| k.upto(usize::MAX).to_vec());
        assert_eq!(all, Some(block_keys(&context(), &tokens, 16)));
        assert_eq!(keys.keyed_blocks(16), 6);
        // Another block size is its own chain.
        assert_eq!(keys.keyed_blocks(32), 0);
        keys.warm(32);
        assert_eq!(keys.keyed_blocks(32), 3);
        assert_eq!(keys.keyed_blocks(16), 6);
    }

    #[test]
    fn nothing_is_keyed_without_exact_tokens_and_a_context() {
        let no_context = PromptKeys::new(PromptTokens::Exact(vec![1; 64]), None);
        assert_eq!(no_context.with_keys(16, |k| k.total_blocks()), None);
        assert!(no_context.keyable_tokens().is_none());
        let empty = PromptKeys::new(PromptTokens::Empty, Some(context()));
        assert_eq!(empty.with_keys(16, |k| k.total_blocks()), None);
        empty.warm(16);
        assert_eq!(empty.keyed_blocks(16), 0);
    }
}
