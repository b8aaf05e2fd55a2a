//! The pods (and tiers) that hold one block key: the value of the global block map.
//!
//! Why this shape: most blocks are held by one pod, so the first holder is stored inline and
//! the rest behind one thin pointer (16 bytes in all, no heap allocation for a single holder);
//! changes are rare compared with reads.

use crate::kvevents::Tier;

/// One (pod slot, tier) that holds a block, with how many of the pod's engine hashes in that
/// tier map to the block (usually 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) slot: u32,
    pub(crate) refs: u16,
    pub(crate) tier: u8,
}

/// The holders of one block key; never empty while stored in the map.
// NOTE: `Box<Vec<_>>` on purpose: a thin 8-byte pointer keeps the map value at 16 bytes; the
// extra allocation only exists for blocks held by two or more (pod, tier) pairs.
#[allow(clippy::box_collection)]
#[derive(Clone, Debug)]
pub(crate) struct Holders {
    first: Holder,
    rest: Option<Box<Vec<Holder>>>,
}

impl Holders {
    pub(crate) fn new(slot: u32, tier: Tier) -> Self {
        Holders {
            first: Holder {
                slot,
                refs: 1,
                tier: tier.index() as u8,
            },
            rest: None,
        }
    }

    /// Every holder.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Holder> {
        std::iter::once(&self.first).chain(self.rest.iter().flat_map(|rest| rest.iter()))
    }

    fn find_mut(&mut self, slot: u32, tier: u8) -> Option<&mut Holder> {
        if self.first.slot == slot && self.first.tier == tier {
            return Some(&mut self.first);
        }
        self.rest
            .as_mut()?
            .iter_mut()
            .find(|h| h.slot == slot && h.tier == tier)
    }

    /// Adds one reference for (slot, tier).
    pub(crate) fn add(&mut self, slot: u32, tier: Tier) {
        let tier = tier.index() as u8;
        if let Some(holder) = self.find_mut(slot, tier) {
            holder.refs = holder.refs.saturating_add(1);
            return;
        }
        self.rest.get_or_insert_with(Box::default).push(Holder {
            slot,
            refs: 1,
            tier,
        });
    }

    /// Drops one reference for (slot, tier); returns true when no holder is left.
    pub(crate) fn remove(&mut self, slot: u32, tier: Tier) -> bool {
        let tier = tier.index() as u8;
        let Some(holder) = self.find_mut(slot, tier) else {
            return false;
        };
        holder.refs = holder.refs.saturating_sub(1);
        if holder.refs > 0 {
            return false;
        }
        if self.first.slot == slot && self.first.tier == tier {
            match self.rest.as_mut().and_then(|rest| rest.pop()) {
                Some(next) => self.first = next,
                None => return true,
            }
        } else if let Some(rest) = self.rest.as_mut() {
            rest.retain(|h| !(h.slot == slot && h.tier == tier));
        }
        if self.rest.as_ref().is_some_and(|rest| rest.is_empty()) {
            self.rest = None;
        }
        false
    }

    /// Heap bytes owned beyond the inline value.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.rest.as_ref().map_or(0, |rest| {
            std::mem::size_of::<Vec<Holder>>() + rest.capacity() * std::mem::size_of::<Holder>()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_count_references_and_stay_compact() {
        assert_eq!(std::mem::size_of::<Holders>(), 16);
        let mut h = Holders::new(1, Tier::Gpu);
        h.add(2, Tier::Gpu);
        h.add(1, Tier::Cpu);
        h.add(1, Tier::Gpu);
        assert_eq!(h.iter().count(), 3);
        assert!(!h.remove(1, Tier::Gpu)); // 2 refs → 1
        assert!(!h.remove(1, Tier::Gpu)); // gone; another holder moves inline
        assert_eq!(h.iter().count(), 2);
        assert!(!h.remove(9, Tier::Gpu));
        assert!(!h.remove(2, Tier::Gpu));
        assert!(h.remove(1, Tier::Cpu));
    }
}
