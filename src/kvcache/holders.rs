//! The pods (and tiers) that hold one block key: the value of the global block map.
//!
//! Why this shape: most blocks are held by one pod, so one holder is stored inline (no heap
//! allocation); more holders live in a boxed slice, resized on change (changes are rare
//! compared with reads, and a boxed slice is 8 bytes smaller than a `Vec`).

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
#[derive(Clone, Debug)]
pub(crate) enum Holders {
    One(Holder),
    Many(Box<[Holder]>),
}

impl Holders {
    pub(crate) fn new(slot: u32, tier: Tier) -> Self {
        Holders::One(Holder {
            slot,
            refs: 1,
            tier: tier.index() as u8,
        })
    }

    pub(crate) fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(holder) => std::slice::from_ref(holder),
            Holders::Many(holders) => holders,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [Holder] {
        match self {
            Holders::One(holder) => std::slice::from_mut(holder),
            Holders::Many(holders) => holders,
        }
    }

    /// Adds one reference for (slot, tier).
    pub(crate) fn add(&mut self, slot: u32, tier: Tier) {
        let tier = tier.index() as u8;
        if let Some(holder) = self
            .as_mut_slice()
            .iter_mut()
            .find(|h| h.slot == slot && h.tier == tier)
        {
            holder.refs = holder.refs.saturating_add(1);
            return;
        }
        let mut all = self.as_slice().to_vec();
        all.push(Holder {
            slot,
            refs: 1,
            tier,
        });
        *self = Holders::Many(all.into_boxed_slice());
    }

    /// Drops one reference for (slot, tier); returns true when no holder is left.
    pub(crate) fn remove(&mut self, slot: u32, tier: Tier) -> bool {
        let tier = tier.index() as u8;
        let slice = self.as_mut_slice();
        let Some(position) = slice.iter().position(|h| h.slot == slot && h.tier == tier) else {
            return slice.is_empty();
        };
        if let Some(holder) = slice.get_mut(position) {
            holder.refs = holder.refs.saturating_sub(1);
            if holder.refs > 0 {
                return false;
            }
        }
        let rest: Vec<Holder> = self
            .as_slice()
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != position)
            .map(|(_, h)| *h)
            .collect();
        match rest.as_slice() {
            [] => true,
            [only] => {
                *self = Holders::One(*only);
                false
            }
            _ => {
                *self = Holders::Many(rest.into_boxed_slice());
                false
            }
        }
    }

    /// Heap bytes owned beyond the inline value.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::One(_) => 0,
            Holders::Many(holders) => std::mem::size_of_val::<[Holder]>(holders),
        }
    }
}
