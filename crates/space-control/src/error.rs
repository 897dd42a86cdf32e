//! The control plane's error: the same `space_http::ApiError` a node's edge
//! answers with (a domain `NodeError`, answered as an `HttpError`), named
//! for the control plane.

pub use space_http::ApiError as ControlError;
