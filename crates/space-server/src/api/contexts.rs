//! `/v1/sandboxes/{id}/contexts`: code contexts (see `contexts.rs`).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use space_api::{CodeContext, CodeContextList, CreateContextRequest, ErrorBody, RunCodeRequest};
use space_http::extract::{ApiJson, NoBody, NoQuery};

use super::access::{ContextPath, SandboxPath};
use crate::error::ApiError;
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts", tag = "contexts",
    request_body = CreateContextRequest,
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 201, description = "The interpreter runs and answers", body = CodeContext),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 422, description = "An unknown language, or the template has no interpreter for it", body = ErrorBody),
        (status = 503, description = "The interpreter did not answer in time", body = ErrorBody)))]
pub async fn create(
    path: SandboxPath,
    State(state): State<AppState>,
    _: NoQuery,
    ApiJson(request): ApiJson<CreateContextRequest>,
) -> Result<(StatusCode, Json<CodeContext>), ApiError> {
    let session = state.platform.session(&path.sandbox).await?;
    Ok((StatusCode::CREATED, Json(state.platform.create_context(&session, request).await?)))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/contexts", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = CodeContextList), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn list(
    path: SandboxPath,
    State(state): State<AppState>,
    _: NoQuery,
) -> Result<Json<CodeContextList>, ApiError> {
    Ok(Json(CodeContextList { contexts: state.platform.contexts(&path.sandbox)? }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/contexts/{cid}", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Context id")),
    responses((status = 200, body = CodeContext), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(path: ContextPath, State(state): State<AppState>, _: NoQuery) -> Result<Json<CodeContext>, ApiError> {
    Ok(Json(state.platform.get_context(&path.sandbox, path.context.as_str())?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/contexts/{cid}", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Context id")),
    responses((status = 204, description = "Its interpreter is stopped"), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn delete(
    path: ContextPath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    state.platform.delete_context(&state.platform.session(&path.sandbox).await?, path.context.as_str()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts/{cid}/interrupt", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Context id")),
    responses((status = 200, description = "The run going on is interrupted; the context stays", body = CodeContext),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn interrupt(
    path: ContextPath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<Json<CodeContext>, ApiError> {
    Ok(Json(
        state.platform.interrupt_context(&state.platform.session(&path.sandbox).await?, path.context.as_str()).await?,
    ))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts/{cid}/restart", tag = "contexts",
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Context id")),
    responses((status = 200, description = "A fresh interpreter answers (its state is gone)", body = CodeContext),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody)))]
pub async fn restart(
    path: ContextPath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<Json<CodeContext>, ApiError> {
    Ok(Json(
        state.platform.restart_context(&state.platform.session(&path.sandbox).await?, path.context.as_str()).await?,
    ))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts/{cid}/run", tag = "contexts",
    request_body = RunCodeRequest,
    params(("id" = String, Path, description = "Sandbox id"), ("cid" = String, Path, description = "Context id")),
    responses((status = 200, description = "NDJSON as it happens (SSE with `Accept: text/event-stream`, the type as the event's name): `stdout`/`stderr` (`text`), `result` (`data`: a MIME bundle, `is_main_result`), `error` (`name`, `value`, `traceback`), and last `end` (`status`: ok, error, interrupted, timeout or died; `execution_count`)", content_type = "application/x-ndjson"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Another run is going on, or the interpreter died", body = ErrorBody),
        (status = 422, description = "An `env` the context cannot take (bash: names of letters, digits and `_`)", body = ErrorBody)))]
pub async fn run(
    path: ContextPath,
    State(state): State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    ApiJson(request): ApiJson<RunCodeRequest>,
) -> Result<Response, ApiError> {
    let sse =
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|a| a.contains("text/event-stream"));
    // A busy context keeps the sandbox from being idle; the work gate is
    // held only to start the run (a fork or checkpoint does not wait for it).
    let session = state.platform.session(&path.sandbox).await?;
    let run = state.platform.run_code(&session, path.context.as_str(), request).await?;
    drop(session);
    let lines = futures_util::stream::unfold(Some(run), move |held| async move {
        let mut run = held?;
        let event = run.events.recv().await?;
        let end = event["type"] == "end";
        let text = match sse {
            true => format!("event: {}\ndata: {event}\n\n", event["type"].as_str().unwrap_or("message")),
            false => format!("{event}\n"),
        };
        Some((Ok::<_, std::convert::Infallible>(text), (!end).then_some(run)))
    });
    Ok(space_http::stream::stream_response(Body::from_stream(lines), sse))
}
