//! Cluster mode (decision 009): a control plane in front of nodes that
//! speak the v1 API. A node (`space node`) is a host like a single-host
//! server; it answers only the control plane, which presents the cluster's
//! node token and names the caller's tenant. The control plane
//! (`space serve --cluster`) keeps tenants, keys, the nodes with their
//! leases and where each sandbox lives in PostgreSQL, and forwards each
//! request to the sandbox's node as a stream.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::{Deserialize, Serialize};

use space_api::ErrorCode;

use crate::error::ApiError;
pub use crate::links::Links;
use crate::links::{member_url, LinkError};
use crate::platform::Platform;
use crate::state::AppState;
use crate::store::{NodeRow, Store};
use crate::tenants::Caller;

/// How often a node reports, and how long a report keeps it alive.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
pub const LEASE: Duration = Duration::from_secs(10);
/// The largest answer the control plane reads whole (JSON it records from).
const MAX_RECORDED: usize = 4 << 20;

/// What a node tells the control plane with every heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeReport {
    pub id: String,
    /// Where the control plane reaches it (`http://host:port`).
    pub url: String,
    pub engine: String,
    pub capacity_mib: u64,
    pub promised_mib: u64,
    pub templates: Vec<String>,
    /// Sandboxes that hold its resources (not deleted or failed).
    pub sandboxes: Vec<String>,
    /// The change of the cluster's secrets it holds (0: none).
    #[serde(default)]
    pub secrets_epoch: u64,
    /// The engines it can run (its default is `engine`).
    #[serde(default)]
    pub engines: Vec<String>,
    /// Templates whose sandboxes must run on one engine, and that engine.
    #[serde(default)]
    pub pinned: std::collections::BTreeMap<String, String>,
    /// Snapshot templates it holds: they stay here (never spread).
    #[serde(default)]
    pub local: Vec<String>,
    /// Each template's default size, which a create that names none gets:
    /// the control plane counts a tenant's quotas and a node's room by it.
    #[serde(default)]
    pub sizes: std::collections::BTreeMap<String, TemplateSize>,
}

/// A template's default vCPUs and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSize {
    pub vcpus: u32,
    pub memory_mib: u32,
}

impl NodeReport {
    /// Whether a sandbox of `template` (that must run on `engine`, if
    /// named) can start here.
    fn can_run(&self, template: &str, engine: Option<&str>) -> bool {
        self.templates.iter().any(|t| t == template)
            && engine.is_none_or(|e| e == self.engine || self.engines.iter().any(|have| have == e))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

// ---- the node's side -------------------------------------------------------

/// What this node would report now.
pub fn report(platform: &Platform, id: &str, url: &str) -> NodeReport {
    let sandboxes = platform.store.live_sandboxes().unwrap_or_default();
    let templates = platform.data.templates();
    NodeReport {
        id: id.to_string(),
        url: url.to_string(),
        engine: platform.engine.name().to_string(),
        capacity_mib: platform.capacity_mib,
        promised_mib: platform.reserved_mib(),
        templates: templates.iter().map(|t| t.meta.name.clone()).collect(),
        sandboxes: sandboxes
            .into_iter()
            .filter(|r| r.sandbox.state != space_api::SandboxState::Failed)
            .map(|r| r.sandbox.id)
            .collect(),
        secrets_epoch: platform.secrets_epoch.load(std::sync::atomic::Ordering::SeqCst),
        engines: platform
            .engine_report
            .get()
            .map(|engines| engines.iter().filter(|e| e.available).map(|e| e.name.to_string()).collect())
            .unwrap_or_default(),
        pinned: templates.iter().filter_map(|t| Some((t.meta.name.clone(), t.meta.engine.clone()?))).collect(),
        local: templates.iter().filter(|t| t.meta.image.is_some()).map(|t| t.meta.name.clone()).collect(),
        sizes: templates
            .iter()
            .map(|t| {
                let size = TemplateSize { vcpus: t.meta.defaults.vcpus, memory_mib: t.meta.defaults.memory_mib };
                (t.meta.name.clone(), size)
            })
            .collect(),
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
    let request = hyper::Request::post("/internal/v1/nodes/heartbeat")
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

/// Why an exchange with another member (a heartbeat, a node's event feed,
/// a template pulled from another node) failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The node could not be reached through the control plane's forward.
    #[error("{}", .0.message)]
    Forward(ApiError),
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
    #[error("a line of its feed: {0}")]
    FeedLine(#[source] serde_json::Error),
    #[error("taking its events in: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("another replica follows it now")]
    Overtaken,
    #[error("its feed ended")]
    FeedEnded,
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

// ---- the control plane -------------------------------------------------------

/// The control plane's state: PostgreSQL, its own key, the node token.
pub struct ControlPlane {
    pub store: Store,
    pub api_key: String,
    pub node_token: String,
    /// Seals tenants' secrets in PostgreSQL (the same key on every
    /// replica: `--secrets-key-file`); without it, no secrets.
    pub keyring: Option<crate::secrets::Keyring>,
    /// How it reaches the nodes.
    pub links: Links,
}

type Shared = Arc<ControlPlane>;

pub fn router(control_plane: Arc<ControlPlane>) -> Router {
    Router::new()
        .route("/internal/v1/nodes/heartbeat", post(heartbeat))
        .route("/v1/health", get(health))
        .merge(space_http::console::router())
        .fallback(public)
        .layer(axum::middleware::from_fn(space_http::server::close_if_body_unread))
        .with_state(control_plane)
}

/// The control plane's listener for nodes alone (`--cluster-listen`, over
/// the cluster's mutual TLS): heartbeats.
pub fn internal_router(control_plane: Arc<ControlPlane>) -> Router {
    Router::new()
        .route("/internal/v1/nodes/heartbeat", post(heartbeat))
        .layer(axum::middleware::from_fn(space_http::server::close_if_body_unread))
        .with_state(control_plane)
}

async fn heartbeat(State(cp): State<Shared>, _token: NodeToken, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let report: NodeReport =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("a node report: {e}")))?;
    member_url(&report.url).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let json = serde_json::to_string(&report).map_err(|e| ApiError::internal("a node report", e))?;
    cp.store.heartbeat_node(&report.id, &report.url, &json, now_ms() + LEASE.as_millis() as i64)?;
    // A node whose secrets are older (restarted, or away when one changed)
    // gets the whole set back.
    if let Some(keyring) = &cp.keyring {
        if report.secrets_epoch < cp.store.secrets_epoch()? {
            return Ok(axum::Json(crate::secrets::secret_set(&cp.store, keyring)?).into_response());
        }
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A node with its last report, and whether its lease still holds.
struct Node {
    row: NodeRow,
    report: NodeReport,
    alive: bool,
}

impl Node {
    /// When its last report came (its lease runs [`LEASE`] from then).
    fn reported_ms(&self) -> i64 {
        self.row.lease_until_ms - LEASE.as_millis() as i64
    }

    /// Whether `placement` holds resources on it: reported so, or placed
    /// after its last report.
    fn holds(&self, placement: &crate::store::Placement, id: &str) -> bool {
        self.alive && (self.report.sandboxes.iter().any(|s| s == id) || placement.placed_at_ms > self.reported_ms())
    }
}

fn nodes(cp: &ControlPlane) -> Result<Vec<Node>, ApiError> {
    let now = now_ms();
    Ok(cp
        .store
        .nodes()?
        .into_iter()
        .filter_map(|row| {
            let report = serde_json::from_str(&row.report).ok()?;
            let alive = row.lease_until_ms > now;
            Some(Node { row, report, alive })
        })
        .collect())
}

async fn health(State(cp): State<Shared>) -> Result<Response, ApiError> {
    let nodes: Vec<serde_json::Value> = nodes(&cp)?
        .iter()
        .map(|n| {
            serde_json::json!({"id": n.row.id, "url": n.row.url, "alive": n.alive, "engine": n.report.engine,
                "engines": n.report.engines,
                "capacity_mib": n.report.capacity_mib, "promised_mib": n.report.promised_mib,
                "sandboxes": n.report.sandboxes.len(), "templates": n.report.templates})
        })
        .collect();
    Ok(axum::Json(serde_json::json!({"status": "ok", "role": "control-plane", "nodes": nodes})).into_response())
}

/// The caller: the cluster's own key, or a tenant's (from PostgreSQL).
fn authenticate(cp: &ControlPlane, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let offered = space_http::auth::websocket_bearer(headers);
    let Some(key) = space_http::auth::bearer(headers).or(offered.as_deref()) else {
        return Err(ApiError::new(ErrorCode::Unauthorized, "missing API key: send `Authorization: Bearer <key>`"));
    };
    caller_for_key(cp, key)
}

fn caller_for_key(cp: &ControlPlane, key: &str) -> Result<Caller, ApiError> {
    if space_proto::constant_time_eq(key.as_bytes(), cp.api_key.as_bytes()) {
        return Ok(Caller::operator());
    }
    match cp.store.key_tenant(&crate::tenants::hash_key(key))? {
        Some(tenant) => Ok(Caller::tenant(tenant)),
        None => Err(ApiError::new(ErrorCode::Unauthorized, "the API key is not valid")),
    }
}

async fn public(State(cp): State<Shared>, request: Request) -> Response {
    match route(cp, request).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn route(cp: Shared, request: Request) -> Result<Response, ApiError> {
    if request.uri().path().starts_with("/e2b/") {
        return Ok(e2b(&cp, request).await.unwrap_or_else(IntoResponse::into_response));
    }
    let caller = authenticate(&cp, request.headers())?;
    let path = request.uri().path().to_string();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = request.method().clone();
    match (&method, parts.as_slice()) {
        (&Method::POST, ["v1", "sandboxes"]) => create(&cp, &caller, request).await,
        (&Method::GET, ["v1", "sandboxes"]) => list(&cp, &caller, request).await,
        (_, ["v1", "sandboxes", id, ..]) => {
            let id = id.to_string();
            sandbox_request(&cp, &caller, &id, request).await
        }
        (&Method::GET, ["v1", "operations", id] | ["v1", "operations", id, "log"]) => {
            let Some((node_id, tenant)) = cp.store.operation_node(id)? else {
                return Err(ApiError::not_found("operation", id));
            };
            if tenant != caller.tenant {
                return Err(ApiError::not_found("operation", id));
            }
            let node = live_node(&cp, &node_id)?;
            forward(&cp, &node, &caller, request).await
        }
        (&Method::GET, ["v1", "templates"]) => templates(&cp, &caller, request).await,
        (&Method::GET | &Method::DELETE, ["v1", "templates", name]) => {
            let name = name.to_string();
            template(&cp, &caller, &name, request).await
        }
        (&Method::GET, ["v1", "operations"]) => operations(&cp, &caller, request).await,
        (&Method::GET, ["v1", "openapi.json"]) => Ok(crate::api::openapi::document().await.into_response()),
        (&Method::POST, ["v1", "templates"]) => build(&cp, &caller, request).await,
        (&Method::GET, ["v1", "usage"]) => usage(&cp, &caller).await,
        (&Method::GET, ["v1", "secrets"]) => {
            Ok(axum::Json(space_api::SecretList { secrets: cp.store.secrets(&caller.tenant)? }).into_response())
        }
        (&Method::PUT | &Method::DELETE, ["v1", "secrets", name]) => {
            let name = name.to_string();
            secret(&cp, &caller, &name, request).await
        }
        (&Method::GET, ["v1", "events"]) => {
            use axum::extract::FromRequestParts as _;
            let (mut parts, _) = request.into_parts();
            let space_http::extract::ApiQuery(query) =
                space_http::extract::ApiQuery::from_request_parts(&mut parts, &()).await?;
            // Another replica may have taken events in since this one looked.
            cp.store.refresh_event_head()?;
            crate::api::events::serve(cp.clone(), caller, query, &parts.headers)
        }
        _ => Err(ApiError::new(
            ErrorCode::NotInClusterMode,
            format!("{method} {path} is not served by a cluster's control plane yet (decision 009)"),
        )),
    }
}

fn live_node(cp: &ControlPlane, id: &str) -> Result<NodeRow, ApiError> {
    match cp.store.node(id)? {
        Some(row) if row.lease_until_ms > now_ms() => Ok(row),
        _ => Err(ApiError::unavailable(format!("node {id} is lost (no heartbeat within {}s)", LEASE.as_secs()))),
    }
}

/// Sends a request on to a node as `caller`, streaming both ways (and
/// splicing an upgrade, such as attach's WebSocket).
async fn forward(cp: &ControlPlane, node: &NodeRow, caller: &Caller, request: Request) -> Result<Response, ApiError> {
    relay_to(cp, node, Some(caller), request).await
}

/// [`forward`]; with no `caller`, the request keeps the credentials it
/// came with (E2B's envd: the sandbox's access token) and gets neither the
/// node token nor a tenant.
async fn relay_to(
    cp: &ControlPlane,
    node: &NodeRow,
    caller: Option<&Caller>,
    mut request: Request,
) -> Result<Response, ApiError> {
    let unreachable = |e: String| ApiError::new(ErrorCode::NodeUnreachable, format!("node {}: {e}", node.id));
    let upgrade = request.headers().get(header::UPGRADE).cloned();
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (parts, body) = request.into_parts();
    let target = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut outgoing = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(target)
        .body(body)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    // As the caller's: nothing that holds its key in any encoding (a cookie,
    // a Basic header, a subprotocol) goes on; with no caller (envd) the
    // request keeps the sandbox token it needs.
    let incoming = match caller {
        Some(_) => space_http::proxy::without_presented_credentials(&parts.headers),
        None => parts.headers.clone(),
    };
    let headers = outgoing.headers_mut();
    for (name, value) in &incoming {
        let hop = space_http::proxy::HOP_BY_HOP.contains(&name.as_str());
        // A tenant's key (in either header) never reaches a node.
        let key = (name == header::AUTHORIZATION && caller.is_some()) || name == "x-api-key";
        let ours = key || name == header::HOST || name.as_str().starts_with("x-space-");
        if hop || ours || name == header::SEC_WEBSOCKET_PROTOCOL {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    // The subprotocols a browser offered, less the one that carries its
    // key: a node never sees a tenant's key.
    let offered: Vec<&str> = incoming
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with("bearer."))
        .collect();
    if let Some(value) = (!offered.is_empty()).then(|| HeaderValue::from_str(&offered.join(", ")).ok()).flatten() {
        headers.insert(header::SEC_WEBSOCKET_PROTOCOL, value);
    }
    if let Some(upgrade) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
    if let Some(caller) = caller {
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {}", cp.node_token)).map_err(|e| unreachable(e.to_string()))?,
        );
        let tenant = HeaderValue::from_str(&caller.tenant).map_err(|e| unreachable(e.to_string()))?;
        headers.insert("x-space-tenant", tenant);
        if caller.is_operator() {
            headers.insert("x-space-operator", HeaderValue::from_static("true"));
        }
    }
    if let Some(DiskAllowance(value)) = parts.extensions.get::<DiskAllowance>() {
        headers.insert(crate::disk_quota::DISK_QUOTA_HEADER, value.clone());
    }
    let mut response = cp.links.send(&node.url, outgoing, client_side).await.map_err(|e| unreachable(e.to_string()))?;
    if let Ok(value) = HeaderValue::from_str(&node.id) {
        response.headers_mut().insert("x-space-node", value);
    }
    Ok(response)
}

/// A node's answer read whole (a small JSON body), to record from it, and
/// the same answer to send on.
async fn read_answer(response: Response) -> Result<(Response, Option<serde_json::Value>), ApiError> {
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_RECORDED)
        .await
        .map_err(|e| ApiError::new(ErrorCode::NodeUnreachable, format!("reading a node's answer: {e}")))?;
    let json = serde_json::from_slice(&bytes).ok();
    Ok((Response::from_parts(parts, Body::from(bytes)), json))
}

/// Records a lifecycle answer's operation (and the sandbox as it is).
fn record(cp: &ControlPlane, node: &str, caller: &Caller, answer: &serde_json::Value) -> Result<(), ApiError> {
    // A lifecycle answer's sandbox, or a fork's new sandboxes (on the
    // source's node).
    let forks = answer.get("sandboxes").and_then(|s| s.as_array()).cloned().unwrap_or_default();
    for sandbox in answer.get("sandbox").filter(|s| s.is_object()).into_iter().chain(&forks) {
        let id = sandbox["id"].as_str().unwrap_or_default();
        cp.store.put_placement(id, node, &caller.tenant, &sandbox.to_string(), now_ms())?;
    }
    if let Some(op) = answer["operation"]["id"].as_str() {
        cp.store.put_operation_node(op, node, &caller.tenant)?;
    }
    Ok(())
}

/// A tenant's quotas, cluster-wide: the sandboxes its placements hold on
/// live nodes (by their size as created) and `count` new ones of `wanted`
/// (vCPUs, MiB). Nodes keep no quotas of their own.
fn check_quotas(
    cp: &ControlPlane,
    caller: &Caller,
    quotas: &crate::store::Quotas,
    nodes: &[Node],
    wanted: (u64, u64),
    count: u32,
) -> Result<(), ApiError> {
    if quotas.max_sandboxes.is_none() && quotas.max_vcpus.is_none() && quotas.max_memory_mib.is_none() {
        return Ok(());
    }
    let mut held: Vec<(u64, u64)> = cp
        .store
        .placements(&caller.tenant)?
        .iter()
        .filter_map(|p| Some((p, serde_json::from_str::<serde_json::Value>(&p.sandbox).ok()?)))
        .filter(|(p, s)| {
            let id = s["id"].as_str().unwrap_or_default();
            nodes.iter().any(|n| n.row.id == p.node_id && n.holds(p, id))
        })
        .map(|(_, s)| (s["vcpus"].as_u64().unwrap_or(0), s["memory_mib"].as_u64().unwrap_or(0)))
        .collect();
    // All but the last of several count as held when the last is checked.
    held.extend(std::iter::repeat_n(wanted, count.saturating_sub(1) as usize));
    Ok(crate::tenants::check_held(&caller.tenant, quotas, &held, wanted)?)
}

/// For a request that may make a tenant hold more disk on a node (a
/// create, a suspend, a template build): the tenant's disk quota and what
/// it holds on the other live nodes, as `MAX_MIB/ELSEWHERE_BYTES` (`none`:
/// no quota). The node counts both with what the tenant holds there.
#[derive(Clone)]
struct DiskAllowance(HeaderValue);

async fn disk_allowance(
    cp: &ControlPlane,
    caller: &Caller,
    max_disk_mib: Option<u64>,
    node: &str,
) -> Result<DiskAllowance, ApiError> {
    let Some(max_mib) = max_disk_mib else {
        return Ok(DiskAllowance(HeaderValue::from_static("none")));
    };
    let elsewhere: u64 = ask_all_but(cp, caller, "/v1/usage", Some(node))
        .await?
        .iter()
        .map(|usage| usage["disk"]["total_bytes"].as_u64().unwrap_or(0))
        .sum();
    let value =
        HeaderValue::from_str(&format!("{max_mib}/{elsewhere}")).map_err(|e| ApiError::internal("a quota", e))?;
    Ok(DiskAllowance(value))
}

/// The vCPUs and MiB a create asks for: what it names, else its template's
/// defaults as a live node that has the template reports them, else the
/// defaults of a template that sets none (as a node would give it).
fn create_size(wanted: &serde_json::Value, nodes: &[Node]) -> (u64, u64) {
    let template = wanted["template"].as_str().unwrap_or("base");
    let reported = nodes.iter().filter(|n| n.alive).find_map(|n| n.report.sizes.get(template).copied());
    let fallback = space_host::template::TemplateDefaults::default();
    let size = reported.unwrap_or(TemplateSize { vcpus: fallback.vcpus, memory_mib: fallback.memory_mib });
    (
        wanted["vcpus"].as_u64().unwrap_or(u64::from(size.vcpus)),
        wanted["memory_mib"].as_u64().unwrap_or(u64::from(size.memory_mib)),
    )
}

/// The sandbox of a placement on a lost node, as the control plane shows
/// it: failed, saying so (`None` if it was deleted).
fn lost_sandbox(placement: &crate::store::Placement, why: &str) -> Option<serde_json::Value> {
    let mut sandbox: serde_json::Value = serde_json::from_str(&placement.sandbox).ok()?;
    // A delete the node accepted is done or will be: not a lost sandbox.
    if sandbox["state"] == "deleted" || sandbox["state"] == "deleting" {
        return None;
    }
    sandbox["state"] = "failed".into();
    sandbox["failure_reason"] = format!("node lost: {why}").into();
    Some(sandbox)
}

/// Places a new sandbox: a live node that has the template, with the most
/// memory left once what was placed since its last report is counted.
async fn create(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| ApiError::new(ErrorCode::TooLarge, "the request body is too large"))?;
    let wanted: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::new(ErrorCode::MalformedJson, e.to_string()))?;
    let key = parts.headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string);
    let (node, allowance) = place(cp, caller, &wanted, key.as_deref()).await?;
    parts.extensions.insert(allowance);
    forward_recording(cp, caller, node, Request::from_parts(parts, Body::from(bytes))).await
}

/// The node a new sandbox (`wanted`: its template, vCPUs and memory, as a
/// create names them) goes to, once the tenant's quotas allow it, and the
/// tenant's disk allowance there.
async fn place(
    cp: &ControlPlane,
    caller: &Caller,
    wanted: &serde_json::Value,
    key: Option<&str>,
) -> Result<(NodeRow, DiskAllowance), ApiError> {
    let template = wanted["template"].as_str().unwrap_or("base").to_string();
    let quotas = cp.store.tenant_quotas(&caller.tenant)?;
    let nodes = nodes(cp)?;
    let size = create_size(wanted, &nodes);
    let memory = size.1;
    check_quotas(cp, caller, &quotas, &nodes, size, 1)?;
    let anywhere = nodes.iter().any(|n| n.report.templates.contains(&template));
    // A template built to run on one engine goes to a node that has it.
    let engine = nodes.iter().find_map(|n| n.report.pinned.get(&template)).cloned();
    let mut best: Option<(i64, NodeRow)> = None;
    for node in nodes.into_iter().filter(|n| n.alive && n.report.can_run(&template, engine.as_deref())) {
        // What was placed since its last report, which could not count it.
        let placed_since: i64 = cp
            .store
            .placements_since(&node.row.id, node.reported_ms())?
            .iter()
            .filter_map(|p| serde_json::from_str::<serde_json::Value>(&p.sandbox).ok())
            .filter(|s| !node.report.sandboxes.iter().any(|id| s["id"] == id.as_str()))
            .map(|s| s["memory_mib"].as_i64().unwrap_or(0))
            .sum();
        let free = node.report.capacity_mib as i64 - node.report.promised_mib as i64 - placed_since;
        if best.as_ref().is_none_or(|(f, _)| free > *f) {
            best = Some((free, node.row));
        }
    }
    // A create repeated with its Idempotency-Key, through any replica, goes
    // to the node the first one went to, which replays its operation.
    let chosen = match (key, &best) {
        (Some(key), Some((_, node))) => Some(cp.store.create_key_node(&caller.tenant, key, &node.id)?),
        (Some(key), None) => cp.store.create_key_node(&caller.tenant, key, "").ok().filter(|n| !n.is_empty()),
        _ => None,
    };
    if let Some(chosen) = chosen.filter(|c| best.as_ref().is_none_or(|(_, b)| b.id != *c)) {
        let node = live_node(cp, &chosen)?;
        let allowance = disk_allowance(cp, caller, quotas.max_disk_mib, &node.id).await?;
        return Ok((node, allowance));
    }
    let Some((free, node)) = best else {
        return Err(match (anywhere, &engine) {
            (true, Some(engine)) => {
                ApiError::unavailable(format!("no live node that runs {engine} has template {template:?}"))
            }
            (true, None) => ApiError::unavailable(format!("no live node has template {template:?}")),
            (false, _) => crate::templates::template_not_found(&template).into(),
        });
    };
    if free < memory as i64 {
        return Err(ApiError::unavailable(format!("no node has {memory} MiB free for this sandbox")));
    }
    let allowance = disk_allowance(cp, caller, quotas.max_disk_mib, &node.id).await?;
    Ok((node, allowance))
}

/// Forwards a request and records what its 202 answer says (the operation,
/// and the sandbox as it is).
async fn forward_recording(
    cp: &ControlPlane,
    caller: &Caller,
    node: NodeRow,
    request: Request,
) -> Result<Response, ApiError> {
    let response = forward(cp, &node, caller, request).await?;
    if response.status() != StatusCode::ACCEPTED {
        return Ok(response);
    }
    let (response, answer) = read_answer(response).await?;
    if let Some(answer) = answer {
        record(cp, &node.id, caller, &answer)?;
    }
    Ok(response)
}

/// A request about one sandbox goes to its node; a sandbox whose node is
/// lost answers as failed.
async fn sandbox_request(
    cp: &ControlPlane,
    caller: &Caller,
    id: &str,
    mut request: Request,
) -> Result<Response, ApiError> {
    let Some(placement) = cp.store.placement(id)?.filter(|p| p.tenant == caller.tenant) else {
        return Err(ApiError::not_found("sandbox", id));
    };
    let node = match live_node(cp, &placement.node_id) {
        Ok(node) => node,
        Err(lost) => {
            let whole = request.uri().path().trim_end_matches('/') == format!("/v1/sandboxes/{id}");
            if request.method() == Method::GET && whole {
                let shown = lost_sandbox(&placement, &lost.message)
                    .unwrap_or_else(|| serde_json::from_str(&placement.sandbox).unwrap_or_default());
                return Ok(axum::Json(shown).into_response());
            }
            return Err(ApiError::invalid_state("sandbox", "failed", "use it (its node is lost)"));
        }
    };
    // A suspend, a checkpoint or a fork writes what the tenant's disk quota
    // counts; forks count against its other quotas too, cluster-wide.
    let path = request.uri().path().trim_end_matches('/').to_string();
    if request.method() == Method::POST && path.ends_with("/fork") {
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
            .await
            .map_err(|_| ApiError::new(ErrorCode::TooLarge, "the request body is too large"))?;
        let count = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|body| body["count"].as_u64())
            .map_or(1, |count| count.clamp(1, u64::from(space_api::MAX_FORKS)) as u32);
        // A fork is the size of its source, as created.
        let source: serde_json::Value = serde_json::from_str(&placement.sandbox).unwrap_or_default();
        let nodes = nodes(cp)?;
        let size = create_size(&source, &nodes);
        check_quotas(cp, caller, &cp.store.tenant_quotas(&caller.tenant)?, &nodes, size, count)?;
        request = Request::from_parts(parts, Body::from(bytes));
    }
    if request.method() == Method::POST && ["/suspend", "/fork", "/checkpoints"].iter().any(|end| path.ends_with(end)) {
        let max_disk_mib = cp.store.tenant_quotas(&caller.tenant)?.max_disk_mib;
        request.extensions_mut().insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    }
    let deleting = request.method() == Method::DELETE && request.uri().path().trim_end_matches('/').ends_with(id);
    let node_id = node.id.clone();
    let response = forward_recording(cp, caller, node, request).await?;
    if deleting && response.status() == StatusCode::ACCEPTED {
        mark_gone(cp, id, &node_id, caller, "deleting")?;
    }
    Ok(response)
}

/// Records that a sandbox's node accepted its delete (`deleting`) or did it
/// (`deleted`): a later loss of that node does not show it as failed.
fn mark_gone(cp: &ControlPlane, id: &str, node: &str, caller: &Caller, state: &str) -> Result<(), ApiError> {
    let Some(placement) = cp.store.placement(id)? else {
        return Ok(());
    };
    let mut sandbox: serde_json::Value = serde_json::from_str(&placement.sandbox).unwrap_or_default();
    sandbox["state"] = state.into();
    cp.store.put_placement(id, node, &caller.tenant, &sandbox.to_string(), now_ms())?;
    Ok(())
}

/// Asks every live node (as `caller`) and reads each answer whole.
async fn ask_all(cp: &ControlPlane, caller: &Caller, path_and_query: &str) -> Result<Vec<serde_json::Value>, ApiError> {
    ask_all_but(cp, caller, path_and_query, None).await
}

/// [`ask_all`] but the node `except`.
async fn ask_all_but(
    cp: &ControlPlane,
    caller: &Caller,
    path_and_query: &str,
    except: Option<&str>,
) -> Result<Vec<serde_json::Value>, ApiError> {
    let mut answers = Vec::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive && Some(n.row.id.as_str()) != except) {
        let request =
            Request::get(path_and_query).body(Body::empty()).map_err(|e| ApiError::bad_request(e.to_string()))?;
        let response = forward(cp, &node.row, caller, request).await?;
        if !response.status().is_success() {
            let why = format!("node {} answered {}", node.row.id, response.status());
            return Err(ApiError::new(ErrorCode::NodeUnreachable, why));
        }
        if let (_, Some(json)) = read_answer(response).await? {
            answers.push(json);
        }
    }
    Ok(answers)
}

/// `field` of every live node's answer to the list `request` asks for (with
/// its query), all in one list.
async fn gather(
    cp: &ControlPlane,
    caller: &Caller,
    request: Request,
    field: &str,
) -> Result<Vec<serde_json::Value>, ApiError> {
    let path_and_query = request.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
    Ok(ask_all(cp, caller, &path_and_query)
        .await?
        .into_iter()
        .flat_map(|answer| answer[field].as_array().cloned().unwrap_or_default())
        .collect())
}

async fn list(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ApiError> {
    let query = request.uri().query().unwrap_or_default().to_string();
    let mut sandboxes = gather(cp, caller, request, "sandboxes").await?;
    let wants_failed = !query.contains("state=") || query.contains("state=failed");
    let lost: Vec<String> = nodes(cp)?.into_iter().filter(|n| !n.alive).map(|n| n.row.id).collect();
    if wants_failed {
        for placement in cp.store.placements(&caller.tenant)?.into_iter().filter(|p| lost.contains(&p.node_id)) {
            let why = format!("node {} stopped answering", placement.node_id);
            sandboxes.extend(lost_sandbox(&placement, &why));
        }
    }
    sandboxes.sort_by(|a, b| a["created_at"].as_str().cmp(&b["created_at"].as_str()));
    Ok(axum::Json(serde_json::json!({"sandboxes": sandboxes})).into_response())
}

/// `GET /v1/usage`: what the tenant holds on every live node, added up,
/// against its quotas (kept in PostgreSQL).
async fn usage(cp: &ControlPlane, caller: &Caller) -> Result<Response, ApiError> {
    let quotas = crate::disk::quota_limits(&cp.store.tenant_quotas(&caller.tenant)?);
    let mut total =
        serde_json::json!({"tenant": caller.tenant, "sandboxes": 0, "vcpus": 0, "memory_mib": 0, "disk": {}});
    for answer in ask_all(cp, caller, "/v1/usage").await? {
        for field in ["sandboxes", "vcpus", "memory_mib"] {
            total[field] = (total[field].as_u64().unwrap_or(0) + answer[field].as_u64().unwrap_or(0)).into();
        }
        for (field, value) in answer["disk"].as_object().cloned().unwrap_or_default() {
            let sum = total["disk"][&field].as_u64().unwrap_or(0) + value.as_u64().unwrap_or(0);
            total["disk"][&field] = sum.into();
        }
    }
    total["quotas"] = serde_json::to_value(quotas).map_err(|e| ApiError::internal("quotas", e))?;
    let usage: space_api::Usage =
        serde_json::from_value(total).map_err(|e| ApiError::internal("adding up usage", e))?;
    Ok(axum::Json(usage).into_response())
}

/// A template build (or image import) goes to the live node with the most
/// memory left; the others pull it once it is there.
async fn build(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    // A JSON body is read to find a snapshot template's sandbox; an image
    // archive streams on untouched.
    let json = parts.headers.get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let (body, source) = if json {
        let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
            .await
            .map_err(|_| ApiError::new(ErrorCode::TooLarge, "the request body is too large"))?;
        let from = serde_json::from_slice::<serde_json::Value>(&bytes).ok().map(|b| b["from"].clone());
        let source = from.and_then(|f| f["sandbox"].as_str().or(f["checkpoint"]["sandbox"].as_str()).map(String::from));
        (Body::from(bytes), source)
    } else {
        (body, None)
    };
    // A snapshot template is made on its sandbox's node (and stays there).
    let node = match source {
        Some(id) => {
            let placement = cp.store.placement(&id)?.filter(|p| p.tenant == caller.tenant);
            live_node(cp, &placement.ok_or_else(|| ApiError::not_found("sandbox", &id))?.node_id)?
        }
        None => nodes(cp)?
            .into_iter()
            .filter(|n| n.alive)
            .max_by_key(|n| n.report.capacity_mib as i64 - n.report.promised_mib as i64)
            .map(|n| n.row)
            .ok_or_else(|| ApiError::unavailable("no live node to build on"))?,
    };
    let max_disk_mib = cp.store.tenant_quotas(&caller.tenant)?.max_disk_mib;
    parts.extensions.insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    forward_recording(cp, caller, node, Request::from_parts(parts, body)).await
}

/// `GET /v1/templates/{name}` answers from a live node that has it;
/// `DELETE` deletes it on every live node that has it (a node that refuses,
/// say because a sandbox there uses it, keeps it, and the others pull it
/// back once [`DELETE_HOLD`] has passed: the answer is that node's
/// refusal). A node away at the time keeps its copy, and spreads it again
/// when it is back.
async fn template(cp: &ControlPlane, caller: &Caller, name: &str, request: Request) -> Result<Response, ApiError> {
    let holders: Vec<Node> =
        nodes(cp)?.into_iter().filter(|n| n.alive && n.report.templates.iter().any(|t| t == name)).collect();
    if holders.is_empty() {
        return Err(crate::templates::template_not_found(name).into());
    }
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    // No replica asks a node it was deleted on to pull it back from one it
    // is not deleted on yet. A tenant's delete holds pulls only once the
    // first node has allowed it: a refused one (a shared template, 403)
    // must not stop the template's replication.
    let hold = || -> Result<(), ApiError> {
        let every: Vec<String> = nodes(cp)?.into_iter().map(|n| n.row.id).collect();
        Ok(cp.store.hold_template_pulls(&every, name, now_ms() + DELETE_HOLD.as_millis() as i64)?)
    };
    let mut held = false;
    if method == Method::DELETE && caller.is_operator() {
        hold()?;
        held = true;
    }
    let mut last = None;
    for node in &holders {
        let request = Request::builder()
            .method(method.clone())
            .uri(&path)
            .body(Body::empty())
            .map_err(|e| ApiError::internal("a request", e))?;
        let response = forward(cp, &node.row, caller, request).await?;
        if method == Method::GET || !response.status().is_success() {
            return Ok(response);
        }
        if !held {
            hold()?;
            held = true;
        }
        last = Some(response);
    }
    last.ok_or_else(|| ApiError::internal("deleting a template", "no node answered"))
}

/// `GET /v1/operations`: the tenant's operations on every live node, oldest
/// first.
async fn operations(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ApiError> {
    let mut operations = gather(cp, caller, request, "operations").await?;
    operations.sort_by(|a, b| a["created_at"].as_str().cmp(&b["created_at"].as_str()));
    Ok(axum::Json(serde_json::json!({"operations": operations})).into_response())
}

/// Every template any live node has (the first node's copy of each name).
async fn templates(cp: &ControlPlane, caller: &Caller, _request: Request) -> Result<Response, ApiError> {
    let mut seen = std::collections::BTreeMap::new();
    for answer in ask_all(cp, caller, "/v1/templates").await? {
        for template in answer["templates"].as_array().cloned().unwrap_or_default() {
            let name = template["name"].as_str().unwrap_or_default().to_string();
            seen.entry(name).or_insert(template);
        }
    }
    Ok(axum::Json(serde_json::json!({"templates": seen.into_values().collect::<Vec<_>>()})).into_response())
}

// ---- the E2B-compatible API ------------------------------------------------------

/// `/e2b/...` through the control plane, answering in E2B's error shape:
/// envd requests go to the node of the sandbox their `E2b-Sandbox-Id`
/// names, with the sandbox's own access token (checked by the node);
/// control requests are authenticated here by `X-API-KEY` and placed,
/// gathered or forwarded like their `/v1` kin.
async fn e2b(cp: &ControlPlane, request: Request) -> Result<Response, crate::e2b::E2bError> {
    use crate::e2b::E2bError;
    let path = request.uri().path().to_string();
    if path.starts_with("/e2b/envd/") {
        let id = request.headers().get("e2b-sandbox-id").and_then(|v| v.to_str().ok()).unwrap_or_default();
        // Only the sandbox's node can check its token: an id that names no
        // sandbox here (or one whose node is lost) answers what a node says
        // to a wrong token, so no caller learns which ids exist.
        let missing = crate::e2b::target::wrong_token;
        let placement = cp.store.placement(id)?.ok_or_else(missing)?;
        let node = live_node(cp, &placement.node_id).map_err(|_| missing())?;
        return Ok(relay_to(cp, &node, None, request).await?);
    }
    let key = request.headers().get("x-api-key").and_then(|v| v.to_str().ok()).filter(|k| !k.is_empty());
    let key = key.ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "missing API key: send X-API-KEY"))?;
    let caller = caller_for_key(cp, key)?;
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = request.method().clone();
    match (&method, parts.as_slice()) {
        (&Method::POST, ["e2b", "sandboxes"] | ["e2b", "v2", "sandboxes"]) => e2b_create(cp, &caller, request).await,
        (&Method::GET, ["e2b", "sandboxes"] | ["e2b", "v2", "sandboxes"]) => e2b_list(cp, &caller, request).await,
        (_, ["e2b", "sandboxes", id, ..] | ["e2b", "v2", "sandboxes", id, ..]) => {
            let missing = || E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"));
            let placement = cp.store.placement(id)?.filter(|p| p.tenant == caller.tenant).ok_or_else(missing)?;
            let node = live_node(cp, &placement.node_id)?;
            let killed = method == Method::DELETE && parts.len() == 3;
            let response = forward(cp, &node, &caller, request).await?;
            if killed && response.status().is_success() {
                mark_gone(cp, id, &node.id, &caller, "deleted")?;
            }
            Ok(response)
        }
        // What E2B has and SPACE does not: any node says so.
        _ => {
            let node = nodes(cp)?.into_iter().find(|n| n.alive).ok_or_else(|| ApiError::unavailable("no live node"))?;
            Ok(forward(cp, &node.row, &caller, request).await?)
        }
    }
}

/// E2B's create: placed like `/v1`'s (its `templateID`, default `base`),
/// and recorded with the sandbox as `/v1` shows it.
async fn e2b_create(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, crate::e2b::E2bError> {
    use crate::e2b::E2bError;
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, "the request body is too large"))?;
    let body: serde_json::Value = match bytes.is_empty() {
        true => serde_json::json!({}),
        false => serde_json::from_slice(&bytes).map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, e.to_string()))?,
    };
    let name = body["templateID"].as_str().unwrap_or("base");
    let key = parts.headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string);
    let placed = place(cp, caller, &serde_json::json!({"template": name}), key.as_deref()).await;
    let (node, allowance) = match placed {
        // E2B's code interpreter template, served by SPACE's (as on a node).
        Err(err) if err.code == ErrorCode::TemplateNotFound && name == space_api::e2b::E2B_CODE_INTERPRETER => {
            let served = serde_json::json!({"template": space_host::template::CODE_INTERPRETER_TEMPLATE});
            place(cp, caller, &served, key.as_deref()).await?
        }
        placed => placed?,
    };
    parts.extensions.insert(allowance);
    let response = forward(cp, &node, caller, Request::from_parts(parts, Body::from(bytes))).await?;
    if !response.status().is_success() {
        return Ok(response);
    }
    let (response, answer) = read_answer(response).await?;
    let id = answer.as_ref().and_then(|a| a["sandboxID"].as_str()).unwrap_or_default().to_string();
    let request = Request::get(format!("/v1/sandboxes/{id}"))
        .body(Body::empty())
        .map_err(|e| ApiError::internal("a request", e))?;
    if let (_, Some(sandbox)) = read_answer(forward(cp, &node, caller, request).await?).await? {
        cp.store.put_placement(&id, &node.id, &caller.tenant, &sandbox.to_string(), now_ms())?;
    }
    Ok(response)
}

/// E2B's list: every live node's, in E2B's order and pages.
async fn e2b_list(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, crate::e2b::E2bError> {
    // Each node's whole list, its filters passed on as sent (E2B encodes
    // metadata its own way), then one page of them all, as a node pages.
    let raw = request.uri().query().unwrap_or_default().to_string();
    let query: std::collections::BTreeMap<String, String> = space_api::e2b::form_pairs(&raw).into_iter().collect();
    let mut asked: Vec<&str> =
        raw.split('&').filter(|p| !p.is_empty() && !p.starts_with("limit=") && !p.starts_with("nextToken=")).collect();
    let whole = format!("limit={}", usize::MAX);
    asked.push(&whole);
    let path = format!("{}?{}", request.uri().path(), asked.join("&"));
    let mut listed = Vec::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let asking = Request::get(&path).body(Body::empty()).map_err(|e| ApiError::internal("a request", e))?;
        let response = forward(cp, &node.row, caller, asking).await?;
        if !response.status().is_success() {
            return Ok(response);
        }
        if let (_, Some(serde_json::Value::Array(some))) = read_answer(response).await? {
            listed.extend(
                some.into_iter().map(|s| (space_api::e2b::parse_time(s["startedAt"].as_str().unwrap_or("")), s)),
            );
        }
    }
    crate::e2b::wire::page(listed, &query)
}

// ---- secrets ---------------------------------------------------------------------

/// `PUT` or `DELETE /v1/secrets/{name}`: kept in PostgreSQL, then sent to
/// every live node at once (a node missed, or started later, gets the set
/// with its next heartbeat), so a sandbox created next can bind it.
async fn secret(cp: &ControlPlane, caller: &Caller, name: &str, request: Request) -> Result<Response, ApiError> {
    let Some(keyring) = &cp.keyring else {
        return Err(ApiError::new(
            ErrorCode::NotInClusterMode,
            "this control plane keeps no secrets: start it with --secrets-key-file",
        ));
    };
    let answer = if request.method() == Method::PUT {
        use axum::extract::FromRequest as _;
        let space_http::extract::ApiJson(put) =
            space_http::extract::ApiJson::<space_api::PutSecretRequest>::from_request(request, &()).await?;
        axum::Json(crate::secrets::put_secret(&cp.store, keyring, &caller.tenant, name, put)?).into_response()
    } else {
        crate::secrets::delete_secret(&cp.store, &caller.tenant, name)?;
        StatusCode::NO_CONTENT.into_response()
    };
    let set = serde_json::to_vec(&crate::secrets::secret_set(&cp.store, keyring)?)
        .map_err(|e| ApiError::internal("the secrets", e))?;
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let request = Request::post("/internal/v1/secrets")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(set.clone()))
            .map_err(|e| ApiError::internal("a request", e))?;
        match forward(cp, &node.row, &Caller::operator(), request).await {
            Ok(response) if response.status().is_success() => {}
            Ok(response) => tracing::warn!(node = %node.row.id, "sending the secrets: {}", response.status()),
            Err(err) => tracing::warn!(node = %node.row.id, "sending the secrets: {}", err.message),
        }
    }
    Ok(answer)
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

// ---- events from the nodes ---------------------------------------------------

impl crate::api::events::EventLog for ControlPlane {
    fn store(&self) -> &Store {
        &self.store
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FeedQuery {
    #[serde(default)]
    after: u64,
}

/// An idle feed sends an empty line this often, so a dead control plane
/// (or node) is noticed.
const FEED_KEEPALIVE: Duration = Duration::from_secs(15);

/// `GET /internal/v1/events?after=N` on a node: every tenant's events
/// after id N, then each one as it commits, as NDJSON lines of
/// [`crate::store::FeedEvent`], for the control plane to take in.
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
    let feed = Feed { platform: state.platform.clone(), after: query.after, head: state.platform.store.event_head() };
    let lines = futures_util::stream::unfold(feed, |mut feed| async move {
        loop {
            feed.head.borrow_and_update();
            let batch = match feed.platform.store.feed(feed.after, 500) {
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

/// What each replica does for as long as it runs: claims the feeds of the
/// live nodes nobody else follows (in PostgreSQL, renewed every
/// [`HEARTBEAT`], lapsing after [`LEASE`]) and takes their events in, so
/// `GET /v1/events` on any replica shows the whole cluster's; announces a
/// lost node's sandboxes as failed, and as they are when it comes back.
pub async fn follow_feeds(cp: Arc<ControlPlane>) {
    let owner = crate::ids::new_id("replica");
    let mut following: std::collections::HashMap<String, tokio::task::JoinHandle<()>> = Default::default();
    loop {
        following.retain(|_, task| !task.is_finished());
        if let Err(err) = feeds_once(&cp, &owner, &mut following).await {
            tracing::warn!("following the nodes' events: {}", err.message);
        }
        tokio::time::sleep(HEARTBEAT).await;
    }
}

async fn feeds_once(
    cp: &Arc<ControlPlane>,
    owner: &str,
    following: &mut std::collections::HashMap<String, tokio::task::JoinHandle<()>>,
) -> Result<(), ApiError> {
    for node in nodes(cp)? {
        let id = node.row.id.clone();
        if !node.alive {
            if let Some(task) = following.remove(&id) {
                task.abort();
            }
            if cp.store.mark_feed_lost(&id, true)? {
                announce_lost(cp, &node)?;
            }
            continue;
        }
        let now = now_ms();
        let Some(last) = cp.store.claim_feed(&id, owner, now, now + LEASE.as_millis() as i64)? else {
            if let Some(task) = following.remove(&id) {
                task.abort();
            }
            continue;
        };
        if cp.store.mark_feed_lost(&id, false)? {
            // One request per sandbox it has: not in the way of the claims.
            let (cp, row) = (cp.clone(), node.row.clone());
            tokio::spawn(async move {
                if let Err(err) = announce_back(&cp, &row).await {
                    tracing::warn!(node = %row.id, "announcing its sandboxes back: {}", err.message);
                }
            });
        }
        if let std::collections::hash_map::Entry::Vacant(entry) = following.entry(id) {
            let (cp, owner, row) = (cp.clone(), owner.to_string(), node.row.clone());
            entry.insert(tokio::spawn(async move {
                if let Err(err) = take_feed(&cp, &owner, &row, last).await {
                    tracing::warn!(node = %row.id, "its events: {err}");
                }
            }));
        }
    }
    Ok(())
}

/// Follows one node's feed from after `last`, taking each batch in while
/// this replica's claim holds.
async fn take_feed(cp: &ControlPlane, owner: &str, node: &NodeRow, mut last: u64) -> Result<(), ExchangeError> {
    use futures_util::StreamExt as _;
    let request = Request::get(format!("/internal/v1/events?after={last}")).body(Body::empty())?;
    let response = forward(cp, node, &Caller::operator(), request).await.map_err(ExchangeError::Forward)?;
    if response.status() != StatusCode::OK {
        return Err(ExchangeError::Status { status: response.status(), body: String::new() });
    }
    let mut body = response.into_body().into_data_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        pending.extend_from_slice(&chunk.map_err(ExchangeError::Body)?);
        let Some(end) = pending.iter().rposition(|b| *b == b'\n') else {
            continue;
        };
        let complete: Vec<u8> = pending.drain(..=end).collect();
        let events = complete
            .split(|b| *b == b'\n')
            .filter(|line| !line.is_empty())
            .map(serde_json::from_slice::<crate::store::FeedEvent>)
            .collect::<Result<Vec<_>, _>>()
            .map_err(ExchangeError::FeedLine)?;
        let Some(newest) = events.last().map(|e| e.seq) else {
            continue;
        };
        if !cp.store.ingest(&node.id, owner, last, &events)? {
            return Err(ExchangeError::Overtaken);
        }
        last = newest;
    }
    Err(ExchangeError::FeedEnded)
}

/// A `sandbox.state` event of a sandbox as the control plane shows it.
fn state_event(sandbox: serde_json::Value) -> Option<space_api::Event> {
    let sandbox: space_api::Sandbox = serde_json::from_value(sandbox).ok()?;
    let mut event = crate::store::new_event(space_api::EventType::SandboxState, Some(&sandbox.id));
    event.sandbox = Some(sandbox);
    Some(event)
}

fn announce_lost(cp: &ControlPlane, node: &Node) -> Result<(), ApiError> {
    let why = format!("node {} stopped answering", node.row.id);
    let events: Vec<(String, space_api::Event)> = cp
        .store
        .placements_on(&node.row.id)?
        .iter()
        .filter_map(|p| Some((p.tenant.clone(), state_event(lost_sandbox(p, &why)?)?)))
        .collect();
    tracing::warn!(node = %node.row.id, sandboxes = events.len(), "a node is lost: its sandboxes are failed");
    Ok(cp.store.add_events(&events)?)
}

async fn announce_back(cp: &ControlPlane, node: &NodeRow) -> Result<(), ApiError> {
    let mut events = Vec::new();
    // Those that were announced lost (not those deleted before).
    for placement in cp.store.placements_on(&node.id)?.into_iter().filter(|p| lost_sandbox(p, "").is_some()) {
        let id = serde_json::from_str::<serde_json::Value>(&placement.sandbox).unwrap_or_default()["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let caller = Caller::tenant(placement.tenant.clone());
        let request = Request::get(format!("/v1/sandboxes/{id}"))
            .body(Body::empty())
            .map_err(|e| ApiError::internal("a request", e))?;
        let response = forward(cp, node, &caller, request).await?;
        if response.status() != StatusCode::OK {
            continue;
        }
        if let (_, Some(sandbox)) = read_answer(response).await? {
            events.extend(state_event(sandbox).map(|e| (placement.tenant.clone(), e)));
        }
    }
    tracing::info!(node = %node.id, sandboxes = events.len(), "a lost node is back");
    Ok(cp.store.add_events(&events)?)
}

/// Wakes this replica's event followers when another replica took events in.
pub async fn watch_event_head(cp: Arc<ControlPlane>) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if cp.store.followed() {
            if let Err(err) = cp.store.refresh_event_head() {
                tracing::warn!("reading the newest event's id: {err}");
            }
        }
    }
}

// ---- templates between nodes -------------------------------------------------

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

/// On the control plane: a node's heartbeat.
impl axum::extract::FromRequestParts<Shared> for NodeToken {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, cp: &Shared) -> Result<NodeToken, ApiError> {
        node_only(Some(&cp.node_token), &parts.headers)
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
    let export = tokio::task::spawn_blocking(move || space_host::template::export(&platform.data, &name))
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
    headers.insert("x-space-sha256", sum);
    let meta = base64::engine::general_purpose::STANDARD.encode(meta);
    headers.insert("x-space-template", HeaderValue::from_str(&meta).map_err(|e| ApiError::internal("a template", e))?);
    Ok(response)
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullRequest {
    /// The node that has it (`http://host:port`).
    pub from: String,
    pub name: String,
}

/// `POST /internal/v1/templates/pull` on a node: fetch a template from
/// another node, check it against its SHA-256 and make it a template here
/// (in the background; the node's next reports name it once it is there).
pub(crate) async fn pull_template(
    State(state): State<AppState>,
    NodeToken(token): NodeToken,
    space_http::extract::ApiJson(request): space_http::extract::ApiJson<PullRequest>,
) -> Result<StatusCode, ApiError> {
    if state.platform.data.template(&request.name).is_some() {
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
    let outgoing = hyper::Request::get(format!("/internal/v1/templates/{}", request.name))
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
        (text("x-space-sha256")?, text("x-space-template")?)
    };
    let meta = base64::engine::general_purpose::STANDARD.decode(meta).map_err(ExchangeError::MetaEncoding)?;
    let meta: space_host::template::TemplateMeta = serde_json::from_slice(&meta).map_err(ExchangeError::Meta)?;
    if meta.name != request.name {
        return Err(ExchangeError::WrongTemplate { asked: request.name, got: meta.name });
    }
    let dir = platform.data.run_dir().join("pulls");
    tokio::fs::create_dir_all(&dir).await.map_err(ExchangeError::io("making the pulls directory"))?;
    let path = dir.join(format!("{}-{}.tar", request.name, std::process::id()));
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
            tokio::task::spawn_blocking(move || space_host::template::import_export(&platform.data, &meta, &tar))
                .await
                .map_err(ExchangeError::ImportTask)
                .and_then(|r| r.map(drop).map_err(ExchangeError::Import))
        }
        false => Err(ExchangeError::Digest { got, expected }),
    };
    let _ = tokio::fs::remove_file(&path).await;
    result
}

/// What each replica does every few seconds: a live node that lacks a
/// template another live node has is told to pull it (claimed in the
/// database, so one replica asks, and asks again only if it never came).
pub async fn replicate_templates(cp: Arc<ControlPlane>) {
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        if let Err(err) = replicate_once(&cp).await {
            tracing::warn!("spreading templates: {}", err.message);
        }
    }
}

/// How long a deleted template is not spread again (while the nodes that
/// have it delete it, one after another).
const DELETE_HOLD: Duration = Duration::from_secs(60);

/// How long a node is given to pull a template before another try.
const PULL_PATIENCE: Duration = Duration::from_secs(600);

async fn replicate_once(cp: &ControlPlane) -> Result<(), ApiError> {
    let live: Vec<Node> = nodes(cp)?.into_iter().filter(|n| n.alive).collect();
    for node in &live {
        for source in &live {
            let spread = source.report.templates.iter().filter(|t| !source.report.local.contains(t));
            for name in spread.filter(|t| !node.report.templates.contains(t)) {
                if !cp.store.claim_template_pull(&node.row.id, name, now_ms(), PULL_PATIENCE.as_millis() as i64)? {
                    continue;
                }
                let body = serde_json::to_vec(&PullRequest { from: source.row.url.clone(), name: name.clone() })
                    .map_err(|e| ApiError::internal("a pull", e))?;
                let request = Request::post("/internal/v1/templates/pull")
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(body))
                    .map_err(|e| ApiError::internal("a pull", e))?;
                let answer = forward(cp, &node.row, &Caller::operator(), request).await?;
                if !answer.status().is_success() {
                    tracing::warn!(node = %node.row.id, template = %name, "asking for a pull: {}", answer.status());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(engine: &str, engines: &[&str], templates: &[&str]) -> NodeReport {
        NodeReport {
            id: "n".into(),
            url: "http://n.test:1".into(),
            engine: engine.into(),
            capacity_mib: 1024,
            promised_mib: 0,
            templates: templates.iter().map(|t| t.to_string()).collect(),
            sandboxes: vec![],
            secrets_epoch: 0,
            engines: engines.iter().map(|e| e.to_string()).collect(),
            pinned: Default::default(),
            local: vec![],
            sizes: Default::default(),
        }
    }

    #[test]
    fn a_create_is_sized_by_what_it_names_else_by_its_templates_reported_defaults() {
        let node = |alive: bool, sizes: &[(&str, u32, u32)]| {
            let mut report = report("gvisor", &["gvisor"], &["base", "big"]);
            report.sizes = sizes
                .iter()
                .map(|(t, vcpus, memory_mib)| (t.to_string(), TemplateSize { vcpus: *vcpus, memory_mib: *memory_mib }))
                .collect();
            let row =
                NodeRow { id: "n".into(), url: "http://n.test:1".into(), lease_until_ms: 0, report: String::new() };
            Node { row, report, alive }
        };
        let nodes = [node(false, &[("big", 8, 9999)]), node(true, &[("big", 4, 4096), ("base", 1, 512)])];
        let big = serde_json::json!({"template": "big"});
        assert_eq!(create_size(&big, &nodes), (4, 4096), "a live node's report, not a lost one's");
        let named = serde_json::json!({"template": "big", "vcpus": 2, "memory_mib": 1024});
        assert_eq!(create_size(&named, &nodes), (2, 1024));
        let unknown = serde_json::json!({"template": "nowhere"});
        assert_eq!(create_size(&unknown, &nodes), (1, 512), "a template no node reports: the defaults of none set");
    }

    #[test]
    fn a_node_runs_a_template_it_has_on_an_engine_it_can_run() {
        let gvisor = report("gvisor", &["gvisor"], &["base", "vm"]);
        let both = report("firecracker", &["firecracker", "gvisor"], &["base", "vm"]);
        assert!(gvisor.can_run("base", None) && both.can_run("base", None));
        assert!(!gvisor.can_run("other", None), "a template it lacks");
        assert!(!gvisor.can_run("vm", Some("firecracker")), "an engine it cannot run");
        assert!(both.can_run("vm", Some("firecracker")) && both.can_run("vm", Some("gvisor")));
        // A report from before engines were reported: its default engine.
        let old = report("gvisor", &[], &["base"]);
        assert!(old.can_run("base", Some("gvisor")) && !old.can_run("base", Some("firecracker")));
    }

    #[test]
    fn a_report_without_the_newer_fields_still_reads() {
        let old = r#"{"id":"n","url":"http://n.test:1","engine":"gvisor","capacity_mib":1,"promised_mib":0,
            "templates":["base"],"sandboxes":[]}"#;
        let report: NodeReport = serde_json::from_str(old).unwrap();
        assert!(report.engines.is_empty() && report.pinned.is_empty() && report.secrets_epoch == 0);
    }
}
