//! Recording what a node's answer to a lifecycle request says: which node
//! holds each sandbox it places, and where its operation is.

use axum::extract::Request;
use axum::response::Response;
use space_core::tenants::Caller;
use space_store::NodeRow;

use crate::error::ControlError;
use crate::forward::forward;
use crate::node_client::{Accepted, Expect, NodeClient};
use crate::state::{now_ms, ControlPlane};

/// Records what a node's 202 says: which node holds each sandbox it
/// places (kept as the control plane reads it) and where its operation is.
fn record(cp: &ControlPlane, node: &str, caller: &Caller, accepted: &Accepted) -> Result<(), ControlError> {
    for sandbox in accepted.sandboxes() {
        let kept = serde_json::to_string(sandbox).map_err(|e| ControlError::internal("keeping a sandbox", e))?;
        cp.store.cluster().put_placement(&sandbox.id, node, &caller.tenant, &kept, now_ms())?;
    }
    cp.store.cluster().put_operation_node(&accepted.operation().id, node, &caller.tenant)?;
    Ok(())
}

/// Forwards a lifecycle request and records what its 202 answer says (read
/// as `expect` names its type): the operation, and the sandboxes as they
/// are. A 202 that is not that type is an error: the node accepted
/// something the control plane cannot place.
pub(crate) async fn forward_recording(
    cp: &ControlPlane,
    caller: &Caller,
    node: NodeRow,
    request: Request,
    expect: Expect,
) -> Result<Response, ControlError> {
    let response = forward(cp, &node, caller, request).await?;
    let client = NodeClient::new(cp, &node);
    let (response, accepted) = client.accepted(response, expect).await.map_err(|e| e.into_control(&node.id))?;
    if let Some(accepted) = accepted {
        record(cp, &node.id, caller, &accepted)?;
    }
    Ok(response)
}
