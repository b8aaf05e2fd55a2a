//! Decoding of vLLM KV-event messages (DESIGN §3) into typed batches.
//!
//! This crate is kvpick's KV-event wire format and nothing else: the ZMQ frames (topic, seq,
//! payload), the msgpack batch and the event types it decodes into. It lives apart from kvpick
//! so that it can be fuzzed on its own (`fuzz/`) without building kvpick's servers, and it
//! depends only on rmpv, thiserror and xxhash-rust (serde behind the `serde` feature). kvpick
//! re-exports everything here as `kvpick::kvevents`.
//!
//! Why a hand-written decoder over [`rmpv::Value`]: vLLM has published two layouts (tagged maps
//! since ~0.24, legacy tagged arrays before), omits fields at their default, and adds fields in
//! new releases. A schema-bound deserializer would reject one of those; this one accepts both
//! layouts, ignores unknown keys and trailing fields, and treats a missing key as "none".
//! The payload is read in one pass (`reader`: the token ids and block hashes straight into
//! typed vectors, the rest as values), then interpreted (`batch`).
//!
//! Every input here comes from the network: nothing panics on a payload, sizes are bounded
//! ([`MAX_PAYLOAD_BYTES`], nesting depth) and every failure is a typed [`DecodeError`]. What
//! the decoder never reads is stepped over (`skip`), not kept, so a payload costs about what
//! its decoded batch holds, whatever its shape.

mod batch;
mod reader;
mod skip;
pub mod zmtp;

use reader::RawBatch;
use std::net::SocketAddr;

/// Largest payload accepted (vLLM batches are a few KB; a full-report batch can reach ~1 MB).
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024 * 1024;

/// Why a message or payload could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    /// The message did not have exactly the 3 frames topic, seq, payload.
    #[error("expected 3 frames (topic, seq, payload), got {0}")]
    FrameCount(usize),
    /// The seq frame was not 8 bytes.
    #[error("seq frame must be 8 bytes, got {0}")]
    SeqLength(usize),
    /// The payload is larger than [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// The payload is not valid msgpack (or too deeply nested).
    #[error("invalid msgpack: {0}")]
    Msgpack(String),
    /// The payload has bytes left after the batch.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    /// The batch is not an array `[ts, events, dp_rank?]`.
    #[error("batch must be an array [ts, events, dp_rank?]")]
    BatchShape,
    /// A field has the wrong msgpack type.
    #[error("field `{field}` has an unexpected type")]
    FieldType {
        /// The field's name.
        field: &'static str,
    },
    /// A required field is missing.
    #[error("field `{0}` is missing")]
    MissingField(&'static str),
    /// An event's tag is not a string.
    #[error("event without a string type tag")]
    EventTag,
    /// A block hash is neither an integer nor bytes.
    #[error("invalid block hash")]
    Hash,
    /// A token id does not fit in u32.
    #[error("token id out of range")]
    TokenId,
}

/// The engine's 64-bit block hash as published (never used as kvpick's own key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// Where a block lives on the pod (vLLM's `medium`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Tier {
    /// Accelerator memory (vLLM reports "GPU" even on CPU builds); the default.
    #[default]
    Gpu,
    /// Host-memory offload tier.
    Cpu,
    /// Anything slower (disk, remote stores).
    Other,
}

impl Tier {
    /// Every tier, in order of its index.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Other];

    /// A small index for per-tier tables.
    pub fn index(self) -> usize {
        match self {
            Tier::Gpu => 0,
            Tier::Cpu => 1,
            Tier::Other => 2,
        }
    }

    /// Maps vLLM's `medium` string (case-insensitive; missing = GPU).
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") || m.eq_ignore_ascii_case("cuda") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("cpu") => Tier::Cpu,
            Some(_) => Tier::Other,
        }
    }
}

/// Extra hash inputs of one block beyond its tokens (vLLM's `extra_keys[i]`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtra {
    /// The request's `cache_salt` (the last string of block 0's extra keys).
    pub cache_salt: Option<String>,
    /// A digest of any other extra keys (multimodal hashes, …) that a text request cannot
    /// reproduce; blocks carrying one never match a plain token prefix.
    pub opaque: Option<u64>,
}

/// `BlockStored`: consecutive full blocks that the pod now holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStored {
    /// One engine hash per block, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// The block before the first one; `None` when the chain starts at block 0.
    pub parent_block_hash: Option<EngineHash>,
    /// `block_size × block_hashes.len()` token ids (may be empty for offload tiers).
    pub token_ids: Vec<u32>,
    /// Tokens per block, when published.
    pub block_size: Option<u32>,
    /// The LoRA adapter's numeric id, when any.
    pub lora_id: Option<i64>,
    /// The tier the blocks were stored in.
    pub tier: Tier,
    /// The LoRA adapter's name, when any.
    pub lora_name: Option<String>,
    /// Per block extra keys, aligned with `block_hashes`; empty when not published or when no
    /// block has any (vLLM publishes one nil per block), so read it with `get(i)`.
    pub extra: Vec<BlockExtra>,
    /// KV-cache group (hybrid models), when published.
    pub group_idx: Option<i64>,
}

/// `BlockRemoved`: blocks the pod evicted from one tier.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockRemoved {
    /// The evicted blocks' engine hashes.
    pub block_hashes: Vec<EngineHash>,
    /// The tier they were evicted from.
    pub tier: Tier,
    /// KV-cache group, when published.
    pub group_idx: Option<i64>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// The pod dropped its whole prefix cache (optionally for one tier).
    AllBlocksCleared {
        /// The tier cleared, when the event names one.
        tier: Option<Tier>,
    },
    /// An event type this version does not know; skipped.
    Unknown(String),
}

/// One published batch (`EventBatch`).
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// Engine timestamp (seconds since the epoch).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank, when published.
    pub dp_rank: Option<i64>,
}

/// One raw ZMQ message, split into its parts.
#[derive(Clone, Debug, PartialEq)]
pub struct RawMessage<'a> {
    /// The topic frame.
    pub topic: &'a [u8],
    /// The sequence number.
    pub seq: u64,
    /// The msgpack payload.
    pub payload: &'a [u8],
}

/// Splits the 3 frames of a PUB message (topic, 8-byte BE seq, payload).
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<RawMessage<'a>, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount(frames.len()));
    };
    Ok(RawMessage {
        topic,
        seq: decode_seq(seq)?,
        payload,
    })
}

/// Decodes an 8-byte big-endian sequence number.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Splits a topic `kv@<ip:port>@<model>` defensively into the publishing pod's address and
/// the model: the prefix may be anything without `@`; the pod is the first `@`-separated part
/// after it that parses as a socket address (IPv6 in brackets); the model is everything after
/// that part (so it may contain `@`). `None` when no part is an address.
pub fn split_topic(topic: &[u8]) -> Option<(SocketAddr, &str)> {
    let text = std::str::from_utf8(topic).ok()?;
    let mut rest = text.split_once('@')?.1;
    loop {
        let (head, tail) = match rest.split_once('@') {
            Some((h, t)) => (h, Some(t)),
            None => (rest, None),
        };
        if let Ok(addr) = head.trim().parse::<SocketAddr>() {
            return Some((addr, tail.unwrap_or("")));
        }
        rest = tail?;
    }
}

/// Decodes one msgpack payload into an [`EventBatch`].
pub fn decode_payload(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut rest = payload;
    let batch = RawBatch::read(&mut rest).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    batch::decode_batch(batch)
}

/// [`decode_payload`] as it was before its reader: the whole payload read by rmpv into one
/// value first. The same result for every input, slower; kept to test and fuzz against.
#[doc(hidden)]
pub fn decode_payload_reference(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut rest = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rest, reader::MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    batch::decode_batch(RawBatch::from_value(value))
}

/// Whether two decodings are the same, the timestamps compared bit for bit: a payload's NaN
/// `ts` decodes to a batch that `==` finds unequal to itself. For comparing
/// [`decode_payload`] with [`decode_payload_reference`].
#[doc(hidden)]
pub fn decoded_alike(
    a: &Result<EventBatch, DecodeError>,
    b: &Result<EventBatch, DecodeError>,
) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => {
            a.ts.to_bits() == b.ts.to_bits() && a.events == b.events && a.dp_rank == b.dp_rank
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batch::block_extra;
    use rmpv::Value;

    /// A value's msgpack bytes (the crate's tests build payloads with it).
    pub(crate) fn encode(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, value).unwrap();
        out
    }

    #[test]
    fn legacy_array_layout_with_trailing_fields() {
        let event = Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![Value::from(-1i64), Value::Binary(vec![9; 32])]),
            Value::Nil,
            Value::Array((0..4u32).map(Value::from).collect()),
            Value::from(2u32),
            Value::Nil,
            "CPU".into(),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            "future-field".into(),
        ]);
        let payload = encode(&Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![event]),
        ]));
        let batch = decode_payload(&payload).unwrap();
        assert_eq!(batch.dp_rank, None);
        let KvEvent::BlockStored(stored) = &batch.events[0] else {
            panic!("not stored")
        };
        assert_eq!(
            stored.block_hashes,
            vec![EngineHash(u64::MAX), EngineHash(0x0909_0909_0909_0909)]
        );
        assert_eq!(stored.tier, Tier::Cpu);
        assert_eq!(stored.token_ids, vec![0, 1, 2, 3]);
    }

    #[test]
    fn salt_and_lora_extra_keys() {
        let extra = block_extra(
            0,
            &Value::Array(vec!["lora-a".into(), "tenant".into()]),
            Some("lora-a"),
        )
        .unwrap();
        assert_eq!(extra.cache_salt.as_deref(), Some("tenant"));
        assert_eq!(extra.opaque, None);
        let later = block_extra(3, &Value::Array(vec!["mm".into()]), None).unwrap();
        assert!(later.cache_salt.is_none() && later.opaque.is_some());
    }

    #[test]
    fn topics_split_defensively() {
        let (addr, model) = split_topic(b"kv@127.0.0.1:8101@tiny").unwrap();
        assert_eq!(addr.to_string(), "127.0.0.1:8101");
        assert_eq!(model, "tiny");
        let (addr, model) = split_topic(b"kv@[::1]:80@org@model@v2").unwrap();
        assert_eq!(addr.to_string(), "[::1]:80");
        assert_eq!(model, "org@model@v2");
        let (addr, model) = split_topic(b"kv@junk@10.0.0.1:9@m").unwrap();
        assert_eq!(addr.to_string(), "10.0.0.1:9");
        assert_eq!(model, "m");
        assert_eq!(split_topic(b"kv@10.0.0.1:9").map(|(_, m)| m), Some(""));
        assert!(split_topic(b"kv@no-address@m").is_none());
        assert!(split_topic(b"\xff\xfe").is_none());
        assert!(split_topic(b"").is_none());
    }

    #[test]
    fn hostile_payloads_are_errors() {
        assert!(decode_payload(&[]).is_err());
        assert!(decode_payload(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert_eq!(
            decode_payload(&encode(&Value::from(3))),
            Err(DecodeError::BatchShape)
        );
        let bad_token = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                ("block_hashes".into(), Value::Array(vec![Value::from(1)])),
                ("token_ids".into(), Value::Array(vec![Value::from(-5)])),
            ])]),
        ]);
        assert_eq!(
            decode_payload(&encode(&bad_token)),
            Err(DecodeError::TokenId)
        );
        assert_eq!(split_frames(&[b"a", b"b"]), Err(DecodeError::FrameCount(2)));
        assert_eq!(decode_seq(b"123"), Err(DecodeError::SeqLength(3)));
    }
}
