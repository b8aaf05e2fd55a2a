//! Tokenizer registry errors.

/// Why a tokenizer could not be loaded or a prompt not rendered/encoded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A tokenizer directory file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// `tokenizer.json` could not be loaded.
    #[error("loading tokenizer {path}: {detail}")]
    Load {
        /// The file.
        path: String,
        /// The tokenizers crate's message.
        detail: String,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("parsing {path}: {detail}")]
    Config {
        /// The file.
        path: String,
        /// The parse error.
        detail: String,
    },
    /// The chat template failed to compile or render (e.g. `raise_exception`).
    #[error("chat template: {0}")]
    Template(String),
    /// The model has no chat template but a chat prompt must be rendered.
    #[error("model has no chat template")]
    NoTemplate,
    /// The tokenizer failed to encode.
    #[error("encoding: {0}")]
    Encode(String),
    /// A pre-token is longer than [`super::bounds::MAX_PRETOKEN_BYTES`]: exact tokenization
    /// stops before it (at its byte offset `at`, when that is a safe place to stop).
    #[error("a pre-token is longer than {limit} bytes")]
    PretokenTooLong {
        /// Byte offset of the pre-token in the encoded text, when the ids before it are
        /// exactly those of the whole text.
        at: Option<usize>,
        /// The bound.
        limit: usize,
    },
    /// Metrics could not be registered.
    #[error("registering metrics: {0}")]
    Metrics(String),
}

impl TokenizeError {
    /// The same error for a text that starts `offset` bytes into the one reported on.
    pub fn offset_by(self, offset: usize) -> Self {
        match self {
            Self::PretokenTooLong { at, limit } => Self::PretokenTooLong {
                at: at.map(|a| a + offset),
                limit,
            },
            other => other,
        }
    }
}
