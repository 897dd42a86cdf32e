//! `GET .../commands/{cid}/attach`: a WebSocket for interactive use.
//! Binary frames from the client go to the command's stdin; the command's
//! output (replayed from the start, then live) comes back as binary frames;
//! a JSON text frame `{"resize": {"cols", "rows"}}` resizes a tty and
//! `{"eof": true}` closes the command's stdin (after every byte sent before
//! it). When the command ends the server sends `{"exit": <result>}` as text
//! and closes.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use space_api::ErrorBody;

use super::access::CommandPath;
use super::output::{follow, Emitted};
use super::AppState;
use crate::error::ApiError;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientText {
    #[serde(default)]
    resize: Option<Size>,
    #[serde(default)]
    eof: bool,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Size {
    cols: u16,
    rows: u16,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{cid}/attach", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id")),
    responses((status = 101, description = "Switching to the WebSocket protocol"),
        (status = 400, description = "Not a WebSocket upgrade", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn attach(
    path: CommandPath,
    State(state): State<AppState>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(|e| ApiError::bad_request(format!("attach needs a WebSocket upgrade: {e}")))?;
    let output = follow(&state.platform, path.sandbox.id(), path.id(), 0, true)?;
    let input = state.platform.live_command(path.id()).map(|(_, stream, agent)| (stream, agent));
    // A browser names `space.v1` beside its key (see `websocket_bearer`).
    Ok(upgrade.protocols(["space.v1"]).on_upgrade(move |socket| session(socket, output, input)))
}

async fn session(
    socket: WebSocket,
    mut output: tokio::sync::mpsc::Receiver<Emitted>,
    input: Option<(u32, space_engine::AgentConn)>,
) {
    let (mut sink, mut source) = socket.split();
    let pump_out = async move {
        while let Some(item) = output.recv().await {
            let message = match item {
                Emitted::Chunk(chunk) => Message::Binary(chunk.bytes.into()),
                Emitted::Exit(result) => {
                    let text = serde_json::json!({ "exit": result }).to_string();
                    let _ = sink.send(Message::Text(text.into())).await;
                    break;
                }
            };
            if sink.send(message).await.is_err() {
                return;
            }
        }
        let _ = sink.close().await;
    };
    let pump_in = async move {
        while let Some(Ok(message)) = source.next().await {
            let Some((stream, agent)) = &input else { continue };
            match message {
                Message::Binary(bytes) => {
                    if agent.send_stdin(*stream, bytes.to_vec()).await.is_err() {
                        break;
                    }
                }
                Message::Text(text) => {
                    let Ok(control) = serde_json::from_str::<ClientText>(&text) else { continue };
                    if let Some(resize) = control.resize {
                        let size = space_proto::TerminalSize { cols: resize.cols.max(1), rows: resize.rows.max(1) };
                        let _ = agent.resize(*stream, size).await;
                    }
                    if control.eof {
                        let _ = agent.close_stdin(*stream).await;
                    }
                }
                Message::Close(_) => break,
                Message::Ping(_) | Message::Pong(_) => {}
            }
        }
    };
    // The session ends when the output ends (the command exited) or the
    // client goes away.
    tokio::select! {
        () = pump_out => {}
        () = pump_in => {}
    }
}
