//! One pass over a payload's msgpack into a [`RawBatch`]: the batch's shape as published, with
//! its two long arrays (token ids, block hashes) read straight into typed vectors, map keys
//! and string fields borrowed from the payload, and everything else as [`rmpv::Value`]s.
//!
//! Why not `rmpv::decode::read_value` of the whole payload, as before: a store event of a
//! chunked prefill carries ~8,000 token ids, and rmpv reads each into a 32-byte `Value` of a
//! vector grown by pushing (it does not trust a declared length), then kvpick copied them
//! out and dropped the tree; and an eviction is one event per block, each with four keys and
//! two strings rmpv allocates. With pods publishing events, that tree was ~30% of the event
//! thread's CPU, and a cold 220 KB request cost 18 ms of kvpick CPU instead of 12
//! (docs/benchmarks.md, session 31).
//!
//! Exactness: the result must be what reading the whole payload with rmpv gives
//! ([`RawBatch::from_value`], the reference). So:
//! - a typed array is read only when every element has the type its field accepts (a token
//!   id that fits in `u32`; a hash that is an integer or non-empty bytes); on anything else,
//!   including the end of the input, the reader goes back to the array's first byte and reads
//!   it with rmpv, so the value and any error are rmpv's own; likewise a string that is not
//!   UTF-8 (rmpv keeps it as a `Value::String` that is no `str`);
//! - every other value is read with rmpv at the depth budget rmpv would have left at that
//!   point (rmpv spends one unit per value and one more per array, map, string or bytes), so
//!   "too deep" fails at the same byte;
//! - declared lengths reserve at most one element per byte left and at most
//!   [`RESERVE_BYTES`], so a hostile length cannot make the reader allocate more than what
//!   it reads (a list longer than that grows as its elements are read).
//!
//! Memory: the reader keeps only what the decoder reads, and steps over the rest with
//! [`crate::skip`] (which fails where rmpv would). Kept: the first pair of each key the
//! decoder knows ([`FIELD_KEYS`]), a legacy event's first [`LEGACY_FIELDS`] fields, the
//! events up to the first that is neither a map nor an array (decoding stops there), and the
//! batch's first three items. A collection where the decoder takes a scalar is checked and
//! kept as [`Slot::Skipped`]; a typed array with an element its field does not take as
//! [`Slot::Invalid`]; `extra_keys` as its bytes ([`RawList`]), read entry by entry when
//! decoded. So no payload makes the reader hold much more than the decoded batch: before,
//! a message of one-byte elements where nothing reads them grew ~30× as rmpv read it.

use std::ops::Range;

use rmpv::Value;

use crate::EngineHash;

/// The most a declared length may reserve up front, in bytes.
const RESERVE_BYTES: usize = 1 << 20;

/// Deepest msgpack nesting accepted (real payloads nest 4 levels), as rmpv counts it.
pub(crate) const MAX_DEPTH: usize = 16;
/// rmpv's depth budget for the batch's items: the batch array spent 2.
const ITEM_DEPTH: usize = MAX_DEPTH - 2;
/// … for each event in the events array.
const EVENT_DEPTH: usize = ITEM_DEPTH - 2;
/// … for an event's keys and fields.
const FIELD_DEPTH: usize = EVENT_DEPTH - 2;
// A typed array's elements (FIELD_DEPTH - 2) must have room for a bytes value (2 units).
const _: () = assert!(FIELD_DEPTH >= 4);

/// The keys of a tagged map's fields that the decoder reads (`crate::batch`); the reader
/// keeps no other.
const FIELD_KEYS: [&str; 10] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];

/// A key's index in [`FIELD_KEYS`], if the decoder reads it.
fn field_key(key: &str) -> Option<usize> {
    Some(match key {
        "type" => 0,
        "block_hashes" => 1,
        "parent_block_hash" => 2,
        "token_ids" => 3,
        "block_size" => 4,
        "lora_id" => 5,
        "medium" => 6,
        "lora_name" => 7,
        "extra_keys" => 8,
        "group_idx" => 9,
        _ => return None,
    })
}

/// The fields of a legacy tagged array the decoder reads: the tag and `BlockStored`'s nine.
const LEGACY_FIELDS: usize = 10;

/// A payload's top level as read.
#[derive(Debug, PartialEq)]
pub(crate) enum RawBatch<'a> {
    /// An array `[ts, events, dp_rank, …]` (the reader keeps its first three items).
    Array(Vec<BatchItem<'a>>),
    /// Anything else.
    Other,
}

/// One item of the batch array.
#[derive(Debug, PartialEq)]
pub(crate) enum BatchItem<'a> {
    /// The events: the item at index 1, when it is an array.
    Events(Events<'a>),
    /// Any other item.
    Value(Value),
    /// An array or map where the decoder takes none (checked, not kept).
    Skipped,
}

/// The batch's events, their fields kept in two lists shared by all of them: one allocation
/// per batch rather than one per event (a pod evicting publishes one event per block).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Events<'a> {
    /// The events in order.
    pub(crate) list: Vec<RawEvent>,
    /// The tagged maps' key–field pairs.
    pub(crate) pairs: Vec<(Key<'a>, Slot<'a>)>,
    /// The tagged arrays' fields.
    pub(crate) fields: Vec<Slot<'a>>,
}

/// One event as read.
#[derive(Debug, PartialEq)]
pub(crate) enum RawEvent {
    /// The tagged-map layout (vLLM ≥ ~0.24): its key–field pairs in order, in
    /// [`Events::pairs`].
    Map(Range<usize>),
    /// The legacy tagged-array layout: tag first, then the fields by position, in
    /// [`Events::fields`].
    Array(Range<usize>),
    /// Neither (the reader keeps no event after it: decoding stops here).
    Other,
}

/// A tagged map's key.
#[derive(Debug, PartialEq)]
pub(crate) enum Key<'a> {
    /// A string, borrowed from the payload.
    Str(&'a str),
    /// Anything else (a string only from the reference).
    Value(Value),
}

impl Key<'_> {
    /// The key as a string, if it is one.
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Key::Str(s) => Some(s),
            Key::Value(v) => v.as_str(),
        }
    }
}

/// An event's field.
#[derive(Debug, PartialEq)]
pub(crate) enum Slot<'a> {
    /// Read as a value.
    Value(Value),
    /// A string, borrowed from the payload (the tag, `medium`, …): no allocation per event.
    Str(&'a str),
    /// `token_ids`, every element a token id.
    Tokens(Vec<u32>),
    /// `block_hashes`, every element a hash.
    Hashes(Vec<EngineHash>),
    /// `extra_keys` as an array, checked and left in the payload.
    Extra(RawList<'a>),
    /// An array or map where the field takes none (checked, not kept): the decoder's type
    /// error, as for any value of the wrong type.
    Skipped,
    /// A typed field's array with an element the field does not take: the decoder's error
    /// for it (`Hash`, `TokenId`).
    Invalid(crate::DecodeError),
    /// Already taken by the decoder.
    Taken,
}

/// An array left in the payload: its length, and its elements' bytes (checked by
/// [`crate::skip`] at [`RawList::DEPTH`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RawList<'a> {
    /// How many elements.
    pub(crate) len: usize,
    /// The elements' bytes, after the array's header.
    pub(crate) bytes: &'a [u8],
}

impl RawList<'_> {
    /// The depth budget rmpv had for the elements (a field's array spent 2).
    pub(crate) const DEPTH: usize = FIELD_DEPTH - 2;

    /// Reads the next element into a value if it holds at most `cap` values; `Ok(None)` if
    /// it holds more (the element is passed over either way).
    pub(crate) fn next_within(&mut self, cap: usize) -> Result<Option<Value>, rmpv::decode::Error> {
        // What vLLM publishes for a block without extra keys: one nil each.
        if let Some((0xc0, rest)) = self.bytes.split_first() {
            self.bytes = rest;
            return Ok(Some(Value::Nil));
        }
        let start = self.bytes;
        if crate::skip::skip(&mut self.bytes, Self::DEPTH)? > cap {
            return Ok(None);
        }
        let mut element = start;
        rmpv::decode::read_value_with_max_depth(&mut element, Self::DEPTH).map(Some)
    }
}

impl<'a> RawBatch<'a> {
    /// Reads one batch from the front of `input`, leaving the rest (trailing bytes) in it.
    pub(crate) fn read(input: &mut &'a [u8]) -> Result<RawBatch<'a>, rmpv::decode::Error> {
        let mut reader = Reader { rest: input };
        let batch = reader.batch();
        *input = reader.rest;
        batch
    }

    /// The reference: the batch as read by rmpv into one value, arranged as [`Self::read`]
    /// arranges it, with every field a [`Slot::Value`]. Kept to test and fuzz the reader
    /// against.
    pub(crate) fn from_value(value: Value) -> RawBatch<'a> {
        let Value::Array(items) = value else {
            return RawBatch::Other;
        };
        let items = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match (i, item) {
                (1, Value::Array(values)) => {
                    let mut events = Events::default();
                    for value in values {
                        events.push_value(value);
                    }
                    BatchItem::Events(events)
                }
                (_, item) => BatchItem::Value(item),
            });
        RawBatch::Array(items.collect())
    }
}

impl Events<'_> {
    /// Adds an event read whole by rmpv (the reference), every field a [`Slot::Value`].
    fn push_value(&mut self, value: Value) {
        let event = match value {
            Value::Map(pairs) => {
                let start = self.pairs.len();
                let pairs = pairs.into_iter();
                self.pairs
                    .extend(pairs.map(|(k, v)| (Key::Value(k), Slot::Value(v))));
                RawEvent::Map(start..self.pairs.len())
            }
            Value::Array(items) => {
                let start = self.fields.len();
                self.fields.extend(items.into_iter().map(Slot::Value));
                RawEvent::Array(start..self.fields.len())
            }
            _ => RawEvent::Other,
        };
        self.list.push(event);
    }
}

/// Which typed array a field is read as, when it can be.
#[derive(Clone, Copy, PartialEq)]
enum Typed {
    Tokens,
    Hashes,
    /// `extra_keys`: an array is left in the payload ([`Slot::Extra`]).
    Extra,
    No,
}

impl Typed {
    /// A tagged map's field, by its key.
    fn of_key(key: &Key<'_>) -> Typed {
        match key.as_str() {
            Some("token_ids") => Typed::Tokens,
            Some("block_hashes") => Typed::Hashes,
            Some("extra_keys") => Typed::Extra,
            _ => Typed::No,
        }
    }

    /// A tagged array's field, by the event's tag and the field's index (the tag is 0).
    fn of_index(tag: Option<&str>, index: usize) -> Typed {
        match (tag, index) {
            (Some("BlockStored" | "BlockRemoved"), 1) => Typed::Hashes,
            (Some("BlockStored"), 3) => Typed::Tokens,
            (Some("BlockStored"), 8) => Typed::Extra,
            _ => Typed::No,
        }
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn batch(&mut self) -> Result<RawBatch<'a>, rmpv::decode::Error> {
        let Some(len) = self.array_len() else {
            self.skip(MAX_DEPTH)?;
            return Ok(RawBatch::Other);
        };
        // The decoder reads `ts`, the events and `dp_rank`: the rest is only checked.
        let mut items = Vec::with_capacity(len.min(3));
        for i in 0..len {
            let item = if i == 1
                && let Some(events) = self.array_len()
            {
                BatchItem::Events(self.events(events)?)
            } else if i < 3 && self.collection_ahead() {
                self.skip(ITEM_DEPTH)?;
                BatchItem::Skipped
            } else if i < 3 {
                BatchItem::Value(self.value(ITEM_DEPTH)?)
            } else {
                self.skip(ITEM_DEPTH)?;
                continue;
            };
            items.push(item);
        }
        Ok(RawBatch::Array(items))
    }

    /// The events array's `len` events, its header read.
    fn events(&mut self, len: usize) -> Result<Events<'a>, rmpv::decode::Error> {
        let mut events = Events {
            list: Vec::with_capacity(self.bounded::<RawEvent>(len)),
            ..Events::default()
        };
        for e in 0..len {
            if events.list.last() == Some(&RawEvent::Other) {
                // Decoding fails at that event: the rest are only checked.
                self.skip(EVENT_DEPTH)?;
                continue;
            }
            self.event(&mut events)?;
            if e == 0 {
                // A batch's events nearly always have one shape (an eviction is one event per
                // block): room for the rest at once, rather than growing the lists, and
                // copying them, as they fill.
                let more = len - 1;
                let pairs = events.pairs.len().saturating_mul(more);
                let fields = events.fields.len().saturating_mul(more);
                events.pairs.reserve(self.bounded::<(Key, Slot)>(pairs));
                events.fields.reserve(self.bounded::<Slot>(fields));
            }
        }
        Ok(events)
    }

    /// Reads one event into `events`.
    fn event(&mut self, events: &mut Events<'a>) -> Result<(), rmpv::decode::Error> {
        let event = if let Some(len) = self.map_len() {
            let pairs = &mut events.pairs;
            let start = pairs.len();
            pairs.reserve(len.min(FIELD_KEYS.len()));
            // The known keys this event has kept, by their index in FIELD_KEYS.
            let mut kept = 0u16;
            for _ in 0..len {
                let key = self.str();
                let known = key.and_then(field_key);
                // NOTE: the decoder reads a key's first pair; later ones are only checked.
                match known {
                    Some(index) if kept & (1 << index) == 0 => {
                        kept |= 1 << index;
                        let key = Key::Str(FIELD_KEYS[index]);
                        let field = self.field(Typed::of_key(&key))?;
                        pairs.push((key, field));
                    }
                    _ => {
                        if key.is_none() {
                            self.skip(FIELD_DEPTH)?;
                        }
                        self.skip(FIELD_DEPTH)?;
                    }
                }
            }
            RawEvent::Map(start..pairs.len())
        } else if let Some(len) = self.array_len() {
            let fields = &mut events.fields;
            let start = fields.len();
            fields.reserve(len.min(LEGACY_FIELDS));
            for i in 0..len {
                if i >= LEGACY_FIELDS {
                    self.skip(FIELD_DEPTH)?;
                    continue;
                }
                let tag = match fields.get(start) {
                    Some(Slot::Str(tag)) => Some(*tag),
                    Some(Slot::Value(tag)) => tag.as_str(),
                    _ => None,
                };
                let field = self.field(Typed::of_index(tag, i))?;
                fields.push(field);
            }
            RawEvent::Array(start..fields.len())
        } else {
            self.skip(EVENT_DEPTH)?;
            RawEvent::Other
        };
        events.list.push(event);
        Ok(())
    }

    /// One field: as a typed array when `typed` says so and every element fits, a string as
    /// borrowed, a scalar in place; an array or map the field cannot take checked and not
    /// kept; anything else by rmpv.
    fn field(&mut self, typed: Typed) -> Result<Slot<'a>, rmpv::decode::Error> {
        let start = self.rest;
        let read = match typed {
            Typed::Tokens => self.typed_array(token).map(Slot::Tokens),
            Typed::Hashes => self.typed_array(hash).map(Slot::Hashes),
            Typed::Extra | Typed::No => None,
        };
        if let Some(slot) = read {
            return Ok(slot);
        }
        self.rest = start;
        if let Some(text) = self.str() {
            return Ok(Slot::Str(text));
        }
        if let Some(value) = self.scalar() {
            return Ok(Slot::Value(value));
        }
        self.rest = start;
        if !self.collection_ahead() {
            // Floats, binaries, exts and strings that are not UTF-8: no larger than their bytes.
            return Ok(Slot::Value(self.value(FIELD_DEPTH)?));
        }
        let array = self.array_len();
        let elements = self.rest;
        self.rest = start;
        self.skip(FIELD_DEPTH)?;
        Ok(match (typed, array) {
            (Typed::Extra, Some(len)) => Slot::Extra(RawList {
                len,
                bytes: &elements[..elements.len() - self.rest.len()],
            }),
            // The reference gives each field's own error for an element it does not take.
            (Typed::Tokens, Some(_)) => Slot::Invalid(crate::DecodeError::TokenId),
            (Typed::Hashes, Some(_)) => Slot::Invalid(crate::DecodeError::Hash),
            _ => Slot::Skipped,
        })
    }

    /// An array whose every element `element` reads; `None` at the first one it cannot
    /// (the caller rewinds).
    fn typed_array<T>(&mut self, element: fn(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        let len = self.array_len()?;
        let mut out = Vec::with_capacity(self.bounded::<T>(len));
        for _ in 0..len {
            out.push(element(self)?);
        }
        Some(out)
    }

    /// The next value if it is a valid UTF-8 string (else `None`, nothing consumed: rmpv
    /// reads it, and an invalid one is its `Value::String` that is no `str`).
    ///
    /// NOTE: where this is called, rmpv would have depth left for a string (`FIELD_DEPTH`).
    fn str(&mut self) -> Option<&'a str> {
        let (&marker, rest) = self.rest.split_first()?;
        let (len, rest) = match marker {
            0xa0..=0xbf => (usize::from(marker & 0x1f), rest),
            0xd9 => (usize::from(*rest.first()?), &rest[1..]),
            0xda => {
                let (len, rest) = rest.split_first_chunk::<2>()?;
                (usize::from(u16::from_be_bytes(*len)), rest)
            }
            0xdb => {
                let (len, rest) = rest.split_first_chunk::<4>()?;
                (usize::try_from(u32::from_be_bytes(*len)).ok()?, rest)
            }
            _ => return None,
        };
        let (text, rest) = rest.split_at_checked(len)?;
        let text = match known_str(text) {
            Some(known) => known,
            None => std::str::from_utf8(text).ok()?,
        };
        self.rest = rest;
        Some(text)
    }

    /// The next value if it is nil, a boolean or an integer, as rmpv reads it (else `None`,
    /// with the input left anywhere: the caller rewinds). An event's small fields
    /// (`group_idx`, `lora_id`, `block_size`, …) are these, and rmpv's reader costs more than
    /// the value.
    ///
    /// NOTE: rmpv spends one unit of depth on a scalar; where this is called it has more.
    fn scalar(&mut self) -> Option<Value> {
        match self.rest.first()? {
            0xc0 => {
                self.rest = self.rest.get(1..)?;
                Some(Value::Nil)
            }
            &marker @ (0xc2 | 0xc3) => {
                self.rest = self.rest.get(1..)?;
                Some(Value::Boolean(marker == 0xc3))
            }
            _ => Some(match self.integer()? {
                Integer::Unsigned(n) => Value::from(n),
                Integer::Signed(n) => Value::from(n),
            }),
        }
    }

    /// One value by rmpv, with `depth` of its depth budget left.
    fn value(&mut self, depth: usize) -> Result<Value, rmpv::decode::Error> {
        rmpv::decode::read_value_with_max_depth(&mut self.rest, depth)
    }

    /// Steps over one value with `depth` of rmpv's depth budget left, failing as rmpv would.
    fn skip(&mut self, depth: usize) -> Result<usize, rmpv::decode::Error> {
        crate::skip::skip(&mut self.rest, depth)
    }

    /// Whether the next value is an array or a map.
    fn collection_ahead(&self) -> bool {
        matches!(self.rest.first(), Some(0x80..=0x9f | 0xdc..=0xdf))
    }

    /// What a declared length of `len` elements of `T` may reserve: at most one per byte left
    /// and [`RESERVE_BYTES`] in all.
    fn bounded<T>(&self, len: usize) -> usize {
        len.min(self.rest.len())
            .min(RESERVE_BYTES / size_of::<T>().max(1))
    }

    /// An array's length, its marker consumed; `None` (nothing consumed) if the next value is
    /// not an array or its header is cut short.
    fn array_len(&mut self) -> Option<usize> {
        self.collection_len(0x90, 0xdc)
    }

    /// A map's length, as [`Self::array_len`].
    fn map_len(&mut self) -> Option<usize> {
        self.collection_len(0x80, 0xde)
    }

    /// `fix` is the fix-length marker family (low 4 bits the length), `wide` the 16-bit
    /// length marker (the 32-bit one follows it).
    fn collection_len(&mut self, fix: u8, wide: u8) -> Option<usize> {
        let (&marker, rest) = self.rest.split_first()?;
        let (len, rest) = match marker {
            m if m & 0xf0 == fix => (usize::from(m & 0x0f), rest),
            m if m == wide => {
                let (bytes, rest) = rest.split_first_chunk::<2>()?;
                (usize::from(u16::from_be_bytes(*bytes)), rest)
            }
            m if m == wide + 1 => {
                let (bytes, rest) = rest.split_first_chunk::<4>()?;
                (usize::try_from(u32::from_be_bytes(*bytes)).ok()?, rest)
            }
            _ => return None,
        };
        self.rest = rest;
        Some(len)
    }

    /// The next value if it is an integer, as rmpv's `Integer` holds it: unsigned, or signed
    /// when negative.
    fn integer(&mut self) -> Option<Integer> {
        let (&marker, rest) = self.rest.split_first()?;
        self.rest = rest;
        Some(match marker {
            0x00..=0x7f => Integer::Unsigned(u64::from(marker)),
            0xe0..=0xff => Integer::Signed(i64::from(marker as i8)),
            0xcc => Integer::Unsigned(u64::from(self.bytes::<1>()?[0])),
            0xcd => Integer::Unsigned(u64::from(u16::from_be_bytes(self.bytes()?))),
            0xce => Integer::Unsigned(u64::from(u32::from_be_bytes(self.bytes()?))),
            0xcf => Integer::Unsigned(u64::from_be_bytes(self.bytes()?)),
            0xd0 => Integer::signed(i64::from(i8::from_be_bytes(self.bytes()?))),
            0xd1 => Integer::signed(i64::from(i16::from_be_bytes(self.bytes()?))),
            0xd2 => Integer::signed(i64::from(i32::from_be_bytes(self.bytes()?))),
            0xd3 => Integer::signed(i64::from_be_bytes(self.bytes()?)),
            _ => return None,
        })
    }

    fn bytes<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (bytes, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*bytes)
    }
}

/// Strings every event repeats (keys, tags, tiers), matched as bytes: equal bytes are the same
/// valid UTF-8, so they skip the check (a removal event carries five strings).
fn known_str(bytes: &[u8]) -> Option<&'static str> {
    Some(match bytes {
        b"type" => "type",
        b"block_hashes" => "block_hashes",
        b"medium" => "medium",
        b"group_idx" => "group_idx",
        b"BlockRemoved" => "BlockRemoved",
        b"BlockStored" => "BlockStored",
        b"GPU" => "GPU",
        b"CPU" => "CPU",
        b"parent_block_hash" => "parent_block_hash",
        b"token_ids" => "token_ids",
        b"block_size" => "block_size",
        b"lora_id" => "lora_id",
        b"lora_name" => "lora_name",
        b"extra_keys" => "extra_keys",
        b"kv_cache_spec_kind" => "kv_cache_spec_kind",
        b"AllBlocksCleared" => "AllBlocksCleared",
        _ => return None,
    })
}

/// An integer as rmpv keeps it: non-negative ones as unsigned, whatever their marker.
#[derive(Clone, Copy)]
enum Integer {
    Unsigned(u64),
    Signed(i64),
}

impl Integer {
    fn signed(value: i64) -> Integer {
        match u64::try_from(value) {
            Ok(unsigned) => Integer::Unsigned(unsigned),
            Err(_) => Integer::Signed(value),
        }
    }
}

/// A token id: an integer that fits in `u32` (the decoder's rule, `crate::batch`).
fn token(reader: &mut Reader<'_>) -> Option<u32> {
    // A 151k vocabulary's ids, read here first: a store carries 8,192 of them.
    let (&marker, rest) = reader.rest.split_first()?;
    let fast = match marker {
        0x00..=0x7f => Some((u32::from(marker), rest)),
        0xcd => rest
            .split_first_chunk::<2>()
            .map(|(id, rest)| (u32::from(u16::from_be_bytes(*id)), rest)),
        0xce => rest
            .split_first_chunk::<4>()
            .map(|(id, rest)| (u32::from_be_bytes(*id), rest)),
        _ => None,
    };
    if let Some((id, rest)) = fast {
        reader.rest = rest;
        return Some(id);
    }
    match reader.integer()? {
        Integer::Unsigned(id) => u32::try_from(id).ok(),
        Integer::Signed(_) => None,
    }
}

/// A block hash: any integer (a negative one reinterpreted), or non-empty bytes (their last
/// 8, big-endian) — the decoder's rule, `crate::batch::hash`.
fn hash(reader: &mut Reader<'_>) -> Option<EngineHash> {
    let (&marker, rest) = reader.rest.split_first()?;
    let len = match marker {
        0xc4 => usize::from(rest.first().copied()?),
        0xc5 => usize::from(u16::from_be_bytes(*rest.split_first_chunk::<2>()?.0)),
        0xc6 => usize::try_from(u32::from_be_bytes(*rest.split_first_chunk::<4>()?.0)).ok()?,
        _ => {
            return match reader.integer()? {
                Integer::Unsigned(h) => Some(EngineHash(h)),
                Integer::Signed(h) => Some(EngineHash(h as u64)),
            };
        }
    };
    let header = match marker {
        0xc4 => 1,
        0xc5 => 2,
        _ => 4,
    };
    let (bytes, rest) = rest[header..].split_at_checked(len)?;
    if bytes.is_empty() {
        return None;
    }
    reader.rest = rest;
    Some(crate::batch::hash_of_bytes(bytes))
}

#[cfg(test)]
#[path = "reader_tests.rs"]
mod tests;
