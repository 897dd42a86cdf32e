//! Templates across the cluster: a build goes to one node (a snapshot
//! template to its sandbox's node, where it stays), the others pull it from
//! there; a delete goes to every node that has it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, Method};
use axum::response::Response;
use space_api::cluster::PullRequest;
use space_api::{CreateTemplateRequest, ErrorCode};
use space_core::tenants::Caller;

use crate::error::ControlError;
use crate::forward::forward;
use crate::node_client::{Expect, NodeClient};
use crate::quotas::disk_allowance;
use crate::record::forward_recording;
use crate::state::{live_node, nodes, now_ms, ControlPlane, Node};

/// How long a deleted template is not spread again (while the nodes that
/// have it delete it, one after another).
const DELETE_HOLD: Duration = Duration::from_secs(60);

/// How long a node is given to pull a template before another try.
const PULL_PATIENCE: Duration = Duration::from_secs(600);

/// A template build (or image import) goes to the live node with the most
/// memory left; the others pull it once it is there.
pub(crate) async fn build(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let (mut parts, body) = request.into_parts();
    // A JSON body is read to find a snapshot template's sandbox; an image
    // archive streams on untouched.
    let json = parts.headers.get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let (body, source) = if json {
        let bytes = axum::body::to_bytes(body, space_http::extract::MAX_JSON_BODY)
            .await
            .map_err(|_| ControlError::new(ErrorCode::TooLarge, "the request body is too large"))?;
        // Read as the node reads it, for its source; one that does not read
        // goes on as sent for the node to refuse (it checks the query and
        // the content type first, as a single host answers).
        let source = serde_json::from_slice::<CreateTemplateRequest>(&bytes)
            .ok()
            .and_then(|build| build.from.sandbox.or(build.from.checkpoint.map(|c| c.sandbox)));
        (Body::from(bytes), source)
    } else {
        (body, None)
    };
    // A snapshot template is made on its sandbox's node (and stays there).
    let node = match source {
        Some(id) => {
            let placement = cp.store.cluster().placement(&id)?.filter(|p| p.tenant == caller.tenant);
            live_node(cp, &placement.ok_or_else(|| ControlError::not_found("sandbox", &id))?.node_id)?
        }
        None => nodes(cp)?
            .into_iter()
            .filter(|n| n.alive)
            .max_by_key(|n| n.report.capacity_mib as i64 - n.report.promised_mib as i64)
            .map(|n| n.row)
            .ok_or_else(|| ControlError::unavailable("no live node to build on"))?,
    };
    let max_disk_mib = cp.store.tenancy().tenant_quotas(&caller.tenant)?.max_disk_mib;
    parts.extensions.insert(disk_allowance(cp, caller, max_disk_mib, &node.id).await?);
    forward_recording(cp, caller, node, Request::from_parts(parts, body), Expect::Template).await
}

/// `GET /v1/templates/{name}` answers from a live node that has it;
/// `DELETE` deletes it on every live node that has it (a node that refuses,
/// say because a sandbox there uses it, keeps it, and the others pull it
/// back once [`DELETE_HOLD`] has passed: the answer is that node's
/// refusal). A node away at the time keeps its copy, and spreads it again
/// when it is back.
pub(crate) async fn template(
    cp: &ControlPlane,
    caller: &Caller,
    name: &str,
    request: Request,
) -> Result<Response, ControlError> {
    let holders: Vec<Node> =
        nodes(cp)?.into_iter().filter(|n| n.alive && n.report.templates.iter().any(|t| t == name)).collect();
    if holders.is_empty() {
        return Err(space_core::error::template_not_found(name).into());
    }
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    // No replica asks a node it was deleted on to pull it back from one it
    // is not deleted on yet. A tenant's delete holds pulls only once the
    // first node has allowed it: a refused one (a shared template, 403)
    // must not stop the template's replication.
    let hold = || -> Result<(), ControlError> {
        let every: Vec<String> = nodes(cp)?.into_iter().map(|n| n.row.id).collect();
        Ok(cp.store.cluster().hold_template_pulls(&every, name, now_ms() + DELETE_HOLD.as_millis() as i64)?)
    };
    let mut held = false;
    if method == Method::DELETE && caller.is_operator() {
        hold()?;
        held = true;
    }
    let mut last = None;
    for node in &holders {
        let request = Request::builder()
            .method(method.clone())
            .uri(&path)
            .body(Body::empty())
            .map_err(|e| ControlError::internal("a request", e))?;
        let response = forward(cp, &node.row, caller, request).await?;
        if method == Method::GET || !response.status().is_success() {
            return Ok(response);
        }
        if !held {
            hold()?;
            held = true;
        }
        last = Some(response);
    }
    last.ok_or_else(|| ControlError::internal("deleting a template", "no node answered"))
}

/// What each replica does every few seconds: a live node that lacks a
/// template another live node has is told to pull it (claimed in the
/// database, so one replica asks, and asks again only if it never came).
pub(crate) async fn replicate_templates(cp: Arc<ControlPlane>) {
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        if let Err(err) = replicate_once(&cp).await {
            tracing::warn!("spreading templates: {}", err.message);
        }
    }
}

async fn replicate_once(cp: &ControlPlane) -> Result<(), ControlError> {
    let live: Vec<Node> = nodes(cp)?.into_iter().filter(|n| n.alive).collect();
    for node in &live {
        for source in &live {
            let spread = source.report.templates.iter().filter(|t| !source.report.local.contains(t));
            for name in spread.filter(|t| !node.report.templates.contains(t)) {
                if !cp.store.cluster().claim_template_pull(
                    &node.row.id,
                    name,
                    now_ms(),
                    PULL_PATIENCE.as_millis() as i64,
                )? {
                    continue;
                }
                let pull = PullRequest { from: source.row.url.clone(), name: name.clone() };
                if let Err(err) = NodeClient::new(cp, &node.row).pull_template(&pull).await {
                    tracing::warn!(node = %node.row.id, template = %name, "asking for a pull: {err}");
                }
            }
        }
    }
    Ok(())
}
