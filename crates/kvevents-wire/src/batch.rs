//! What a read batch means: the [`RawBatch`] of [`crate::reader`] interpreted as vLLM's
//! `EventBatch` in either layout (tagged maps, legacy tagged arrays), tolerant of fields
//! missing at their default and of fields it does not know.

use std::borrow::Cow;

use rmpv::Value;

use crate::reader::{BatchItem, Events, Key, RawBatch, RawEvent, RawList, Slot};
use crate::{
    BlockExtra, BlockRemoved, BlockStored, DecodeError, EngineHash, EventBatch, KvEvent, Tier,
};

pub(crate) fn decode_batch(batch: RawBatch<'_>) -> Result<EventBatch, DecodeError> {
    let RawBatch::Array(mut items) = batch else {
        return Err(DecodeError::BatchShape);
    };
    let ts = match items.first() {
        Some(BatchItem::Value(v)) => as_f64(v).ok_or(DecodeError::FieldType { field: "ts" })?,
        Some(BatchItem::Events(_) | BatchItem::Skipped) => {
            return Err(DecodeError::FieldType { field: "ts" });
        }
        None => return Err(DecodeError::BatchShape),
    };
    let events = match items.get_mut(1) {
        Some(BatchItem::Events(events)) => {
            let Events {
                list,
                pairs,
                fields,
            } = events;
            // NOTE: not `collect::<Result<_, _>>`, which cannot size the list up front (an
            // eviction's thousands of events were copied as it grew).
            let mut decoded = Vec::with_capacity(list.len());
            for event in list.iter() {
                decoded.push(decode_event(event, pairs, fields)?);
            }
            decoded
        }
        Some(BatchItem::Value(_) | BatchItem::Skipped) => {
            return Err(DecodeError::FieldType { field: "events" });
        }
        None => return Err(DecodeError::BatchShape),
    };
    let dp_rank = match items.get(2) {
        None | Some(BatchItem::Value(Value::Nil)) => None,
        Some(BatchItem::Value(v)) => Some(as_i64(v).ok_or(DecodeError::FieldType {
            field: "data_parallel_rank",
        })?),
        Some(BatchItem::Events(_) | BatchItem::Skipped) => {
            return Err(DecodeError::FieldType {
                field: "data_parallel_rank",
            });
        }
    };
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Field access over both layouts: a map by key, or a legacy array by position.
enum Fields<'e, 'a> {
    Map(&'e mut [(Key<'a>, Slot<'a>)]),
    Array(&'e mut [Slot<'a>]),
}

/// A field's value as the reader left it: an rmpv value, a string borrowed from the payload,
/// an array left in it, or a collection of no type a scalar field takes.
#[derive(Clone, Copy)]
enum FieldRef<'f> {
    Value(&'f Value),
    Str(&'f str),
    List(RawList<'f>),
    Skipped,
}

impl<'f> FieldRef<'f> {
    fn as_str(self) -> Option<&'f str> {
        match self {
            FieldRef::Value(v) => v.as_str(),
            FieldRef::Str(s) => Some(s),
            FieldRef::List(_) | FieldRef::Skipped => None,
        }
    }

    fn as_u64(self) -> Option<u64> {
        match self {
            FieldRef::Value(v) => v.as_u64(),
            _ => None,
        }
    }

    fn as_i64(self) -> Option<i64> {
        match self {
            FieldRef::Value(v) => v.as_i64(),
            _ => None,
        }
    }
}

impl<'a> Fields<'_, 'a> {
    /// The field named `key` (map: its first pair) or at `position` (array, after the tag).
    fn slot(&mut self, key: &str, position: usize) -> Option<&mut Slot<'a>> {
        match self {
            Fields::Map(pairs) => pairs
                .iter_mut()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            Fields::Array(items) => items.get_mut(position + 1),
        }
    }

    /// The field's value; nil counts as missing.
    ///
    /// NOTE: the reader types only `token_ids` and `block_hashes`, which are taken with
    /// [`Self::take`]; a typed field asked for as a value is a type error of `field`.
    fn get(
        &mut self,
        key: &str,
        position: usize,
        field: &'static str,
    ) -> Result<Option<FieldRef<'_>>, DecodeError> {
        match self.slot(key, position) {
            None | Some(Slot::Taken | Slot::Value(Value::Nil)) => Ok(None),
            Some(Slot::Value(v)) => Ok(Some(FieldRef::Value(v))),
            Some(Slot::Str(s)) => Ok(Some(FieldRef::Str(s))),
            Some(Slot::Extra(list)) => Ok(Some(FieldRef::List(*list))),
            Some(Slot::Skipped) => Ok(Some(FieldRef::Skipped)),
            Some(Slot::Tokens(_) | Slot::Hashes(_) | Slot::Invalid(_)) => {
                Err(DecodeError::FieldType { field })
            }
        }
    }

    /// The field, taken out; nil counts as missing.
    fn take(&mut self, key: &str, position: usize) -> Option<Slot<'a>> {
        let slot = self.slot(key, position)?;
        match std::mem::replace(slot, Slot::Taken) {
            Slot::Value(Value::Nil) | Slot::Taken => None,
            taken => Some(taken),
        }
    }
}

/// An event's tag: borrowed from the payload as the reader leaves it, copied from a value.
fn tag<'a>(slot: Option<&Slot<'a>>) -> Option<Cow<'a, str>> {
    match slot? {
        Slot::Str(s) => Some(Cow::Borrowed(*s)),
        Slot::Value(v) => v.as_str().map(|s| Cow::Owned(s.to_string())),
        _ => None,
    }
}

/// Decodes one event, whose fields are in `pairs` (a map) or `fields` (an array); it takes
/// the long ones out of them.
fn decode_event<'a>(
    event: &RawEvent,
    pairs: &mut [(Key<'a>, Slot<'a>)],
    fields: &mut [Slot<'a>],
) -> Result<KvEvent, DecodeError> {
    let (tag, mut fields) = match event {
        RawEvent::Map(range) => {
            let pairs = pairs.get_mut(range.clone()).ok_or(DecodeError::EventTag)?;
            let found = pairs.iter().find(|(k, _)| k.as_str() == Some("type"));
            let tag = tag(found.map(|(_, v)| v)).ok_or(DecodeError::EventTag)?;
            (tag, Fields::Map(pairs))
        }
        RawEvent::Array(range) => {
            let items = fields.get_mut(range.clone()).ok_or(DecodeError::EventTag)?;
            let tag = tag(items.first()).ok_or(DecodeError::EventTag)?;
            (tag, Fields::Array(items))
        }
        RawEvent::Other => return Err(DecodeError::EventTag),
    };
    match tag.as_ref() {
        "BlockStored" => decode_stored(&mut fields).map(KvEvent::BlockStored),
        "BlockRemoved" => decode_removed(&mut fields).map(KvEvent::BlockRemoved),
        "AllBlocksCleared" => {
            let medium = opt_str(fields.get("medium", 0, "medium")?, "medium")?;
            Ok(KvEvent::AllBlocksCleared {
                tier: medium.map(|m| Tier::from_medium(Some(m))),
            })
        }
        other => Ok(KvEvent::Unknown(other.chars().take(64).collect())),
    }
}

fn decode_stored(fields: &mut Fields<'_, '_>) -> Result<BlockStored, DecodeError> {
    let block_hashes = block_hashes(fields)?;
    let parent_block_hash = fields
        .get("parent_block_hash", 1, "parent_block_hash")?
        .map(|field| match field {
            FieldRef::Value(v) => hash(v),
            _ => Err(DecodeError::Hash),
        })
        .transpose()?;
    let token_ids = match fields.take("token_ids", 2) {
        None => Vec::new(),
        Some(Slot::Tokens(ids)) => ids,
        Some(Slot::Invalid(error)) => return Err(error),
        Some(Slot::Value(Value::Array(items))) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or(DecodeError::TokenId)
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(DecodeError::FieldType { field: "token_ids" }),
    };
    let block_size = match fields.get("block_size", 3, "block_size")? {
        None => None,
        Some(field) => Some(field.as_u64().and_then(|b| u32::try_from(b).ok()).ok_or(
            DecodeError::FieldType {
                field: "block_size",
            },
        )?),
    };
    let lora_id = opt_i64(fields.get("lora_id", 4, "lora_id")?, "lora_id")?;
    let tier = Tier::from_medium(opt_str(fields.get("medium", 5, "medium")?, "medium")?);
    let lora_name =
        opt_str(fields.get("lora_name", 6, "lora_name")?, "lora_name")?.map(str::to_string);
    let extra = extra_keys(
        fields.get("extra_keys", 7, "extra_keys")?,
        block_hashes.len(),
        lora_name.as_deref(),
    )?;
    let group_idx = opt_i64(fields.get("group_idx", 8, "group_idx")?, "group_idx")?;
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        tier,
        lora_name,
        extra,
        group_idx,
    })
}

fn decode_removed(fields: &mut Fields<'_, '_>) -> Result<BlockRemoved, DecodeError> {
    let block_hashes = block_hashes(fields)?;
    let tier = Tier::from_medium(opt_str(fields.get("medium", 1, "medium")?, "medium")?);
    let group_idx = opt_i64(fields.get("group_idx", 2, "group_idx")?, "group_idx")?;
    Ok(BlockRemoved {
        block_hashes,
        tier,
        group_idx,
    })
}

/// Most msgpack values one block's extra keys may hold. vLLM's hold a LoRA name, the hashes
/// of the multimodal items the block overlaps and a salt; the bound keeps a hostile entry from
/// growing ~30× as it is read into values.
const EXTRA_VALUES_PER_BLOCK: usize = 1024;

/// A store's `extra_keys`: at most one entry per block (as vLLM publishes them), each of at
/// most [`EXTRA_VALUES_PER_BLOCK`] values, read one entry at a time. Empty when no block has
/// any (the common case: one nil per block), so a store costs nothing for them.
fn extra_keys(
    field: Option<FieldRef<'_>>,
    blocks: usize,
    lora_name: Option<&str>,
) -> Result<Vec<BlockExtra>, DecodeError> {
    const WRONG: DecodeError = DecodeError::FieldType {
        field: "extra_keys",
    };
    enum Entries<'f> {
        Values(std::slice::Iter<'f, Value>),
        Raw(RawList<'f>),
    }
    let (len, mut entries) = match field {
        None => return Ok(Vec::new()),
        Some(FieldRef::Value(Value::Array(items))) => (items.len(), Entries::Values(items.iter())),
        Some(FieldRef::List(list)) => (list.len, Entries::Raw(list)),
        Some(_) => return Err(WRONG),
    };
    if len > blocks {
        return Err(WRONG);
    }
    let mut extra = Vec::new();
    for i in 0..len {
        let entry = match &mut entries {
            Entries::Values(items) => {
                let value = items.next().ok_or(WRONG)?;
                if value_count(value) > EXTRA_VALUES_PER_BLOCK {
                    return Err(WRONG);
                }
                block_extra(i, value, lora_name)?
            }
            Entries::Raw(list) => {
                let value = list
                    .next_within(EXTRA_VALUES_PER_BLOCK)
                    .map_err(|e| DecodeError::Msgpack(e.to_string()))?
                    .ok_or(WRONG)?;
                block_extra(i, &value, lora_name)?
            }
        };
        if extra.is_empty() && entry == BlockExtra::default() {
            continue;
        }
        if extra.is_empty() {
            extra.reserve_exact(len);
            extra.resize(i, BlockExtra::default());
        }
        extra.push(entry);
    }
    Ok(extra)
}

/// How many msgpack values `value` holds: itself, its elements, a map's keys and fields (as
/// [`crate::skip::skip`] counts them).
pub(crate) fn value_count(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(value_count).sum::<usize>(),
        Value::Map(pairs) => {
            1 + pairs
                .iter()
                .map(|(k, v)| value_count(k) + value_count(v))
                .sum::<usize>()
        }
        _ => 1,
    }
}

/// One block's extra keys: vLLM orders them LoRA name, multimodal hashes, cache salt (block 0
/// only). The LoRA name is already a seed of the key, the salt is taken as the last string of
/// block 0, and anything else is digested into `opaque`.
pub(crate) fn block_extra(
    index: usize,
    value: &Value,
    lora_name: Option<&str>,
) -> Result<BlockExtra, DecodeError> {
    let items: &[Value] = match value {
        Value::Nil => return Ok(BlockExtra::default()),
        Value::Array(items) => items,
        _ => {
            return Err(DecodeError::FieldType {
                field: "extra_keys",
            });
        }
    };
    let mut rest: Vec<&Value> = items
        .iter()
        .filter(|v| lora_name.is_none() || v.as_str() != lora_name)
        .collect();
    let mut cache_salt = None;
    if index == 0
        && let Some(last) = rest.last().and_then(|v| v.as_str())
    {
        cache_salt = Some(last.to_string());
        rest.pop();
    }
    let opaque = if rest.is_empty() {
        None
    } else {
        let mut bytes = Vec::new();
        for item in rest {
            // NOTE: writing into a Vec cannot fail; an error would only shorten the digest.
            let _ = rmpv::encode::write_value(&mut bytes, item);
        }
        Some(xxhash_rust::xxh3::xxh3_64(&bytes))
    };
    Ok(BlockExtra { cache_salt, opaque })
}

/// A store's or removal's `block_hashes` (the first field of both layouts): required.
fn block_hashes(fields: &mut Fields<'_, '_>) -> Result<Vec<EngineHash>, DecodeError> {
    hash_list(
        fields
            .take("block_hashes", 0)
            .ok_or(DecodeError::MissingField("block_hashes"))?,
    )
}

fn hash_list(slot: Slot<'_>) -> Result<Vec<EngineHash>, DecodeError> {
    match slot {
        Slot::Hashes(hashes) => Ok(hashes),
        Slot::Invalid(error) => Err(error),
        Slot::Value(Value::Array(items)) => items.iter().map(hash).collect(),
        _ => Err(DecodeError::FieldType {
            field: "block_hashes",
        }),
    }
}

/// A block hash: u64, i64 (reinterpreted), or bytes (see [`hash_of_bytes`]).
fn hash(value: &Value) -> Result<EngineHash, DecodeError> {
    match value {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .map(EngineHash)
            .ok_or(DecodeError::Hash),
        Value::Binary(bytes) if !bytes.is_empty() => Ok(hash_of_bytes(bytes)),
        _ => Err(DecodeError::Hash),
    }
}

/// A hash published as bytes: the last 8, big-endian; shorter ones are left-padded with zeros.
pub(crate) fn hash_of_bytes(bytes: &[u8]) -> EngineHash {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    let mut be = [0u8; 8];
    be[8 - tail.len()..].copy_from_slice(tail);
    EngineHash(u64::from_be_bytes(be))
}

fn as_f64(value: &Value) -> Option<f64> {
    match value {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn as_i64(value: &Value) -> Option<i64> {
    value.as_i64()
}

fn opt_i64(value: Option<FieldRef<'_>>, field: &'static str) -> Result<Option<i64>, DecodeError> {
    value
        .map(|v| v.as_i64().ok_or(DecodeError::FieldType { field }))
        .transpose()
}

fn opt_str<'f>(
    value: Option<FieldRef<'f>>,
    field: &'static str,
) -> Result<Option<&'f str>, DecodeError> {
    value
        .map(|v| v.as_str().ok_or(DecodeError::FieldType { field }))
        .transpose()
}
