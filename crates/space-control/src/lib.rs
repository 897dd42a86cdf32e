//! A cluster's control plane (decision 009, `space serve --cluster`): it
//! keeps tenants, keys, the nodes with their leases and where each sandbox
//! and volume lives in PostgreSQL, places new sandboxes (with the volumes
//! they mount), moves volumes between nodes, counts tenants' quotas
//! cluster-wide, and forwards each request to its sandbox's node as a
//! stream. Nodes speak the v1 API; the messages that are the cluster's own
//! (a node's report, its event feed, a template pull, the disk allowance)
//! are `space_api::cluster`'s types.
//!
//! It must link neither the node runtime (`space-node`) nor the engines nor
//! the node's HTTP edge (`space-server`): it builds on the domain
//! (`space-core`), the store and `space-http`, and is handed the OpenAPI
//! document it serves (decision 020).
//!
//! Files import downwards only: `error`, `tasks` ← `state` ← `forward`
//! (relaying a user's request) ← `node_client` (the control plane's own
//! calls to a node, typed) ← `record` ← `quotas` ← `volumes` (which node
//! holds each volume, and its move) ← `place` ← the request handlers
//! (`lists`, `templates`, `secrets`, `e2b`) and the background loops
//! (`feeds`, `templates`) ← this file's router, which also starts the
//! loops (`ControlPlane::start`).

mod e2b;
pub mod error;
mod feeds;
mod forward;
mod lists;
mod node_client;
mod place;
mod quotas;
mod record;
mod secrets;
pub mod state;
mod templates;
mod volumes;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use space_api::cluster::{NodeReport, HEARTBEAT_PATH, LEASE};
use space_api::ErrorCode;
use space_core::tenants::Caller;

// How the control plane reaches its nodes, for its composition root.
pub use space_http::links::Links;

pub use crate::error::ControlError;
use crate::state::{live_node, nodes, now_ms};
pub use crate::state::{Config, ControlPlane};

type Shared = Arc<ControlPlane>;

impl ControlPlane {
    /// Starts what every replica does for as long as it runs: following
    /// the nodes' event feeds, spreading templates, and watching for events
    /// other replicas took in; [`ControlPlane::shutdown`] stops them. Called
    /// within a tokio runtime.
    pub fn start(self: &Arc<ControlPlane>) {
        self.tasks.spawn_cancellable(feeds::follow_feeds(self.clone()));
        self.tasks.spawn_cancellable(feeds::watch_event_head(self.clone()));
        self.tasks.spawn_cancellable(templates::replicate_templates(self.clone()));
    }
}

/// The control plane's API: nodes' heartbeats, its health, the console,
/// and every other request placed, gathered or forwarded to a node.
pub fn router(control_plane: Arc<ControlPlane>) -> Router {
    Router::new()
        .route(HEARTBEAT_PATH, post(heartbeat))
        .route("/v1/health", get(health))
        .merge(space_http::console::router())
        .fallback(public)
        .layer(axum::middleware::from_fn(space_http::server::close_if_body_unread))
        // Outermost: a preview host's request never reaches the API.
        .layer(axum::middleware::from_fn_with_state(control_plane.clone(), preview_first))
        .with_state(control_plane)
}

/// A request for a preview host goes to its sandbox's node, whatever its
/// path; a name in the preview domain that names no port is 404; every
/// other request goes on to the API.
async fn preview_first(State(cp): State<Shared>, request: Request, next: axum::middleware::Next) -> Response {
    use space_http::preview::Zone;
    let Some(domain) = cp.preview.get() else { return next.run(request).await };
    let mut hosts = request.headers().get_all(header::HOST).iter();
    let (host, more) = (hosts.next().cloned(), hosts.next().is_some());
    let authority = request.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
    let host = match (host, authority) {
        _ if more => return ControlError::bad_request("more than one Host header (RFC 9112 §3.2)").into_response(),
        (Some(host), Some(authority)) if !host.as_bytes().eq_ignore_ascii_case(authority.as_bytes()) => {
            return ControlError::bad_request("the Host header and the request's authority differ").into_response()
        }
        (Some(host), _) | (None, Some(host)) => host,
        (None, None) => return next.run(request).await,
    };
    match domain.classify(host.as_bytes()) {
        Zone::Api => next.run(request).await,
        Zone::Unknown => ControlError::new(ErrorCode::NotFound, space_http::preview::NO_SUCH_PREVIEW).into_response(),
        Zone::Port { id, port } => {
            // Without the node's keyring nothing here can check a proof: an
            // id placed nowhere answers as a private port does.
            let placed = match cp.store.cluster().placement(id.as_str()) {
                Ok(placed) => placed,
                Err(err) => return ControlError::from(err).into_response(),
            };
            let Some(placement) = placed else {
                return ControlError::new(ErrorCode::Forbidden, space_http::preview::private_port(port))
                    .into_response();
            };
            let node = match live_node(&cp, &placement.node_id) {
                Ok(node) => node,
                Err(lost) => return lost.into_response(),
            };
            forward::relay_preview(&cp, &node, &host, request).await.unwrap_or_else(IntoResponse::into_response)
        }
    }
}

/// The control plane's listener for nodes alone (`--cluster-listen`, over
/// the cluster's mutual TLS): heartbeats.
pub fn internal_router(control_plane: Arc<ControlPlane>) -> Router {
    Router::new()
        .route(HEARTBEAT_PATH, post(heartbeat))
        .layer(axum::middleware::from_fn(space_http::server::close_if_body_unread))
        .with_state(control_plane)
}

/// The node token of a heartbeat, checked before its body is read: a
/// caller without it learns nothing from how a malformed report would have
/// been refused.
struct NodeToken;

impl axum::extract::FromRequestParts<Shared> for NodeToken {
    type Rejection = ControlError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        cp: &Shared,
    ) -> Result<NodeToken, ControlError> {
        let presented = space_http::auth::bearer(&parts.headers).unwrap_or_default();
        if !space_proto::constant_time_eq(presented.as_bytes(), cp.node_token.as_bytes()) {
            return Err(ControlError::new(ErrorCode::Unauthorized, "internal routes need the node token"));
        }
        Ok(NodeToken)
    }
}

/// A node's report: kept with its lease, and answered with the cluster's
/// secrets when the node's are older.
async fn heartbeat(
    State(cp): State<Shared>,
    _token: NodeToken,
    body: axum::body::Bytes,
) -> Result<Response, ControlError> {
    let report: NodeReport =
        serde_json::from_slice(&body).map_err(|e| ControlError::bad_request(format!("a node report: {e}")))?;
    space_http::links::member_url(&report.url).map_err(|e| ControlError::bad_request(e.to_string()))?;
    let json = serde_json::to_string(&report).map_err(|e| ControlError::internal("a node report", e))?;
    cp.store.cluster().heartbeat_node(&report.id, &report.url, &json, now_ms() + LEASE.as_millis() as i64)?;
    // A node whose secrets are older (restarted, or away when one changed)
    // gets the whole set back.
    if let Some(keyring) = &cp.keyring {
        if report.secrets_epoch < cp.store.tenancy().secrets_epoch()? {
            return Ok(axum::Json(space_core::secrets::secret_set(&cp.store, keyring)?).into_response());
        }
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn health(State(cp): State<Shared>) -> Result<Response, ControlError> {
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
fn authenticate(cp: &ControlPlane, headers: &HeaderMap) -> Result<Caller, ControlError> {
    let offered = space_http::auth::websocket_bearer(headers);
    let Some(key) = space_http::auth::bearer(headers).or(offered.as_deref()) else {
        return Err(ControlError::new(ErrorCode::Unauthorized, "missing API key: send `Authorization: Bearer <key>`"));
    };
    caller_for_key(cp, key)
}

fn caller_for_key(cp: &ControlPlane, key: &str) -> Result<Caller, ControlError> {
    if space_proto::constant_time_eq(key.as_bytes(), cp.api_key.as_bytes()) {
        return Ok(Caller::operator());
    }
    match cp.store.tenancy().key_tenant(&space_core::tenants::hash_key(key))? {
        Some(tenant) => Ok(Caller::tenant(tenant)),
        None => Err(ControlError::new(ErrorCode::Unauthorized, "the API key is not valid")),
    }
}

async fn public(State(cp): State<Shared>, request: Request) -> Response {
    match route(cp, request).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn route(cp: Shared, request: Request) -> Result<Response, ControlError> {
    if request.uri().path().starts_with("/e2b/") {
        return Ok(e2b::e2b(&cp, request).await.unwrap_or_else(IntoResponse::into_response));
    }
    let caller = authenticate(&cp, request.headers())?;
    let path = request.uri().path().to_string();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = request.method().clone();
    match (&method, parts.as_slice()) {
        (&Method::POST, ["v1", "sandboxes"]) => place::create(&cp, &caller, request).await,
        (&Method::GET, ["v1", "sandboxes"]) => lists::list(&cp, &caller, request).await,
        (_, ["v1", "sandboxes", id, ..]) => {
            let id = id.to_string();
            place::sandbox_request(&cp, &caller, &id, request).await
        }
        (&Method::GET, ["v1", "operations", id] | ["v1", "operations", id, "log"]) => {
            let Some((node_id, tenant)) = cp.store.cluster().operation_node(id)? else {
                return Err(ControlError::not_found("operation", id));
            };
            if tenant != caller.tenant {
                return Err(ControlError::not_found("operation", id));
            }
            let node = live_node(&cp, &node_id)?;
            forward::forward(&cp, &node, &caller, request).await
        }
        (&Method::POST, ["v1", "volumes"]) => volumes::create(&cp, &caller, request).await,
        (&Method::GET, ["v1", "volumes"]) => volumes::list(&cp, &caller).await,
        (&Method::POST, ["v1", "volumes", name, "move"]) => {
            let name = name.to_string();
            volumes::move_volume(&cp, &caller, &name, request).await
        }
        (_, ["v1", "volumes", name, ..]) => {
            let name = name.to_string();
            volumes::volume_request(&cp, &caller, &name, request).await
        }
        (&Method::GET, ["v1", "templates"]) => lists::templates(&cp, &caller).await,
        (&Method::GET | &Method::DELETE, ["v1", "templates", name]) => {
            let name = name.to_string();
            templates::template(&cp, &caller, &name, request).await
        }
        (&Method::GET, ["v1", "operations"]) => lists::operations(&cp, &caller, request).await,
        (&Method::GET, ["v1", "openapi.json"]) => {
            Ok(([(header::CONTENT_TYPE, "application/json")], cp.openapi.clone()).into_response())
        }
        (&Method::POST, ["v1", "templates"]) => templates::build(&cp, &caller, request).await,
        (&Method::GET, ["v1", "usage"]) => quotas::usage(&cp, &caller).await,
        (&Method::GET, ["v1", "secrets"]) => {
            Ok(axum::Json(space_api::SecretList { secrets: cp.store.tenancy().secrets(&caller.tenant)? })
                .into_response())
        }
        (&Method::PUT | &Method::DELETE, ["v1", "secrets", name]) => {
            let name = name.to_string();
            secrets::secret(&cp, &caller, &name, request).await
        }
        (&Method::GET, ["v1", "events"]) => {
            use axum::extract::FromRequestParts as _;
            let (mut parts, _) = request.into_parts();
            let space_http::extract::ApiQuery(query) =
                space_http::extract::ApiQuery::from_request_parts(&mut parts, &()).await?;
            // Another replica may have taken events in since this one looked.
            cp.store.refresh_event_head()?;
            Ok(space_http::events::serve(cp.clone(), caller.tenant, query, &parts.headers)?)
        }
        _ => Err(ControlError::new(
            ErrorCode::NotInClusterMode,
            format!("{method} {path} is not served by a cluster's control plane yet (decision 009)"),
        )),
    }
}
