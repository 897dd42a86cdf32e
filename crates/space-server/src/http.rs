//! Serving the API: the server loop, TLS and timeouts are
//! `space_http::server`'s (re-exported here under their former paths).

use std::sync::Arc;

use tokio_rustls::rustls;

pub use space_http::server::{
    cluster_tls, tls_config, ClusterTls, TlsError, HANDSHAKE_TIMEOUT, HEADER_TIMEOUT, MAX_HEADERS, MAX_HEAD_BYTES,
};

use crate::state::AppState;
use crate::ServerError;

impl From<TlsError> for ServerError {
    fn from(err: TlsError) -> ServerError {
        ServerError::Startup(err.0)
    }
}

/// Serves the API on `listener` (over TLS when `tls` is given) until
/// `shutdown` resolves; then open connections get a few seconds to end.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: AppState,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    serve_router(listener, crate::router::app(state), tls, shutdown).await
}

/// [`serve_with`] for any router (a cluster's control plane has its own).
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    space_http::server::serve(listener, router, tls, shutdown).await;
    Ok(())
}
