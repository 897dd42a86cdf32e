//! Fast create: pools of pre-started sandboxes per template.
//!
//! The fast path is a sandbox that already started. Most members wait
//! paused (*warm*: costing memory, not CPU) and a create takes one, thaws
//! it and gives it its identity — its env and fresh entropy; its id and
//! hostname were chosen when it was started. In front of them a few
//! members wait running (*hot*) with their agent connected, so a create is
//! only that identity hand-off over the open channel. They wait dozing
//! (their engine told they are idle: under gVisor ≈ 0.3 % of a core each
//! instead of ≈ 3.5 %) and are woken as they are handed out. A hot member taken is replaced by thawing a warm one,
//! and the warm one by a new start. A member is handed out once, never
//! back. On gVisor a member is booted (a restore is slower
//! than a cold start there); on Firecracker the engine starts every sandbox
//! of a template's default shape as a clone of the template's snapshot, so
//! members are clones sharing the snapshot's memory pages. Pool members are
//! not in the database: a restarted server sweeps them away. The pool
//! refills in the background, in tasks the pools hold: a drain (at
//! shutdown) lets each finish the member it is starting and waits for it.
//!
//! The pools know nothing of `Platform`: a refill asks its host
//! ([`WarmHost`]) only for room and a directory.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_engine::{AgentConn, AgentError, Engine, EngineError, SandboxSpec};
use space_host::template::TemplateInfo;
use tokio::task::JoinSet;

use crate::domain::CreateSpec;
use crate::ids;
use crate::store::EgressCa;

/// How long a woken member's agent has to take its identity.
const IDENTITY_PATIENCE: Duration = Duration::from_secs(10);
/// How long a shutdown waits for members that are still starting.
const DRAIN_PATIENCE: Duration = Duration::from_secs(30);

/// How many members of each kind a template keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolSizes {
    /// Paused members.
    pub warm: u32,
    /// Running members, in front of the paused ones.
    pub hot: u32,
}

/// Where a member stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Paused and frozen.
    Paused,
    /// Being thawed to become hot: not to be taken meanwhile.
    Waking,
    /// Running, its agent connected.
    Hot,
}

/// A started sandbox waiting to be handed out.
pub(crate) struct WarmMember {
    pub spec: SandboxSpec,
    pub agent: AgentConn,
    /// Its egress CA, made when it started (the agent has trusted the
    /// certificate since): the create that takes the member keeps it.
    pub egress_ca: Option<EgressCa>,
    template: String,
    version: u32,
    standing: Standing,
}

impl WarmMember {
    /// Whether it runs already (a hot member): no thaw on hand-out.
    pub(crate) fn is_hot(&self) -> bool {
        self.standing == Standing::Hot
    }

    /// Wakes the member (unless it runs) and gives it its identity; the
    /// CA certificate goes along only if the agent does not trust it yet.
    pub(crate) async fn hand_out(
        &self,
        engine: &dyn Engine,
        env: &std::collections::BTreeMap<String, String>,
        trust_pem: Option<&str>,
    ) -> Result<(), WarmError> {
        if self.is_hot() {
            engine.set_idle(&self.spec, false);
        } else {
            engine.resume(&self.spec).await.map_err(WarmError::Thaw)?;
        }
        let trust_pem = trust_pem.filter(|pem| self.spec.trust_pem.as_deref() != Some(*pem));
        let identity = space_engine::fresh_identity(env, trust_pem).map_err(WarmError::Identity)?;
        self.agent.set_identity(&identity, IDENTITY_PATIENCE).await.map_err(WarmError::SetIdentity)
    }
}

/// Why a warm member could not be started or handed out.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WarmError {
    /// Its egress CA could not be made (the detail is logged where made).
    #[error("{}", .0.message)]
    EgressCa(crate::error::NodeError),
    #[error(transparent)]
    Boot(EngineError),
    #[error("freezing it: {0}")]
    Freeze(#[source] EngineError),
    #[error("thawing it: {0}")]
    Thaw(#[source] EngineError),
    #[error("giving it a fresh identity: {0}")]
    Identity(#[source] EngineError),
    #[error("giving it a fresh identity: {0}")]
    SetIdentity(#[source] AgentError),
}

/// What the pools need of the host they run on; all a refill may ask.
pub(crate) trait WarmHost: Send + Sync + 'static {
    fn warm(&self) -> &WarmPools;
    /// Where a sandbox with this id keeps its state.
    fn sandbox_dir(&self, id: &str) -> PathBuf;
    /// A new egress CA for the sandbox with this id.
    fn new_egress_ca(&self, id: &str) -> Result<EgressCa, WarmError>;
    /// Whether this host can run the template's engine at all.
    fn runs(&self, template: &TemplateInfo) -> bool;
    /// Why one more member of `template` may not start now (memory, disk).
    fn no_room_for(&self, template: &TemplateInfo) -> Option<String>;
    /// Starts a member (booted, or woken from a snapshot template's image)
    /// and returns its healthy agent; on error nothing of it is left.
    fn boot(&self, spec: &SandboxSpec) -> impl std::future::Future<Output = Result<AgentConn, EngineError>> + Send;
}

/// The pools of every template on this host.
pub struct WarmPools {
    engine: Arc<dyn Engine>,
    /// Members kept per template unless it says otherwise (0: cold starts).
    sizes: PoolSizes,
    members: Mutex<Vec<WarmMember>>,
    /// Templates being refilled right now.
    filling: Mutex<HashSet<(String, u32)>>,
    /// The refills, and the destruction of members taken but not handed
    /// out, running now.
    tasks: Mutex<JoinSet<()>>,
    /// Set once the pools are closed for shutdown: no member starts after.
    closed: std::sync::atomic::AtomicBool,
}

impl WarmPools {
    pub(crate) fn new(engine: Arc<dyn Engine>, sizes: PoolSizes) -> WarmPools {
        WarmPools {
            engine,
            sizes,
            members: Mutex::default(),
            filling: Mutex::default(),
            tasks: Mutex::default(),
            closed: Default::default(),
        }
    }

    /// Runs `task` among the pools' tasks, unless they are closed.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock a drain takes the tasks with: it waits for this
        // one, or it never starts.
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        while tasks.try_join_next().is_some() {}
        tasks.spawn(task);
    }

    /// The sizes `template` keeps: its own, else the server's.
    fn sizes_of(&self, template: &TemplateInfo) -> PoolSizes {
        PoolSizes {
            warm: template.meta.warm_pool.unwrap_or(self.sizes.warm),
            hot: template.meta.hot_pool.unwrap_or(self.sizes.hot),
        }
    }

    /// Members of `key` held now: (paused or waking, hot).
    fn held(&self, key: &(String, u32)) -> (usize, usize) {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        let theirs = members.iter().filter(|m| (m.template.as_str(), m.version) == (key.0.as_str(), key.1));
        theirs.fold((0, 0), |(warm, hot), m| if m.is_hot() { (warm, hot + 1) } else { (warm + 1, hot) })
    }

    /// Marks a paused member of `key` as waking and returns its spec.
    fn pick_to_wake(&self, key: &(String, u32)) -> Option<SandboxSpec> {
        let mut members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        let member = members
            .iter_mut()
            .find(|m| (m.template.as_str(), m.version) == (key.0.as_str(), key.1) && m.standing == Standing::Paused)?;
        member.standing = Standing::Waking;
        Some(member.spec.clone())
    }

    /// A waking member is hot now, or (it failed to thaw) gone.
    async fn woken(&self, spec: &SandboxSpec, thawed: bool) {
        if thawed {
            // Before it can be taken (and woken by its hand-out), and off
            // the lock every create takes.
            self.engine.set_idle(spec, true);
        }
        let failed = {
            let mut members = self.members.lock().unwrap_or_else(|e| e.into_inner());
            let at = members.iter().position(|m| m.spec.id == spec.id);
            match at {
                Some(at) if thawed => {
                    members[at].standing = Standing::Hot;
                    None
                }
                Some(at) => Some(members.remove(at)),
                None => None, // drained meanwhile
            }
        };
        if let Some(member) = failed {
            let _ = self.engine.destroy(&member.spec).await;
        }
    }

    /// Destroys members whose sandbox died while they waited.
    async fn purge_dead(&self) {
        self.drain_where(|m| m.agent.is_closed()).await;
    }

    async fn start<H: WarmHost>(
        &self,
        host: &H,
        dir: PathBuf,
        id: String,
        template: &TemplateInfo,
        hot: bool,
    ) -> Result<WarmMember, WarmError> {
        let defaults = &template.meta.defaults;
        // Made now, trusted from the start: not on the create's path.
        let egress_ca = host.new_egress_ca(&id)?;
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
            trust_pem: Some(egress_ca.cert_pem.clone()),
            volumes: Vec::new(),
            id,
        };
        let agent = host.boot(&spec).await.map_err(WarmError::Boot)?;
        if hot {
            self.engine.set_idle(&spec, true);
        } else {
            if let Err(err) = self.engine.pause(&spec).await {
                let _ = self.engine.destroy(&spec).await;
                return Err(WarmError::Freeze(err));
            }
        }
        let standing = if hot { Standing::Hot } else { Standing::Paused };
        Ok(WarmMember {
            spec,
            agent,
            egress_ca: Some(egress_ca),
            template: template.meta.name.clone(),
            version: template.meta.version,
            standing,
        })
    }

    /// Starts no more members: a refill ends once the member it is
    /// starting has started (and is destroyed).
    pub fn close(&self) {
        let _tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Destroys every member and starts no more (on shutdown; a restart
    /// would sweep them). Members still starting are waited for (up to
    /// [`DRAIN_PATIENCE`], then their refills are aborted): left behind,
    /// their runsc processes would outlive the server.
    pub async fn drain(&self) {
        self.close();
        let mut tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        let all_ended = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(DRAIN_PATIENCE, all_ended).await.is_err() {
            tracing::warn!(refills = tasks.len(), "warm members still started {DRAIN_PATIENCE:?} into the shutdown");
            tasks.shutdown().await;
        }
        self.drain_where(|_| true).await;
    }

    /// Refills and discards running now.
    pub(crate) fn tasks_running(&self) -> usize {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        while tasks.try_join_next().is_some() {}
        tasks.len()
    }

    /// Memory promised to members, in MiB.
    pub(crate) fn reserved_mib(&self) -> u64 {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        members.iter().map(|m| u64::from(m.spec.memory_mib)).sum()
    }

    /// Destroys a member that was taken but will not be handed out.
    pub(crate) fn discard(&self, member: WarmMember) {
        let engine = self.engine.clone();
        let destroy = async move {
            let _ = engine.destroy(&member.spec).await;
        };
        // Also once the pools are closed: nothing else would destroy it.
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        while tasks.try_join_next().is_some() {}
        tasks.spawn(destroy);
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

    /// How many members wait now, hot or paused.
    pub fn count(&self) -> usize {
        self.members.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Every member's id and whether it waits running (hot).
    pub fn members(&self) -> Vec<(String, bool)> {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        members.iter().map(|m| (m.spec.id.clone(), m.is_hot())).collect()
    }

    /// How many members wait running.
    pub fn hot_count(&self) -> usize {
        self.members.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|m| m.is_hot()).count()
    }

    /// The CPU time the members waiting running have used so far, summed
    /// (what keeping them hot costs), and how many they are.
    pub fn hot_cpu(&self) -> (usize, Duration) {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        let hot: Vec<&WarmMember> = members.iter().filter(|m| m.is_hot()).collect();
        let usec: u64 = hot.iter().filter_map(|m| self.engine.resource_use(&m.spec)).map(|u| u.cpu_usec).sum();
        (hot.len(), Duration::from_micros(usec))
    }
}

/// Takes a member for a create that asks for nothing the member was not
/// started with (the template's default sizes), a hot one first, and
/// refills behind it.
pub(crate) fn take<H: WarmHost>(host: &Arc<H>, spec: &CreateSpec, template: &TemplateInfo) -> Option<WarmMember> {
    let defaults = &template.meta.defaults;
    if (spec.vcpus, spec.memory_mib, spec.disk_mib) != (defaults.vcpus, defaults.memory_mib, defaults.disk_mib) {
        return None;
    }
    // A member was started without mounts: a sandbox with volumes starts cold.
    if !spec.volumes.is_empty() {
        return None;
    }
    let version = template.meta.version;
    let taken = {
        let mut members = host.warm().members.lock().unwrap_or_else(|e| e.into_inner());
        let usable = |m: &WarmMember| m.template == spec.template && m.version == version && !m.agent.is_closed();
        let at = members
            .iter()
            .position(|m| usable(m) && m.is_hot())
            .or_else(|| members.iter().position(|m| usable(m) && m.standing == Standing::Paused));
        at.map(|at| members.remove(at))
    };
    refill(host, template.clone());
    taken
}

/// Tops the pool of `template` up to its sizes, in the background: hot
/// members first (a paused one thawed, else a new one started), then
/// paused ones.
pub(crate) fn refill<H: WarmHost>(host: &Arc<H>, template: TemplateInfo) {
    let pools = host.warm();
    let sizes = pools.sizes_of(&template);
    // A template whose engine cannot run here gets no members.
    if sizes == PoolSizes::default() || !host.runs(&template) || pools.closed.load(Ordering::Relaxed) {
        return;
    }
    let key = (template.meta.name.clone(), template.meta.version);
    if !pools.filling.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone()) {
        return; // already being refilled
    }
    let refilling = host.clone();
    pools.spawn(async move {
        let host = refilling;
        let pools = host.warm();
        pools.purge_dead().await;
        loop {
            let (warm, hot) = pools.held(&key);
            let hot_short = hot < sizes.hot as usize;
            if !hot_short && warm >= sizes.warm as usize || pools.closed.load(Ordering::Relaxed) {
                break;
            }
            if hot_short {
                if let Some(spec) = pools.pick_to_wake(&key) {
                    let thawed = pools.engine.resume(&spec).await;
                    if let Err(err) = &thawed {
                        tracing::warn!(template = %key.0, "could not thaw a warm sandbox: {err}");
                    }
                    pools.woken(&spec, thawed.is_ok()).await;
                    continue;
                }
            }
            if let Some(why) = host.no_room_for(&template) {
                tracing::info!(template = %key.0, "the warm pool stops: {why}");
                break;
            }
            let id = ids::new_id("sbx");
            match pools.start(host.as_ref(), host.sandbox_dir(&id), id, &template, hot_short).await {
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
