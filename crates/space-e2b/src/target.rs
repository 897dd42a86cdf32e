//! Which sandbox an envd request is for, and whether it may reach it: the
//! sandbox's tokens (derived, never stored), the port it names, and its
//! agent once it runs. Below envd's handlers and the code interpreter's.

use axum::http::{HeaderMap, StatusCode};
use base64::Engine as _;
use space_engine::AgentConn;

use super::error::E2bError;
use super::wire::header;
use crate::access::{OwnedSandbox, TokenRefused};
use crate::platform::Platform;
use crate::session::Session;
use crate::E2bState;

/// The port E2B's SDK names for envd itself.
const ENVD_PORT: &str = "49983";

/// The port E2B's SDK names for its code interpreter.
pub const INTERPRETER_PORT: &str = "49999";

/// The keyring's purposes of a sandbox's two E2B tokens.
const ENVD_TOKEN: &str = "e2b-envd";
const TRAFFIC_TOKEN: &str = "e2b-traffic";

/// The token E2B's code interpreter presents on the context routes
/// (`E2B-Traffic-Access-Token`), which carry no envd token: derived like it,
/// for another purpose. Never logged.
pub fn traffic_token(platform: &Platform, sandbox_id: &str) -> Result<String, space_node::NodeError> {
    Ok(platform.keyring()?.token(TRAFFIC_TOKEN, sandbox_id))
}

/// The envd access token of a sandbox: derived from the server's key file
/// and the sandbox id, so it is random per sandbox, needs no storage and
/// stays the same across restarts. Never logged.
pub fn envd_token(platform: &Platform, sandbox_id: &str) -> Result<String, space_node::NodeError> {
    Ok(platform.keyring()?.token(ENVD_TOKEN, sandbox_id))
}

/// The sandbox an envd request is for, and who acts in it.
pub struct Target {
    pub id: String,
    /// The sandbox, loaded for the token the request holds.
    pub sandbox: OwnedSandbox,
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
pub fn wrong_token() -> E2bError {
    E2bError::new(StatusCode::UNAUTHORIZED, "missing or wrong access token for this sandbox")
}

/// E2B's proxy answer for a sandbox that does not run: the SDK looks for
/// "was not found" to raise its not-running error.
pub(crate) fn not_running(id: &str) -> E2bError {
    E2bError { sandbox_id: Some(id.to_string()), ..E2bError::new(StatusCode::BAD_GATEWAY, "The sandbox was not found") }
}

/// Finds and authenticates the request's sandbox (envd's port).
pub(crate) fn target(state: &E2bState, headers: &HeaderMap) -> Result<Target, E2bError> {
    target_on(state, headers, ENVD_PORT)
}

/// Finds the request's sandbox, checks the port it names (`E2b-Sandbox-Port`)
/// is `port`, and authenticates it: the sandbox's `X-Access-Token`, or on the
/// code interpreter's port its `E2B-Traffic-Access-Token` (its context routes
/// carry no other).
pub fn target_on(state: &E2bState, headers: &HeaderMap, port: &str) -> Result<Target, E2bError> {
    let id = header(headers, "e2b-sandbox-id")
        .filter(|id| !id.is_empty())
        .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, "missing E2b-Sandbox-Id"))?
        .to_string();
    // The token first, before anything about the sandbox is looked up: it
    // is derived from the id alone, so an unknown id and an existing one
    // answer the same 401 to a caller without it (no existence oracle).
    let presented = |name: &str| header(headers, name).unwrap_or_default().as_bytes();
    let mut tokens = vec![(ENVD_TOKEN, presented("x-access-token"))];
    if port == INTERPRETER_PORT {
        tokens.push((TRAFFIC_TOKEN, presented("e2b-traffic-access-token")));
    }
    let found = match state.platform.sandbox_by_token(&id, &tokens) {
        Err(TokenRefused::Wrong) => return Err(wrong_token()),
        Err(TokenRefused::Node(err)) => return Err(err.into()),
        found => found,
    };
    if let Some(named) = header(headers, "e2b-sandbox-port").filter(|p| *p != port) {
        let message = format!("The sandbox port {named} is not open");
        return Err(E2bError { sandbox_id: Some(id), ..E2bError::new(StatusCode::BAD_GATEWAY, message) });
    }
    let Ok(owned) = found else { return Err(not_running(&id)) };
    let sandbox = &owned.record().sandbox;
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
    Ok(Target { id, sandbox: owned, user })
}

/// The sandbox's agent, awake, with the session that keeps it so.
pub async fn agent(state: &E2bState, target: &Target) -> Result<(AgentConn, Session), E2bError> {
    let session = state.platform.session(&target.sandbox).await.map_err(|_| not_running(&target.id))?;
    let agent = session.agent("reach it").map_err(|_| not_running(&target.id))?.clone();
    Ok((agent, session))
}
