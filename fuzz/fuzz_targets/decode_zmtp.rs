//! Fuzz the ZMTP codec kvpick reads every KV-event connection with: no input may panic, and
//! no declared length may make a message exceed its limits (the decoder must refuse it before
//! its bytes are buffered).
//!
//! The input is fed in chunks whose sizes come from its first byte, so frame boundaries fall
//! anywhere relative to reads, as they do on a socket.
#![no_main]

use bytes::BytesMut;
use kvpick_kvevents_wire::zmtp::{Decoder, GREETING_LEN, Inbound, Limits, parse_greeting};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_message_bytes: 4096,
    max_frames: 4,
};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, data)) = data.split_first() else {
        return;
    };
    if let Some(greeting) = data.first_chunk::<GREETING_LEN>() {
        let _ = parse_greeting(greeting);
    }
    let chunk = usize::from(chunk).max(1);
    let mut decoder = Decoder::new(LIMITS);
    let mut buf = BytesMut::new();
    for piece in data.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(Inbound::Message(frames))) => {
                    assert!(frames.len() <= LIMITS.max_frames);
                    let bytes: usize = frames.iter().map(|f| f.len()).sum();
                    assert!(bytes <= LIMITS.max_message_bytes);
                }
                Ok(Some(Inbound::Command(_))) => {}
                Ok(None) => {
                    assert!(decoder.partial_message_bytes() <= LIMITS.max_message_bytes);
                    break;
                }
                Err(_) => return,
            }
        }
    }
});
