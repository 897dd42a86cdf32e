//! Previews: a sandbox's port on a host name of its own,
//! `{port}-{sandbox_id}.{domain}` under the operator's `--preview-domain`
//! (decision 035). Every request whose host is in that domain is a
//! preview's, decided here before the API's router sees it: the API and the
//! console are never served on a preview's origin (an API path there goes
//! to the sandbox), so a page a sandbox serves never shares an origin with
//! the API's credentials.
//!
//! Access is per port: private by default — the sandbox's preview token in
//! `X-Space-Preview-Token` (or, for E2B's SDK, its traffic token in
//! `E2B-Traffic-Access-Token`), or a cookie for that one host, set by
//! opening a short-lived link the API signs (`GET
//! /v1/sandboxes/{id}/ports/{port}/link`) — or public, as its owner says
//! (`PUT /v1/sandboxes/{id}/ports/{port}`). Proofs are derived from the
//! server's keyring and the sandbox id, so they need no storage and are
//! checked before anything about the sandbox is looked up: a request
//! without one is refused alike whether the sandbox exists or not.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use space_api::ErrorCode;

use crate::access::TokenRefused;
use crate::error::ApiError;
use crate::ids::SandboxId;
use crate::state::AppState;

/// The header a client sends the sandbox's preview token in.
pub const TOKEN_HEADER: &str = "x-space-preview-token";
/// E2B's header for a sandbox's traffic token.
pub const E2B_TOKEN_HEADER: &str = "e2b-traffic-access-token";
/// The cookie a signed link sets (on the preview's own host only).
pub const COOKIE: &str = "space_preview";
/// The path on a preview host that takes a signed link; the server in the
/// sandbox never sees it.
pub const LINK_PATH: &str = "/__space/preview-link";
pub use space_http::preview::{PreviewDomain, Zone, FORWARDED_HOST};
/// How long a signed link may be opened.
pub const LINK_TTL: Duration = Duration::from_secs(300);
/// How long the cookie it sets lasts.
pub const COOKIE_TTL: Duration = Duration::from_secs(12 * 3600);

/// The keyring's purposes of a preview's proofs.
const TOKEN_PURPOSE: &str = "space-preview";
const LINK_PURPOSE: &str = "space-preview-link";
const COOKIE_PURPOSE: &str = "space-preview-cookie";

/// The sandbox's preview token (derived, never stored).
pub fn token(state: &AppState, id: &str) -> Result<String, ApiError> {
    Ok(state.platform.keyring()?.token(TOKEN_PURPOSE, id))
}

fn signature(state: &AppState, purpose: &str, id: &str, port: u16, expires: u64) -> Result<String, ApiError> {
    Ok(state.platform.keyring()?.token(&format!("{purpose}\0{port}\0{expires}"), id))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// A link that, opened within [`LINK_TTL`], lets its browser into one port:
/// the path and query on the preview host.
pub fn link_path(state: &AppState, id: &str, port: u16) -> Result<(String, u64), ApiError> {
    let expires = unix_now() + LINK_TTL.as_secs();
    let sig = signature(state, LINK_PURPOSE, id, port, expires)?;
    Ok((format!("{LINK_PATH}?expires={expires}&sig={sig}"), expires))
}

/// `{expires}.{sig}` holds when signed for this port and not past.
fn signed_ok(state: &AppState, purpose: &str, id: &str, port: u16, expires: &str, sig: &str, ttl: Duration) -> bool {
    let Ok(expires) = expires.parse::<u64>() else { return false };
    let now = unix_now();
    if expires < now || expires > now + ttl.as_secs() + 60 {
        return false;
    }
    let Ok(expected) = signature(state, purpose, id, port, expires) else { return false };
    space_proto::constant_time_eq(expected.as_bytes(), sig.as_bytes())
}

/// The scheme a client reached this server with: HTTPS over the server's
/// own TLS, or as a TLS-terminating proxy in front says.
pub fn https(state: &AppState, headers: &HeaderMap) -> bool {
    state.tls
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').next().is_some_and(|p| p.trim().eq_ignore_ascii_case("https")))
}

/// The URL of a sandbox's port for a client of the API that asked with
/// `headers`: its scheme, and the port it reached the server on (a
/// preview is served on the API's own listener).
pub fn url(state: &AppState, headers: &HeaderMap, id: &str, port: u16) -> Option<String> {
    let domain = state.preview.as_ref()?;
    let scheme = if https(state, headers) { "https" } else { "http" };
    let host = headers.get("x-forwarded-host").or_else(|| headers.get(header::HOST));
    let host = host.and_then(|h| h.to_str().ok()).and_then(|h| h.split(',').next()).unwrap_or_default().trim();
    let listener_port = match host.rsplit_once(':') {
        Some((_, p)) if !host.ends_with(']') && p.parse::<u16>().is_ok() => format!(":{p}"),
        _ => String::new(),
    };
    Some(format!("{scheme}://{}{listener_port}/", domain.host(id, port)))
}

/// The host a request names: its `Host` (one), or HTTP/2's `:authority`.
fn request_host(request: &Request) -> Result<Option<Vec<u8>>, ApiError> {
    let mut hosts = request.headers().get_all(header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Err(ApiError::bad_request("more than one Host header (RFC 9112 §3.2)"));
    }
    let authority = request.uri().authority().map(|a| a.as_str().as_bytes().to_vec());
    match (first, authority) {
        (Some(host), Some(authority)) if !host.as_bytes().eq_ignore_ascii_case(&authority) => {
            Err(ApiError::bad_request("the Host header and the request's authority differ"))
        }
        (Some(host), _) => Ok(Some(host.as_bytes().to_vec())),
        (None, authority) => Ok(authority),
    }
}

/// Every request passes here first: one for a preview host is served as
/// the preview's, whatever its path; the others go on to the API.
pub(crate) async fn route_preview(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(domain) = state.preview.clone() else { return next.run(request).await };
    let host = match request_host(&request) {
        Ok(host) => host,
        Err(err) => return err.into_response(),
    };
    // A node of a cluster: the control plane names the host it was asked
    // for, with the node token.
    let forwarded = forwarded_host(&state, request.headers());
    let zone = match (&forwarded, &host) {
        (Some(forwarded), _) => match domain.classify(forwarded) {
            Zone::Api => Zone::Unknown,
            zone => zone,
        },
        (None, Some(host)) => domain.classify(host),
        (None, None) => Zone::Api,
    };
    let public_host = forwarded.or(host).and_then(|h| HeaderValue::from_bytes(&h).ok());
    match zone {
        Zone::Api => next.run(request).await,
        Zone::Unknown => not_a_preview().into_response(),
        Zone::Port { id, port } if E2B_PORTS.contains(&port) => match to_envd(request, &id, port) {
            // Routed afresh (a layer's rewrite would not be): the E2B
            // adapter's routes alone.
            Ok(request) => {
                let envd = space_e2b::router::<()>(crate::state::e2b_state(&state));
                // A router is always ready for a call.
                let mut envd = envd.into_service::<Body>();
                match tower_service::Service::call(&mut envd, request).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                }
            }
            Err(err) => err.into_response(),
        },
        Zone::Port { id, port } => {
            serve(state, id, port, public_host, request).await.unwrap_or_else(IntoResponse::into_response)
        }
    }
}

/// The ports E2B's SDK reaches envd and its code interpreter on (as
/// `{port}-{id}.{domain}` when no `E2B_SANDBOX_URL` is set): served by the
/// E2B adapter's envd routes, with their own access token, for that one
/// sandbox.
pub const E2B_PORTS: [u16; 2] = [49983, 49999];

/// `request` as the E2B adapter's envd routes take it: under `/e2b/envd`,
/// naming the host's sandbox and port (whatever the client said).
fn to_envd(mut request: Request, id: &SandboxId, port: u16) -> Result<Request, ApiError> {
    let path = request.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let uri: axum::http::Uri =
        format!("/e2b/envd{path}").parse().map_err(|e| ApiError::bad_request(format!("{path:?}: {e}")))?;
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.insert("e2b-sandbox-id", HeaderValue::from_str(id.as_str()).expect("an id is a header value"));
    headers.insert("e2b-sandbox-port", HeaderValue::from(port));
    Ok(request)
}

fn forwarded_host(state: &AppState, headers: &HeaderMap) -> Option<Vec<u8>> {
    let token = state.node_token.as_ref()?;
    let host = headers.get(FORWARDED_HOST)?;
    let presented = space_http::auth::bearer(headers)?;
    space_proto::constant_time_eq(presented.as_bytes(), token.as_bytes()).then(|| host.as_bytes().to_vec())
}

fn not_a_preview() -> ApiError {
    ApiError::new(ErrorCode::NotFound, space_http::preview::NO_SUCH_PREVIEW)
}

fn private_port(port: u16) -> ApiError {
    // 403 as E2B's proxy answers it (its SDK's tests look for it).
    ApiError::new(ErrorCode::Forbidden, space_http::preview::private_port(port))
}

/// The cookie's value this request holds, if any.
fn cookie_value(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_string())
}

/// Whether the request proves it may open this port of `id`: the
/// sandbox's preview token, its E2B traffic token, or the link's cookie.
fn proven(state: &AppState, headers: &HeaderMap, id: &str, port: u16) -> Result<bool, ApiError> {
    let keyring = state.platform.keyring()?;
    let presented = |name: &str| headers.get(name).map(|v| v.as_bytes().trim_ascii()).unwrap_or_default();
    let mut ok = space_proto::constant_time_eq(presented(TOKEN_HEADER), keyring.token(TOKEN_PURPOSE, id).as_bytes());
    ok |= space_proto::constant_time_eq(
        presented(E2B_TOKEN_HEADER),
        space_e2b::traffic_token(&state.platform, id)?.as_bytes(),
    );
    if let Some((expires, sig)) = cookie_value(headers).as_deref().and_then(|v| v.split_once('.')) {
        ok |= signed_ok(state, COOKIE_PURPOSE, id, port, expires, sig, COOKIE_TTL);
    }
    Ok(ok)
}

async fn serve(
    state: AppState,
    id: SandboxId,
    port: u16,
    host: Option<HeaderValue>,
    request: Request,
) -> Result<Response, ApiError> {
    if request.uri().path() == LINK_PATH {
        return open_link(&state, &id, port, &request);
    }
    let proven = proven(&state, request.headers(), id.as_str(), port)?;
    let sandbox = match state.platform.sandbox_for_preview(&id, port, proven) {
        Ok(sandbox) => sandbox,
        Err(TokenRefused::Wrong) => return Err(private_port(port)),
        Err(TokenRefused::NotFound) => return Err(ApiError::not_found("sandbox", id.as_str())),
        Err(TokenRefused::Node(err)) => return Err(err.into()),
    };
    if state.platform.reconciling(id.as_str()) {
        crate::api::until_reconciled(&state, id.as_str()).await?;
    }
    let https = https(&state, request.headers());
    let path = request.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into());
    let forwarded = Forwarded { prefix: None, proto: Some(if https { "https" } else { "http" }), host };
    crate::api::ports::to_port(state, sandbox, port, path, request, forwarded).await
}

/// What the server in the sandbox is told of where a request came from.
pub(crate) struct Forwarded {
    /// The path form's prefix (`X-Forwarded-Prefix`).
    pub prefix: Option<String>,
    /// The scheme the client used (`X-Forwarded-Proto`).
    pub proto: Option<&'static str>,
    /// The host the client asked for (`X-Forwarded-Host`), when not the
    /// request's own `Host` (a control plane's link to a node).
    pub host: Option<HeaderValue>,
}

/// A signed link opened: the cookie for this one host, and on to `/`.
fn open_link(state: &AppState, id: &SandboxId, port: u16, request: &Request) -> Result<Response, ApiError> {
    let query = request.uri().query().unwrap_or_default();
    let pairs: Vec<(&str, &str)> = query.split('&').filter_map(|p| p.split_once('=')).collect();
    let find = |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| *v).unwrap_or_default();
    if !signed_ok(state, LINK_PURPOSE, id.as_str(), port, find("expires"), find("sig"), LINK_TTL) {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "this preview link is not valid or has expired: ask GET /v1/sandboxes/{id}/ports/{port}/link for another",
        ));
    }
    let expires = unix_now() + COOKIE_TTL.as_secs();
    let sig = signature(state, COOKIE_PURPOSE, id.as_str(), port, expires)?;
    // No Domain: the browser keeps it for this one host.
    let secure = if https(state, request.headers()) { "; Secure" } else { "" };
    let cookie =
        format!("{COOKIE}={expires}.{sig}; Path=/; Max-Age={}; HttpOnly; SameSite=Lax{secure}", COOKIE_TTL.as_secs());
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::SEE_OTHER;
    let headers = response.headers_mut();
    headers.insert(header::LOCATION, HeaderValue::from_static("/"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers
        .insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).map_err(|e| ApiError::bad_request(e.to_string()))?);
    Ok(response)
}

/// `headers` less this server's cookie (the other cookies are the app's).
pub(crate) fn without_preview_cookie(headers: &mut HeaderMap) {
    let kept: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|pair| !pair.is_empty() && pair.split_once('=').map_or(*pair, |(n, _)| n).trim() != COOKIE)
        .map(str::to_string)
        .collect();
    headers.remove(header::COOKIE);
    if let Ok(value) = HeaderValue::from_str(&kept.join("; ")) {
        if !kept.is_empty() {
            headers.insert(header::COOKIE, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preview_cookie_is_dropped_and_the_apps_stay() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1; space_preview=9.x"));
        headers.append(header::COOKIE, HeaderValue::from_static("space_preview =2; b=2"));
        without_preview_cookie(&mut headers);
        assert_eq!(headers[header::COOKIE], "a=1; b=2");
        let mut only = HeaderMap::new();
        only.append(header::COOKIE, HeaderValue::from_static("space_preview=9.x"));
        without_preview_cookie(&mut only);
        assert!(!only.contains_key(header::COOKIE));
    }
}
