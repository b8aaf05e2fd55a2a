//! `kvpick serve`: builds every part from one [`ServeConfig`] and runs until shutdown.
//!
//! `extproc_server` serves the ext-proc port, each connection on one of a few threads;
//! [`pool_sync`] keeps KV-event subscriptions and metric scrapers in step with the pool;
//! [`liveness`] marks endpoints down (left out of the candidates) and up again.
//! The background subsystems ([`subsystems`]) run under a [`supervise::Supervisor`]: one
//! that dies turns readiness off and is restarted, or ends kvpick with an error.
//!
//! Shutdown order (SIGTERM/SIGINT or the `shutdown` future): readiness goes NOT_SERVING so
//! the gateway stops opening streams; new streams are still accepted for the grace period
//! (until the gateway's next health check has seen NOT_SERVING); then the ext-proc server
//! stops accepting and lets open streams finish, for at most the drain timeout; then the
//! rest stops and the process exits.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

mod extproc_server;
mod liveness;
mod pool_sync;
mod sources;
pub mod subsystems;
pub mod supervise;

use crate::admin;
use crate::config::ServeConfig;
use crate::discovery::PoolFileError;
use crate::discovery::kube::KubeError;
use crate::endpoints::Datastore;
use crate::extproc::admission::Admission;
use crate::extproc::{BodyBudget, ExtProcService, StreamContext};
use crate::kvcache::{IndexConfig, PrefixIndex};
use crate::kvevents::{KvEventsError, KvEventsManager};
use crate::scheduling::{
    ConfiguredScheduler, FlowControlConfig, FlowController, MetricsSource, SchedulerDeps,
};
use crate::scrape::{MetricsStore, ScrapeMetrics};
use crate::telemetry::{EppMetrics, health};
use crate::tokenize::{TokenizeError, Tokenizers};
use supervise::{Policy, SubsystemFailed, Supervisor};

/// Why `kvpick serve` could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The initial pool is invalid.
    #[error(transparent)]
    Pool(#[from] PoolFileError),
    /// The Kubernetes client could not be made.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// Metrics could not be registered.
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    /// A tokenizer directory could not be loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizeError),
    /// The KV-event subsystem could not start.
    #[error("kv events: {0}")]
    KvEvents(#[from] KvEventsError),
    /// TLS on the ext-proc port could not be set up.
    #[error("--secure-serving: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// The replica exchange could not start.
    #[error(transparent)]
    Replica(#[from] crate::replica::ReplicaError),
    /// A background subsystem died for good (see [`supervise`]).
    #[error(transparent)]
    Subsystem(#[from] SubsystemFailed),
    /// A server failed.
    #[error("{server} server failed: {message}")]
    Server {
        /// Which server.
        server: &'static str,
        /// The error.
        message: String,
    },
}

async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Runs kvpick until `shutdown` resolves, then drains and returns.
pub async fn serve(
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(EppMetrics::with_fairness_id_limit(
        &registry,
        config.fairness_id_label_limit,
    )?);
    let datastore = Arc::new(Datastore::new());
    let background = CancellationToken::new();
    let mut supervisor = Supervisor::new(metrics.subsystem_failures.clone());
    let model_rewrites = crate::live::Live::new(config.model_rewrites.clone());
    let objectives = crate::live::Live::new(config.objectives.clone());
    // Fires when shutdown begins (before the drain), unlike `background`.
    let stepping_down = CancellationToken::new();
    let mut source_ready = sources::start(
        &config.source,
        sources::SourceInputs {
            objectives: objectives.clone(),
            rewrites: model_rewrites.clone(),
            flag_objectives: config.objectives.clone(),
            file_rewrites: config.model_rewrites.clone(),
            stepping_down: stepping_down.clone(),
        },
        &datastore,
        &metrics,
        &registry,
        &mut supervisor,
        &background,
    )
    .await?;

    // Loading tokenizers parses multi-megabyte JSON: keep it off the async workers.
    let tokenizer_config = config.tokenizers.clone();
    let tokenizer_registry = registry.clone();
    let tokenizers = Arc::new(
        tokio::task::spawn_blocking(move || Tokenizers::new(tokenizer_config, &tokenizer_registry))
            .await
            .map_err(|e| ServeError::Server {
                server: "tokenizer loading",
                message: e.to_string(),
            })??,
    );
    // NOTE: prefix homes cost every routing record a few map writes: kept only when a
    // scorer reads them.
    let defaults = IndexConfig::default();
    let index_config = IndexConfig {
        max_prefix_home_keys: if config.picker.scheduler.reads_prefix_homes() {
            defaults.max_prefix_home_keys
        } else {
            0
        },
        ..defaults
    };
    let index = Arc::new(PrefixIndex::with_registry(index_config, &registry)?);
    let kv_events = Arc::new(KvEventsManager::new(
        Arc::clone(&index),
        config.kv_events.clone(),
        &registry,
    )?);
    if let Some(endpoint) = &config.kv_events_bind {
        let bound = kv_events.bind_central(endpoint).await?;
        tracing::info!(%bound, "accepting KV events from pods that dial in");
    }
    // Before the exchange, which reuses the ext-proc port's certificate.
    let ext_tls = ext_proc_tls(&config, &registry, &background)?;
    if let Some(replica) = &config.replica {
        let parts = crate::replica::ReplicaParts {
            index: Arc::clone(&index),
            datastore: Arc::clone(&datastore),
            registry: registry.clone(),
            tls: ext_tls
                .as_ref()
                .map(|(_, metrics, resolver)| (Arc::clone(resolver), metrics.clone())),
        };
        let started = crate::replica::start(replica, parts, &background).await?;
        for (name, task) in started.tasks {
            supervisor.spawn(name, Policy::RESTART, task);
        }
    }
    let metrics_store = Arc::new(MetricsStore::default());
    for warning in &config.picker.warnings {
        tracing::warn!(%warning, "scheduler config");
    }
    for warning in &config.flag_warnings {
        tracing::warn!(%warning, "flags");
    }
    let scheduler = Arc::new(
        ConfiguredScheduler::new(
            config.picker.scheduler.clone(),
            SchedulerDeps {
                index: Arc::clone(&index),
                metrics: Arc::clone(&metrics_store) as Arc<dyn MetricsSource>,
            },
            config.max_fallbacks,
        )
        .with_plugin_metrics(&registry)?
        .with_score_trace(config.emit_endpoint_scores),
    );
    let prefill_profile = match &config.picker.scheduler.handler {
        crate::scheduling::ProfileHandlerSpec::Single => None,
        crate::scheduling::ProfileHandlerSpec::PrefillDecode(pd) => {
            Some(pd.prefill.profile_name.as_str())
        }
    };
    tracing::info!(profile = %config.picker.scheduler.profile_name, prefill_profile, flow_control = config.picker.scheduler.flow_control, emit_endpoint_scores = config.emit_endpoint_scores, "scheduler ready");
    let admission = Arc::new(admission(
        &scheduler,
        config.picker.scheduler.flow_control,
        &config.pool_name,
        &datastore,
        &mut supervisor,
        &background,
    ));
    supervisor.spawn(
        "pool-follower",
        Policy::RESTART,
        subsystems::pool_follower(
            subsystems::FollowerParts {
                datastore: Arc::clone(&datastore),
                kv_events: Arc::clone(&kv_events),
                scrape: config.scrape.clone(),
                store: Arc::clone(&metrics_store),
                scrape_metrics: ScrapeMetrics::new(&registry)?,
                index: Arc::clone(&index),
            },
            background.clone(),
        ),
    );
    supervisor.spawn(
        "liveness",
        Policy::RESTART,
        subsystems::liveness(
            Arc::clone(&datastore),
            Arc::clone(&metrics_store),
            Arc::clone(&kv_events),
            Arc::clone(&metrics),
            config.scrape.interval,
            background.clone(),
        ),
    );
    subsystems::supervise_kv_events(&mut supervisor, &kv_events, &background);
    tokio::spawn(trim_memory(Arc::clone(&tokenizers), background.clone()));

    let tls = ext_tls.map(|(server, metrics, _)| (server, metrics));
    let grpc_listener = bind(config.grpc_addr).await?;
    let health_listener = bind(config.health_addr).await?;
    let metrics_listener = bind(config.metrics_addr).await?;
    let debug_listener = bind(config.debug_addr).await?;
    tracing::info!(
        grpc = %local(&grpc_listener),
        health = %local(&health_listener),
        metrics = %local(&metrics_listener),
        debug = %local(&debug_listener),
        extproc_threads = config.extproc_threads,
        background_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        metrics_auth = config.metrics_bearer_token.is_some(),
        "kvpick listening"
    );

    let (reporter, health_service) = health::reporter().await;
    let health_server = tokio::spawn({
        let cancel = background.clone();
        tonic::transport::Server::builder()
            .add_service(health_service)
            .serve_with_incoming_shutdown(incoming(health_listener), cancel.cancelled_owned())
    });
    let admin_state = admin::AdminState {
        registry: registry.clone(),
        datastore: Arc::clone(&datastore),
        metrics: Arc::clone(&metrics),
        kv_events: Arc::clone(&kv_events),
        index: Arc::clone(&index),
        tokenizers: Arc::clone(&tokenizers),
        scrapes: Arc::clone(&metrics_store),
        staleness: config.scrape.staleness,
        pool_name: config.pool_name.clone(),
        model_rewrites: model_rewrites.clone(),
        scheduler: Arc::clone(&scheduler),
        admission: Arc::clone(&admission),
    };
    let auth = crate::admin::auth::AuthState {
        token: config.metrics_bearer_token.clone(),
        refused: metrics.admin_unauthorized.clone(),
    };
    let admin_server = tokio::spawn({
        let cancel = background.clone();
        let router = admin::metrics_router(admin_state.clone(), auth.clone());
        async move {
            axum::serve(metrics_listener, router)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await
        }
    });
    let debug_server = tokio::spawn({
        let cancel = background.clone();
        let router = admin::debug_router(admin_state, auth);
        async move {
            axum::serve(debug_listener, router)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await
        }
    });

    let ctx = Arc::new(StreamContext {
        datastore: Arc::clone(&datastore),
        scheduler: Arc::clone(&scheduler) as _,
        tokenizers: Arc::clone(&tokenizers),
        model_rewrites,
        objectives,
        admission: Arc::clone(&admission),
        metrics: Arc::clone(&metrics),
        body_budget: Arc::new(BodyBudget::new(
            config.max_buffered_bytes,
            config.max_body_bytes,
        )),
        max_body_bytes: config.max_body_bytes,
        timeouts: config.stream_timeouts,
        conformance_hooks: config.conformance_hooks,
        endpoint_subset_filter: config.endpoint_subset_filter,
    });
    // The same bound per HTTP/2 connection keeps one client from opening more h2 streams
    // than the service would take, before the service even sees them.
    let h2_streams = u32::try_from(config.max_extproc_streams).unwrap_or(u32::MAX);
    let drain = CancellationToken::new();
    let mut grpc_server = tokio::spawn(extproc_server::serve(
        grpc_listener,
        ExtProcService::new(ctx)
            .with_max_streams(config.max_extproc_streams)
            .into_server(config.grpc_message_limits),
        extproc_server::Settings {
            threads: config.extproc_threads,
            max_streams: h2_streams,
            tls,
        },
        drain.clone(),
    ));
    let ready_now = |healthy: bool, source: &watch::Receiver<crate::discovery::kube::Readiness>| {
        healthy && datastore.is_synced() && source.borrow().is_ok()
    };
    health::set_ready(&reporter, ready_now(true, &source_ready)).await;

    let ended = {
        let mut healthy = supervisor.healthy();
        let supervision = supervisor.run();
        tokio::pin!(supervision, shutdown);
        loop {
            tokio::select! {
                joined = &mut grpc_server => break Ended::Server(joined),
                () = &mut shutdown => break Ended::Signal,
                failed = &mut supervision => break Ended::Subsystem(failed),
                Ok(()) = healthy.changed() => {
                    let ready = ready_now(*healthy.borrow_and_update(), &source_ready);
                    health::set_ready(&reporter, ready).await;
                }
                Ok(()) = source_ready.changed() => {
                    source_ready.borrow_and_update();
                    let ready = ready_now(*healthy.borrow(), &source_ready);
                    health::set_ready(&reporter, ready).await;
                }
            }
        }
    };
    let result = match ended {
        Ended::Server(joined) => flatten("ext-proc", joined),
        Ended::Signal => {
            health::set_ready(&reporter, false).await;
            stepping_down.cancel();
            wind_down(&mut grpc_server, &drain, &config).await
        }
        Ended::Subsystem(failed) => {
            // Readiness is already off; in-flight and arriving requests still get served.
            tracing::error!(%failed, "shutting down: a subsystem failed for good");
            health::set_ready(&reporter, false).await;
            stepping_down.cancel();
            if let Err(error) = wind_down(&mut grpc_server, &drain, &config).await {
                tracing::error!(%error, "while shutting down");
            }
            Err(failed.into())
        }
    };
    stepping_down.cancel();
    background.cancel();
    kv_events.shutdown();
    supervisor.stop(SUBSYSTEM_STOP_TIMEOUT).await;
    let _ = health_server.await;
    let _ = admin_server.await;
    let _ = debug_server.await;
    tracing::info!("kvpick stopped");
    result
}

type GrpcServer = tokio::task::JoinHandle<std::io::Result<()>>;

/// How long the subsystems may take to see the cancellation before they are aborted.
const SUBSYSTEM_STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why `serve` stops.
enum Ended {
    /// The ext-proc server ended by itself (an error).
    Server(Result<std::io::Result<()>, tokio::task::JoinError>),
    /// SIGTERM/SIGINT (the `shutdown` future).
    Signal,
    /// A subsystem failed for good.
    Subsystem(SubsystemFailed),
}

/// With readiness already off: keeps accepting streams for the grace period (the gateway
/// notices NOT_SERVING only at its next health check and sends streams until then), then
/// stops accepting and lets open streams finish within the drain timeout.
async fn wind_down(
    grpc_server: &mut GrpcServer,
    drain: &CancellationToken,
    config: &ServeConfig,
) -> Result<(), ServeError> {
    tracing::info!(grace = ?config.shutdown_grace_period, "shutting down: readiness off, still accepting streams");
    tokio::select! {
        joined = &mut *grpc_server => return flatten("ext-proc", joined),
        () = tokio::time::sleep(config.shutdown_grace_period) => {}
    }
    tracing::info!(timeout = ?config.drain_timeout, "grace period over: no new streams, draining");
    drain.cancel();
    match tokio::time::timeout(config.drain_timeout, &mut *grpc_server).await {
        Ok(joined) => flatten("ext-proc", joined),
        Err(_) => {
            tracing::warn!("drain timeout reached; closing the remaining streams");
            grpc_server.abort();
            Ok(())
        }
    }
}

/// Returns memory freed by large preparations to the OS, once a second at most
/// ([`crate::tokenize::PrepareGate::trim_if_due`]).
async fn trim_memory(tokenizers: Arc<Tokenizers>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let tokenizers = Arc::clone(&tokenizers);
        let _ = tokio::task::spawn_blocking(move || tokenizers.gate().trim_if_due()).await;
    }
}

/// How often flow control re-checks capacity for queued requests.
const FLOW_DISPATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

/// Shedding always; flow control when its feature gate is on.
fn admission(
    scheduler: &ConfiguredScheduler,
    flow_control: bool,
    pool_name: &str,
    datastore: &Arc<Datastore>,
    supervisor: &mut Supervisor,
    background: &CancellationToken,
) -> Admission {
    let detector = scheduler.saturation_detector().clone();
    let flow = flow_control.then(|| {
        let (detector, datastore) = (detector.clone(), Arc::clone(datastore));
        let flow = FlowController::new(FlowControlConfig::default(), move |pending| {
            detector.has_capacity(&datastore.snapshot().endpoints, pending)
        });
        supervisor.spawn(
            "flow-dispatcher",
            Policy::RESTART,
            subsystems::flow_dispatcher(flow.clone(), FLOW_DISPATCH_INTERVAL, background.clone()),
        );
        flow
    });
    Admission {
        detector,
        flow,
        pool_name: pool_name.to_owned(),
    }
}

fn local(listener: &TcpListener) -> String {
    listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

/// Accepted connections with Nagle's algorithm off: ext-proc replies are small messages on a
/// latency-critical path, and Nagle plus delayed ACKs would hold some of them for 40 ms.
/// The ext-proc port's TLS (`--secure-serving`): the first certificate, and with
/// `--enable-cert-reload` the task that swaps in changed files.
/// The ext-proc port's TLS: its server config, handshake metrics and certificate.
type ExtProcTls = (
    Arc<rustls::ServerConfig>,
    crate::tls::TlsMetrics,
    Arc<crate::tls::CertResolver>,
);

fn ext_proc_tls(
    config: &ServeConfig,
    registry: &prometheus::Registry,
    background: &CancellationToken,
) -> Result<Option<ExtProcTls>, ServeError> {
    let Some(tls) = &config.tls else {
        return Ok(None);
    };
    let metrics = crate::tls::TlsMetrics::new(registry)?;
    let resolver = Arc::new(crate::tls::CertResolver::new(crate::tls::initial_pair(
        tls,
    )?));
    match (&tls.cert_path, tls.reload) {
        (Some(dir), true) => {
            tracing::info!(dir = %dir.display(), "ext-proc serves TLS; certificate reloaded when its files change");
            tokio::spawn(crate::tls::reload::watch_files(
                dir.clone(),
                Arc::clone(&resolver),
                metrics.reloads.clone(),
                background.clone(),
            ));
        }
        (Some(dir), false) => tracing::info!(dir = %dir.display(), "ext-proc serves TLS"),
        (None, _) => tracing::info!("ext-proc serves TLS with a self-signed certificate"),
    }
    Ok(Some((
        crate::tls::server_config(Arc::clone(&resolver), tls.tls13_only)?,
        metrics,
        resolver,
    )))
}

fn incoming(
    listener: TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use futures::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}

fn flatten<E: std::fmt::Display>(
    server: &'static str,
    joined: Result<Result<(), E>, tokio::task::JoinError>,
) -> Result<(), ServeError> {
    match joined {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(ServeError::Server {
            server,
            message: error.to_string(),
        }),
        Err(error) => Err(ServeError::Server {
            server,
            message: error.to_string(),
        }),
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = terminate => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}
