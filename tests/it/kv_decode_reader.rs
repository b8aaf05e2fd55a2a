//! The payload reader (token ids and block hashes read straight into typed vectors) against
//! the reference decoder (the whole payload read by rmpv first): the same result, errors and
//! their messages included, for every real capture, every truncation and mutation of them,
//! and generated batches of every shape the decoder tolerates or refuses.

use crate::hostile_bytes::cuts_and_mutations;
use crate::support::paths;

use kvpick::kvevents::decode::{decode_payload, decode_payload_reference, decoded_alike};
use proptest::prelude::*;
use rmpv::Value;

fn assert_same(payload: &[u8]) -> bool {
    let fast = decode_payload(payload);
    let reference = decode_payload_reference(payload);
    assert!(
        decoded_alike(&fast, &reference),
        "{fast:?} != {reference:?} for payload {payload:02x?}"
    );
    fast.is_ok()
}

#[test]
fn a_nan_timestamp_decodes_alike() {
    // [NaN, [["BlockRemoved", [7]]]]: `==` finds such a batch unequal to itself.
    let mut payload = vec![0x92, 0xcb];
    payload.extend(f64::NAN.to_be_bytes());
    payload.extend([0x91, 0x92, 0xac]);
    payload.extend(b"BlockRemoved");
    payload.extend([0x91, 0x07]);
    assert!(assert_same(&payload));
    let mut other = payload.clone();
    let hash = other.len() - 1;
    other[hash] = 0x08; // another block hash
    assert!(!decoded_alike(
        &decode_payload(&payload),
        &decode_payload(&other)
    ));
}

fn captures() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for dir in [
        "vllm-0.32-kv-events",
        "vllm-0.32-kv-events-bytehash",
        "vllm-0.32-kv-events-sha256cbor",
    ] {
        let dir = paths::fixtures().join(dir);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().and_then(|e| e.to_str()) == Some("msgpack"))
            .collect();
        files.sort();
        out.extend(files.iter().map(|path| std::fs::read(path).unwrap()));
    }
    out
}

#[test]
fn every_capture_its_truncations_and_mutations_decode_as_the_reference_does() {
    let captures = captures();
    assert!(captures.len() >= 30, "only {} captures", captures.len());
    let (mut decoded, mut rejected) = (0, 0);
    let mut rng = fastrand::Rng::with_seed(31);
    for (i, payload) in captures.iter().enumerate() {
        assert!(assert_same(payload), "capture {i} does not decode");
        // Every cut of the first few, a spread of cuts of the rest (some are ~100 KB).
        let step = if i < 4 { 1 } else { payload.len() / 200 };
        let (ok, refused) = cuts_and_mutations(payload, step, 200, &mut rng, assert_same);
        decoded += ok;
        rejected += refused;
    }
    assert!(
        decoded > 0 && rejected > 0,
        "{decoded} decoded, {rejected} rejected"
    );
}

/// msgpack bytes for an integer in a chosen marker (rmpv's encoder always picks the
/// smallest): what a typed read must take as rmpv does, e.g. a token id sent as int8.
fn integer_as(value: i128, marker: u8) -> Option<Vec<u8>> {
    let mut out = vec![marker];
    match marker {
        0xcc => out.extend(u8::try_from(value).ok()?.to_be_bytes()),
        0xcd => out.extend(u16::try_from(value).ok()?.to_be_bytes()),
        0xce => out.extend(u32::try_from(value).ok()?.to_be_bytes()),
        0xcf => out.extend(u64::try_from(value).ok()?.to_be_bytes()),
        0xd0 => out.extend(i8::try_from(value).ok()?.to_be_bytes()),
        0xd1 => out.extend(i16::try_from(value).ok()?.to_be_bytes()),
        0xd2 => out.extend(i32::try_from(value).ok()?.to_be_bytes()),
        0xd3 => out.extend(i64::try_from(value).ok()?.to_be_bytes()),
        _ => return None,
    }
    Some(out)
}

fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

/// An element of a token-id or hash array: mostly what the typed read takes, sometimes what
/// sends it back to rmpv.
fn element() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => (0u64..200_000).prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        1 => proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::Binary),
        1 => Just(Value::Nil),
        1 => Just(Value::F64(1.5)),
        1 => Just(Value::from("7")),
    ]
}

fn field_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<i64>().prop_map(Value::from),
        (0u32..64).prop_map(Value::from),
        Just(Value::from("GPU")),
        Just(Value::from("cpu")),
        Just(Value::F32(0.5)),
        proptest::collection::vec(any::<u8>(), 0..10).prop_map(Value::Binary),
    ];
    prop_oneof![
        3 => proptest::collection::vec(element(), 0..40).prop_map(Value::Array),
        3 => leaf.clone(),
        1 => proptest::collection::vec(leaf, 0..4)
            .prop_map(|items| Value::Array(vec![Value::Array(items)])),
    ]
}

const KEYS: [&str; 11] = [
    "type",
    "block_hashes",
    "token_ids",
    "parent_block_hash",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "future",
];
const TAGS: [&str; 4] = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"];

fn event() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![
        6 => Just(Value::from(TAGS[0])),
        3 => proptest::sample::select(&TAGS[..]).prop_map(Value::from),
        1 => Just(Value::from(3)),
    ];
    // Mostly with hashes and tokens that decode, so that what follows them is reached.
    let hashes = proptest::option::weighted(
        0.8,
        proptest::collection::vec(any::<u64>().prop_map(Value::from), 0..8).prop_map(Value::Array),
    );
    // Integers only, mostly (the typed read's own cases), else any element (its way back).
    let integer = prop_oneof![
        8 => (0u64..200_000).prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => (-70_000i64..0).prop_map(Value::from),
    ];
    let tokens = proptest::option::weighted(
        0.8,
        prop_oneof![
            3 => proptest::collection::vec(integer, 0..40),
            1 => proptest::collection::vec(element(), 0..40),
        ]
        .prop_map(Value::Array),
    );
    let map = (
        tag.clone(),
        hashes,
        tokens,
        proptest::collection::vec((proptest::sample::select(&KEYS[..]), field_value()), 0..6),
    )
        .prop_map(|(tag, hashes, tokens, fields)| {
            let mut pairs = vec![(Value::from("type"), tag)];
            pairs.extend(hashes.map(|h| (Value::from("block_hashes"), h)));
            pairs.extend(tokens.map(|t| (Value::from("token_ids"), t)));
            pairs.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
            Value::Map(pairs)
        });
    let array = (tag, proptest::collection::vec(field_value(), 0..11)).prop_map(|(tag, fields)| {
        let mut items = vec![tag];
        items.extend(fields);
        Value::Array(items)
    });
    prop_oneof![6 => map, 3 => array, 1 => field_value()]
}

fn batch() -> impl Strategy<Value = Value> {
    let events = prop_oneof![
        9 => proptest::collection::vec(event(), 1..4).prop_map(Value::Array),
        1 => field_value(),
    ];
    (
        prop_oneof![9 => Just(Value::F64(1.0)), 1 => field_value()],
        events,
        proptest::collection::vec(field_value(), 0..3),
    )
        .prop_map(|(ts, events, rest)| {
            let mut items = vec![ts, events];
            items.extend(rest);
            Value::Array(items)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn generated_batches_decode_as_the_reference_does(
        batch in batch(),
        cut in any::<prop::sample::Index>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    ) {
        let payload = encode(&batch);
        assert_same(&payload);
        assert_same(&payload[..cut.index(payload.len() + 1)]);
        let mut mutated = payload.clone();
        for (at, byte) in flips {
            let at = at.index(mutated.len());
            mutated[at] = byte;
        }
        assert_same(&mutated);
    }

    #[test]
    fn token_ids_and_hashes_in_any_integer_marker_decode_as_the_reference_does(
        values in proptest::collection::vec(
            (prop_oneof![
                -300i128..300,
                (u32::MAX as i128 - 300)..=(u32::MAX as i128 + 300),
                (i64::MIN as i128)..=(u64::MAX as i128),
            ], proptest::sample::select(
                &[0xccu8, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3][..])),
            1..20),
        legacy in any::<bool>(),
    ) {
        // An array of integers each in its marker, where it fits (e.g. a token id as int8).
        let mut array = vec![0xdc, 0, 0];
        let mut count = 0u16;
        for (value, marker) in values {
            if let Some(bytes) = integer_as(value, marker) {
                array.extend(bytes);
                count += 1;
            }
        }
        array[1..3].copy_from_slice(&count.to_be_bytes());
        // The same array as a store's block hashes and as its token ids (the hashes then
        // count the tokens' blocks: one block of `count` tokens each).
        let mut event = Vec::new();
        if legacy {
            event.push(0x94); // ["BlockStored", hashes, parent, tokens]
            event.extend(encode(&Value::from("BlockStored")));
            event.extend(&array);
            event.push(0xc0);
            event.extend(&array);
        } else {
            event.push(0x83);
            event.extend(encode(&Value::from("type")));
            event.extend(encode(&Value::from("BlockStored")));
            event.extend(encode(&Value::from("block_hashes")));
            event.extend(&array);
            event.extend(encode(&Value::from("token_ids")));
            event.extend(&array);
        }
        let mut payload = vec![0x92, 0xcb];
        payload.extend(1.0f64.to_be_bytes());
        payload.push(0x91);
        payload.extend(event);
        assert_same(&payload);
    }
}
