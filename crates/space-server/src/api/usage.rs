//! `GET /v1/usage`: what the caller's tenant uses of each quota, host disk
//! by kind included. The operator may ask for any tenant (`?tenant=`).

use axum::extract::State;
use axum::{Extension, Json};
use space_api::{ErrorBody, ErrorCode, Usage};
use space_http::extract::{ApiQuery, NoQuery};

use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Caller;

#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// Another tenant's usage (the server's own key only).
    tenant: Option<String>,
}

#[utoipa::path(get, path = "/v1/usage", tag = "usage", params(UsageQuery),
    responses((status = 200, body = Usage), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, description = "`tenant` given with a tenant's key", body = ErrorBody)))]
pub async fn usage(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiQuery(query): ApiQuery<UsageQuery>,
) -> Result<Json<Usage>, ApiError> {
    let tenant = match query.tenant {
        Some(tenant) if tenant != caller.tenant && !caller.is_operator() => {
            return Err(ApiError::new(
                ErrorCode::Forbidden,
                "only the server's own key may ask for another tenant's usage",
            ));
        }
        Some(tenant) if !crate::tenants::valid_tenant(&tenant) => {
            return Err(ApiError::bad_request(format!("not a tenant name: {tenant:?}")));
        }
        Some(tenant) => tenant,
        None => caller.tenant,
    };
    let platform = state.platform.clone();
    // Sizes are read from the disk: off the async threads.
    let usage = tokio::task::spawn_blocking(move || platform.usage_of(&tenant))
        .await
        .map_err(|e| ApiError::internal("measuring usage", e))??;
    Ok(Json(usage))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = space_api::SandboxUsage), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn sandbox(
    path: super::access::SandboxPath,
    State(state): State<AppState>,
    _: NoQuery,
) -> Result<Json<space_api::SandboxUsage>, ApiError> {
    Ok(Json(state.platform.sandbox_usage(&path.sandbox).await?))
}
