//! Sending a request on to a node as the caller (streaming both ways, an
//! upgrade spliced), reading a node's small answers, and recording what a
//! lifecycle answer says: which node holds the sandbox and its operation.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde::de::DeserializeOwned;
use space_api::cluster::{DiskAllowance, DISK_QUOTA_HEADER, NODE_HEADER, OPERATOR_HEADER, TENANT_HEADER};
use space_api::ErrorCode;
use space_core::tenants::Caller;
use space_store::NodeRow;

use crate::error::ControlError;
use crate::state::{nodes, now_ms, ControlPlane};

/// The largest answer the control plane reads whole (JSON it records from).
const MAX_RECORDED: usize = 4 << 20;

/// Sends a request on to a node as `caller`, streaming both ways (and
/// splicing an upgrade, such as attach's WebSocket). A [`DiskAllowance`]
/// in the request's extensions goes on as its header.
pub(crate) async fn forward(
    cp: &ControlPlane,
    node: &NodeRow,
    caller: &Caller,
    request: Request,
) -> Result<Response, ControlError> {
    relay_to(cp, node, Some(caller), request).await
}

/// [`forward`]; with no `caller`, the request keeps the credentials it
/// came with (E2B's envd: the sandbox's access token) and gets neither the
/// node token nor a tenant.
pub(crate) async fn relay_to(
    cp: &ControlPlane,
    node: &NodeRow,
    caller: Option<&Caller>,
    mut request: Request,
) -> Result<Response, ControlError> {
    let unreachable = |e: String| ControlError::new(ErrorCode::NodeUnreachable, format!("node {}: {e}", node.id));
    let upgrade = request.headers().get(header::UPGRADE).cloned();
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (parts, body) = request.into_parts();
    let target = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut outgoing = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(target)
        .body(body)
        .map_err(|e| ControlError::bad_request(e.to_string()))?;
    // As the caller's: nothing that holds its key in any encoding (a cookie,
    // a Basic header, a subprotocol) goes on; with no caller (envd) the
    // request keeps the sandbox token it needs.
    let incoming = match caller {
        Some(_) => space_http::proxy::without_presented_credentials(&parts.headers),
        None => parts.headers.clone(),
    };
    let headers = outgoing.headers_mut();
    for (name, value) in &incoming {
        let hop = space_http::proxy::HOP_BY_HOP.contains(&name.as_str());
        // A tenant's key (in either header) never reaches a node.
        let key = (name == header::AUTHORIZATION && caller.is_some()) || name == "x-api-key";
        let ours = key || name == header::HOST || name.as_str().starts_with("x-space-");
        if hop || ours || name == header::SEC_WEBSOCKET_PROTOCOL {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    // The subprotocols a browser offered, less the one that carries its
    // key: a node never sees a tenant's key.
    let offered: Vec<&str> = incoming
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with("bearer."))
        .collect();
    if let Some(value) = (!offered.is_empty()).then(|| HeaderValue::from_str(&offered.join(", ")).ok()).flatten() {
        headers.insert(header::SEC_WEBSOCKET_PROTOCOL, value);
    }
    if let Some(upgrade) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
    if let Some(caller) = caller {
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {}", cp.node_token)).map_err(|e| unreachable(e.to_string()))?,
        );
        let tenant = HeaderValue::from_str(&caller.tenant).map_err(|e| unreachable(e.to_string()))?;
        headers.insert(TENANT_HEADER, tenant);
        if caller.is_operator() {
            headers.insert(OPERATOR_HEADER, HeaderValue::from_static("true"));
        }
    }
    if let Some(allowance) = parts.extensions.get::<DiskAllowance>() {
        let value = HeaderValue::from_str(&allowance.to_header()).map_err(|e| ControlError::internal("a quota", e))?;
        headers.insert(DISK_QUOTA_HEADER, value);
    }
    let mut response = cp.links.send(&node.url, outgoing, client_side).await.map_err(|e| unreachable(e.to_string()))?;
    if let Ok(value) = HeaderValue::from_str(&node.id) {
        response.headers_mut().insert(NODE_HEADER, value);
    }
    Ok(response)
}

/// A node's answer read whole (a small JSON body), to record from it, and
/// the same answer to send on; `None` if it is not a `T`.
pub(crate) async fn read_answer<T: DeserializeOwned>(
    response: Response,
) -> Result<(Response, Option<T>), ControlError> {
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_RECORDED)
        .await
        .map_err(|e| ControlError::new(ErrorCode::NodeUnreachable, format!("reading a node's answer: {e}")))?;
    let answer = serde_json::from_slice(&bytes).ok();
    Ok((Response::from_parts(parts, Body::from(bytes)), answer))
}

/// Records a lifecycle answer's operation (and the sandbox as it is).
///
/// Read as JSON, not as one of the API's answers: every 202 passes here (a
/// sandbox's operation, a fork's, a checkpoint's, a template build's), and
/// the sandbox is kept as the node sent it.
fn record(cp: &ControlPlane, node: &str, caller: &Caller, answer: &serde_json::Value) -> Result<(), ControlError> {
    // A lifecycle answer's sandbox, or a fork's new sandboxes (on the
    // source's node).
    let forks = answer.get("sandboxes").and_then(|s| s.as_array()).cloned().unwrap_or_default();
    for sandbox in answer.get("sandbox").filter(|s| s.is_object()).into_iter().chain(&forks) {
        let id = sandbox["id"].as_str().unwrap_or_default();
        cp.store.cluster().put_placement(id, node, &caller.tenant, &sandbox.to_string(), now_ms())?;
    }
    if let Some(op) = answer["operation"]["id"].as_str() {
        cp.store.cluster().put_operation_node(op, node, &caller.tenant)?;
    }
    Ok(())
}

/// Forwards a request and records what its 202 answer says (the operation,
/// and the sandbox as it is).
pub(crate) async fn forward_recording(
    cp: &ControlPlane,
    caller: &Caller,
    node: NodeRow,
    request: Request,
) -> Result<Response, ControlError> {
    let response = forward(cp, &node, caller, request).await?;
    if response.status() != StatusCode::ACCEPTED {
        return Ok(response);
    }
    let (response, answer) = read_answer::<serde_json::Value>(response).await?;
    if let Some(answer) = answer {
        record(cp, &node.id, caller, &answer)?;
    }
    Ok(response)
}

/// Asks every live node (as `caller`) and reads each answer whole (those
/// that are not a `T` are passed over).
pub(crate) async fn ask_all<T: DeserializeOwned>(
    cp: &ControlPlane,
    caller: &Caller,
    path_and_query: &str,
) -> Result<Vec<T>, ControlError> {
    ask_all_but(cp, caller, path_and_query, None).await
}

/// [`ask_all`] but the node `except`.
pub(crate) async fn ask_all_but<T: DeserializeOwned>(
    cp: &ControlPlane,
    caller: &Caller,
    path_and_query: &str,
    except: Option<&str>,
) -> Result<Vec<T>, ControlError> {
    let mut answers = Vec::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive && Some(n.row.id.as_str()) != except) {
        let request =
            Request::get(path_and_query).body(Body::empty()).map_err(|e| ControlError::bad_request(e.to_string()))?;
        let response = forward(cp, &node.row, caller, request).await?;
        if !response.status().is_success() {
            let why = format!("node {} answered {}", node.row.id, response.status());
            return Err(ControlError::new(ErrorCode::NodeUnreachable, why));
        }
        if let (_, Some(answer)) = read_answer(response).await? {
            answers.push(answer);
        }
    }
    Ok(answers)
}
