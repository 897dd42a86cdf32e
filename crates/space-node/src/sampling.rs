//! What a sandbox uses: CPU and memory from its engine's cgroup, disk from
//! its root's btrfs accounting. Running sandboxes are sampled every 5 s
//! into a short history kept in memory (the last 10 minutes), which
//! `GET /v1/sandboxes/{id}/metrics` and E2B's `get_metrics` answer from.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use space_api::{SandboxState, SandboxUsage, UsagePoint};

use crate::error::NodeError;
use crate::platform::Platform;
use crate::state::usage::Last;
pub use crate::state::usage::UsageHistory;
use crate::store::SandboxRecord;

/// How often running sandboxes are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Samples kept per sandbox: 10 minutes.
const KEPT: usize = 120;
/// The window of a sample taken on demand (no recent one exists).
const CPU_WINDOW: Duration = Duration::from_millis(200);

fn percent(used_usec: u64, over: Duration, vcpus: u32) -> f64 {
    let window = over.as_micros().max(1) as f64;
    (used_usec as f64 / window / f64::from(vcpus.max(1)) * 100.0).min(100.0)
}

impl Platform {
    /// One sample of `id` now, from its engine and disk (blocking).
    fn sample_now(&self, record: &SandboxRecord, window: Option<Duration>) -> Option<(UsagePoint, u64)> {
        let (id, vcpus) = (&record.sandbox.id, record.sandbox.vcpus);
        let spec = self.engine_spec(record);
        let disk_bytes = space_host::btrfs::exclusive_bytes(&self.data.sandbox_dir(id).join("rootfs")).unwrap_or(0);
        let before = self.engine.resource_use(&spec)?;
        let mut cpu_percent = 0.0;
        let mut after = before;
        if let Some(window) = window {
            let started = Instant::now();
            std::thread::sleep(window);
            after = self.engine.resource_use(&spec).unwrap_or(before);
            cpu_percent = percent(after.cpu_usec.saturating_sub(before.cpu_usec), started.elapsed(), vcpus);
        }
        let point = UsagePoint { at: crate::ids::now(), cpu_percent, memory_bytes: after.memory_bytes, disk_bytes };
        Some((point, after.cpu_usec))
    }

    /// Samples every running sandbox every [`SAMPLE_EVERY`] until the
    /// platform shuts down (a pass under way is finished first: none
    /// writes after the shutdown); forgets sandboxes that are gone.
    pub(crate) async fn sample_usage(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(SAMPLE_EVERY);
        let stopping = self.tasks.stopping();
        tokio::pin!(stopping);
        loop {
            tokio::select! {
                biased;
                () = &mut stopping => return,
                _ = ticker.tick() => {}
            }
            let platform = self.clone();
            let _ = tokio::task::spawn_blocking(move || platform.sample_all()).await;
        }
    }

    fn sample_all(&self) {
        let Ok(records) = self.store.node().live_sandboxes() else { return };
        let mut alive = std::collections::HashSet::new();
        for record in &records {
            alive.insert(record.sandbox.id.clone());
            if record.sandbox.state != SandboxState::Running {
                continue;
            }
            let Some((mut point, cpu_usec)) = self.sample_now(record, None) else {
                continue;
            };
            let now = Instant::now();
            let mut series = self.usage.series.lock().unwrap_or_else(|e| e.into_inner());
            let series = series.entry(record.sandbox.id.clone()).or_default();
            if let Some(last) = series.last {
                point.cpu_percent =
                    percent(cpu_usec.saturating_sub(last.cpu_usec), now.duration_since(last.at), record.sandbox.vcpus);
            }
            series.last = Some(Last { at: now, cpu_usec });
            series.cpu_usec = cpu_usec;
            series.points.push_back(point);
            while series.points.len() > KEPT {
                series.points.pop_front();
            }
        }
        self.usage.series.lock().unwrap_or_else(|e| e.into_inner()).retain(|id, _| alive.contains(id));
    }

    /// What the sandbox uses now and its recent history; a sandbox that
    /// does not run uses no CPU or memory.
    pub async fn sandbox_usage(
        self: &Arc<Self>,
        owned: &crate::access::OwnedSandbox,
    ) -> Result<SandboxUsage, NodeError> {
        let id = owned.id();
        let record = self.sandbox(id)?;
        let sandbox = &record.sandbox;
        let (history, cpu_usec) = {
            let series = self.usage.series.lock().unwrap_or_else(|e| e.into_inner());
            series.get(id).map(|s| (s.points.iter().cloned().collect::<Vec<_>>(), s.cpu_usec)).unwrap_or_default()
        };
        let fresh = history
            .last()
            .and_then(|p| crate::idle::age(&p.at, SystemTime::now()))
            .is_some_and(|a| a < SAMPLE_EVERY * 2);
        let (current, cpu_usec) = match (sandbox.state, fresh) {
            (SandboxState::Running, true) => (history.last().cloned(), cpu_usec),
            (SandboxState::Running, false) => {
                let (platform, record) = (self.clone(), record.clone());
                let sampled = tokio::task::spawn_blocking(move || platform.sample_now(&record, Some(CPU_WINDOW)))
                    .await
                    .map_err(|e| NodeError::internal("sampling a sandbox's use", e))?;
                (sampled.as_ref().map(|(p, _)| p.clone()), sampled.map_or(cpu_usec, |(_, c)| c))
            }
            _ => (None, cpu_usec),
        };
        let disk_bytes = match &current {
            Some(point) => point.disk_bytes,
            None => space_host::btrfs::exclusive_bytes(&self.data.sandbox_dir(id).join("rootfs")).unwrap_or(0),
        };
        let commands = self.store.node().commands(id)?;
        let running = commands.iter().filter(|c| c.result.is_none()).count() as u64;
        Ok(SandboxUsage {
            sandbox_id: id.to_string(),
            state: sandbox.state,
            vcpus: sandbox.vcpus,
            cpu_seconds: cpu_usec as f64 / 1e6,
            cpu_percent: current.as_ref().map_or(0.0, |p| p.cpu_percent),
            memory_bytes: current.as_ref().map_or(0, |p| p.memory_bytes),
            memory_limit_bytes: u64::from(sandbox.memory_mib) << 20,
            disk_bytes,
            disk_quota_bytes: u64::from(sandbox.disk_mib) << 20,
            commands: commands.len() as u64,
            commands_running: running,
            history,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_percent_is_of_all_vcpus_and_capped() {
        assert_eq!(percent(500_000, Duration::from_secs(1), 1), 50.0);
        assert_eq!(percent(500_000, Duration::from_secs(1), 2), 25.0);
        assert_eq!(percent(5_000_000, Duration::from_secs(1), 1), 100.0);
        assert_eq!(percent(1, Duration::ZERO, 0), 100.0);
    }
}
