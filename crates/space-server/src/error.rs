//! The node edge's error: `space_http::ApiError`, a `NodeError` on its way
//! to an HTTP client (decision 018), under the path the handlers use.

pub use space_http::ApiError;
