//! Tenants' secrets in a cluster: kept sealed in PostgreSQL, and the whole
//! set sent to every live node on each change (a node missed, or started
//! later, gets it with its next heartbeat's answer).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use space_api::cluster::SECRETS_PATH;
use space_api::ErrorCode;
use space_core::tenants::Caller;

use crate::error::ControlError;
use crate::forward::forward;
use crate::state::{nodes, ControlPlane};

/// `PUT` or `DELETE /v1/secrets/{name}`: kept in PostgreSQL, then sent to
/// every live node at once, so a sandbox created next can bind it.
pub(crate) async fn secret(
    cp: &ControlPlane,
    caller: &Caller,
    name: &str,
    request: Request,
) -> Result<Response, ControlError> {
    let Some(keyring) = &cp.keyring else {
        return Err(ControlError::new(
            ErrorCode::NotInClusterMode,
            "this control plane keeps no secrets: start it with --secrets-key-file",
        ));
    };
    let answer = if request.method() == Method::PUT {
        use axum::extract::FromRequest as _;
        let space_http::extract::ApiJson(put) =
            space_http::extract::ApiJson::<space_api::PutSecretRequest>::from_request(request, &()).await?;
        axum::Json(space_core::secrets::put_secret(&cp.store, keyring, &caller.tenant, name, put)?).into_response()
    } else {
        space_core::secrets::delete_secret(&cp.store, &caller.tenant, name)?;
        StatusCode::NO_CONTENT.into_response()
    };
    let set = serde_json::to_vec(&space_core::secrets::secret_set(&cp.store, keyring)?)
        .map_err(|e| ControlError::internal("the secrets", e))?;
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let request = Request::post(SECRETS_PATH)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(set.clone()))
            .map_err(|e| ControlError::internal("a request", e))?;
        match forward(cp, &node.row, &Caller::operator(), request).await {
            Ok(response) if response.status().is_success() => {}
            Ok(response) => tracing::warn!(node = %node.row.id, "sending the secrets: {}", response.status()),
            Err(err) => tracing::warn!(node = %node.row.id, "sending the secrets: {}", err.message),
        }
    }
    Ok(answer)
}
