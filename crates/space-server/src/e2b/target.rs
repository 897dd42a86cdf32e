//! Which sandbox an envd request is for, and whether it may reach it: the
//! sandbox's tokens (derived, never stored), the port it names, and its
//! agent once it runs. Below envd's handlers and the code interpreter's.

use axum::http::{HeaderMap, StatusCode};
use base64::Engine as _;
use space_engine::AgentConn;

use super::error::E2bError;
use super::wire::header;
use crate::error::ApiError;
use crate::lifecycle::WorkGuard;
use crate::platform::Platform;
use crate::state::AppState;

/// The port E2B's SDK names for envd itself.
const ENVD_PORT: &str = "49983";

/// The port E2B's SDK names for its code interpreter.
pub const INTERPRETER_PORT: &str = "49999";

/// The token E2B's code interpreter presents on the context routes
/// (`E2B-Traffic-Access-Token`), which carry no envd token: derived like it,
/// for another purpose. Never logged.
pub fn traffic_token(platform: &Platform, sandbox_id: &str) -> Result<String, ApiError> {
    Ok(platform.keyring()?.token("e2b-traffic", sandbox_id))
}

/// The envd access token of a sandbox: derived from the server's key file
/// and the sandbox id, so it is random per sandbox, needs no storage and
/// stays the same across restarts. Never logged.
pub fn envd_token(platform: &Platform, sandbox_id: &str) -> Result<String, ApiError> {
    Ok(platform.keyring()?.token("e2b-envd", sandbox_id))
}

/// The sandbox an envd request is for, and who acts in it.
pub struct Target {
    pub id: String,
    /// From `Authorization: Basic <user:>`; None: the template's default.
    pub user: Option<String>,
}

impl Target {
    /// An absolute path for what the SDK sent: empty is the user's home,
    /// `~` expands to it and relative paths are joined to it.
    pub fn path(&self, given: &str) -> String {
        let home = match self.user.as_deref() {
            None | Some("root") => "/root".to_string(),
            Some(user) => format!("/home/{user}"),
        };
        match given {
            "" | "~" => home,
            _ if given.starts_with("~/") => format!("{home}/{}", &given[2..]),
            _ if given.starts_with('/') => given.to_string(),
            _ => format!("{home}/{given}"),
        }
    }
}

/// What a request without its sandbox's token gets, whether the sandbox
/// exists or not (a cluster's control plane answers the same for an id it
/// cannot place).
pub(crate) fn wrong_token() -> E2bError {
    E2bError::new(StatusCode::UNAUTHORIZED, "missing or wrong access token for this sandbox")
}

/// E2B's proxy answer for a sandbox that does not run: the SDK looks for
/// "was not found" to raise its not-running error.
pub(crate) fn not_running(id: &str) -> E2bError {
    E2bError { sandbox_id: Some(id.to_string()), ..E2bError::new(StatusCode::BAD_GATEWAY, "The sandbox was not found") }
}

/// Finds and authenticates the request's sandbox (envd's port).
pub(crate) fn target(state: &AppState, headers: &HeaderMap) -> Result<Target, E2bError> {
    target_on(state, headers, ENVD_PORT)
}

/// Finds the request's sandbox, checks the port it names (`E2b-Sandbox-Port`)
/// is `port`, and authenticates it: the sandbox's `X-Access-Token`, or on the
/// code interpreter's port its `E2B-Traffic-Access-Token` (its context routes
/// carry no other).
pub fn target_on(state: &AppState, headers: &HeaderMap, port: &str) -> Result<Target, E2bError> {
    let id = header(headers, "e2b-sandbox-id")
        .filter(|id| !id.is_empty())
        .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, "missing E2b-Sandbox-Id"))?
        .to_string();
    // The token first, before anything about the sandbox is looked up: it
    // is derived from the id alone, so an unknown id and an existing one
    // answer the same 401 to a caller without it (no existence oracle).
    let presented = |name: &str| header(headers, name).unwrap_or_default().as_bytes().to_vec();
    let envd = envd_token(&state.platform, &id)?;
    let mut authentic = space_proto::constant_time_eq(&presented("x-access-token"), envd.as_bytes());
    if port == INTERPRETER_PORT {
        let traffic = traffic_token(&state.platform, &id)?;
        authentic |= space_proto::constant_time_eq(&presented("e2b-traffic-access-token"), traffic.as_bytes());
    }
    if !authentic {
        return Err(wrong_token());
    }
    if let Some(named) = header(headers, "e2b-sandbox-port").filter(|p| *p != port) {
        let message = format!("The sandbox port {named} is not open");
        return Err(E2bError { sandbox_id: Some(id), ..E2bError::new(StatusCode::BAD_GATEWAY, message) });
    }
    let Ok(record) = state.platform.sandbox(&id) else { return Err(not_running(&id)) };
    let sandbox = &record.sandbox;
    let awake = match sandbox.state {
        space_api::SandboxState::Running => true,
        // Paused by the server for idleness: the request wakes it.
        space_api::SandboxState::Paused => sandbox.auto_paused,
        _ => false,
    };
    if !awake {
        return Err(not_running(&id));
    }
    let user = header(headers, "authorization")
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b.trim()).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .map(|pair| pair.split_once(':').map(|(u, _)| u.to_string()).unwrap_or(pair))
        .filter(|u| !u.is_empty());
    Ok(Target { id, user })
}

/// The sandbox's agent, awake, with the guard that keeps it so.
pub async fn agent(state: &AppState, target: &Target) -> Result<(AgentConn, WorkGuard), E2bError> {
    let work = state.platform.begin_work(&target.id).await.map_err(|_| not_running(&target.id))?;
    match state.platform.agent(&target.id) {
        Some(agent) if crate::domain::accepts_commands(work.state) => Ok((agent, work)),
        _ => Err(not_running(&target.id)),
    }
}
