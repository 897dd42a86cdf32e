//! The gVisor engine: each sandbox is one `runsc` container in its own
//! sandbox (sentry + gofer), with a btrfs snapshot of the template as its
//! root, no network device, and the agent as PID 1 dialing home through a
//! Unix socket in a bind-mounted directory (`--host-uds=open`).
//!
//! What needs root — runsc, the bundle, roots and quotas, the agent's
//! socket, the freezer, timer slack — the engine asks of an
//! [`EngineHost`] ([`LocalHost`] in this process, `local.rs`). What it
//! keeps is its own logic: waiting for the agent and its handshake, what
//! runsc's states and the cgroup's counters mean.

mod local;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use local::{set_timer_slack, LocalConfig, LocalHost};
use space_privsep::layout::Layout;
use space_privsep::proto::{PatienceMs, SandboxId, SlackNs, StartFrom};
use tokio::net::UnixListener;

use crate::host::{live_status, EngineHost, Hosted, Placed};
use crate::{AgentConn, AgentListener, Availability, Engine, EngineError, LiveStatus, SandboxSpec, Started, Steps};

/// How long a sandbox may take from `runsc run` to the agent's hello.
const BOOT_PATIENCE: Duration = Duration::from_secs(20);
/// The socket the agent dials, as seen from the host.
const SOCKET_NAME: &str = "agent.sock";
/// The step of a start from spawning runsc to the agent dialing home.
const UNTIL_DIAL: &str = "runsc until the agent dials";
/// In an image: its memory (the engine checks it is whole before a start).
const IMAGE_MEMORY: &str = "memory";

#[derive(Debug, Clone)]
pub struct GvisorConfig {
    /// The `runsc` binary.
    pub runsc: PathBuf,
    /// The statically linked `space-agent` put into every sandbox.
    pub agent_bin: PathBuf,
    /// `runsc --root`: where runsc keeps its container state, `run/<name>`
    /// in the data dir.
    pub state_dir: PathBuf,
}

pub struct Gvisor {
    config: GvisorConfig,
    hosted: Hosted,
}

impl Gvisor {
    /// The engine doing its privileged work in this process, on the data
    /// dir that holds `config.state_dir` (`DATA/run/runsc`).
    pub fn new(config: GvisorConfig) -> Gvisor {
        let layout = Layout::new(data_dir_of(&config.state_dir));
        let host = LocalHost::new(LocalConfig {
            runsc: config.runsc.clone(),
            agent_bin: config.agent_bin.clone(),
            state_dir: config.state_dir.clone(),
            layout: layout.clone(),
        });
        Gvisor::with_host(config, layout, Arc::new(host))
    }

    /// The engine asking the root helper at `socket` (served by
    /// `helper_uid`) for its privileged work: [`crate::helper`].
    pub fn through_helper(config: GvisorConfig, socket: &Path, helper_uid: u32) -> Gvisor {
        let layout = Layout::new(data_dir_of(&config.state_dir));
        Gvisor::with_host(config, layout, Arc::new(crate::helper::HelperHost::new(socket, helper_uid)))
    }

    /// The engine asking `host` for its privileged work, with sandboxes'
    /// paths checked against `layout`.
    pub fn with_host(config: GvisorConfig, layout: Layout, host: Arc<dyn EngineHost>) -> Gvisor {
        Gvisor { config, hosted: Hosted::new(layout, host) }
    }

    /// runsc with its global flags, for measuring runsc itself beside the
    /// engine (`space bench`); the engine's own calls go through its host.
    pub fn runsc(&self) -> Command {
        runsc_command(&self.config.runsc, &self.config.state_dir)
    }

    /// Prepares the sandbox and runs it until its agent dials home. Returns
    /// the agent's socket (before any handshake) and the time from spawning
    /// `runsc` to the connection, the engine's own floor.
    pub async fn boot(&self, spec: &SandboxSpec) -> Result<(tokio::net::UnixStream, Duration), EngineError> {
        let from = self.hosted.placed.start_from(spec)?;
        let (socket, steps) = self.launch(spec, from).await?;
        let dialed = steps.iter().find(|(name, _)| *name == UNTIL_DIAL).map(|(_, took)| *took);
        Ok((socket, dialed.unwrap_or_default()))
    }

    /// Asks the host to start the sandbox from `from`, then waits for its
    /// agent to dial (or runsc to fail).
    async fn launch(
        &self,
        spec: &SandboxSpec,
        from: StartFrom,
    ) -> Result<(tokio::net::UnixStream, Steps), EngineError> {
        let sandbox = self.hosted.placed.sandbox(spec)?;
        let shape = Placed::shape(spec)?;
        let mounts = Placed::mounts(spec)?;
        let id = sandbox.clone();
        let launched = self.hosted.on_host(move |host| host.start(&id, &from, shape, &mounts)).await??;
        let (mut steps, finished) = (launched.steps, launched.finished);
        let listener = UnixListener::from_std(launched.listener).map_err(EngineError::io("socket"))?;
        let started = Instant::now();
        let mut runsc_done = tokio::task::spawn_blocking(finished);

        let accept = tokio::time::timeout(BOOT_PATIENCE, listener.accept());
        tokio::pin!(accept);
        let mut runsc_finished = false;
        let socket = loop {
            tokio::select! {
                done = &mut runsc_done, if !runsc_finished => {
                    runsc_finished = true;
                    done.map_err(|e| EngineError::Runtime(e.to_string()))??;
                }
                accepted = &mut accept => {
                    let accepted = match accepted {
                        Ok(accepted) => accepted,
                        Err(_) => {
                            let id = sandbox.clone();
                            let log = self.hosted.on_host(move |host| host.engine_log(&id)).await?;
                            return Err(EngineError::Runtime(format!(
                                "the agent did not dial home within {BOOT_PATIENCE:?}: {log}"
                            )));
                        }
                    };
                    let (socket, _) = accepted.map_err(EngineError::io("accepting the agent"))?;
                    break socket;
                }
            }
        };
        steps.push((UNTIL_DIAL, started.elapsed()));
        let returned = Instant::now();
        // Nobody else may connect: the socket goes away once the agent is in.
        let id = sandbox.clone();
        self.hosted.on_host(move |host| host.close_agent(&id)).await?;
        if !runsc_finished {
            // `runsc run --detach` returns once the container started; don't
            // leave its exit status unobserved.
            runsc_done.await.map_err(|e| EngineError::Runtime(e.to_string()))??;
        }
        steps.push(("runsc returns", returned.elapsed()));
        Ok((socket, steps))
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        let from = self.hosted.placed.start_from(spec)?;
        let (socket, mut steps) = self.launch(spec, from).await?;
        let boot = steps.iter().find(|(name, _)| *name == UNTIL_DIAL).map(|(_, took)| *took).unwrap_or_default();
        let shaking = Instant::now();
        let agent = AgentConn::handshake(socket, crate::welcome_for(spec), BOOT_PATIENCE).await?;
        steps.push(("agent handshake", shaking.elapsed()));
        Ok(Started { agent, boot, steps })
    }

    /// The snapshot a suspend writes (where `has_snapshot` looks).
    fn snapshot_dir(&self, spec: &SandboxSpec) -> PathBuf {
        spec.dir.join("snapshot")
    }
}

/// The data dir holding runsc root `state_dir` (`DATA/run/<name>`).
pub(crate) fn data_dir_of(state_dir: &Path) -> PathBuf {
    state_dir.parent().and_then(Path::parent).unwrap_or(Path::new("/")).to_path_buf()
}

/// runsc's global flags. Each is part of the isolation contract:
/// - `--network=none`: no network device but loopback;
/// - `--host-uds=open`: lets the agent connect to the one host socket
///   bind-mounted into the sandbox (nothing else on the host is mounted);
/// - `--overlay2=none`: writes land in the sandbox's own btrfs snapshot,
///   not in sentry memory, so they count as disk and survive a suspend.
fn runsc_command(runsc: &Path, state_dir: &Path) -> Command {
    let mut command = Command::new(runsc);
    command.arg(format!("--root={}", state_dir.display())).args([
        "--network=none",
        "--host-uds=open",
        "--overlay2=none",
    ]);
    command
}

#[async_trait::async_trait]
impl Engine for Gvisor {
    fn name(&self) -> &'static str {
        "gvisor"
    }

    fn availability(&self) -> Availability {
        // Whoever runs runsc (this process or the root helper) knows.
        let (available, detail) = self.hosted.host.availability();
        Availability { name: "gvisor", available, detail }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        match self.start(spec).await {
            Ok(started) => Ok(started),
            Err(err) => {
                if let Err(cleanup) = self.destroy(spec).await {
                    tracing::warn!(sandbox = %spec.id, "cleaning up after a failed create: {cleanup}");
                }
                Err(err)
            }
        }
    }

    fn stop_reason(&self, spec: &SandboxSpec) -> Option<&'static str> {
        // A counter in one of the cgroup's files, under cgroup v1 or v2.
        let counted = |files: [PathBuf; 2], key: &str| {
            files.iter().filter_map(|path| fs::read_to_string(path).ok()).any(|text| {
                text.lines()
                    .any(|line| line.strip_prefix(key).is_some_and(|n| n.trim().parse::<u64>().unwrap_or(0) > 0))
            })
        };
        let v1 = |controller: &str, file: &str| cgroup_dir(Some(controller), &spec.id).join(file);
        let v2 = |file: &str| cgroup_dir(None, &spec.id).join(file);
        if counted([v1("memory", "memory.oom_control"), v2("memory.events")], "oom_kill ") {
            return Some("out of memory: the sandbox went over its memory_mib and the host stopped it");
        }
        if counted([v1("pids", "pids.events"), v2("pids.events")], "max ") {
            return Some("too many tasks: the sandbox's engine hit its host task limit and stopped");
        }
        None
    }

    /// `runsc pause` stops the guest's tasks, but the sentry itself keeps
    /// ticking (≈ 3% of a core, measured, the same as running idle): the
    /// sandbox's cgroup is frozen too, so a paused sandbox costs no CPU.
    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.pause(id)).await?;
        if let Err(err) = self.hosted.ask(spec, |host, id| host.freeze(id, true)).await {
            // Still paused; only the sentry's idle cost remains.
            tracing::warn!(sandbox = %spec.id, "freezing the paused sandbox's cgroup: {err}");
        }
        Ok(())
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.freeze(id, false)).await?;
        self.hosted.ask(spec, |host, id| host.resume(id)).await
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.suspend(id)).await
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        if !self.has_snapshot(spec) {
            return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
        }
        let (socket, _) = self.launch(spec, StartFrom::Suspended {}).await?;
        self.hosted.ask(spec, |host, id| host.drop_snapshot(id)).await?;
        Ok(socket)
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        self.snapshot_dir(spec).join("checkpoint.img").is_file()
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        self.hosted.status(spec)
    }

    fn statuses(&self, specs: &[SandboxSpec]) -> Vec<LiveStatus> {
        self.hosted.statuses(specs)
    }

    async fn redial(&self, spec: &SandboxSpec) -> Result<AgentListener, EngineError> {
        self.hosted.redial(spec).await
    }

    async fn save_image(&self, spec: &SandboxSpec, image: &Path) -> Result<Duration, EngineError> {
        self.hosted.save_image(spec, image).await
    }

    async fn drop_image(&self, spec: &SandboxSpec, image: &Path) -> Result<(), EngineError> {
        self.hosted.drop_image(spec, image).await
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.stop(spec)
    }

    fn saves_images(&self, _spec: &SandboxSpec) -> bool {
        true
    }

    async fn start_from_image(&self, spec: &SandboxSpec, image: &Path) -> Result<tokio::net::UnixStream, EngineError> {
        let from = self.hosted.placed.start_from_image(image)?;
        if !image.join(IMAGE_MEMORY).join("checkpoint.img").is_file() {
            return Err(EngineError::Runtime("the image is not whole".into()));
        }
        let (socket, _) = self.launch(spec, from).await?;
        Ok(socket)
    }

    fn resource_use(&self, spec: &SandboxSpec) -> Option<crate::ResourceUse> {
        let cgroup = cgroup_path(&spec.id);
        crate::cgroup_use(cgroup.strip_prefix("/").unwrap_or(&cgroup))
    }

    fn set_idle(&self, spec: &SandboxSpec, idle: bool) {
        let Some(sandbox) = self.hosted.sandbox_of(spec) else { return };
        let slack = idle.then(|| SlackNs::new(IDLE_TIMER_SLACK_NS)).transpose();
        let set = slack
            .map_err(|e| EngineError::Runtime(e.to_string()))
            .and_then(|slack| self.hosted.host.set_timer_slack(&sandbox, slack));
        if let Err(err) = set {
            tracing::debug!(sandbox = %spec.id, "setting the timer slack of its tasks: {err}");
        }
    }

    fn stop_strays(&self, spec: &SandboxSpec) {
        if let Some(sandbox) = self.hosted.sandbox_of(spec) {
            self.hosted.host.stop_strays(&sandbox);
        }
    }

    /// This server freezes a sandbox's cgroup only once runsc shows it
    /// paused, and thaws it before it resumes: a cgroup frozen under a
    /// sandbox runsc shows running was left so by something else, and
    /// keeps its agent from dialing in. Thawed.
    fn settle_running(&self, spec: &SandboxSpec) -> Option<String> {
        let sandbox = self.hosted.sandbox_of(spec)?;
        if self.hosted.host.states(std::slice::from_ref(&sandbox)).first().copied().map(live_status)
            != Some(LiveStatus::Running)
        {
            return None;
        }
        let frozen = freezer_state(&spec.id).filter(|state| state != "THAWED" && state != "frozen 0")?;
        match self.hosted.host.freeze(&sandbox, false) {
            Ok(()) => Some(format!("its cgroup was left frozen ({frozen}) while runsc shows it running: thawed")),
            Err(err) => Some(format!("its cgroup was left frozen ({frozen}) while runsc shows it running: {err}")),
        }
    }

    /// See [`EngineHost::settle_orphans`].
    fn settle_orphans(&self, ids: &[String], patience: Duration) {
        let sandboxes: Vec<SandboxId> = ids.iter().filter_map(|id| SandboxId::parse(id).ok()).collect();
        let millis = patience.as_millis().clamp(PatienceMs::MIN.into(), PatienceMs::MAX.into()) as u32;
        if let Ok(patience) = PatienceMs::new(millis) {
            self.hosted.host.settle_orphans(&sandboxes, patience);
        }
    }

    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.destroy(id)).await
    }
}

/// How long the kernel may take to freeze or thaw a sandbox's tasks.
const FREEZE_PATIENCE: Duration = Duration::from_secs(5);

/// What the cgroup freezer says of the sandbox's cgroup: v1's
/// `freezer.state` (THAWED, FREEZING, FROZEN) or v2's `frozen 0|1` line
/// of `cgroup.events`; None without a freezer.
fn freezer_state(id: &str) -> Option<String> {
    let (v1, v2) = (cgroup_dir(Some("freezer"), id), cgroup_dir(None, id));
    if let Ok(state) = fs::read_to_string(v1.join("freezer.state")) {
        return Some(state.trim().to_string());
    }
    let events = fs::read_to_string(v2.join("cgroup.events")).ok()?;
    events.lines().find(|line| line.starts_with("frozen ")).map(str::to_string)
}

/// The timer slack of an idle sandbox's tasks, in ns. An idle gVisor
/// sentry is not idle: the systrap platform of the runsc this host runs
/// (Debian's 2024 build) polls its fast path every 400 µs, forever — ≈ 1000
/// wakeups a second, ≈ 3 % of a core per sandbox (newer gVisor parks the
/// poller when nothing runs). With this much slack the kernel may delay
/// each of those timed sleeps by up to 50 ms, so they come ≈ 20 times a
/// second (≈ 0.3 % of a core). Only timers are late; anything woken by an
/// event (a request reaching the agent, a pipe, a futex) is not.
pub const IDLE_TIMER_SLACK_NS: u64 = 50_000_000;

/// The timer slack of every task of the sandbox's cgroup now, in ns.
pub fn timer_slacks(id: &str) -> Result<Vec<u64>, EngineError> {
    let read = |tid: &u32| fs::read_to_string(slack_file(*tid)).ok()?.trim().parse().ok();
    Ok(tasks_of(id)?.iter().filter_map(read).collect())
}

pub(crate) fn slack_file(tid: u32) -> String {
    format!("/proc/{tid}/timerslack_ns")
}

/// The ids of every task (thread) of the sandbox's cgroup, v2 or v1.
pub(crate) fn tasks_of(id: &str) -> Result<Vec<u32>, EngineError> {
    let v2 = cgroup_dir(None, id).join("cgroup.threads");
    let listing = if v2.exists() { v2 } else { cgroup_dir(Some("freezer"), id).join("tasks") };
    let tasks = fs::read_to_string(&listing).map_err(EngineError::io("listing the sandbox's tasks"))?;
    Ok(tasks.split_whitespace().filter_map(|tid| tid.parse().ok()).collect())
}

/// The sandbox's cgroup, relative to each controller's root.
pub fn cgroup_path(id: &str) -> PathBuf {
    PathBuf::from(format!("/space/{id}"))
}

/// The sandbox's cgroup directory: under a cgroup v1 `controller`, or in
/// the v2 hierarchy (None).
pub(crate) fn cgroup_dir(controller: Option<&str>, id: &str) -> PathBuf {
    let cgroup = cgroup_path(id);
    let relative = cgroup.strip_prefix("/").unwrap_or(&cgroup);
    Path::new("/sys/fs/cgroup").join(controller.unwrap_or("")).join(relative)
}
