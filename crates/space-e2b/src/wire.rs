//! E2B's HTTP conventions the adapter and a cluster's control plane both
//! answer with: envd's version, a header's text, a list's page.

use std::collections::BTreeMap;
use std::time::SystemTime;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::error::E2bError;

/// The envd version SPACE answers with: the SDK turns on features by it.
/// 0.6.4's are served: closing stdin, raw and gzip uploads (0.5.7), file
/// metadata asked for (0.6.2) is refused with a clear error rather than
/// dropped (envd keeps it in user extended attributes, which gVisor's
/// filesystems do not hold), watchers with entries (0.6.3) and the
/// network-mount flag (0.6.4: a sandbox's directories are all local).
pub const ENVD_VERSION: &str = "0.6.4";

/// A header's text, if present and readable.
pub(crate) fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// One page of `listed` (each with its start) as E2B answers a list
/// (`space_api::e2b::page`), the next page's `nextToken` in `X-Next-Token`.
/// `query` is the list's decoded query.
pub fn page(listed: Vec<(SystemTime, Value)>, query: &BTreeMap<String, String>) -> Result<Response, E2bError> {
    let page =
        space_api::e2b::page(listed, query).map_err(|message| E2bError::new(StatusCode::BAD_REQUEST, message))?;
    let mut response = axum::Json(page.items).into_response();
    if let Some(next) = page.next_token {
        response.headers_mut().insert("x-next-token", HeaderValue::from(next));
    }
    Ok(response)
}
