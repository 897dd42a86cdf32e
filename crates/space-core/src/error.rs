//! The runtime's one error type: what went wrong, as a stable code from
//! `space_api::ErrorCode`, a message for the caller and details. It names no
//! transport: the HTTP edge (`space-server`'s `NodeError`) and the E2B adapter
//! each turn it into their own answer in one place.

use space_api::{ErrorCode, ErrorDetail};

/// An error as a caller of the node sees it: a stable code, a human message
/// and details.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct NodeError {
    pub code: ErrorCode,
    pub message: String,
    pub details: serde_json::Value,
    /// The request may work if repeated after this many seconds.
    pub retry_after_s: Option<u32>,
}

impl NodeError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> NodeError {
        NodeError { code, message: message.into(), details: serde_json::json!({}), retry_after_s: None }
    }

    pub fn with_details(mut self, details: serde_json::Value) -> NodeError {
        self.details = details;
        self
    }

    /// Tells the caller to try again after `seconds`.
    pub fn retry_after(mut self, seconds: u32) -> NodeError {
        self.retry_after_s = Some(seconds);
        self
    }

    pub fn bad_request(message: impl Into<String>) -> NodeError {
        NodeError::new(ErrorCode::InvalidRequest, message)
    }

    pub fn unprocessable(message: impl Into<String>) -> NodeError {
        NodeError::new(ErrorCode::InvalidValue, message)
    }

    pub fn not_found(kind: &str, id: &str) -> NodeError {
        NodeError::new(ErrorCode::NotFound, format!("no {kind} {id:?}"))
            .with_details(serde_json::json!({ "kind": kind, "id": id }))
    }

    pub fn invalid_state(what: &str, state: &str, action: &str) -> NodeError {
        NodeError::new(ErrorCode::InvalidState, format!("cannot {action}: the {what} is {state}"))
            .with_details(serde_json::json!({ "state": state }))
    }

    pub fn unavailable(message: impl Into<String>) -> NodeError {
        NodeError::new(ErrorCode::EngineUnavailable, message)
    }

    /// A bug or a host failure. The detail goes to the log, not the caller,
    /// so host paths never leak.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> NodeError {
        tracing::error!("{context}: {err}");
        NodeError::new(ErrorCode::Internal, format!("internal error while {context}"))
    }

    /// The error's wire form.
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail { code: self.code, message: self.message.clone(), details: self.details.clone() }
    }
}

impl From<space_store::StoreError> for NodeError {
    fn from(err: space_store::StoreError) -> NodeError {
        NodeError::internal("accessing the state database", err)
    }
}

/// 404 `template_not_found`.
pub fn template_not_found(name: &str) -> NodeError {
    NodeError::new(ErrorCode::TemplateNotFound, format!("no template {name:?}"))
        .with_details(serde_json::json!({"kind": "template", "id": name}))
}
