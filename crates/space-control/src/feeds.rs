//! Events from the nodes: each replica follows the feeds of the live nodes
//! nobody else follows and takes their events into PostgreSQL, so
//! `GET /v1/events` on any replica shows the whole cluster's; a lost node's
//! sandboxes are announced failed, and as they are when it comes back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use space_api::cluster::{FeedEvent, EVENTS_PATH, HEARTBEAT, LEASE};
use space_api::{Event, EventType, Sandbox};
use space_core::tenants::Caller;
use space_http::events::EventLog;
use space_store::{NodeRow, Store};

use crate::error::ControlError;
use crate::forward::{forward, read_answer};
use crate::state::{lost_sandbox, nodes, now_ms, ControlPlane, Node};

/// The control plane's event log: what it took in from every node.
impl EventLog for ControlPlane {
    fn store(&self) -> &Store {
        &self.store
    }
}

/// Why following a node's feed stopped.
#[derive(Debug, thiserror::Error)]
enum FeedError {
    /// The node could not be reached through the control plane's forward.
    #[error("{}", .0.message)]
    Forward(ControlError),
    #[error("making the request: {0}")]
    Request(#[from] axum::http::Error),
    #[error("it answered {0}")]
    Status(StatusCode),
    #[error("reading its answer: {0}")]
    Body(#[source] axum::Error),
    #[error("a line of its feed: {0}")]
    Line(#[source] serde_json::Error),
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
/// comes back.
pub async fn follow_feeds(cp: Arc<ControlPlane>) {
    let owner = space_core::ids::new_id("replica");
    let mut following: HashMap<String, tokio::task::JoinHandle<()>> = Default::default();
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
    following: &mut HashMap<String, tokio::task::JoinHandle<()>>,
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
            let (cp, row) = (cp.clone(), node.row.clone());
            tokio::spawn(async move {
                if let Err(err) = announce_back(&cp, &row).await {
                    tracing::warn!(node = %row.id, "announcing its sandboxes back: {}", err.message);
                }
            });
        }
        if let std::collections::hash_map::Entry::Vacant(entry) = following.entry(id) {
            let (cp, owner, row) = (cp.clone(), owner.to_string(), node.row.clone());
            entry.insert(tokio::spawn(async move {
                if let Err(err) = take_feed(&cp, &owner, &row, last).await {
                    tracing::warn!(node = %row.id, "its events: {err}");
                }
            }));
        }
    }
    Ok(())
}

/// Follows one node's feed from after `last`, taking each batch in while
/// this replica's claim holds.
async fn take_feed(cp: &ControlPlane, owner: &str, node: &NodeRow, mut last: u64) -> Result<(), FeedError> {
    use futures_util::StreamExt as _;
    let request = Request::get(format!("{EVENTS_PATH}?after={last}")).body(Body::empty())?;
    let response = forward(cp, node, &Caller::operator(), request).await.map_err(FeedError::Forward)?;
    if response.status() != StatusCode::OK {
        return Err(FeedError::Status(response.status()));
    }
    let mut body = response.into_body().into_data_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        pending.extend_from_slice(&chunk.map_err(FeedError::Body)?);
        let Some(end) = pending.iter().rposition(|b| *b == b'\n') else {
            continue;
        };
        let complete: Vec<u8> = pending.drain(..=end).collect();
        let events = complete
            .split(|b| *b == b'\n')
            .filter(|line| !line.is_empty())
            .map(serde_json::from_slice::<FeedEvent>)
            .collect::<Result<Vec<_>, _>>()
            .map_err(FeedError::Line)?;
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
        .filter_map(|p| Some((p.tenant.clone(), state_event(lost_sandbox(p, &why)?))))
        .collect();
    tracing::warn!(node = %node.row.id, sandboxes = events.len(), "a node is lost: its sandboxes are failed");
    Ok(cp.store.add_events(&events)?)
}

async fn announce_back(cp: &ControlPlane, node: &NodeRow) -> Result<(), ControlError> {
    let mut events = Vec::new();
    // Those that were announced lost (not those deleted before).
    for (placement, sandbox) in cp
        .store
        .cluster()
        .placements_on(&node.id)?
        .into_iter()
        .filter_map(|p| lost_sandbox(&p, "").map(|sandbox| (p, sandbox)))
    {
        let caller = Caller::tenant(placement.tenant.clone());
        let request = Request::get(format!("/v1/sandboxes/{}", sandbox.id))
            .body(Body::empty())
            .map_err(|e| ControlError::internal("a request", e))?;
        let response = forward(cp, node, &caller, request).await?;
        if response.status() != StatusCode::OK {
            continue;
        }
        if let (_, Some(sandbox)) = read_answer::<Sandbox>(response).await? {
            events.push((placement.tenant.clone(), state_event(sandbox)));
        }
    }
    tracing::info!(node = %node.id, sandboxes = events.len(), "a lost node is back");
    Ok(cp.store.add_events(&events)?)
}

/// Wakes this replica's event followers when another replica took events in.
pub async fn watch_event_head(cp: Arc<ControlPlane>) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if cp.store.followed() {
            if let Err(err) = cp.store.refresh_event_head() {
                tracing::warn!("reading the newest event's id: {err}");
            }
        }
    }
}
