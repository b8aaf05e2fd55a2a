//! Why a request body was refused. Every variant maps to HTTP 400 with [`RequestError::reason`].

/// A request body kvpick refuses to route (the lead answers 400 `inference error: <reason>`).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// The body is not valid UTF-8.
    #[error("body is not valid UTF-8 (invalid byte at offset {offset})")]
    NotUtf8 {
        /// Byte offset of the first invalid byte.
        offset: usize,
    },
    /// The body ends in the middle of a JSON value.
    #[error("body is truncated JSON")]
    Truncated,
    /// The body is not JSON.
    #[error("body is not valid JSON: {detail}")]
    NotJson {
        /// serde_json's description of the syntax error.
        detail: String,
    },
    /// The JSON top level is not an object.
    #[error("body is not a JSON object")]
    NotAnObject,
    /// Nested deeper than the configured bound.
    #[error("JSON nested deeper than {max_depth} levels")]
    TooDeep {
        /// The configured bound.
        max_depth: usize,
    },
    /// An array longer than the configured bound.
    #[error("JSON array longer than {max_len} elements")]
    ArrayTooLong {
        /// The configured bound.
        max_len: usize,
    },
    /// No top-level `model` field.
    #[error("no `model` field")]
    MissingModel,
    /// `model` is not a non-empty string.
    #[error("`model` must be a non-empty string")]
    InvalidModel,
    /// A known field has the wrong shape (e.g. `messages` not an array).
    #[error("invalid field `{field}`: {detail}")]
    InvalidField {
        /// The field path, e.g. `messages[2].content`.
        field: String,
        /// What is wrong with it.
        detail: &'static str,
    },
}

impl RequestError {
    /// The short reason for the 400 answer.
    pub fn reason(&self) -> String {
        self.to_string()
    }
}
