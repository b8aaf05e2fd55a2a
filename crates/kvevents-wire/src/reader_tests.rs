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

/// A batch's only event, its fields taken out of the shared lists.
#[derive(Debug)]
enum OneEvent<'a> {
    Map(Vec<(Key<'a>, Slot<'a>)>),
    Array(Vec<Slot<'a>>),
}

fn only_event(batch: RawBatch<'static>) -> OneEvent<'static> {
    let RawBatch::Array(mut items) = batch else {
        panic!("not an array")
    };
    let Some(BatchItem::Events(events)) = items.drain(..).nth(1) else {
        panic!("no events")
    };
    match &events.list[..] {
        [RawEvent::Map(range)] => {
            assert_eq!(*range, 0..events.pairs.len());
            OneEvent::Map(events.pairs)
        }
        [RawEvent::Array(range)] => {
            assert_eq!(*range, 0..events.fields.len());
            OneEvent::Array(events.fields)
        }
        other => panic!("{other:?}"),
    }
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
    let OneEvent::Map(pairs) = only_event(read(&map)) else {
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
    let OneEvent::Array(fields) = only_event(read(&legacy)) else {
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
    let OneEvent::Array(fields) = only_event(read(&removed)) else {
        panic!("not an array")
    };
    assert_eq!(fields[1], Slot::Hashes(vec![EngineHash(3)]));
    // An array where `group_idx` takes an integer: checked, not kept.
    assert_eq!(fields[3], Slot::Skipped);
}

#[test]
fn keys_and_string_fields_are_borrowed_and_an_invalid_one_is_rmpvs() {
    let event = batch_of(Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), Value::Array(vec![Value::from(3u64)])),
        ("medium".into(), "CPU".into()),
        (Value::from(7), Value::Nil),
    ]));
    let OneEvent::Map(pairs) = only_event(read(&event)) else {
        panic!("not a map")
    };
    assert_eq!(pairs[0], (Key::Str("type"), Slot::Str("BlockRemoved")));
    assert_eq!(pairs[2], (Key::Str("medium"), Slot::Str("CPU")));
    // A key the decoder never reads is not kept.
    assert_eq!(pairs.len(), 3);
    // A string that is not UTF-8: rmpv's value (which is no `str`), as the reference has it.
    let mut payload = vec![0x92, 0x01, 0x91, 0x92, 0xa2, 0xff, 0xfe, 0xc0];
    let mut rest: &[u8] = &payload;
    let RawBatch::Array(items) = RawBatch::read(&mut rest).unwrap() else {
        panic!("not an array")
    };
    let BatchItem::Events(events) = &items[1] else {
        panic!("no events")
    };
    let [RawEvent::Array(_)] = &events.list[..] else {
        panic!("not an array")
    };
    let fields = &events.fields;
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

/// A removal event's map with `fields` (key, raw msgpack value) after its tag and hashes,
/// in a batch; decoded by the reader and the reference, which must agree.
fn removal_with(fields: &[(&str, &[u8])]) -> Result<crate::EventBatch, crate::DecodeError> {
    let mut payload = vec![0x92, 0x01, 0x91, 0x80 | (2 + fields.len() as u8)];
    for (key, value) in [
        ("type", encode(&Value::from("BlockRemoved"))),
        ("block_hashes", vec![0x91, 0x07]),
    ] {
        payload.extend(encode(&Value::from(key)));
        payload.extend(value);
    }
    for (key, value) in fields {
        payload.extend(encode(&Value::from(*key)));
        payload.extend_from_slice(value);
    }
    let fast = crate::decode_payload(&payload);
    assert_eq!(
        fast,
        crate::decode_payload_reference(&payload),
        "{fields:?}"
    );
    fast
}

#[test]
fn events_of_both_layouts_in_one_batch_keep_their_own_fields() {
    let map = |h: u64| {
        Value::Map(vec![
            ("type".into(), "BlockRemoved".into()),
            ("block_hashes".into(), Value::Array(vec![Value::from(h)])),
            (
                "medium".into(),
                if h.is_multiple_of(2) { "GPU" } else { "CPU" }.into(),
            ),
        ])
    };
    let array = |h: u64| {
        Value::Array(vec![
            "BlockRemoved".into(),
            Value::Array(vec![Value::from(h), Value::from(h + 100)]),
            "CPU".into(),
        ])
    };
    let events = vec![map(1), array(2), map(4), Value::Nil, array(5), map(7)];
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(events)]);
    let RawBatch::Array(items) = read(&batch) else {
        panic!("not an array")
    };
    let BatchItem::Events(events) = &items[1] else {
        panic!("no events")
    };
    assert_eq!(
        events.list,
        vec![
            RawEvent::Map(0..3),
            RawEvent::Array(0..3),
            RawEvent::Map(3..6),
            // Decoding stops at the event that is neither: the rest are checked, not kept.
            RawEvent::Other,
        ]
    );
    assert_eq!((events.pairs.len(), events.fields.len()), (6, 3));
    // Without the event that is neither, the decoding in order.
    let mut values = match batch {
        Value::Array(mut items) => match items.remove(1) {
            Value::Array(events) => events,
            _ => unreachable!(),
        },
        _ => unreachable!(),
    };
    values.remove(3);
    let payload = encode(&Value::Array(vec![Value::F64(1.0), Value::Array(values)]));
    let decoded = crate::decode_payload(&payload).unwrap();
    let removed: Vec<(Vec<u64>, crate::Tier)> = decoded
        .events
        .iter()
        .map(|event| match event {
            crate::KvEvent::BlockRemoved(r) => {
                (r.block_hashes.iter().map(|h| h.0).collect(), r.tier)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    let (gpu, cpu) = (
        crate::Tier::from_medium(Some("GPU")),
        crate::Tier::from_medium(Some("CPU")),
    );
    assert_eq!(
        removed,
        vec![
            (vec![1], cpu),
            (vec![2, 102], cpu),
            (vec![4], gpu),
            (vec![5, 105], cpu),
            (vec![7], cpu),
        ]
    );
    assert_eq!(Ok(decoded), crate::decode_payload_reference(&payload));
}

#[test]
fn small_fields_read_without_rmpv_are_what_rmpv_reads() {
    let removed = |batch: crate::EventBatch| match &batch.events[..] {
        [crate::KvEvent::BlockRemoved(removed)] => removed.clone(),
        other => panic!("{other:?}"),
    };
    // Every integer marker, minimal or not, and signed markers holding positive values.
    for (value, expected) in [
        (&[0x05][..], 5),
        (&[0xff], -1),
        (&[0xcc, 0x80], 128),
        (&[0xcd, 0x01, 0x00], 256),
        (&[0xce, 0, 1, 0, 0], 65_536),
        (&[0xcf, 0, 0, 0, 0, 0, 0, 0, 9], 9),
        (&[0xd0, 0x05], 5),
        (&[0xd0, 0x80], -128),
        (&[0xd1, 0xff, 0xfe], -2),
        (&[0xd2, 0x00, 0x00, 0x01, 0x00], 256),
        (&[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfd], -3),
    ] {
        let batch = removal_with(&[("group_idx", value)]).unwrap();
        assert_eq!(removed(batch).group_idx, Some(expected), "{value:?}");
    }
    // Above i64: not a group index, as rmpv's value says.
    let big = [0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0];
    assert!(removal_with(&[("group_idx", &big)]).is_err());
    // Nil is a missing field; booleans and unknown keys' integers are kept or ignored alike.
    let batch = removal_with(&[("group_idx", &[0xc0]), ("flag", &[0xc3]), ("n", &[0xc2])]);
    assert_eq!(removed(batch.unwrap()).group_idx, None);
    assert!(removal_with(&[("group_idx", &[0xc3])]).is_err());
    // Cut short inside the integer, or a marker that is no scalar (a float, a map).
    for value in [
        &[0xcd, 0x01][..],
        &[0xd3, 0xff],
        &[0xca, 0, 0, 0, 0],
        &[0x80],
    ] {
        let _ = removal_with(&[("group_idx", value)]);
    }
}

#[test]
fn token_ids_in_any_integer_marker_are_read_as_rmpv_reads_them() {
    // Fixint, u8, u16, u32, u64 and signed markers with positive ids, then one past u32
    // (the whole array goes back to rmpv) and one cut short.
    let ids: [&[u8]; 7] = [
        &[0x07],
        &[0xcc, 0xff],
        &[0xcd, 0x40, 0x00],
        &[0xce, 0x00, 0x02, 0x4f, 0x1b],
        &[0xcf, 0, 0, 0, 0, 0, 0, 0x01, 0x00],
        &[0xd0, 0x11],
        &[0xd2, 0x00, 0x01, 0x00, 0x00],
    ];
    let store = |ids: &[&[u8]]| {
        let mut payload = vec![0x92, 0x01, 0x91, 0x83];
        payload.extend(encode(&Value::from("type")));
        payload.extend(encode(&Value::from("BlockStored")));
        payload.extend(encode(&Value::from("block_hashes")));
        payload.push(0x91);
        payload.push(0x07);
        payload.extend(encode(&Value::from("token_ids")));
        payload.push(0x90 | ids.len() as u8);
        for id in ids {
            payload.extend_from_slice(id);
        }
        let fast = crate::decode_payload(&payload);
        assert_eq!(fast, crate::decode_payload_reference(&payload));
        fast
    };
    let Ok(batch) = store(&ids) else {
        panic!("not decoded")
    };
    let crate::KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not a store")
    };
    assert_eq!(
        stored.token_ids,
        vec![7, 255, 16_384, 151_323, 256, 17, 65_536]
    );
    let past_u32: [&[u8]; 2] = [&[0x01], &[0xcf, 0, 0, 0, 0x01, 0, 0, 0, 0]];
    assert_eq!(store(&past_u32), Err(crate::DecodeError::TokenId));
    let cut: [&[u8]; 2] = [&[0x01], &[0xce, 0x00, 0x02]];
    assert!(store(&cut).is_err());
}

#[test]
fn an_element_the_field_does_not_take_is_the_fields_error_without_reading_the_rest() {
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
        let OneEvent::Map(pairs) = only_event(read(&event)) else {
            panic!("not a map")
        };
        assert_eq!(pairs[2].1, Slot::Invalid(crate::DecodeError::TokenId));
    }
    let hashes = Value::Array(vec![Value::from(1u64), Value::Binary(Vec::new())]);
    let event = batch_of(Value::Array(vec!["BlockRemoved".into(), hashes.clone()]));
    let OneEvent::Array(fields) = only_event(read(&event)) else {
        panic!("not an array")
    };
    assert_eq!(fields[1], Slot::Invalid(crate::DecodeError::Hash));
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
    assert_eq!(reader.bounded::<u32>(u32::MAX as usize), 4);
    // And never more than a megabyte up front, however long the payload.
    let long = vec![0u8; 4 << 20];
    let reader = Reader { rest: &long };
    assert_eq!(reader.bounded::<u32>(u32::MAX as usize), RESERVE_BYTES / 4);
    assert_eq!(reader.bounded::<(Key, Slot)>(10), 10);
}

/// A payload whose events array holds `event` `count` times, built as bytes (a 32-bit length).
fn repeated_event(event: &[u8], count: u32) -> Vec<u8> {
    let mut payload = vec![0x92, 0x01, 0xdd];
    payload.extend(count.to_be_bytes());
    for _ in 0..count {
        payload.extend_from_slice(event);
    }
    payload
}

#[test]
fn what_the_decoder_never_reads_is_checked_not_kept() {
    let removal = |extra: Vec<(Value, Value)>| {
        let mut pairs = vec![
            ("type".into(), "BlockRemoved".into()),
            ("block_hashes".into(), Value::Array(vec![Value::from(9u64)])),
        ];
        pairs.extend(extra);
        batch_of(Value::Map(pairs))
    };
    // Unknown keys, a key that is no string, a known key repeated (the decoder reads its
    // first pair): only the known keys' first pairs are kept, and the decoding is the
    // reference's (`read` checks it).
    let nested = Value::Array((0..50).map(|_| Value::Map(vec![])).collect());
    let event = removal(vec![
        ("future".into(), nested.clone()),
        (nested.clone(), Value::Nil),
        ("medium".into(), "CPU".into()),
        ("medium".into(), nested.clone()),
        ("type".into(), "BlockStored".into()),
    ]);
    let OneEvent::Map(pairs) = only_event(read(&event)) else {
        panic!("not a map")
    };
    let keys: Vec<_> = pairs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, [Some("type"), Some("block_hashes"), Some("medium")]);
    // A collection where a scalar field is read: the field's type error, as the reference.
    for (key, error) in [
        ("medium", crate::DecodeError::FieldType { field: "medium" }),
        (
            "group_idx",
            crate::DecodeError::FieldType { field: "group_idx" },
        ),
    ] {
        let event = removal(vec![(key.into(), Value::Map(vec![(1.into(), 2.into())]))]);
        let payload = encode(&event);
        assert_eq!(crate::decode_payload(&payload), Err(error));
        let OneEvent::Map(pairs) = only_event(read(&event)) else {
            panic!("not a map")
        };
        assert_eq!(pairs[2].1, Slot::Skipped);
    }
    // A legacy event's fields past the ten the decoder reads, and batch items past dp_rank.
    let mut legacy = vec!["BlockRemoved".into(), Value::Array(vec![Value::from(1u64)])];
    legacy.extend((0..20).map(|_| nested.clone()));
    let OneEvent::Array(fields) = only_event(read(&batch_of(Value::Array(legacy)))) else {
        panic!("not an array")
    };
    assert_eq!(fields.len(), LEGACY_FIELDS);
    let long_batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![]),
        Value::from(2),
        nested.clone(),
        nested,
    ]);
    let RawBatch::Array(items) = read(&long_batch) else {
        panic!("not an array")
    };
    assert_eq!(items.len(), 3);
    // A timestamp or rank that is a collection: their type errors.
    for (index, field) in [(0, "ts"), (1, "events"), (2, "data_parallel_rank")] {
        let mut items = vec![Value::F64(1.0), Value::Array(vec![]), Value::Nil];
        items[index] = Value::Map(vec![]);
        let batch = Value::Array(items);
        assert_eq!(
            crate::decode_payload(&encode(&batch)),
            Err(crate::DecodeError::FieldType { field })
        );
        read(&batch);
    }
}

#[test]
fn a_hostile_shape_keeps_no_more_than_its_decoded_batch() {
    // An event map of a million one-byte pairs: rmpv kept 80 bytes a pair.
    let mut event = vec![0xdf, 0x00, 0x10, 0x00, 0x00];
    event.extend(encode(&"type".into()));
    event.extend(encode(&"BlockRemoved".into()));
    event.extend(encode(&"block_hashes".into()));
    event.extend([0x91, 0x05]);
    event.resize(event.len() + 2 * ((1 << 20) - 2), 0x01);
    let payload = repeated_event(&event, 1);
    let mut rest = &payload[..];
    let RawBatch::Array(items) = RawBatch::read(&mut rest).unwrap() else {
        panic!("not an array")
    };
    let BatchItem::Events(events) = &items[1] else {
        panic!("no events")
    };
    assert!(
        events.pairs.capacity() <= FIELD_KEYS.len(),
        "{}",
        events.pairs.capacity()
    );
    let decoded = crate::decode_payload(&payload).unwrap();
    assert_eq!(decoded.events.len(), 1);

    // A million events that are nil: decoding stops at the first, nothing after it is kept.
    let payload = repeated_event(&[0xc0], 1 << 20);
    let mut rest = &payload[..];
    let RawBatch::Array(items) = RawBatch::read(&mut rest).unwrap() else {
        panic!("not an array")
    };
    let BatchItem::Events(events) = &items[1] else {
        panic!("no events")
    };
    assert_eq!(events.list, [RawEvent::Other]);
    assert_eq!(
        crate::decode_payload(&payload),
        Err(crate::DecodeError::EventTag)
    );
    // … but the rest is still checked: cut short, it is rmpv's error.
    let cut = &payload[..payload.len() - 1];
    assert!(matches!(
        crate::decode_payload(cut),
        Err(crate::DecodeError::Msgpack(_))
    ));
}

/// A store of `blocks` blocks with `extra` as its `extra_keys`.
fn store_with_extra(blocks: u64, extra: Value) -> Value {
    batch_of(Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array((0..blocks).map(Value::from).collect()),
        ),
        ("extra_keys".into(), extra),
        ("lora_name".into(), "adapter".into()),
    ]))
}

fn stored_extra(batch: &Value) -> Result<Vec<crate::BlockExtra>, crate::DecodeError> {
    read(batch);
    match crate::decode_payload(&encode(batch))?.events.remove(0) {
        crate::KvEvent::BlockStored(stored) => Ok(stored.extra),
        other => panic!("{other:?}"),
    }
}

#[test]
fn extra_keys_are_read_entry_by_entry_one_per_block_at_most() {
    let salted = Value::Array(vec![
        Value::Array(vec!["adapter".into(), "salt".into()]),
        Value::Nil,
        Value::Array(vec!["mm-hash".into()]),
    ]);
    let batch = store_with_extra(3, salted);
    let OneEvent::Map(pairs) = only_event(read(&batch)) else {
        panic!("not a map")
    };
    assert!(matches!(pairs[2].1, Slot::Extra(RawList { len: 3, .. })));
    let extra = stored_extra(&batch).unwrap();
    assert_eq!(extra.len(), 3);
    assert_eq!(extra[0].cache_salt.as_deref(), Some("salt"));
    assert_eq!(extra[1], crate::BlockExtra::default());
    assert!(extra[2].opaque.is_some());
    // One nil per block (what vLLM publishes without extras): nothing kept.
    let nils = Value::Array(vec![Value::Nil; 4]);
    assert_eq!(stored_extra(&store_with_extra(4, nils)), Ok(Vec::new()));
    // A salt only on a later block: the defaults before it are filled in.
    let late = Value::Array(vec![Value::Nil, Value::Array(vec!["mm".into()])]);
    let extra = stored_extra(&store_with_extra(2, late)).unwrap();
    assert_eq!(extra.len(), 2);
    assert_eq!(extra[0], crate::BlockExtra::default());
    // More entries than blocks, or an entry of more values than a block's keys hold: the
    // field's type error (in the reference too: `stored_extra` reads through `read`).
    let wrong = Err(crate::DecodeError::FieldType {
        field: "extra_keys",
    });
    let long = Value::Array(vec![Value::Nil; 3]);
    assert_eq!(stored_extra(&store_with_extra(2, long)), wrong);
    let wide = Value::Array(vec![Value::Array(vec![Value::Nil; 1024])]);
    assert_eq!(stored_extra(&store_with_extra(1, wide)), wrong);
    let within = Value::Array(vec![Value::Array(vec![Value::Nil; 1023])]);
    assert!(stored_extra(&store_with_extra(1, within)).is_ok());
    // Not an array: its type error; an entry that is neither nil nor an array: likewise.
    let map = Value::Map(vec![]);
    assert_eq!(stored_extra(&store_with_extra(1, map)), wrong);
    let scalar_entry = Value::Array(vec![Value::from(3)]);
    assert_eq!(stored_extra(&store_with_extra(1, scalar_entry)), wrong);
}

#[test]
fn every_field_key_is_found_at_its_index() {
    for (index, key) in FIELD_KEYS.iter().enumerate() {
        assert_eq!(field_key(key), Some(index));
    }
    assert_eq!(field_key("kv_cache_spec_kind"), None);
}
