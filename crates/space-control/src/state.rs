//! What every part of the control plane works from: its state
//! ([`ControlPlane`]), the nodes as their last reports describe them, and
//! the placements it keeps of each sandbox.

use std::time::Duration;

use space_api::cluster::{NodeReport, LEASE};
use space_api::{Sandbox, SandboxState};
use space_core::keyring::Keyring;
use space_core::tenants::Caller;
use space_http::links::Links;
use space_store::{NodeRow, Placement, Store};

use crate::error::ControlError;
use space_core::tasks::Tasks;

/// The control plane's state: PostgreSQL, its own key, the node token, and
/// the loops it runs in the background.
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
    /// Its loops and what they start, stopped by [`ControlPlane::shutdown`].
    pub(crate) tasks: Tasks,
    /// `--preview-domain`: a preview host's requests go to the sandbox's
    /// node as they are (see [`ControlPlane::serve_previews`]).
    pub(crate) preview: std::sync::OnceLock<space_http::preview::PreviewDomain>,
}

/// What a control plane is made of (see [`ControlPlane`]'s fields).
pub struct Config {
    pub store: Store,
    pub api_key: String,
    pub node_token: String,
    pub keyring: Option<Keyring>,
    pub links: Links,
    pub openapi: String,
}

/// How long a shutdown waits for the background tasks to end before it
/// aborts them. Each is dropped at its next await, so this is only reached
/// by one stuck outside one (a blocking database call).
const SHUTDOWN_PATIENCE: Duration = Duration::from_secs(10);

impl ControlPlane {
    /// A control plane that runs nothing in the background until it is
    /// started (`ControlPlane::start`, in `lib.rs`, over the loops).
    pub fn new(config: Config) -> ControlPlane {
        let Config { store, api_key, node_token, keyring, links, openapi } = config;
        ControlPlane {
            store,
            api_key,
            node_token,
            keyring,
            links,
            openapi,
            tasks: Tasks::default(),
            preview: Default::default(),
        }
    }

    /// Serves previews under `domain`: a request for `{port}-{id}.{domain}`
    /// goes to the sandbox's node (which has the same domain) whatever its
    /// path, with its host named in `X-Space-Preview-Host`.
    pub fn serve_previews(&self, domain: space_http::preview::PreviewDomain) {
        let _ = self.preview.set(domain);
    }

    /// Stops every background task and waits until they ended (up to
    /// [`SHUTDOWN_PATIENCE`], then they are aborted). What they held in
    /// PostgreSQL lapses and another replica takes it up, as after a kill.
    /// Nothing starts in the background after this.
    pub async fn shutdown(&self) {
        self.tasks.stop(SHUTDOWN_PATIENCE).await;
    }

    /// How many background tasks run now (0 once
    /// [`ControlPlane::shutdown`] returned).
    pub fn background_tasks(&self) -> usize {
        self.tasks.running()
    }
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
            // Passed over, not an error: one row that does not read must
            // not stop every request to the cluster, and the node's next
            // heartbeat (every two seconds) writes it anew.
            let report = match serde_json::from_str(&row.report) {
                Ok(report) => report,
                Err(err) => {
                    tracing::warn!(node = %row.id, "its last report does not read as a NodeReport: {err}");
                    return None;
                }
            };
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

/// The sandbox a placement keeps, as the node last answered it.
pub(crate) fn placed_sandbox(placement: &Placement) -> Result<Sandbox, ControlError> {
    serde_json::from_str(&placement.sandbox)
        .map_err(|e| ControlError::internal("reading a sandbox's placement (it is not a Sandbox)", e))
}

/// The sandbox of a placement on a lost node, as the control plane shows
/// it: failed, saying so (`None` if it was deleted).
pub(crate) fn lost_sandbox(placement: &Placement, why: &str) -> Result<Option<Sandbox>, ControlError> {
    let mut sandbox = placed_sandbox(placement)?;
    // A delete the node accepted is done or will be: not a lost sandbox.
    if matches!(sandbox.state, SandboxState::Deleted | SandboxState::Deleting) {
        return Ok(None);
    }
    sandbox.state = SandboxState::Failed;
    sandbox.failure_reason = Some(format!("node lost: {why}"));
    Ok(Some(sandbox))
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
    let mut sandbox = placed_sandbox(&placement)?;
    sandbox.state = state;
    let kept = serde_json::to_string(&sandbox).map_err(|e| ControlError::internal("keeping a sandbox", e))?;
    cp.store.cluster().put_placement(id, node, &caller.tenant, &kept, now_ms())?;
    Ok(())
}
