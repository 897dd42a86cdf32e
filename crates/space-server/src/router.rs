//! The whole API of a node as one router: the `/v1` API, the node's
//! internal routes for its control plane, the E2B adapter and the console,
//! under the layers every request passes. Above all of them, so none of
//! them imports another to be mounted.

use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use space_http::extract::MAX_JSON_BODY;

use crate::state::AppState;
use crate::{api, cluster};

/// The whole API as a router, separate from `serve` so tests drive it directly.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/internal/v1/templates/{name}", get(cluster::export_template))
        .route("/internal/v1/templates/pull", post(cluster::pull_template))
        .route("/internal/v1/events", get(cluster::feed))
        .route(space_api::cluster::VOLUME_RELEASE_PATH, post(cluster::release_volume))
        .route(space_api::cluster::VOLUME_ADOPT_PATH, post(cluster::adopt_volume))
        .route(
            "/internal/v1/secrets",
            post(cluster::take_secrets).layer(axum::extract::DefaultBodyLimit::max(crate::secrets::MAX_SECRET_SET)),
        )
        .merge(api::routes(&state))
        .merge(space_e2b::router(crate::state::e2b_state(&state)))
        .merge(space_http::console::router())
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), api::reconciled_first))
        .layer(middleware::from_fn_with_state(state.clone(), api::observe_request))
        .layer(middleware::from_fn(space_http::server::close_if_body_unread))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON_BODY))
        // Outermost: a preview host's request never reaches the API.
        .layer(middleware::from_fn_with_state(state.clone(), crate::preview::route_preview))
        .with_state(state)
}
