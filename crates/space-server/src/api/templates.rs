//! `/v1/templates`: build from Debian packages (an operation), list,
//! inspect, delete; and `/v1/operations/{id}/log` for build logs.

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use space_api::{CreateTemplateRequest, ErrorBody, Template, TemplateList, TemplateOperation};

use super::{ApiJson, AppState};
use crate::error::ApiError;

#[utoipa::path(post, path = "/v1/templates", tag = "templates", request_body = CreateTemplateRequest,
    responses((status = 202, description = "Accepted; follow the build operation", body = TemplateOperation),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 422, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<CreateTemplateRequest>,
) -> Result<(StatusCode, Json<TemplateOperation>), ApiError> {
    let (template, operation) = state.platform.build_template(request)?;
    Ok((StatusCode::ACCEPTED, Json(TemplateOperation { template, operation })))
}

#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = TemplateList), (status = 401, body = ErrorBody)))]
pub async fn list(State(state): State<AppState>) -> Json<TemplateList> {
    Json(TemplateList { templates: state.platform.templates() })
}

#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses((status = 200, body = Template), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(State(state): State<AppState>, Path(name): Path<String>) -> Result<Json<Template>, ApiError> {
    Ok(Json(state.platform.template(&name)?))
}

#[utoipa::path(delete, path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses((status = 204, description = "Every version is gone"), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, description = "In use or being built", body = ErrorBody)))]
pub async fn delete(State(state): State<AppState>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    state.platform.delete_template(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/operations/{id}/log", tag = "operations",
    params(("id" = String, Path, description = "Operation id")),
    responses((status = 200, description = "The operation's log as text", content_type = "text/plain"),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn log(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    state.platform.operation(&id)?;
    let text = tokio::fs::read(state.platform.data.log_path(&id))
        .await
        .map_err(|_| ApiError::new(StatusCode::NOT_FOUND, "not_found", "this operation has no log"))?;
    let mut response = text.into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    Ok(response)
}
