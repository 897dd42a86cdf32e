//! Where a request presents its API key: `Authorization: Bearer <key>`, or
//! (a browser's WebSocket, which cannot set headers) a subprotocol.

use axum::http::{header, HeaderMap};

/// The key in `Authorization: Bearer <key>`, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ").map(str::trim)
}

/// The key a browser's WebSocket offers as the subprotocol
/// `bearer.<base64url of the key>` (browsers cannot set headers on a
/// WebSocket); the server never selects, so never echoes, that protocol.
pub fn websocket_bearer(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let upgrade = headers.get(header::UPGRADE)?.to_str().ok()?;
    if !upgrade.eq_ignore_ascii_case("websocket") {
        return None;
    }
    let offered = headers.get(header::SEC_WEBSOCKET_PROTOCOL)?.to_str().ok()?;
    let encoded = offered.split(',').map(str::trim).find_map(|p| p.strip_prefix("bearer."))?;
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(encoded).ok()?;
    String::from_utf8(key).ok()
}
