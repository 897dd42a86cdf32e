//! `GET /v1/events` over an event log: what happened to the caller's
//! sandboxes, operations and commands, as NDJSON (or SSE), resumable by
//! event id and followable. A node serves it from its own store, a
//! cluster's control plane from the store every node's feed is taken into:
//! both hand [`serve`] an [`EventLog`].

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap};
use axum::response::Response;
use space_api::EventType;
use space_store::{EventFilter, EventReader, RawEvent};

use crate::HttpError;

/// Events read from the store at a time.
const BATCH: u32 = 500;
/// Without `follow`: events answered unless `limit` says otherwise.
const DEFAULT_LIMIT: u32 = 1000;
const MAX_LIMIT: u32 = 10_000;
/// An SSE comment this often keeps idle streams open through proxies.
const KEEPALIVE: Duration = Duration::from_secs(15);

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Start at this event id, inclusive (0: the oldest kept). Default: the
    /// newest `limit` events, or with `follow` only events from now on. A
    /// `Last-Event-ID` header (the last id a client saw) wins over it.
    from: Option<u64>,
    /// Keep the stream open and send events as they happen.
    #[serde(default)]
    follow: bool,
    /// Only these types, comma-separated: full names (`sandbox.state`,
    /// `operation.progress`, `operation.finished`, `command.started`,
    /// `command.exited`) or their first part (`sandbox`, `operation`,
    /// `command`).
    types: Option<String>,
    /// Only events of this sandbox.
    sandbox_id: Option<String>,
    /// Without `follow`: at most this many events (default 1000, at most 10000).
    limit: Option<u32>,
}

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Ndjson,
    Sse,
}

/// Who keeps the event log: a host's platform, or a cluster's control
/// plane (whose log holds what it took in from every node).
pub trait EventLog: Send + Sync + 'static {
    fn events(&self) -> EventReader<'_>;
}

/// `GET /v1/events` over `log`'s store for `tenant`.
pub fn serve(
    log: Arc<dyn EventLog>,
    tenant: String,
    query: EventsQuery,
    headers: &HeaderMap,
) -> Result<Response, HttpError> {
    let filter = EventFilter { types: parse_types(query.types.as_deref())?, sandbox_id: query.sandbox_id };
    let last_seen = match headers.get("last-event-id") {
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| HttpError::bad_request("Last-Event-ID must be an event id (a whole number)"))?,
        ),
        None => None,
    };
    let start = last_seen.map(|id| id.saturating_add(1)).or(query.from);
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
    if limit == 0 || limit > MAX_LIMIT {
        return Err(HttpError::bad_request(format!("limit must be between 1 and {MAX_LIMIT}")));
    }
    if query.follow && query.limit.is_some() {
        return Err(HttpError::bad_request("limit applies without follow only"));
    }
    let format = match headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) {
        Some(accept) if accept.contains("text/event-stream") => Format::Sse,
        _ => Format::Ndjson,
    };
    let events = log.events();
    let mut head = events.head();
    let now = *head.borrow_and_update();
    let mut first = VecDeque::new();
    if let Some(from) = start.filter(|from| *from > 0) {
        let oldest = events.oldest()?;
        if from < oldest {
            let mut gap = space_store::new_event(EventType::Gap, None);
            gap.id = oldest - 1;
            let json = serde_json::to_string(&gap).map_err(|e| HttpError::internal("an event", e))?;
            first.push_back(RawEvent { id: gap.id, kind: EventType::Gap.as_str().to_string(), json });
        }
    }
    let body = if query.follow {
        let follower =
            Follower { log: log.clone(), tenant, filter, next: start.unwrap_or(now + 1), head, pending: first, format };
        Body::from_stream(futures_util::stream::unfold(follower, |mut follower| async move {
            let bytes = follower.next_bytes().await?;
            Some((Ok::<_, Infallible>(bytes), follower))
        }))
    } else {
        let events = match start {
            Some(from) => events.from(&tenant, from, &filter, limit)?,
            None => events.latest(&tenant, &filter, limit)?,
        };
        let text: Vec<u8> = first.iter().chain(events.iter()).flat_map(|e| render(format, e)).collect();
        Body::from(text)
    };
    Ok(crate::stream::stream_response(body, format == Format::Sse))
}

/// `types=`: full names or their first part; unknown ones are an error.
fn parse_types(text: Option<&str>) -> Result<Vec<EventType>, HttpError> {
    let Some(text) = text else {
        return Ok(vec![]);
    };
    let mut types = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let matching: Vec<EventType> = EventType::ALL
            .into_iter()
            .filter(|t| *t != EventType::Gap)
            .filter(|t| t.as_str() == name || t.as_str().split('.').next() == Some(name))
            .collect();
        if matching.is_empty() {
            return Err(HttpError::bad_request(format!(
                "unknown event type {name:?}: sandbox.state, operation.progress, operation.finished, \
                 command.started, command.exited, or sandbox, operation, command"
            )));
        }
        types.extend(matching);
    }
    types.dedup();
    Ok(types)
}

fn render(format: Format, event: &RawEvent) -> Vec<u8> {
    match format {
        Format::Ndjson => format!("{}\n", event.json).into_bytes(),
        Format::Sse => format!("id: {}\nevent: {}\ndata: {}\n\n", event.id, event.kind, event.json).into_bytes(),
    }
}

/// A `follow=true` stream: what is kept from `next` on, then each new
/// event of the tenant as its change commits.
struct Follower {
    log: Arc<dyn EventLog>,
    tenant: String,
    filter: EventFilter,
    /// The first event id not yet looked at.
    next: u64,
    head: tokio::sync::watch::Receiver<u64>,
    pending: VecDeque<RawEvent>,
    format: Format,
}

impl Follower {
    /// The next bytes to send; `None` ends the stream.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Bytes::from(render(self.format, &event)));
            }
            // Every event up to `seen` has committed (one writer at a time).
            let seen = *self.head.borrow_and_update();
            let batch = match self.log.events().from(&self.tenant, self.next, &self.filter, BATCH) {
                Ok(batch) => batch,
                Err(err) => {
                    tracing::error!("reading events: {err}");
                    return None;
                }
            };
            let full = batch.len() == BATCH as usize;
            let last = batch.last().map(|e| e.id + 1).unwrap_or(0);
            self.next = match full {
                true => last,
                false => last.max(seen + 1).max(self.next),
            };
            if !batch.is_empty() {
                self.pending.extend(batch);
                continue;
            }
            match tokio::time::timeout(KEEPALIVE, self.head.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return None,
                Err(_) if self.format == Format::Sse => return Some(Bytes::from_static(b": keepalive\n\n")),
                Err(_) => {}
            }
        }
    }
}
