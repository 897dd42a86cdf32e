//! `/v1/secrets`: the caller's tenant's secrets. Write-only: a value goes
//! in with `PUT` and never comes out (listing gives names and hosts).

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use space_api::{ErrorBody, PutSecretRequest, SecretInfo, SecretList};
use space_http::extract::{ApiJson, NoBody, NoQuery};

use super::access::NamePath;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Caller;

#[utoipa::path(put, path = "/v1/secrets/{name}", tag = "secrets",
    params(("name" = String, Path, description = "Secret name")),
    request_body = PutSecretRequest,
    responses((status = 200, description = "Kept (sealed); used from the next request that needs it", body = SecretInfo),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn put(
    NamePath { name, caller }: NamePath,
    State(state): State<AppState>,
    _: NoQuery,
    ApiJson(request): ApiJson<PutSecretRequest>,
) -> Result<Json<SecretInfo>, ApiError> {
    Ok(Json(state.platform.put_secret(&caller.tenant, &name, request)?))
}

#[utoipa::path(get, path = "/v1/secrets", tag = "secrets",
    responses((status = 200, description = "Names and hosts, never values", body = SecretList),
        (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    _: NoQuery,
) -> Result<Json<SecretList>, ApiError> {
    Ok(Json(SecretList { secrets: state.platform.secrets_of(&caller)? }))
}

#[utoipa::path(delete, path = "/v1/secrets/{name}", tag = "secrets",
    params(("name" = String, Path, description = "Secret name")),
    responses((status = 204, description = "Gone; sandboxes bound to it get `secret_unavailable`"),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn delete(
    NamePath { name, caller }: NamePath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    state.platform.delete_secret(&caller.tenant, &name)?;
    Ok(StatusCode::NO_CONTENT)
}
