//! Static bearer-token authentication for `/metrics` and the `/debug/*` views.
//!
//! GIE's EPP authenticates its metrics endpoint (`--metrics-endpoint-auth`) with Kubernetes
//! TokenReview and SubjectAccessReview. kvpick has no Kubernetes client, so the honest
//! equivalent is a static token the operator mounts as a file (e.g. from a Secret) and gives
//! the Prometheus scrape config as `authorization: {credentials_file: …}`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus::IntCounter;

/// The token requests must present as `Authorization: Bearer <token>`.
#[derive(Clone)]
pub struct BearerToken(Arc<[u8]>);

impl std::fmt::Debug for BearerToken {
    /// Never prints the secret (the config is logged at debug level).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file holds no token (only whitespace).
    #[error("{path} holds no token")]
    Empty {
        /// The file.
        path: std::path::PathBuf,
    },
}

impl BearerToken {
    /// The token in `path`, surrounding whitespace (a trailing newline) removed.
    pub fn from_file(path: &std::path::Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.to_owned(),
            source,
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(TokenError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self(token.as_bytes().into()))
    }

    /// Whether an `Authorization` header value carries this token.
    pub fn accepts(&self, authorization: &[u8]) -> bool {
        let Some(scheme) = authorization.get(..7) else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case(b"bearer ") {
            return false;
        }
        constant_time_eq(authorization[7..].trim_ascii(), &self.0)
    }
}

/// Compares without an early exit on the first differing byte, so response timing does not
/// reveal how much of a guessed token was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What [`require`] checks against.
#[derive(Clone, Debug)]
pub struct AuthState {
    /// The token; `None` lets every request through.
    pub token: Option<BearerToken>,
    /// Requests refused (`kvpick_admin_unauthorized_requests_total`).
    pub refused: IntCounter,
}

/// Middleware: 401 unless the request carries the configured token.
pub async fn require(State(auth): State<AuthState>, request: Request, next: Next) -> Response {
    let Some(token) = &auth.token else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if presented.is_some_and(|value| token.accepts(value)) {
        return next.run(request).await;
    }
    auth.refused.inc();
    tracing::debug!(path = %request.uri().path(), "admin request without a valid bearer token");
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "a valid bearer token is required\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_with_the_bearer_scheme_is_accepted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").expect("write");
        let token = BearerToken::from_file(&path).expect("token");
        assert!(token.accepts(b"Bearer s3cret"));
        assert!(token.accepts(b"bearer s3cret"));
        assert!(!token.accepts(b"Bearer s3cre"));
        assert!(!token.accepts(b"Bearer s3cretx"));
        assert!(!token.accepts(b"Basic s3cret"));
        assert!(!token.accepts(b"s3cret"));
        assert!(!token.accepts(b""));
        assert_eq!(format!("{token:?}"), "BearerToken(<redacted>)");

        std::fs::write(&path, " \n").expect("write");
        assert!(matches!(
            BearerToken::from_file(&path),
            Err(TokenError::Empty { .. })
        ));
    }
}
