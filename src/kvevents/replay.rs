//! Fetching missed batches from a pod's replay ROUTER (DESIGN §3 replay protocol).
//!
//! A DEALER sends `[b"", start_seq(8B BE)]`; the ROUTER answers `[b"", topic, seq, payload]`
//! for each buffered batch with seq ≥ start, then the end marker `[b"", b"", 0xFF×8, b""]`.
//! The whole exchange is bounded by a timeout and by `max_batches`, so a dead or hostile
//! replay endpoint costs at most that.

use std::time::Duration;

use bytes::Bytes;

use super::decode::decode_seq;
use super::transport::{Connection, Role, TransportConfig, TransportError};

/// Most batches kept from one replay exchange.
pub const MAX_REPLAY_BATCHES: u64 = 50_000;

/// Most payload bytes kept from one replay exchange (a hostile replay endpoint must not fill
/// memory with 50,000 large batches).
pub const MAX_REPLAY_BYTES: usize = 256 * 1024 * 1024;

/// The end marker's seq frame.
pub const END_MARKER_SEQ: u64 = u64::MAX;

/// Why a replay did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Connecting, sending or receiving failed.
    #[error("replay socket error: {0}")]
    Socket(#[from] TransportError),
    /// No end marker within the timeout.
    #[error("replay timed out")]
    Timeout,
    /// A reply did not have the 4 expected frames.
    #[error("malformed replay reply with {0} frames")]
    Malformed(usize),
    /// The replies exceeded [`MAX_REPLAY_BYTES`].
    #[error("replay replies exceed {MAX_REPLAY_BYTES} bytes")]
    TooLarge,
}

/// One replayed batch (payload still encoded: it is byte-identical to the live one).
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayedBatch {
    /// The topic frame.
    pub topic: Bytes,
    /// Its seq.
    pub seq: u64,
    /// The msgpack payload.
    pub payload: Bytes,
}

/// Asks `endpoint` for every buffered batch with seq in `from..until`; returns them in the
/// order received (replies at or past `until` are discarded).
pub async fn fetch_replay(
    endpoint: &str,
    from: u64,
    until: u64,
    timeout: Duration,
) -> Result<Vec<ReplayedBatch>, ReplayError> {
    tokio::time::timeout(timeout, fetch_inner(endpoint, from, until, timeout))
        .await
        .map_err(|_| ReplayError::Timeout)?
}

async fn fetch_inner(
    endpoint: &str,
    from: u64,
    until: u64,
    timeout: Duration,
) -> Result<Vec<ReplayedBatch>, ReplayError> {
    let config = TransportConfig {
        connect_timeout: timeout,
        ..TransportConfig::default()
    };
    let mut connection = Connection::connect(endpoint, Role::Dealer, config).await?;
    connection.send(&[b"", &from.to_be_bytes()]).await?;
    // NOTE: bounded by vLLM's replay buffer size (buffer_steps, default 10,000) with room to
    // spare; a larger gap is not coverable anyway and ends in a clear.
    let wanted = until.saturating_sub(from).min(MAX_REPLAY_BATCHES);
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let (frames, _budget) = connection.recv().await?;
        let [_, topic, seq, payload] = <[Bytes; 4]>::try_from(frames)
            .map_err(|frames: Vec<Bytes>| ReplayError::Malformed(frames.len()))?;
        let seq = decode_seq(&seq).map_err(|_| ReplayError::Malformed(4))?;
        if seq == END_MARKER_SEQ && topic.is_empty() {
            break;
        }
        if seq >= from && seq < until {
            bytes = bytes.saturating_add(topic.len() + payload.len());
            if bytes > MAX_REPLAY_BYTES {
                return Err(ReplayError::TooLarge);
            }
            out.push(ReplayedBatch {
                topic,
                seq,
                payload,
            });
            if out.len() as u64 >= wanted {
                break;
            }
        }
    }
    Ok(out)
}
