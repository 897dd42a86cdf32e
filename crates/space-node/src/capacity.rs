//! Host capacity: memory promised to sandboxes that hold RAM (creating,
//! running, paused, resuming, and warm-pool members) must fit what the host
//! can give. A create or resume that would not fit is refused with 503
//! `capacity` instead of overcommitting the host; the warm pool stops
//! refilling at the limit. Suspended sandboxes hold only disk.

use space_api::{ErrorCode, SandboxState};

use crate::error::NodeError;
use crate::platform::Platform;

/// Host memory kept back for the server, runsc and the host itself.
const HOST_RESERVE_MIB: u64 = 1024;

/// The default capacity: the host's memory less a reserve.
pub fn default_capacity_mib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total_kib: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    (total_kib / 1024).saturating_sub(HOST_RESERVE_MIB)
}

fn holds_memory(state: SandboxState) -> bool {
    match state {
        SandboxState::Creating
        | SandboxState::Running
        | SandboxState::Paused
        | SandboxState::Suspending
        | SandboxState::Resuming => true,
        SandboxState::Suspended | SandboxState::Deleting | SandboxState::Deleted | SandboxState::Failed => false,
    }
}

impl Platform {
    /// Memory promised now, in MiB.
    pub fn reserved_mib(&self) -> u64 {
        let sandboxes: u64 = self
            .store
            .node()
            .live_sandboxes()
            .unwrap_or_default()
            .iter()
            .filter(|r| holds_memory(r.sandbox.state))
            .map(|r| u64::from(r.sandbox.memory_mib))
            .sum();
        sandboxes + self.warm.reserved_mib()
    }

    /// Refuses `memory_mib` more if it would not fit.
    pub(crate) fn admit(&self, memory_mib: u32) -> Result<(), NodeError> {
        let reserved = self.reserved_mib();
        if reserved + u64::from(memory_mib) > self.capacity_mib {
            return Err(NodeError::new(
                ErrorCode::Capacity,
                format!(
                    "this host cannot hold {memory_mib} MiB more: {reserved} of {} MiB are promised to sandboxes",
                    self.capacity_mib
                ),
            )
            .with_details(serde_json::json!({"requested_mib": memory_mib, "reserved_mib": reserved, "capacity_mib": self.capacity_mib})));
        }
        Ok(())
    }
}
