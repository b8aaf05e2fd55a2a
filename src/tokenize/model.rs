//! One model's tokenizer: `tokenizer.json`, its chat template and special tokens (HF layout,
//! the same directory vLLM loads), and its prefix token cache.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use super::error::TokenizeError;
use super::fast_bpe::FastEncoder;
use super::merge_table::{LAZY_AFTER_MISSES, LazyMerges};
use super::prefix_cache::{CachedTokens, PrefixTokenCache, WordEncoder};
use super::template::{ChatTemplate, ContentFormat};
use crate::request::ChatPrompt;

/// The special-token variables HF passes to chat templates.
const SPECIAL_TOKEN_KEYS: [&str; 4] = ["bos_token", "eos_token", "pad_token", "unk_token"];

/// A loaded tokenizer directory.
///
/// Concurrency: immutable except for the internally locked prefix cache; share via `Arc`.
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    adds_special_tokens: bool,
    fast: Option<FastEncoder>,
    cache: PrefixTokenCache,
}

impl ModelTokenizer {
    /// Loads `dir` (`tokenizer.json`, optional `tokenizer_config.json` and
    /// `chat_template.jinja`, which wins over the config's `chat_template` as in transformers).
    pub fn load(
        dir: &Path,
        prefix_cache_bytes: usize,
        content_format: Option<ContentFormat>,
    ) -> Result<Self, TokenizeError> {
        let tok_path = dir.join("tokenizer.json");
        let tok_json = std::fs::read(&tok_path).map_err(|source| TokenizeError::Io {
            path: tok_path.display().to_string(),
            source,
        })?;
        let tokenizer = Tokenizer::from_bytes(&tok_json).map_err(|e| TokenizeError::Load {
            path: tok_path.display().to_string(),
            detail: e.to_string(),
        })?;
        let config = read_config(&dir.join("tokenizer_config.json"))?;
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(
                std::fs::read_to_string(&jinja_path).map_err(|source| TokenizeError::Io {
                    path: jinja_path.display().to_string(),
                    source,
                })?,
            )
        } else {
            config_template(&config)
        };
        let mut special = Map::new();
        for key in SPECIAL_TOKEN_KEYS {
            if let Some(tok) = special_token(config.get(key)) {
                special.insert(key.to_owned(), Json::String(tok));
            }
        }
        // NOTE: a template minijinja cannot compile leaves the model without a template (chat
        // prompts for it are routed approximately) rather than failing startup.
        let template = source.and_then(|s| match ChatTemplate::new(s, special, content_format) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "chat template does not compile; chat prompts will be approximate");
                None
            }
        });
        let adds_special_tokens = match (tokenizer.encode("a", true), tokenizer.encode("a", false))
        {
            (Ok(with), Ok(without)) => with.get_ids() != without.get_ids(),
            _ => true,
        };
        let longest_added = tokenizer
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.len())
            .max()
            .unwrap_or(0);
        let fast = FastEncoder::new(&tokenizer).map(|fast| {
            let lazy = LazyMerges::new(
                tok_path.clone(),
                &tok_json,
                *fast.byte_chars(),
                LAZY_AFTER_MISSES,
            );
            fast.with_lazy_merges(lazy)
        });
        Ok(Self {
            dir: dir.to_path_buf(),
            fast,
            tokenizer,
            template,
            adds_special_tokens,
            cache: PrefixTokenCache::new(prefix_cache_bytes, longest_added.max(56) + 8),
        })
    }

    /// The directory this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying tokenizers-crate tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, if the directory has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Bytes held by the prefix cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Renders a chat prompt with this model's template.
    pub fn render(&self, chat: &ChatPrompt) -> Result<String, TokenizeError> {
        self.template
            .as_ref()
            .ok_or(TokenizeError::NoTemplate)?
            .render(chat)
    }

    /// Encodes `text` as the server would (`add_special_tokens` as in the request), through the
    /// prefix cache when the post-processor adds nothing. At a pre-token over
    /// [`super::MAX_PRETOKEN_BYTES`] exact tokenization stops: the ids are those of the text
    /// before it, and `cut_at` says where (module docs of `bounds`).
    pub fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<CachedTokens, TokenizeError> {
        match self.encode_whole(text, add_special_tokens) {
            Err(TokenizeError::PretokenTooLong {
                at: Some(at),
                limit,
            }) if !(add_special_tokens && self.adds_special_tokens) => {
                self.encode_head(text, at, limit)
            }
            Err(TokenizeError::PretokenTooLong {
                at: Some(at),
                limit,
            }) => {
                let head = text
                    .get(..at)
                    .ok_or(TokenizeError::PretokenTooLong { at: None, limit })?;
                let mut tokens = self.encode_whole(head, add_special_tokens)?;
                tokens.cut_at = Some(at);
                Ok(tokens)
            }
            other => other,
        }
    }

    /// The ids of `text` before byte `at`, where a pre-token over the bound starts: the
    /// tokens the whole text has there.
    ///
    /// Why not encode `text[..at]` alone: a head that ends in whitespace splits its trailing
    /// run differently at the end of a text (`\s+(?!\S)` then takes the whole run, while
    /// before the long pre-token it leaves the last character to it or to a word of its own),
    /// so its last ids would differ. Encoding the head with the first character of the long
    /// pre-token lets the pre-tokenizer see what the whole text has there; the ids are those
    /// before the last word start at or before `at`.
    fn encode_head(
        &self,
        text: &str,
        at: usize,
        limit: usize,
    ) -> Result<CachedTokens, TokenizeError> {
        let too_long = || TokenizeError::PretokenTooLong { at: None, limit };
        let next = text
            .get(at..)
            .and_then(|rest| rest.chars().next())
            .map_or(0, char::len_utf8);
        let head = text.get(..at + next).ok_or_else(too_long)?;
        let (mut ids, words) = self.word_encoder().encode(head)?;
        let (cut, kept) = words
            .iter()
            .rev()
            .find(|(start, _)| *start <= at)
            .copied()
            .unwrap_or((0, 0));
        ids.truncate(kept);
        Ok(CachedTokens {
            ids,
            reused_tokens: 0,
            cut_at: Some(cut),
        })
    }

    fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<CachedTokens, TokenizeError> {
        if add_special_tokens && self.adds_special_tokens {
            // NOTE: tokenizers that add BOS/EOS bypass the prefix cache (the Qwen2 tokenizer
            // used by the fixtures adds nothing).
            super::bounds::check_unbroken_runs(text, super::MAX_PRETOKEN_BYTES)?;
            let enc = self
                .tokenizer
                .encode(text, true)
                .map_err(|e| TokenizeError::Encode(e.to_string()))?;
            return Ok(CachedTokens {
                ids: enc.get_ids().to_vec(),
                reused_tokens: 0,
                cut_at: None,
            });
        }
        self.cache.encode(&self.word_encoder(), text)
    }

    /// [`Self::encode`] for an owned text (a rendered chat prompt): the prefix cache keeps it
    /// without copying. On error the text is handed back.
    pub fn encode_owned(
        &self,
        text: String,
        add_special_tokens: bool,
    ) -> Result<CachedTokens, (TokenizeError, String)> {
        if add_special_tokens && self.adds_special_tokens {
            return match self.encode(&text, true) {
                Ok(tokens) => Ok(tokens),
                Err(e) => Err((e, text)),
            };
        }
        match self.cache.encode_owned(&self.word_encoder(), text) {
            Err((
                TokenizeError::PretokenTooLong {
                    at: Some(at),
                    limit,
                },
                text,
            )) if text.is_char_boundary(at) => {
                self.encode_head(&text, at, limit).map_err(|e| (e, text))
            }
            Err((TokenizeError::PretokenTooLong { limit, .. }, text)) => {
                Err((TokenizeError::PretokenTooLong { at: None, limit }, text))
            }
            other => other,
        }
    }

    /// The encoder the prefix cache uses (fast path when supported).
    pub fn word_encoder(&self) -> WordEncoder<'_> {
        WordEncoder::new(&self.tokenizer, self.fast.as_ref())
    }

    /// Whether the exact fast byte-level BPE path is active for this tokenizer.
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Whether the fast path merges word-cache misses itself now ([`super::MergeTable`]; built once
    /// the crate has merged [`LAZY_AFTER_MISSES`] of them).
    pub fn has_merge_table(&self) -> bool {
        self.fast.as_ref().is_some_and(FastEncoder::has_merge_table)
    }
}

impl std::fmt::Debug for ModelTokenizer {
    // NOTE: hand-written so that debug output never dumps the whole vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("has_template", &self.template.is_some())
            .field("fast_path", &self.fast.is_some())
            .field("cache_bytes", &self.cache.bytes())
            .finish()
    }
}

fn read_config(path: &Path) -> Result<Map<String, Json>, TokenizeError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Map::new()),
        Err(source) => {
            return Err(TokenizeError::Io {
                path: path.display().to_string(),
                source,
            });
        }
    };
    match serde_json::from_str::<Json>(&text) {
        Ok(Json::Object(m)) => Ok(m),
        Ok(_) => Err(TokenizeError::Config {
            path: path.display().to_string(),
            detail: "not a JSON object".into(),
        }),
        Err(e) => Err(TokenizeError::Config {
            path: path.display().to_string(),
            detail: e.to_string(),
        }),
    }
}

/// `chat_template` as a string, or the `default` entry of a list of named templates.
fn config_template(config: &Map<String, Json>) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A special token given as a string or as an AddedToken object `{"content": …}`.
fn special_token(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}
