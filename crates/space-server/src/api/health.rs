//! `GET /v1/health`: no auth; what runs here and whether it can.

use std::path::Path;

use axum::extract::State;
use axum::Json;
use space_api::{DiskStatus, EngineStatus, Health, KvmStatus};

use super::AppState;

/// Facts about the host, probed once at startup.
pub struct HostFacts {
    pub engine_available: bool,
    engines: Vec<EngineStatus>,
    kvm: KvmStatus,
}

impl HostFacts {
    pub fn probe(platform: &crate::Platform) -> HostFacts {
        // Probed once at startup; only a platform built without it probes here.
        let report = platform.engine_report.get().cloned().unwrap_or_else(|| vec![platform.engine.availability()]);
        let availability = report.iter().find(|a| a.name == platform.engine.name()).cloned().unwrap_or_else(|| {
            space_engine::Availability { name: platform.engine.name(), available: false, detail: "not probed".into() }
        });
        let engines = report
            .into_iter()
            .map(|a| EngineStatus { name: a.name.into(), available: a.available, detail: a.detail })
            .collect();
        HostFacts { engine_available: availability.available, engines, kvm: kvm_status() }
    }
}

/// Whether `/dev/kvm` exists and can boot a stock kernel.
pub fn kvm_status() -> KvmStatus {
    let present = Path::new("/dev/kvm").exists();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hardware = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|flag| flag == "vmx" || flag == "svm"));
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let detail = match (present, hardware, pvm) {
        (false, _, _) => "no /dev/kvm on this host",
        (true, true, _) => "/dev/kvm with hardware virtualization (vmx/svm)",
        (true, false, true) => "/dev/kvm is kvm_pvm (no vmx/svm): it cannot boot a stock guest kernel",
        (true, false, false) => "/dev/kvm without vmx/svm flags",
    };
    KvmStatus { present, detail: detail.into() }
}

#[utoipa::path(get, path = "/v1/health", tag = "health", security(()),
    responses((status = 200, description = "The server is up", body = Health)))]
pub async fn health(State(state): State<AppState>) -> Json<Health> {
    let platform = &state.platform;
    let (free_bytes, total_bytes) = platform.data.disk_space();
    let filesystem = if space_host::btrfs::is_btrfs(platform.data.root()) { "btrfs" } else { "other" };
    Json(Health {
        status: if state.health.engine_available { "ok" } else { "degraded" }.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        engine: platform.engine.name().into(),
        engines: state.health.engines.clone(),
        kvm: state.health.kvm.clone(),
        disk: DiskStatus {
            filesystem: filesystem.into(),
            free_bytes,
            total_bytes,
            reserve_bytes: platform.disk_reserve_bytes.load(std::sync::atomic::Ordering::Relaxed),
        },
        reconciling: platform.reconciling.lock().unwrap_or_else(|e| e.into_inner()).len() as u64,
    })
}
