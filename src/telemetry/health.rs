//! gRPC health (GIE-compatible service names) on its own port.
//!
//! `liveness` is SERVING while the process runs. `readiness`, `""` and the ext-proc service
//! name are SERVING once discovery has synced and go NOT_SERVING first on shutdown, so the
//! gateway stops sending new streams before kvpick drains.

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// The ext-proc service name gateways health-check.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

const READINESS_SERVICES: [&str; 3] = ["readiness", "", EXT_PROC_SERVICE];

/// Sets the readiness services (`readiness`, `""`, ext-proc) to `ready`.
pub async fn set_ready(reporter: &HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for service in READINESS_SERVICES {
        reporter.set_service_status(service, status).await;
    }
}

/// A health reporter with `liveness` SERVING and readiness NOT_SERVING.
pub async fn reporter() -> (
    HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    set_ready(&reporter, false).await;
    (reporter, service)
}
