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
//! - declared lengths reserve at most one element per byte left, so a hostile length cannot
//!   allocate more than the payload's size.

use rmpv::Value;

use crate::EngineHash;

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

/// A payload's top level as read.
#[derive(Debug, PartialEq)]
pub(crate) enum RawBatch<'a> {
    /// An array `[ts, events, dp_rank, …]`.
    Array(Vec<BatchItem<'a>>),
    /// Anything else.
    Other(Value),
}

/// One item of the batch array.
#[derive(Debug, PartialEq)]
pub(crate) enum BatchItem<'a> {
    /// The events: the item at index 1, when it is an array.
    Events(Vec<RawEvent<'a>>),
    /// Any other item.
    Value(Value),
}

/// One event as read.
#[derive(Debug, PartialEq)]
pub(crate) enum RawEvent<'a> {
    /// The tagged-map layout (vLLM ≥ ~0.24): its key–field pairs in order.
    Map(Vec<(Key<'a>, Slot<'a>)>),
    /// The legacy tagged-array layout: tag first, then the fields by position.
    Array(Vec<Slot<'a>>),
    /// Neither.
    Other(Value),
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
    /// Already taken by the decoder.
    Taken,
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
            return RawBatch::Other(value);
        };
        let items = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match (i, item) {
                (1, Value::Array(events)) => {
                    BatchItem::Events(events.into_iter().map(RawEvent::from_value).collect())
                }
                (_, item) => BatchItem::Value(item),
            });
        RawBatch::Array(items.collect())
    }
}

impl RawEvent<'_> {
    fn from_value(value: Value) -> Self {
        match value {
            Value::Map(pairs) => RawEvent::Map(
                pairs
                    .into_iter()
                    .map(|(k, v)| (Key::Value(k), Slot::Value(v)))
                    .collect(),
            ),
            Value::Array(items) => RawEvent::Array(items.into_iter().map(Slot::Value).collect()),
            other => RawEvent::Other(other),
        }
    }
}

/// Which typed array a field is read as, when it can be.
#[derive(Clone, Copy, PartialEq)]
enum Typed {
    Tokens,
    Hashes,
    No,
}

impl Typed {
    /// A tagged map's field, by its key.
    fn of_key(key: &Key<'_>) -> Typed {
        match key.as_str() {
            Some("token_ids") => Typed::Tokens,
            Some("block_hashes") => Typed::Hashes,
            _ => Typed::No,
        }
    }

    /// A tagged array's field, by the event's tag and the field's index (the tag is 0).
    fn of_index(tag: Option<&str>, index: usize) -> Typed {
        match (tag, index) {
            (Some("BlockStored" | "BlockRemoved"), 1) => Typed::Hashes,
            (Some("BlockStored"), 3) => Typed::Tokens,
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
            return Ok(RawBatch::Other(self.value(MAX_DEPTH)?));
        };
        let mut items = Vec::with_capacity(self.bounded(len));
        for i in 0..len {
            let item = if i == 1
                && let Some(events) = self.array_len()
            {
                let mut list = Vec::with_capacity(self.bounded(events));
                for _ in 0..events {
                    list.push(self.event()?);
                }
                BatchItem::Events(list)
            } else {
                BatchItem::Value(self.value(ITEM_DEPTH)?)
            };
            items.push(item);
        }
        Ok(RawBatch::Array(items))
    }

    fn event(&mut self) -> Result<RawEvent<'a>, rmpv::decode::Error> {
        if let Some(len) = self.map_len() {
            let mut pairs = Vec::with_capacity(self.bounded(len));
            for _ in 0..len {
                let key = match self.str() {
                    Some(key) => Key::Str(key),
                    None => Key::Value(self.value(FIELD_DEPTH)?),
                };
                let field = self.field(Typed::of_key(&key))?;
                pairs.push((key, field));
            }
            return Ok(RawEvent::Map(pairs));
        }
        if let Some(len) = self.array_len() {
            let mut fields: Vec<Slot<'a>> = Vec::with_capacity(self.bounded(len));
            for i in 0..len {
                let tag = match fields.first() {
                    Some(Slot::Str(tag)) => Some(*tag),
                    Some(Slot::Value(tag)) => tag.as_str(),
                    _ => None,
                };
                let field = self.field(Typed::of_index(tag, i))?;
                fields.push(field);
            }
            return Ok(RawEvent::Array(fields));
        }
        Ok(RawEvent::Other(self.value(EVENT_DEPTH)?))
    }

    /// One field: as a typed array when `typed` says so and every element fits, a string as
    /// borrowed, else by rmpv.
    fn field(&mut self, typed: Typed) -> Result<Slot<'a>, rmpv::decode::Error> {
        let start = self.rest;
        let read = match typed {
            Typed::Tokens => self.typed_array(token).map(Slot::Tokens),
            Typed::Hashes => self.typed_array(hash).map(Slot::Hashes),
            Typed::No => self.str().map(Slot::Str),
        };
        match read {
            Some(slot) => Ok(slot),
            None => {
                self.rest = start;
                Ok(Slot::Value(self.value(FIELD_DEPTH)?))
            }
        }
    }

    /// An array whose every element `element` reads; `None` at the first one it cannot
    /// (the caller rewinds).
    fn typed_array<T>(&mut self, element: fn(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        let len = self.array_len()?;
        let mut out = Vec::with_capacity(self.bounded(len));
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
        let text = std::str::from_utf8(text).ok()?;
        self.rest = rest;
        Some(text)
    }

    /// One value by rmpv, with `depth` of its depth budget left.
    fn value(&mut self, depth: usize) -> Result<Value, rmpv::decode::Error> {
        rmpv::decode::read_value_with_max_depth(&mut self.rest, depth)
    }

    /// At most one element per byte left: what a declared length may reserve.
    fn bounded(&self, len: usize) -> usize {
        len.min(self.rest.len())
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
mod tests {
    use super::*;
    use crate::tests::encode;

    /// The batch as read, and checked against the reference.
    fn read(value: &Value) -> RawBatch<'static> {
        // NOTE: leaked so the batch can borrow it; a test's few bytes.
        let payload: &'static [u8] = Vec::leak(encode(value));
        assert_eq!(
            crate::batch::decode_batch(RawBatch::from_value(value.clone())),
            crate::decode_payload(payload),
        );
        let mut rest = payload;
        let batch = RawBatch::read(&mut rest).unwrap();
        assert!(rest.is_empty());
        batch
    }

    fn only_event(batch: RawBatch<'static>) -> RawEvent<'static> {
        let RawBatch::Array(mut items) = batch else {
            panic!("not an array")
        };
        let Some(BatchItem::Events(mut events)) = items.drain(..).nth(1) else {
            panic!("no events")
        };
        events.remove(0)
    }

    fn batch_of(event: Value) -> Value {
        Value::Array(vec![Value::F64(1.0), Value::Array(vec![event])])
    }

    #[test]
    fn a_store_events_arrays_are_read_typed_in_both_layouts() {
        let hashes = Value::Array(vec![
            Value::from(7u64),
            Value::from(-1i64),
            Value::Binary(vec![1, 2]),
        ]);
        let tokens = Value::Array((0..48u32).map(|t| Value::from(t * 5_000)).collect());
        let map = batch_of(Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            ("block_hashes".into(), hashes.clone()),
            ("token_ids".into(), tokens.clone()),
        ]));
        let RawEvent::Map(pairs) = only_event(read(&map)) else {
            panic!("not a map")
        };
        let expected_hashes = vec![EngineHash(7), EngineHash(u64::MAX), EngineHash(0x0102)];
        assert_eq!(pairs[1].1, Slot::Hashes(expected_hashes.clone()));
        assert_eq!(
            pairs[2].1,
            Slot::Tokens((0..48u32).map(|t| t * 5_000).collect())
        );
        let legacy = batch_of(Value::Array(vec![
            "BlockStored".into(),
            hashes,
            Value::Nil,
            tokens,
        ]));
        let RawEvent::Array(fields) = only_event(read(&legacy)) else {
            panic!("not an array")
        };
        assert_eq!(fields[1], Slot::Hashes(expected_hashes));
        assert!(matches!(&fields[3], Slot::Tokens(ids) if ids.len() == 48));
        // A removal's hashes too; not another event's fields at those places.
        let removed = batch_of(Value::Array(vec![
            "BlockRemoved".into(),
            Value::Array(vec![Value::from(3u64)]),
            Value::Nil,
            Value::Array(vec![Value::from(1u64)]),
        ]));
        let RawEvent::Array(fields) = only_event(read(&removed)) else {
            panic!("not an array")
        };
        assert_eq!(fields[1], Slot::Hashes(vec![EngineHash(3)]));
        assert!(matches!(fields[3], Slot::Value(Value::Array(_))));
    }

    #[test]
    fn keys_and_string_fields_are_borrowed_and_an_invalid_one_is_rmpvs() {
        let event = batch_of(Value::Map(vec![
            ("type".into(), "BlockRemoved".into()),
            ("block_hashes".into(), Value::Array(vec![Value::from(3u64)])),
            ("medium".into(), "CPU".into()),
            (Value::from(7), Value::Nil),
        ]));
        let RawEvent::Map(pairs) = only_event(read(&event)) else {
            panic!("not a map")
        };
        assert_eq!(pairs[0], (Key::Str("type"), Slot::Str("BlockRemoved")));
        assert_eq!(pairs[2], (Key::Str("medium"), Slot::Str("CPU")));
        assert_eq!(
            pairs[3],
            (Key::Value(Value::from(7)), Slot::Value(Value::Nil))
        );
        // A string that is not UTF-8: rmpv's value (which is no `str`), as the reference has it.
        let mut payload = vec![0x92, 0x01, 0x91, 0x92, 0xa2, 0xff, 0xfe, 0xc0];
        let mut rest: &[u8] = &payload;
        let RawBatch::Array(items) = RawBatch::read(&mut rest).unwrap() else {
            panic!("not an array")
        };
        let BatchItem::Events(events) = &items[1] else {
            panic!("no events")
        };
        let RawEvent::Array(fields) = &events[0] else {
            panic!("not an array")
        };
        assert!(matches!(&fields[0], Slot::Value(Value::String(s)) if s.as_str().is_none()));
        assert_eq!(
            crate::decode_payload(&payload),
            Err(crate::DecodeError::EventTag)
        );
        payload[4] = 0xa1; // the string cut short: rmpv's error
        assert_eq!(
            crate::decode_payload(&payload[..6]),
            crate::decode_payload_reference(&payload[..6])
        );
    }

    #[test]
    fn an_element_the_field_does_not_take_sends_the_array_back_to_rmpv() {
        for bad in [
            Value::from(u64::from(u32::MAX) + 1),
            Value::from(-1i64),
            Value::F64(2.0),
        ] {
            let tokens = Value::Array(vec![Value::from(1u32), bad]);
            let event = batch_of(Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                ("block_hashes".into(), Value::Array(vec![Value::from(1u64)])),
                ("token_ids".into(), tokens.clone()),
            ]));
            let RawEvent::Map(pairs) = only_event(read(&event)) else {
                panic!("not a map")
            };
            assert_eq!(pairs[2].1, Slot::Value(tokens));
        }
        let hashes = Value::Array(vec![Value::from(1u64), Value::Binary(Vec::new())]);
        let event = batch_of(Value::Array(vec!["BlockRemoved".into(), hashes.clone()]));
        let RawEvent::Array(fields) = only_event(read(&event)) else {
            panic!("not an array")
        };
        assert_eq!(fields[1], Slot::Value(hashes));
    }

    #[test]
    fn a_declared_length_past_the_input_is_rmpvs_error_and_reserves_nothing_past_it() {
        // An event array declaring 2^32 - 1 token ids, with three present.
        let mut payload = vec![0x92, 0x01, 0x91, 0x82];
        payload.extend(encode(&Value::from("type")));
        payload.extend(encode(&Value::from("BlockStored")));
        payload.extend(encode(&Value::from("token_ids")));
        payload.extend([0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02, 0x03]);
        let fast = crate::decode_payload(&payload);
        assert!(
            matches!(fast, Err(crate::DecodeError::Msgpack(_))),
            "{fast:?}"
        );
        assert_eq!(fast, crate::decode_payload_reference(&payload));
        let reader = Reader {
            rest: &payload[..4],
        };
        assert_eq!(reader.bounded(u32::MAX as usize), 4);
    }
}
