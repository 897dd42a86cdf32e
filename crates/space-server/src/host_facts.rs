//! What the host offers, probed once at startup for `GET /v1/health`.

use std::path::Path;

use space_api::{EngineStatus, KvmStatus};

use crate::platform::Platform;

/// Facts about the host, probed once at startup.
pub struct HostFacts {
    pub engine_available: bool,
    pub(crate) engines: Vec<EngineStatus>,
    pub(crate) kvm: KvmStatus,
}

impl HostFacts {
    pub fn probe(platform: &Platform) -> HostFacts {
        // Probed once at startup; only a platform built without it probes here.
        let report = platform.engine_report();
        let availability = report.iter().find(|a| a.name == platform.engine_name()).cloned().unwrap_or_else(|| {
            space_engine::Availability { name: platform.engine_name(), available: false, detail: "not probed".into() }
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
