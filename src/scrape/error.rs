//! Why a scrape failed (shared by the connection and the scrape tasks).

/// Why a scrape failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrapeError {
    /// No answer within the timeout.
    #[error("timed out")]
    Timeout,
    /// No connection within the timeout: nothing was asked of the pod (reason `timeout`).
    #[error("timed out connecting")]
    ConnectTimeout,
    /// The connection was refused, reset or unroutable: nothing listens at the address
    /// (a slow answer is [`Self::Timeout`], not this).
    #[error("connection failed: {0}")]
    Connect(String),
    /// Any other connection or protocol failure.
    #[error("request failed: {0}")]
    Http(String),
    /// A non-200 status.
    #[error("HTTP status {0}")]
    Status(u16),
    /// The body is larger than the limit, not UTF-8, or cut off.
    #[error("bad body: {0}")]
    Body(String),
    /// A needed metric is absent.
    #[error(transparent)]
    Missing(#[from] super::engine::MissingMetric),
}

impl ScrapeError {
    /// Every [`Self::reason`].
    pub const REASONS: [&'static str; 6] = [
        "timeout",
        "connect",
        "http",
        "status",
        "body",
        "missing_metric",
    ];

    /// The `reason` label of `kvpick_scrape_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Timeout | Self::ConnectTimeout => "timeout",
            Self::Connect(_) => "connect",
            Self::Http(_) => "http",
            Self::Status(_) => "status",
            Self::Body(_) => "body",
            Self::Missing(_) => "missing_metric",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_listed() {
        let errors = [
            ScrapeError::Timeout,
            ScrapeError::Connect(String::new()),
            ScrapeError::Http(String::new()),
            ScrapeError::Status(500),
            ScrapeError::Body(String::new()),
            ScrapeError::Missing(super::super::engine::MissingMetric("m")),
        ];
        let reasons: Vec<_> = errors.iter().map(ScrapeError::reason).collect();
        assert_eq!(reasons, ScrapeError::REASONS);
        assert_eq!(ScrapeError::ConnectTimeout.reason(), "timeout");
    }
}
