//! The `/v1` API: its routes, the middleware every request passes (auth,
//! request logs and metrics), the OpenAPI document. `router.rs` mounts it.
//! Handlers are thin: parse, call the platform, shape the response.

pub(crate) mod access;
mod attach;
mod checkpoints;
mod commands;
mod contexts;
mod egress;
pub(crate) mod events;
pub(crate) mod files;
mod health;
pub mod openapi;
mod operations;
pub(crate) mod output;
pub(crate) mod ports;
mod sandboxes;
mod secrets;
mod templates;
mod usage;
mod volumes;

use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use space_api::ErrorCode;
use space_http::auth::{bearer, websocket_bearer};

pub use self::openapi::ApiDoc;
use crate::error::ApiError;
pub use crate::host_facts::kvm_status;
use crate::state::AppState;

/// Longest `?wait=` a client may ask for.
pub const MAX_WAIT_S: u64 = 60;

/// The `/v1` API's routes (and `/metrics`), each behind the key check.
pub(crate) fn routes(state: &AppState) -> Router<AppState> {
    let protected = Router::new()
        .route("/v1/sandboxes", get(sandboxes::list).post(sandboxes::create))
        .route("/v1/sandboxes/{id}", get(sandboxes::get).delete(sandboxes::delete))
        .route("/v1/sandboxes/{id}/pause", axum::routing::post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/resume", axum::routing::post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/suspend", axum::routing::post(sandboxes::suspend))
        .route("/v1/sandboxes/{id}/fork", axum::routing::post(sandboxes::fork))
        .route("/v1/sandboxes/{id}/checkpoints", get(checkpoints::list).post(checkpoints::create))
        .route("/v1/sandboxes/{id}/contexts", get(contexts::list).post(contexts::create))
        .route("/v1/sandboxes/{id}/contexts/{cid}", get(contexts::get).delete(contexts::delete))
        .route("/v1/sandboxes/{id}/contexts/{cid}/run", axum::routing::post(contexts::run))
        .route("/v1/sandboxes/{id}/contexts/{cid}/interrupt", axum::routing::post(contexts::interrupt))
        .route("/v1/sandboxes/{id}/contexts/{cid}/restart", axum::routing::post(contexts::restart))
        .route("/v1/sandboxes/{id}/checkpoints/{name}", axum::routing::delete(checkpoints::delete))
        .route("/v1/sandboxes/{id}/checkpoints/{name}/restore", axum::routing::post(checkpoints::restore))
        .route("/v1/sandboxes/{id}/commands", get(commands::list).post(commands::create))
        .route("/v1/sandboxes/{id}/commands/{cid}", get(commands::get))
        .route("/v1/sandboxes/{id}/commands/{cid}/output", get(output::output))
        .route("/v1/sandboxes/{id}/commands/{cid}/stdin", axum::routing::post(commands::stdin))
        .route("/v1/sandboxes/{id}/commands/{cid}/signal", axum::routing::post(commands::signal))
        .route("/v1/sandboxes/{id}/commands/{cid}/resize", axum::routing::post(commands::resize))
        .route("/v1/sandboxes/{id}/commands/{cid}/attach", get(attach::attach))
        .route("/v1/sandboxes/{id}/exec", axum::routing::post(commands::exec))
        .route("/v1/sandboxes/{id}/egress", get(egress::log))
        .route("/v1/sandboxes/{id}/metrics", get(usage::sandbox))
        .route("/v1/sandboxes/{id}/network", axum::routing::put(egress::set_network))
        .route("/v1/sandboxes/{id}/ports", get(ports::list))
        // The port's own resource takes PUT and its link GET; every other
        // method (and every other path) is the server in the sandbox's.
        .route("/v1/sandboxes/{id}/ports/{port}", axum::routing::put(ports::set_access).fallback(ports::proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/", axum::routing::any(ports::proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/link", get(ports::link).fallback(ports::proxy))
        .route("/v1/sandboxes/{id}/ports/{port}/{*path}", axum::routing::any(ports::proxy))
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::read).put(files::write).delete(files::delete).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/operations", get(operations::list))
        .route("/v1/operations/{id}", get(operations::get))
        .route("/v1/operations/{id}/log", get(templates::log))
        .route(
            "/v1/templates",
            get(templates::list).post(templates::create).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(
            "/v1/templates/builds",
            axum::routing::post(templates::build).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/templates/{name}", get(templates::get).delete(templates::delete))
        .route("/v1/usage", get(usage::usage))
        .route("/v1/events", get(events::events))
        .route("/v1/volumes", get(volumes::list).post(volumes::create))
        .route("/v1/volumes/{name}", get(volumes::get).delete(volumes::delete))
        .route("/v1/volumes/{name}/snapshots", get(volumes::snapshots).post(volumes::snapshot))
        .route("/v1/volumes/{name}/snapshots/{snapshot}", axum::routing::delete(volumes::delete_snapshot))
        .route("/v1/volumes/{name}/snapshots/{snapshot}/restore", axum::routing::post(volumes::restore))
        .route("/v1/volumes/{name}/move", axum::routing::post(volumes::move_volume))
        .route(
            "/v1/volumes/{name}/files",
            get(volumes::read_file)
                .put(volumes::write_file)
                .delete(volumes::delete_file)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/secrets", get(secrets::list))
        .route("/v1/secrets/{name}", axum::routing::put(secrets::put).delete(secrets::delete))
        .route("/v1/openapi.json", get(openapi::document))
        .route_layer(middleware::from_fn(idempotency_key_where_taken))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new().route("/v1/health", get(health::health)).route("/metrics", get(metrics)).merge(protected)
}

/// A client's `X-Request-Id` when it is a sane token, else a new one.
fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 64)
        .filter(|v| v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)))
        .map(str::to_string)
        .unwrap_or_else(|| crate::ids::new_id("req"))
}

/// The sandbox or operation a path names (`.../sandboxes/{id}/...`,
/// `.../operations/{id}`, under `/v1` or `/e2b`), for the request's log
/// and for waiting on re-adoption; decoded as the router decodes it (this
/// authorizes nothing: handlers load what they name for the caller).
fn path_ids(path: &str) -> (Option<String>, Option<String>) {
    let parts: Vec<String> =
        path.split('/').map(|p| percent_encoding::percent_decode_str(p).decode_utf8_lossy().into_owned()).collect();
    let after = |kind: &str, prefix: &str| {
        parts.windows(2).find(|w| w[0] == kind && crate::ids::plausible(&w[1], prefix)).map(|w| w[1].clone())
    };
    (after("sandboxes", "sbx"), after("operations", "op"))
}

/// An E2B request for a sandbox that a restarted server is still
/// re-adopting (by path, or `E2b-Sandbox-Id`) waits until it is, then goes
/// on; past [`crate::Platform::reconcile_patience_ms`] it gets a 503 with
/// `Retry-After`. `/v1` requests wait in `access.rs`, after their owner
/// check, so the wait tells a stranger nothing; E2B's handlers load their
/// sandbox synchronously, so theirs is still here, before authentication.
pub(crate) async fn reconciled_first(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if !request.uri().path().starts_with("/e2b/") {
        return next.run(request).await;
    }
    let named = path_ids(request.uri().path())
        .0
        .or_else(|| request.headers().get("e2b-sandbox-id").and_then(|v| v.to_str().ok()).map(str::to_string));
    if let Some(id) = named {
        if let Err(refused) = until_reconciled(&state, &id).await {
            return axum::response::IntoResponse::into_response(refused);
        }
    }
    next.run(request).await
}

/// Waits for sandbox `id`'s re-adoption after a restart, up to the
/// platform's patience; then a 503 with `Retry-After`.
pub(crate) async fn until_reconciled(state: &AppState, id: &str) -> Result<(), ApiError> {
    match state.platform.until_reconciled(id, state.platform.reconcile_patience()).await {
        true => Ok(()),
        false => Err(ApiError::unavailable(format!("sandbox {id} is being re-adopted after a restart; try again"))
            .retry_after(1)),
    }
}

/// Every request: an id (echoed as `X-Request-Id`), a span that the
/// request's own log lines carry (request id, route, tenant once known,
/// sandbox or operation id; never keys or bodies), one log line at its
/// end, and the metrics (by route template, never by id).
pub(crate) async fn observe_request(State(state): State<AppState>, request: Request, next: Next) -> Response {
    use tracing::Instrument as _;
    if !state.platform.observing() {
        return next.run(request).await;
    }
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let method = request.method().as_str().to_string();
    let id = request_id(request.headers());
    let (mut sandbox, operation) = path_ids(request.uri().path());
    // E2B's envd names its sandbox in a header.
    if sandbox.is_none() {
        sandbox = request
            .headers()
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| crate::ids::plausible(v, "sbx"))
            .map(str::to_string);
    }
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %method,
        route = %route,
        tenant = tracing::field::Empty,
        sandbox = sandbox.as_deref().unwrap_or_default(),
        operation = operation.as_deref().unwrap_or_default(),
    );
    let started = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    let elapsed = started.elapsed();
    let status = response.status().as_u16();
    span.in_scope(|| tracing::info!(status, latency_ms = elapsed.as_secs_f64() * 1000.0, "request"));
    if let Ok(value) = axum::http::HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    let metrics = state.platform.metrics();
    let labels =
        crate::metrics::RequestLabels { method: method.clone(), route: route.clone(), status: status.to_string() };
    metrics.requests.get_or_create(&labels).inc();
    metrics
        .request_seconds
        .get_or_create(&crate::metrics::RouteLabels { method, route })
        .observe(elapsed.as_secs_f64());
    response
}

/// `GET /metrics`: Prometheus's text format. Host-wide figures, so only the
/// server's own key reads them, unless the server was started with
/// `--metrics-without-key` (for a scraper on a trusted network).
async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    if !state.platform.metrics_without_key() {
        let presented = bearer(&headers).unwrap_or_default();
        if !space_proto::constant_time_eq(presented.as_bytes(), state.api_key.as_bytes()) {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "metrics need the server's own key (`Authorization: Bearer <key>`), or --metrics-without-key",
            ));
        }
    }
    let text = state.platform.metrics_text();
    let mut response = Response::new(axum::body::Body::from(text));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, axum::http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    Ok(response)
}

pub(crate) async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such route")
}

pub(crate) async fn method_not_allowed() -> ApiError {
    ApiError::new(ErrorCode::MethodNotAllowed, "this route does not take that method")
}

/// Authenticates the key (the server's own, or a tenant's) and hands the
/// caller on to the handler.
async fn require_key(State(state): State<AppState>, mut request: Request, next: Next) -> Result<Response, ApiError> {
    let offered = websocket_bearer(request.headers());
    let caller = match bearer(request.headers()).or(offered.as_deref()) {
        Some(key) => crate::state::caller_for_key(&state, key)?,
        None => {
            return Err(ApiError::new(ErrorCode::Unauthorized, "missing API key: send `Authorization: Bearer <key>`"))
        }
    };
    let caller = match caller.role == crate::tenants::Role::ControlPlane {
        true => {
            let caller = crate::tenants::Caller::asserted(request.headers())?;
            crate::disk_quota::take_disk_quota(&state.platform, &caller, request.headers())?;
            caller
        }
        false => caller,
    };
    tracing::Span::current().record("tenant", caller.tenant.as_str());
    // Which resources the caller may reach is decided where each handler
    // loads one (`access.rs`), never here from the path's text.
    request.extensions_mut().insert(caller);
    Ok(next.run(request).await)
}

/// An `Idempotency-Key` on a route whose operation does not take one (the
/// document says which) would be ignored, and a repeat would act twice: it
/// is refused (400). A GET is safe to repeat anyway; the port proxy passes
/// the header on to the server in the sandbox.
async fn idempotency_key_where_taken(request: Request, next: Next) -> Result<Response, ApiError> {
    if request.headers().contains_key("idempotency-key") && request.method() != axum::http::Method::GET {
        let route = request.extensions().get::<axum::extract::MatchedPath>().map(|p| p.as_str()).unwrap_or_default();
        if !route.contains("/ports/") && !openapi::takes_idempotency_key(request.method().as_str(), route) {
            return Err(ApiError::bad_request(
                "this route does not take an Idempotency-Key (a repeat of it would not be made safe)",
            ));
        }
    }
    Ok(next.run(request).await)
}

/// `?wait=<seconds>` as a deadline (at most [`MAX_WAIT_S`]).
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Seconds to wait for a terminal state (max 60).
    pub wait: Option<u64>,
}

impl WaitQuery {
    /// When to stop waiting; no `wait` means answer at once.
    pub fn deadline(&self) -> Result<Instant, ApiError> {
        let seconds = self.wait.unwrap_or(0);
        if seconds > MAX_WAIT_S {
            return Err(ApiError::bad_request(format!("wait may be at most {MAX_WAIT_S} seconds")));
        }
        Ok(Instant::now() + Duration::from_secs(seconds))
    }
}

/// The `Idempotency-Key` header, if sent.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value.to_str().map_err(|_| ApiError::bad_request("Idempotency-Key must be ASCII"))?;
    if key.is_empty() || key.len() > 255 {
        return Err(ApiError::bad_request("Idempotency-Key must be 1-255 characters"));
    }
    Ok(Some(key.to_string()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_ids_a_path_names_are_read_as_the_router_decodes_them() {
        let id = crate::ids::new_id("sbx");
        let encoded = format!("/v1/sandboxes/%73{}/exec", &id[1..]);
        assert_eq!(super::path_ids(&encoded).0.as_deref(), Some(id.as_str()));
        assert_eq!(super::path_ids(&format!("/v1/sandboxes/{}/exec", id.to_uppercase())).0, None);
        let op = crate::ids::new_id("op");
        assert_eq!(super::path_ids(&format!("/v1/operations/%6F{}", &op[1..])).1.as_deref(), Some(op.as_str()));
    }
}
