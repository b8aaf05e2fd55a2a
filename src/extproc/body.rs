//! What the EPP core reads from a request body: that it is JSON and which model it names.
//!
//! NOTE: this is the minimal reading the EPP core needs; the request-understanding module
//! replaces it with full OpenAI/Anthropic parsing and tokenization behind the same call.

use super::error::RequestError;

/// What the ext-proc path learned from the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodySummary {
    /// The `model` field.
    pub model: String,
}

#[derive(serde::Deserialize)]
struct ModelOnly<'a> {
    #[serde(borrow, default)]
    model: Option<std::borrow::Cow<'a, str>>,
}

/// Reads the body as a JSON object and takes its `model`.
pub fn summarize(body: &[u8]) -> Result<BodySummary, RequestError> {
    // Deserializing into a struct that ignores other fields validates the whole document
    // (serde_json checks the remaining input) without building a tree of it.
    let parsed: ModelOnly<'_> =
        serde_json::from_slice(body).map_err(|e| RequestError::BodyNotJson(e.to_string()))?;
    match parsed.model {
        Some(model) if !model.trim().is_empty() => Ok(BodySummary {
            model: model.into_owned(),
        }),
        _ => Err(RequestError::MissingModel),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_model_and_rejects_bad_bodies() {
        let ok = summarize(br#"{"model":"m","prompt":"hi","extra":{"a":[1,2]}}"#).expect("ok");
        assert_eq!(ok.model, "m");
        assert!(matches!(
            summarize(b"not json"),
            Err(RequestError::BodyNotJson(_))
        ));
        assert!(matches!(
            summarize(b"[1,2]"),
            Err(RequestError::BodyNotJson(_))
        ));
        assert!(matches!(
            summarize(br#"{"model":"m""#),
            Err(RequestError::BodyNotJson(_))
        ));
        assert!(matches!(
            summarize(br#"{"prompt":"x"}"#),
            Err(RequestError::MissingModel)
        ));
        assert!(matches!(
            summarize(br#"{"model":""}"#),
            Err(RequestError::MissingModel)
        ));
        assert!(matches!(
            summarize(br#"{"model":3}"#),
            Err(RequestError::BodyNotJson(_))
        ));
        assert!(matches!(
            summarize(b"{\"model\":\"\xff\"}"),
            Err(RequestError::BodyNotJson(_))
        ));
    }
}
