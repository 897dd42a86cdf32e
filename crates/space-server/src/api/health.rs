//! `GET /v1/health`: no auth; what runs here and whether it can.

use axum::extract::State;
use axum::Json;
use space_api::{DiskStatus, Health};

use crate::state::AppState;

#[utoipa::path(get, path = "/v1/health", tag = "health", security(()),
    responses((status = 200, description = "The server is up", body = Health)))]
pub async fn health(State(state): State<AppState>) -> Json<Health> {
    let platform = &state.platform;
    let (free_bytes, total_bytes) = platform.data().disk_space();
    let filesystem = if space_host::btrfs::is_btrfs(platform.data().root()) { "btrfs" } else { "other" };
    Json(Health {
        status: if state.health.engine_available { "ok" } else { "degraded" }.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        engine: platform.engine_name().into(),
        engines: state.health.engines.clone(),
        kvm: state.health.kvm.clone(),
        disk: DiskStatus {
            filesystem: filesystem.into(),
            free_bytes,
            total_bytes,
            reserve_bytes: platform.disk_reserve_bytes(),
        },
        reconciling: platform.reconciling_count() as u64,
    })
}
