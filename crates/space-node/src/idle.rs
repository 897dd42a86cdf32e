//! Idle sandboxes are paused by the server and resumed on demand.
//!
//! An idle running gVisor sandbox still costs CPU (≈ 3.5 % of a core
//! awake, ≈ 0.3 % dozing, see below); a paused one costs none. So a running sandbox with no
//! command running and no request for `auto_pause_s` seconds is paused by
//! the server (`auto_paused` in its record, unless its lifecycle says
//! `auto_pause: false`), and the next command or file request resumes it
//! before it is served (`begin_work`, in `lifecycle.rs`). Requests that use a sandbox hold its work gate
//! shared while they do; the pause takes it exclusively and re-checks that
//! the sandbox is idle, so a sandbox is never frozen under a request.
//!
//! Before that, and for sandboxes that are never paused (`auto_pause:
//! false`, or the idle pause turned off), a running sandbox idle for
//! [`DOZE_AFTER`] *dozes*: the server tells its engine it is idle (gVisor
//! coarsens its tasks' timers, ≈ 3.5 % of a core down to ≈ 0.3 %), under the
//! same gate, and tells it it is not before anything uses it again (a
//! request, a port, an operation that saves or copies it: `wake_up`).

use std::time::{Duration, SystemTime};

use space_api::{CommandState, SandboxState, Timestamp};

pub use crate::platform::DEFAULT_AUTO_PAUSE_S;
use crate::platform::{Doze, Platform};
use crate::store::SandboxRecord;

/// Idleness after which a running sandbox dozes.
pub(crate) const DOZE_AFTER: Duration = Duration::from_secs(2);

/// How long before `now` a time was (`None` if after it).
pub(crate) fn age(at: &Timestamp, now: SystemTime) -> Option<Duration> {
    now.duration_since(at.system_time()).ok()
}

/// Whether the server may pause this sandbox now for idleness, given the
/// threshold and whether a command of it runs.
pub(crate) fn may_auto_pause(record: &SandboxRecord, now: SystemTime, threshold_s: u64, busy: bool) -> bool {
    let sandbox = &record.sandbox;
    threshold_s > 0
        && sandbox.state == SandboxState::Running
        && sandbox.lifecycle.auto_pause != Some(false)
        && !busy
        && age(&sandbox.last_activity_at, now).is_some_and(|idle| idle.as_secs() >= threshold_s)
}

impl Platform {
    /// Whether a command of the sandbox is running.
    pub(crate) fn has_running_commands(&self, id: &str) -> bool {
        self.has_busy_context(id)
            || self
                .store
                .node()
                .commands(id)
                .map(|commands| commands.iter().any(|c| c.state == CommandState::Running))
                .unwrap_or(true)
    }

    /// Tells the engine of a running sandbox that has been idle for
    /// [`DOZE_AFTER`] (`busy`: a command of it runs) that it is, unless a
    /// request holds it now; tells one a restarted server found that is
    /// busy that it is not.
    pub(crate) fn doze_if_idle(&self, record: &SandboxRecord, now: SystemTime, busy: bool) {
        let id = &record.sandbox.id;
        let known = self.dozing.lock().unwrap_or_else(|e| e.into_inner()).get(id).copied();
        let idle = !busy && age(&record.sandbox.last_activity_at, now).is_some_and(|idle| idle >= DOZE_AFTER);
        if !idle {
            if known == Some(Doze::Unknown) {
                self.wake_up(id);
            }
            return;
        }
        if known == Some(Doze::Dozing) || record.sandbox.state != SandboxState::Running {
            return;
        }
        let Some(live) = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned() else { return };
        let Ok(_gate) = live.work.clone().try_write_owned() else { return };
        // What the tick read may be stale: a request may have started a
        // command and let go of the gate since. Under the gate none is half
        // started, so the store is true now.
        let Ok(record) = self.sandbox(id) else { return };
        let still_idle =
            age(&record.sandbox.last_activity_at, SystemTime::now()).is_some_and(|idle| idle >= DOZE_AFTER);
        if record.sandbox.state != SandboxState::Running || !still_idle || self.has_running_commands(id) {
            return;
        }
        self.engine.set_idle(&self.engine_spec(&record), true);
        self.dozing.lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), Doze::Dozing);
    }

    /// Whether the sandbox may be paused for idleness now.
    pub(crate) fn idle_now(&self, record: &SandboxRecord) -> bool {
        let threshold = self.auto_pause_s.load(std::sync::atomic::Ordering::Relaxed);
        may_auto_pause(record, SystemTime::now(), threshold, self.has_running_commands(&record.sandbox.id))
    }
}

#[cfg(test)]
mod tests {
    use space_api::Lifecycle;

    use super::*;

    fn record(state: SandboxState, auto_pause: Option<bool>, active: &str) -> SandboxRecord {
        let lifecycle = Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: None, auto_pause };
        SandboxRecord::sample(state, lifecycle, active, active)
    }

    #[test]
    fn only_idle_running_sandboxes_that_allow_it_are_paused() {
        let now = humantime::parse_rfc3339_weak("2026-01-01T00:10:00Z").unwrap();
        let old = "2026-01-01T00:09:00.000Z";
        let fresh = "2026-01-01T00:09:55.000Z";
        assert!(may_auto_pause(&record(SandboxState::Running, None, old), now, 30, false));
        assert!(!may_auto_pause(&record(SandboxState::Running, None, fresh), now, 30, false), "recently active");
        assert!(!may_auto_pause(&record(SandboxState::Running, None, old), now, 30, true), "a command runs");
        assert!(!may_auto_pause(&record(SandboxState::Running, Some(false), old), now, 30, false), "opted out");
        assert!(!may_auto_pause(&record(SandboxState::Running, None, old), now, 0, false), "turned off");
        assert!(!may_auto_pause(&record(SandboxState::Paused, None, old), now, 30, false), "already paused");
    }
}
