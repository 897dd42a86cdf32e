//! `/v1/operations`: follow asynchronous lifecycle work.

use axum::extract::State;
use axum::{Extension, Json};
use space_api::{ErrorBody, Operation, OperationList};
use space_http::extract::ApiQuery;

use super::access::OperationPath;
use super::WaitQuery;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Caller;

#[utoipa::path(get, path = "/v1/operations/{id}", tag = "operations",
    params(("id" = String, Path, description = "Operation id"), WaitQuery),
    responses((status = 200, body = Operation), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(
    path: OperationPath,
    State(state): State<AppState>,
    ApiQuery(wait): ApiQuery<WaitQuery>,
) -> Result<Json<Operation>, ApiError> {
    let deadline = wait.deadline()?;
    if path.operation.state.is_terminal() {
        return Ok(Json(path.operation));
    }
    let platform = &state.platform;
    let id = path.id.as_str();
    let operation = platform.wait_for(Some(deadline), || platform.operation(id), |op| op.state.is_terminal()).await?;
    Ok(Json(operation))
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only this sandbox's operations.
    sandbox_id: Option<String>,
}

#[utoipa::path(get, path = "/v1/operations", tag = "operations", params(ListQuery),
    responses((status = 200, body = OperationList), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<OperationList>, ApiError> {
    let operations = state.platform.operations_of(&caller, query.sandbox_id.as_deref())?;
    Ok(Json(OperationList { operations }))
}
