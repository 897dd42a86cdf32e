//! Volumes in a cluster (issue 37, decision 031): a volume lives on one
//! node's disk, and the control plane records which (`volume_nodes`). A
//! create goes to the live node with the most free disk (or, made from a
//! snapshot, to that snapshot's node), claimed by name first so that two
//! replicas never make one name on two nodes; every other request about
//! a volume goes to its node; the list asks every live node; a move copies
//! an unmounted volume's files as a tar from its node to another.
//!
//! Another tenant's volume is answered exactly as one that does not
//! exist: both are a name the caller's tenant has no record of, refused
//! before any node is asked.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use space_api::cluster::DiskAllowance;
use space_api::{CreateVolumeRequest, ErrorCode, MoveVolumeRequest, Volume, VolumeList};
use space_core::tenants::Caller;
use space_store::{NodeRow, VolumeNode};

use crate::error::ControlError;
use crate::forward::forward;
use crate::node_client::{CallError, NodeClient};
use crate::quotas::disk_allowance;
use crate::state::{live_node, nodes, now_ms, ControlPlane};

/// How long a move holds a volume before it must renew the hold (a
/// replica killed mid-move lets go of it within this).
const MOVE_HOLD: Duration = Duration::from_secs(60);
/// How often a move renews its hold.
const MOVE_RENEW: Duration = Duration::from_secs(10);
/// A claimed name whose node never made the volume (a replica killed
/// between the claim and the node's answer) may be claimed again after
/// this, once its node says it has no such volume.
const STALE_CLAIM: Duration = Duration::from_secs(30);

/// 404 `volume_not_found`, as a node answers it.
pub(crate) fn volume_not_found(name: &str) -> ControlError {
    ControlError::new(ErrorCode::VolumeNotFound, format!("no volume named {name:?}"))
        .with_details(serde_json::json!({"kind": "volume", "id": name}))
}

/// 409 `invalid_state`: a move holds the volume.
fn being_moved(name: &str, action: &str) -> ControlError {
    ControlError::new(ErrorCode::InvalidState, format!("cannot {action}: volume {name:?} is being moved"))
        .with_details(serde_json::json!({"state": "moving"}))
        .retry_after(5)
}

/// The caller's record of volume `name` (`volume_not_found` if it has none).
fn record(cp: &ControlPlane, caller: &Caller, name: &str) -> Result<VolumeNode, ControlError> {
    cp.store.cluster().volume_node(&caller.tenant, name)?.ok_or_else(|| volume_not_found(name))
}

fn moving(volume: &VolumeNode) -> bool {
    volume.moving_until_ms > now_ms()
}

/// The node a sandbox that mounts volumes `names` must go to (`None`
/// when it mounts none): all of them must be on one node. An unknown
/// volume is 404 before any node is asked; volumes on two nodes are 422
/// naming both.
pub(crate) fn volumes_node(cp: &ControlPlane, caller: &Caller, names: &[&str]) -> Result<Option<String>, ControlError> {
    let mut home: Option<(String, String)> = None;
    for name in names {
        let volume = record(cp, caller, name)?;
        if moving(&volume) {
            return Err(being_moved(name, "mount it"));
        }
        match &home {
            Some((first, node)) if *node != volume.node_id => {
                return Err(ControlError::new(
                    ErrorCode::InvalidValue,
                    format!(
                        "volume {first:?} is on node {node} and volume {name:?} on node {}: a sandbox mounts \
                         volumes of one node (move one with POST /v1/volumes/{{name}}/move)",
                        volume.node_id
                    ),
                )
                .with_details(serde_json::json!({"field": "volumes"})));
            }
            Some(_) => {}
            None => home = Some((name.to_string(), volume.node_id)),
        }
    }
    Ok(home.map(|(_, node)| node))
}

/// A name that can be recorded and put in a path as it is. The node
/// checks the name for itself (more narrowly); one it would refuse in any
/// case goes to it unclaimed, and its refusal is passed on.
fn recordable(name: &str) -> bool {
    !name.is_empty() && name.len() <= 255 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `POST /v1/volumes`: claimed, then made on its node.
pub(crate) async fn create(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
    // Read as the node reads it (refused the same way), to place it; the
    // body goes on as sent.
    let axum::Json(create) =
        axum::Json::<CreateVolumeRequest>::from_bytes(&bytes).map_err(space_http::extract::json_rejection)?;
    let node = match &create.from_snapshot {
        // A copy-on-write copy of a snapshot is made beside it.
        Some(from) => {
            let source = record(cp, caller, &from.volume)?;
            live_node(cp, &source.node_id)?
        }
        None => most_free_disk(cp).await?,
    };
    let max_disk_mib = cp.store.tenancy().tenant_quotas(&caller.tenant)?.max_disk_mib;
    parts.extensions.insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    let request = Request::from_parts(parts, Body::from(bytes));
    if !recordable(&create.name) {
        return forward(cp, &node, caller, request).await;
    }
    let claimed = claim(cp, caller, &create.name, &node.id).await?;
    // Unanswered, whether the node made it is not known: the claim stays,
    // and is taken back once its node says it has no such volume.
    let response = forward(cp, &node, caller, request).await?;
    if !response.status().is_success() {
        cp.store.cluster().forget_volume(&caller.tenant, &create.name, &node.id, claimed)?;
        return Ok(response);
    }
    with_node(response, &node.id).await
}

/// Claims `name` for `node`; the claim's time. A name the tenant holds is
/// 409 `name_taken`, unless it is a claim whose node never made it.
async fn claim(cp: &ControlPlane, caller: &Caller, name: &str, node: &str) -> Result<i64, ControlError> {
    let now = now_ms();
    if cp.store.cluster().claim_volume(&caller.tenant, name, node, now)? {
        return Ok(now);
    }
    let taken = || {
        ControlError::new(ErrorCode::NameTaken, format!("a volume named {name:?} exists"))
            .with_details(serde_json::json!({"field": "name"}))
    };
    let Some(held) = cp.store.cluster().volume_node(&caller.tenant, name)? else {
        // Deleted since: claim it again (once).
        return match cp.store.cluster().claim_volume(&caller.tenant, name, node, now)? {
            true => Ok(now),
            false => Err(taken()),
        };
    };
    if now - held.created_at_ms < STALE_CLAIM.as_millis() as i64 {
        return Err(taken());
    }
    let Ok(holder) = live_node(cp, &held.node_id) else {
        return Err(taken());
    };
    let client = NodeClient::new(cp, &holder);
    if client.volume(caller, name).await.map_err(|e| e.into_control(client.id()))?.is_some() {
        return Err(taken());
    }
    tracing::warn!(tenant = %caller.tenant, volume = name, node = %held.node_id,
        "a claim whose node never made the volume is taken back");
    cp.store.cluster().forget_volume(&caller.tenant, name, &held.node_id, held.created_at_ms)?;
    match cp.store.cluster().claim_volume(&caller.tenant, name, node, now)? {
        true => Ok(now),
        false => Err(taken()),
    }
}

/// The live node with the most free disk (beyond what it keeps free), as
/// each says now.
async fn most_free_disk(cp: &ControlPlane) -> Result<NodeRow, ControlError> {
    let live: Vec<NodeRow> = nodes(cp)?.into_iter().filter(|n| n.alive).map(|n| n.row).collect();
    let asked = futures_util::future::join_all(live.iter().map(|row| async move {
        let health = NodeClient::new(cp, row).health().await;
        (row, health)
    }))
    .await;
    let mut best: Option<(u64, &NodeRow)> = None;
    for (row, health) in asked {
        match health {
            Ok(health) => {
                let free = health.disk.free_bytes.saturating_sub(health.disk.reserve_bytes);
                if best.is_none_or(|(most, _)| free > most) {
                    best = Some((free, row));
                }
            }
            // One node that does not answer is passed over, not an error.
            Err(err) => tracing::warn!(node = %row.id, "asking its free disk: {err}"),
        }
    }
    best.map(|(_, row)| row.clone()).ok_or_else(|| ControlError::unavailable("no live node to hold a volume"))
}

/// A node's answer with a `Volume`, with `node` set to it if the node did
/// not say so itself; any other answer as it came.
async fn with_node(response: Response, node: &str) -> Result<Response, ControlError> {
    if !response.status().is_success() {
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 4 << 20)
        .await
        .map_err(|e| ControlError::new(ErrorCode::NodeUnreachable, format!("node {node}: reading a volume: {e}")))?;
    let mut volume: Volume = serde_json::from_slice(&bytes).map_err(|e| {
        ControlError::new(ErrorCode::NodeUnreachable, format!("node {node}: its answer is not a Volume: {e}"))
    })?;
    if volume.node.is_some() {
        return Ok(Response::from_parts(parts, Body::from(bytes)));
    }
    volume.node = Some(node.to_string());
    let mut response = axum::Json(volume).into_response();
    *response.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_LENGTH {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    Ok(response)
}

/// `GET /v1/volumes`: the caller's volumes on every live node, each as
/// its node has it (a copy a move left behind is not listed), by name as
/// a node lists them.
pub(crate) async fn list(cp: &ControlPlane, caller: &Caller) -> Result<Response, ControlError> {
    let records = cp.store.cluster().volume_nodes(&caller.tenant)?;
    let mut volumes = Vec::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let client = NodeClient::new(cp, &node.row);
        let answer = client.list_volumes(caller).await.map_err(|e| e.into_control(client.id()))?;
        for mut volume in answer.volumes {
            if records.iter().any(|r| r.name == volume.name && r.node_id == node.row.id) {
                volume.node = Some(node.row.id.clone());
                volumes.push(volume);
            }
        }
    }
    volumes.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(axum::Json(VolumeList { volumes }).into_response())
}

/// `/v1/volumes/{name}…` but the move: relayed to the volume's node. A
/// change is refused while a move holds it; a delete the node did
/// forgets it.
pub(crate) async fn volume_request(
    cp: &ControlPlane,
    caller: &Caller,
    name: &str,
    mut request: Request,
) -> Result<Response, ControlError> {
    let volume = record(cp, caller, name)?;
    let method = request.method().clone();
    if moving(&volume) && method != Method::GET && method != Method::HEAD {
        return Err(being_moved(name, "change it"));
    }
    let node = live_node(cp, &volume.node_id)?;
    let path = request.uri().path().trim_end_matches('/').to_string();
    let whole = path == format!("/v1/volumes/{name}");
    // A snapshot holds what only it holds, counted in the disk quota.
    if method == Method::POST && path.ends_with("/snapshots") {
        let max_disk_mib = cp.store.tenancy().tenant_quotas(&caller.tenant)?.max_disk_mib;
        request.extensions_mut().insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    }
    let response = forward(cp, &node, caller, request).await?;
    if whole && method == Method::DELETE && response.status().is_success() {
        cp.store.cluster().forget_volume(&caller.tenant, name, &node.id, volume.created_at_ms)?;
    }
    if whole && method == Method::GET {
        return with_node(response, &node.id).await;
    }
    Ok(response)
}

/// `POST /v1/volumes/{name}/move {"node"}`: the volume made anew on
/// `node` with its size and its files copied there as a tar (streamed),
/// then its record moved and the old copy deleted. Refused while a
/// sandbox mounts it and while it has snapshots (a move does not carry
/// them). A failure midway deletes the new copy and leaves the volume
/// where it was.
pub(crate) async fn move_volume(
    cp: &Arc<ControlPlane>,
    caller: &Caller,
    name: &str,
    request: Request,
) -> Result<Response, ControlError> {
    // Refused in the order a node's extractors refuse: the volume, the
    // query, the body.
    let volume = record(cp, caller, name)?;
    let (mut parts, body) = request.into_parts();
    use axum::extract::FromRequestParts as _;
    space_http::extract::NoQuery::from_request_parts(&mut parts, &()).await?;
    let body = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
        .await
        .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
    let axum::Json(wanted) =
        axum::Json::<MoveVolumeRequest>::from_bytes(&body).map_err(space_http::extract::json_rejection)?;
    let Some(target) = cp.store.cluster().node(&wanted.node)? else {
        return Err(ControlError::new(ErrorCode::InvalidValue, format!("no node {:?} in the cluster", wanted.node))
            .with_details(serde_json::json!({"field": "node"})));
    };
    let source = live_node(cp, &volume.node_id)?;
    let source_client = NodeClient::new(cp, &source);
    if target.id == source.id {
        // Already there: a move repeated after it succeeded.
        let shown = source_client.volume(caller, name).await.map_err(|e| e.into_control(&source.id))?;
        let mut shown = shown.ok_or_else(|| volume_not_found(name))?;
        shown.node = Some(source.id.clone());
        return Ok(axum::Json(shown).into_response());
    }
    let target = live_node(cp, &target.id)?;
    let shown = carry(cp, caller, name, source, target).await?;
    Ok((StatusCode::OK, axum::Json(shown)).into_response())
}

/// Moves volume `name` from `source` to `target` under a hold that refuses
/// writes and mounts meanwhile: handed over when both nodes share a volume
/// store (decision 032), else its files copied.
async fn carry(
    cp: &Arc<ControlPlane>,
    caller: &Caller,
    name: &str,
    source: NodeRow,
    target: NodeRow,
) -> Result<Volume, ControlError> {
    let now = now_ms();
    let until = now + MOVE_HOLD.as_millis() as i64;
    if !cp.store.cluster().hold_volume_move(&caller.tenant, name, &source.id, now, until, false)? {
        return Err(being_moved(name, "move it"));
    }
    let shared = store_of(&source).is_some() && store_of(&source) == store_of(&target);
    // Carried through to its end (or its undoing) in a task of its own: a
    // caller that goes away midway must not leave a copy on each node.
    let (owned, who, what) = (cp.clone(), caller.clone(), name.to_string());
    let (from, to) = (source.clone(), target.clone());
    let task = tokio::spawn(async move {
        let (cp, caller, name) = (&*owned, &who, what.as_str());
        let copy = async {
            match shared {
                true => hand_over(cp, caller, name, &from, &to).await,
                false => copy_to(cp, caller, name, &from, &to).await,
            }
        };
        tokio::pin!(copy);
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + MOVE_RENEW, MOVE_RENEW);
        let moved = loop {
            tokio::select! {
                moved = &mut copy => break moved,
                _ = renew.tick() => renew_hold(cp, caller, name),
            }
        };
        cp.store.cluster().release_volume_move(&caller.tenant, name)?;
        moved
    });
    let moved = task.await.map_err(|e| ControlError::internal("moving a volume", e))?;
    let mut shown = moved?;
    shown.node = Some(target.id.clone());
    tracing::info!(tenant = %caller.tenant, volume = name, from = %source.id, to = %target.id, shared, "moved a volume");
    Ok(shown)
}

/// The shared volume store a node reported (decision 032), if any.
fn store_of(node: &NodeRow) -> Option<String> {
    serde_json::from_str::<space_api::cluster::NodeReport>(&node.report).ok().and_then(|report| report.volume_store)
}

/// The shared store all of the volumes `names` are in, when they are all
/// in one (decision 032); `None` when any is on a node's own disk.
pub(crate) fn volumes_store(
    cp: &ControlPlane,
    caller: &Caller,
    names: &[&str],
) -> Result<Option<String>, ControlError> {
    let mut common: Option<String> = None;
    for name in names {
        let volume = record(cp, caller, name)?;
        let store = cp.store.cluster().node(&volume.node_id)?.as_ref().and_then(store_of);
        match (store, &common) {
            (None, _) => return Ok(None),
            (Some(store), Some(seen)) if store != *seen => return Ok(None),
            (Some(store), _) => common = Some(store),
        }
    }
    Ok(common)
}

/// Brings every volume of `names` (all in one shared store) to `node`,
/// handing over each one that is elsewhere: how a sandbox that mounts
/// volumes of a shared store goes wherever placement puts it. One that
/// something mounts where it is refuses (409 `volume_in_use`).
pub(crate) async fn gather(
    cp: &Arc<ControlPlane>,
    caller: &Caller,
    names: &[&str],
    node: &NodeRow,
) -> Result<(), ControlError> {
    for name in names {
        let volume = record(cp, caller, name)?;
        if volume.node_id == node.id {
            continue;
        }
        let source = live_node(cp, &volume.node_id)?;
        carry(cp, caller, name, source, node.clone()).await?;
    }
    Ok(())
}

/// The steps of a move between nodes that share a volume store (decision
/// 032) while its hold is kept: the source lets go of the volume (refused
/// while anything mounts it), the record moves, the target takes it. No
/// file is copied and its snapshots go with it. A failure after the
/// source let go gives it back to the source.
async fn hand_over(
    cp: &ControlPlane,
    caller: &Caller,
    name: &str,
    source: &NodeRow,
    target: &NodeRow,
) -> Result<Volume, ControlError> {
    let (from, to) = (NodeClient::new(cp, source), NodeClient::new(cp, target));
    let handed = from.release_volume(caller, name).await.map_err(|e| e.into_control(&source.id))?;
    let taken = async {
        if !cp.store.cluster().relocate_volume(&caller.tenant, name, &source.id, &target.id)? {
            return Err(ControlError::internal("moving a volume's record", "it is no longer on its source node"));
        }
        to.adopt_volume(&handed).await.map_err(|e| e.into_control(&target.id))
    }
    .await;
    if let Err(err) = &taken {
        tracing::warn!(tenant = %caller.tenant, volume = name, node = %target.id, "handing a volume over: {}", err.message);
        if let Err(store) = cp.store.cluster().relocate_volume(&caller.tenant, name, &target.id, &source.id) {
            tracing::error!(tenant = %caller.tenant, volume = name, "moving a volume's record back: {store}");
        }
        if let Err(back) = from.adopt_volume(&handed).await {
            tracing::error!(tenant = %caller.tenant, volume = name, node = %source.id,
                "a volume its node let go of could not be given back: {back}");
        }
    }
    taken
}

/// The steps of a move while its hold is kept: the volume on `target`
/// as it reports it, or why not (and nothing changed).
async fn copy_to(
    cp: &ControlPlane,
    caller: &Caller,
    name: &str,
    source: &NodeRow,
    target: &NodeRow,
) -> Result<Volume, ControlError> {
    let (from, to) = (NodeClient::new(cp, source), NodeClient::new(cp, target));
    let at_source = |e: CallError| e.into_control(&source.id);
    let volume = from.volume(caller, name).await.map_err(at_source)?.ok_or_else(|| volume_not_found(name))?;
    if let Some(holder) = volume.mounted_by.first() {
        return Err(ControlError::new(
            ErrorCode::VolumeInUse,
            format!(
                "volume {name:?} is mounted by sandbox {}: a volume moves while nothing mounts it",
                holder.sandbox_id
            ),
        )
        .with_details(serde_json::json!({"sandbox_id": holder.sandbox_id})));
    }
    if !volume.snapshots.is_empty() {
        let names: Vec<&str> = volume.snapshots.iter().map(|s| s.name.as_str()).collect();
        return Err(ControlError::new(
            ErrorCode::InvalidState,
            format!(
                "volume {name:?} has snapshots ({}): a move does not carry them; delete them first",
                names.join(", ")
            ),
        )
        .with_details(serde_json::json!({"state": "has_snapshots", "snapshots": names})));
    }
    // Made on the target with its size; the tenant's allowance there does
    // not count the copy being moved away.
    let quotas = cp.store.tenancy().tenant_quotas(&caller.tenant)?;
    let allowance = match disk_allowance(cp, caller, quotas.max_disk_mib, &target.id).await? {
        DiskAllowance::Quota { max_mib, elsewhere_bytes } => DiskAllowance::Quota {
            max_mib,
            elsewhere_bytes: elsewhere_bytes.saturating_sub(u64::from(volume.size_mib) << 20),
        },
        unlimited => unlimited,
    };
    let create = CreateVolumeRequest { name: name.to_string(), size_mib: Some(volume.size_mib), from_snapshot: None };
    to.create_volume(caller, &create, allowance).await.map_err(|e| e.into_control(&target.id))?;
    let copied = async {
        let tar = from.volume_tar(caller, name).await.map_err(at_source)?;
        to.put_volume_tar(caller, name, tar).await.map_err(|e| e.into_control(&target.id))?;
        // The record moves (the hold stays) before the old copy goes: a
        // failure after leaves the volume on one node or the other, found.
        if !cp.store.cluster().relocate_volume(&caller.tenant, name, &source.id, &target.id)? {
            return Err(ControlError::internal("moving a volume's record", "it is no longer on its source node"));
        }
        Ok(())
    }
    .await;
    let done = match copied {
        Ok(()) => match from.delete_volume(caller, name).await {
            Ok(()) => Ok(()),
            Err(err) => match cp.store.cluster().relocate_volume(&caller.tenant, name, &target.id, &source.id) {
                Ok(_) => Err(err.into_control(&source.id)),
                // The record stays on the target, whose copy is whole: it
                // is kept, and the source's is left over (not listed).
                Err(store) => {
                    tracing::error!(tenant = %caller.tenant, volume = name, node = %source.id,
                        "a moved volume's old copy could not be deleted ({err}) nor its record moved back: {store}");
                    return Err(err.into_control(&source.id));
                }
            },
        },
        Err(err) => Err(err),
    };
    if let Err(err) = done {
        // The new copy goes; the volume stays where it was.
        if let Err(left) = to.delete_volume(caller, name).await {
            tracing::warn!(tenant = %caller.tenant, volume = name, node = %target.id,
                "a failed move's copy could not be deleted: {left}");
        }
        return Err(err);
    }
    to.volume(caller, name).await.map_err(|e| e.into_control(&target.id))?.ok_or_else(|| volume_not_found(name))
}

/// Renews a move's hold while it copies, wherever its record is now
/// (it moves to the target before the old copy is deleted).
fn renew_hold(cp: &ControlPlane, caller: &Caller, name: &str) {
    let now = now_ms();
    let until = now + MOVE_HOLD.as_millis() as i64;
    let renewed = cp.store.cluster().volume_node(&caller.tenant, name).and_then(|held| match held {
        Some(held) => cp.store.cluster().hold_volume_move(&caller.tenant, name, &held.node_id, now, until, true),
        None => Ok(false),
    });
    match renewed {
        Ok(true) => {}
        Ok(false) => tracing::warn!(tenant = %caller.tenant, volume = name, "a move's hold lapsed before it ended"),
        Err(err) => tracing::warn!(tenant = %caller.tenant, volume = name, "renewing a move's hold: {err}"),
    }
}
