//! Fast create: a warm pool of pre-started, paused sandboxes per template.
//!
//! The fast path is a sandbox that already started: it waits paused
//! (costing memory, not CPU), and a create takes it, thaws it and gives it
//! its identity — its env and fresh entropy; its id and hostname were chosen
//! when it was started. On gVisor a member is booted (a restore is slower
//! than a cold start there); on Firecracker the engine starts every sandbox
//! of a template's default shape as a clone of the template's snapshot, so
//! members are clones sharing the snapshot's memory pages. Pool members are
//! not in the database: a restarted server sweeps them away. The pool
//! refills in the background.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_engine::{AgentConn, SandboxSpec};
use space_host::template::TemplateInfo;

use crate::domain::CreateSpec;
use crate::ids;
use crate::platform::Platform;

/// How long a woken member's agent has to take its identity.
const IDENTITY_PATIENCE: Duration = Duration::from_secs(10);
/// How long a shutdown waits for members that are still starting.
const DRAIN_PATIENCE: Duration = Duration::from_secs(30);

/// A started, paused sandbox waiting to be handed out.
pub(crate) struct WarmMember {
    pub spec: SandboxSpec,
    pub agent: AgentConn,
    template: String,
    version: u32,
}

#[derive(Default)]
pub(crate) struct WarmPools {
    members: Mutex<Vec<WarmMember>>,
    /// Templates being refilled right now.
    filling: Mutex<HashSet<(String, u32)>>,
    /// Set once the pools are drained for shutdown: no member starts after.
    closed: std::sync::atomic::AtomicBool,
}

impl Platform {
    /// Takes a warm member for a create that asks for nothing the member
    /// was not started with (the template's default sizes).
    pub(crate) fn take_warm(self: &Arc<Self>, spec: &CreateSpec, template: &TemplateInfo) -> Option<WarmMember> {
        let defaults = &template.meta.defaults;
        if (spec.vcpus, spec.memory_mib, spec.disk_mib) != (defaults.vcpus, defaults.memory_mib, defaults.disk_mib) {
            return None;
        }
        let version = template.meta.version;
        let taken = {
            let mut members = self.warm.members.lock().unwrap_or_else(|e| e.into_inner());
            let at = members
                .iter()
                .position(|m| m.template == spec.template && m.version == version && !m.agent.is_closed());
            at.map(|at| members.remove(at))
        };
        self.refill_warm(template.clone());
        taken
    }

    /// Wakes a member and gives it its identity.
    pub(crate) async fn hand_out(
        &self,
        member: &WarmMember,
        env: &std::collections::BTreeMap<String, String>,
        trust_pem: Option<&str>,
    ) -> Result<(), String> {
        self.engine.resume(&member.spec).await.map_err(|e| e.to_string())?;
        let identity = space_engine::fresh_identity(env, trust_pem).map_err(|e| e.to_string())?;
        member.agent.set_identity(&identity, IDENTITY_PATIENCE).await.map_err(|e| e.to_string())
    }

    /// Tops the pool of `template` up to its size, in the background.
    pub(crate) fn refill_warm(self: &Arc<Self>, template: TemplateInfo) {
        let size = template.meta.warm_pool.unwrap_or(self.warm_size) as usize;
        // A template whose engine cannot run here gets no warm members.
        if size == 0 || self.engine_for(&template).is_err() || self.warm.closed.load(Ordering::Relaxed) {
            return;
        }
        let key = (template.meta.name.clone(), template.meta.version);
        if !self.warm.filling.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone()) {
            return; // already being refilled
        }
        let platform = self.clone();
        tokio::spawn(async move {
            loop {
                let have = platform
                    .warm
                    .members
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .filter(|m| (m.template.as_str(), m.version) == (key.0.as_str(), key.1))
                    .count();
                if have >= size {
                    break;
                }
                if platform.free_above_reserve() == 0 {
                    tracing::warn!(template = %key.0, "the warm pool stops: the host is low on disk");
                    break;
                }
                if platform.admit(template.meta.defaults.memory_mib).is_err() {
                    tracing::info!(template = %key.0, "the warm pool stops at the host's capacity");
                    break;
                }
                match platform.start_warm(&template).await {
                    // Drained meanwhile (shutdown, or the version was
                    // deleted): nobody would ever destroy this member.
                    Ok(member) if platform.warm.closed.load(Ordering::Relaxed) || !template.dir.exists() => {
                        let _ = platform.engine.destroy(&member.spec).await;
                        break;
                    }
                    Ok(member) => platform.warm.members.lock().unwrap_or_else(|e| e.into_inner()).push(member),
                    Err(err) => {
                        tracing::warn!(template = %key.0, "could not start a warm sandbox: {err}");
                        break;
                    }
                }
            }
            platform.warm.filling.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
        });
    }

    async fn start_warm(&self, template: &TemplateInfo) -> Result<WarmMember, String> {
        let id = ids::new_id("sbx");
        let defaults = &template.meta.defaults;
        let spec = SandboxSpec {
            dir: self.data.sandbox_dir(&id),
            template_rootfs: template.rootfs(),
            hostname: ids::hostname_for(&id),
            vcpus: defaults.vcpus,
            memory_mib: defaults.memory_mib,
            disk_mib: defaults.disk_mib,
            env: Default::default(),
            workdir: Some(defaults.workdir.clone()),
            user: Some(defaults.user.clone()),
            engine: template.meta.engine.clone(),
            trust_pem: None,
            id,
        };
        let started = self.engine.create(&spec).await.map_err(|e| e.to_string())?;
        if let Err(err) = self.engine.pause(&spec).await {
            let _ = self.engine.destroy(&spec).await;
            return Err(err.to_string());
        }
        Ok(WarmMember {
            spec,
            agent: started.agent,
            template: template.meta.name.clone(),
            version: template.meta.version,
        })
    }

    /// Fills every template's pool (at start).
    pub(crate) fn fill_warm_pools(self: &Arc<Self>) {
        for template in self.data.templates() {
            self.refill_warm(template);
        }
    }

    /// Destroys every warm member and starts no more (on shutdown; a
    /// restart would sweep them). Members still starting are waited for:
    /// left behind, their runsc processes would outlive the server.
    pub async fn drain_warm(&self) {
        self.warm.closed.store(true, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + DRAIN_PATIENCE;
        while !self.warm.filling.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.drain_warm_where(|_| true).await;
    }

    /// Memory promised to warm members, in MiB.
    pub(crate) fn warm_reserved_mib(&self) -> u64 {
        let members = self.warm.members.lock().unwrap_or_else(|e| e.into_inner());
        members.iter().map(|m| u64::from(m.spec.memory_mib)).sum()
    }

    /// Destroys the warm members of one template (it is being deleted).
    pub(crate) async fn drain_warm_template(&self, name: &str) {
        self.drain_warm_where(|m| m.template == name).await;
    }

    /// Destroys the warm members of one version of a template.
    pub(crate) async fn drain_warm_version(&self, name: &str, version: u32) {
        self.drain_warm_where(|m| m.template == name && m.version == version).await;
    }

    async fn drain_warm_where(&self, doomed: impl Fn(&WarmMember) -> bool) {
        let members: Vec<WarmMember> = {
            let mut all = self.warm.members.lock().unwrap_or_else(|e| e.into_inner());
            let (theirs, others): (Vec<_>, Vec<_>) = std::mem::take(&mut *all).into_iter().partition(|m| doomed(m));
            *all = others;
            theirs
        };
        for member in members {
            let _ = self.engine.destroy(&member.spec).await;
        }
    }

    /// How many warm sandboxes wait now.
    pub fn warm_count(&self) -> usize {
        self.warm.members.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}
