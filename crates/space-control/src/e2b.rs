//! `/e2b/...` through the control plane, answering in E2B's error shape:
//! envd requests go to the node of the sandbox their `E2b-Sandbox-Id`
//! names, with the sandbox's own access token (checked by the node);
//! control requests are authenticated here by `X-API-KEY` and placed,
//! gathered or forwarded like their `/v1` kin.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use space_api::{ErrorCode, SandboxState};
use space_core::tenants::Caller;

use crate::error::ControlError;
use crate::forward::{forward, relay_to};
use crate::node_client::NodeClient;
use crate::place::place;
use crate::quotas::Wanted;
use crate::state::{live_node, mark_gone, nodes, now_ms, ControlPlane};
use crate::volumes::volumes_node;

/// An error in E2B's REST shape, `{"code": <status>, "message": "..."}`,
/// as a node's E2B adapter answers it (the SDK reads `code` as a number
/// and raises by status). The adapter's own type lives with the runtime;
/// this one needs none.
#[derive(Debug)]
pub(crate) struct E2bError {
    status: StatusCode,
    message: String,
}

impl E2bError {
    fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError { status, message: message.into() }
    }
}

/// SPACE's errors in E2B's shape, as the adapter maps them: by the code's
/// status, but for a file of the wrong type, which envd answers with 400.
impl From<ControlError> for E2bError {
    fn from(err: ControlError) -> E2bError {
        let status = match err.code {
            ErrorCode::WrongFileType => StatusCode::BAD_REQUEST,
            code => space_http::error::status_of(code),
        };
        E2bError::new(status, err.0.message)
    }
}

impl From<space_store::StoreError> for E2bError {
    fn from(err: space_store::StoreError) -> E2bError {
        ControlError::from(err).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(json!({"code": self.status.as_u16(), "message": self.message}))).into_response()
    }
}

fn wrong_token() -> E2bError {
    E2bError::new(StatusCode::UNAUTHORIZED, space_api::e2b::WRONG_TOKEN)
}

/// `/e2b/...` (envd's routes and E2B's control API).
pub(crate) async fn e2b(cp: &ControlPlane, request: Request) -> Result<Response, E2bError> {
    let path = request.uri().path().to_string();
    if path.starts_with("/e2b/envd/") {
        let id = request.headers().get("e2b-sandbox-id").and_then(|v| v.to_str().ok()).unwrap_or_default();
        // Only the sandbox's node can check its token: an id that names no
        // sandbox here (or one whose node is lost) answers what a node says
        // to a wrong token, so no caller learns which ids exist.
        let placement = cp.store.cluster().placement(id)?.ok_or_else(wrong_token)?;
        let node = live_node(cp, &placement.node_id).map_err(|_| wrong_token())?;
        return Ok(relay_to(cp, &node, None, request).await?);
    }
    let key = request.headers().get("x-api-key").and_then(|v| v.to_str().ok()).filter(|k| !k.is_empty());
    let key = key.ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "missing API key: send X-API-KEY"))?;
    // A SPACE key, or the same key in the shape E2B's SDK checks for.
    let key = space_api::e2b::presented_key(key).unwrap_or_default();
    let caller = crate::caller_for_key(cp, &key)?;
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = request.method().clone();
    match (&method, parts.as_slice()) {
        (&Method::POST, ["e2b", "sandboxes"] | ["e2b", "v2", "sandboxes"]) => create(cp, &caller, request).await,
        (&Method::GET, ["e2b", "sandboxes"] | ["e2b", "v2", "sandboxes"]) => list(cp, &caller, request).await,
        // New sandboxes and templates a node would make where the control
        // plane could not place them: not through a cluster yet.
        (_, ["e2b", "sandboxes", _, "fork" | "snapshots"] | ["e2b", "snapshots"] | ["e2b", "templates", ..]) => {
            Err(E2bError::new(
                StatusCode::NOT_IMPLEMENTED,
                "E2B's fork and snapshots are not served through a cluster's control plane: use \
                 /v1/sandboxes/{id}/fork and /v1/templates",
            ))
        }
        (_, ["e2b", "sandboxes", id, ..] | ["e2b", "v2", "sandboxes", id, ..]) => {
            let missing = || E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"));
            let placement =
                cp.store.cluster().placement(id)?.filter(|p| p.tenant == caller.tenant).ok_or_else(missing)?;
            let node = live_node(cp, &placement.node_id)?;
            let killed = method == Method::DELETE && parts.len() == 3;
            let response = forward(cp, &node, &caller, request).await?;
            if killed && response.status().is_success() {
                mark_gone(cp, id, &node.id, &caller, SandboxState::Deleted)?;
            }
            Ok(response)
        }
        // What E2B has and SPACE does not: any node says so.
        _ => {
            let node =
                nodes(cp)?.into_iter().find(|n| n.alive).ok_or_else(|| ControlError::unavailable("no live node"))?;
            Ok(forward(cp, &node.row, &caller, request).await?)
        }
    }
}

/// What the control plane reads of E2B's create body: its template. The
/// rest is the node's to read (and refuse).
#[derive(Debug, Default, serde::Deserialize)]
struct E2bCreateBody {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    /// SPACE volumes to mount: the sandbox goes to their node.
    #[serde(rename = "volumeMounts", default)]
    volume_mounts: Vec<E2bMountName>,
}

/// The name of one of E2B's `volumeMounts` (the node reads the rest).
#[derive(Debug, serde::Deserialize)]
struct E2bMountName {
    name: String,
}

/// E2B's create: placed like `/v1`'s (its `templateID`, default `base`),
/// and recorded with the sandbox as `/v1` shows it.
async fn create(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, E2bError> {
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, "the request body is too large"))?;
    // The body as sent (the node validates it): only its template is read,
    // E2B's default (`base`) when it names none, as the adapter reads it.
    let body: E2bCreateBody = match bytes.is_empty() {
        true => E2bCreateBody::default(),
        false => serde_json::from_slice(&bytes).map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, e.to_string()))?,
    };
    let name = body.template_id.as_deref().unwrap_or("base");
    let key = parts.headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string);
    let wanted = |template| Wanted { template, vcpus: None, memory_mib: None };
    let names: Vec<&str> = body.volume_mounts.iter().map(|mount| mount.name.as_str()).collect();
    let home = volumes_node(cp, caller, &names)?;
    let placed = place(cp, caller, &wanted(name), key.as_deref(), home.as_deref()).await;
    let (node, allowance) = match placed {
        // E2B's code interpreter template, served by SPACE's (as on a node).
        Err(err) if err.code == ErrorCode::TemplateNotFound && name == space_api::e2b::E2B_CODE_INTERPRETER => {
            let served = wanted(space_host::template::CODE_INTERPRETER_TEMPLATE);
            place(cp, caller, &served, key.as_deref(), home.as_deref()).await?
        }
        placed => placed?,
    };
    parts.extensions.insert(allowance);
    let response = forward(cp, &node, caller, Request::from_parts(parts, Body::from(bytes))).await?;
    let client = NodeClient::new(cp, &node);
    let (response, created) = client.e2b_created(response).await.map_err(|e| e.into_control(&node.id))?;
    let Some(created) = created else {
        return Ok(response);
    };
    // Kept as `/v1` shows it, which E2B's answer is not.
    let sandbox = client.sandbox(caller, &created.sandbox_id).await.map_err(|e| e.into_control(&node.id))?;
    // None: deleted already (by a caller quicker than this answer), so
    // there is nothing to place.
    if let Some(sandbox) = sandbox {
        let kept = serde_json::to_string(&sandbox).map_err(|e| ControlError::internal("keeping a sandbox", e))?;
        cp.store.cluster().put_placement(&sandbox.id, &node.id, &caller.tenant, &kept, now_ms())?;
    }
    Ok(response)
}

/// E2B's list: every live node's, in E2B's order and pages.
async fn list(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, E2bError> {
    // Each node's whole list, its filters passed on as sent (E2B encodes
    // metadata its own way), then one page of them all, as a node pages.
    let raw = request.uri().query().unwrap_or_default().to_string();
    let query: BTreeMap<String, String> = space_api::e2b::form_pairs(&raw).into_iter().collect();
    let mut asked: Vec<&str> =
        raw.split('&').filter(|p| !p.is_empty() && !p.starts_with("limit=") && !p.starts_with("nextToken=")).collect();
    let whole = format!("limit={}", usize::MAX);
    asked.push(&whole);
    let path = format!("{}?{}", request.uri().path(), asked.join("&"));
    let mut listed = Vec::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let client = NodeClient::new(cp, &node.row);
        let some = match client.e2b_list(caller, &path).await.map_err(|e| e.into_control(&node.row.id))? {
            Ok(some) => some,
            // Refused in E2B's shape: passed on as the node answered.
            Err(refused) => return Ok(refused),
        };
        for item in some {
            let started = space_api::e2b::parse_time(&item.started_at);
            let item = serde_json::to_value(&item).map_err(|e| ControlError::internal("an E2B list item", e))?;
            listed.push((started, item));
        }
    }
    let page =
        space_api::e2b::page(listed, &query).map_err(|message| E2bError::new(StatusCode::BAD_REQUEST, message))?;
    let mut response = axum::Json(page.items).into_response();
    if let Some(next) = page.next_token {
        response.headers_mut().insert("x-next-token", HeaderValue::from(next));
    }
    Ok(response)
}
