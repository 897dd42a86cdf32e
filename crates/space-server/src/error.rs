//! One error type for the API edge, mapped to statuses in one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use space_api::{ErrorBody, ErrorDetail};

/// An error as the client sees it: status, stable code, human message.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub details: serde_json::Value,
    /// Sent as `Retry-After` (seconds): the request may work if repeated.
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), details: serde_json::json!({}), retry_after_s: None }
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
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_value", message)
    }

    pub fn not_found(kind: &str, id: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no {kind} {id:?}"))
            .with_details(serde_json::json!({ "kind": kind, "id": id }))
    }

    pub fn invalid_state(what: &str, state: &str, action: &str) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "invalid_state", format!("cannot {action}: the {what} is {state}"))
            .with_details(serde_json::json!({ "state": state }))
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_unavailable", message)
    }

    /// A bug or a host failure. The detail goes to the log, not the client,
    /// so host paths never leak.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> ApiError {
        tracing::error!("{context}: {err}");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("internal error while {context}"))
    }

    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail { code: self.code.to_string(), message: self.message.clone(), details: self.details.clone() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: self.detail() };
        let mut response = (self.status, Json(body)).into_response();
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
