//! The SPACE server: the HTTP edge of a node (the `/v1` API, the E2B
//! adapter, the console from `space-http`, a cluster node's internal
//! routes) over the runtime in `space-node`. A cluster's control plane is
//! `space-control`, which links none of this.
//!
//! `app` builds the router, separate from `serve`, so tests drive the real
//! API over a real socket against real sandboxes.

pub mod api;
// Internal routes with the node token; a node's template by name.
#[allow(clippy::disallowed_types)]
pub mod cluster;
mod disk_quota;
pub mod error;
mod host_facts;
pub mod http;
pub mod preview;
mod router;
pub mod state;

// The runtime's modules under their former paths, for the server's own
// modules and its users.
pub use space_e2b as e2b;
pub use space_node::{
    access, actor, adoption, capacity, checkpoints, commands, contexts, disk, domain, egress, engine_report, engines,
    firecracker_config, idle, ids, lifecycle, metrics, platform, policies, recovery, sampling, secrets, session,
    start_platform, start_platform_with, start_platform_with_helper, store, templates, tenants, transcript, warm,
    EngineChoice, Platform, PlatformConfig, UnknownEngine, DEFAULT_AUTO_PAUSE_S, DEFAULT_LAYER_CACHE_MIB,
};

pub use router::app;
pub use state::AppState;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Start(#[from] space_node::StartError),
    #[error("{0}")]
    Startup(String),
}

/// Serves the API on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    http::serve_with(listener, state, None, shutdown).await
}
