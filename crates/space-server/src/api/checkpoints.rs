//! `/v1/sandboxes/{id}/checkpoints`: save, list, restore and delete a
//! sandbox's checkpoints (see `checkpoints.rs`).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use space_api::{CheckpointList, CreateCheckpointRequest, ErrorBody, OperationKind, SandboxOperation};
use space_http::extract::{ApiJson, NoBody, NoQuery};

use super::access::{CheckpointPath, SandboxPath};
use super::idempotency_key;
use super::sandboxes::replay;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Caller;

/// The answer a repeated `Idempotency-Key` gets: the first request's, if
/// it was for the same sandbox and checkpoint.
fn replayed(
    state: &AppState,
    caller: &Caller,
    key: Option<&str>,
    kind: OperationKind,
    id: &str,
    name: &str,
) -> Result<Option<SandboxOperation>, ApiError> {
    let Some(replayed) = replay(state, caller, key, kind)? else { return Ok(None) };
    if replayed.sandbox.id != id || replayed.operation.checkpoint.as_deref() != Some(name) {
        return Err(ApiError::unprocessable("this Idempotency-Key was already used for a different request"));
    }
    Ok(Some(replayed))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/checkpoints", tag = "checkpoints",
    request_body = CreateCheckpointRequest,
    params(("id" = String, Path, description = "Sandbox id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, description = "Accepted: the sandbox runs on, frozen only while its memory and disk are saved (`frozen_ms`)", body = SandboxOperation),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Neither running nor paused, the name is taken, or its engine cannot checkpoint", body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 429, description = "The checkpoint would take the tenant past its disk quota", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn create(
    SandboxPath { sandbox, caller }: SandboxPath,
    State(state): State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    ApiJson(request): ApiJson<CreateCheckpointRequest>,
) -> Result<(StatusCode, Json<SandboxOperation>), ApiError> {
    let id = sandbox.id();
    let key = idempotency_key(&headers)?;
    if let Some(first) = replayed(&state, &caller, key.as_deref(), OperationKind::Checkpoint, id, &request.name)? {
        return Ok((StatusCode::ACCEPTED, Json(first)));
    }
    let (sandbox, operation) = state.platform.checkpoint_sandbox(&sandbox, &request.name, key.as_deref())?;
    Ok((StatusCode::ACCEPTED, Json(SandboxOperation { sandbox, operation })))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/checkpoints", tag = "checkpoints",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, description = "Its whole checkpoints, oldest first", body = CheckpointList),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn list(
    path: SandboxPath,
    State(state): State<AppState>,
    _: NoQuery,
) -> Result<Json<CheckpointList>, ApiError> {
    let platform = state.platform.clone();
    // Sizes are read from the disk: off the async threads.
    let checkpoints = tokio::task::spawn_blocking(move || platform.checkpoints(&path.sandbox))
        .await
        .map_err(|e| ApiError::internal("listing checkpoints", e))??;
    Ok(Json(CheckpointList { checkpoints }))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/checkpoints/{name}/restore", tag = "checkpoints",
    params(("id" = String, Path, description = "Sandbox id"), ("name" = String, Path, description = "Checkpoint name"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, description = "Accepted: the sandbox (keeping its id) is stopped and started again from the checkpoint's memory and disk", body = SandboxOperation),
        (status = 401, body = ErrorBody), (status = 404, description = "No such sandbox or checkpoint", body = ErrorBody),
        (status = 409, description = "Neither running, paused nor suspended", body = ErrorBody),
        (status = 503, description = "The host cannot hold a suspended sandbox's memory", body = ErrorBody)))]
pub async fn restore(
    CheckpointPath { sandbox, caller, name }: CheckpointPath,
    State(state): State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    _: NoBody,
) -> Result<(StatusCode, Json<SandboxOperation>), ApiError> {
    let id = sandbox.id();
    let key = idempotency_key(&headers)?;
    if let Some(first) = replayed(&state, &caller, key.as_deref(), OperationKind::RestoreCheckpoint, id, &name)? {
        return Ok((StatusCode::ACCEPTED, Json(first)));
    }
    let (sandbox, operation) = state.platform.restore_checkpoint(&sandbox, &name, key.as_deref())?;
    Ok((StatusCode::ACCEPTED, Json(SandboxOperation { sandbox, operation })))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/checkpoints/{name}", tag = "checkpoints",
    params(("id" = String, Path, description = "Sandbox id"), ("name" = String, Path, description = "Checkpoint name")),
    responses((status = 204, description = "Deleted"), (status = 401, body = ErrorBody),
        (status = 404, description = "No such sandbox or checkpoint", body = ErrorBody),
        (status = 409, description = "Being saved or restored", body = ErrorBody)))]
pub async fn delete(
    path: CheckpointPath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    state.platform.delete_checkpoint(&path.sandbox, &path.name).await?;
    Ok(StatusCode::NO_CONTENT)
}
