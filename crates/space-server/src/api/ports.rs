//! `/v1/sandboxes/{id}/ports/{port}/{path}`: HTTP (and WebSocket) to a
//! server listening on that port inside the sandbox — a dev server, a
//! notebook, an app an agent built — through the agent's channel (the
//! sandbox has no network device). A WebSocket asking for the `space-tcp`
//! subprotocol on `/v1/sandboxes/{id}/ports/{port}` is a raw TCP tunnel
//! instead (`space port-forward`): binary messages carry the bytes.

use std::time::Duration;

use axum::body::Body;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hyper_util::rt::TokioIo;
use space_api::{ErrorBody, ErrorCode, PortAccess, PortAccessUpdate, PortList, PreviewLink};
use space_http::extract::{ApiJson, NoQuery};
use space_http::proxy::{inward_headers, relay, tunnel_tcp};

use super::access::{PortPath, SandboxPath};
use crate::access::OwnedSandbox;
use crate::error::ApiError;
use crate::preview::{self, Forwarded};
use crate::state::AppState;

/// How long the agent may take to connect to the port.
const CONNECT_PATIENCE: Duration = Duration::from_secs(10);
/// The WebSocket subprotocol of a raw TCP tunnel.
pub const TCP_PROTOCOL: &str = "space-tcp";

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}/{path}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "A port a server listens on inside the sandbox"),
        ("path" = String, Path, description = "The path on that server")),
    responses((status = 200, description = "Whatever the server in the sandbox answers (any method; WebSocket upgrades too)"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "Nothing listens on that port in the sandbox (`port_closed`)", body = ErrorBody)))]
pub async fn proxy(
    PortPath { sandbox, port, path }: PortPath,
    State(state): State<AppState>,
    request: Request,
) -> Result<Response, ApiError> {
    forward(state, sandbox, port, path, request).await
}

/// The server's root (`.../ports/{port}` and `.../ports/{port}/`), and the
/// TCP tunnel.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "A port a server listens on inside the sandbox")),
    responses((status = 200, description = "The server's root (any method; WebSocket upgrades too); a WebSocket offering the `space-tcp` subprotocol is a raw TCP tunnel to the port"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "Nothing listens on that port in the sandbox (`port_closed`)", body = ErrorBody)))]
pub async fn proxy_root(
    PortPath { sandbox, port, .. }: PortPath,
    State(state): State<AppState>,
    request: Request,
) -> Result<Response, ApiError> {
    let tunnel = request
        .headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|p| p.trim() == TCP_PROTOCOL));
    if tunnel {
        let port = checked_port(&port)?;
        let agent = running_agent(&state, &sandbox).await?;
        let (mut parts, _) = request.into_parts();
        let upgrade = WebSocketUpgrade::from_request_parts(&mut parts, &state)
            .await
            .map_err(|e| ApiError::bad_request(format!("a TCP tunnel is a WebSocket upgrade: {e}")))?;
        let stream = open(&agent, port).await?;
        let io = stream.into_io();
        return Ok(upgrade.protocols([TCP_PROTOCOL]).on_upgrade(move |socket| tunnel_tcp(socket, io)).into_response());
    }
    forward(state, sandbox, port, String::new(), request).await
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports", tag = "sandboxes", operation_id = "list_ports",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, description = "The sandbox's preview token and its public ports", body = PortList),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn list(
    SandboxPath { sandbox, .. }: SandboxPath,
    State(state): State<AppState>,
    _: NoQuery,
    headers: HeaderMap,
) -> Result<Json<PortList>, ApiError> {
    let access = state.platform.port_access(&sandbox)?;
    let ports = access
        .public
        .iter()
        .map(|&port| PortAccess { port, public: true, url: preview::url(&state, &headers, sandbox.id(), port) })
        .collect();
    Ok(Json(PortList {
        preview_domain: state.preview.as_ref().map(|d| d.as_str().to_string()),
        preview_token: preview::token(&state, sandbox.id())?,
        all_public: access.all_public,
        ports,
    }))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/ports/{port}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "A port of the sandbox")),
    request_body = PortAccessUpdate,
    responses((status = 200, description = "Who may open the port on its preview host from now on (kept across restarts)", body = PortAccess),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn set_access(
    PortPath { sandbox, port, .. }: PortPath,
    State(state): State<AppState>,
    _: NoQuery,
    headers: HeaderMap,
    ApiJson(update): ApiJson<PortAccessUpdate>,
) -> Result<Json<PortAccess>, ApiError> {
    let port = checked_port(&port)?;
    let access = state.platform.set_port_public(&sandbox, port, update.public)?;
    let url = preview::url(&state, &headers, sandbox.id(), port);
    Ok(Json(PortAccess { port, public: access.is_public(port), url }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}/link", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "A port of the sandbox")),
    responses((status = 200, description = "A signed URL on the port's preview host, to open within five minutes", body = PreviewLink),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The server has no preview domain (`not_supported`)", body = ErrorBody)))]
pub async fn link(
    PortPath { sandbox, port, .. }: PortPath,
    State(state): State<AppState>,
    _: NoQuery,
    headers: HeaderMap,
) -> Result<Json<PreviewLink>, ApiError> {
    let port = checked_port(&port)?;
    let Some(base) = preview::url(&state, &headers, sandbox.id(), port) else {
        return Err(ApiError::new(
            ErrorCode::NotSupported,
            "this server has no preview domain (space serve --preview-domain): use the path form",
        ));
    };
    let (path, expires) = preview::link_path(&state, sandbox.id(), port)?;
    let public = state.platform.port_access(&sandbox)?.is_public(port);
    let expires_at = space_api::Timestamp::from(std::time::UNIX_EPOCH + Duration::from_secs(expires));
    Ok(Json(PreviewLink { url: format!("{}{}", base.trim_end_matches('/'), path), expires_at, port, public }))
}

fn checked_port(port: &str) -> Result<u16, ApiError> {
    port.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("a port is a number from 1 to 65535, not {port:?}")))
}

/// The agent of a sandbox that runs (woken first if the server paused it
/// for idleness), through a session held while the port is opened.
async fn running_agent(state: &AppState, sandbox: &OwnedSandbox) -> Result<space_engine::AgentConn, ApiError> {
    let session = state.platform.session(sandbox).await?;
    Ok(session.agent("reach a port in it")?.clone())
}

async fn open(agent: &space_engine::AgentConn, port: u16) -> Result<space_engine::EgressStream, ApiError> {
    agent.open_port(port, CONNECT_PATIENCE).await.map_err(|err| match err {
        space_engine::AgentError::PortClosed(why) => {
            ApiError::new(ErrorCode::PortClosed, why).with_details(serde_json::json!({"port": port}))
        }
        other => ApiError::new(ErrorCode::PortUnreachable, format!("port {port}: {other}"))
            .with_details(serde_json::json!({"port": port})),
    })
}

async fn forward(
    state: AppState,
    sandbox: OwnedSandbox,
    port: String,
    path: String,
    request: Request,
) -> Result<Response, ApiError> {
    let port = checked_port(&port)?;
    // Its own path (as the caller wrote it, still percent-encoded).
    let query = request.uri().query().map(|q| format!("?{q}")).unwrap_or_default();
    let uri = format!("/{}{query}", path_in_sandbox(request.uri().path()).unwrap_or(&path));
    let prefix = format!("/v1/sandboxes/{}/ports/{port}", sandbox.id());
    to_port(state, sandbox, port, uri, request, Forwarded { prefix: Some(prefix), proto: None, host: None }).await
}

/// Relays `request` to `port` of `sandbox` as `uri` (a path and query),
/// streaming both ways, an upgrade spliced: the path form's and a
/// preview's. The request as the server in the sandbox sees it: no
/// credential of the caller, one framing, its own host; the sandbox
/// counts as active while the answer streams.
pub(crate) async fn to_port(
    state: AppState,
    sandbox: OwnedSandbox,
    port: u16,
    uri: String,
    mut request: Request,
    forwarded: Forwarded,
) -> Result<Response, ApiError> {
    let mut inward = inward_headers(request.headers())?;
    crate::preview::without_preview_cookie(&mut inward);
    let agent = running_agent(&state, &sandbox).await?;
    let stream = open(&agent, port).await?;
    state.platform.mark_active(&sandbox);
    let upgrade = request.headers().get(header::UPGRADE).cloned();
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (parts, body) = request.into_parts();
    let mut outgoing = hyper::Request::builder()
        .method(parts.method)
        .uri(&uri)
        .body(body)
        .map_err(|e| ApiError::bad_request(format!("{uri:?}: {e}")))?;
    *outgoing.headers_mut() = inward;
    let headers = outgoing.headers_mut();
    if let Some(upgrade) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
    headers.insert(header::HOST, HeaderValue::from_str(&format!("localhost:{port}")).expect("a host"));
    if let Some(prefix) = forwarded.prefix.and_then(|p| HeaderValue::from_str(&p).ok()) {
        headers.insert("x-forwarded-prefix", prefix);
    }
    if let Some(proto) = forwarded.proto {
        headers.insert("x-forwarded-proto", HeaderValue::from_static(proto));
    }
    let host = forwarded.host.or_else(|| parts.headers.get(header::HOST).cloned());
    let host = host.or_else(|| parts.uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    if let Some(host) = host {
        headers.insert("x-forwarded-host", host);
    }

    let response = relay(TokioIo::new(stream.into_io()), outgoing, client_side)
        .await
        .map_err(|e| ApiError::new(ErrorCode::PortUnreachable, format!("port {port}: {e}")))?;
    Ok(response.map(|body| Body::new(Active::new(body, state, sandbox))))
}

/// An answer's body that keeps its sandbox counted as active while it
/// streams (a download, server-sent events), without holding the sandbox's
/// work gate (which a checkpoint would wait on for as long as a stream
/// lasts); and once more at its end.
struct Active {
    inner: Body,
    state: AppState,
    sandbox: OwnedSandbox,
    marked: std::time::Instant,
}

/// How often a streaming answer stamps its sandbox active, at most.
const ACTIVE_EVERY: Duration = Duration::from_secs(1);

impl Active {
    fn new(inner: Body, state: AppState, sandbox: OwnedSandbox) -> Active {
        Active { inner, state, sandbox, marked: std::time::Instant::now() }
    }
}

impl hyper::body::Body for Active {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if polled.is_ready() && self.marked.elapsed() >= ACTIVE_EVERY {
            self.marked = std::time::Instant::now();
            self.state.platform.mark_active(&self.sandbox);
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

impl Drop for Active {
    fn drop(&mut self) {
        if self.marked.elapsed() >= ACTIVE_EVERY {
            self.state.platform.mark_active(&self.sandbox);
        }
    }
}

/// The path on the server in the sandbox as the caller wrote it (still
/// percent-encoded: decoding would turn `%2F` into a separator, `%3F` into a
/// query and `%20` into a refused target), from the request's path
/// `/v1/sandboxes/{id}/ports/{port}[/{path}]`.
fn path_in_sandbox(request_path: &str) -> Option<&str> {
    let mut segments = request_path.splitn(7, '/');
    let prefix: Vec<&str> = segments.by_ref().take(6).collect();
    match prefix.as_slice() {
        ["", "v1", "sandboxes", _, "ports", _] => Some(segments.next().unwrap_or("")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_in_the_sandbox_stays_as_written() {
        assert_eq!(path_in_sandbox("/v1/sandboxes/sbx_1/ports/8000/a%2Fb/c%3Fd"), Some("a%2Fb/c%3Fd"));
        assert_eq!(path_in_sandbox("/v1/sandboxes/sbx_1/ports/8000/"), Some(""));
        assert_eq!(path_in_sandbox("/v1/sandboxes/sbx_1/ports/8000"), Some(""));
        assert_eq!(path_in_sandbox("/elsewhere/a/b/c/d/e"), None);
    }
}
