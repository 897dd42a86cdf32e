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
//!
//! The pools know nothing of `Platform`: a refill asks its host
//! ([`WarmHost`]) only for room and a directory.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_engine::{AgentConn, Engine, SandboxSpec};
use space_host::template::TemplateInfo;

use crate::domain::CreateSpec;
use crate::ids;

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

impl WarmMember {
    /// Wakes the member and gives it its identity.
    pub(crate) async fn hand_out(
        &self,
        engine: &dyn Engine,
        env: &std::collections::BTreeMap<String, String>,
        trust_pem: Option<&str>,
    ) -> Result<(), String> {
        engine.resume(&self.spec).await.map_err(|e| e.to_string())?;
        let identity = space_engine::fresh_identity(env, trust_pem).map_err(|e| e.to_string())?;
        self.agent.set_identity(&identity, IDENTITY_PATIENCE).await.map_err(|e| e.to_string())
    }
}

/// What the pools need of the host they run on; all a refill may ask.
pub(crate) trait WarmHost: Send + Sync + 'static {
    fn warm(&self) -> &WarmPools;
    /// Where a sandbox with this id keeps its state.
    fn sandbox_dir(&self, id: &str) -> PathBuf;
    /// Whether this host can run the template's engine at all.
    fn runs(&self, template: &TemplateInfo) -> bool;
    /// Why one more member of `template` may not start now (memory, disk).
    fn no_room_for(&self, template: &TemplateInfo) -> Option<String>;
    /// Starts a member (booted, or woken from a snapshot template's image)
    /// and returns its healthy agent; on error nothing of it is left.
    fn boot(&self, spec: &SandboxSpec) -> impl std::future::Future<Output = Result<AgentConn, String>> + Send;
}

/// The warm pools of every template on this host.
pub struct WarmPools {
    engine: Arc<dyn Engine>,
    /// Members kept per template unless it says otherwise (0: cold starts).
    size: u32,
    members: Mutex<Vec<WarmMember>>,
    /// Templates being refilled right now.
    filling: Mutex<HashSet<(String, u32)>>,
    /// Set once the pools are drained for shutdown: no member starts after.
    closed: std::sync::atomic::AtomicBool,
}

impl WarmPools {
    pub(crate) fn new(engine: Arc<dyn Engine>, size: u32) -> WarmPools {
        WarmPools { engine, size, members: Mutex::default(), filling: Mutex::default(), closed: Default::default() }
    }

    fn held(&self, key: &(String, u32)) -> usize {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        members.iter().filter(|m| (m.template.as_str(), m.version) == (key.0.as_str(), key.1)).count()
    }

    async fn start<H: WarmHost>(
        &self,
        host: &H,
        dir: PathBuf,
        id: String,
        template: &TemplateInfo,
    ) -> Result<WarmMember, String> {
        let defaults = &template.meta.defaults;
        let spec = SandboxSpec {
            dir,
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
        let agent = host.boot(&spec).await?;
        if let Err(err) = self.engine.pause(&spec).await {
            let _ = self.engine.destroy(&spec).await;
            return Err(err.to_string());
        }
        Ok(WarmMember { spec, agent, template: template.meta.name.clone(), version: template.meta.version })
    }

    /// Destroys every member and starts no more (on shutdown; a restart
    /// would sweep them). Members still starting are waited for: left
    /// behind, their runsc processes would outlive the server.
    pub async fn drain(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + DRAIN_PATIENCE;
        while !self.filling.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.drain_where(|_| true).await;
    }

    /// Memory promised to members, in MiB.
    pub(crate) fn reserved_mib(&self) -> u64 {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        members.iter().map(|m| u64::from(m.spec.memory_mib)).sum()
    }

    /// Destroys the members of one template (it is being deleted).
    pub(crate) async fn drain_template(&self, name: &str) {
        self.drain_where(|m| m.template == name).await;
    }

    /// Destroys the members of one version of a template.
    pub(crate) async fn drain_version(&self, name: &str, version: u32) {
        self.drain_where(|m| m.template == name && m.version == version).await;
    }

    async fn drain_where(&self, doomed: impl Fn(&WarmMember) -> bool) {
        let members: Vec<WarmMember> = {
            let mut all = self.members.lock().unwrap_or_else(|e| e.into_inner());
            let (theirs, others): (Vec<_>, Vec<_>) = std::mem::take(&mut *all).into_iter().partition(|m| doomed(m));
            *all = others;
            theirs
        };
        for member in members {
            let _ = self.engine.destroy(&member.spec).await;
        }
    }

    /// How many members wait now.
    pub fn count(&self) -> usize {
        self.members.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Takes a member for a create that asks for nothing the member was not
/// started with (the template's default sizes), and refills behind it.
pub(crate) fn take<H: WarmHost>(host: &Arc<H>, spec: &CreateSpec, template: &TemplateInfo) -> Option<WarmMember> {
    let defaults = &template.meta.defaults;
    if (spec.vcpus, spec.memory_mib, spec.disk_mib) != (defaults.vcpus, defaults.memory_mib, defaults.disk_mib) {
        return None;
    }
    let version = template.meta.version;
    let taken = {
        let mut members = host.warm().members.lock().unwrap_or_else(|e| e.into_inner());
        let at =
            members.iter().position(|m| m.template == spec.template && m.version == version && !m.agent.is_closed());
        at.map(|at| members.remove(at))
    };
    refill(host, template.clone());
    taken
}

/// Tops the pool of `template` up to its size, in the background.
pub(crate) fn refill<H: WarmHost>(host: &Arc<H>, template: TemplateInfo) {
    let pools = host.warm();
    let size = template.meta.warm_pool.unwrap_or(pools.size) as usize;
    // A template whose engine cannot run here gets no warm members.
    if size == 0 || !host.runs(&template) || pools.closed.load(Ordering::Relaxed) {
        return;
    }
    let key = (template.meta.name.clone(), template.meta.version);
    if !pools.filling.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone()) {
        return; // already being refilled
    }
    let host = host.clone();
    tokio::spawn(async move {
        let pools = host.warm();
        while pools.held(&key) < size {
            if let Some(why) = host.no_room_for(&template) {
                tracing::info!(template = %key.0, "the warm pool stops: {why}");
                break;
            }
            let id = ids::new_id("sbx");
            match pools.start(host.as_ref(), host.sandbox_dir(&id), id, &template).await {
                // Drained meanwhile (shutdown, or the version was deleted):
                // nobody would ever destroy this member.
                Ok(member) if pools.closed.load(Ordering::Relaxed) || !template.dir.exists() => {
                    let _ = pools.engine.destroy(&member.spec).await;
                    break;
                }
                Ok(member) => pools.members.lock().unwrap_or_else(|e| e.into_inner()).push(member),
                Err(err) => {
                    tracing::warn!(template = %key.0, "could not start a warm sandbox: {err}");
                    break;
                }
            }
        }
        pools.filling.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
    });
}
