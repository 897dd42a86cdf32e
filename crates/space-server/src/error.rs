//! The runtime's error as an HTTP answer: the one place a `NodeError`'s code
//! becomes a status (the code fixes it), a JSON error body and `Retry-After`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use space_api::{ErrorBody, ErrorCode};
use space_node::NodeError;

/// A [`NodeError`] on its way to an HTTP client. The edge's own failures
/// (a malformed body, an unknown route) are made with the same constructors.
#[derive(Debug, Clone)]
pub struct ApiError(pub NodeError);

impl std::ops::Deref for ApiError {
    type Target = NodeError;
    fn deref(&self) -> &NodeError {
        &self.0
    }
}

impl From<NodeError> for ApiError {
    fn from(err: NodeError) -> ApiError {
        ApiError(err)
    }
}

impl From<ApiError> for NodeError {
    fn from(err: ApiError) -> NodeError {
        err.0
    }
}

impl From<space_node::store::StoreError> for ApiError {
    fn from(err: space_node::store::StoreError) -> ApiError {
        ApiError(err.into())
    }
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError(NodeError::new(code, message))
    }

    /// The HTTP status, the one the code is always answered with.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.0.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    pub fn with_details(self, details: serde_json::Value) -> ApiError {
        ApiError(self.0.with_details(details))
    }

    pub fn retry_after(self, seconds: u32) -> ApiError {
        ApiError(self.0.retry_after(seconds))
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError(NodeError::bad_request(message))
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError(NodeError::unprocessable(message))
    }

    pub fn not_found(kind: &str, id: &str) -> ApiError {
        ApiError(NodeError::not_found(kind, id))
    }

    pub fn invalid_state(what: &str, state: &str, action: &str) -> ApiError {
        ApiError(NodeError::invalid_state(what, state, action))
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError(NodeError::unavailable(message))
    }

    /// A bug or a host failure, logged here; the client gets no detail.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> ApiError {
        ApiError(NodeError::internal(context, err))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let retry_after = self.0.retry_after_s;
        let mut response = (status, Json(ErrorBody { error: self.0.detail() })).into_response();
        if let Some(seconds) = retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}
