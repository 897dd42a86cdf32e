//! The event log behind `GET /v1/events`: one row per change of a
//! sandbox's state, an operation or a command, written in the transaction
//! of the change itself, so an event exists exactly when its change does.

use std::sync::atomic::Ordering::Relaxed;

use space_api::{Event, EventType};

use super::db::{vals, Conn, SqliteConn, Value};
use super::{Store, StoreError};

/// Events kept (all tenants together); older ones are dropped in batches.
pub const EVENTS_KEPT: u64 = 100_000;
/// How often (in events) the oldest beyond [`EVENTS_KEPT`] are dropped.
const TRIM_EVERY: u64 = 1024;

/// An event as kept: its JSON (with its id) is sent as it is, never parsed
/// on the way out.
#[derive(Debug, Clone)]
pub struct RawEvent {
    pub id: u64,
    pub kind: String,
    pub json: String,
}

impl RawEvent {
    pub fn parse(&self) -> Result<Event, StoreError> {
        Ok(serde_json::from_str(&self.json)?)
    }
}

/// The stored body is the event with id 0; the id is `seq`.
const BODY_PREFIX: &str = "{\"id\":0,";

/// Which of a tenant's events to read.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// Only these types (none: all).
    pub types: Vec<EventType>,
    /// Only this sandbox's.
    pub sandbox_id: Option<String>,
}

/// An event of `kind` about `sandbox_id`, at this moment, as yet without
/// its id (its row's, once added).
pub fn new_event(kind: EventType, sandbox_id: Option<&str>) -> Event {
    Event {
        id: 0,
        kind,
        at: space_api::Timestamp::now(),
        sandbox_id: sandbox_id.map(str::to_string),
        sandbox: None,
        operation: None,
        command: None,
    }
}

/// Adds `event` for `tenant` inside a write's transaction; its id.
pub(super) fn insert(c: &mut dyn Conn, tenant: &str, event: &Event) -> Result<u64, StoreError> {
    debug_assert_eq!(event.id, 0, "an event's id is its row's");
    let body = serde_json::to_string(event)?;
    insert_body(c, tenant, event.sandbox_id.as_deref(), event.kind.as_str(), &body)
}

/// Adds an event as stored (`body` with id 0), taking the next id.
fn insert_body(
    c: &mut dyn Conn,
    tenant: &str,
    sandbox_id: Option<&str>,
    kind: &str,
    body: &str,
) -> Result<u64, StoreError> {
    // Followers read up to the newest id and go on after it, so ids must
    // commit in order: on PostgreSQL, whose writers run concurrently, the
    // transactions that add events take turns (until they commit).
    if c.postgres() {
        c.execute("SELECT pg_advisory_xact_lock(7270003)", &[])?;
    }
    let row = c.query_one(
        "INSERT INTO events (tenant, sandbox_id, kind, body) VALUES (?1, ?2, ?3, ?4) RETURNING seq",
        vals![tenant, sandbox_id, kind, body],
    )?;
    let seq = row.ok_or_else(|| StoreError::Shape("an insert returned no id".into()))?.int(0)?.max(0) as u64;
    if seq.is_multiple_of(TRIM_EVERY) && seq > EVENTS_KEPT {
        c.execute("DELETE FROM events WHERE seq <= ?1", vals![seq - EVENTS_KEPT])?;
    }
    Ok(seq)
}

/// An event as a node passes it to the control plane (the feed's wire
/// type, shared with the control plane).
pub use space_api::cluster::FeedEvent;

impl Store {
    /// Every tenant's events after id `after`, oldest first, at most `limit`
    /// (a node's feed to the control plane).
    pub fn feed(&self, after: u64, limit: u32) -> Result<Vec<FeedEvent>, StoreError> {
        let sql = "SELECT seq, tenant, sandbox_id, kind, body FROM events WHERE seq > ?1 ORDER BY seq LIMIT ?2";
        let values = vals![after, limit];
        let rows = match &self.reader {
            Some(reader) => SqliteConn(&reader.lock().unwrap_or_else(|e| e.into_inner())).query(sql, values)?,
            None => self.tx(|c| c.query(sql, values))?,
        };
        rows.iter()
            .map(|r| {
                Ok(FeedEvent {
                    seq: r.int(0)?.max(0) as u64,
                    tenant: r.text(1)?,
                    sandbox_id: r.opt_text(2)?,
                    kind: r.text(3)?,
                    body: r.text(4)?,
                })
            })
            .collect()
    }

    /// Adds what a node's feed passed on, after `from` (the last of its
    /// events already here), as long as `owner` still holds the node's feed
    /// and nobody else moved it on: false (and nothing added) otherwise.
    /// Exactly once: the feed's position moves in the same transaction.
    pub fn ingest(&self, node: &str, owner: &str, from: u64, events: &[FeedEvent]) -> Result<bool, StoreError> {
        let Some(last) = events.last() else {
            return Ok(true);
        };
        let mut newest = None;
        let moved = self.tx(|c| {
            let moved = c.execute(
                "UPDATE node_feeds SET last_seq = ?1 WHERE node_id = ?2 AND owner = ?3 AND last_seq = ?4",
                vals![last.seq, node, owner, from],
            )?;
            if moved == 0 {
                return Ok(false);
            }
            for event in events {
                let body = event.body.as_str();
                if !body.starts_with(BODY_PREFIX) {
                    return Err(StoreError::Shape(format!(
                        "node {node}'s event {} is not as stores write them",
                        event.seq
                    )));
                }
                newest = Some(insert_body(c, &event.tenant, event.sandbox_id.as_deref(), &event.kind, body)?);
            }
            Ok(true)
        })?;
        self.announce(newest);
        Ok(moved)
    }

    /// Adds events made here (by the control plane itself, such as a lost
    /// node's sandboxes failing).
    pub fn add_events(&self, events: &[(String, Event)]) -> Result<(), StoreError> {
        let newest = self.tx(|c| {
            let mut newest = None;
            for (tenant, event) in events {
                newest = Some(insert(c, tenant, event)?);
            }
            Ok(newest)
        })?;
        self.announce(newest);
        Ok(())
    }

    /// Reads the newest event's id from the database, for events another
    /// process added (a replica's ingest), and wakes followers if it moved.
    pub fn refresh_event_head(&self) -> Result<u64, StoreError> {
        let head = self.tx(|c| c.query_one("SELECT COALESCE(MAX(seq), 0) FROM events", &[]))?;
        let head = head.map(|r| r.int(0)).transpose()?.unwrap_or(0).max(0) as u64;
        self.announce(Some(head));
        Ok(head)
    }

    /// Whether anyone follows the event log in this process.
    pub fn followed(&self) -> bool {
        self.event_head.receiver_count() > 0
    }

    pub(super) fn recording(&self) -> bool {
        self.recording.load(Relaxed)
    }

    /// Turns the recording of events on or off (off: `space bench`'s
    /// baseline for what events cost).
    pub fn record_events(&self, on: bool) {
        self.recording.store(on, Relaxed);
    }

    /// Wakes followers once the transaction that added `event` committed.
    pub(super) fn announce(&self, event: Option<u64>) {
        if let Some(seq) = event {
            self.event_head.send_if_modified(|head| {
                let newer = seq > *head;
                *head = (*head).max(seq);
                newer
            });
        }
    }

    /// The newest event's id (0: none yet), and a way to wait for more.
    pub fn event_head(&self) -> tokio::sync::watch::Receiver<u64> {
        self.event_head.subscribe()
    }

    /// The id of the oldest event still kept (the next one when none is).
    pub fn oldest_event(&self) -> Result<u64, StoreError> {
        let oldest = self.tx(|c| c.query_one("SELECT MIN(seq) FROM events", &[]))?;
        let oldest = oldest.map(|r| r.opt_int(0)).transpose()?.flatten();
        Ok(oldest.map(|s| s.max(0) as u64).unwrap_or_else(|| *self.event_head.borrow() + 1))
    }

    /// A tenant's events from id `from` on, oldest first, at most `limit`.
    pub fn events_from(
        &self,
        tenant: &str,
        from: u64,
        filter: &EventFilter,
        limit: u32,
    ) -> Result<Vec<RawEvent>, StoreError> {
        self.select_events(tenant, filter, "seq >= {from}", Some(from), "ASC", limit)
    }

    /// A tenant's newest `limit` events, oldest first.
    pub fn latest_events(&self, tenant: &str, filter: &EventFilter, limit: u32) -> Result<Vec<RawEvent>, StoreError> {
        let mut events = self.select_events(tenant, filter, "1 = 1", None, "DESC", limit)?;
        events.reverse();
        Ok(events)
    }

    fn select_events(
        &self,
        tenant: &str,
        filter: &EventFilter,
        bound: &str,
        bound_value: Option<u64>,
        order: &str,
        limit: u32,
    ) -> Result<Vec<RawEvent>, StoreError> {
        let mut sql = format!("SELECT seq, kind, body FROM events WHERE tenant = ?1 AND {bound}");
        let mut values: Vec<Value> = vec![tenant.into()];
        let mark = |values: &mut Vec<Value>, value: Value| {
            values.push(value);
            format!("?{}", values.len())
        };
        if let Some(value) = bound_value {
            let at = mark(&mut values, value.into());
            sql = sql.replace("{from}", &at);
        }
        if let Some(sandbox) = &filter.sandbox_id {
            let at = mark(&mut values, sandbox.as_str().into());
            sql.push_str(&format!(" AND sandbox_id = {at}"));
        }
        if !filter.types.is_empty() {
            let marks: Vec<String> = filter.types.iter().map(|t| mark(&mut values, t.as_str().into())).collect();
            sql.push_str(&format!(" AND kind IN ({})", marks.join(", ")));
        }
        let at = mark(&mut values, limit.into());
        sql.push_str(&format!(" ORDER BY seq {order} LIMIT {at}"));
        let rows = match &self.reader {
            Some(reader) => SqliteConn(&reader.lock().unwrap_or_else(|e| e.into_inner())).query(&sql, &values)?,
            None => self.tx(|c| c.query(&sql, &values))?,
        };
        rows.iter()
            .map(|row| {
                let (seq, kind, body) = (row.int(0)?, row.text(1)?, row.text(2)?);
                let id = seq.max(0) as u64;
                let rest = body
                    .strip_prefix(BODY_PREFIX)
                    .ok_or_else(|| StoreError::Shape(format!("event {id} is not as the store writes them")))?;
                Ok(RawEvent { id, kind, json: format!("{{\"id\":{id},{rest}") })
            })
            .collect()
    }
}

/// The event log read-only: what an events endpoint and a node's feed
/// need, and nothing of the tables behind the events (`store.events()`).
#[derive(Clone, Copy)]
pub struct EventReader<'a>(pub(crate) &'a Store);

impl EventReader<'_> {
    /// See [`Store::event_head`].
    pub fn head(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.event_head()
    }

    /// See [`Store::oldest_event`].
    pub fn oldest(&self) -> Result<u64, StoreError> {
        self.0.oldest_event()
    }

    /// See [`Store::events_from`].
    pub fn from(&self, tenant: &str, from: u64, filter: &EventFilter, limit: u32) -> Result<Vec<RawEvent>, StoreError> {
        self.0.events_from(tenant, from, filter, limit)
    }

    /// See [`Store::latest_events`].
    pub fn latest(&self, tenant: &str, filter: &EventFilter, limit: u32) -> Result<Vec<RawEvent>, StoreError> {
        self.0.latest_events(tenant, filter, limit)
    }

    /// See [`Store::feed`].
    pub fn feed(&self, after: u64, limit: u32) -> Result<Vec<FeedEvent>, StoreError> {
        self.0.feed(after, limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use space_api::{Operation, OperationKind, OperationOrigin, OperationState, Progress, SandboxState};

    fn store() -> ((), Store) {
        ((), Store::open(std::path::Path::new(":memory:")).unwrap())
    }

    fn operation(kind: OperationKind, sandbox_id: &str) -> Operation {
        Operation {
            id: "op_1".into(),
            kind,
            sandbox_id: Some(sandbox_id.into()),
            template: None,
            state: OperationState::Pending,
            progress: Progress::new("queued", 0, 1),
            error: None,
            forks: Vec::new(),
            checkpoint: None,
            frozen_ms: None,
            origin: OperationOrigin::Client,
            created_at: space_api::Timestamp::now(),
            started_at: None,
            finished_at: None,
        }
    }

    #[test]
    fn a_state_change_is_one_event_and_a_rewrite_in_the_same_state_is_none() {
        let (_dir, store) = store();
        let mut record = super::super::SandboxRecord::sample(
            SandboxState::Creating,
            space_api::Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: None, auto_pause: None },
            "2026-01-01T00:00:00Z",
            "2026-01-01T00:00:00Z",
        );
        record.tenant = "acme".into();
        store.node().put_sandbox(&record).unwrap();
        store.node().put_sandbox(&record).unwrap();
        record.sandbox.state = SandboxState::Running;
        store.node().put_sandbox(&record).unwrap();
        let events: Vec<Event> = store
            .events_from("acme", 0, &EventFilter::default(), 100)
            .unwrap()
            .iter()
            .map(|e| e.parse().unwrap())
            .collect();
        let states: Vec<_> = events.iter().map(|e| e.sandbox.as_ref().unwrap().state).collect();
        assert_eq!(states, [SandboxState::Creating, SandboxState::Running]);
        assert!(events[0].id < events[1].id);
        assert_eq!(*store.event_head().borrow(), events[1].id);
        // Another tenant sees none of them.
        assert!(store.events_from("other", 0, &EventFilter::default(), 100).unwrap().is_empty());
    }

    #[test]
    fn operations_are_progress_until_they_end_and_keep_their_first_tenant() {
        let (_dir, store) = store();
        let mut op = operation(OperationKind::Pause, "sbx_1");
        store.node().put_operation(&op, "acme", None).unwrap();
        op.state = OperationState::Succeeded;
        // Updates name no tenant: the event is still the first writer's.
        store.node().put_operation(&op, "", None).unwrap();
        let filter = EventFilter { types: vec![EventType::OperationFinished], sandbox_id: Some("sbx_1".into()) };
        let finished: Vec<Event> =
            store.events_from("acme", 0, &filter, 100).unwrap().iter().map(|e| e.parse().unwrap()).collect();
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0].operation.as_ref().unwrap().state, OperationState::Succeeded);
        let all = store.latest_events("acme", &EventFilter::default(), 1).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].kind, "operation.finished");
        assert_eq!(all[0].parse().unwrap().id, all[0].id);
        assert!(store.events_from("", 0, &EventFilter::default(), 100).unwrap().is_empty());
    }

    #[test]
    fn nothing_is_recorded_while_recording_is_off() {
        let (_dir, store) = store();
        store.record_events(false);
        let op = operation(OperationKind::Pause, "sbx_1");
        store.node().put_operation(&op, "acme", None).unwrap();
        assert!(store.events_from("acme", 0, &EventFilter::default(), 100).unwrap().is_empty());
        assert_eq!(*store.event_head().borrow(), 0);
    }
}
