//! kvpick: a KV-cache-aware endpoint picker for LLM inference behind Envoy.
//!
//! The folder tree is the architecture (see `../shared/DESIGN.md` §1):
//! - [`extproc`]: the Envoy ext-proc stream state machine (the product's front door);
//! - [`request`] and [`tokenize`]: what a request asks for, as the model server will see it;
//! - [`kvevents`] and [`kvcache`]: which pod holds which prefix, fed by vLLM's KV events;
//! - [`endpoints`] and [`discovery`]: the pool of model-server pods and their live load;
//! - [`scheduling`]: the decision;
//! - [`telemetry`]: our own metrics and health;
//! - [`tls`]: TLS on the ext-proc port;
//! - [`live`]: values the request path reads and watchers replace;
//! - [`replica`]: what active-active replicas exchange (routing records, in-flight counts);
//! - [`admin`]: the metrics and debug HTTP servers, above every layer they report on;
//! - [`app`]: `kvpick serve`, the wiring of all of the above;
//!
//! The simulator and the load generator are their own crates (`crates/kvpick-sim`,
//! `crates/kvpick-bench`): the product neither links nor rebuilds with them.

pub mod admin;
pub mod app;
pub mod config;
pub mod discovery;
pub mod endpoints;
pub mod extproc;
pub mod kvcache;
pub mod kvevents;
pub mod live;
pub mod pb;
pub mod replica;
pub mod request;
pub mod scheduling;
pub mod scrape;
pub mod telemetry;
pub mod tls;
pub mod tokenize;

/// Where the unit tests find the shared real-vLLM captures: the workspace's one fixture lookup
/// (`tests/support/paths.rs`), so a checkout anywhere finds them as the integration tests do.
#[cfg(test)]
#[path = "../tests/support/paths.rs"]
mod test_paths;
