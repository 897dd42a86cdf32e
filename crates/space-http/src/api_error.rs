//! A runtime or domain error (`space_core::NodeError`) on its way to an
//! HTTP client: `ApiError` is answered as an [`HttpError`], where its code
//! becomes a status (the code fixes it), a JSON error body and
//! `Retry-After` (decision 018). A node's edge, the E2B adapter and the
//! control plane all answer with it.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use space_api::ErrorCode;
use space_core::NodeError;

use crate::error::HttpError;

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

impl From<space_store::StoreError> for ApiError {
    fn from(err: space_store::StoreError) -> ApiError {
        ApiError(err.into())
    }
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError(NodeError::new(code, message))
    }

    /// The HTTP status, the one the code is always answered with.
    pub fn status(&self) -> StatusCode {
        crate::error::status_of(self.0.code)
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

/// What the edge's own checks refuse (a body, a query, a proxied request's
/// framing), on the way back from a handler as its error.
impl From<HttpError> for ApiError {
    fn from(err: HttpError) -> ApiError {
        let HttpError { detail, retry_after_s } = err;
        let mut err = NodeError::new(detail.code, detail.message).with_details(detail.details);
        err.retry_after_s = retry_after_s;
        ApiError(err)
    }
}

impl From<ApiError> for HttpError {
    fn from(err: ApiError) -> HttpError {
        HttpError { detail: err.0.detail(), retry_after_s: err.0.retry_after_s }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        HttpError::from(self).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_keeps_its_code_message_details_and_retry_hint_through_the_edge() {
        let node =
            ApiError::new(ErrorCode::Capacity, "full").with_details(serde_json::json!({"free": 0})).retry_after(5);
        let edge = HttpError::from(node);
        assert_eq!(edge.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!((edge.detail.code, edge.detail.message.as_str()), (ErrorCode::Capacity, "full"));
        assert_eq!(edge.detail.details, serde_json::json!({"free": 0}));
        assert_eq!(edge.retry_after_s, Some(5));
        let back = ApiError::from(edge);
        assert_eq!((back.code, back.message.as_str(), back.retry_after_s), (ErrorCode::Capacity, "full", Some(5)));
        assert_eq!(back.details, serde_json::json!({"free": 0}));
    }
}
