//! vLLM's prefix-cache block hashes, reproduced byte for byte.
//!
//! Why: the simulator is the ground truth other components are tested against, so the hashes it
//! publishes must equal what a real vLLM 0.32 engine publishes for the same tokens. vLLM hashes
//! the Python tuple `(parent_digest, tuple(block_token_ids), extra_keys)` either through
//! `pickle.dumps(.., protocol=5)` (`sha256`, the default) or through `cbor2.dumps(..,
//! canonical=True)` (`sha256_cbor`). Both serialisations are mirrored here for exactly the Python
//! types involved (bytes, tuples, ints, str, None), verified against the captures in
//! `../shared/fixtures/` (`tests/sim_conformance.rs`).
//!
//! Pure functions, no shared state.

use sha2::{Digest, Sha256};

/// A full 32-byte block digest; chaining uses all of it.
pub type BlockDigest = [u8; 32];

/// The hash function vLLM was started with (`--prefix-caching-hash-algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashAlgo {
    /// `sha256(pickle.dumps(x, protocol=5))`, vLLM's default.
    #[default]
    Sha256,
    /// `sha256(cbor2.dumps(x, canonical=True))`.
    Sha256Cbor,
}

impl std::str::FromStr for HashAlgo {
    type Err = UnknownHashAlgo;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256" => Ok(Self::Sha256),
            "sha256_cbor" => Ok(Self::Sha256Cbor),
            other => Err(UnknownHashAlgo(other.to_owned())),
        }
    }
}

/// Error for an unsupported `--prefix-caching-hash-algo` value.
#[derive(Debug, thiserror::Error)]
#[error("unknown prefix caching hash algorithm {0:?} (expected sha256 or sha256_cbor)")]
pub struct UnknownHashAlgo(pub String);

/// One entry of a block's `extra_keys` tuple, as vLLM tags it: `("cache_salt", salt)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraKey {
    /// The tag, e.g. `cache_salt` or `lora_name`.
    pub tag: String,
    /// The value (the salt, the adapter name).
    pub value: String,
}

impl ExtraKey {
    /// `("cache_salt", salt)`.
    pub fn cache_salt(salt: &str) -> Self {
        Self {
            tag: "cache_salt".to_owned(),
            value: salt.to_owned(),
        }
    }

    /// `("lora_name", name)`.
    // NOTE: the LoRA tag is an assumption by analogy with cache_salt; no LoRA capture exists.
    pub fn lora_name(name: &str) -> Self {
        Self {
            tag: "lora_name".to_owned(),
            value: name.to_owned(),
        }
    }
}

/// `H("vllm-none-hash")`: the parent of block 0 when PYTHONHASHSEED is unset.
pub fn none_hash(algo: HashAlgo) -> BlockDigest {
    let bytes = match algo {
        HashAlgo::Sha256 => {
            let mut body = Vec::with_capacity(24);
            pickle_str(&mut body, "vllm-none-hash");
            pickle_frame(body)
        }
        HashAlgo::Sha256Cbor => {
            let mut out = Vec::with_capacity(16);
            cbor_text(&mut out, "vllm-none-hash");
            out
        }
    };
    Sha256::digest(&bytes).into()
}

/// `H((parent, tuple(tokens), extra))`, where `extra` is `None` when empty.
pub fn hash_block(
    algo: HashAlgo,
    parent: &BlockDigest,
    tokens: &[u32],
    extra: &[ExtraKey],
) -> BlockDigest {
    let bytes = match algo {
        HashAlgo::Sha256 => pickle_block(parent, tokens, extra),
        HashAlgo::Sha256Cbor => cbor_block(parent, tokens, extra),
    };
    Sha256::digest(&bytes).into()
}

/// The 64-bit hash vLLM publishes in events: the digest's last 8 bytes, big-endian.
pub fn low64(digest: &BlockDigest) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(tail)
}

/// Hashes every full block of `tokens`, chained from [`none_hash`]; `salt` enters block 0 and
/// `lora` (if any) every block.
pub fn chain_hashes(
    algo: HashAlgo,
    tokens: &[u32],
    block_size: usize,
    salt: Option<&str>,
    lora: Option<&str>,
) -> Vec<BlockDigest> {
    let mut parent = none_hash(algo);
    let mut out = Vec::new();
    if block_size == 0 {
        return out;
    }
    for (index, block) in tokens.chunks_exact(block_size).enumerate() {
        let extra = block_extra_keys(index, salt, lora);
        parent = hash_block(algo, &parent, block, &extra);
        out.push(parent);
    }
    out
}

/// The extra keys of block `index`: the LoRA name on every block, then the salt on block 0.
pub fn block_extra_keys(index: usize, salt: Option<&str>, lora: Option<&str>) -> Vec<ExtraKey> {
    let mut extra = Vec::new();
    if let Some(name) = lora {
        extra.push(ExtraKey::lora_name(name));
    }
    if let (0, Some(salt)) = (index, salt.filter(|s| !s.is_empty())) {
        extra.push(ExtraKey::cache_salt(salt));
    }
    extra
}

// ---- pickle protocol 5 (CPython's C pickler output for these types) ----

const PICKLE_MEMOIZE: u8 = 0x94;

fn pickle_block(parent: &BlockDigest, tokens: &[u32], extra: &[ExtraKey]) -> Vec<u8> {
    let mut body = Vec::with_capacity(48 + tokens.len() * 5);
    // parent: SHORT_BINBYTES
    body.push(b'C');
    body.push(32);
    body.extend_from_slice(parent);
    body.push(PICKLE_MEMOIZE);
    pickle_int_tuple(&mut body, tokens);
    if extra.is_empty() {
        body.push(b'N');
    } else {
        let mut pairs = Vec::with_capacity(extra.len());
        for key in extra {
            let mut pair = Vec::new();
            pickle_str(&mut pair, &key.tag);
            pickle_str(&mut pair, &key.value);
            pickle_tuple_close(&mut pair, 2, false);
            pairs.push(pair);
        }
        pickle_tuple_of(&mut body, pairs);
    }
    pickle_tuple_close(&mut body, 3, false);
    pickle_frame(body)
}

/// Wraps an opcode body as `PROTO 5, FRAME len, body, STOP`.
// NOTE: CPython commits a frame every 64 KiB and writes large bytes/str outside frames; the
// inputs hashed here (32-token blocks, short salts) stay far below that.
fn pickle_frame(mut body: Vec<u8>) -> Vec<u8> {
    body.push(b'.');
    let mut out = Vec::with_capacity(body.len() + 11);
    out.extend_from_slice(&[0x80, 5, 0x95]);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

fn pickle_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    if let Ok(len) = u8::try_from(bytes.len()) {
        out.push(0x8c); // SHORT_BINUNICODE
        out.push(len);
    } else {
        out.push(b'X'); // BINUNICODE
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(bytes);
    out.push(PICKLE_MEMOIZE);
}

fn pickle_int(out: &mut Vec<u8>, value: u32) {
    if let Ok(v) = u8::try_from(value) {
        out.extend_from_slice(&[b'K', v]);
    } else if let Ok(v) = u16::try_from(value) {
        out.push(b'M');
        out.extend_from_slice(&v.to_le_bytes());
    } else if let Ok(v) = i32::try_from(value) {
        out.push(b'J');
        out.extend_from_slice(&v.to_le_bytes());
    } else {
        // LONG1 with the minimal two's-complement little-endian bytes of a positive value.
        let mut bytes = u64::from(value).to_le_bytes().to_vec();
        while bytes.len() > 1 && bytes[bytes.len() - 1] == 0 && bytes[bytes.len() - 2] & 0x80 == 0 {
            bytes.pop();
        }
        out.extend_from_slice(&[0x8a, bytes.len() as u8]);
        out.extend_from_slice(&bytes);
    }
}

fn pickle_int_tuple(out: &mut Vec<u8>, tokens: &[u32]) {
    let elements = tokens
        .iter()
        .map(|&t| {
            let mut v = Vec::with_capacity(5);
            pickle_int(&mut v, t);
            v
        })
        .collect();
    pickle_tuple_of(out, elements);
}

/// Writes a tuple whose elements are already pickled.
fn pickle_tuple_of(out: &mut Vec<u8>, elements: Vec<Vec<u8>>) {
    let len = elements.len();
    let with_mark = !(1..=3).contains(&len);
    if with_mark && len > 0 {
        out.push(b'(');
    }
    for element in elements {
        out.extend_from_slice(&element);
    }
    pickle_tuple_close(out, len, with_mark);
}

fn pickle_tuple_close(out: &mut Vec<u8>, len: usize, with_mark: bool) {
    match (len, with_mark) {
        (0, _) => {
            // EMPTY_TUPLE is a singleton and never memoized.
            out.push(b')');
            return;
        }
        (1, false) => out.push(0x85),
        (2, false) => out.push(0x86),
        (3, false) => out.push(0x87),
        _ => out.push(b't'),
    }
    out.push(PICKLE_MEMOIZE);
}

// ---- canonical CBOR (cbor2, canonical=True) ----

fn cbor_head(out: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    if value < 24 {
        out.push(m | value as u8);
    } else if let Ok(v) = u8::try_from(value) {
        out.extend_from_slice(&[m | 24, v]);
    } else if let Ok(v) = u16::try_from(value) {
        out.push(m | 25);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(value) {
        out.push(m | 26);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

fn cbor_text(out: &mut Vec<u8>, s: &str) {
    cbor_head(out, 3, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn cbor_block(parent: &BlockDigest, tokens: &[u32], extra: &[ExtraKey]) -> Vec<u8> {
    let mut out = Vec::with_capacity(40 + tokens.len() * 5);
    cbor_head(&mut out, 4, 3);
    cbor_head(&mut out, 2, 32);
    out.extend_from_slice(parent);
    cbor_head(&mut out, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut out, 0, u64::from(t));
    }
    if extra.is_empty() {
        out.push(0xf6);
    } else {
        cbor_head(&mut out, 4, extra.len() as u64);
        for key in extra {
            cbor_head(&mut out, 4, 2);
            cbor_text(&mut out, &key.tag);
            cbor_text(&mut out, &key.value);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &BlockDigest) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn none_hashes_match_the_fixture_readme() {
        let sha = hex(&none_hash(HashAlgo::Sha256));
        assert!(
            sha.starts_with("066b1e89") && sha.ends_with("d71198"),
            "{sha}"
        );
        let cbor = hex(&none_hash(HashAlgo::Sha256Cbor));
        assert!(
            cbor.starts_with("9bd96a48") && cbor.ends_with("81eef0"),
            "{cbor}"
        );
    }

    #[test]
    fn pickle_of_a_long_tuple_uses_mark_and_tuple() {
        let mut out = Vec::new();
        pickle_int_tuple(&mut out, &[1, 300, 70000, 5]);
        assert_eq!(
            out,
            vec![
                b'(', b'K', 1, b'M', 0x2c, 0x01, b'J', 0x70, 0x11, 0x01, 0x00, b'K', 5, b't', 0x94
            ]
        );
    }
}
