//! Fuzz the KV-event wire decoder: no input may panic, hang or allocate without bound, in the
//! payload decoder, the frame splitter or the topic parser (all three read network bytes); and
//! the payload decoder must agree with its reference (`decode_payload_reference`).
//!
//! The index that consumes decoded batches is covered by tests/kv_index_proptest.rs (a
//! differential property test); it is left out here so this target builds without kvpick.
//!
//! Seed corpus: fuzz/seeds/decode_payload/ (real vLLM 0.32 payloads, see its README).
#![no_main]

use kvpick_kvevents_wire::{
    KvEvent, decode_payload, decode_payload_reference, decoded_alike, split_frames, split_topic,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((_, model)) = split_topic(data) {
        // The model is a suffix of the topic, never invented.
        assert!(model.len() < data.len());
    }
    let frames: Vec<&[u8]> = data.splitn(3, |b| *b == 0).collect();
    if let Ok(message) = split_frames(&frames) {
        assert_eq!(frames.len(), 3);
        assert_eq!(message.payload.len(), frames[2].len());
    }
    // The one-pass reader decodes exactly as the whole payload read by rmpv first does,
    // errors included.
    let decoded = decode_payload(data);
    let reference = decode_payload_reference(data);
    assert!(
        decoded_alike(&decoded, &reference),
        "{decoded:?} != {reference:?}"
    );
    let Ok(batch) = decoded else {
        return;
    };
    for event in &batch.events {
        match event {
            KvEvent::BlockStored(stored) => {
                // Every decoded item came from at least one input byte.
                assert!(stored.block_hashes.len() + stored.token_ids.len() <= data.len());
            }
            KvEvent::BlockRemoved(removed) => assert!(removed.block_hashes.len() <= data.len()),
            KvEvent::Unknown(tag) => assert!(tag.chars().count() <= 64),
            KvEvent::AllBlocksCleared { .. } => {}
        }
    }
});
