//! A pick's routing record, applied after the reply: [`PendingRecord`].
//!
//! Why deferred: recording the picked pod as holding the prompt's blocks (the prefix index's
//! speculative entries, `PrefixIndex::record_routed_from`) is bookkeeping for the *next*
//! requests, and for a long prompt it costs as much as the rest of the decision (keying the
//! uncached tail, checking and writing each of its blocks). The ext-proc path sends the
//! gateway its answer first and records afterwards on the same task, so the request never
//! waits for it and no thread is woken for it.
//!
//! NOTE: a request of the same new prefix that is decided in the microseconds between the
//! reply and the record sees the prefix cold; KV events take milliseconds anyway, which is the
//! gap speculation covers.

use std::sync::Arc;

use crate::endpoints::PodId;
use crate::kvcache::{PrefixIndex, PromptKeys};

/// Routing records of one pick, not applied yet. [`Self::apply`] applies them; dropping
/// applies them too, so a record is never lost by a caller that forgets.
#[must_use = "a pending record is applied when dropped; apply it after replying"]
#[derive(Default)]
pub struct PendingRecord {
    records: Vec<RouteRecord>,
}

/// One pod recorded as holding a prompt's blocks.
struct RouteRecord {
    index: Arc<PrefixIndex>,
    pod: PodId,
    /// The request's prompt and the keys its lookup computed (shared, not copied).
    prompt: Arc<PromptKeys>,
    /// Leading blocks the pod was found to hold confirmed (not recorded again).
    held: usize,
}

impl PendingRecord {
    /// Adds the record of `pod` holding `prompt`'s blocks from block `held` on.
    pub(crate) fn push(
        &mut self,
        index: Arc<PrefixIndex>,
        pod: PodId,
        prompt: Arc<PromptKeys>,
        held: usize,
    ) {
        self.records.push(RouteRecord {
            index,
            pod,
            prompt,
            held,
        });
    }

    /// Takes over `other`'s records.
    pub(crate) fn merge(&mut self, mut other: PendingRecord) {
        self.records.append(&mut other.records);
    }

    /// Whether there is nothing to record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Applies the records now.
    pub fn apply(mut self) {
        self.apply_all();
    }

    fn apply_all(&mut self) {
        for record in self.records.drain(..) {
            record
                .index
                .record_routed_from(record.pod, &record.prompt, record.held);
        }
    }
}

impl Drop for PendingRecord {
    fn drop(&mut self) {
        self.apply_all();
    }
}

impl std::fmt::Debug for PendingRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingRecord")
            .field("records", &self.records.len())
            .finish()
    }
}
