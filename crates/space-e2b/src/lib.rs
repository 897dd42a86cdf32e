//! An E2B-compatible surface over the platform, so the unmodified `e2b`
//! SDK drives SPACE with three environment variables:
//! `E2B_API_URL=<server>/e2b`, `E2B_SANDBOX_URL=<server>/e2b/envd` and
//! `E2B_API_KEY=<a SPACE key>`.
//!
//! It is an adapter, like a second router: an E2B sandbox *is* a SPACE
//! sandbox (same id, same tenant, visible in both APIs), and every call
//! goes through the same platform methods as SPACE's own handlers.
//! - `control`: E2B's REST control plane (`/e2b/v2/sandboxes`, ...),
//!   authenticated with `X-API-KEY`, answering synchronously where E2B
//!   does (create, kill, pause, connect wait for their operation);
//!   `network`: its network rules as SPACE's egress policy; `snapshots`:
//!   its fork and snapshots over SPACE's fork and snapshot templates.
//! - `envd`: the in-sandbox API E2B's SDK talks to (`/e2b/envd/...`,
//!   routed by the `E2b-Sandbox-Id` header, authenticated with the
//!   sandbox's `X-Access-Token`): Connect RPCs for processes and the
//!   filesystem, `/files` and `/health`.
//! - `interpreter`: what E2B's code interpreter adds on port 49999 of the
//!   same URL (`/execute`, `/contexts`), over SPACE's code contexts.
//!
//! The wire format is described in `docs/decisions/008-e2b-compatibility.md`.
//!
//! It is a crate of its own over the runtime (`space-node`) and the edge's
//! generic parts (`space-http`), and knows nothing of the server that mounts
//! it: the host gives it the platform, its rule for who an E2B control
//! request is from, and whether its engine can run sandboxes ([`E2bState`]).

// E2B's routes load each sandbox for the caller themselves (`owned` in
// control.rs; envd's routes by the sandbox's own token, `target.rs`), so
// they read path parameters as text; clippy refuses that elsewhere.
#![allow(clippy::disallowed_types)]

mod connect;
mod control;
mod envd;
pub mod error;
mod filesystem;
mod interpreter;
mod network;
mod process;
mod snapshots;
pub mod target;
mod watch;
pub mod wire;

use std::sync::Arc;

use axum::http::HeaderMap;
use axum::routing::{any, get, post};
use axum::Router;
// The runtime's modules under the names the adapter's files use.
use space_node::{access, domain, ids, platform, session, store, tenants, transcript};
use space_node::{NodeError, Platform};

pub use self::error::E2bError;
pub use self::target::{envd_token, traffic_token};
pub use self::wire::ENVD_VERSION;

/// Who an E2B control request is from: the host's rule (a SPACE key in
/// `X-API-KEY`; on a cluster's node, the control plane's assertion).
pub type Authenticate = Arc<dyn Fn(&HeaderMap) -> Result<tenants::Caller, NodeError> + Send + Sync>;

/// What the adapter's handlers get from the host that mounts them.
#[derive(Clone)]
pub struct E2bState {
    pub platform: Arc<Platform>,
    pub caller: Authenticate,
    /// Whether the host's default engine can run sandboxes (probed once).
    pub engine_available: bool,
    /// The server's preview domain, E2B's sandbox `domain` (`get_host`).
    pub preview_domain: Option<String>,
}

/// Both E2B surfaces, mounted under `/e2b` on the API's listener.
pub fn router<S: Clone + Send + Sync + 'static>(state: E2bState) -> Router<S> {
    Router::new()
        .route("/e2b/sandboxes", get(control::list).post(control::create))
        .route("/e2b/v2/sandboxes", get(control::list).post(control::create))
        .route("/e2b/sandboxes/{id}", get(control::detail).delete(control::kill))
        .route("/e2b/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/e2b/sandboxes/{id}/pause", post(control::pause))
        .route("/e2b/sandboxes/{id}/connect", post(control::connect))
        .route("/e2b/sandboxes/{id}/resume", post(control::resume))
        .route("/e2b/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/e2b/sandboxes/{id}/metrics", get(control::metrics))
        .route(
            "/e2b/sandboxes/{id}/network",
            axum::routing::put(control::update_network).fallback(control::unsupported),
        )
        .route("/e2b/sandboxes/{id}/fork", post(snapshots::fork))
        .route("/e2b/sandboxes/{id}/snapshots", post(snapshots::create_snapshot))
        .route("/e2b/snapshots", get(snapshots::list_snapshots))
        .route("/e2b/templates/{id}", axum::routing::delete(snapshots::delete_template).fallback(control::unsupported))
        .route("/e2b/envd/health", get(envd::health))
        .route("/e2b/envd/execute", post(interpreter::execute))
        .route("/e2b/envd/contexts", get(interpreter::list).post(interpreter::create))
        .route("/e2b/envd/contexts/{id}", axum::routing::delete(interpreter::delete))
        .route("/e2b/envd/contexts/{id}/restart", post(interpreter::restart))
        .route(
            "/e2b/envd/files",
            get(envd::read_file).post(envd::write_files).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        // Where the SDK's `download_url`/`upload_url` point with
        // `E2B_SANDBOX_URL` set (it joins `/files` to the URL's host):
        // signed URLs only, matched to their sandbox by the signature.
        .route("/files", get(envd::read_file).post(envd::write_files).layer(axum::extract::DefaultBodyLimit::disable()))
        .route(
            "/e2b/envd/{service}/{method}",
            post(envd::rpc).layer(axum::extract::DefaultBodyLimit::max(envd::MAX_RPC_BODY)),
        )
        .route("/e2b/{*rest}", any(control::unsupported))
        .with_state(state)
}
