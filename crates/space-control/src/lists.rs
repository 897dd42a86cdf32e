//! Lists over the whole cluster: every live node's answer as one list, and
//! a lost node's sandboxes shown as failed.

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use space_api::{OperationList, Sandbox, SandboxList, TemplateList};
use space_core::tenants::Caller;

use crate::error::ControlError;
use crate::node_client::NodeClient;
use crate::state::{lost_sandbox, nodes, ControlPlane};

/// `GET /v1/sandboxes`: every live node's (with the caller's filters), and
/// those on lost nodes as failed, oldest first.
pub(crate) async fn list(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let query = request.uri().query().unwrap_or_default().to_string();
    let all = nodes(cp)?;
    let mut sandboxes: Vec<Sandbox> = Vec::new();
    for node in all.iter().filter(|n| n.alive) {
        let client = NodeClient::new(cp, &node.row);
        let answer = client.list_sandboxes(caller, Some(&query)).await.map_err(|e| e.into_control(client.id()))?;
        sandboxes.extend(answer.sandboxes);
    }
    let wants_failed = !query.contains("state=") || query.contains("state=failed");
    let lost: Vec<&str> = all.iter().filter(|n| !n.alive).map(|n| n.row.id.as_str()).collect();
    if wants_failed {
        for placement in
            cp.store.cluster().placements(&caller.tenant)?.into_iter().filter(|p| lost.contains(&p.node_id.as_str()))
        {
            let why = format!("node {} stopped answering", placement.node_id);
            sandboxes.extend(lost_sandbox(&placement, &why)?);
        }
    }
    sandboxes.sort_by_key(|x| x.created_at);
    Ok(axum::Json(SandboxList { sandboxes }).into_response())
}

/// `GET /v1/operations`: the tenant's operations on every live node, oldest
/// first.
pub(crate) async fn operations(cp: &ControlPlane, caller: &Caller, request: Request) -> Result<Response, ControlError> {
    let mut operations = Vec::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let client = NodeClient::new(cp, &node.row);
        let answer =
            client.list_operations(caller, request.uri().query()).await.map_err(|e| e.into_control(client.id()))?;
        operations.extend(answer.operations);
    }
    operations.sort_by_key(|x| x.created_at);
    Ok(axum::Json(OperationList { operations }).into_response())
}

/// `GET /v1/templates`: every template any live node has (the first
/// node's copy of each name).
pub(crate) async fn templates(cp: &ControlPlane, caller: &Caller) -> Result<Response, ControlError> {
    let mut seen = std::collections::BTreeMap::new();
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let client = NodeClient::new(cp, &node.row);
        for template in client.list_templates(caller).await.map_err(|e| e.into_control(client.id()))?.templates {
            seen.entry(template.name.clone()).or_insert(template);
        }
    }
    Ok(axum::Json(TemplateList { templates: seen.into_values().collect() }).into_response())
}
