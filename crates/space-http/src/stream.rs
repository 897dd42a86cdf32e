//! Answers that stream: newline-delimited JSON, or server-sent events.

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::Response;

/// A stream's answer: NDJSON, or SSE; never cached.
pub fn stream_response(body: Body, sse: bool) -> Response {
    let content_type = if sse { "text/event-stream" } else { "application/x-ndjson" };
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
