//! Events from the nodes: each replica follows the feeds of the live nodes
//! nobody else follows and takes their events into PostgreSQL, so
//! `GET /v1/events` on any replica shows the whole cluster's; a lost node's
//! sandboxes are announced failed, and as they are when it comes back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use space_api::cluster::{HEARTBEAT, LEASE};
use space_api::{Event, EventType, Sandbox};
use space_core::tenants::Caller;
use space_http::events::EventLog;
use space_store::{EventReader, NodeRow};
use tokio::task::AbortHandle;

use crate::error::ControlError;
use crate::node_client::{CallError, NodeClient};
use crate::state::{lost_sandbox, nodes, now_ms, ControlPlane, Node};

/// The control plane's event log: what it took in from every node.
impl EventLog for ControlPlane {
    fn events(&self) -> EventReader<'_> {
        self.store.events()
    }
}

/// Why following a node's feed stopped.
#[derive(Debug, thiserror::Error)]
enum FeedError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("taking its events in: {0}")]
    Store(#[from] space_store::StoreError),
    #[error("another replica follows it now")]
    Overtaken,
    #[error("its feed ended")]
    Ended,
}

/// What each replica does for as long as it runs: claims the feeds of the
/// live nodes nobody else follows (in PostgreSQL, renewed every
/// [`HEARTBEAT`], lapsing after [`LEASE`]) and takes their events in;
/// announces a lost node's sandboxes as failed, and as they are when it
/// comes back. Each feed's follower is one of the control plane's tasks,
/// so a shutdown stops it with this loop.
pub(crate) async fn follow_feeds(cp: Arc<ControlPlane>) {
    let owner = space_core::ids::new_id("replica");
    let mut following: HashMap<String, AbortHandle> = Default::default();
    loop {
        following.retain(|_, task| !task.is_finished());
        if let Err(err) = feeds_once(&cp, &owner, &mut following).await {
            tracing::warn!("following the nodes' events: {}", err.message);
        }
        tokio::time::sleep(HEARTBEAT).await;
    }
}

async fn feeds_once(
    cp: &Arc<ControlPlane>,
    owner: &str,
    following: &mut HashMap<String, AbortHandle>,
) -> Result<(), ControlError> {
    for node in nodes(cp)? {
        let id = node.row.id.clone();
        if !node.alive {
            if let Some(task) = following.remove(&id) {
                task.abort();
            }
            if cp.store.cluster().mark_feed_lost(&id, true)? {
                announce_lost(cp, &node)?;
            }
            continue;
        }
        let now = now_ms();
        let Some(last) = cp.store.cluster().claim_feed(&id, owner, now, now + LEASE.as_millis() as i64)? else {
            if let Some(task) = following.remove(&id) {
                task.abort();
            }
            continue;
        };
        if cp.store.cluster().mark_feed_lost(&id, false)? {
            // One request per sandbox it has: not in the way of the claims.
            let announce = {
                let (cp, row) = (cp.clone(), node.row.clone());
                async move {
                    if let Err(err) = announce_back(&cp, &row).await {
                        tracing::warn!(node = %row.id, "announcing its sandboxes back: {}", err.message);
                    }
                }
            };
            cp.tasks.spawn_cancellable(announce);
        }
        if let std::collections::hash_map::Entry::Vacant(entry) = following.entry(id) {
            let follow = {
                let (cp, owner, row) = (cp.clone(), owner.to_string(), node.row.clone());
                async move {
                    if let Err(err) = take_feed(&cp, &owner, &row, last).await {
                        tracing::warn!(node = %row.id, "its events: {err}");
                    }
                }
            };
            // None: the control plane is shutting down.
            if let Some(follower) = cp.tasks.spawn_cancellable(follow) {
                entry.insert(follower);
            }
        }
    }
    Ok(())
}

/// Follows one node's feed from after `last`, taking each batch in while
/// this replica's claim holds.
async fn take_feed(cp: &ControlPlane, owner: &str, node: &NodeRow, mut last: u64) -> Result<(), FeedError> {
    let mut feed = NodeClient::new(cp, node).feed(last).await?;
    while let Some(events) = feed.next_batch().await {
        let events = events?;
        let Some(newest) = events.last().map(|e| e.seq) else {
            continue;
        };
        if !cp.store.ingest(&node.id, owner, last, &events)? {
            return Err(FeedError::Overtaken);
        }
        last = newest;
    }
    Err(FeedError::Ended)
}

/// A `sandbox.state` event of a sandbox as the control plane shows it.
fn state_event(sandbox: Sandbox) -> Event {
    let mut event = space_store::new_event(EventType::SandboxState, Some(&sandbox.id));
    event.sandbox = Some(sandbox);
    event
}

fn announce_lost(cp: &ControlPlane, node: &Node) -> Result<(), ControlError> {
    let why = format!("node {} stopped answering", node.row.id);
    let events: Vec<(String, Event)> = cp
        .store
        .cluster()
        .placements_on(&node.row.id)?
        .iter()
        .map(|p| Ok(lost_sandbox(p, &why)?.map(|sandbox| (p.tenant.clone(), state_event(sandbox)))))
        .collect::<Result<Vec<_>, ControlError>>()?
        .into_iter()
        .flatten()
        .collect();
    tracing::warn!(node = %node.row.id, sandboxes = events.len(), "a node is lost: its sandboxes are failed");
    Ok(cp.store.add_events(&events)?)
}

async fn announce_back(cp: &ControlPlane, node: &NodeRow) -> Result<(), ControlError> {
    let mut events = Vec::new();
    let client = NodeClient::new(cp, node);
    for placement in cp.store.cluster().placements_on(&node.id)? {
        // Those that were announced lost (not those deleted before).
        let Some(lost) = lost_sandbox(&placement, "")? else {
            continue;
        };
        let caller = Caller::tenant(placement.tenant.clone());
        // None: deleted while its node was away, as the node says.
        let now = client.sandbox(&caller, &lost.id).await.map_err(|e| e.into_control(&node.id))?;
        if let Some(sandbox) = now {
            events.push((placement.tenant.clone(), state_event(sandbox)));
        }
    }
    tracing::info!(node = %node.id, sandboxes = events.len(), "a lost node is back");
    Ok(cp.store.add_events(&events)?)
}

/// Wakes this replica's event followers when another replica took events in.
pub(crate) async fn watch_event_head(cp: Arc<ControlPlane>) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if cp.store.followed() {
            if let Err(err) = cp.store.refresh_event_head() {
                tracing::warn!("reading the newest event's id: {err}");
            }
        }
    }
}
