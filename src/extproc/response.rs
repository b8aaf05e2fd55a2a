//! The response path: pass chunks through, putting the client's model name back when the
//! request's model was rewritten.

use bytes::Bytes;

use super::mutations;
use crate::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use crate::request::ResponseModelRewriter;

/// How the gateway sends response bodies (its `processing_mode.response_body_mode`, told in
/// the first message's `protocol_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponseBodyMode {
    /// `FULL_DUPLEX_STREAMED` (GIE's): Envoy keeps no copy; every chunk is sent back.
    #[default]
    FullDuplex,
    /// `STREAMED`: Envoy holds each chunk until its answer, so an unchanged chunk needs no
    /// bytes back. (It does not let Envoy fail open when kvpick dies mid-response: measured,
    /// deploy/envoy/envoy.yaml.)
    Streamed,
}

/// How response bodies are handled.
pub enum ResponseBody {
    /// Unchanged, chunk by chunk.
    PassThrough,
    /// SSE: complete lines rewritten as they arrive.
    Sse(ResponseModelRewriter),
    /// One JSON document: buffered (up to a limit), rewritten at the end.
    Json {
        /// The rewriter.
        rewriter: ResponseModelRewriter,
        /// Bytes held so far.
        held: Vec<u8>,
        /// Largest body held; past it the rest passes through unchanged.
        limit: usize,
    },
}

impl ResponseBody {
    /// The handling for a response whose request model was rewritten from `client_model`.
    pub fn restoring(client_model: &str, stream: bool, limit: usize) -> Self {
        let rewriter = ResponseModelRewriter::new(client_model);
        if stream {
            Self::Sse(rewriter)
        } else {
            Self::Json {
                rewriter,
                held: Vec::new(),
                limit,
            }
        }
    }

    /// Whether the body may change length (so `content-length` must go).
    pub fn changes_length(&self) -> bool {
        !matches!(self, Self::PassThrough)
    }

    /// Handles one response chunk and returns the replies to send, in the gateway's mode.
    pub fn on_chunk(
        &mut self,
        chunk: Bytes,
        end_of_stream: bool,
        mode: ResponseBodyMode,
    ) -> Vec<ProcessingResponse> {
        let rewritten = self.rewrite(&chunk, end_of_stream);
        match (mode, rewritten) {
            (ResponseBodyMode::FullDuplex, None) => {
                vec![mutations::response_body_chunk(chunk, end_of_stream)]
            }
            (ResponseBodyMode::FullDuplex, Some(out)) => {
                mutations::response_body_chunks(out, end_of_stream)
            }
            // One answer per chunk; a replacement equal to the chunk is none (Envoy
            // forwards the chunk it holds, and no bytes come back).
            (ResponseBodyMode::Streamed, out) => vec![mutations::response_body_streamed_mode(
                out.filter(|out| out[..] != chunk[..]),
            )],
        }
    }

    /// The bytes that replace `chunk` (`None`: it passes unchanged). Bytes held back (a JSON
    /// answer until it is complete, an SSE line until its end) are answered with fewer bytes
    /// now and sent with a later chunk.
    fn rewrite(&mut self, chunk: &[u8], end_of_stream: bool) -> Option<Bytes> {
        match self {
            Self::PassThrough => None,
            Self::Sse(rewriter) => {
                let out = rewriter.push(chunk);
                if !end_of_stream {
                    return Some(out);
                }
                let mut out = out.to_vec();
                out.extend_from_slice(&rewriter.finish());
                Some(out.into())
            }
            Self::Json {
                rewriter,
                held,
                limit,
            } => {
                if held.len() + chunk.len() > *limit {
                    // NOTE: a response too large to hold is forwarded unchanged.
                    let mut out = std::mem::take(held);
                    out.extend_from_slice(chunk);
                    *self = Self::PassThrough;
                    return Some(out.into());
                }
                held.extend_from_slice(chunk);
                if end_of_stream {
                    let out = rewriter.rewrite_json(held);
                    held.clear();
                    Some(out)
                } else {
                    Some(Bytes::new())
                }
            }
        }
    }
}
