//! Where a sandbox goes and where a request about one goes: a create is
//! placed on a live node that has its template and the most memory left
//! (once the tenant's quotas allow it), or, when it mounts volumes, on
//! their node; a request about a sandbox goes to its node, and one whose
//! node is lost answers as failed.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use space_api::cluster::DiskAllowance;
use space_api::{CreateSandboxRequest, ErrorCode, ForkRequest, SandboxState};
use space_core::tenants::Caller;
use space_store::NodeRow;

use crate::error::ControlError;
use crate::node_client::Expect;
use crate::quotas::{check_quotas, create_size, disk_allowance, Wanted};
use crate::record::forward_recording;
use crate::state::{live_node, lost_sandbox, mark_gone, nodes, placed_sandbox, ControlPlane, Node};
use crate::volumes::{gather, volumes_node, volumes_store};

/// Places a new sandbox: a live node that has the template, with the most
/// memory left once what was placed since its last report is counted.
pub(crate) async fn create(
    cp: &std::sync::Arc<ControlPlane>,
    caller: &Caller,
    request: Request,
) -> Result<Response, ControlError> {
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
    // Read as the node reads it (refused the same way), to place it; the
    // body goes on as sent, and the node validates the rest.
    let axum::Json(request) =
        axum::Json::<CreateSandboxRequest>::from_bytes(&bytes).map_err(space_http::extract::json_rejection)?;
    let wanted = Wanted { template: &request.template, vcpus: request.vcpus, memory_mib: request.memory_mib };
    let key = parts.headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string);
    let names: Vec<&str> = request.volumes.iter().map(|mount| mount.name.as_str()).collect();
    let (node, allowance) = match volumes_store(cp, caller, &names)? {
        // Volumes of a shared store go where the sandbox is placed (among
        // the nodes that share it), unless something mounts them where
        // they are: then the sandbox goes there (decision 032).
        Some(store) => {
            let (node, allowance) = place_among(cp, caller, &wanted, key.as_deref(), None, Some(&store)).await?;
            match gather(cp, caller, &names, &node).await {
                Ok(()) => (node, allowance),
                Err(err) if err.code == ErrorCode::VolumeInUse => {
                    let home = volumes_node(cp, caller, &names)?;
                    place(cp, caller, &wanted, key.as_deref(), home.as_deref()).await?
                }
                Err(err) => return Err(err),
            }
        }
        None => {
            let home = volumes_node(cp, caller, &names)?;
            place(cp, caller, &wanted, key.as_deref(), home.as_deref()).await?
        }
    };
    parts.extensions.insert(allowance);
    forward_recording(cp, caller, node, Request::from_parts(parts, Body::from(bytes)), Expect::Sandbox).await
}

/// The node a new sandbox goes to, once the tenant's quotas allow it, and
/// the tenant's disk allowance there; with `only` (the node of the volumes
/// it mounts), that node or none.
pub(crate) async fn place(
    cp: &ControlPlane,
    caller: &Caller,
    wanted: &Wanted<'_>,
    key: Option<&str>,
    only: Option<&str>,
) -> Result<(NodeRow, DiskAllowance), ControlError> {
    place_among(cp, caller, wanted, key, only, None).await
}

/// [`place`], among the nodes that report the shared volume store `store`
/// when it is given.
async fn place_among(
    cp: &ControlPlane,
    caller: &Caller,
    wanted: &Wanted<'_>,
    key: Option<&str>,
    only: Option<&str>,
    store: Option<&str>,
) -> Result<(NodeRow, DiskAllowance), ControlError> {
    let template = wanted.template.to_string();
    let quotas = cp.store.tenancy().tenant_quotas(&caller.tenant)?;
    let nodes = nodes(cp)?;
    let size = create_size(wanted, &nodes);
    let memory = size.1;
    check_quotas(cp, caller, &quotas, &nodes, size, 1)?;
    let anywhere = nodes.iter().any(|n| n.report.templates.contains(&template));
    // A template built to run on one engine goes to a node that has it.
    let engine = nodes.iter().find_map(|n| n.report.pinned.get(&template)).cloned();
    let mut best: Option<(i64, NodeRow)> = None;
    let eligible = |n: &Node| {
        only.is_none_or(|only| n.row.id == only) && store.is_none_or(|s| n.report.volume_store.as_deref() == Some(s))
    };
    for node in nodes.into_iter().filter(|n| n.alive && eligible(n) && n.report.can_run(&template, engine.as_deref())) {
        // What was placed since its last report, which could not count it.
        let mut placed_since: i64 = 0;
        for placement in cp.store.cluster().placements_since(&node.row.id, node.reported_ms())? {
            let sandbox = placed_sandbox(&placement)?;
            if !node.report.sandboxes.contains(&sandbox.id) {
                placed_since += i64::from(sandbox.memory_mib);
            }
        }
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
        return Err(match (anywhere, &engine, only) {
            (true, _, Some(only)) => ControlError::unavailable(format!(
                "node {only}, which holds the volumes it mounts, is lost or cannot run template {template:?}{}",
                engine.as_ref().map(|e| format!(" on {e}")).unwrap_or_default()
            )),
            (true, Some(engine), None) => {
                ControlError::unavailable(format!("no live node that runs {engine} has template {template:?}"))
            }
            (true, None, None) => ControlError::unavailable(format!("no live node has template {template:?}")),
            (false, _, _) => space_core::error::template_not_found(&template).into(),
        });
    };
    if free < memory as i64 {
        return Err(ControlError::unavailable(match only {
            Some(only) => format!("node {only}, which holds the volumes it mounts, has not {memory} MiB free"),
            None => format!("no node has {memory} MiB free for this sandbox"),
        }));
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
                return Ok(match lost_sandbox(&placement, &lost.message)? {
                    Some(shown) => axum::Json(shown).into_response(),
                    // Deleted: as it was kept.
                    None => axum::Json(placed_sandbox(&placement)?).into_response(),
                });
            }
            return Err(ControlError::invalid_state("sandbox", "failed", "use it (its node is lost)"));
        }
    };
    // A suspend, a checkpoint or a fork writes what the tenant's disk quota
    // counts; forks count against its other quotas too, cluster-wide.
    let path = request.uri().path().trim_end_matches('/').to_string();
    let fork = request.method() == Method::POST && path.ends_with("/fork");
    if fork {
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
            .await
            .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
        // A body the node will refuse is not counted: it goes on, and the
        // node answers why (as it checks the headers first, its answer
        // is the one a single host would give).
        if let Ok(fork) = serde_json::from_slice::<ForkRequest>(&bytes) {
            let count = fork.count.unwrap_or(1).clamp(1, space_api::MAX_FORKS);
            // A fork is the size of its source, as created.
            let source = placed_sandbox(&placement)?;
            let size = (u64::from(source.vcpus), u64::from(source.memory_mib));
            let quotas = cp.store.tenancy().tenant_quotas(&caller.tenant)?;
            check_quotas(cp, caller, &quotas, &nodes(cp)?, size, count)?;
        }
        request = Request::from_parts(parts, Body::from(bytes));
    }
    if request.method() == Method::POST && ["/suspend", "/fork", "/checkpoints"].iter().any(|end| path.ends_with(end)) {
        let max_disk_mib = cp.store.tenancy().tenant_quotas(&caller.tenant)?.max_disk_mib;
        request.extensions_mut().insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    }
    let deleting = request.method() == Method::DELETE && request.uri().path().trim_end_matches('/').ends_with(id);
    let node_id = node.id.clone();
    let expect = if fork { Expect::Fork } else { Expect::Sandbox };
    let response = forward_recording(cp, caller, node, request, expect).await?;
    if deleting && response.status() == StatusCode::ACCEPTED {
        mark_gone(cp, id, &node_id, caller, SandboxState::Deleting)?;
    }
    Ok(response)
}
