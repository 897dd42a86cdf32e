//! `GET .../commands/{cid}/output`: replay and follow a transcript as
//! NDJSON (or SSE), always ending with the exit frame once the command ended.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::Response;
use space_api::{ErrorBody, OutputFrame};
use space_http::extract::ApiQuery;
use space_http::stream::stream_response;

use super::access::CommandPath;
use crate::error::ApiError;
use crate::state::AppState;
use space_node::follow::follow;

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// Start at this offset of the combined output (stdout and stderr bytes
    /// in arrival order). Default 0.
    #[serde(default)]
    from: u64,
    /// Keep the stream open until the command exits. Default false: send
    /// what is there (and the exit frame if it has ended).
    #[serde(default)]
    follow: bool,
}

#[derive(Clone, Copy)]
enum Format {
    Ndjson,
    Sse,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{cid}/output", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Command id"), OutputQuery),
    responses(
        (status = 200, description = "Newline-delimited frames; the last is the exit frame once the command ended",
         body = OutputFrame, content_type = "application/x-ndjson"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn output(
    path: CommandPath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<OutputQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let emitted = follow(&state.platform, path.sandbox.id(), path.id(), query.from, query.follow)?;
    let format = match headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) {
        Some(accept) if accept.contains("text/event-stream") => Format::Sse,
        _ => Format::Ndjson,
    };
    let body = Body::from_stream(futures_util::stream::unfold(emitted, move |mut emitted| async move {
        let item = emitted.recv().await?;
        Some((Ok::<_, Infallible>(render(format, &item.into_frame())), emitted))
    }));
    Ok(stream_response(body, matches!(format, Format::Sse)))
}

fn render(format: Format, frame: &OutputFrame) -> Bytes {
    let json = serde_json::to_string(frame).unwrap_or_default();
    let text = match format {
        Format::Ndjson => format!("{json}\n"),
        Format::Sse => {
            let event = match frame {
                OutputFrame::Stdout { .. } => "stdout",
                OutputFrame::Stderr { .. } => "stderr",
                OutputFrame::Exit { .. } => "exit",
            };
            format!("event: {event}\ndata: {json}\n\n")
        }
    };
    Bytes::from(text)
}
