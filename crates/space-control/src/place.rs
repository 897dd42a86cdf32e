//! Where a sandbox goes and where a request about one goes: a create is
//! placed on a live node that has its template and the most memory left
//! (once the tenant's quotas allow it); a request about a sandbox goes to
//! its node, and one whose node is lost answers as failed.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use space_api::cluster::DiskAllowance;
use space_api::{ErrorCode, SandboxState};
use space_core::tenants::Caller;
use space_store::NodeRow;

use crate::error::ControlError;
use crate::forward::forward_recording;
use crate::quotas::{check_quotas, create_size, disk_allowance};
use crate::state::{live_node, lost_sandbox, mark_gone, nodes, ControlPlane};

/// Places a new sandbox: a live node that has the template, with the most
/// memory left once what was placed since its last report is counted.
pub(crate) async fn create(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
    // The body as sent: the node validates it (and answers its errors).
    let wanted: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| ControlError::new(ErrorCode::MalformedJson, e.to_string()))?;
    let key = parts.headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string);
    let (node, allowance) = place(cp, caller, &wanted, key.as_deref()).await?;
    parts.extensions.insert(allowance);
    forward_recording(cp, caller, node, Request::from_parts(parts, Body::from(bytes))).await
}

/// The node a new sandbox (`wanted`: its template, vCPUs and memory, as a
/// create names them) goes to, once the tenant's quotas allow it, and the
/// tenant's disk allowance there.
pub(crate) async fn place(
    cp: &ControlPlane,
    caller: &Caller,
    wanted: &serde_json::Value,
    key: Option<&str>,
) -> Result<(NodeRow, DiskAllowance), ControlError> {
    let template = wanted["template"].as_str().unwrap_or("base").to_string();
    let quotas = cp.store.tenancy().tenant_quotas(&caller.tenant)?;
    let nodes = nodes(cp)?;
    let size = create_size(wanted, &nodes);
    let memory = size.1;
    check_quotas(cp, caller, &quotas, &nodes, size, 1)?;
    let anywhere = nodes.iter().any(|n| n.report.templates.contains(&template));
    // A template built to run on one engine goes to a node that has it.
    let engine = nodes.iter().find_map(|n| n.report.pinned.get(&template)).cloned();
    let mut best: Option<(i64, NodeRow)> = None;
    for node in nodes.into_iter().filter(|n| n.alive && n.report.can_run(&template, engine.as_deref())) {
        // What was placed since its last report, which could not count it.
        let placed_since: i64 = cp
            .store
            .cluster()
            .placements_since(&node.row.id, node.reported_ms())?
            .iter()
            .filter_map(|p| serde_json::from_str::<serde_json::Value>(&p.sandbox).ok())
            .filter(|s| !node.report.sandboxes.iter().any(|id| s["id"] == id.as_str()))
            .map(|s| s["memory_mib"].as_i64().unwrap_or(0))
            .sum();
        let free = node.report.capacity_mib as i64 - node.report.promised_mib as i64 - placed_since;
        if best.as_ref().is_none_or(|(f, _)| free > *f) {
            best = Some((free, node.row));
        }
    }
    // A create repeated with its Idempotency-Key, through any replica, goes
    // to the node the first one went to, which replays its operation.
    let chosen = match (key, &best) {
        (Some(key), Some((_, node))) => Some(cp.store.cluster().create_key_node(&caller.tenant, key, &node.id)?),
        (Some(key), None) => cp.store.cluster().create_key_node(&caller.tenant, key, "").ok().filter(|n| !n.is_empty()),
        _ => None,
    };
    if let Some(chosen) = chosen.filter(|c| best.as_ref().is_none_or(|(_, b)| b.id != *c)) {
        let node = live_node(cp, &chosen)?;
        let allowance = disk_allowance(cp, caller, quotas.max_disk_mib, &node.id).await?;
        return Ok((node, allowance));
    }
    let Some((free, node)) = best else {
        return Err(match (anywhere, &engine) {
            (true, Some(engine)) => {
                ControlError::unavailable(format!("no live node that runs {engine} has template {template:?}"))
            }
            (true, None) => ControlError::unavailable(format!("no live node has template {template:?}")),
            (false, _) => space_core::error::template_not_found(&template).into(),
        });
    };
    if free < memory as i64 {
        return Err(ControlError::unavailable(format!("no node has {memory} MiB free for this sandbox")));
    }
    let allowance = disk_allowance(cp, caller, quotas.max_disk_mib, &node.id).await?;
    Ok((node, allowance))
}

/// A request about one sandbox goes to its node; a sandbox whose node is
/// lost answers as failed.
pub(crate) async fn sandbox_request(
    cp: &ControlPlane,
    caller: &Caller,
    id: &str,
    mut request: Request,
) -> Result<Response, ControlError> {
    let Some(placement) = cp.store.cluster().placement(id)?.filter(|p| p.tenant == caller.tenant) else {
        return Err(ControlError::not_found("sandbox", id));
    };
    let node = match live_node(cp, &placement.node_id) {
        Ok(node) => node,
        Err(lost) => {
            let whole = request.uri().path().trim_end_matches('/') == format!("/v1/sandboxes/{id}");
            if request.method() == Method::GET && whole {
                return Ok(match lost_sandbox(&placement, &lost.message) {
                    Some(shown) => axum::Json(shown).into_response(),
                    // Deleted: as it was kept.
                    None => {
                        axum::Json(serde_json::from_str::<serde_json::Value>(&placement.sandbox).unwrap_or_default())
                            .into_response()
                    }
                });
            }
            return Err(ControlError::invalid_state("sandbox", "failed", "use it (its node is lost)"));
        }
    };
    // A suspend, a checkpoint or a fork writes what the tenant's disk quota
    // counts; forks count against its other quotas too, cluster-wide.
    let path = request.uri().path().trim_end_matches('/').to_string();
    if request.method() == Method::POST && path.ends_with("/fork") {
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
            .await
            .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
        let count = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|body| body["count"].as_u64())
            .map_or(1, |count| count.clamp(1, u64::from(space_api::MAX_FORKS)) as u32);
        // A fork is the size of its source, as created.
        let source: serde_json::Value = serde_json::from_str(&placement.sandbox).unwrap_or_default();
        let nodes = nodes(cp)?;
        let size = create_size(&source, &nodes);
        check_quotas(cp, caller, &cp.store.tenancy().tenant_quotas(&caller.tenant)?, &nodes, size, count)?;
        request = Request::from_parts(parts, Body::from(bytes));
    }
    if request.method() == Method::POST && ["/suspend", "/fork", "/checkpoints"].iter().any(|end| path.ends_with(end)) {
        let max_disk_mib = cp.store.tenancy().tenant_quotas(&caller.tenant)?.max_disk_mib;
        request.extensions_mut().insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    }
    let deleting = request.method() == Method::DELETE && request.uri().path().trim_end_matches('/').ends_with(id);
    let node_id = node.id.clone();
    let response = forward_recording(cp, caller, node, request).await?;
    if deleting && response.status() == StatusCode::ACCEPTED {
        mark_gone(cp, id, &node_id, caller, SandboxState::Deleting)?;
    }
    Ok(response)
}
