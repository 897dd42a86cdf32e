//! How the members of a cluster reach each other: a node pulling a template
//! from another, the control plane forwarding to a node. Plain HTTP, or
//! HTTPS with the member's certificate; free connections kept a moment for
//! the next request.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use hyper_util::rt::TokioIo;

/// Why reaching another member of the cluster failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{url:?}: {source}")]
    BadUrl {
        url: String,
        #[source]
        source: axum::http::uri::InvalidUri,
    },
    #[error("{0:?} is not http://host:port or https://host:port")]
    NotAMemberUrl(String),
    #[error("its host is not a header value: {0}")]
    Host(#[source] axum::http::header::InvalidHeaderValue),
    #[error("connecting: {0}")]
    Connect(#[source] std::io::Error),
    #[error("{0} is HTTPS: this member needs the cluster's TLS (--cluster-ca)")]
    NoTls(String),
    #[error("its host is not a TLS server name: {0}")]
    ServerName(#[source] tokio_rustls::rustls::pki_types::InvalidDnsNameError),
    #[error("the TLS handshake took too long")]
    TlsTimeout,
    #[error("TLS: {0}")]
    Tls(#[source] std::io::Error),
    #[error(transparent)]
    Relay(#[from] crate::proxy::RelayError),
}

impl From<hyper::Error> for LinkError {
    fn from(err: hyper::Error) -> LinkError {
        LinkError::Relay(err.into())
    }
}

/// How the members of a cluster reach each other: plain HTTP, or (given
/// the cluster's TLS) HTTPS with this member's certificate.
#[derive(Clone, Default)]
pub struct Links {
    tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
    /// Connections to other members that are free again, by URL.
    idle: Arc<std::sync::Mutex<std::collections::HashMap<String, Vec<IdleConnection>>>>,
}

struct IdleConnection {
    since: std::time::Instant,
    sender: hyper::client::conn::http1::SendRequest<Body>,
}

/// How long a free connection is kept for the next request (less than the
/// [`crate::server::HEADER_TIMEOUT`] after which a member closes it).
const IDLE_FOR: Duration = Duration::from_secs(4);
/// Free connections kept per member.
const IDLE_PER_MEMBER: usize = 32;

/// Whether `url` is `http://host:port` or `https://host:port`, and its
/// `host:port`.
pub fn member_url(url: &str) -> Result<(bool, axum::http::uri::Authority), LinkError> {
    let uri: axum::http::Uri = url.parse().map_err(|source| LinkError::BadUrl { url: url.to_string(), source })?;
    match (uri.scheme_str(), uri.authority()) {
        (Some(scheme @ ("http" | "https")), Some(authority)) if authority.port().is_some() => {
            Ok((scheme == "https", authority.clone()))
        }
        _ => Err(LinkError::NotAMemberUrl(url.to_string())),
    }
}

impl Links {
    pub fn new(tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>) -> Links {
        Links { tls, idle: Default::default() }
    }

    /// Sends `request` (its target a path) to the member at `url`, and its
    /// answer back as a stream (an upgrade spliced to `upgrade`): over a
    /// connection left free by an earlier request, or a new one (always
    /// for an upgrade, which takes the connection over).
    pub async fn send(
        &self,
        url: &str,
        mut request: hyper::Request<Body>,
        upgrade: Option<hyper::upgrade::OnUpgrade>,
    ) -> Result<Response, LinkError> {
        let (https, authority) = member_url(url)?;
        let host = HeaderValue::from_str(authority.as_str()).map_err(LinkError::Host)?;
        request.headers_mut().insert(header::HOST, host);
        if upgrade.is_none() {
            while let Some(mut sender) = self.free_connection(url) {
                match sender.try_send_request(request).await {
                    Ok(response) => {
                        self.keep(url, sender);
                        return Ok(crate::proxy::answer(response, None)?);
                    }
                    // Closed before it took the request: another one.
                    Err(mut failed) => match failed.take_message() {
                        Some(unsent) => request = unsent,
                        None => return Err(failed.into_error().into()),
                    },
                }
            }
        }
        let mut sender = self.connect(https, &authority, url).await?;
        let response = sender.send_request(request).await?;
        if upgrade.is_none() {
            self.keep(url, sender);
        }
        Ok(crate::proxy::answer(response, upgrade)?)
    }

    /// A free connection to `url` that is neither stale nor closed.
    fn free_connection(&self, url: &str) -> Option<hyper::client::conn::http1::SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let free = idle.get_mut(url)?;
        while let Some(connection) = free.pop() {
            if connection.since.elapsed() < IDLE_FOR && !connection.sender.is_closed() {
                return Some(connection.sender);
            }
        }
        None
    }

    /// Keeps a connection for the next request once it is free again (its
    /// answer read to the end); a long stream's connection is let go.
    fn keep(&self, url: &str, mut sender: hyper::client::conn::http1::SendRequest<Body>) {
        let (idle, url) = (self.idle.clone(), url.to_string());
        tokio::spawn(async move {
            if !matches!(tokio::time::timeout(IDLE_FOR, sender.ready()).await, Ok(Ok(()))) {
                return;
            }
            let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
            let free = idle.entry(url).or_default();
            free.retain(|c| c.since.elapsed() < IDLE_FOR && !c.sender.is_closed());
            if free.len() < IDLE_PER_MEMBER {
                free.push(IdleConnection { since: std::time::Instant::now(), sender });
            }
        });
    }

    /// A new connection to the member at `authority` (TLS when `https`).
    async fn connect(
        &self,
        https: bool,
        authority: &axum::http::uri::Authority,
        url: &str,
    ) -> Result<hyper::client::conn::http1::SendRequest<Body>, LinkError> {
        let tcp = tokio::net::TcpStream::connect(authority.as_str()).await.map_err(LinkError::Connect)?;
        let _ = tcp.set_nodelay(true);
        if !https {
            return Ok(crate::proxy::http1(TokioIo::new(tcp)).await?);
        }
        let Some(config) = &self.tls else {
            return Err(LinkError::NoTls(url.to_string()));
        };
        let name = tokio_rustls::rustls::pki_types::ServerName::try_from(
            authority.host().trim_start_matches('[').trim_end_matches(']').to_string(),
        )
        .map_err(LinkError::ServerName)?;
        let tls = tokio::time::timeout(
            crate::server::HANDSHAKE_TIMEOUT,
            tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp),
        )
        .await
        .map_err(|_| LinkError::TlsTimeout)?
        .map_err(LinkError::Tls)?;
        Ok(crate::proxy::http1(TokioIo::new(tls)).await?)
    }
}
