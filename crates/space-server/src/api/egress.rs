//! `GET /v1/sandboxes/{id}/egress`: every connection the sandbox made
//! through the egress gateway, allowed or not; `PUT .../network` changes
//! its policy while it runs.

use axum::extract::State;
use axum::Json;
use space_api::{EgressLog, ErrorBody, Network, Sandbox};
use space_http::extract::{ApiJson, ApiQuery, NoQuery};

use super::access::SandboxPath;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EgressQuery {
    /// The newest this many events (default 1000, at most 10000).
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/egress", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"), EgressQuery),
    responses((status = 200, body = EgressLog), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn log(
    path: SandboxPath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<EgressQuery>,
) -> Result<Json<EgressLog>, ApiError> {
    let limit = query.limit.unwrap_or(1000);
    let most = crate::store::EGRESS_EVENTS_KEPT;
    if limit == 0 || limit > most {
        return Err(ApiError::bad_request(format!("limit is between 1 and {most}")));
    }
    Ok(Json(EgressLog { events: state.platform.egress_log(&path.sandbox, limit)? }))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = Network,
    responses((status = 200, description = "In force for new connections at once; open ones it no longer allows are cut", body = Sandbox),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is deleted", body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn set_network(
    path: SandboxPath,
    State(state): State<AppState>,
    _: NoQuery,
    ApiJson(network): ApiJson<Network>,
) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(state.platform.set_network(&path.sandbox, network)?))
}
