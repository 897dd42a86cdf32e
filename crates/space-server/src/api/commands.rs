//! `/v1/sandboxes/{id}/commands` and `/exec`.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use space_api::{Command, CommandCreated, CommandList, CommandRequest, CommandState, ErrorBody, ExecResponse};
use space_http::extract::{ApiJson, ApiQuery, NoQuery};

use super::access::{CommandPath, SandboxPath};
use super::WaitQuery;
use crate::commands::{check_input, Input};
use crate::domain::CommandSpec;
use crate::error::ApiError;
use crate::state::AppState;
use crate::transcript::{self, Stream, TranscriptReader};

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AutoResume {
    /// Resume a paused or suspended sandbox first (default: such a sandbox
    /// answers 409).
    #[serde(default)]
    auto_resume: bool,
}

/// A running command's agent stream, or 404 / 409 (it has exited, or was
/// not started to take `input`).
pub(super) fn running(
    state: &AppState,
    path: &CommandPath,
    input: Option<Input>,
    action: &str,
) -> Result<(u32, space_engine::AgentConn), ApiError> {
    let (cid, command) = (path.id(), &path.command);
    if let Some(input) = input {
        check_input(command, input)?;
    }
    // Its recorded result wins: the live entry may outlast the exit briefly.
    if command.result.is_some() {
        return Err(ApiError::invalid_state("command", "exited", action));
    }
    let Some((_, stream, agent)) = state.platform.live_command(cid) else {
        // Nobody holds it: its sandbox is frozen and was not taken back since
        // a restart (see `adoption.rs`), or it has just exited.
        let sandbox = state.platform.reload(&path.sandbox)?.record().sandbox.state;
        if sandbox != space_api::SandboxState::Running {
            return Err(ApiError::invalid_state("sandbox", sandbox.as_str(), action));
        }
        return Err(ApiError::invalid_state("command", "exited", action));
    };
    Ok((stream, agent))
}

/// The most stdout (and, apart, stderr) `/exec` returns inline.
pub const EXEC_OUTPUT_LIMIT: usize = 1 << 20;

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), AutoResume),
    request_body = CommandRequest,
    responses((status = 201, description = "The process is running", body = CommandCreated),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody),
        (status = 422, description = "No such binary, bad cwd or user; `\"stdin\": false` with `\"tty\": true`", body = ErrorBody)))]
pub async fn create(
    SandboxPath { sandbox, .. }: SandboxPath,
    State(state): State<AppState>,
    ApiQuery(resume): ApiQuery<AutoResume>,
    ApiJson(request): ApiJson<CommandRequest>,
) -> Result<(StatusCode, Json<CommandCreated>), ApiError> {
    let spec = CommandSpec::try_from(request)?;
    if resume.auto_resume {
        state.platform.resume_for_work(&sandbox).await?;
    }
    let session = state.platform.session(&sandbox).await?;
    let command = state.platform.start_command(&session, spec).await?;
    drop(session); // a running command keeps the sandbox from being idle
    Ok((StatusCode::CREATED, Json(CommandCreated { command })))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = CommandList), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn list(path: SandboxPath, State(state): State<AppState>, _: NoQuery) -> Result<Json<CommandList>, ApiError> {
    Ok(Json(CommandList { commands: state.platform.commands_of(&path.sandbox)? }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{cid}", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id"), WaitQuery),
    responses((status = 200, body = Command), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(
    path: CommandPath,
    State(state): State<AppState>,
    ApiQuery(wait): ApiQuery<WaitQuery>,
) -> Result<Json<Command>, ApiError> {
    let deadline = wait.deadline()?;
    let platform = &state.platform;
    let (sandbox, cid) = (&path.sandbox, path.id());
    let command = platform
        .wait_for(Some(deadline), || platform.command(sandbox, cid), |c| c.state == CommandState::Exited)
        .await?;
    Ok(Json(command))
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StdinQuery {
    /// Close stdin after writing the body.
    #[serde(default)]
    eof: bool,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{cid}/stdin", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id"), StdinQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204, description = "Delivered to the agent"), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The command has exited, or was started without stdin", body = ErrorBody)))]
pub async fn stdin(
    path: CommandPath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<StdinQuery>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let (stream, agent) = running(&state, &path, Some(Input::Stdin), "write to stdin")?;
    let gone = |_| ApiError::invalid_state("command", "exited", "write to stdin");
    for chunk in body.chunks(space_proto::MAX_OUTPUT_CHUNK) {
        agent.send_stdin(stream, chunk.to_vec()).await.map_err(gone)?;
    }
    if query.eof {
        agent.close_stdin(stream).await.map_err(gone)?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// `TERM`, `KILL`, `INT`, `HUP`, `QUIT`, `USR1`, `USR2`, `STOP`, `CONT` (with or without `SIG`).
    signal: String,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{cid}/signal", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id")),
    request_body = SignalRequest,
    responses((status = 204, description = "Sent to the process group"), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn signal(
    path: CommandPath,
    State(state): State<AppState>,
    _: NoQuery,
    ApiJson(request): ApiJson<SignalRequest>,
) -> Result<StatusCode, ApiError> {
    use nix::sys::signal::Signal;
    let name = request.signal.trim_start_matches("SIG");
    let signal = match name {
        "TERM" => Signal::SIGTERM,
        "KILL" => Signal::SIGKILL,
        "INT" => Signal::SIGINT,
        "HUP" => Signal::SIGHUP,
        "QUIT" => Signal::SIGQUIT,
        "USR1" => Signal::SIGUSR1,
        "USR2" => Signal::SIGUSR2,
        "STOP" => Signal::SIGSTOP,
        "CONT" => Signal::SIGCONT,
        other => return Err(ApiError::bad_request(format!("unknown signal {other:?}"))),
    };
    let (stream, agent) = running(&state, &path, None, "signal it")?;
    agent.signal(stream, signal as i32).await.map_err(|_| ApiError::invalid_state("command", "exited", "signal it"))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    cols: u16,
    rows: u16,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{cid}/resize", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id")),
    request_body = ResizeRequest,
    responses((status = 204, description = "The terminal has the new size"), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The command has exited, or was started without a terminal", body = ErrorBody)))]
pub async fn resize(
    path: CommandPath,
    State(state): State<AppState>,
    _: NoQuery,
    ApiJson(request): ApiJson<ResizeRequest>,
) -> Result<StatusCode, ApiError> {
    if request.cols == 0 || request.rows == 0 {
        return Err(ApiError::bad_request("cols and rows must be at least 1"));
    }
    let (stream, agent) = running(&state, &path, Some(Input::Resize), "resize it")?;
    let size = space_proto::TerminalSize { cols: request.cols, rows: request.rows };
    agent.resize(stream, size).await.map_err(|_| ApiError::invalid_state("command", "exited", "resize it"))?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), AutoResume),
    request_body = CommandRequest,
    responses((status = 200, description = "The command ran to its end", body = ExecResponse),
        (status = 400, description = "Bad input, or `stdin` or `tty` (nothing could type into it)", body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn exec(
    SandboxPath { sandbox, .. }: SandboxPath,
    State(state): State<AppState>,
    ApiQuery(resume): ApiQuery<AutoResume>,
    ApiJson(request): ApiJson<CommandRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    let id = sandbox.id();
    // Exec waits for the exit with nobody left to type: a command that read
    // its stdin would wait forever.
    if request.tty {
        return Err(ApiError::bad_request("exec cannot take a terminal; start a command instead")
            .with_details(serde_json::json!({"field": "tty"})));
    }
    if request.stdin == Some(true) {
        return Err(ApiError::bad_request("exec cannot take stdin; start a command instead")
            .with_details(serde_json::json!({"field": "stdin"})));
    }
    let spec = CommandSpec::try_from(request)?;
    if resume.auto_resume {
        state.platform.resume_for_work(&sandbox).await?;
    }
    let platform = &state.platform;
    let session = platform.session(&sandbox).await?;
    let started = platform.start_command(&session, spec).await?;
    drop(session); // a running command keeps the sandbox from being idle
    let command = platform
        .wait_for(None::<Instant>, || platform.command(&sandbox, &started.id), |c| c.state == CommandState::Exited)
        .await?;
    let path = transcript::path_for(&platform.data().sandbox_state_dir(id), &command.id);
    let (stdout, stderr, truncated) =
        collect_output(&path).map_err(|e| ApiError::internal("reading the transcript", e))?;
    let result = command.result.clone().ok_or_else(|| ApiError::internal("finishing exec", "no result recorded"))?;
    Ok(Json(ExecResponse { command, stdout, stderr, result, truncated }))
}

/// Reads a finished transcript into two bounded strings.
fn collect_output(path: &std::path::Path) -> std::io::Result<(String, String, bool)> {
    let limit = std::fs::metadata(path)?.len();
    let mut reader = TranscriptReader::open(path)?;
    let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
    while let Some(chunk) = reader.next_chunk(limit)? {
        let target = match chunk.stream {
            Stream::Stdout => &mut out,
            Stream::Stderr => &mut err,
        };
        let room = EXEC_OUTPUT_LIMIT - target.len();
        if chunk.bytes.len() > room {
            truncated = true;
        }
        target.extend_from_slice(&chunk.bytes[..chunk.bytes.len().min(room)]);
    }
    Ok((String::from_utf8_lossy(&out).into_owned(), String::from_utf8_lossy(&err).into_owned(), truncated))
}
