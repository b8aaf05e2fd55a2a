//! Reads the `usage` a model server reports at the end of a response (OpenAI shape: in the
//! JSON body, or in the last SSE event with `stream_options.include_usage`).
//!
//! Only the tail of the body is kept (bounded), because `usage` comes last: a long streamed
//! response costs a fixed few kilobytes, not its length.

use serde::Deserialize;

/// Bytes of the response tail kept for finding `usage`.
const TAIL_BYTES: usize = 16 * 1024;

/// Token counts a server reported for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from the server's prefix cache, when reported.
    pub cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
    // Anthropic's names.
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// The last bytes of a response body.
#[derive(Debug, Default)]
pub struct UsageTail {
    tail: Vec<u8>,
}

impl UsageTail {
    /// Appends a chunk, keeping only the last [`TAIL_BYTES`].
    pub fn push(&mut self, chunk: &[u8]) {
        if chunk.len() >= TAIL_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(&chunk[chunk.len() - TAIL_BYTES..]);
            return;
        }
        let overflow = (self.tail.len() + chunk.len()).saturating_sub(TAIL_BYTES);
        self.tail.drain(..overflow);
        self.tail.extend_from_slice(chunk);
    }

    /// The last `usage` object in the tail, if one parses.
    pub fn usage(&self) -> Option<Usage> {
        let needle = b"\"usage\"";
        let mut end = self.tail.len();
        while let Some(at) = find_last(&self.tail[..end], needle) {
            if let Some(usage) = parse_after_key(&self.tail[at + needle.len()..]) {
                return Some(usage);
            }
            end = at;
        }
        None
    }
}

fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// Parses `: {…}` after a `"usage"` key.
fn parse_after_key(rest: &[u8]) -> Option<Usage> {
    let colon = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    if rest[colon] != b':' {
        return None;
    }
    let value = &rest[colon + 1..];
    // Only an object is a usage (serde would also read a struct from an array).
    if value.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let mut stream = serde_json::Deserializer::from_slice(value).into_iter::<UsageJson>();
    let parsed = stream.next()?.ok()?;
    let prompt_tokens = parsed.prompt_tokens.or(parsed.input_tokens)?;
    Some(Usage {
        prompt_tokens,
        completion_tokens: parsed
            .completion_tokens
            .or(parsed.output_tokens)
            .unwrap_or(0),
        cached_tokens: parsed
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .or(parsed.cache_read_input_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_usage_from_json_and_sse_tails() {
        let mut json = UsageTail::default();
        json.push(br#"{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":474,"#);
        json.push(br#""total_tokens":490,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":448}}}"#);
        assert_eq!(
            json.usage(),
            Some(Usage {
                prompt_tokens: 474,
                completion_tokens: 16,
                cached_tokens: Some(448)
            })
        );

        let mut sse = UsageTail::default();
        sse.push(b"data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n");
        sse.push(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n");
        assert_eq!(
            sse.usage(),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                cached_tokens: None
            })
        );
    }

    #[test]
    fn keeps_a_bounded_tail_and_survives_garbage() {
        let mut tail = UsageTail::default();
        for _ in 0..100 {
            tail.push(&[b'x'; 1000]);
        }
        tail.push(
            br#""usage": {"input_tokens": 9, "output_tokens": 1, "cache_read_input_tokens": 8}"#,
        );
        assert!(tail.tail.len() <= TAIL_BYTES);
        assert_eq!(
            tail.usage().map(|u| (u.prompt_tokens, u.cached_tokens)),
            Some((9, Some(8)))
        );
        let mut junk = UsageTail::default();
        junk.push(b"\"usage\"\"usage\": [1,2] \"usage\": {\"prompt_tokens\": \"many\"}");
        assert_eq!(junk.usage(), None);
        let mut big = UsageTail::default();
        big.push(&vec![b'y'; 3 * TAIL_BYTES]);
        assert_eq!(big.tail.len(), TAIL_BYTES);
    }
}
