//! What every handler of a node gets (`AppState`), and who a presented key
//! belongs to. Below the `/v1` handlers, the E2B adapter and the node's
//! internal routes, which all take it.

use std::sync::Arc;

use space_api::ErrorCode;
use space_http::links::Links;

use crate::error::ApiError;
use crate::host_facts::HostFacts;
use crate::platform::Platform;
use crate::tenants::Caller;
use space_node::NodeError;

/// What every handler gets.
#[derive(Clone)]
pub struct AppState {
    pub platform: Arc<Platform>,
    pub api_key: Arc<String>,
    pub health: Arc<HostFacts>,
    /// On a node of a cluster: the token the control plane presents, with
    /// the caller's tenant in `X-Space-Tenant` (decision 009).
    pub node_token: Option<Arc<String>>,
    /// On a node: how it reaches other members (template pulls).
    pub links: Links,
    /// `--preview-domain`: sandboxes' ports on host names of their own.
    pub preview: Option<Arc<crate::preview::PreviewDomain>>,
    /// The server serves HTTPS itself (a preview's cookie is `Secure`).
    pub tls: bool,
}

impl AppState {
    pub fn new(platform: Arc<Platform>, api_key: String) -> AppState {
        let health = Arc::new(HostFacts::probe(&platform));
        AppState {
            platform,
            api_key: Arc::new(api_key),
            health,
            node_token: None,
            links: Default::default(),
            preview: None,
            tls: false,
        }
    }

    /// A node's state: only the control plane, with `token`, calls it.
    pub fn node(platform: Arc<Platform>, token: String, links: Links) -> AppState {
        let mut unusable = [0u8; 32];
        let _ = getrandom::getrandom(&mut unusable);
        let mut state = AppState::new(platform, unusable.iter().map(|b| format!("{b:02x}")).collect());
        state.node_token = Some(Arc::new(token));
        state.links = links;
        state
    }

    /// This state serving previews under `domain`.
    pub fn with_preview(mut self, domain: crate::preview::PreviewDomain) -> AppState {
        self.preview = Some(Arc::new(domain));
        self
    }
}

/// Who a presented key belongs to: the server's own key, or a tenant's.
pub(crate) fn caller_for_key(state: &AppState, key: &str) -> Result<Caller, ApiError> {
    if space_proto::constant_time_eq(key.as_bytes(), state.api_key.as_bytes()) {
        return Ok(Caller::operator());
    }
    if let Some(token) = &state.node_token {
        if space_proto::constant_time_eq(key.as_bytes(), token.as_bytes()) {
            return Ok(Caller::control_plane());
        }
        // A node knows no tenant keys: the control plane checked them.
        return Err(ApiError::new(ErrorCode::Unauthorized, "a node answers its control plane only"));
    }
    state
        .platform
        .caller_for_key(key)?
        .ok_or_else(|| ApiError::new(ErrorCode::Unauthorized, "the API key is not valid"))
}

/// What the E2B adapter gets from this server: its platform, whether its
/// engine can run sandboxes, and who an E2B control request is from — a
/// SPACE key in `X-API-KEY`, or on a node of a cluster only the control
/// plane (the node token and the tenant it asserts, with the tenant's disk
/// quota as the control plane tells it).
pub fn e2b_state(state: &AppState) -> space_e2b::E2bState {
    let host = state.clone();
    let caller = move |headers: &axum::http::HeaderMap| -> Result<Caller, NodeError> {
        if host.node_token.is_some() {
            let token = space_http::auth::bearer(headers).unwrap_or_default();
            if caller_for_key(&host, token)?.role != crate::tenants::Role::ControlPlane {
                return Err(NodeError::new(ErrorCode::Unauthorized, "a node answers its control plane only"));
            }
            let caller = Caller::asserted(headers)?;
            crate::disk_quota::take_disk_quota(&host.platform, &caller, headers)?;
            return Ok(caller);
        }
        let key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| NodeError::new(ErrorCode::Unauthorized, "missing API key: send X-API-KEY"))?;
        // A SPACE key, or the same key in the shape E2B's SDK checks for.
        let key = space_api::e2b::presented_key(key).unwrap_or_default();
        Ok(caller_for_key(&host, &key)?)
    };
    space_e2b::E2bState {
        platform: state.platform.clone(),
        caller: std::sync::Arc::new(caller),
        engine_available: state.health.engine_available,
        preview_domain: state.preview.as_ref().map(|d| d.as_str().to_string()),
    }
}
