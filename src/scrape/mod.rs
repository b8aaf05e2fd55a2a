//! Model-server `/metrics` scraping per engine type (DESIGN §4).
//!
//! - [`prom_text`]: a tolerant Prometheus text parser;
//! - [`engine`]: which series mean queue, running, KV usage, cache shape and LoRA per engine;
//! - [`error`]: why a scrape failed;
//! - [`connection`]: one pod's kept-alive HTTP/1.1 connection, driven by its scrape task;
//! - `by_name`: asking a pod for only the metrics kvpick reads;
//! - [`scraper`]: the per-endpoint scrape tasks and the store scheduling reads.

mod by_name;
pub mod connection;
pub mod engine;
pub mod error;
pub mod prom_text;
pub mod scraper;
#[cfg(test)]
mod test_pod;

pub use engine::{EngineKind, LoraState, PodMetrics};
pub use scraper::{
    DEFAULT_METRICS_PATH, MetricsStore, ScrapeConfig, ScrapeManager, ScrapeMetrics, ScrapeObserver,
    ScrapeStatus,
};
