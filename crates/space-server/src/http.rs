//! The HTTP edge below the router: accepting connections, optional TLS
//! (rustls), and the timeouts that keep slow or idle clients from holding
//! the server (a request head must arrive within [`HEADER_TIMEOUT`], a TLS
//! handshake within [`HANDSHAKE_TIMEOUT`]; heads are capped by hyper at
//! [`MAX_HEADERS`] headers and [`MAX_HEAD_BYTES`] bytes).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio_rustls::rustls;

use crate::{AppState, ServerError};

pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// How long open connections get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);

/// A TLS configuration from PEM files: a certificate chain and its key.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
        ServerError::Startup(format!("{what} {}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad("reading the certificate", cert, &e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("reading the certificate", cert, &e))?;
    if chain.is_empty() {
        return Err(ServerError::Startup(format!("no certificate in {}", cert.display())));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("reading the private key", key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServerError::Startup(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| ServerError::Startup(format!("TLS: the key does not fit the certificate: {e}")))?;
    Ok(Arc::new(config))
}

/// Serves the API on `listener` (over TLS when `tls` is given) until
/// `shutdown` resolves; then open connections get a few seconds to end.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: AppState,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let router = crate::app(state);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEAD_BYTES);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of descriptors and the like: pause instead of spinning.
                    tracing::warn!("accepting a connection: {err}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let (builder, watcher, acceptor) = (builder.clone(), graceful.watcher(), acceptor.clone());
        tokio::spawn(async move {
            let result = match acceptor {
                None => {
                    let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(connection.into_owned()).await
                }
                Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        let connection = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
                        watcher.watch(connection.into_owned()).await
                    }
                    Ok(Err(err)) => Err(format!("TLS handshake: {err}").into()),
                    Err(_) => Err("TLS handshake timed out".into()),
                },
            };
            if let Err(err) = result {
                tracing::debug!("connection ended: {err}");
            }
        });
    }
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    Ok(())
}
