//! An error as an HTTP answer: the one place an `ErrorCode` becomes a
//! status (the code fixes it, decision 017), a JSON error body and
//! `Retry-After`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use space_api::{ErrorBody, ErrorCode, ErrorDetail};

/// An error answer: what the edge's own checks refuse (a malformed body, a
/// query, an unknown route), and what the server's `ApiError` is answered
/// as. It holds the wire form, so it needs no runtime.
#[derive(Debug, Clone)]
pub struct HttpError {
    pub detail: ErrorDetail,
    /// The request may work if repeated after this many seconds.
    pub retry_after_s: Option<u32>,
}

impl HttpError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> HttpError {
        HttpError {
            detail: ErrorDetail { code, message: message.into(), details: serde_json::json!({}) },
            retry_after_s: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> HttpError {
        HttpError::new(ErrorCode::InvalidRequest, message)
    }

    /// A bug or a host failure, logged here; the client gets no detail.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> HttpError {
        tracing::error!("{context}: {err}");
        HttpError::new(ErrorCode::Internal, format!("internal error while {context}"))
    }

    pub fn with_details(mut self, details: serde_json::Value) -> HttpError {
        self.detail.details = details;
        self
    }

    /// The HTTP status, the one the code is always answered with.
    pub fn status(&self) -> StatusCode {
        status_of(self.detail.code)
    }
}

/// The status `code` is always answered with.
pub fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail.message)
    }
}

impl std::error::Error for HttpError {}

/// The state database failed under a request (as the runtime answers it).
impl From<space_store::StoreError> for HttpError {
    fn from(err: space_store::StoreError) -> HttpError {
        HttpError::internal("accessing the state database", err)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, Json(ErrorBody { error: self.detail })).into_response();
        if let Some(seconds) = self.retry_after_s {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_error_is_answered_with_its_codes_status_its_body_and_retry_after() {
        let mut error = HttpError::new(ErrorCode::QuotaExceeded, "too many").with_details(serde_json::json!({"n": 1}));
        error.retry_after_s = Some(3);
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "3");
        let body = axum::body::to_bytes(response.into_body(), 4096).await.expect("the body");
        let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(
            body,
            serde_json::json!({"error": {"code": "quota_exceeded", "message": "too many", "details": {"n": 1}}})
        );
        let plain = HttpError::bad_request("no").into_response();
        assert_eq!(plain.status(), StatusCode::BAD_REQUEST);
        assert!(!plain.headers().contains_key(axum::http::header::RETRY_AFTER));
    }
}
