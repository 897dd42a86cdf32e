//! `/v1/volumes`: a tenant's volumes (issue 37, decision 031) — create,
//! list, get, delete, snapshots and their restore, and files without a
//! sandbox (the sandbox files routes' query and answers, served by the
//! volume's confined files child). The runtime's `volumes.rs` does the
//! work; each volume is loaded for the caller by `access::VolumePath`.

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use space_api::{
    CreateVolumeRequest, CreateVolumeSnapshotRequest, ErrorBody, ErrorCode, MoveVolumeRequest, Volume, VolumeList,
    VolumeSnapshot, VolumeSnapshotList,
};
use space_http::extract::{ApiJson, ApiQuery, NoBody, NoQuery};

use super::access::{VolumePath, VolumeSnapshotPath};
use super::files::{self, FileAction, FileQuery, FileWritten};
use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Caller;

#[utoipa::path(post, path = "/v1/volumes", tag = "volumes",
    request_body = CreateVolumeRequest,
    responses((status = 201, description = "Created: empty, or a copy-on-write copy of a snapshot", body = Volume),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "`from_snapshot` names no volume or snapshot of the caller's", body = ErrorBody),
        (status = 409, description = "The tenant has a volume of that name", body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 429, description = "The volume would take the tenant past its disk quota", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    _: NoQuery,
    ApiJson(request): ApiJson<CreateVolumeRequest>,
) -> Result<(StatusCode, Json<Volume>), ApiError> {
    let volume = state.platform.create_volume(&caller.tenant, request).await?;
    Ok((StatusCode::CREATED, Json(volume)))
}

#[utoipa::path(get, path = "/v1/volumes", tag = "volumes",
    responses((status = 200, description = "The caller's volumes, by name", body = VolumeList),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    _: NoQuery,
) -> Result<Json<VolumeList>, ApiError> {
    Ok(Json(VolumeList { volumes: state.platform.volumes(&caller.tenant).await? }))
}

#[utoipa::path(get, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, body = Volume), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn get(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    _: NoQuery,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(state.platform.volume(&caller.tenant, &volume.name).await?))
}

#[utoipa::path(delete, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 204, description = "Deleted, with its snapshots"), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "A live sandbox mounts it (`details.sandbox_id`)", body = ErrorBody)))]
pub async fn delete(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    state.platform.delete_volume(&caller.tenant, &volume.name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/volumes/{name}/snapshots", tag = "volumes",
    request_body = CreateVolumeSnapshotRequest,
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 201, description = "Its files at this instant, read-only", body = VolumeSnapshot),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The volume has a snapshot of that name", body = ErrorBody),
        (status = 422, body = ErrorBody), (status = 429, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn snapshot(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    _: NoQuery,
    ApiJson(request): ApiJson<CreateVolumeSnapshotRequest>,
) -> Result<(StatusCode, Json<VolumeSnapshot>), ApiError> {
    let snapshot = state.platform.snapshot_volume(&caller.tenant, &volume.name, &request.name).await?;
    Ok((StatusCode::CREATED, Json(snapshot)))
}

#[utoipa::path(get, path = "/v1/volumes/{name}/snapshots", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, description = "Oldest first", body = VolumeSnapshotList), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn snapshots(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    _: NoQuery,
) -> Result<Json<VolumeSnapshotList>, ApiError> {
    Ok(Json(VolumeSnapshotList { snapshots: state.platform.volume_snapshots(&caller.tenant, &volume.name).await? }))
}

#[utoipa::path(delete, path = "/v1/volumes/{name}/snapshots/{snapshot}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), ("snapshot" = String, Path, description = "Snapshot name")),
    responses((status = 204, description = "Deleted"), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn delete_snapshot(
    VolumeSnapshotPath { volume, snapshot, caller }: VolumeSnapshotPath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    state.platform.delete_volume_snapshot(&caller.tenant, &volume.name, &snapshot).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/volumes/{name}/snapshots/{snapshot}/restore", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), ("snapshot" = String, Path, description = "Snapshot name")),
    responses((status = 200, description = "The volume's files are the snapshot's (the snapshot stays)", body = Volume),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "A live sandbox mounts it (`details.sandbox_id`)", body = ErrorBody)))]
pub async fn restore(
    VolumeSnapshotPath { volume, snapshot, caller }: VolumeSnapshotPath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(state.platform.restore_volume(&caller.tenant, &volume.name, &snapshot).await?))
}

#[utoipa::path(post, path = "/v1/volumes/{name}/move", tag = "volumes",
    request_body = MoveVolumeRequest,
    params(("name" = String, Path, description = "Volume name")),
    responses(
        (status = 200, description = "Moved (a cluster's control plane only): made on `node` with its size, its files copied as a tar, the old copy deleted. Snapshots are not carried: a volume that has any is refused", body = Volume),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "No volume of that name for the caller", body = ErrorBody),
        (status = 409, description = "`volume_in_use` while a sandbox mounts it (`details.sandbox_id`); `invalid_state` while it has snapshots (`details.state` `has_snapshots`) or another move holds it (`moving`)", body = ErrorBody),
        (status = 422, description = "`details.field` `node`: no node of that name", body = ErrorBody),
        (status = 429, description = "The copy would take the tenant past its disk quota on the target", body = ErrorBody),
        (status = 501, description = "A single server keeps every volume on its own disk", body = ErrorBody),
        (status = 502, description = "A node did not answer", body = ErrorBody),
        (status = 503, description = "The volume's node or the target is lost", body = ErrorBody)))]
pub async fn move_volume(
    VolumePath { volume, .. }: VolumePath,
    _: NoQuery,
    ApiJson(request): ApiJson<MoveVolumeRequest>,
) -> Result<Json<Volume>, ApiError> {
    Err(ApiError::new(
        ErrorCode::NotInClusterMode,
        format!(
            "volume {:?} cannot move to node {:?}: this server is not a cluster's control plane",
            volume.name, request.node
        ),
    ))
}

#[utoipa::path(get, path = "/v1/volumes/{name}/files", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), FileQuery),
    responses(
        (status = 200, description = "A regular file's bytes (application/octet-stream), a directory's listing, or with format=tar a directory as a tar", body = files::DirListing),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 422, body = ErrorBody)))]
pub async fn read_file(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<FileQuery>,
) -> Result<Response, ApiError> {
    let query = query.checked(FileAction::Read)?;
    files::checked_path(&query.path)?;
    query.tar()?;
    let conn = state.platform.volume_files(&caller.tenant, &volume.name, false).await?;
    let agent = conn.agent().clone();
    files::read_with(&agent, conn, &query).await
}

#[utoipa::path(put, path = "/v1/volumes/{name}/files", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), FileQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 201, description = "Written (parent directories created; a file replaced whole or not at all)", body = FileWritten),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "A sandbox mounts the volume read-write", body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 422, description = "Among others `io_error` when the volume is full", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn write_file(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<FileQuery>,
    body: Body,
) -> Result<(StatusCode, Json<FileWritten>), ApiError> {
    let query = query.checked(FileAction::Write)?;
    let path = files::checked_path(&query.path)?.to_string();
    let mode = files::write_mode(&query)?;
    let tar = query.tar()?;
    state.platform.check_reserve("upload a file", 0)?;
    let conn = state.platform.volume_files(&caller.tenant, &volume.name, true).await?;
    files::write_with(conn.agent(), path, mode, tar, body).await
}

#[utoipa::path(delete, path = "/v1/volumes/{name}/files", tag = "volumes",
    params(("name" = String, Path, description = "Volume name"), FileQuery),
    responses((status = 204, description = "Deleted"), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "A sandbox mounts the volume read-write, or a directory is not empty", body = ErrorBody),
        (status = 422, body = ErrorBody)))]
pub async fn delete_file(
    VolumePath { volume, caller }: VolumePath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<FileQuery>,
) -> Result<StatusCode, ApiError> {
    let query = query.checked(FileAction::Delete)?;
    let path = files::checked_path(&query.path)?;
    let conn = state.platform.volume_files(&caller.tenant, &volume.name, true).await?;
    conn.agent().delete_path(path, query.recursive.unwrap_or(false)).await.map_err(files::file_error)?;
    Ok(StatusCode::NO_CONTENT)
}
