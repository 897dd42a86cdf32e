//! What every part of the control plane works from: its state
//! ([`ControlPlane`]), the nodes as their last reports describe them, and
//! the placements it keeps of each sandbox.

use space_api::cluster::{NodeReport, LEASE};
use space_api::{Sandbox, SandboxState};
use space_core::keyring::Keyring;
use space_core::tenants::Caller;
use space_http::links::Links;
use space_store::{NodeRow, Placement, Store};

use crate::error::ControlError;

/// The control plane's state: PostgreSQL, its own key, the node token.
pub struct ControlPlane {
    pub store: Store,
    pub api_key: String,
    pub node_token: String,
    /// Seals tenants' secrets in PostgreSQL (the same key on every
    /// replica: `--secrets-key-file`); without it, no secrets.
    pub keyring: Option<Keyring>,
    /// How it reaches the nodes.
    pub links: Links,
    /// The API's OpenAPI document (JSON text), served at
    /// `/v1/openapi.json` as a node serves it: the composition root hands it
    /// over, so the control plane links none of the node's HTTP edge.
    pub openapi: String,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// A node with its last report, and whether its lease still holds.
pub(crate) struct Node {
    pub(crate) row: NodeRow,
    pub(crate) report: NodeReport,
    pub(crate) alive: bool,
}

impl Node {
    /// When its last report came (its lease runs [`LEASE`] from then).
    pub(crate) fn reported_ms(&self) -> i64 {
        self.row.lease_until_ms - LEASE.as_millis() as i64
    }

    /// Whether `placement` holds resources on it: reported so, or placed
    /// after its last report.
    pub(crate) fn holds(&self, placement: &Placement, id: &str) -> bool {
        self.alive && (self.report.sandboxes.iter().any(|s| s == id) || placement.placed_at_ms > self.reported_ms())
    }
}

/// Every node the control plane knows, with its last report.
pub(crate) fn nodes(cp: &ControlPlane) -> Result<Vec<Node>, ControlError> {
    let now = now_ms();
    Ok(cp
        .store
        .cluster()
        .nodes()?
        .into_iter()
        .filter_map(|row| {
            let report = serde_json::from_str(&row.report).ok()?;
            let alive = row.lease_until_ms > now;
            Some(Node { row, report, alive })
        })
        .collect())
}

/// The node `id`, if its lease holds.
pub(crate) fn live_node(cp: &ControlPlane, id: &str) -> Result<NodeRow, ControlError> {
    match cp.store.cluster().node(id)? {
        Some(row) if row.lease_until_ms > now_ms() => Ok(row),
        _ => Err(ControlError::unavailable(format!("node {id} is lost (no heartbeat within {}s)", LEASE.as_secs()))),
    }
}

/// The sandbox of a placement on a lost node, as the control plane shows
/// it: failed, saying so (`None` if it was deleted).
pub(crate) fn lost_sandbox(placement: &Placement, why: &str) -> Option<Sandbox> {
    let mut sandbox: Sandbox = serde_json::from_str(&placement.sandbox).ok()?;
    // A delete the node accepted is done or will be: not a lost sandbox.
    if matches!(sandbox.state, SandboxState::Deleted | SandboxState::Deleting) {
        return None;
    }
    sandbox.state = SandboxState::Failed;
    sandbox.failure_reason = Some(format!("node lost: {why}"));
    Some(sandbox)
}

/// Records that a sandbox's node accepted its delete (`deleting`) or did it
/// (`deleted`): a later loss of that node does not show it as failed.
pub(crate) fn mark_gone(
    cp: &ControlPlane,
    id: &str,
    node: &str,
    caller: &Caller,
    state: SandboxState,
) -> Result<(), ControlError> {
    let Some(placement) = cp.store.cluster().placement(id)? else {
        return Ok(());
    };
    // The record as it was kept, with only its state changed: fields this
    // control plane does not know (a newer node's) are kept.
    let mut sandbox: serde_json::Value = serde_json::from_str(&placement.sandbox).unwrap_or_default();
    sandbox["state"] = state.as_str().into();
    cp.store.cluster().put_placement(id, node, &caller.tenant, &sandbox.to_string(), now_ms())?;
    Ok(())
}
