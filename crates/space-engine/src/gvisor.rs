//! The gVisor engine: each sandbox is one `runsc` container in its own
//! sandbox (sentry + gofer), with a btrfs snapshot of the template as its
//! root, no network device, and the agent as PID 1 dialing home through a
//! Unix socket in a bind-mounted directory (`--host-uds=open`).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use oci_spec::runtime::{
    Capability, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxMemoryBuilder, LinuxPidsBuilder, LinuxResourcesBuilder,
    MountBuilder, ProcessBuilder, RootBuilder, Spec, UserBuilder,
};
use space_host::btrfs;
use space_host::template::{AGENT_PATH_IN_ROOT, HOST_DIR_IN_ROOT};
use space_process::Reaper;
use tokio::net::UnixListener;

use crate::{AgentConn, AgentListener, Availability, Engine, EngineError, LiveStatus, SandboxSpec, Started, Steps};

/// How long a sandbox may take from `runsc run` to the agent's hello.
const BOOT_PATIENCE: Duration = Duration::from_secs(20);
/// The socket the agent dials, as seen from the host.
const SOCKET_NAME: &str = "agent.sock";
/// The step of a start from spawning runsc to the agent dialing home.
const UNTIL_DIAL: &str = "runsc until the agent dials";

#[derive(Debug, Clone)]
pub struct GvisorConfig {
    /// The `runsc` binary.
    pub runsc: PathBuf,
    /// The statically linked `space-agent` put into every sandbox.
    pub agent_bin: PathBuf,
    /// `runsc --root`: where runsc keeps its container state.
    pub state_dir: PathBuf,
}

pub struct Gvisor {
    config: GvisorConfig,
}

/// How `runsc` starts a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Launch {
    /// A fresh container from the template root.
    Run,
    /// The container from the checkpoint in this directory (its root,
    /// bundle and socket directory exist).
    Restore(PathBuf),
}

/// In an image: the copy of the sandbox's root, and its memory.
const IMAGE_ROOT: &str = "rootfs";
const IMAGE_MEMORY: &str = "memory";

impl Gvisor {
    pub fn new(config: GvisorConfig) -> Gvisor {
        crate::oom_relief::watch(&config.state_dir);
        Gvisor { config }
    }

    /// runsc's global flags. Each is part of the isolation contract:
    /// - `--network=none`: no network device but loopback;
    /// - `--host-uds=open`: lets the agent connect to the one host socket
    ///   bind-mounted into the sandbox (nothing else on the host is mounted);
    /// - `--overlay2=none`: writes land in the sandbox's own btrfs snapshot,
    ///   not in sentry memory, so they count as disk and survive a suspend.
    pub fn runsc(&self) -> Command {
        let mut command = Command::new(&self.config.runsc);
        command.arg(format!("--root={}", self.config.state_dir.display())).args([
            "--network=none",
            "--host-uds=open",
            "--overlay2=none",
        ]);
        command
    }

    /// The OCI bundle directory of a sandbox.
    pub fn bundle_dir(dir: &Path) -> PathBuf {
        dir.join("bundle")
    }

    /// The host directory that holds the agent's socket.
    pub fn socket_dir(dir: &Path) -> PathBuf {
        dir.join("sock")
    }

    /// Writes the OCI bundle for `spec`: `config.json` with the sandbox's own
    /// root, the agent as PID 1, and the two bind mounts it needs.
    pub fn write_bundle(&self, spec: &SandboxSpec) -> Result<PathBuf, EngineError> {
        let bundle = Self::bundle_dir(&spec.dir);
        fs::create_dir_all(&bundle).map_err(EngineError::io("creating the bundle dir"))?;
        let config = oci_config(spec, &self.config.agent_bin)?;
        let json = serde_json::to_vec_pretty(&config).map_err(|e| EngineError::Runtime(e.to_string()))?;
        fs::write(bundle.join("config.json"), json).map_err(EngineError::io("writing config.json"))?;
        Ok(bundle)
    }

    /// Everything before `runsc run`: the root snapshot, the socket directory
    /// and the bundle. Returns the listener the agent will dial.
    fn prepare(
        &self,
        spec: &SandboxSpec,
        launch: &Launch,
        steps: &mut Steps,
    ) -> Result<std::os::unix::net::UnixListener, EngineError> {
        let socket_dir = Self::socket_dir(&spec.dir);
        let mut lap = Instant::now();
        let mut step = |name: &'static str| {
            steps.push((name, lap.elapsed()));
            lap = Instant::now();
        };
        if *launch == Launch::Run {
            fs::create_dir_all(&spec.dir).map_err(EngineError::io("creating the sandbox dir"))?;
            btrfs::snapshot(&spec.template_rootfs, &spec.dir.join("rootfs"))?;
            step("root snapshot (btrfs)");
            if spec.disk_mib > 0 {
                btrfs::limit_exclusive(&spec.dir.join("rootfs"), spec.disk_mib)?;
                step("disk limit (btrfs qgroup)");
            }
            fs::create_dir_all(&socket_dir).map_err(EngineError::io("creating the socket dir"))?;
            fs::set_permissions(&socket_dir, fs::Permissions::from_mode(0o700)).map_err(EngineError::io("chmod"))?;
            self.write_bundle(spec)?;
        }
        // runsc resolves `/tmp`'s bind source on the host: the sandbox
        // could have made it a link. Nothing of the sandbox runs now.
        ensure_real_dir(&spec.dir.join("rootfs/tmp"))?;
        // Whatever the sandbox left in its socket directory goes first.
        let socket_path = socket_dir.join(SOCKET_NAME);
        if fs::symlink_metadata(&socket_path).is_ok() {
            fs::remove_file(&socket_path).map_err(EngineError::io("clearing the socket path"))?;
        }
        let listener = std::os::unix::net::UnixListener::bind(&socket_path)
            .map_err(EngineError::io("binding the agent socket"))?;
        listener.set_nonblocking(true).map_err(EngineError::io("socket mode"))?;
        step("bundle and agent socket");
        Ok(listener)
    }

    /// Where a suspended sandbox's checkpoint lives.
    pub fn snapshot_dir(dir: &Path) -> PathBuf {
        dir.join("snapshot")
    }

    /// Prepares the sandbox and runs it until its agent dials home. Returns
    /// the agent's socket (before any handshake) and the time from spawning
    /// `runsc` to the connection, the engine's own floor.
    pub async fn boot(&self, spec: &SandboxSpec) -> Result<(tokio::net::UnixStream, Duration), EngineError> {
        let (socket, steps) = self.launch(spec, Launch::Run).await?;
        let dialed = steps.iter().find(|(name, _)| *name == UNTIL_DIAL).map(|(_, took)| *took);
        Ok((socket, dialed.unwrap_or_default()))
    }

    /// Gives `spec` its own writable copy of an image's root (in place of
    /// any root it had), its socket directory and its bundle.
    fn prepare_from_image(&self, spec: &SandboxSpec, image: &Path) -> Result<(), EngineError> {
        fs::create_dir_all(&spec.dir).map_err(EngineError::io("creating the sandbox dir"))?;
        let root = spec.dir.join("rootfs");
        btrfs::delete_subvolume(&root)?;
        // A suspend's snapshot no longer applies to what runs from here.
        let _ = fs::remove_dir_all(Self::snapshot_dir(&spec.dir));
        btrfs::snapshot(&image.join(IMAGE_ROOT), &root)?;
        if spec.disk_mib > 0 {
            btrfs::limit_exclusive(&root, spec.disk_mib)?;
        }
        let socket_dir = Self::socket_dir(&spec.dir);
        fs::create_dir_all(&socket_dir).map_err(EngineError::io("creating the socket dir"))?;
        fs::set_permissions(&socket_dir, fs::Permissions::from_mode(0o700)).map_err(EngineError::io("chmod"))?;
        self.write_bundle(spec).map(drop)
    }

    async fn launch(&self, spec: &SandboxSpec, launch: Launch) -> Result<(tokio::net::UnixStream, Steps), EngineError> {
        let this = self.clone_config();
        let spec_clone = spec.clone();
        let how = launch.clone();
        let (listener, mut steps) = tokio::task::spawn_blocking(move || {
            let mut steps = Steps::new();
            this.prepare(&spec_clone, &how, &mut steps).map(|listener| (listener, steps))
        })
        .await
        .map_err(|e| EngineError::Runtime(e.to_string()))??;
        let listener = UnixListener::from_std(listener).map_err(EngineError::io("socket"))?;

        let log_path = spec.dir.join("runsc.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(EngineError::io("opening runsc.log"))?;
        let log_err = log.try_clone().map_err(EngineError::io("runsc.log"))?;
        let mut run = self.runsc();
        match &launch {
            Launch::Run => run.args(["run", "--detach"]),
            Launch::Restore(memory) => run.args(["restore", "--detach", "--image-path"]).arg(memory),
        };
        run.arg("--bundle")
            .arg(Self::bundle_dir(&spec.dir))
            .arg(&spec.id)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let started = Instant::now();
        let child = Reaper::global().spawn(&mut run).map_err(EngineError::io("starting runsc"))?;
        let mut runsc_done = tokio::task::spawn_blocking(move || child.wait());

        let accept = tokio::time::timeout(BOOT_PATIENCE, listener.accept());
        tokio::pin!(accept);
        let mut runsc_finished = false;
        let socket = loop {
            tokio::select! {
                status = &mut runsc_done, if !runsc_finished => {
                    runsc_finished = true;
                    let status = status.map_err(|e| EngineError::Runtime(e.to_string()))?;
                    if !status.success() {
                        return Err(EngineError::Runtime(format!(
                            "runsc {launch:?} failed ({status:?}): {}", log_tail(&log_path)
                        )));
                    }
                }
                accepted = &mut accept => {
                    let (socket, _) = accepted
                        .map_err(|_| EngineError::Runtime(format!(
                            "the agent did not dial home within {BOOT_PATIENCE:?}: {}", log_tail(&log_path)
                        )))?
                        .map_err(EngineError::io("accepting the agent"))?;
                    break socket;
                }
            }
        };
        steps.push((UNTIL_DIAL, started.elapsed()));
        // Before anything runs in it: its memory cgroup is looked after.
        crate::oom_relief::started();
        let returned = Instant::now();
        // Nobody else may connect: the socket file goes away once the agent is in.
        let _ = fs::remove_file(Self::socket_dir(&spec.dir).join(SOCKET_NAME));
        if !runsc_finished {
            // `runsc run --detach` returns once the container started; don't
            // leave its exit status unobserved.
            let status = runsc_done.await.map_err(|e| EngineError::Runtime(e.to_string()))?;
            if !status.success() {
                return Err(EngineError::Runtime(format!("runsc run failed: {}", log_tail(&log_path))));
            }
        }
        steps.push(("runsc returns", returned.elapsed()));
        Ok((socket, steps))
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        let (socket, mut steps) = self.launch(spec, Launch::Run).await?;
        let boot = steps.iter().find(|(name, _)| *name == UNTIL_DIAL).map(|(_, took)| *took).unwrap_or_default();
        let shaking = Instant::now();
        let agent = AgentConn::handshake(socket, crate::welcome_for(spec), BOOT_PATIENCE).await?;
        steps.push(("agent handshake", shaking.elapsed()));
        Ok(Started { agent, boot, steps })
    }

    /// Runs one runsc subcommand off the async threads.
    async fn runsc_blocking<const N: usize>(&self, args: [&str; N]) -> Result<(), EngineError> {
        let mut command = self.runsc();
        command.args(args);
        tokio::task::spawn_blocking(move || space_host::run(&mut command))
            .await
            .map_err(|e| EngineError::Runtime(e.to_string()))?
            .map(drop)
            .map_err(|e| EngineError::Runtime(e.to_string()))
    }

    fn clone_config(&self) -> Gvisor {
        Gvisor { config: self.config.clone() }
    }

    fn destroy_blocking(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        // `delete --force` kills the sandbox if it still runs (thawed first:
        // a frozen one takes no signal). A container that never existed
        // makes it fail, which is fine here.
        let _ = set_frozen(&spec.id, false);
        let _ = space_host::run(self.runsc().args(["delete", "--force", &spec.id]));
        remove_cgroups(&spec.id);
        btrfs::delete_subvolume(&spec.dir.join("rootfs"))?;
        // Images (a fork's, checkpoints) hold subvolumes of their own.
        btrfs::remove_tree(&spec.dir)?;
        if spec.dir.exists() {
            fs::remove_dir_all(&spec.dir).map_err(EngineError::io("removing the sandbox dir"))?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Engine for Gvisor {
    fn name(&self) -> &'static str {
        "gvisor"
    }

    fn availability(&self) -> Availability {
        let version = space_host::run(Command::new(&self.config.runsc).arg("--version"));
        let (available, detail) = match version {
            Ok(out) => {
                let text = String::from_utf8_lossy(&out);
                (true, text.lines().next().unwrap_or("runsc").to_string())
            }
            Err(err) => (false, format!("runsc is not usable ({err}); run `space setup` to install it")),
        };
        let agent_ok = self.config.agent_bin.is_file();
        if available && !agent_ok {
            return Availability {
                name: "gvisor",
                available: false,
                detail: format!("the agent binary {} is missing", self.config.agent_bin.display()),
            };
        }
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
        self.runsc_blocking(["pause", &spec.id]).await?;
        let id = spec.id.clone();
        let frozen = tokio::task::spawn_blocking(move || set_frozen(&id, true))
            .await
            .map_err(|e| EngineError::Runtime(e.to_string()))?;
        if let Err(err) = frozen {
            // Still paused; only the sentry's idle cost remains.
            tracing::warn!(sandbox = %spec.id, "freezing the paused sandbox's cgroup: {err}");
        }
        Ok(())
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        let id = spec.id.clone();
        tokio::task::spawn_blocking(move || set_frozen(&id, false))
            .await
            .map_err(|e| EngineError::Runtime(e.to_string()))??;
        self.runsc_blocking(["resume", &spec.id]).await
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        let snapshot = Self::snapshot_dir(&spec.dir);
        let _ = fs::remove_dir_all(&snapshot);
        fs::create_dir_all(&snapshot).map_err(EngineError::io("creating the snapshot dir"))?;
        let image = snapshot.to_string_lossy().into_owned();
        self.runsc_blocking(["checkpoint", "--image-path", &image, &spec.id]).await?;
        // The checkpointed container has stopped; free its runsc state so
        // no engine process of it is left while it is suspended.
        self.runsc_blocking(["delete", "--force", &spec.id]).await
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        if !Self::snapshot_dir(&spec.dir).join("checkpoint.img").is_file() {
            return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
        }
        let (socket, _) = self.launch(spec, Launch::Restore(Self::snapshot_dir(&spec.dir))).await?;
        let _ = fs::remove_dir_all(Self::snapshot_dir(&spec.dir));
        Ok(socket)
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        Self::snapshot_dir(&spec.dir).join("checkpoint.img").is_file()
    }

    fn saves_images(&self, _spec: &SandboxSpec) -> bool {
        true
    }

    /// Frozen (`runsc pause`) for the instant: the root is snapshotted
    /// (btrfs, atomic) and the memory checkpointed with `--leave-running`
    /// (which keeps a paused sandbox paused), then thawed, so disk and
    /// memory are of the same instant.
    async fn save_image(&self, spec: &SandboxSpec, image: &Path) -> Result<Duration, EngineError> {
        let memory = image.join(IMAGE_MEMORY);
        fs::create_dir_all(&memory).map_err(EngineError::io("creating the image dir"))?;
        self.runsc_blocking(["pause", &spec.id]).await?;
        let frozen = Instant::now();
        let saved = async {
            let (root, copy) = (spec.dir.join("rootfs"), image.join(IMAGE_ROOT));
            tokio::task::spawn_blocking(move || btrfs::snapshot(&root, &copy))
                .await
                .map_err(|e| EngineError::Runtime(e.to_string()))??;
            let memory = memory.to_string_lossy().into_owned();
            self.runsc_blocking(["checkpoint", "--leave-running", "--image-path", &memory, &spec.id]).await
        }
        .await;
        let thawed = self.runsc_blocking(["resume", &spec.id]).await;
        let frozen = frozen.elapsed();
        saved?;
        thawed?;
        Ok(frozen)
    }

    async fn start_from_image(&self, spec: &SandboxSpec, image: &Path) -> Result<tokio::net::UnixStream, EngineError> {
        if !image.join(IMAGE_MEMORY).join("checkpoint.img").is_file() {
            return Err(EngineError::Runtime("the image is not whole".into()));
        }
        let this = self.clone_config();
        let (spec_clone, image_clone) = (spec.clone(), image.to_path_buf());
        tokio::task::spawn_blocking(move || this.prepare_from_image(&spec_clone, &image_clone))
            .await
            .map_err(|e| EngineError::Runtime(e.to_string()))??;
        let (socket, _) = self.launch(spec, Launch::Restore(image.join(IMAGE_MEMORY))).await?;
        Ok(socket)
    }

    fn resource_use(&self, spec: &SandboxSpec) -> Option<crate::ResourceUse> {
        let cgroup = cgroup_path(&spec.id);
        crate::cgroup_use(cgroup.strip_prefix("/").unwrap_or(&cgroup))
    }

    fn set_idle(&self, spec: &SandboxSpec, idle: bool) {
        let slack = idle.then_some(IDLE_TIMER_SLACK_NS);
        if let Err(err) = set_timer_slack(&spec.id, slack) {
            tracing::debug!(sandbox = %spec.id, "setting the timer slack of its tasks: {err}");
        }
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        let Ok(out) = space_host::run(self.runsc().args(["state", &spec.id])) else {
            return LiveStatus::Gone;
        };
        let state: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        live_status(state["status"].as_str())
    }

    fn statuses(&self, specs: &[SandboxSpec]) -> Vec<LiveStatus> {
        // Read from the state files runsc keeps, with the sandbox process
        // checked alive: a `runsc state` (or `list`) each costs a process
        // and a call into every sandbox, seconds for a hundred on two cores.
        specs.iter().map(|spec| self.recorded_status(spec).unwrap_or_else(|| self.status(spec))).collect()
    }

    async fn redial(&self, spec: &SandboxSpec) -> Result<AgentListener, EngineError> {
        let this = self.clone_config();
        let spec_clone = spec.clone();
        let restore = Launch::Restore(Self::snapshot_dir(&spec.dir));
        let listener = tokio::task::spawn_blocking(move || this.prepare(&spec_clone, &restore, &mut Steps::new()))
            .await
            .map_err(|e| EngineError::Runtime(e.to_string()))??;
        let listener = UnixListener::from_std(listener).map_err(EngineError::io("socket"))?;
        Ok(AgentListener::new(listener, Self::socket_dir(&spec.dir).join(SOCKET_NAME)))
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        // A frozen sandbox takes no signal, not even SIGKILL, until thawed.
        let _ = set_frozen(&spec.id, false);
        let deleted = space_host::run(self.runsc().args(["delete", "--force", &spec.id]));
        // runsc removes only cgroups it made: not those of a sandbox whose
        // processes a restarted server killed (a warm member it swept).
        remove_cgroups(&spec.id);
        deleted.map(drop).map_err(|e| EngineError::Runtime(e.to_string()))
    }

    /// Every process started with this engine's `--root` that names the
    /// sandbox (its id as an argument, or a path in its directory) is
    /// killed — thawed first — and waited for.
    fn stop_strays(&self, spec: &SandboxSpec) {
        let root = format!("--root={}", self.config.state_dir.display());
        let dir = format!("{}/", spec.dir.display());
        let strays = processes_where(|args| {
            args.iter().any(|a| *a == root) && args.iter().any(|a| *a == spec.id || a.contains(&dir))
        });
        if strays.is_empty() {
            return;
        }
        tracing::info!(sandbox = %spec.id, count = strays.len(), "killing engine processes a previous server left");
        let _ = set_frozen(&spec.id, false);
        for pid in &strays {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
        }
        let deadline = Instant::now() + FREEZE_PATIENCE;
        while strays.iter().any(|pid| alive(*pid)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// This server freezes a sandbox's cgroup only once runsc shows it
    /// paused, and thaws it before it resumes: a cgroup frozen under a
    /// sandbox runsc shows running was left so by something else, and
    /// keeps its agent from dialing in. Thawed.
    fn settle_running(&self, spec: &SandboxSpec) -> Option<String> {
        if self.recorded_status(spec).unwrap_or_else(|| self.status(spec)) != LiveStatus::Running {
            return None;
        }
        let frozen = freezer_state(&spec.id).filter(|state| state != "THAWED" && state != "frozen 0")?;
        match set_frozen(&spec.id, false) {
            Ok(()) => Some(format!("its cgroup was left frozen ({frozen}) while runsc shows it running: thawed")),
            Err(err) => Some(format!("its cgroup was left frozen ({frozen}) while runsc shows it running: {err}")),
        }
    }

    /// The commands are `runsc` processes with this engine's `--root`
    /// (not the sandboxes' own `runsc-sandbox` and `runsc-gofer`).
    ///
    /// runsc keeps a sandbox's status in its state file, written after
    /// its call into the sandbox: a `runsc pause` killed between the two
    /// leaves a sandbox stopped inside that runsc shows running (its agent
    /// never dials in, and `runsc resume` refuses a running container),
    /// and a `runsc resume` killed there leaves one running that runsc
    /// shows paused (the next resume's call into it then takes the sandbox
    /// down). So a pause or resume is waited for up to [`PAUSE_PATIENCE`],
    /// far past what one takes on a loaded host, and killed only if the
    /// sandbox itself is stuck.
    fn settle_orphans(&self, ids: &[String], patience: Duration) {
        if ids.is_empty() {
            return;
        }
        let root = format!("--root={}", self.config.state_dir.display());
        let orphans = || {
            processes_where(|args| {
                Path::new(args[0]).file_name().is_some_and(|name| name == "runsc")
                    && args.contains(&root.as_str())
                    && args.iter().any(|arg| ids.iter().any(|id| id == arg))
            })
            .into_iter()
            .map(|pid| (pid, pausing(pid)))
            .collect::<Vec<_>>()
        };
        let started = Instant::now();
        let mut found = orphans();
        if !found.is_empty() {
            tracing::info!(count = found.len(), "waiting for engine commands a previous server left running");
        }
        while !found.is_empty() {
            for &(pid, pausing) in &found {
                if started.elapsed() > if pausing { PAUSE_PATIENCE } else { patience } {
                    tracing::warn!(pid, pausing, "killing an engine command a previous server left running");
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
            found = orphans().into_iter().filter(|(pid, _)| alive(*pid)).collect();
        }
    }

    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        let this = self.clone_config();
        let spec = spec.clone();
        tokio::task::spawn_blocking(move || this.destroy_blocking(&spec))
            .await
            .map_err(|e| EngineError::Runtime(e.to_string()))?
    }
}

/// Makes `path` a real directory (mode 1777) if the sandbox left anything
/// else there: a link, a file, a FIFO. Its contents, if it is one, stay.
/// Everything is done relative to the parent's descriptor and never
/// follows a link at `path`.
fn ensure_real_dir(path: &Path) -> Result<(), EngineError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use nix::fcntl::{openat, AtFlags, OFlag};
    use nix::sys::stat::{fchmod, fstatat, mkdirat, Mode, SFlag};
    use nix::unistd::{unlinkat, UnlinkatFlags};

    let io = |what: &'static str| move |e: nix::Error| EngineError::io(what)(std::io::Error::from(e));
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(EngineError::Runtime(format!("{} has no parent", path.display())));
    };
    let dir_flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY;
    let open = |at: Option<i32>, name: &std::ffi::OsStr| {
        // SAFETY: openat returned a new descriptor that nothing else owns.
        openat(at, name, dir_flags, Mode::empty()).map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
    };
    let dir = open(None, parent.as_os_str()).map_err(io("opening the root"))?;
    let at = Some(dir.as_raw_fd());
    match fstatat(at, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR => return Ok(()),
        Ok(_) => unlinkat(at, name, UnlinkatFlags::NoRemoveDir).map_err(io("clearing a non-directory at /tmp"))?,
        Err(nix::Error::ENOENT) => {}
        Err(err) => return Err(io("looking at /tmp")(err)),
    }
    mkdirat(at, name, Mode::from_bits_truncate(0o1777)).map_err(io("creating /tmp"))?;
    // mkdir's mode passes through the umask; the descriptor's chmod does not.
    let tmp = open(at, name).map_err(io("opening /tmp"))?;
    fchmod(tmp.as_raw_fd(), Mode::from_bits_truncate(0o1777)).map_err(io("chmod /tmp"))
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let tail = lines.into_iter().rev().collect::<Vec<_>>().join(" | ");
    if tail.is_empty() {
        "no output".into()
    } else {
        tail
    }
}

/// The capabilities of root inside the sandbox (Docker's default set). They
/// are capabilities of gVisor's emulated kernel, not of the host.
const CAPABILITIES: &[Capability] = &[
    Capability::AuditWrite,
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fowner,
    Capability::Fsetid,
    Capability::Kill,
    Capability::Mknod,
    Capability::NetBindService,
    Capability::NetRaw,
    Capability::Setfcap,
    Capability::Setgid,
    Capability::Setpcap,
    Capability::Setuid,
    Capability::SysChroot,
];

/// CFS period for the CPU quota (`vcpus` periods of CPU time per period).
const CPU_PERIOD_US: u64 = 100_000;
/// Host tasks (threads) of one sandbox's runsc processes.
const HOST_TASKS_LIMIT: i64 = 4096;
/// Memory the sentry and gofer need beyond what the guest is given.
/// (The sentry's own ≈ 20–30 MiB; the rest is the agent's memory
/// watcher's time to kill a hog inside before this limit stops the whole
/// sandbox.)
const ENGINE_OVERHEAD_MIB: u32 = 128;

fn memory_limit_bytes(memory_mib: u32) -> i64 {
    i64::from(memory_mib + ENGINE_OVERHEAD_MIB) << 20
}

/// How long the kernel may take to freeze or thaw a sandbox's tasks.
const FREEZE_PATIENCE: Duration = Duration::from_secs(5);

/// How long a starting server waits for a killed one's `runsc pause` or
/// `resume` before it kills it (see `Gvisor::settle_running`).
const PAUSE_PATIENCE: Duration = Duration::from_secs(60);

/// Whether process `pid` is a `runsc pause` or `runsc resume`.
fn pausing(pid: i32) -> bool {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let text = String::from_utf8_lossy(&cmdline);
    text.split('\0').any(|arg| arg == "pause" || arg == "resume")
}

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

/// Freezes or thaws every task of the sandbox's cgroup (the sentry and the
/// gofer) with the cgroup freezer, v1 or v2, and waits until the kernel
/// says it is done. A host without a freezer leaves them as they are.
fn set_frozen(id: &str, frozen: bool) -> Result<(), EngineError> {
    let (v1, v2) = (cgroup_dir(Some("freezer"), id), cgroup_dir(None, id));
    let (control, value, state, settled) = if v1.join("freezer.state").exists() {
        let word = if frozen { "FROZEN" } else { "THAWED" };
        (v1.join("freezer.state"), word, v1.join("freezer.state"), word.to_string())
    } else if v2.join("cgroup.freeze").exists() {
        let flag = if frozen { "1" } else { "0" };
        (v2.join("cgroup.freeze"), flag, v2.join("cgroup.events"), format!("frozen {flag}"))
    } else {
        return Ok(());
    };
    fs::write(&control, value).map_err(EngineError::io("writing the cgroup freezer"))?;
    let started = Instant::now();
    loop {
        let now = fs::read_to_string(&state).unwrap_or_default();
        if now.lines().any(|line| line.trim() == settled) {
            return Ok(());
        }
        if started.elapsed() > FREEZE_PATIENCE {
            return Err(EngineError::Runtime(format!("the cgroup freezer did not reach {settled:?}: {now:?}")));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
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

/// Sets the timer slack (`/proc/<tid>/timerslack_ns`) of every task of the
/// sandbox's cgroup — the sentry's threads, its stubs, the gofer — to `ns`;
/// `None`: to this process's own, which they had from the start. Returns
/// how many tasks it set.
///
/// A task takes its maker's slack, both as its own and as its default (so
/// writing 0, "back to the default", would keep a task made while idle
/// idle): the usual value is written, not 0. Tasks made while the listing
/// is gone through are caught by going through it again.
pub fn set_timer_slack(id: &str, ns: Option<u64>) -> Result<usize, EngineError> {
    let ns = ns.unwrap_or_else(|| {
        let own = fs::read_to_string("/proc/thread-self/timerslack_ns").ok();
        own.and_then(|v| v.trim().parse().ok()).unwrap_or(DEFAULT_TIMER_SLACK_NS)
    });
    let value = ns.to_string();
    let mut done = std::collections::HashSet::new();
    for _ in 0..3 {
        let new: Vec<u32> = tasks_of(id)?.into_iter().filter(|tid| !done.contains(tid)).collect();
        if new.is_empty() {
            break;
        }
        // A task that ended since the listing is no error.
        done.extend(new.into_iter().filter(|tid| fs::write(slack_file(*tid), &value).is_ok()));
    }
    Ok(done.len())
}

/// Linux's timer slack for a task nobody set one for, in ns.
const DEFAULT_TIMER_SLACK_NS: u64 = 50_000;

/// The timer slack of every task of the sandbox's cgroup now, in ns.
pub fn timer_slacks(id: &str) -> Result<Vec<u64>, EngineError> {
    let read = |tid: &u32| fs::read_to_string(slack_file(*tid)).ok()?.trim().parse().ok();
    Ok(tasks_of(id)?.iter().filter_map(read).collect())
}

fn slack_file(tid: u32) -> String {
    format!("/proc/{tid}/timerslack_ns")
}

/// The ids of every task (thread) of the sandbox's cgroup, v2 or v1.
fn tasks_of(id: &str) -> Result<Vec<u32>, EngineError> {
    let v2 = cgroup_dir(None, id).join("cgroup.threads");
    let listing = if v2.exists() { v2 } else { cgroup_dir(Some("freezer"), id).join("tasks") };
    let tasks = fs::read_to_string(&listing).map_err(EngineError::io("listing the sandbox's tasks"))?;
    Ok(tasks.split_whitespace().filter_map(|tid| tid.parse().ok()).collect())
}

/// The size of `/dev/shm`: a quarter of the sandbox's memory.
fn shm_kib(memory_mib: u32) -> u32 {
    memory_mib.max(4) * 1024 / 4
}

/// The sandbox's cgroup, relative to each controller's root.
pub fn cgroup_path(id: &str) -> PathBuf {
    PathBuf::from(format!("/space/{id}"))
}

/// The sandbox's cgroup directory: under a cgroup v1 `controller`, or in
/// the v2 hierarchy (None).
fn cgroup_dir(controller: Option<&str>, id: &str) -> PathBuf {
    let cgroup = cgroup_path(id);
    let relative = cgroup.strip_prefix("/").unwrap_or(&cgroup);
    Path::new("/sys/fs/cgroup").join(controller.unwrap_or("")).join(relative)
}

fn oci_config(spec: &SandboxSpec, agent_bin: &Path) -> Result<Spec, EngineError> {
    let invalid = |e: oci_spec::OciSpecError| EngineError::Runtime(format!("building the OCI spec: {e}"));
    let caps: std::collections::HashSet<Capability> = CAPABILITIES.iter().copied().collect();
    // The agent alone also holds CAP_SYS_ADMIN, to take a new hostname when
    // a fork wakes as another sandbox; it drops it from its bounding set at
    // start, so nothing it runs can hold it (see the agent's `main.rs`).
    let mut agents = caps.clone();
    agents.insert(Capability::SysAdmin);
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(agents.clone())
        .effective(agents.clone())
        .permitted(agents)
        .inheritable(caps.clone())
        .ambient(caps)
        .build()
        .map_err(invalid)?;
    let agent_in_root = format!("/{AGENT_PATH_IN_ROOT}");
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(0u32).gid(0u32).build().map_err(invalid)?)
        .args(vec![agent_in_root.clone()])
        .env(vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            format!("SPACE_AGENT_SOCKET=/{HOST_DIR_IN_ROOT}/{SOCKET_NAME}"),
        ])
        .cwd("/")
        .capabilities(capabilities)
        .no_new_privileges(false)
        .build()
        .map_err(invalid)?;
    let root = RootBuilder::default().path(spec.dir.join("rootfs")).readonly(false).build().map_err(invalid)?;

    let mut mounts = Spec::default().mounts().clone().unwrap_or_default();
    // `/dev/shm` is memory: a quarter of the sandbox's, so filling it can
    // never take the sandbox's memory alone. (`/dev` itself takes no size
    // from here: runsc mounts a `/dev` of its own whatever the spec says,
    // and the agent puts a capped tmpfs over it, `init::cap_dev`.)
    for mount in mounts.iter_mut().filter(|m| m.destination() == Path::new("/dev/shm")) {
        let mut options = mount.options().clone().unwrap_or_default();
        options.retain(|o| !o.starts_with("size="));
        options.push(format!("size={}k", shm_kib(spec.memory_mib)));
        mount.set_options(Some(options));
    }
    // `/tmp` is disk, as on a normal machine, under the sandbox's disk
    // quota: runsc would otherwise put a tmpfs there (memory), and a build
    // that fills `/tmp` would take the sandbox's memory.
    mounts.push(
        MountBuilder::default()
            .destination("/tmp")
            .typ("bind")
            .source(spec.dir.join("rootfs/tmp"))
            .options(vec!["rbind".to_string(), "rw".to_string()])
            .build()
            .map_err(invalid)?,
    );
    mounts.push(
        MountBuilder::default()
            .destination(agent_in_root)
            .typ("bind")
            .source(agent_bin)
            .options(vec!["rbind".to_string(), "ro".to_string()])
            .build()
            .map_err(invalid)?,
    );
    mounts.push(
        MountBuilder::default()
            .destination(format!("/{HOST_DIR_IN_ROOT}"))
            .typ("bind")
            .source(Gvisor::socket_dir(&spec.dir))
            // Read-only: connecting to the host's socket needs no write to
            // the directory, and nothing the sandbox writes may land in a
            // host directory outside its disk quota.
            .options(vec!["rbind".to_string(), "ro".to_string()])
            .build()
            .map_err(invalid)?,
    );

    // The sentry and gofer run in a cgroup of their own (`space/<id>`):
    // memory (the guest's share plus the sentry's own), CPU quota, and
    // host tasks (the sentry's threads; guest processes are not host tasks).
    let resources = LinuxResourcesBuilder::default()
        .memory(
            LinuxMemoryBuilder::default()
                .limit(memory_limit_bytes(spec.memory_mib))
                .swap(memory_limit_bytes(spec.memory_mib))
                .build()
                .map_err(invalid)?,
        )
        .cpu(
            LinuxCpuBuilder::default()
                .period(CPU_PERIOD_US)
                .quota(i64::from(spec.vcpus.max(1)) * CPU_PERIOD_US as i64)
                .build()
                .map_err(invalid)?,
        )
        .pids(LinuxPidsBuilder::default().limit(HOST_TASKS_LIMIT).build().map_err(invalid)?)
        .build()
        .map_err(invalid)?;
    let mut linux = Spec::default().linux().clone().unwrap_or_default();
    linux.set_cgroups_path(Some(cgroup_path(&spec.id)));
    linux.set_resources(Some(resources));

    let mut config = Spec::default();
    config.set_linux(Some(linux));
    config.set_process(Some(process));
    config.set_root(Some(root));
    config.set_hostname(Some(spec.hostname.clone()));
    config.set_mounts(Some(mounts));
    Ok(config)
}

impl Gvisor {
    /// The status runsc recorded for the sandbox, if its state file reads
    /// and names a sandbox process; Gone when that process is not runsc's.
    fn recorded_status(&self, spec: &SandboxSpec) -> Option<LiveStatus> {
        let file = self.config.state_dir.join(format!("{0}_sandbox:{0}.state", spec.id));
        let state: serde_json::Value = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes).ok()?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Some(LiveStatus::Gone),
            Err(_) => return None,
        };
        let pid = state["sandbox"]["pid"].as_u64()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let alive = String::from_utf8_lossy(&cmdline).contains(spec.id.as_str());
        Some(if alive { live_status(state["status"].as_str()) } else { LiveStatus::Gone })
    }
}

/// Removes the sandbox's cgroups that runsc left: it removes only those it
/// made, and one made by a killed server's `runsc run` would otherwise be
/// joined, and then kept, by the next start under the same id.
fn remove_cgroups(id: &str) {
    let relative = cgroup_path(id);
    let relative = relative.strip_prefix("/").unwrap_or(&relative);
    let Ok(controllers) = fs::read_dir("/sys/fs/cgroup") else { return };
    let dirs =
        controllers.flatten().map(|c| c.path().join(relative)).chain([Path::new("/sys/fs/cgroup").join(relative)]);
    for dir in dirs.filter(|dir| dir.is_dir()) {
        // Its last processes may still be leaving: a few tries.
        for _ in 0..50 {
            match fs::remove_dir(&dir) {
                Err(err) if err.raw_os_error() == Some(nix::libc::EBUSY) => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => break,
            }
        }
    }
}

/// The processes whose arguments satisfy `matches`.
fn processes_where(matches: impl Fn(&[&str]) -> bool) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let text = String::from_utf8_lossy(&cmdline);
            let args: Vec<&str> = text.split('\0').filter(|a| !a.is_empty()).collect();
            !args.is_empty() && matches(&args)
        })
        .collect()
}

/// Whether `pid` still runs (a zombie does not).
fn alive(pid: i32) -> bool {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
}

/// What runsc's status of a container says of its sandbox.
fn live_status(status: Option<&str>) -> LiveStatus {
    match status {
        Some("running") => LiveStatus::Running,
        Some("paused") => LiveStatus::Paused,
        _ => LiveStatus::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_runs_the_agent_with_its_two_binds() {
        let spec = SandboxSpec {
            id: "sbx_test".into(),
            dir: PathBuf::from("/data/sandboxes/sbx_test"),
            template_rootfs: PathBuf::from("/data/templates/base/1/rootfs"),
            hostname: "sbx_test".into(),
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 1024,
            env: Default::default(),
            workdir: None,
            user: None,
            engine: None,
            trust_pem: None,
        };
        let config = serde_json::to_value(oci_config(&spec, Path::new("/opt/space-agent")).unwrap()).unwrap();
        assert_eq!(config["process"]["args"][0], "/.space/space-agent");
        assert_eq!(config["root"]["path"], "/data/sandboxes/sbx_test/rootfs");
        assert_eq!(config["hostname"], "sbx_test");
        let mounts = config["mounts"].as_array().unwrap();
        let bind_sources: Vec<&str> =
            mounts.iter().filter(|m| m["type"] == "bind").map(|m| m["source"].as_str().unwrap()).collect();
        assert_eq!(
            bind_sources,
            ["/data/sandboxes/sbx_test/rootfs/tmp", "/opt/space-agent", "/data/sandboxes/sbx_test/sock"]
        );
        let host_dir = mounts.iter().find(|m| m["destination"] == "/.space/host").unwrap();
        assert!(host_dir["options"].as_array().unwrap().contains(&"ro".into()), "read-only: {host_dir}");
        let shm = mounts.iter().find(|m| m["destination"] == "/dev/shm").unwrap();
        assert!(shm["options"].as_array().unwrap().contains(&"size=65536k".into()), "{shm}");
        let namespaces: Vec<&str> =
            config["linux"]["namespaces"].as_array().unwrap().iter().map(|n| n["type"].as_str().unwrap()).collect();
        assert!(namespaces.contains(&"network") && namespaces.contains(&"pid"), "{namespaces:?}");
    }

    #[test]
    fn whatever_stands_at_tmp_becomes_a_real_directory_and_no_link_is_followed() {
        let scratch = std::env::temp_dir().join(format!("space-tmp-check-{}", std::process::id()));
        let _ = fs::remove_dir_all(&scratch);
        fs::create_dir_all(scratch.join("target")).unwrap();
        fs::write(scratch.join("target/keep"), "host file").unwrap();
        let tmp = scratch.join("tmp");
        let check = |tmp: &Path| {
            let meta = fs::symlink_metadata(tmp).unwrap();
            assert!(meta.file_type().is_dir(), "{meta:?}");
            assert_eq!(meta.permissions().mode() & 0o7777, 0o1777);
        };
        // A link to a host directory: replaced, its target untouched (not
        // even its mode).
        fs::set_permissions(scratch.join("target"), fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(scratch.join("target"), &tmp).unwrap();
        ensure_real_dir(&tmp).unwrap();
        check(&tmp);
        assert_eq!(fs::read_to_string(scratch.join("target/keep")).unwrap(), "host file");
        assert_eq!(fs::metadata(scratch.join("target")).unwrap().permissions().mode() & 0o7777, 0o700);
        assert!(fs::read_dir(&tmp).unwrap().next().is_none());
        // A FIFO, a plain file: replaced.
        fs::remove_dir(&tmp).unwrap();
        nix::unistd::mkfifo(&tmp, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        ensure_real_dir(&tmp).unwrap();
        check(&tmp);
        fs::remove_dir(&tmp).unwrap();
        fs::write(&tmp, "a file").unwrap();
        ensure_real_dir(&tmp).unwrap();
        check(&tmp);
        // A real directory keeps what the sandbox left in it.
        fs::write(tmp.join("work"), "sandbox file").unwrap();
        ensure_real_dir(&tmp).unwrap();
        assert_eq!(fs::read_to_string(tmp.join("work")).unwrap(), "sandbox file");
        fs::remove_dir_all(&scratch).unwrap();
    }
}
