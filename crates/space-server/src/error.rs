//! One error type for the API edge, mapped to statuses in one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use space_api::{ErrorBody, ErrorCode, ErrorDetail};

/// An error as the client sees it: a stable code (which fixes the status),
/// a human message and details.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub details: serde_json::Value,
    /// Sent as `Retry-After` (seconds): the request may work if repeated.
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), details: serde_json::json!({}), retry_after_s: None }
    }

    /// The HTTP status, the one the code is always answered with.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    pub fn with_details(mut self, details: serde_json::Value) -> ApiError {
        self.details = details;
        self
    }

    /// Tells the client to try again after `seconds`.
    pub fn retry_after(mut self, seconds: u32) -> ApiError {
        self.retry_after_s = Some(seconds);
        self
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, message)
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidValue, message)
    }

    pub fn not_found(kind: &str, id: &str) -> ApiError {
        ApiError::new(ErrorCode::NotFound, format!("no {kind} {id:?}"))
            .with_details(serde_json::json!({ "kind": kind, "id": id }))
    }

    pub fn invalid_state(what: &str, state: &str, action: &str) -> ApiError {
        ApiError::new(ErrorCode::InvalidState, format!("cannot {action}: the {what} is {state}"))
            .with_details(serde_json::json!({ "state": state }))
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::EngineUnavailable, message)
    }

    /// A bug or a host failure. The detail goes to the log, not the client,
    /// so host paths never leak.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> ApiError {
        tracing::error!("{context}: {err}");
        ApiError::new(ErrorCode::Internal, format!("internal error while {context}"))
    }

    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail { code: self.code, message: self.message.clone(), details: self.details.clone() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: self.detail() };
        let mut response = (self.status(), Json(body)).into_response();
        if let Some(seconds) = self.retry_after_s {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(err: crate::store::StoreError) -> ApiError {
        ApiError::internal("accessing the state database", err)
    }
}
