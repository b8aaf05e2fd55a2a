//! ZMTP 3.x framing, sans I/O and bounded before allocation (the transport under vLLM's KV
//! events: PUB/SUB for the live stream, ROUTER/DEALER for replay).
//!
//! Why our own codec: the pure-Rust `zeromq` crate reserves whatever frame length a peer
//! declares (one header declaring 2^50 bytes aborts the process on allocation failure) and
//! buffers a multipart message whose MORE frames never end without bound. libzmq's
//! `ZMQ_MAXMSGSIZE` bounds one frame, not a multipart message, and the `zmq` crate is
//! blocking and builds C++. Every peer here is hostile until parsed, so this decoder checks
//! each declared length against the message's remaining allowance ([`Limits`]) *before* its
//! body is buffered, caps the frames per message, caps command sizes, and never reserves more
//! than the caller reads: memory grows only with bytes that actually arrived, up to the limit.
//!
//! What is implemented (ZMTP 3.0/3.1, NULL mechanism only, which is what vLLM uses):
//! the 64-byte greeting, the READY handshake with its `Socket-Type` property, message frames
//! (short and long, MORE), commands (READY, ERROR, PING → the caller answers PONG, others
//! ignored), and the 3.0 subscription message (`0x01` + prefix) that libzmq and the `zeromq`
//! crate both accept from a SUB.

use bytes::{Buf, Bytes, BytesMut};

/// Length of a ZMTP 3 greeting.
pub const GREETING_LEN: usize = 64;

/// Largest command body accepted (READY carries a few short properties; PING ≤ 18 bytes).
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;

/// Per-connection bounds on what a peer may make us buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of frame bodies in one (multipart) message.
    pub max_message_bytes: usize,
    /// Most frames in one message.
    pub max_frames: usize,
}

impl Default for Limits {
    /// 16 MiB and 16 frames: a vLLM batch is a few KB to ~1 MB and has 3 frames (4 in
    /// replay replies).
    fn default() -> Self {
        Self {
            max_message_bytes: 16 * 1024 * 1024,
            max_frames: 16,
        }
    }
}

/// Why a peer's bytes were rejected. The connection must be dropped after any of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZmtpError {
    /// The greeting does not start with ZMTP's signature.
    #[error("not a ZMTP peer (bad greeting signature)")]
    Signature,
    /// The peer speaks ZMTP 1.0/2.0 (no 3.x handshake).
    #[error("unsupported ZMTP version {0}.{1}")]
    Version(u8, u8),
    /// The peer asks for a security mechanism other than NULL.
    #[error("unsupported security mechanism {0:?}")]
    Mechanism(String),
    /// A frame declared more bytes than the message may still hold.
    #[error("frame of {declared} bytes exceeds the message limit of {limit} bytes")]
    MessageTooLarge {
        /// Bytes declared by this frame plus the frames before it in the message.
        declared: u64,
        /// The limit.
        limit: usize,
    },
    /// A message has more frames than allowed.
    #[error("message has more than {0} frames")]
    TooManyFrames(usize),
    /// A command frame is larger than [`MAX_COMMAND_BYTES`] or carries MORE.
    #[error("invalid command frame ({0})")]
    CommandFrame(&'static str),
    /// A command body could not be parsed.
    #[error("malformed {0} command")]
    MalformedCommand(&'static str),
    /// The peer sent ERROR.
    #[error("peer sent ERROR: {0}")]
    PeerError(String),
    /// The handshake did not go as ZMTP says (e.g. a message before READY).
    #[error("handshake: {0}")]
    Handshake(String),
    /// The peer's socket type cannot talk to ours.
    #[error("peer socket type {peer:?} is not compatible with {ours}")]
    SocketType {
        /// What the peer announced.
        peer: String,
        /// Our socket type.
        ours: &'static str,
    },
}

/// The parts of a peer's greeting we check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerGreeting {
    /// ZMTP major version (3).
    pub major: u8,
    /// ZMTP minor version (0 or 1).
    pub minor: u8,
}

/// Our greeting: ZMTP 3.0, NULL, not as-server. 3.0 (not 3.1) so that every 3.x peer sends and
/// accepts subscriptions as `0x01`-prefixed messages, which libzmq and the `zeromq` crate both
/// handle.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut out = [0u8; GREETING_LEN];
    out[0] = 0xFF;
    out[9] = 0x7F;
    out[10] = 3;
    out[11] = 0;
    out[12..16].copy_from_slice(b"NULL");
    out
}

/// Parses a peer's 64-byte greeting.
pub fn parse_greeting(bytes: &[u8; GREETING_LEN]) -> Result<PeerGreeting, ZmtpError> {
    // NOTE: libzmq puts a length (1) in the padding for ZMTP 1.0 compatibility and only checks
    // bit 0 of byte 9, so neither do we check more.
    if bytes[0] != 0xFF || bytes[9] & 1 != 1 {
        return Err(ZmtpError::Signature);
    }
    let (major, minor) = (bytes[10], bytes[11]);
    if major < 3 {
        return Err(ZmtpError::Version(major, minor));
    }
    let mechanism = &bytes[12..32];
    let end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..end] != b"NULL" {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(&mechanism[..end]).into_owned(),
        ));
    }
    Ok(PeerGreeting { major, minor })
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

fn frame_header(out: &mut Vec<u8>, flags: u8, len: usize) {
    if len > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(len as u8);
    }
}

/// Appends a command frame `name` + `body` to `out`.
pub fn encode_command(out: &mut Vec<u8>, name: &str, body: &[u8]) {
    debug_assert!(name.len() < 256);
    frame_header(out, FLAG_COMMAND, 1 + name.len() + body.len());
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(body);
}

/// Appends a READY command announcing `socket_type` (and no identity) to `out`.
pub fn encode_ready(out: &mut Vec<u8>, socket_type: &str) {
    let mut body = Vec::with_capacity(32);
    let name = b"Socket-Type";
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    encode_command(out, "READY", &body);
}

/// Appends a message of `frames` to `out` (MORE on all but the last).
pub fn encode_message(out: &mut Vec<u8>, frames: &[&[u8]]) {
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        frame_header(out, more, frame.len());
        out.extend_from_slice(frame);
    }
}

/// A command received from the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// READY with its `Socket-Type` property (upper-cased as sent).
    Ready {
        /// The peer's socket type.
        socket_type: String,
    },
    /// ERROR with its reason.
    Error(String),
    /// PING (ZMTP 3.1 heartbeat): answer PONG with this context.
    Ping {
        /// Context to echo in PONG.
        context: Bytes,
    },
    /// Any other command (SUBSCRIBE from a 3.1 SUB, PONG, …): nothing to do for a reader.
    Other(String),
}

/// What one [`Decoder::decode`] call produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inbound {
    /// A command.
    Command(Command),
    /// A whole message: its frames, in order.
    Message(Vec<Bytes>),
}

#[derive(Clone, Copy, Debug)]
enum State {
    /// Waiting for a frame's flags byte.
    Flags,
    /// Waiting for the length (1 or 8 bytes) of a frame with these flags.
    Length(u8),
    /// Waiting for `len` body bytes of a frame with these flags.
    Body(u8, usize),
}

/// Decodes frames after the greeting. Feed it a buffer that the caller fills from the socket;
/// it consumes what it decodes and leaves partial input in place.
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    state: State,
    frames: Vec<Bytes>,
    message_bytes: usize,
}

impl Decoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            state: State::Flags,
            frames: Vec::new(),
            message_bytes: 0,
        }
    }

    /// How many more bytes, beyond `buffered`, the decoder needs to make progress: read at
    /// most this many (or a chunk, whichever is smaller) so the buffer never grows past what
    /// the current frame may legally hold.
    pub fn wants(&self, buffered: usize) -> usize {
        let need = match self.state {
            State::Flags => 1,
            State::Length(flags) if flags & FLAG_LONG != 0 => 8,
            State::Length(_) => 1,
            State::Body(_, len) => len,
        };
        need.saturating_sub(buffered).max(1)
    }

    /// Bytes of the frames of the message in progress already split off the buffer.
    pub fn partial_message_bytes(&self) -> usize {
        self.message_bytes
    }

    /// Whether a message has started but not finished (for receive timeouts).
    pub fn mid_message(&self) -> bool {
        !self.frames.is_empty() || !matches!(self.state, State::Flags)
    }

    /// Decodes the next command or whole message from `buf`, or `None` if more bytes are
    /// needed. Errors are final for the connection.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Inbound>, ZmtpError> {
        loop {
            match self.state {
                State::Flags => {
                    let Some(&flags) = buf.first() else {
                        return Ok(None);
                    };
                    buf.advance(1);
                    if flags & FLAG_COMMAND != 0 {
                        if flags & FLAG_MORE != 0 {
                            return Err(ZmtpError::CommandFrame("MORE on a command"));
                        }
                        if !self.frames.is_empty() {
                            return Err(ZmtpError::CommandFrame("command inside a message"));
                        }
                    }
                    self.state = State::Length(flags);
                }
                State::Length(flags) => {
                    let len: u64 = if flags & FLAG_LONG != 0 {
                        if buf.len() < 8 {
                            return Ok(None);
                        }
                        buf.get_u64()
                    } else {
                        let Some(&len) = buf.first() else {
                            return Ok(None);
                        };
                        buf.advance(1);
                        u64::from(len)
                    };
                    let len = self.check_length(flags, len)?;
                    self.state = State::Body(flags, len);
                }
                State::Body(flags, len) => {
                    if buf.len() < len {
                        return Ok(None);
                    }
                    let body = buf.split_to(len).freeze();
                    self.state = State::Flags;
                    if flags & FLAG_COMMAND != 0 {
                        return parse_command(body).map(|c| Some(Inbound::Command(c)));
                    }
                    self.frames.push(body);
                    self.message_bytes += len;
                    if flags & FLAG_MORE == 0 {
                        self.message_bytes = 0;
                        return Ok(Some(Inbound::Message(std::mem::take(&mut self.frames))));
                    }
                }
            }
        }
    }

    /// Checks a declared frame length before anything of its body is buffered.
    fn check_length(&self, flags: u8, len: u64) -> Result<usize, ZmtpError> {
        if flags & FLAG_COMMAND != 0 {
            return usize::try_from(len)
                .ok()
                .filter(|&len| len <= MAX_COMMAND_BYTES)
                .ok_or(ZmtpError::CommandFrame("too large"));
        }
        if self.frames.len() >= self.limits.max_frames {
            return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
        }
        let allowance = self.limits.max_message_bytes - self.message_bytes;
        match usize::try_from(len) {
            Ok(len) if len <= allowance => Ok(len),
            _ => Err(ZmtpError::MessageTooLarge {
                declared: len.saturating_add(self.message_bytes as u64),
                limit: self.limits.max_message_bytes,
            }),
        }
    }
}

/// Splits a command frame body into its name and data.
fn parse_command(body: Bytes) -> Result<Command, ZmtpError> {
    let Some((&name_len, rest)) = body.split_first() else {
        return Err(ZmtpError::MalformedCommand("empty"));
    };
    let name_len = usize::from(name_len);
    if rest.len() < name_len {
        return Err(ZmtpError::MalformedCommand("truncated"));
    }
    let (name, data) = rest.split_at(name_len);
    match name {
        b"READY" => Ok(Command::Ready {
            socket_type: ready_socket_type(data)?,
        }),
        b"ERROR" => {
            let reason = match data.split_first() {
                Some((&len, reason)) => &reason[..usize::from(len).min(reason.len())],
                None => &[][..],
            };
            Ok(Command::Error(String::from_utf8_lossy(reason).into_owned()))
        }
        b"PING" => {
            // TTL (2 bytes) then up to 16 bytes of context.
            if data.len() < 2 {
                return Err(ZmtpError::MalformedCommand("PING"));
            }
            let context = &data[2..];
            let context = &context[..context.len().min(16)];
            Ok(Command::Ping {
                context: Bytes::copy_from_slice(context),
            })
        }
        other => Ok(Command::Other(String::from_utf8_lossy(other).into_owned())),
    }
}

/// The `Socket-Type` property of a READY body (`name-len name value-len(4 BE) value`…).
fn ready_socket_type(mut data: &[u8]) -> Result<String, ZmtpError> {
    let mut socket_type = None;
    while let Some((&name_len, rest)) = data.split_first() {
        let name_len = usize::from(name_len);
        if rest.len() < name_len + 4 {
            return Err(ZmtpError::MalformedCommand("READY"));
        }
        let (name, rest) = rest.split_at(name_len);
        let (value_len, rest) = rest.split_at(4);
        let value_len =
            u32::from_be_bytes([value_len[0], value_len[1], value_len[2], value_len[3]]);
        let value_len = usize::try_from(value_len)
            .ok()
            .filter(|&len| len <= rest.len())
            .ok_or(ZmtpError::MalformedCommand("READY"))?;
        let (value, rest) = rest.split_at(value_len);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(String::from_utf8_lossy(value).to_ascii_uppercase());
        }
        data = rest;
    }
    socket_type.ok_or(ZmtpError::MalformedCommand("READY without Socket-Type"))
}

/// The 3.0 subscription message a SUB sends for `prefix` (empty: everything).
pub fn subscription(prefix: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(1 + prefix.len());
    frame.push(1);
    frame.extend_from_slice(prefix);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(decoder: &mut Decoder, bytes: &[u8]) -> Result<Vec<Inbound>, ZmtpError> {
        let mut buf = BytesMut::from(bytes);
        let mut out = Vec::new();
        while let Some(item) = decoder.decode(&mut buf)? {
            out.push(item);
        }
        Ok(out)
    }

    #[test]
    fn greeting_round_trips_and_rejects_others() {
        let ours = greeting();
        assert_eq!(
            parse_greeting(&ours),
            Ok(PeerGreeting { major: 3, minor: 0 })
        );
        let mut libzmq = ours;
        libzmq[8] = 1; // libzmq's padding carries a length
        libzmq[11] = 1;
        assert_eq!(
            parse_greeting(&libzmq),
            Ok(PeerGreeting { major: 3, minor: 1 })
        );
        let mut bad = ours;
        bad[0] = b'G';
        assert_eq!(parse_greeting(&bad), Err(ZmtpError::Signature));
        let mut old = ours;
        old[10] = 2;
        assert_eq!(parse_greeting(&old), Err(ZmtpError::Version(2, 0)));
        let mut curve = ours;
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(matches!(parse_greeting(&curve), Err(ZmtpError::Mechanism(m)) if m == "CURVE"));
    }

    #[test]
    fn messages_and_commands_decode() {
        let mut bytes = Vec::new();
        encode_ready(&mut bytes, "PUB");
        let big = vec![7u8; 300];
        encode_message(&mut bytes, &[b"topic", &[0, 0, 0, 0, 0, 0, 0, 5], &big]);
        let mut decoder = Decoder::new(Limits::default());
        let items = decode_all(&mut decoder, &bytes).unwrap();
        assert_eq!(
            items,
            vec![
                Inbound::Command(Command::Ready {
                    socket_type: "PUB".into()
                }),
                Inbound::Message(vec![
                    Bytes::from_static(b"topic"),
                    Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 5]),
                    Bytes::from(big),
                ]),
            ]
        );
        assert!(!decoder.mid_message());
    }

    #[test]
    fn partial_input_resumes_byte_by_byte() {
        let mut bytes = Vec::new();
        encode_message(&mut bytes, &[b"a", &[9u8; 1000]]);
        let mut decoder = Decoder::new(Limits::default());
        let mut buf = BytesMut::new();
        let mut got = None;
        for &b in &bytes {
            buf.extend_from_slice(&[b]);
            if let Some(item) = decoder.decode(&mut buf).unwrap() {
                got = Some(item);
            }
        }
        assert!(
            matches!(got, Some(Inbound::Message(frames)) if frames.len() == 2 && frames[1].len() == 1000)
        );
    }

    #[test]
    fn a_huge_declared_frame_is_rejected_before_its_body() {
        let mut bytes = vec![FLAG_LONG];
        bytes.extend_from_slice(&(1u64 << 50).to_be_bytes());
        let mut decoder = Decoder::new(Limits::default());
        let mut buf = BytesMut::from(&bytes[..]);
        let error = decoder.decode(&mut buf).unwrap_err();
        assert!(
            matches!(error, ZmtpError::MessageTooLarge { declared, .. } if declared == 1 << 50)
        );
        // u64::MAX does not overflow the accounting either.
        let mut bytes = vec![FLAG_LONG];
        bytes.extend_from_slice(&u64::MAX.to_be_bytes());
        let error = Decoder::new(Limits::default())
            .decode(&mut BytesMut::from(&bytes[..]))
            .unwrap_err();
        assert!(matches!(error, ZmtpError::MessageTooLarge { .. }));
    }

    #[test]
    fn the_limit_counts_every_frame_of_a_message() {
        let limits = Limits {
            max_message_bytes: 1000,
            max_frames: 16,
        };
        let mut bytes = Vec::new();
        encode_message(&mut bytes, &[&[1u8; 600], &[2u8; 600]]);
        let error = decode_all(&mut Decoder::new(limits), &bytes).unwrap_err();
        assert_eq!(
            error,
            ZmtpError::MessageTooLarge {
                declared: 1200,
                limit: 1000
            }
        );
        // Exactly at the limit is fine, and the next message starts afresh.
        let mut bytes = Vec::new();
        encode_message(&mut bytes, &[&[1u8; 500], &[2u8; 500]]);
        encode_message(&mut bytes, &[&[3u8; 1000]]);
        assert_eq!(
            decode_all(&mut Decoder::new(limits), &bytes).unwrap().len(),
            2
        );
    }

    #[test]
    fn endless_more_frames_stop_at_the_frame_cap() {
        let mut bytes = Vec::new();
        for _ in 0..100 {
            bytes.extend_from_slice(&[FLAG_MORE, 0]);
        }
        let error = decode_all(&mut Decoder::new(Limits::default()), &bytes).unwrap_err();
        assert_eq!(error, ZmtpError::TooManyFrames(16));
    }

    #[test]
    fn commands_are_bounded_and_parsed() {
        let mut bytes = vec![FLAG_COMMAND | FLAG_LONG];
        bytes.extend_from_slice(&(MAX_COMMAND_BYTES as u64 + 1).to_be_bytes());
        let error = decode_all(&mut Decoder::new(Limits::default()), &bytes).unwrap_err();
        assert_eq!(error, ZmtpError::CommandFrame("too large"));
        let error = decode_all(
            &mut Decoder::new(Limits::default()),
            &[FLAG_COMMAND | FLAG_MORE, 0],
        )
        .unwrap_err();
        assert_eq!(error, ZmtpError::CommandFrame("MORE on a command"));
        let mut bytes = Vec::new();
        encode_command(&mut bytes, "PING", &[0, 10, b'c', b't', b'x']);
        encode_command(&mut bytes, "ERROR", &[3, b'b', b'a', b'd']);
        encode_command(&mut bytes, "SUBSCRIBE", b"");
        encode_command(&mut bytes, "READY", &[5, b'X']);
        let mut decoder = Decoder::new(Limits::default());
        let mut buf = BytesMut::from(&bytes[..]);
        assert_eq!(
            decoder.decode(&mut buf).unwrap(),
            Some(Inbound::Command(Command::Ping {
                context: Bytes::from_static(b"ctx")
            }))
        );
        assert_eq!(
            decoder.decode(&mut buf).unwrap(),
            Some(Inbound::Command(Command::Error("bad".into())))
        );
        assert_eq!(
            decoder.decode(&mut buf).unwrap(),
            Some(Inbound::Command(Command::Other("SUBSCRIBE".into())))
        );
        assert_eq!(
            decoder.decode(&mut buf).unwrap_err(),
            ZmtpError::MalformedCommand("READY")
        );
    }

    #[test]
    fn wants_never_exceeds_the_current_frame() {
        let mut decoder = Decoder::new(Limits::default());
        assert_eq!(decoder.wants(0), 1);
        let mut buf = BytesMut::from(&[FLAG_LONG][..]);
        assert_eq!(decoder.decode(&mut buf).unwrap(), None);
        assert_eq!(decoder.wants(buf.len()), 8);
        buf.extend_from_slice(&5000u64.to_be_bytes());
        assert_eq!(decoder.decode(&mut buf).unwrap(), None);
        assert_eq!(decoder.wants(buf.len()), 5000);
        assert!(decoder.mid_message());
        buf.extend_from_slice(&[0u8; 1000]);
        assert_eq!(decoder.decode(&mut buf).unwrap(), None);
        assert_eq!(decoder.wants(buf.len()), 4000);
    }
}
