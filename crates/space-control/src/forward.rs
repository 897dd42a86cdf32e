//! Sending a user's request on to its node as the caller: a relay,
//! streaming both ways, an upgrade spliced.

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use space_api::cluster::{DiskAllowance, DISK_QUOTA_HEADER, NODE_HEADER, OPERATOR_HEADER, TENANT_HEADER};
use space_api::ErrorCode;
use space_core::tenants::Caller;
use space_store::NodeRow;

use crate::error::ControlError;
use crate::state::ControlPlane;

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
        // A preview's own proofs and host go on to the node, which checks
        // them (and drops them before the sandbox).
        let preview = caller.is_none() && name.as_str().starts_with("x-space-preview-");
        let ours = key || name == header::HOST || (name.as_str().starts_with("x-space-") && !preview);
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
    // The host the caller asked for, which the node's answers may name (a
    // preview's link).
    if let (Some(_), Some(host), false) =
        (caller, parts.headers.get(header::HOST), incoming.contains_key("x-forwarded-host"))
    {
        headers.insert("x-forwarded-host", host.clone());
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

/// A request to a preview host, sent on to the node of its sandbox as it
/// is (its preview token or cookie, which the node checks and never passes
/// into the sandbox), less any API key, with the host it named and the node
/// token that makes the node take that host's word.
pub(crate) async fn relay_preview(
    cp: &ControlPlane,
    node: &NodeRow,
    host: &HeaderValue,
    request: Request,
) -> Result<Response, ControlError> {
    let (mut parts, body) = request.into_parts();
    parts.headers.remove(header::AUTHORIZATION);
    parts.headers.remove("x-api-key");
    parts.headers.insert(space_http::preview::FORWARDED_HOST, host.clone());
    let token = HeaderValue::from_str(&format!("Bearer {}", cp.node_token))
        .map_err(|e| ControlError::internal("the node token", e))?;
    parts.headers.insert(header::AUTHORIZATION, token);
    relay_to(cp, node, None, Request::from_parts(parts, body)).await
}
