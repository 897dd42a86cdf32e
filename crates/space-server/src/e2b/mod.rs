//! An E2B-compatible surface over the platform, so the unmodified `e2b`
//! SDK drives SPACE with three environment variables:
//! `E2B_API_URL=<server>/e2b`, `E2B_SANDBOX_URL=<server>/e2b/envd` and
//! `E2B_API_KEY=<a SPACE key>`.
//!
//! It is an adapter, like a second router: an E2B sandbox *is* a SPACE
//! sandbox (same id, same tenant, visible in both APIs), and every call
//! goes through the same platform methods as SPACE's own handlers.
//! - `control`: E2B's REST control plane (`/e2b/v2/sandboxes`, ...),
//!   authenticated with `X-API-KEY`, answering synchronously where E2B
//!   does (create, kill, pause, connect wait for their operation).
//! - `envd`: the in-sandbox API E2B's SDK talks to (`/e2b/envd/...`,
//!   routed by the `E2b-Sandbox-Id` header, authenticated with the
//!   sandbox's `X-Access-Token`): Connect RPCs for processes and the
//!   filesystem, `/files` and `/health`.
//! - `interpreter`: what E2B's code interpreter adds on port 49999 of the
//!   same URL (`/execute`, `/contexts`), over SPACE's code contexts.
//!
//! The wire format is described in `docs/decisions/008-e2b-compatibility.md`.

mod connect;
mod control;
pub(crate) mod envd;
mod filesystem;
mod interpreter;
mod process;

use std::collections::BTreeMap;
use std::time::SystemTime;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use serde_json::{json, Value};

use crate::api::AppState;
use crate::error::ApiError;
use crate::platform::Platform;

/// The envd version SPACE answers with: the SDK turns on features by it,
/// and 0.5.7 is the highest whose features are all served here (closing
/// stdin, raw and gzip uploads; no file metadata or watchers).
pub const ENVD_VERSION: &str = "0.5.7";

/// Both E2B surfaces, mounted under `/e2b` on the API's listener.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/e2b/sandboxes", get(control::list).post(control::create))
        .route("/e2b/v2/sandboxes", get(control::list).post(control::create))
        .route("/e2b/sandboxes/{id}", get(control::detail).delete(control::kill))
        .route("/e2b/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/e2b/sandboxes/{id}/pause", post(control::pause))
        .route("/e2b/sandboxes/{id}/connect", post(control::connect))
        .route("/e2b/sandboxes/{id}/resume", post(control::resume))
        .route("/e2b/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/e2b/sandboxes/{id}/metrics", get(control::metrics))
        .route("/e2b/envd/health", get(envd::health))
        .route("/e2b/envd/execute", post(interpreter::execute))
        .route("/e2b/envd/contexts", get(interpreter::list).post(interpreter::create))
        .route("/e2b/envd/contexts/{id}", axum::routing::delete(interpreter::delete))
        .route("/e2b/envd/contexts/{id}/restart", post(interpreter::restart))
        .route(
            "/e2b/envd/files",
            get(envd::read_file).post(envd::write_files).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(
            "/e2b/envd/{service}/{method}",
            post(envd::rpc).layer(axum::extract::DefaultBodyLimit::max(envd::MAX_RPC_BODY)),
        )
        .route("/e2b/{*rest}", any(control::unsupported))
}

/// An error in E2B's REST shape: `{"code": <status>, "message": "..."}`
/// (the SDK reads `code` as a number and raises by status).
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// Named in envd's answers about a sandbox that does not run.
    pub sandbox_id: Option<String>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError { status, message: message.into(), sandbox_id: None }
    }
}

/// SPACE's errors in E2B's REST shape: by the code's status, but for a file
/// of the wrong type, which envd answers with 400.
impl From<space_node::NodeError> for E2bError {
    fn from(err: space_node::NodeError) -> E2bError {
        let status = match err.code {
            space_api::ErrorCode::WrongFileType => StatusCode::BAD_REQUEST,
            code => StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        };
        E2bError::new(status, err.message)
    }
}

impl From<ApiError> for E2bError {
    fn from(err: ApiError) -> E2bError {
        err.0.into()
    }
}

impl From<crate::store::StoreError> for E2bError {
    fn from(err: crate::store::StoreError) -> E2bError {
        ApiError::from(err).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(id) = self.sandbox_id {
            body["sandboxId"] = json!(id);
        }
        (self.status, axum::Json(body)).into_response()
    }
}

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

/// A header's text, if present and readable.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// One page of `listed` (each with its start) as E2B answers a list
/// (`space_api::e2b::page`), the next page's `nextToken` in `X-Next-Token`.
/// `query` is the list's decoded query.
pub(crate) fn page(listed: Vec<(SystemTime, Value)>, query: &BTreeMap<String, String>) -> Result<Response, E2bError> {
    let page =
        space_api::e2b::page(listed, query).map_err(|message| E2bError::new(StatusCode::BAD_REQUEST, message))?;
    let mut response = axum::Json(page.items).into_response();
    if let Some(next) = page.next_token {
        response.headers_mut().insert("x-next-token", HeaderValue::from(next));
    }
    Ok(response)
}
