//! `/v1/sandboxes/{id}/ports/{port}/{path}`: HTTP (and WebSocket) to a
//! server listening on that port inside the sandbox — a dev server, a
//! notebook, an app an agent built — through the agent's channel (the
//! sandbox has no network device). A WebSocket asking for the `space-tcp`
//! subprotocol on `/v1/sandboxes/{id}/ports/{port}` is a raw TCP tunnel
//! instead (`space port-forward`): binary messages carry the bytes.

use std::time::Duration;

use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use space_api::{ErrorBody, SandboxState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::access::PortPath;
use super::AppState;
use crate::error::ApiError;

/// How long the agent may take to connect to the port.
const CONNECT_PATIENCE: Duration = Duration::from_secs(10);
/// The WebSocket subprotocol of a raw TCP tunnel.
pub const TCP_PROTOCOL: &str = "space-tcp";

/// Headers that belong to one hop, never passed on (an upgrade's own are
/// put back when there is one).
pub(crate) const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

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
    forward(state, sandbox.id().to_string(), port, path, request).await
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
    let id = sandbox.id().to_string();
    let tunnel = request
        .headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|p| p.trim() == TCP_PROTOCOL));
    if tunnel {
        let port = checked_port(&port)?;
        let agent = running_agent(&state, &id)?;
        let (mut parts, _) = request.into_parts();
        let upgrade = WebSocketUpgrade::from_request_parts(&mut parts, &state)
            .await
            .map_err(|e| ApiError::bad_request(format!("a TCP tunnel is a WebSocket upgrade: {e}")))?;
        let stream = open(&agent, port).await?;
        let io = stream.into_io();
        return Ok(upgrade.protocols([TCP_PROTOCOL]).on_upgrade(move |socket| tunnel_tcp(socket, io)).into_response());
    }
    forward(state, id, port, String::new(), request).await
}

fn checked_port(port: &str) -> Result<u16, ApiError> {
    port.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("a port is a number from 1 to 65535, not {port:?}")))
}

fn running_agent(state: &AppState, id: &str) -> Result<space_engine::AgentConn, ApiError> {
    let record = state.platform.sandbox(id)?;
    if record.sandbox.state != SandboxState::Running {
        return Err(ApiError::invalid_state("sandbox", record.sandbox.state.as_str(), "reach a port in it"));
    }
    let agent = state.platform.agent(id);
    state.platform.wake_up(id);
    agent.ok_or_else(|| ApiError::invalid_state("sandbox", "starting", "reach a port in it"))
}

async fn open(agent: &space_engine::AgentConn, port: u16) -> Result<space_engine::EgressStream, ApiError> {
    agent.open_port(port, CONNECT_PATIENCE).await.map_err(|err| match err {
        space_engine::AgentError::PortClosed(why) => {
            ApiError::new(StatusCode::BAD_GATEWAY, "port_closed", why).with_details(serde_json::json!({"port": port}))
        }
        other => ApiError::new(StatusCode::BAD_GATEWAY, "port_unreachable", format!("port {port}: {other}"))
            .with_details(serde_json::json!({"port": port})),
    })
}

async fn forward(
    state: AppState,
    id: String,
    port: String,
    path: String,
    mut request: Request,
) -> Result<Response, ApiError> {
    let port = checked_port(&port)?;
    let agent = running_agent(&state, &id)?;
    let stream = open(&agent, port).await?;
    // The request as the server in the sandbox sees it: its own path, no
    // API key, its own host.
    let upgrade = request.headers().get(header::UPGRADE).cloned();
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (parts, body) = request.into_parts();
    let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    let uri = format!("/{path}{query}");
    let mut outgoing = hyper::Request::builder()
        .method(parts.method)
        .uri(&uri)
        .body(body)
        .map_err(|e| ApiError::bad_request(format!("{uri:?}: {e}")))?;
    let headers = outgoing.headers_mut();
    for (name, value) in &parts.headers {
        if name == header::AUTHORIZATION || name == header::HOST || HOP_BY_HOP.contains(&name.as_str()) {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    if let Some(upgrade) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
    headers.insert(header::HOST, HeaderValue::from_str(&format!("localhost:{port}")).expect("a host"));
    if let Ok(prefix) = HeaderValue::from_str(&format!("/v1/sandboxes/{id}/ports/{port}")) {
        headers.insert("x-forwarded-prefix", prefix);
    }
    if let Some(host) = parts.headers.get(header::HOST) {
        headers.insert("x-forwarded-host", host.clone());
    }

    relay(TokioIo::new(stream.into_io()), outgoing, client_side)
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "port_unreachable", format!("port {port}: {e}")))
}

/// Sends `outgoing` over `io` (HTTP/1.1) and answers with what comes back,
/// streamed; an upgrade (a WebSocket) is spliced to the client's side.
/// Hop-by-hop headers of the answer are dropped.
pub(crate) async fn relay<I>(
    io: I,
    outgoing: hyper::Request<Body>,
    client_side: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
{
    let mut sender = http1(io).await?;
    let response = sender.send_request(outgoing).await.map_err(|e| e.to_string())?;
    answer(response, client_side)
}

/// An HTTP/1.1 connection over `io`, driven by a task of its own (which
/// lets it be upgraded).
pub(crate) async fn http1<I>(io: I) -> Result<hyper::client::conn::http1::SendRequest<Body>, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
{
    let (sender, connection) =
        hyper::client::conn::http1::Builder::new().handshake::<_, Body>(io).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    });
    Ok(sender)
}

/// What [`relay`] answers with `response`.
pub(crate) fn answer(
    mut response: hyper::Response<hyper::body::Incoming>,
    client_side: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, String> {
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let (Some(client_side), server_side) = (client_side, hyper::upgrade::on(&mut response)) else {
            return Err("an upgrade nobody asked for".into());
        };
        tokio::spawn(async move {
            if let (Ok(client), Ok(server)) = (client_side.await, server_side.await) {
                let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(server)).await;
            }
        });
        let (parts, _) = response.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = response.into_parts();
    for name in HOP_BY_HOP {
        parts.headers.remove(name);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// Pumps a TCP tunnel: binary messages in are bytes to the port, bytes
/// from it go out as binary messages; either side closing ends it.
async fn tunnel_tcp(socket: WebSocket, io: tokio::io::DuplexStream) {
    let (mut ws_out, mut ws_in) = socket.split();
    let (mut port_read, mut port_write) = tokio::io::split(io);
    let inward = async {
        while let Some(Ok(message)) = ws_in.next().await {
            match message {
                Message::Binary(bytes) if port_write.write_all(&bytes).await.is_err() => break,
                Message::Close(_) => break,
                _ => {}
            }
        }
        let _ = port_write.shutdown().await;
    };
    let outward = async {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match port_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if ws_out.send(Message::Binary(buf[..n].to_vec().into())).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = ws_out.send(Message::Close(None)).await;
    };
    tokio::join!(inward, outward);
}
