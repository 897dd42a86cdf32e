//! A node's side of a cluster (decision 009): what it reports to the
//! control plane with every heartbeat, and its internal routes, which only
//! the control plane (or another node) reaches with the cluster's node
//! token — its event feed, the cluster's secrets, a template's export and a
//! pull from another node. The control plane itself is `space-control`;
//! the messages both sides read are `space_api::cluster`'s.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use space_api::cluster::{FeedQuery, HEARTBEAT_PATH, TEMPLATE_META_HEADER, TEMPLATE_SHA256_HEADER};
use space_api::ErrorCode;
use space_http::links::LinkError;

use crate::error::ApiError;
use crate::platform::Platform;
use crate::state::AppState;

// The cluster's messages and how members reach each other, under their
// former paths.
pub use space_api::cluster::{NodeReport, PullRequest, TemplateSize, HEARTBEAT, LEASE};
pub use space_http::links::Links;

// ---- what a node reports -----------------------------------------------------

/// What this node would report now.
pub fn report(platform: &Platform, id: &str, url: &str) -> NodeReport {
    let templates = platform.data().templates();
    NodeReport {
        id: id.to_string(),
        url: url.to_string(),
        engine: platform.engine_name().to_string(),
        capacity_mib: platform.capacity_mib(),
        promised_mib: platform.reserved_mib(),
        templates: templates.iter().map(|t| t.meta.name.clone()).collect(),
        sandboxes: platform.held_sandbox_ids().unwrap_or_default(),
        secrets_epoch: platform.secrets_epoch(),
        engines: platform.engine_report().iter().filter(|e| e.available).map(|e| e.name.to_string()).collect(),
        pinned: templates.iter().filter_map(|t| Some((t.meta.name.clone(), t.meta.engine.clone()?))).collect(),
        local: templates.iter().filter(|t| t.meta.image.is_some()).map(|t| t.meta.name.clone()).collect(),
        sizes: templates
            .iter()
            .map(|t| {
                let size = TemplateSize { vcpus: t.meta.defaults.vcpus, memory_mib: t.meta.defaults.memory_mib };
                (t.meta.name.clone(), size)
            })
            .collect(),
        volume_store: platform.volume_store(),
    }
}

/// Reports to the control plane every [`HEARTBEAT`], for as long as the
/// node runs. `control_plane` may name several replicas (comma-separated):
/// one that does not answer is passed over for the next.
pub async fn heartbeats(
    platform: Arc<Platform>,
    links: Links,
    control_plane: String,
    token: String,
    id: String,
    url: String,
) {
    let replicas: Vec<String> =
        control_plane.split(',').map(str::trim).filter(|r| !r.is_empty()).map(str::to_string).collect();
    let mut current = 0;
    loop {
        let report = report(&platform, &id, &url);
        for attempt in 0..replicas.len() {
            let replica = &replicas[(current + attempt) % replicas.len()];
            match send_report(&links, replica, &token, &report).await {
                Ok(secrets) => {
                    // The control plane answers with the cluster's secrets
                    // when this node's are older.
                    if let Some(Err(err)) = secrets.map(|set| platform.take_secrets(set)) {
                        tracing::error!("taking the cluster's secrets: {}", err.message);
                    }
                    current = (current + attempt) % replicas.len();
                    break;
                }
                Err(err) => tracing::warn!("reporting to the control plane at {replica}: {err}"),
            }
        }
        tokio::time::sleep(HEARTBEAT).await;
    }
}

async fn send_report(
    links: &Links,
    control_plane: &str,
    token: &str,
    report: &NodeReport,
) -> Result<Option<crate::secrets::SecretSet>, ExchangeError> {
    let body = serde_json::to_vec(report).map_err(ExchangeError::Encode)?;
    let request = hyper::Request::post(HEARTBEAT_PATH)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))?;
    let response = links.send(control_plane, request, None).await?;
    match response.status() {
        StatusCode::NO_CONTENT => Ok(None),
        StatusCode::OK => {
            let body = axum::body::to_bytes(response.into_body(), crate::secrets::MAX_SECRET_SET)
                .await
                .map_err(ExchangeError::Body)?;
            serde_json::from_slice(&body).map(Some).map_err(ExchangeError::Answer)
        }
        status => Err(ExchangeError::Status { status, body: String::new() }),
    }
}

/// Why an exchange with another member (a heartbeat, a template pulled
/// from another node) failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("making the request: {0}")]
    Request(#[from] axum::http::Error),
    #[error("encoding the report: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("it answered {status}{}", if .body.is_empty() { String::new() } else { format!(": {}", .body) })]
    Status { status: StatusCode, body: String },
    #[error("reading its answer: {0}")]
    Body(#[source] axum::Error),
    #[error("its answer: {0}")]
    Answer(#[source] serde_json::Error),
    #[error("no {0} header")]
    MissingHeader(&'static str),
    #[error("the template's description is not base64: {0}")]
    MetaEncoding(#[source] base64::DecodeError),
    #[error("the template's description: {0}")]
    Meta(#[source] serde_json::Error),
    #[error("asked for {asked}, got {got}")]
    WrongTemplate { asked: String, got: String },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the content's SHA-256 is {got}, not the {expected} it was sent as")]
    Digest { got: String, expected: String },
    #[error("importing it: {0}")]
    Import(#[source] space_host::HostError),
    #[error("importing it: {0}")]
    ImportTask(#[source] tokio::task::JoinError),
}

impl ExchangeError {
    fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ExchangeError {
        move |source| ExchangeError::Io { what, source }
    }
}

// ---- the internal routes -------------------------------------------------------

/// The node token of an `/internal/v1` request, checked. Its handlers take
/// it as their first argument, so it is checked before their other
/// extractors read the path, the query or the body: a caller without it
/// learns nothing from how a malformed request would have been refused.
pub(crate) struct NodeToken(String);

/// Only the control plane (or another node of the cluster) with the node
/// token reaches a node's internal routes; a single host has none.
fn node_only(expected: Option<&str>, headers: &HeaderMap) -> Result<NodeToken, ApiError> {
    let missing = || ApiError::new(ErrorCode::NotFound, "no such route");
    let token = expected.ok_or_else(missing)?;
    let presented = space_http::auth::bearer(headers).unwrap_or_default();
    if !space_proto::constant_time_eq(presented.as_bytes(), token.as_bytes()) {
        return Err(ApiError::new(ErrorCode::Unauthorized, "internal routes need the node token"));
    }
    Ok(NodeToken(token.to_string()))
}

impl axum::extract::FromRequestParts<AppState> for NodeToken {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<NodeToken, ApiError> {
        node_only(state.node_token.as_deref().map(String::as_str), &parts.headers)
    }
}

/// `GET /internal/v1/templates/{name}` on a node: the newest version of a
/// template as a tar of its root, with its SHA-256 and `template.json`.
pub(crate) async fn export_template(
    State(state): State<AppState>,
    _token: NodeToken,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    use base64::Engine as _;
    let platform = state.platform.clone();
    let export = tokio::task::spawn_blocking(move || platform.export_template(&name))
        .await
        .map_err(|e| ApiError::internal("exporting a template", e))?
        .map_err(|e| ApiError::new(ErrorCode::TemplateNotFound, e.to_string()))?;
    let meta = serde_json::to_vec(&export.meta).map_err(|e| ApiError::internal("a template", e))?;
    let file = tokio::fs::File::open(&export.tar).await.map_err(|e| ApiError::internal("opening an export", e))?;
    let length = file.metadata().await.map(|m| m.len()).unwrap_or(0);
    let chunks = futures_util::stream::unfold(file, |mut file| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(axum::body::Bytes::from(buf)), file))
            }
            Err(err) => Some((Err(err), file)),
        }
    });
    let mut response = Response::new(Body::from_stream(chunks));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-tar"));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    let sum = HeaderValue::from_str(&export.sha256).map_err(|e| ApiError::internal("an export's sum", e))?;
    headers.insert(TEMPLATE_SHA256_HEADER, sum);
    let meta = base64::engine::general_purpose::STANDARD.encode(meta);
    headers
        .insert(TEMPLATE_META_HEADER, HeaderValue::from_str(&meta).map_err(|e| ApiError::internal("a template", e))?);
    Ok(response)
}

/// `POST /internal/v1/templates/pull` on a node: fetch a template from
/// another node, check it against its SHA-256 and make it a template here
/// (in the background; the node's next reports name it once it is there).
pub(crate) async fn pull_template(
    State(state): State<AppState>,
    NodeToken(token): NodeToken,
    space_http::extract::ApiJson(request): space_http::extract::ApiJson<PullRequest>,
) -> Result<StatusCode, ApiError> {
    if state.platform.data().template(&request.name).is_some() {
        return Ok(StatusCode::NO_CONTENT);
    }
    let (platform, links) = (state.platform.clone(), state.links.clone());
    tokio::spawn(async move {
        let name = request.name.clone();
        match pull(platform, &links, &token, request).await {
            Ok(()) => tracing::info!(template = %name, "pulled a template from another node"),
            Err(err) => tracing::warn!(template = %name, "pulling a template: {err}"),
        }
    });
    Ok(StatusCode::ACCEPTED)
}

async fn pull(platform: Arc<Platform>, links: &Links, token: &str, request: PullRequest) -> Result<(), ExchangeError> {
    use base64::Engine as _;
    use futures_util::StreamExt as _;
    use sha2::Digest as _;
    use tokio::io::AsyncWriteExt as _;
    let outgoing = hyper::Request::get(space_api::cluster::template_export_path(&request.name))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())?;
    let response = links.send(&request.from, outgoing, None).await?;
    if response.status() != StatusCode::OK {
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 64 << 10).await.unwrap_or_default();
        return Err(ExchangeError::Status { status, body: String::from_utf8_lossy(&body).into_owned() });
    }
    let (expected, meta) = {
        let text = |name: &'static str| {
            let value = response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
            value.ok_or(ExchangeError::MissingHeader(name))
        };
        (text(TEMPLATE_SHA256_HEADER)?, text(TEMPLATE_META_HEADER)?)
    };
    let meta = base64::engine::general_purpose::STANDARD.decode(meta).map_err(ExchangeError::MetaEncoding)?;
    let meta: space_host::template::TemplateMeta = serde_json::from_slice(&meta).map_err(ExchangeError::Meta)?;
    if meta.name != request.name {
        return Err(ExchangeError::WrongTemplate { asked: request.name, got: meta.name });
    }
    // In the uploads dir, the one of run/ this server writes; named as no
    // tenant's upload is (those start with the tenant's name).
    let dir = platform.uploads_dir();
    tokio::fs::create_dir_all(&dir).await.map_err(ExchangeError::io("making the uploads directory"))?;
    // One file per pull: two asks for the same template may overlap.
    static PULLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let pull = PULLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!(".pull-{}-{}-{pull}.tar", request.name, std::process::id()));
    let mut file = tokio::fs::File::create(&path).await.map_err(ExchangeError::io("creating the pulled archive"))?;
    let mut hasher = sha2::Sha256::new();
    let mut body = response.into_body().into_data_stream();
    while let Some(bytes) = body.next().await {
        let bytes = bytes.map_err(ExchangeError::Body)?;
        hasher.update(&bytes);
        file.write_all(&bytes).await.map_err(ExchangeError::io("writing the pulled archive"))?;
    }
    file.flush().await.map_err(ExchangeError::io("writing the pulled archive"))?;
    drop(file);
    let got: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let result = match got == expected {
        true => {
            let (platform, tar) = (platform.clone(), path.clone());
            tokio::task::spawn_blocking(move || {
                let tar = std::fs::File::open(&tar).map_err(space_host::HostError::io("opening a pulled template"))?;
                platform.import_pulled(&meta, tar)
            })
            .await
            .map_err(ExchangeError::ImportTask)
            .and_then(|r| r.map(drop).map_err(ExchangeError::Import))
        }
        false => Err(ExchangeError::Digest { got, expected }),
    };
    let _ = tokio::fs::remove_file(&path).await;
    result
}

/// `POST /internal/v1/secrets` on a node: the cluster's secrets, as of a
/// change (an older set than the node holds is ignored).
pub(crate) async fn take_secrets(
    State(state): State<AppState>,
    _token: NodeToken,
    space_http::extract::ApiJson(set): space_http::extract::ApiJson<crate::secrets::SecretSet>,
) -> Result<StatusCode, ApiError> {
    state.platform.take_secrets(set)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /internal/v1/volumes/release` on a node: lets go of a volume of
/// the shared store for another node to take (decision 032).
pub(crate) async fn release_volume(
    State(state): State<AppState>,
    _token: NodeToken,
    space_http::extract::ApiJson(wanted): space_http::extract::ApiJson<space_api::cluster::ReleaseVolume>,
) -> Result<axum::Json<space_api::cluster::HandedVolume>, ApiError> {
    Ok(axum::Json(state.platform.release_volume(&wanted.tenant, &wanted.name).await?))
}

/// `POST /internal/v1/volumes/adopt` on a node: takes a volume of the
/// shared store another node let go of.
pub(crate) async fn adopt_volume(
    State(state): State<AppState>,
    _token: NodeToken,
    space_http::extract::ApiJson(handed): space_http::extract::ApiJson<space_api::cluster::HandedVolume>,
) -> Result<axum::Json<space_api::Volume>, ApiError> {
    Ok(axum::Json(state.platform.adopt_volume(handed).await?))
}

/// An idle feed sends an empty line this often, so a dead control plane
/// (or node) is noticed.
const FEED_KEEPALIVE: Duration = Duration::from_secs(15);

/// `GET /internal/v1/events?after=N` on a node: every tenant's events
/// after id N, then each one as it commits, as NDJSON lines of
/// [`space_api::cluster::FeedEvent`], for the control plane to take in.
pub(crate) async fn feed(
    State(state): State<AppState>,
    _token: NodeToken,
    space_http::extract::ApiQuery(query): space_http::extract::ApiQuery<FeedQuery>,
) -> Result<Response, ApiError> {
    struct Feed {
        platform: Arc<Platform>,
        after: u64,
        head: tokio::sync::watch::Receiver<u64>,
    }
    let feed = Feed { platform: state.platform.clone(), after: query.after, head: state.platform.events().head() };
    let lines = futures_util::stream::unfold(feed, |mut feed| async move {
        loop {
            feed.head.borrow_and_update();
            let batch = match feed.platform.events().feed(feed.after, 500) {
                Ok(batch) => batch,
                Err(err) => {
                    tracing::error!("reading events for the control plane: {err}");
                    return None;
                }
            };
            if let Some(last) = batch.last() {
                feed.after = last.seq;
                let mut text = Vec::new();
                for event in &batch {
                    serde_json::to_writer(&mut text, event).ok()?;
                    text.push(b'\n');
                }
                return Some((Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(text)), feed));
            }
            match tokio::time::timeout(FEED_KEEPALIVE, feed.head.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return None,
                Err(_) => return Some((Ok(axum::body::Bytes::from_static(b"\n")), feed)),
            }
        }
    });
    Ok(space_http::stream::stream_response(Body::from_stream(lines), false))
}
