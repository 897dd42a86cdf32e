//! Tenants' secrets in a cluster: kept sealed in PostgreSQL, and the whole
//! set sent to every live node on each change (a node missed, or started
//! later, gets it with its next heartbeat's answer).

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use space_api::ErrorCode;
use space_core::tenants::Caller;

use crate::error::ControlError;
use crate::node_client::NodeClient;
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
    let set = space_core::secrets::secret_set(&cp.store, keyring)?;
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        // A node missed gets the set with its next heartbeat's answer.
        if let Err(err) = NodeClient::new(cp, &node.row).put_secrets(&set).await {
            tracing::warn!(node = %node.row.id, "sending the secrets: {err}");
        }
    }
    Ok(answer)
}
