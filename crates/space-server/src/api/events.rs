//! `GET /v1/events` on a node: the stream itself is `space_http::events`'s,
//! over the node's own store (a cluster's control plane serves the same
//! stream over the store it takes every node's events into).

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use space_api::{ErrorBody, Event};
use space_http::events::{EventLog, EventsQuery};
use space_http::extract::ApiQuery;

use crate::error::ApiError;
use crate::platform::Platform;
use crate::state::AppState;
use crate::store::EventReader;
use crate::tenants::Caller;

#[utoipa::path(get, path = "/v1/events", tag = "events", params(EventsQuery,
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this event id (SSE reconnects send it)")),
    responses(
        (status = 200, description = "Newline-delimited events, oldest first (SSE with `Accept: text/event-stream`)",
         body = Event, content_type = "application/x-ndjson"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiQuery(query): ApiQuery<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    Ok(space_http::events::serve(Arc::new(NodeLog(state.platform.clone())), caller.tenant, query, &headers)?)
}

/// The node's event log: its platform's store.
struct NodeLog(Arc<Platform>);

impl EventLog for NodeLog {
    fn events(&self) -> EventReader<'_> {
        self.0.events()
    }
}
