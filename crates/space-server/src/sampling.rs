//! What a sandbox uses right now: CPU and memory from its engine's cgroup,
//! disk from its root's btrfs accounting.

use std::time::{Duration, Instant};

use crate::error::ApiError;
use crate::platform::Platform;

/// How long CPU use is measured over for one sample.
const CPU_WINDOW: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy, Default)]
pub struct UsageSample {
    /// Of the sandbox's vCPUs together, over the last [`CPU_WINDOW`].
    pub cpu_percent: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
}

impl Platform {
    /// One sample of what the sandbox uses; zeros for what its engine does
    /// not expose (a stopped sandbox uses no CPU or memory).
    pub async fn sandbox_usage(&self, id: &str) -> Result<UsageSample, ApiError> {
        let record = self.sandbox(id)?;
        let vcpus = f64::from(record.sandbox.vcpus.max(1));
        let (engine, spec) = (self.engine.clone(), self.engine_spec(&record));
        let root = self.data.sandbox_dir(id).join("rootfs");
        let sample = tokio::task::spawn_blocking(move || {
            let mut sample = UsageSample {
                disk_bytes: space_host::btrfs::exclusive_bytes(&root).unwrap_or(0),
                ..Default::default()
            };
            let Some(before) = engine.resource_use(&spec) else { return sample };
            let started = Instant::now();
            std::thread::sleep(CPU_WINDOW);
            let after = engine.resource_use(&spec).unwrap_or(before);
            sample.memory_bytes = after.memory_bytes;
            let window = started.elapsed().as_micros() as f64;
            let used = after.cpu_usec.saturating_sub(before.cpu_usec) as f64;
            sample.cpu_percent = (used / window / vcpus * 100.0).min(100.0);
            sample
        })
        .await
        .map_err(|e| ApiError::internal("sampling a sandbox's use", e))?;
        Ok(sample)
    }
}
