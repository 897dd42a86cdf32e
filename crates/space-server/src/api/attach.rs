//! `GET .../commands/{cid}/attach`: a WebSocket for interactive use.
//! Binary frames from the client go to the command's stdin; the command's
//! output (replayed from the start, then live) comes back as binary frames;
//! a JSON text frame `{"resize": {"cols", "rows"}}` resizes a tty and
//! `{"eof": true}` closes the command's stdin (after every byte sent before
//! it). A frame the session cannot carry out is answered with a text frame
//! `{"error": {...}}` and the session goes on. When the command ends the
//! server sends `{"exit": <result>}` as text and closes.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use space_api::{Command, ErrorBody};
use space_engine::AgentConn;
use space_http::extract::NoQuery;
use tokio::sync::mpsc;

use super::access::CommandPath;
use super::commands::running;
use crate::commands::{check_input, Input};
use crate::error::ApiError;
use crate::state::AppState;
use space_node::follow::{follow, Emitted};

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
    description = "A WebSocket (subprotocol `space.v1`). Client to server: binary frames are the \
        command's stdin; text frames are JSON, `{\"resize\": {\"cols\": n, \"rows\": n}}` (a `tty` \
        command's terminal) and/or `{\"eof\": true}` (closes stdin after every byte before it). \
        Server to client: binary frames are the output, replayed from the start, then live; the \
        last frame is the text `{\"exit\": <ProcessResult>}`, then the server closes. A client \
        frame that cannot be carried out is never dropped silently: the server answers a text \
        frame `{\"error\": {\"code\", \"message\", \"details\"}}` (the API's error shape) and the \
        session goes on: `invalid_request` for a text frame that is not one of the above or a size \
        of 0, `invalid_state` for stdin or eof to a command started without stdin, a resize of one \
        started without `tty`, or any input once the command is no longer running.",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id")),
    responses((status = 101, description = "Switching to the WebSocket protocol"),
        (status = 400, description = "Not a WebSocket upgrade", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn attach(
    path: CommandPath,
    State(state): State<AppState>,
    _: NoQuery,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(|e| ApiError::bad_request(format!("attach needs a WebSocket upgrade: {e}")))?;
    let output = follow(&state.platform, path.sandbox.id(), path.id(), 0, true)?;
    let live = running(&state, &path, None, "send it input");
    let input = Target { live, command: path.command };
    // A browser names `space.v1` beside its key (see `websocket_bearer`).
    Ok(upgrade.protocols(["space.v1"]).on_upgrade(move |socket| session(socket, output, input)))
}

/// Where the client's frames go: the command as it was started, and its
/// agent stream (or why it has none: it exited, or its sandbox is frozen).
struct Target {
    command: Command,
    live: Result<(u32, AgentConn), ApiError>,
}

impl Target {
    fn stream(&self, input: Input) -> Result<(u32, &AgentConn), ApiError> {
        check_input(&self.command, input)?;
        let (stream, agent) = self.live.as_ref().map_err(Clone::clone)?;
        Ok((*stream, agent))
    }

    /// Carries out one client frame. `Ok(false)` ends the session.
    async fn carry_out(&self, message: Message) -> Result<bool, ApiError> {
        let gone = |action: &str| ApiError::invalid_state("command", "exited", action);
        match message {
            Message::Binary(bytes) => {
                let (stream, agent) = self.stream(Input::Stdin)?;
                agent.send_stdin(stream, bytes.to_vec()).await.map_err(|_| gone("write to stdin"))?;
            }
            Message::Text(text) => {
                let control = serde_json::from_str::<ClientText>(&text).map_err(|e| {
                    ApiError::bad_request(format!(
                        "a text frame is {{\"resize\": {{\"cols\": n, \"rows\": n}}}} and/or {{\"eof\": true}}: {e}"
                    ))
                })?;
                if let Some(resize) = control.resize {
                    if resize.cols == 0 || resize.rows == 0 {
                        return Err(ApiError::bad_request("cols and rows must be at least 1"));
                    }
                    let (stream, agent) = self.stream(Input::Resize)?;
                    let size = space_proto::TerminalSize { cols: resize.cols, rows: resize.rows };
                    agent.resize(stream, size).await.map_err(|_| gone("resize it"))?;
                }
                if control.eof {
                    let (stream, agent) = self.stream(Input::Stdin)?;
                    agent.close_stdin(stream).await.map_err(|_| gone("close its stdin"))?;
                }
            }
            Message::Close(_) => return Ok(false),
            Message::Ping(_) | Message::Pong(_) => {}
        }
        Ok(true)
    }
}

async fn session(socket: WebSocket, mut output: mpsc::Receiver<Emitted>, target: Target) {
    let (mut sink, mut source) = socket.split();
    let (refuse, mut refusals) = mpsc::channel::<ApiError>(16);
    let pump_out = async move {
        loop {
            let message = tokio::select! {
                item = output.recv() => match item {
                    Some(Emitted::Chunk(chunk)) => Message::Binary(chunk.bytes.into()),
                    Some(Emitted::Exit(result)) => {
                        let text = serde_json::json!({ "exit": result }).to_string();
                        let _ = sink.send(Message::Text(text.into())).await;
                        break;
                    }
                    None => break,
                },
                Some(refused) = refusals.recv() => {
                    let text = serde_json::to_string(&ErrorBody { error: refused.detail() }).unwrap_or_default();
                    Message::Text(text.into())
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
            match target.carry_out(message).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(refused) => {
                    if refuse.send(refused).await.is_err() {
                        break;
                    }
                }
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
