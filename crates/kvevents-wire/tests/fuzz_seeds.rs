//! The fuzz target's seed corpus (fuzz/seeds/decode_payload/) must stay decodable: a seed that
//! fails to decode only exercises the error paths, and the fuzzer would start from nothing.

use std::path::Path;

use kvpick_kvevents_wire::{EngineHash, KvEvent, Tier, decode_payload, split_topic};

fn seeds_dir() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fuzz/seeds/decode_payload"
    ))
}

#[test]
fn every_msgpack_seed_decodes() {
    let mut decoded = 0;
    for entry in std::fs::read_dir(seeds_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("msgpack") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let batch = decode_payload(&bytes)
            .unwrap_or_else(|e| panic!("{} does not decode: {e}", path.display()));
        assert!(!batch.events.is_empty(), "{} has no events", path.display());
        decoded += 1;
    }
    assert!(decoded >= 8, "only {decoded} seeds");
}

#[test]
fn hand_made_legacy_seed_decodes_as_described() {
    let bytes = std::fs::read(seeds_dir().join("legacy-array-and-cleared.msgpack")).unwrap();
    let batch = decode_payload(&bytes).unwrap();
    assert_eq!(batch.ts, 1.5);
    assert_eq!(batch.dp_rank, None);
    let [
        KvEvent::BlockStored(stored),
        KvEvent::AllBlocksCleared { tier: None },
    ] = batch.events.as_slice()
    else {
        panic!("unexpected events {:?}", batch.events)
    };
    assert_eq!(
        stored.block_hashes,
        vec![EngineHash(1), EngineHash(u64::MAX)]
    );
    assert_eq!(stored.token_ids, vec![0, 1, 2, 3]);
    assert_eq!(stored.block_size, Some(2));
    assert_eq!(stored.tier, Tier::Cpu);
}

#[test]
fn topic_seed_splits() {
    let bytes = std::fs::read(seeds_dir().join("topic-tiny")).unwrap();
    let (addr, model) = split_topic(&bytes).unwrap();
    assert_eq!(addr.to_string(), "127.0.0.1:8101");
    assert_eq!(model, "tiny");
}
