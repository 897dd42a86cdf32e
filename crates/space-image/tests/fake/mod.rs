//! Fake registries on loopback, each answering with a closure of its
//! test's: for what a real registry never does.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::Response;
use sha2::{Digest, Sha256};
use space_testkit::oci_layout::{layer_tar, Member};

/// A one-layer image (a plain tar) held in memory.
pub struct FakeImage {
    pub layer: Vec<u8>,
    pub layer_digest: String,
    pub config: Vec<u8>,
    pub config_digest: String,
    pub manifest: Vec<u8>,
    pub manifest_digest: String,
}

pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

impl FakeImage {
    pub fn new() -> FakeImage {
        let layer = layer_tar(&[Member::file("hello", "from a fake registry")]);
        let layer_digest = digest(&layer);
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux", "config": {"Env": ["FAKE=1"]},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }))
        .unwrap();
        let config_digest = digest(&config);
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer.len()}],
        }))
        .unwrap();
        let manifest_digest = digest(&manifest);
        FakeImage { layer, layer_digest, config, config_digest, manifest, manifest_digest }
    }

    /// The answer a registry holding only this image gives to `path`
    /// (manifests by any tag or by digest, blobs by digest).
    pub fn answer(&self, path: &str) -> Response {
        if path == "/v2/" {
            return respond(StatusCode::OK, "application/json", b"{}".to_vec());
        }
        if path.contains("/manifests/") {
            let reference = path.rsplit('/').next().unwrap_or_default();
            if reference.starts_with("sha256:") && reference != self.manifest_digest {
                return not_found();
            }
            return respond(StatusCode::OK, "application/vnd.oci.image.manifest.v1+json", self.manifest.clone());
        }
        if let Some(digest) = path.rsplit("/blobs/").next().filter(|_| path.contains("/blobs/")) {
            if digest == self.config_digest {
                return respond(StatusCode::OK, "application/octet-stream", self.config.clone());
            }
            if digest == self.layer_digest {
                return respond(StatusCode::OK, "application/octet-stream", self.layer.clone());
            }
        }
        not_found()
    }
}

pub fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response {
    Response::builder().status(status).header(header::CONTENT_TYPE, content_type).body(Body::from(body)).unwrap()
}

pub fn not_found() -> Response {
    respond(
        StatusCode::NOT_FOUND,
        "application/json",
        br#"{"errors":[{"code":"NAME_UNKNOWN","message":"no"}]}"#.to_vec(),
    )
}

/// A server on 127.0.0.1 answering every request with `handler`; stopped
/// when dropped.
pub struct Fake {
    pub addr: SocketAddr,
    /// `127.0.0.1:PORT`
    pub host: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn router(handler: impl Fn(Request) -> Response + Send + Sync + 'static) -> axum::Router {
    let handler = Arc::new(handler);
    axum::Router::new().fallback(move |request: Request| {
        let handler = handler.clone();
        async move { handler(request) }
    })
}

pub async fn serve(handler: impl Fn(Request) -> Response + Send + Sync + 'static) -> Fake {
    let app = router(handler);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding 127.0.0.1:0");
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Fake { addr, host: addr.to_string(), task }
}

/// Like [`serve`], over TLS with `tls`'s certificate.
pub async fn serve_tls(
    tls: Arc<tokio_rustls::rustls::ServerConfig>,
    handler: impl Fn(Request) -> Response + Send + Sync + 'static,
) -> Fake {
    let app = router(handler);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding 127.0.0.1:0");
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                // A client that refuses the certificate ends the handshake.
                let Ok(stream) = acceptor.accept(tcp).await else { return };
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Fake { addr, host: addr.to_string(), task }
}
