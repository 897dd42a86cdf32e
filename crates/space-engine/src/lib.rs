//! Isolation engines behind one trait.
//!
//! An [`Engine`] turns a [`SandboxSpec`] into a running sandbox whose agent
//! has dialed home and answered a health check, and tears it down again. The
//! rest of the platform only ever sees the trait and an [`AgentConn`]; it never
//! learns which engine runs a sandbox.
//!
//! Engines own their processes, sockets and on-disk formats. They do not
//! persist state, enforce API rules or know about tenants.

pub mod agent;
#[cfg(feature = "testing")]
pub mod fake;
pub mod firecracker;
pub mod gvisor;
pub mod helper;
pub mod host;
pub mod oom_relief;
pub mod templates;
pub mod volumes;

/// The request set whose types [`host::EngineHost`] speaks.
pub use space_privsep as privsep;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

pub use agent::{
    AgentConn, AgentError, EgressHandler, EgressStream, ExecEvent, ExecStream, FileRead, FileStream, FileUpload,
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("preparing the sandbox: {0}")]
    Host(#[from] space_host::HostError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the engine failed: {0}")]
    Runtime(String),
    #[error("the agent did not come up: {0}")]
    Agent(#[from] AgentError),
}

impl EngineError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> EngineError {
        let what = what.into();
        move |source| EngineError::Io { what, source }
    }
}

/// Everything an engine needs to start one sandbox.
#[derive(Debug, Clone, Default)]
pub struct SandboxSpec {
    pub id: String,
    /// The sandbox's own directory (created by the engine, removed on destroy).
    pub dir: PathBuf,
    /// The template root to copy (read-only).
    pub template_rootfs: PathBuf,
    pub hostname: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    /// The sandbox-wide environment handed to every command.
    pub env: BTreeMap<String, String>,
    /// The template's defaults for commands that name no cwd or user.
    pub workdir: Option<String>,
    pub user: Option<String>,
    /// The engine that runs it (`None`: the server's default), for
    /// [`Engines`] to dispatch on.
    pub engine: Option<String>,
    /// The sandbox's egress CA (PEM), which its programs trust.
    pub trust_pem: Option<String>,
    /// Volumes bound into it (issue 37): checked by the platform, and by
    /// the helper again.
    pub volumes: Vec<VolumeMountSpec>,
}

/// One volume bound into a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMountSpec {
    /// The volume's id (`vol_…`).
    pub volume: String,
    /// An absolute path inside the sandbox.
    pub path: String,
    pub read_only: bool,
}

/// How long a redial waits for the agent to dial in.
pub const REDIAL_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The host's end of a sandbox's agent socket, listening; the socket file
/// goes when it is dropped, so nobody connects once the agent is in.
pub struct AgentListener {
    listener: tokio::net::UnixListener,
    close: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl AgentListener {
    /// Listening at `path`, which is removed when it is dropped.
    pub fn new(listener: tokio::net::UnixListener, path: std::path::PathBuf) -> AgentListener {
        AgentListener::closing(listener, move || {
            let _ = std::fs::remove_file(&path);
        })
    }

    /// Listening until dropped, when `close` removes the socket (an engine
    /// whose host owns the socket's path asks it to).
    pub fn closing(listener: tokio::net::UnixListener, close: impl FnOnce() + Send + Sync + 'static) -> AgentListener {
        AgentListener { listener, close: Some(Box::new(close)) }
    }

    /// The next connection, whoever made it.
    pub async fn accept(&self) -> Result<tokio::net::UnixStream, EngineError> {
        self.listener.accept().await.map(|(socket, _)| socket).map_err(EngineError::io("accepting the agent"))
    }

    /// The first connection within [`REDIAL_PATIENCE`].
    pub async fn accept_one(self) -> Result<tokio::net::UnixStream, EngineError> {
        tokio::time::timeout(REDIAL_PATIENCE, self.accept())
            .await
            .map_err(|_| EngineError::Runtime(format!("the agent did not redial within {REDIAL_PATIENCE:?}")))?
    }
}

impl Drop for AgentListener {
    fn drop(&mut self) {
        if let Some(close) = self.close.take() {
            close();
        }
    }
}

/// Counters of a cgroup: CPU time used so far and memory in use now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceUse {
    pub cpu_usec: u64,
    pub memory_bytes: u64,
}

/// Reads a cgroup's counters: `relative` under the v2 hierarchy, or under
/// v1's `memory` and `cpuacct` controllers.
pub fn cgroup_use(relative: &std::path::Path) -> Option<ResourceUse> {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let read = |path: std::path::PathBuf| std::fs::read_to_string(path).ok();
    let v2 = root.join(relative);
    if let Some(memory) = read(v2.join("memory.current")) {
        let cpu = read(v2.join("cpu.stat")).unwrap_or_default();
        let cpu_usec = cpu.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|v| v.trim().parse().ok());
        return Some(ResourceUse { cpu_usec: cpu_usec.unwrap_or(0), memory_bytes: memory.trim().parse().ok()? });
    }
    let memory = read(root.join("memory").join(relative).join("memory.usage_in_bytes"))?;
    let cpu_ns: u64 = read(root.join("cpuacct").join(relative).join("cpuacct.usage"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some(ResourceUse { cpu_usec: cpu_ns / 1000, memory_bytes: memory.trim().parse().ok()? })
}

/// The identity a sandbox's agent receives when it dials in. The session
/// is fresh for every new host-side connection.
pub fn welcome_for(spec: &SandboxSpec) -> space_proto::Welcome {
    let mut session = [0u8; 8];
    // Any value will do if the kernel's random source fails: it only needs
    // to differ from the previous session's.
    let _ = getrandom::getrandom(&mut session);
    space_proto::Welcome {
        protocol_version: space_proto::PROTOCOL_VERSION,
        sandbox_id: spec.id.clone(),
        hostname: spec.hostname.clone(),
        env: spec.env.clone(),
        workdir: spec.workdir.clone(),
        user: spec.user.clone(),
        memory_mib: (spec.memory_mib > 0).then_some(spec.memory_mib),
        session: u64::from_le_bytes(session) | 1,
        clock_unix_ms: None,
        channel_key: None,
        trust_pem: spec.trust_pem.clone(),
        volumes: Vec::new(),
    }
}

/// What a sandbox that started as a copy of another (a warm member, a
/// clone of a template snapshot) becomes: `env`, and fresh entropy.
pub fn fresh_identity(
    env: &BTreeMap<String, String>,
    trust_pem: Option<&str>,
) -> Result<space_proto::Identity, EngineError> {
    let mut entropy = [0u8; 32];
    getrandom::getrandom(&mut entropy).map_err(|e| EngineError::Runtime(format!("no random bytes: {e}")))?;
    Ok(space_proto::Identity {
        env: env.clone(),
        entropy_hex: entropy.iter().map(|b| format!("{b:02x}")).collect(),
        trust_pem: trust_pem.map(str::to_string),
    })
}

/// A started sandbox: its agent has said hello and answered a ping.
pub struct Started {
    pub agent: AgentConn,
    /// Time from starting the engine's process to the agent dialing home.
    pub boot: std::time::Duration,
    /// How long each step of the start took, in order (empty when the
    /// engine does not tell).
    pub steps: Steps,
}

/// Steps of an engine's work and how long each took, in order.
pub type Steps = Vec<(&'static str, std::time::Duration)>;

/// What the engine knows of a sandbox's processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveStatus {
    Running,
    Paused,
    /// No live engine process (never started, stopped, or died).
    Gone,
}

/// Availability of an engine on this host, and why.
#[derive(Debug, Clone)]
pub struct Availability {
    pub name: &'static str,
    pub available: bool,
    pub detail: String,
}

fn spec_engine(spec: &SandboxSpec) -> &str {
    spec.engine.as_deref().unwrap_or("default")
}

#[async_trait::async_trait]
pub trait Engine: Send + Sync {
    /// `gvisor` or `firecracker`.
    fn name(&self) -> &'static str;

    /// Whether this host can run the engine.
    fn availability(&self) -> Availability;

    /// Starts a sandbox and returns once its agent is healthy. On error,
    /// everything this call created is gone again.
    async fn create(&self, spec: &SandboxSpec) -> Result<Started, EngineError>;

    /// Freezes every process of the sandbox; its memory stays resident.
    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError>;

    /// Thaws a paused sandbox.
    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError>;

    /// Snapshots a running sandbox to its directory (memory, processes,
    /// open files; its disk is already there) and stops it: afterwards no
    /// engine process of it exists. Its agent must have been quiesced.
    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError>;

    /// Starts a suspended sandbox from its snapshot and returns the socket
    /// its agent dialed from inside (before any handshake).
    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError>;

    /// Whether a whole snapshot of the sandbox exists.
    fn has_snapshot(&self, spec: &SandboxSpec) -> bool;

    /// Whether this engine can save a live sandbox as an image (forks).
    fn saves_images(&self, _spec: &SandboxSpec) -> bool {
        false
    }

    /// Saves the sandbox's memory, processes and disk at one instant into
    /// `image` (a directory it creates) and leaves the sandbox running as
    /// it was. Its agent must have been quiesced. Returns how long the
    /// sandbox was frozen.
    async fn save_image(&self, spec: &SandboxSpec, _image: &std::path::Path) -> Result<Duration, EngineError> {
        Err(EngineError::Runtime(format!("the {} engine cannot save a sandbox as an image", spec_engine(spec))))
    }

    /// Removes an image [`Engine::save_image`] wrote under `spec`'s sandbox
    /// (a fork's, a checkpoint's), whole or half written; one not there is
    /// no error. By default in this process.
    async fn drop_image(&self, _spec: &SandboxSpec, image: &std::path::Path) -> Result<(), EngineError> {
        let image = image.to_path_buf();
        tokio::task::spawn_blocking(move || space_host::btrfs::remove_tree(&image))
            .await
            .map_err(|err| EngineError::Runtime(format!("removing an image: {err}")))?
            .map_err(|err| EngineError::Runtime(format!("removing an image: {err}")))
    }

    /// Starts sandbox `spec` from an image [`Engine::save_image`] wrote:
    /// its own writable copy of the image's disk and the image's memory.
    /// Returns the socket its agent dialed (before any handshake); the
    /// agent greets as the image's sandbox until a welcome names this one.
    async fn start_from_image(
        &self,
        spec: &SandboxSpec,
        _image: &std::path::Path,
    ) -> Result<tokio::net::UnixStream, EngineError> {
        Err(EngineError::Runtime(format!("the {} engine cannot start a sandbox from an image", spec_engine(spec))))
    }

    /// Why the sandbox's engine stopped, when the host's limits tell (asked
    /// after it stopped unexpectedly): over its memory, or its task limit.
    fn stop_reason(&self, _spec: &SandboxSpec) -> Option<&'static str> {
        None
    }

    /// What the sandbox's engine processes use now, from their cgroup;
    /// None if the engine keeps them in no cgroup of their own.
    fn resource_use(&self, _spec: &SandboxSpec) -> Option<ResourceUse> {
        None
    }

    /// Tells the engine whether the sandbox is idle (no command, no
    /// request): an engine whose idle sandboxes still cost CPU may make
    /// them cheaper while they are (gVisor: coarse timers, see
    /// `gvisor::set_timer_slack`), and must undo it when told they are
    /// not. Cheap; errors are the engine's to log.
    fn set_idle(&self, _spec: &SandboxSpec, _idle: bool) {}

    /// Whether the sandbox's engine processes are alive, and how.
    /// Blocking: call it off the async threads.
    fn status(&self, spec: &SandboxSpec) -> LiveStatus;

    /// [`Engine::status`] of each of `specs`, in their order: engines that
    /// can tell them all at once (one process instead of one each: a
    /// restarted server asks for every live sandbox) do so.
    fn statuses(&self, specs: &[SandboxSpec]) -> Vec<LiveStatus> {
        specs.iter().map(|spec| self.status(spec)).collect()
    }

    /// Listens on the sandbox's agent socket again (its agent redials when
    /// its channel drops): how a restarted server re-adopts a live sandbox,
    /// and where a restore listens again when someone other than the agent
    /// dialed first.
    async fn redial(&self, spec: &SandboxSpec) -> Result<AgentListener, EngineError>;

    /// Stops the sandbox's processes, keeping its disk and snapshot.
    /// Blocking: call it off the async threads.
    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError>;

    /// Kills whatever engine process still works on the sandbox without an
    /// owner: a killed server's `runsc run` of a create it had begun goes
    /// on and would make the container after a new server cleared it.
    /// Call before clearing what a previous server process left. Blocking.
    fn stop_strays(&self, _spec: &SandboxSpec) {}

    /// Puts right what a killed server may have left half done to a
    /// sandbox its engine shows running, so that its agent can dial in:
    /// gVisor thaws its cgroup if it is frozen (the server freezes only
    /// sandboxes runsc shows paused). Returns what it put right, if
    /// anything. Blocking.
    fn settle_running(&self, _spec: &SandboxSpec) -> Option<String> {
        None
    }

    /// Waits (up to `patience`, then kills them) for the engine commands a
    /// killed server left running on sandboxes `ids` — a `runsc
    /// checkpoint`, `run` or `restore` goes on without it — so that what a
    /// restarted server reads of them no longer moves. Blocking.
    fn settle_orphans(&self, _ids: &[String], _patience: std::time::Duration) {}

    /// Stops the sandbox and frees all it held (processes, mounts, disk).
    /// Idempotent: destroying what is already gone succeeds.
    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError>;
}

/// Every engine this server runs, dispatched per sandbox by
/// [`SandboxSpec::engine`] (the default one when it names none), so a
/// template can choose its engine while the rest of the platform sees one
/// [`Engine`].
pub struct Engines {
    default: std::sync::Arc<dyn Engine>,
    others: Vec<std::sync::Arc<dyn Engine>>,
}

impl Engines {
    pub fn new(default: std::sync::Arc<dyn Engine>, others: Vec<std::sync::Arc<dyn Engine>>) -> Engines {
        Engines { default, others }
    }

    fn pick(&self, spec: &SandboxSpec) -> &std::sync::Arc<dyn Engine> {
        match spec.engine.as_deref() {
            Some(name) if name != self.default.name() => {
                self.others.iter().find(|engine| engine.name() == name).unwrap_or(&self.default)
            }
            _ => &self.default,
        }
    }
}

#[async_trait::async_trait]
impl Engine for Engines {
    fn name(&self) -> &'static str {
        self.default.name()
    }

    fn availability(&self) -> Availability {
        self.default.availability()
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        self.pick(spec).create(spec).await
    }

    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.pick(spec).pause(spec).await
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.pick(spec).resume(spec).await
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.pick(spec).suspend(spec).await
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        self.pick(spec).restore(spec).await
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        self.pick(spec).has_snapshot(spec)
    }

    fn saves_images(&self, spec: &SandboxSpec) -> bool {
        self.pick(spec).saves_images(spec)
    }

    async fn save_image(&self, spec: &SandboxSpec, image: &std::path::Path) -> Result<Duration, EngineError> {
        self.pick(spec).save_image(spec, image).await
    }

    async fn drop_image(&self, spec: &SandboxSpec, image: &std::path::Path) -> Result<(), EngineError> {
        self.pick(spec).drop_image(spec, image).await
    }

    async fn start_from_image(
        &self,
        spec: &SandboxSpec,
        image: &std::path::Path,
    ) -> Result<tokio::net::UnixStream, EngineError> {
        self.pick(spec).start_from_image(spec, image).await
    }

    fn stop_reason(&self, spec: &SandboxSpec) -> Option<&'static str> {
        self.pick(spec).stop_reason(spec)
    }

    fn resource_use(&self, spec: &SandboxSpec) -> Option<ResourceUse> {
        self.pick(spec).resource_use(spec)
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        self.pick(spec).status(spec)
    }

    fn statuses(&self, specs: &[SandboxSpec]) -> Vec<LiveStatus> {
        let mut found = vec![LiveStatus::Gone; specs.len()];
        for engine in std::iter::once(&self.default).chain(&self.others) {
            let mine: Vec<usize> =
                (0..specs.len()).filter(|&i| std::sync::Arc::ptr_eq(self.pick(&specs[i]), engine)).collect();
            if mine.is_empty() {
                continue;
            }
            let asked: Vec<SandboxSpec> = mine.iter().map(|&i| specs[i].clone()).collect();
            for (i, status) in mine.into_iter().zip(engine.statuses(&asked)) {
                found[i] = status;
            }
        }
        found
    }

    async fn redial(&self, spec: &SandboxSpec) -> Result<AgentListener, EngineError> {
        self.pick(spec).redial(spec).await
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.pick(spec).stop(spec)
    }

    fn stop_strays(&self, spec: &SandboxSpec) {
        self.pick(spec).stop_strays(spec)
    }

    fn set_idle(&self, spec: &SandboxSpec, idle: bool) {
        self.pick(spec).set_idle(spec, idle)
    }

    fn settle_running(&self, spec: &SandboxSpec) -> Option<String> {
        self.pick(spec).settle_running(spec)
    }

    fn settle_orphans(&self, ids: &[String], patience: std::time::Duration) {
        std::iter::once(&self.default).chain(&self.others).for_each(|engine| engine.settle_orphans(ids, patience));
    }

    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.pick(spec).destroy(spec).await
    }
}
