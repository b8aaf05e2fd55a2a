//! Model rewrite on the request body and back on the response, byte-preserving.
//!
//! The request body is forwarded as the client sent it except for the `model` value: we find
//! the top-level `"model"` string's byte span with the bounded scanner and splice the new value
//! in, so nothing is re-serialised (key order, whitespace, number formats and escapes survive).
//! Responses get the client's model name back, for whole JSON bodies and for SSE streams (where
//! a `data:` line may be cut anywhere by chunking; see [`ResponseModelRewriter`]).

use bytes::Bytes;

use super::error::RequestError;
use super::scan::{ParseLimits, scan};

/// Returns `body` with its top-level `model` string replaced by `new_model`; every other byte
/// is preserved.
pub fn rewrite_model(body: &[u8], new_model: &str) -> Result<Bytes, RequestError> {
    let shape = scan(body, ParseLimits::default())?;
    let span = shape.model_span.ok_or(RequestError::MissingModel)?;
    Ok(splice(body, span, new_model))
}

fn splice(body: &[u8], span: std::ops::Range<usize>, new_model: &str) -> Bytes {
    let quoted = json_string(new_model);
    let (Some(head), Some(tail)) = (body.get(..span.start), body.get(span.end..)) else {
        return Bytes::copy_from_slice(body);
    };
    let mut out = Vec::with_capacity(body.len() + quoted.len());
    out.extend_from_slice(head);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(tail);
    Bytes::from(out)
}

fn json_string(s: &str) -> String {
    // Serialising a &str cannot fail.
    serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\""))
}

/// Response JSON bodies are trusted more than requests but still bounded.
const RESPONSE_LIMITS: ParseLimits = ParseLimits {
    max_depth: 128,
    max_array_len: 1 << 24,
};

/// Longest SSE line we buffer while looking for its end; longer lines pass through unchanged.
pub const MAX_SSE_LINE_BYTES: usize = 4 << 20;

/// Puts the client's model name back into responses.
///
/// Concurrency: one rewriter per response stream; not shared.
#[derive(Debug)]
pub struct ResponseModelRewriter {
    client_model_json: String,
    pending: Vec<u8>,
    passthrough_line: bool,
}

impl ResponseModelRewriter {
    /// A rewriter that writes `client_model` into every response's top-level `model`.
    pub fn new(client_model: &str) -> Self {
        Self {
            client_model_json: json_string(client_model),
            pending: Vec::new(),
            passthrough_line: false,
        }
    }

    /// Rewrites a whole (non-streamed) JSON response; a body without a top-level `model`
    /// string (or not JSON) is returned unchanged.
    pub fn rewrite_json(&self, body: &[u8]) -> Bytes {
        match scan(body, RESPONSE_LIMITS) {
            Ok(shape) => match shape.model_span {
                Some(span) => self.splice_quoted(body, span),
                None => Bytes::copy_from_slice(body),
            },
            Err(_) => Bytes::copy_from_slice(body),
        }
    }

    fn splice_quoted(&self, body: &[u8], span: std::ops::Range<usize>) -> Bytes {
        let (Some(head), Some(tail)) = (body.get(..span.start), body.get(span.end..)) else {
            return Bytes::copy_from_slice(body);
        };
        let mut out = Vec::with_capacity(body.len() + self.client_model_json.len());
        out.extend_from_slice(head);
        out.extend_from_slice(self.client_model_json.as_bytes());
        out.extend_from_slice(tail);
        Bytes::from(out)
    }

    /// Feeds one chunk of an SSE stream; returns the bytes that can be sent on now (complete
    /// lines, rewritten). A partial last line is held back until its end arrives.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(chunk.len() + 64);
        let mut rest = chunk;
        while !rest.is_empty() {
            let newline = rest.iter().position(|&b| b == b'\n');
            let (piece, has_end) = match newline {
                Some(p) => (rest.get(..=p).unwrap_or(rest), true),
                None => (rest, false),
            };
            rest = rest.get(piece.len()..).unwrap_or(&[]);
            if self.passthrough_line {
                out.extend_from_slice(piece);
                if has_end {
                    self.passthrough_line = false;
                }
                continue;
            }
            self.pending.extend_from_slice(piece);
            if has_end {
                let line = std::mem::take(&mut self.pending);
                self.rewrite_line(&line, &mut out);
            } else if self.pending.len() > MAX_SSE_LINE_BYTES {
                // NOTE: an absurdly long line is forwarded unchanged rather than buffered.
                out.append(&mut self.pending);
                self.passthrough_line = true;
            }
        }
        Bytes::from(out)
    }

    /// Ends the stream: returns whatever partial line was held back (rewritten if possible).
    pub fn finish(&mut self) -> Bytes {
        let line = std::mem::take(&mut self.pending);
        let mut out = Vec::with_capacity(line.len());
        self.rewrite_line(&line, &mut out);
        Bytes::from(out)
    }

    fn rewrite_line(&self, line: &[u8], out: &mut Vec<u8>) {
        let Some(payload) = line.strip_prefix(b"data:") else {
            out.extend_from_slice(line);
            return;
        };
        let offset = line.len() - payload.len();
        match scan(payload, RESPONSE_LIMITS)
            .ok()
            .and_then(|s| s.model_span)
        {
            Some(span) => out.extend_from_slice(
                &self.splice_quoted(line, span.start + offset..span.end + offset),
            ),
            None => out.extend_from_slice(line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_rewrite_preserves_other_bytes() {
        let body = br#"{ "stream":true,  "model" : "a\u00e9", "x":{"model":"keep"} }"#;
        let out = rewrite_model(body, "b\"c").unwrap();
        assert_eq!(
            &out[..],
            br#"{ "stream":true,  "model" : "b\"c", "x":{"model":"keep"} }"#
        );
        assert_eq!(
            rewrite_model(br#"{"x":1}"#, "m"),
            Err(RequestError::MissingModel)
        );
    }

    #[test]
    fn json_response_rewrite_touches_only_the_top_level_model() {
        let rw = ResponseModelRewriter::new("клиент/model");
        let body = br#"{"id":"x","model":"served","choices":[{"model":"inner"}],"usage":{"prompt_tokens":3}}"#;
        assert_eq!(
            std::str::from_utf8(&rw.rewrite_json(body)).unwrap(),
            r#"{"id":"x","model":"клиент/model","choices":[{"model":"inner"}],"usage":{"prompt_tokens":3}}"#
        );
        assert_eq!(&rw.rewrite_json(b"not json")[..], b"not json");
        assert_eq!(
            &rw.rewrite_json(br#"{"object":"list"}"#)[..],
            br#"{"object":"list"}"#
        );
    }

    #[test]
    fn sse_rewrite_handles_multibyte_names_split_across_chunks() {
        let stream = "data: {\"model\":\"séрвер\"}\n\n";
        let expected = "data: {\"model\":\"клиент\"}\n\n";
        let bytes = stream.as_bytes();
        for cut in 0..=bytes.len() {
            let mut rw = ResponseModelRewriter::new("клиент");
            let mut out = rw.push(&bytes[..cut]).to_vec();
            out.extend_from_slice(&rw.push(&bytes[cut..]));
            out.extend_from_slice(&rw.finish());
            assert_eq!(std::str::from_utf8(&out).unwrap(), expected, "cut {cut}");
        }
    }

    #[test]
    fn sse_rewrite_handles_every_chunk_boundary() {
        let stream = "data: {\"id\":\"1\",\"model\":\"served-x\",\"choices\":[]}\n\n: keepalive\ndata: {\"model\":\"served-x\"}\r\n\r\ndata: [DONE]\n\n";
        let expected = stream.replace("served-x", "client");
        for cut in 0..=stream.len() {
            for cut2 in cut..=stream.len() {
                let mut rw = ResponseModelRewriter::new("client");
                let mut out = Vec::new();
                out.extend_from_slice(&rw.push(&stream.as_bytes()[..cut]));
                out.extend_from_slice(&rw.push(&stream.as_bytes()[cut..cut2]));
                out.extend_from_slice(&rw.push(&stream.as_bytes()[cut2..]));
                out.extend_from_slice(&rw.finish());
                assert_eq!(
                    String::from_utf8(out).unwrap(),
                    expected,
                    "cuts {cut} {cut2}"
                );
            }
        }
    }
}
