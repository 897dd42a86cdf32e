//! Lifecycle policies: idle sandboxes are paused, suspended or deleted as
//! each asked (`lifecycle.idle_timeout_s` + `on_idle`), and sandboxes past
//! `lifecycle.max_lifetime_s` are deleted. The loop only files requests;
//! each sandbox's actor carries them out like any client's.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use space_api::{OnIdle, OperationKind, OperationOrigin, SandboxState};

use crate::idle::{age, may_auto_pause};
use crate::platform::Platform;
use crate::store::SandboxRecord;

/// How often policies are checked.
const TICK: Duration = Duration::from_secs(1);

/// What the policies want done to a sandbox now, if anything.
pub(crate) fn due(record: &SandboxRecord, now: SystemTime, has_running_commands: bool) -> Option<OperationKind> {
    let sandbox = &record.sandbox;
    let lifecycle = &sandbox.lifecycle;
    let stable = matches!(sandbox.state, SandboxState::Running | SandboxState::Paused | SandboxState::Suspended);
    let lived_out =
        lifecycle.max_lifetime_s.is_some_and(|max| age(&sandbox.created_at, now).is_some_and(|a| a.as_secs() >= max));
    if stable && lived_out {
        return Some(OperationKind::Delete);
    }
    // One the server paused for idleness is still idle by its own policy:
    // past its idle timeout it is suspended or deleted as it asked.
    let server_paused = sandbox.state == SandboxState::Paused && sandbox.auto_paused;
    if !(sandbox.state == SandboxState::Running || server_paused) || has_running_commands {
        return None;
    }
    let timeout = lifecycle.idle_timeout_s?;
    if age(&sandbox.last_activity_at, now)?.as_secs() < timeout {
        return None;
    }
    match lifecycle.on_idle? {
        OnIdle::Pause if server_paused => None,
        OnIdle::Pause => Some(OperationKind::Pause),
        OnIdle::Suspend => Some(OperationKind::Suspend),
        OnIdle::Delete => Some(OperationKind::Delete),
        OnIdle::None => None,
    }
}

impl Platform {
    /// Checks every sandbox's policies once a second (and tops the warm
    /// pools up) until the platform shuts down; a tick under way is
    /// finished first, so no request is filed after the shutdown.
    pub(crate) async fn enforce_policies(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(TICK);
        let mut ticks: u64 = 0;
        let stopping = self.tasks.stopping();
        tokio::pin!(stopping);
        loop {
            tokio::select! {
                biased;
                () = &mut stopping => return,
                _ = ticker.tick() => {}
            }
            ticks += 1;
            if ticks.is_multiple_of(60) {
                // Quota groups of deleted sandboxes, once btrfs let them go.
                let host = self.template_host();
                let _ = tokio::task::spawn_blocking(move || host.clear_stale_quotas()).await;
                // Layer chains past the cache's size, least recently used first.
                let platform = self.clone();
                let _ = tokio::task::spawn_blocking(move || platform.evict_layers()).await;
            }
            // Memory freed since the last tick may make room for warm members.
            self.fill_warm_pools();
            self.reclaim_old_versions().await;
            let Ok(records) = self.store.node().live_sandboxes() else { continue };
            let now = SystemTime::now();
            let auto_pause_s = self.auto_pause_s.load(std::sync::atomic::Ordering::Relaxed);
            // Only stable sandboxes can be due; the rest cost no query.
            let stable = |r: &SandboxRecord| {
                matches!(r.sandbox.state, SandboxState::Running | SandboxState::Paused | SandboxState::Suspended)
            };
            // Sandboxes gone (or stopped) need not be woken.
            let alive: HashSet<&str> = records.iter().filter(|r| stable(r)).map(|r| r.sandbox.id.as_str()).collect();
            self.dozing.lock().unwrap_or_else(|e| e.into_inner()).retain(|id, _| alive.contains(id.as_str()));
            for record in records.iter().filter(|r| stable(r)) {
                let id = &record.sandbox.id;
                let busy = record.sandbox.state == SandboxState::Running && self.has_running_commands(id);
                if record.sandbox.state == SandboxState::Running {
                    self.doze_if_idle(record, now, busy);
                }
                let (kind, origin) = match due(record, now, busy) {
                    Some(kind) => (kind, OperationOrigin::Policy),
                    None if may_auto_pause(record, now, auto_pause_s, busy) => {
                        (OperationKind::Pause, OperationOrigin::Idle)
                    }
                    None => continue,
                };
                // An operation already queued for it makes this one moot.
                let pending =
                    self.store.node().operations(Some(id)).unwrap_or_default().iter().any(|op| !op.state.is_terminal());
                if pending {
                    continue;
                }
                match self.request_job(id, kind, None, origin) {
                    Ok(_) if origin == OperationOrigin::Idle => {
                        tracing::debug!(sandbox = %id, "pausing an idle sandbox")
                    }
                    Ok(_) => tracing::info!(sandbox = %id, "lifecycle policy: {kind:?}"),
                    Err(err) => {
                        tracing::debug!(sandbox = %id, "lifecycle policy {kind:?} not applied: {}", err.message)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use space_api::Lifecycle;

    use super::*;

    fn record(state: SandboxState, lifecycle: Lifecycle, created: &str, active: &str) -> SandboxRecord {
        SandboxRecord::sample(state, lifecycle, created, active)
    }

    #[test]
    fn idle_and_lifetime_rules() {
        let now = humantime::parse_rfc3339_weak("2026-01-01T00:10:00Z").unwrap();
        let idle = |on_idle| Lifecycle {
            idle_timeout_s: Some(60),
            on_idle: Some(on_idle),
            max_lifetime_s: None,
            auto_pause: None,
        };
        let old = "2026-01-01T00:00:00.000Z";
        let fresh = "2026-01-01T00:09:30.000Z";
        assert_eq!(
            due(&record(SandboxState::Running, idle(OnIdle::Pause), old, old), now, false),
            Some(OperationKind::Pause)
        );
        assert_eq!(
            due(&record(SandboxState::Running, idle(OnIdle::Suspend), old, old), now, false),
            Some(OperationKind::Suspend)
        );
        assert_eq!(
            due(&record(SandboxState::Running, idle(OnIdle::Delete), old, old), now, false),
            Some(OperationKind::Delete)
        );
        assert_eq!(due(&record(SandboxState::Running, idle(OnIdle::None), old, old), now, false), None);
        assert_eq!(
            due(&record(SandboxState::Running, idle(OnIdle::Pause), old, fresh), now, false),
            None,
            "recently active"
        );
        assert_eq!(
            due(&record(SandboxState::Running, idle(OnIdle::Pause), old, old), now, true),
            None,
            "a command runs"
        );
        assert_eq!(
            due(&record(SandboxState::Paused, idle(OnIdle::Pause), old, old), now, false),
            None,
            "already paused"
        );
        let mut server_paused = record(SandboxState::Paused, idle(OnIdle::Suspend), old, old);
        server_paused.sandbox.auto_paused = true;
        assert_eq!(due(&server_paused, now, false), Some(OperationKind::Suspend), "paused for idleness first");
        server_paused.sandbox.lifecycle = idle(OnIdle::Pause);
        assert_eq!(due(&server_paused, now, false), None, "paused is what it asked for");
        let mortal = Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: Some(300), auto_pause: None };
        assert_eq!(
            due(&record(SandboxState::Suspended, mortal.clone(), old, fresh), now, true),
            Some(OperationKind::Delete)
        );
        assert_eq!(due(&record(SandboxState::Running, mortal.clone(), fresh, fresh), now, false), None);
        assert_eq!(due(&record(SandboxState::Deleting, mortal, old, old), now, false), None);
    }
}
