//! The HTTP server below a router: accepting connections, optional TLS
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

pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Requests an HTTP/2 connection may have open at once.
pub const MAX_STREAMS: u32 = 128;
/// How long open connections get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);

/// The connection an HTTP/1.1 request came on, in its extensions: a
/// handler whose answer breaks off because what it relayed went away (a
/// sandbox killed under a stream) calls [`ResetOnClose::arm`], and the
/// connection then ends with a reset instead of an orderly close, as a
/// connection to that peer itself would — which clients tell apart from a
/// clean end. It holds a duplicate of the socket's descriptor, so it never
/// touches another socket that reuses the number.
#[derive(Debug, Clone)]
pub struct ResetOnClose(Arc<std::os::fd::OwnedFd>);

impl ResetOnClose {
    fn of(socket: &impl std::os::fd::AsFd) -> Option<ResetOnClose> {
        socket.as_fd().try_clone_to_owned().ok().map(|fd| ResetOnClose(Arc::new(fd)))
    }

    /// The connection's close becomes a reset (`SO_LINGER` 0): what it
    /// had not sent yet is dropped.
    pub fn arm(&self) {
        let linger = nix::libc::linger { l_onoff: 1, l_linger: 0 };
        if let Err(err) = nix::sys::socket::setsockopt(&*self.0, nix::sys::socket::sockopt::Linger, &linger) {
            tracing::debug!("arming a connection's reset: {err}");
        }
    }
}

/// `router` for one connection: HTTP/1.1's requests carry the
/// connection's [`ResetOnClose`] (an HTTP/2 connection carries many
/// requests, which a reset would all end).
fn for_connection(router: &axum::Router, reset: Option<ResetOnClose>) -> axum::Router {
    match reset {
        Some(reset) => router.clone().layer(axum::Extension(reset)),
        None => router.clone(),
    }
}

/// Why a TLS configuration could not be made from its files.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(pub String);

/// A TLS configuration from PEM files: a certificate chain and its key.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::PrivateKeyDer;
    let bad = |what: &str, path: &Path, e: &dyn std::fmt::Display| TlsError(format!("{what} {}: {e}", path.display()));
    let chain = certificates(cert)?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("reading the private key", key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| TlsError(format!("TLS: the key does not fit the certificate: {e}")))?;
    // HTTP/2 for clients that offer it (browsers on previews), else 1.1.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The certificates of a PEM file (at least one).
fn certificates(path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let bad = |e: &dyn std::fmt::Display| TlsError(format!("reading {}: {e}", path.display()));
    let chain = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(&e))?;
    if chain.is_empty() {
        return Err(TlsError(format!("no certificate in {}", path.display())));
    }
    Ok(chain)
}

/// TLS between the members of a cluster: each has a certificate signed by
/// the cluster's CA, serves with it while asking the other side for one
/// of the same CA (mutual TLS), and presents it when it connects.
pub struct ClusterTls {
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
}

pub fn cluster_tls(ca: &Path, cert: &Path, key: &Path) -> Result<ClusterTls, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let startup = |what: &str, e: &dyn std::fmt::Display| TlsError(format!("cluster TLS: {what}: {e}"));
    let mut roots = rustls::RootCertStore::empty();
    for certificate in certificates(ca)? {
        roots.add(certificate).map_err(|e| startup(&format!("{} holds no CA certificate", ca.display()), &e))?;
    }
    let roots = Arc::new(roots);
    let chain = certificates(cert)?;
    let key_der = rustls::pki_types::PrivateKeyDer::from_pem_file(key)
        .map_err(|e| startup(&format!("reading {}", key.display()), &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| startup("the client verifier", &e))?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| startup("versions", &e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key_der.clone_key())
        .map_err(|e| startup("the key does not fit the certificate", &e))?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| startup("versions", &e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key_der)
        .map_err(|e| startup("the key does not fit the certificate", &e))?;
    Ok(ClusterTls { server: Arc::new(server), client: Arc::new(client) })
}

/// Serves `router` on `listener` (over TLS when `tls` is given) until
/// `shutdown` resolves; then open connections get a few seconds to end.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = GracefulShutdown::new();
    // HTTP/1.1, and HTTP/2 (by ALPN over TLS, by its preface in clear
    // text, each decided before a builder sees the connection, so the head
    // timeouts hold from its first byte); a WebSocket upgrade is 1.1's.
    let mut http1 = auto::Builder::new(TokioExecutor::new()).http1_only();
    http1
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEAD_BYTES);
    let mut http2 = auto::Builder::new(TokioExecutor::new()).http2_only();
    http2
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32)
        .max_concurrent_streams(MAX_STREAMS)
        .keep_alive_interval(Some(HEADER_TIMEOUT))
        .keep_alive_timeout(HEADER_TIMEOUT);
    let builders = Arc::new((http1, http2));
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
        let (router, reset) = (router.clone(), ResetOnClose::of(&stream));
        let (builders, watcher, acceptor) = (builders.clone(), graceful.watcher(), acceptor.clone());
        tokio::spawn(async move {
            let (http1, http2) = &*builders;
            let result = match acceptor {
                None => match cleartext_http2(&stream).await {
                    Some(h2) => {
                        let builder = if h2 { http2 } else { http1 };
                        let service = TowerToHyperService::new(for_connection(&router, reset.filter(|_| !h2)));
                        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                        watcher.watch(connection.into_owned()).await
                    }
                    None => Err("no request head in time".into()),
                },
                Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
                        let builder = if h2 { http2 } else { http1 };
                        let service = TowerToHyperService::new(for_connection(&router, reset.filter(|_| !h2)));
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
}

/// Whether a clear-text connection opens with HTTP/2's preface (prior
/// knowledge) rather than an HTTP/1.1 head, looked at without reading it;
/// `None` when it sends neither within [`HEADER_TIMEOUT`], or closes.
async fn cleartext_http2(stream: &tokio::net::TcpStream) -> Option<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let deadline = tokio::time::Instant::now() + HEADER_TIMEOUT;
    let mut buf = [0u8; PREFACE.len()];
    loop {
        let seen = tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await.ok()?.ok()?;
        if seen == 0 {
            return None;
        }
        if buf[..seen] != PREFACE[..seen] {
            return Some(false);
        }
        if seen == PREFACE.len() {
            return Some(true);
        }
        // Part of the preface so far: the rest is on its way, or the
        // deadline comes first (peeking what is there returns at once).
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A request body that notes when it has been read to its end.
struct Watched {
    inner: axum::body::Body,
    read: Arc<std::sync::atomic::AtomicBool>,
}

impl hyper::body::Body for Watched {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(None) = polled {
            self.read.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Answers a request whose body was not read to its end (an error before
/// the body was needed, say) with `Connection: close`: the connection
/// cannot carry another request then, and a client that is not told so
/// may send its next request on it as it closes.
pub async fn close_if_body_unread(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use hyper::body::Body as _;
    if request.body().is_end_stream() {
        return next.run(request).await;
    }
    let read = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let request = request.map(|inner| axum::body::Body::new(Watched { inner, read: read.clone() }));
    let mut response = next.run(request).await;
    if !read.load(std::sync::atomic::Ordering::Relaxed) && !response.status().is_informational() {
        response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    }
    response
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;
    use std::io::Write as _;

    use axum::body::Body;
    use axum::routing::get;
    use futures_util::StreamExt as _;

    use super::*;

    type Go = Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>;

    /// A server whose one route sends a first chunk, then, once `go` says
    /// so (the client read it), breaks off, its connection armed to reset
    /// first when `reset` says so.
    async fn breaking_server(reset: bool, go: Go) -> std::net::SocketAddr {
        let route = move |armed: Option<axum::Extension<ResetOnClose>>| async move {
            let armed = armed.map(|axum::Extension(armed)| armed);
            let go = go.lock().unwrap().take();
            let first = futures_util::stream::iter([Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"first"))]);
            let broken = futures_util::stream::once(async move {
                if let Some(go) = go {
                    let _ = go.await;
                }
                if let (Some(armed), true) = (&armed, reset) {
                    armed.arm();
                }
                Err(std::io::Error::other("the source went away"))
            });
            Body::from_stream(first.chain(broken))
        };
        let router = axum::Router::new().route("/", get(route));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, router, None, std::future::pending()));
        address
    }

    /// What a client reads of the answer: its bytes, and how the
    /// connection ended (an error kind, or `None` for an orderly close);
    /// `go` once the first chunk came.
    fn read_all(
        address: std::net::SocketAddr,
        go: tokio::sync::oneshot::Sender<()>,
    ) -> (String, Option<std::io::ErrorKind>) {
        let mut client = std::net::TcpStream::connect(address).unwrap();
        client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        client.write_all(b"GET / HTTP/1.1\r\nHost: x.test\r\n\r\n").unwrap();
        let (mut read, mut buffer, mut go) = (Vec::new(), [0u8; 4096], Some(go));
        loop {
            match client.read(&mut buffer) {
                Ok(0) => return (String::from_utf8_lossy(&read).into_owned(), None),
                Ok(n) => read.extend_from_slice(&buffer[..n]),
                Err(err) => return (String::from_utf8_lossy(&read).into_owned(), Some(err.kind())),
            }
            if String::from_utf8_lossy(&read).contains("first") {
                if let Some(go) = go.take() {
                    let _ = go.send(());
                }
            }
        }
    }

    async fn ending(reset: bool) -> (String, Option<std::io::ErrorKind>) {
        let (go, wait) = tokio::sync::oneshot::channel();
        let address = breaking_server(reset, Arc::new(std::sync::Mutex::new(Some(wait)))).await;
        tokio::task::spawn_blocking(move || read_all(address, go)).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_armed_connection_ends_with_a_reset_and_another_with_an_orderly_close() {
        let (read, ended) = ending(true).await;
        assert!(read.contains("first"), "the first chunk came: {read:?}");
        assert_eq!(ended, Some(std::io::ErrorKind::ConnectionReset), "{read:?}");
        let (read, ended) = ending(false).await;
        assert!(read.contains("first"), "{read:?}");
        assert_eq!(ended, None, "not armed: an orderly close");
    }
}
