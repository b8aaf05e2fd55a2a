//! vLLM's KV-cache event batches and their msgpack encoding (msgspec's exact bytes).
//!
//! Why: consumers (kvpick's `kvevents/`, llm-d, Dynamo, vllm-router) decode what vLLM 0.32
//! publishes; the simulator must publish the same bytes. vLLM encodes `EventBatch` with msgspec:
//! payload = `[ts: f64, events, data_parallel_rank]`; each event is a tagged struct encoded as a
//! map whose first key is `"type"` (or, in releases before ~0.24, an array `[tag, fields…]`),
//! fields in declaration order, `omit_defaults` dropping `session_id` when it is None. Integers
//! use the smallest *unsigned* msgpack format for non-negative values, so a 64-bit hash
//! is `0xcf` + 8 bytes exactly as in the captures; `ts` is always an f64 (`0xcb`).
//!
//! A decoder for the same layouts is included so tests can round-trip the real captures.
//! Pure data + functions, no shared state.

use rmpv::Value;

/// A block hash as published: a u64 (default) or the full digest bytes
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// Low 64 bits of the digest.
    Int(u64),
    /// The raw digest.
    Bytes(Vec<u8>),
}

/// Whether events are maps with a `"type"` key (vLLM ≥ ~0.24) or tagged arrays (older).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventLayout {
    /// `{"type": "BlockStored", "block_hashes": …}`.
    #[default]
    Map,
    /// `["BlockStored", block_hashes, …]`.
    Array,
}

/// `BlockStored`: one or more consecutive full blocks were filled.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// Hash of the block before the first one, `None` at block 0.
    pub parent_block_hash: Option<EngineHash>,
    /// All tokens of the stored blocks (`len = n_blocks × block_size`).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA adapter id, if any.
    pub lora_id: Option<i64>,
    /// Storage tier (`"GPU"`).
    pub medium: Option<String>,
    /// LoRA adapter name, if any.
    pub lora_name: Option<String>,
    /// Per-block untagged extra keys (`[["salt"], null, …]`); `None` is encoded as nil.
    pub extra_keys: Option<Vec<Option<Vec<String>>>>,
    /// KV-cache group index (0 for a single full-attention group).
    pub group_idx: Option<i64>,
    /// `"full_attention"` for the only spec kind the simulator models.
    pub kv_cache_spec_kind: Option<String>,
    /// Request `session_id`, omitted from the wire when `None`.
    pub session_id: Option<String>,
}

/// A KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were filled and entered the prefix cache.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved {
        /// Hashes of the evicted blocks (vLLM sends one per event).
        block_hashes: Vec<EngineHash>,
        /// Storage tier (`"GPU"`).
        medium: Option<String>,
        /// KV-cache group index.
        group_idx: Option<i64>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// One published message's payload.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock seconds since the epoch when the batch was taken.
    pub ts: f64,
    /// The events, in engine order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank (`0` on a single-rank engine).
    pub data_parallel_rank: Option<i64>,
}

/// Errors decoding a payload.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not valid msgpack.
    #[error("invalid msgpack: {0}")]
    Msgpack(#[from] rmpv::decode::Error),
    /// Valid msgpack with an unexpected shape.
    #[error("unexpected payload shape: {0}")]
    Shape(&'static str),
}

fn hash_value(h: &EngineHash) -> Value {
    match h {
        EngineHash::Int(v) => Value::from(*v),
        EngineHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn opt_str(v: &Option<String>) -> Value {
    v.as_deref().map_or(Value::Nil, Value::from)
}

fn opt_i64(v: Option<i64>) -> Value {
    v.map_or(Value::Nil, int_value)
}

/// Non-negative integers as unsigned (msgspec's choice), negatives as signed.
fn int_value(v: i64) -> Value {
    u64::try_from(v).map_or_else(|_| Value::from(v), Value::from)
}

impl KvEvent {
    fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved { .. } => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }

    /// The event's fields in declaration order, defaults already omitted.
    fn fields(&self) -> Vec<(&'static str, Value)> {
        match self {
            KvEvent::BlockStored(s) => {
                let mut f = vec![
                    (
                        "block_hashes",
                        Value::Array(s.block_hashes.iter().map(hash_value).collect()),
                    ),
                    (
                        "parent_block_hash",
                        s.parent_block_hash.as_ref().map_or(Value::Nil, hash_value),
                    ),
                    (
                        "token_ids",
                        Value::Array(s.token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    ("block_size", Value::from(s.block_size)),
                    ("lora_id", opt_i64(s.lora_id)),
                    ("medium", opt_str(&s.medium)),
                    ("lora_name", opt_str(&s.lora_name)),
                    (
                        "extra_keys",
                        s.extra_keys.as_ref().map_or(Value::Nil, |keys| {
                            Value::Array(
                                keys.iter()
                                    .map(|k| {
                                        k.as_ref().map_or(Value::Nil, |k| {
                                            Value::Array(
                                                k.iter().map(|s| Value::from(s.as_str())).collect(),
                                            )
                                        })
                                    })
                                    .collect(),
                            )
                        }),
                    ),
                    ("group_idx", opt_i64(s.group_idx)),
                    ("kv_cache_spec_kind", opt_str(&s.kv_cache_spec_kind)),
                ];
                if let Some(session) = &s.session_id {
                    f.push(("session_id", Value::from(session.as_str())));
                }
                f
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => vec![
                (
                    "block_hashes",
                    Value::Array(block_hashes.iter().map(hash_value).collect()),
                ),
                ("medium", opt_str(medium)),
                ("group_idx", opt_i64(*group_idx)),
            ],
            KvEvent::AllBlocksCleared => Vec::new(),
        }
    }

    fn to_value(&self, layout: EventLayout) -> Value {
        let fields = self.fields();
        match layout {
            EventLayout::Map => {
                let mut entries = Vec::with_capacity(fields.len() + 1);
                entries.push((Value::from("type"), Value::from(self.tag())));
                entries.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
                Value::Map(entries)
            }
            EventLayout::Array => {
                let mut items = Vec::with_capacity(fields.len() + 1);
                items.push(Value::from(self.tag()));
                items.extend(fields.into_iter().map(|(_, v)| v));
                Value::Array(items)
            }
        }
    }
}

impl EventBatch {
    /// Encodes the payload as msgspec would.
    pub fn encode(&self, layout: EventLayout) -> Vec<u8> {
        let value = Value::Array(vec![
            Value::F64(self.ts),
            Value::Array(self.events.iter().map(|e| e.to_value(layout)).collect()),
            opt_i64(self.data_parallel_rank),
        ]);
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut out, &value);
        out
    }

    /// Decodes a payload in either layout; unknown keys and trailing fields are ignored.
    pub fn decode(mut payload: &[u8]) -> Result<Self, DecodeError> {
        let value = rmpv::decode::read_value(&mut payload)?;
        let Value::Array(items) = value else {
            return Err(DecodeError::Shape("payload is not an array"));
        };
        let mut items = items.into_iter();
        let ts = match items.next() {
            Some(Value::F64(t)) => t,
            Some(Value::F32(t)) => f64::from(t),
            Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
            _ => return Err(DecodeError::Shape("ts is not a number")),
        };
        let Some(Value::Array(raw_events)) = items.next() else {
            return Err(DecodeError::Shape("events is not an array"));
        };
        let data_parallel_rank = items.next().and_then(|v| v.as_i64());
        let events = raw_events
            .into_iter()
            .map(decode_event)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            ts,
            events,
            data_parallel_rank,
        })
    }
}

const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "session_id",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn decode_event(value: Value) -> Result<KvEvent, DecodeError> {
    let (tag, fields): (String, Vec<(String, Value)>) = match value {
        Value::Map(entries) => {
            let mut tag = None;
            let mut fields = Vec::new();
            for (k, v) in entries {
                let Some(k) = k.as_str().map(str::to_owned) else {
                    continue;
                };
                if k == "type" {
                    tag = v.as_str().map(str::to_owned);
                } else {
                    fields.push((k, v));
                }
            }
            (tag.ok_or(DecodeError::Shape("event without type"))?, fields)
        }
        Value::Array(items) => {
            let mut items = items.into_iter();
            let tag = items
                .next()
                .and_then(|v| v.as_str().map(str::to_owned))
                .ok_or(DecodeError::Shape("array event without tag"))?;
            let names: &[&str] = match tag.as_str() {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            let fields = names.iter().map(|n| (*n).to_owned()).zip(items).collect();
            (tag, fields)
        }
        _ => return Err(DecodeError::Shape("event is neither map nor array")),
    };
    let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    let hashes = |name: &str| -> Vec<EngineHash> {
        get(name)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(decode_hash).collect())
            .unwrap_or_default()
    };
    let string = |name: &str| get(name).and_then(Value::as_str).map(str::to_owned);
    let int = |name: &str| get(name).and_then(Value::as_i64);
    match tag.as_str() {
        "BlockStored" => Ok(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes("block_hashes"),
            parent_block_hash: get("parent_block_hash").and_then(decode_hash),
            token_ids: get("token_ids")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect()
                })
                .unwrap_or_default(),
            block_size: int("block_size")
                .and_then(|b| u32::try_from(b).ok())
                .unwrap_or(0),
            lora_id: int("lora_id"),
            medium: string("medium"),
            lora_name: string("lora_name"),
            extra_keys: get("extra_keys").and_then(Value::as_array).map(|keys| {
                keys.iter()
                    .map(|k| {
                        k.as_array().map(|parts| {
                            parts
                                .iter()
                                .map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_owned))
                                .collect()
                        })
                    })
                    .collect()
            }),
            group_idx: int("group_idx"),
            kv_cache_spec_kind: string("kv_cache_spec_kind"),
            session_id: string("session_id"),
        })),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes("block_hashes"),
            medium: string("medium"),
            group_idx: int("group_idx"),
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        _ => Err(DecodeError::Shape("unknown event type")),
    }
}

fn decode_hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .map(EngineHash::Int),
        Value::Binary(b) => Some(EngineHash::Bytes(b.clone())),
        _ => None,
    }
}

/// The key names of an encoded event map, in wire order (tests compare field sets with this).
pub fn event_keys(payload: &[u8]) -> Result<Vec<Vec<String>>, DecodeError> {
    let mut slice = payload;
    let value = rmpv::decode::read_value(&mut slice)?;
    let events = value
        .as_array()
        .and_then(|a| a.get(1))
        .and_then(Value::as_array)
        .ok_or(DecodeError::Shape("no events array"))?;
    Ok(events
        .iter()
        .map(|e| {
            e.as_map()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, _)| k.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_layout_round_trips() {
        let batch = EventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockRemoved {
                    block_hashes: vec![EngineHash::Int(u64::MAX)],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        let bytes = batch.encode(EventLayout::Array);
        assert_eq!(EventBatch::decode(&bytes).ok(), Some(batch.clone()));
        // ["AllBlocksCleared"] is a one-element fixarray.
        assert!(bytes.windows(2).any(|w| w == [0x91, 0xb0]));
        assert_ne!(bytes, batch.encode(EventLayout::Map));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(EventBatch::decode(&[0xc1]).is_err());
        assert!(EventBatch::decode(&[0x93, 0xcb]).is_err());
        assert!(EventBatch::decode(&[0x90]).is_err());
    }
}
