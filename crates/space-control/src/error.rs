//! The control plane's error: the domain's `NodeError` (the same codes and
//! constructors a node answers with), answered as `space_http::HttpError`.

use axum::response::{IntoResponse, Response};
use space_api::ErrorCode;
use space_core::NodeError;
use space_http::HttpError;

/// A [`NodeError`] on its way to a client of the control plane.
#[derive(Debug, Clone)]
pub struct ControlError(pub NodeError);

impl std::ops::Deref for ControlError {
    type Target = NodeError;
    fn deref(&self) -> &NodeError {
        &self.0
    }
}

impl From<NodeError> for ControlError {
    fn from(err: NodeError) -> ControlError {
        ControlError(err)
    }
}

impl From<space_store::StoreError> for ControlError {
    fn from(err: space_store::StoreError) -> ControlError {
        ControlError(err.into())
    }
}

/// What the edge's own checks refuse (a body, a query), as the control
/// plane's error.
impl From<HttpError> for ControlError {
    fn from(err: HttpError) -> ControlError {
        let HttpError { detail, retry_after_s } = err;
        let mut err = NodeError::new(detail.code, detail.message).with_details(detail.details);
        err.retry_after_s = retry_after_s;
        ControlError(err)
    }
}

impl From<ControlError> for HttpError {
    fn from(err: ControlError) -> HttpError {
        HttpError { detail: err.0.detail(), retry_after_s: err.0.retry_after_s }
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        HttpError::from(self).into_response()
    }
}

impl ControlError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ControlError {
        ControlError(NodeError::new(code, message))
    }

    pub fn bad_request(message: impl Into<String>) -> ControlError {
        ControlError(NodeError::bad_request(message))
    }

    pub fn not_found(kind: &str, id: &str) -> ControlError {
        ControlError(NodeError::not_found(kind, id))
    }

    pub fn invalid_state(what: &str, state: &str, action: &str) -> ControlError {
        ControlError(NodeError::invalid_state(what, state, action))
    }

    pub fn unavailable(message: impl Into<String>) -> ControlError {
        ControlError(NodeError::unavailable(message))
    }

    /// A bug or a host failure, logged here; the client gets no detail.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> ControlError {
        ControlError(NodeError::internal(context, err))
    }
}
