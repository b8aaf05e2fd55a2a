//! The prefix index's side of the replica exchange (`crate::replica`): routing records leave
//! through a sink, and records another replica made come back in as foreign records.
//!
//! Why here: a foreign record must land exactly where kvpick's own records land (speculative
//! runs on pods with events, the approximate LRU set on pods without), so it goes through the
//! same `record_keys`; only the export and the checks on foreign input are new.

use super::index::{PrefixIndex, RouteSink};
use super::key::BlockKey;
use crate::endpoints::PodId;

/// What became of a foreign routing record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForeignRecord {
    /// Recorded like one of kvpick's own.
    Applied,
    /// This replica keys the pod at another block size (the keys would match nothing).
    BlockSizeMismatch,
    /// The pod left the pool recently (a late record must not bring it back).
    PodGone,
}

impl PrefixIndex {
    /// Sends every later routing record to `sink` as well (the replica exchange); a second
    /// call is ignored (one exchange per process).
    pub fn set_route_sink(&self, sink: RouteSink) -> bool {
        self.route_sink.set(sink).is_ok()
    }

    /// Hands a routing record to the sink, if there is one.
    pub(super) fn export_route(&self, pod: PodId, block_size: u32, keys: &[BlockKey]) {
        if let Some(sink) = self.route_sink.get() {
            sink(pod, block_size, keys);
        }
    }

    /// Records that another replica routed a prompt with these keys (computed at
    /// `block_size`) to `pod`, as if this replica had: not exported again. The caller checks
    /// that `pod` is in the pool.
    pub fn record_foreign(&self, pod: PodId, block_size: u32, keys: &[BlockKey]) -> ForeignRecord {
        if self.block_size_for(pod) != block_size {
            return ForeignRecord::BlockSizeMismatch;
        }
        if self.recently_purged(pod) {
            return ForeignRecord::PodGone;
        }
        if !keys.is_empty() {
            let entry = self.pod_or_insert(pod);
            self.record_keys(&entry, keys, 0);
            self.homes.record(pod, keys);
        }
        ForeignRecord::Applied
    }
}
