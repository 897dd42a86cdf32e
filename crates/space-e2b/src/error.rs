//! E2B's error shape, and SPACE's errors in it.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error in E2B's REST shape: `{"code": <status>, "message": "..."}`
/// (the SDK reads `code` as a number and raises by status).
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// Named in envd's answers about a sandbox that does not run.
    pub sandbox_id: Option<String>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError { status, message: message.into(), sandbox_id: None }
    }
}

/// SPACE's errors in E2B's REST shape: by the code's status, but for a file
/// of the wrong type, which envd answers with 400.
impl From<space_node::NodeError> for E2bError {
    fn from(err: space_node::NodeError) -> E2bError {
        let status = match err.code {
            space_api::ErrorCode::WrongFileType => StatusCode::BAD_REQUEST,
            code => StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        };
        E2bError::new(status, err.message)
    }
}

/// An error of the edge's own (a refused key, a node that cannot be
/// reached) in E2B's shape.
impl From<space_http::ApiError> for E2bError {
    fn from(err: space_http::ApiError) -> E2bError {
        err.0.into()
    }
}

impl From<crate::store::StoreError> for E2bError {
    fn from(err: crate::store::StoreError) -> E2bError {
        space_node::NodeError::from(err).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(id) = self.sandbox_id {
            body["sandboxId"] = json!(id);
        }
        (self.status, axum::Json(body)).into_response()
    }
}
