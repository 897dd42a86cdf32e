//! The web console: a small single-page app over the public API, served at
//! `/` and `/console/...` from files embedded in the binary (nothing is
//! loaded from any other host). It holds no data of its own: everything it
//! shows comes from `/v1` with the key the user signs in with.

use axum::extract::Path;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use space_api::ErrorCode;

use crate::error::HttpError;

const INDEX: &[u8] = include_bytes!("../console/index.html");
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// Every file under `/console/`, with its type.
const ASSETS: &[(&str, &str, &[u8])] = &[
    ("app.js", JS, include_bytes!("../console/app.js")),
    ("style.css", CSS, include_bytes!("../console/style.css")),
    ("vendor/xterm.mjs", JS, include_bytes!("../console/vendor/xterm.mjs")),
    ("vendor/addon-fit.mjs", JS, include_bytes!("../console/vendor/addon-fit.mjs")),
    ("vendor/xterm.css", CSS, include_bytes!("../console/vendor/xterm.css")),
    ("vendor/LICENSE-xterm", "text/plain; charset=utf-8", include_bytes!("../console/vendor/LICENSE-xterm")),
];

/// Scripts only from this server; no frames, no other hosts. Styles may be
/// inline: the terminal sets its own.
const POLICY: &str = "default-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self' blob: data:; \
                      style-src 'self' 'unsafe-inline'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; \
                      form-action 'self'";

/// The console's routes, for any router's state.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route("/", get(index)).route("/console/{*file}", get(asset))
}

async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

async fn asset(Path(file): Path<String>) -> Result<Response, HttpError> {
    let (_, kind, bytes) = ASSETS
        .iter()
        .find(|(name, _, _)| *name == file)
        .ok_or_else(|| HttpError::new(ErrorCode::NotFound, "no such console file"))?;
    Ok(page(kind, bytes))
}

fn page(kind: &'static str, bytes: &'static [u8]) -> Response {
    let mut response = Response::new(axum::body::Body::from(bytes));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // Small, and a new server may bring new files: always revalidated.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
