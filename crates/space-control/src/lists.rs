//! Lists over the whole cluster: every live node's answer as one list, and
//! a lost node's sandboxes shown as failed.

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use space_api::{OperationList, Sandbox, SandboxList, TemplateList};
use space_core::tenants::Caller;

use crate::error::ControlError;
use crate::forward::ask_all;
use crate::state::{lost_sandbox, nodes, ControlPlane};

/// The request's path and query, to ask each node the same.
fn asked(request: &Request) -> String {
    request.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default()
}

/// `GET /v1/sandboxes`: every live node's (with the caller's filters), and
/// those on lost nodes as failed, oldest first.
pub(crate) async fn list(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let query = request.uri().query().unwrap_or_default().to_string();
    let mut sandboxes: Vec<Sandbox> =
        ask_all::<SandboxList>(cp, caller, &asked(&request)).await?.into_iter().flat_map(|a| a.sandboxes).collect();
    let wants_failed = !query.contains("state=") || query.contains("state=failed");
    let lost: Vec<String> = nodes(cp)?.into_iter().filter(|n| !n.alive).map(|n| n.row.id).collect();
    if wants_failed {
        for placement in
            cp.store.cluster().placements(&caller.tenant)?.into_iter().filter(|p| lost.contains(&p.node_id))
        {
            let why = format!("node {} stopped answering", placement.node_id);
            sandboxes.extend(lost_sandbox(&placement, &why));
        }
    }
    sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    Ok(axum::Json(SandboxList { sandboxes }).into_response())
}

/// `GET /v1/operations`: the tenant's operations on every live node, oldest
/// first.
pub(crate) async fn operations(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let mut operations: Vec<_> =
        ask_all::<OperationList>(cp, caller, &asked(&request)).await?.into_iter().flat_map(|a| a.operations).collect();
    operations.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    Ok(axum::Json(OperationList { operations }).into_response())
}

/// `GET /v1/templates`: every template any live node has (the first
/// node's copy of each name).
pub(crate) async fn templates(cp: &ControlPlane, caller: &Caller) -> Result<Response, ControlError> {
    let mut seen = std::collections::BTreeMap::new();
    for answer in ask_all::<TemplateList>(cp, caller, "/v1/templates").await? {
        for template in answer.templates {
            seen.entry(template.name.clone()).or_insert(template);
        }
    }
    Ok(axum::Json(TemplateList { templates: seen.into_values().collect() }).into_response())
}
