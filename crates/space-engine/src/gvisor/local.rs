//! The gVisor engine's privileged work done in this process, as root:
//! `runsc` and its state, the OCI bundle, btrfs roots and quotas, the
//! agent's socket, the cgroup freezer and the timer slack of the sandbox's
//! tasks. What the engine asks of it is the [`EngineHost`] request set; a
//! root helper serves the same requests over its socket from this code.
//!
//! Every path is derived from ids by [`Layout`]; none comes from a caller.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use oci_spec::runtime::{
    Capability, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxMemoryBuilder, LinuxPidsBuilder, LinuxResourcesBuilder,
    MountBuilder, ProcessBuilder, RootBuilder, Spec, UserBuilder,
};
use space_host::btrfs;
use space_host::template::{AGENT_PATH_IN_ROOT, HOST_DIR_IN_ROOT};
use space_privsep::layout::Layout;
use space_privsep::proto::{
    ChainId, EngineState, ImageRef, Mount, PatienceMs, SandboxId, Shape, SlackNs, StartFrom, TemplateRef,
};
use space_process::Reaper;

use super::{cgroup_dir, cgroup_path, tasks_of, FREEZE_PATIENCE, SOCKET_NAME};
use crate::host::{EngineHost, Launched};
use crate::{EngineError, Steps};

/// In an image: the copy of the sandbox's root, and its memory.
const IMAGE_ROOT: &str = "rootfs";
const IMAGE_MEMORY: &str = "memory";

/// What the in-process host needs: the binaries and where runsc keeps its
/// state; everything else is under the layout's data dir.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    pub runsc: PathBuf,
    pub agent_bin: PathBuf,
    /// `runsc --root`.
    pub state_dir: PathBuf,
    pub layout: Layout,
}

/// [`EngineHost`] in this process (which must be root).
#[derive(Debug, Clone)]
pub struct LocalHost {
    config: LocalConfig,
}

impl LocalHost {
    /// Also starts looking after the memory of the sandboxes under
    /// `config.state_dir` (cgroup v1 hosts, see [`crate::oom_relief`]).
    pub fn new(config: LocalConfig) -> LocalHost {
        crate::oom_relief::watch(&config.state_dir);
        LocalHost { config }
    }

    fn layout(&self) -> &Layout {
        &self.config.layout
    }

    /// runsc with its global flags (see [`super::Gvisor::runsc`]).
    fn runsc(&self) -> Command {
        super::runsc_command(&self.config.runsc, &self.config.state_dir)
    }

    /// Runs one runsc subcommand, its failure an engine error.
    fn runsc_run<const N: usize>(&self, args: [&str; N]) -> Result<(), EngineError> {
        space_host::run(self.runsc().args(args)).map(drop).map_err(|e| EngineError::Runtime(e.to_string()))
    }

    /// Writes the OCI bundle: `config.json` with the sandbox's own root,
    /// the agent as PID 1, the binds it needs and its volumes (each one
    /// there, a restore a killed process left half done finished first;
    /// the read-only ones' views mounted, for [`crate::volumes::drop_views`]
    /// once runsc has its own copies).
    fn write_bundle(&self, sandbox: &SandboxId, shape: Shape, mounts: &[Mount]) -> Result<(), EngineError> {
        crate::volumes::drop_views(&self.layout().volume_views(sandbox));
        for mount in mounts {
            crate::volumes::settle(self.layout(), &mount.volume)?;
            let data = self.layout().volume_data(&mount.volume);
            if !fs::symlink_metadata(&data).is_ok_and(|meta| meta.is_dir()) {
                return Err(EngineError::Runtime(format!("volume {} is not on this host", mount.volume)));
            }
            if fs::symlink_metadata(self.layout().volume_image(&mount.volume)).is_ok() {
                return Err(EngineError::Runtime(format!(
                    "volume {} is an ext4 image, made for Firecracker sandboxes: gVisor mounts directory volumes",
                    mount.volume
                )));
            }
            let view = self.layout().volume_view(sandbox, &mount.volume);
            if mount.read_only && !view.exists() {
                crate::volumes::mount_view(&data, &view)?;
            }
        }
        let bundle = self.layout().bundle_dir(sandbox);
        fs::create_dir_all(&bundle).map_err(EngineError::io("creating the bundle dir"))?;
        let config = oci_config(self.layout(), sandbox, shape, &self.config.agent_bin, mounts)?;
        let json = serde_json::to_vec_pretty(&config).map_err(|e| EngineError::Runtime(e.to_string()))?;
        fs::write(bundle.join("config.json"), json).map_err(EngineError::io("writing config.json"))
    }

    fn make_socket_dir(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        let socket_dir = self.layout().socket_dir(sandbox);
        fs::create_dir_all(&socket_dir).map_err(EngineError::io("creating the socket dir"))?;
        fs::set_permissions(&socket_dir, fs::Permissions::from_mode(0o700)).map_err(EngineError::io("chmod"))
    }

    /// A fresh root from the template's, under the disk quota, and the
    /// socket directory. Returns when the quota was set (the
    /// bundle counts with the agent's socket as one step).
    fn prepare_root(
        &self,
        sandbox: &SandboxId,
        template: &TemplateRef,
        shape: Shape,
        steps: &mut Steps,
    ) -> Result<Instant, EngineError> {
        self.root_from(sandbox, &self.layout().template_root(template), shape, steps, false)
    }

    /// A build sandbox's root: a writable snapshot of a layer chain, under
    /// the disk quota, the agent and its mount points put in (a chain has
    /// neither), the chain recorded for `SaveLayer`; then the socket
    /// directory and bundle.
    fn prepare_from_chain(
        &self,
        sandbox: &SandboxId,
        chain: &ChainId,
        shape: Shape,
        steps: &mut Steps,
    ) -> Result<Instant, EngineError> {
        let chain_root = self.layout().layer_root(chain);
        if !fs::symlink_metadata(&chain_root).is_ok_and(|meta| meta.is_dir()) {
            return Err(EngineError::Runtime(format!("layer chain {chain} is not in the cache")));
        }
        fs::create_dir_all(self.layout().sandbox_dir(sandbox)).map_err(EngineError::io("creating the sandbox dir"))?;
        // Recorded before the root exists: a root with no record is never
        // kept as a layer, whatever failed half way.
        fs::write(self.layout().sandbox_chain(sandbox), chain.as_str())
            .map_err(EngineError::io("recording the sandbox's chain"))?;
        self.root_from(sandbox, &chain_root, shape, steps, true)
    }

    /// The sandbox's root as a writable snapshot of `source` under the disk
    /// quota (with the agent put in when `with_agent`), then its socket
    /// directory and bundle; when the quota was set.
    fn root_from(
        &self,
        sandbox: &SandboxId,
        source: &Path,
        shape: Shape,
        steps: &mut Steps,
        with_agent: bool,
    ) -> Result<Instant, EngineError> {
        let mut lap = Instant::now();
        let mut step = |name: &'static str| {
            steps.push((name, lap.elapsed()));
            lap = Instant::now();
        };
        let root = self.layout().sandbox_root(sandbox);
        fs::create_dir_all(self.layout().sandbox_dir(sandbox)).map_err(EngineError::io("creating the sandbox dir"))?;
        btrfs::snapshot(source, &root)?;
        step("root snapshot (btrfs)");
        btrfs::limit_exclusive(&root, shape.disk_mib.get())?;
        step("disk limit (btrfs qgroup)");
        let limited = Instant::now();
        if with_agent {
            space_host::template::install_agent(&root, &self.config.agent_bin)?;
        }
        self.make_socket_dir(sandbox)?;
        Ok(limited)
    }

    /// The sandbox's own writable copy of an image's root (in place of any
    /// root it had), its socket directory and its bundle.
    fn prepare_from_image(&self, sandbox: &SandboxId, image: &Path, shape: Shape) -> Result<(), EngineError> {
        fs::create_dir_all(self.layout().sandbox_dir(sandbox)).map_err(EngineError::io("creating the sandbox dir"))?;
        let root = self.layout().sandbox_root(sandbox);
        btrfs::delete_subvolume(&root)?;
        // A suspend's snapshot no longer applies to what runs from here.
        let _ = fs::remove_dir_all(self.layout().snapshot_dir(sandbox));
        btrfs::snapshot(&image.join(IMAGE_ROOT), &root)?;
        btrfs::limit_exclusive(&root, shape.disk_mib.get())?;
        self.make_socket_dir(sandbox)
    }

    /// `/tmp` made safe and the agent's socket bound, just before runsc
    /// runs (or the agent redials).
    fn bind_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        // runsc resolves `/tmp`'s bind source on the host: the sandbox
        // could have made it a link. Nothing of the sandbox runs now.
        ensure_real_dir(&self.layout().sandbox_root(sandbox).join("tmp"))?;
        // Whatever the sandbox left in its socket directory goes first.
        let socket_path = self.layout().socket_dir(sandbox).join(SOCKET_NAME);
        if fs::symlink_metadata(&socket_path).is_ok() {
            fs::remove_file(&socket_path).map_err(EngineError::io("clearing the socket path"))?;
        }
        let listener = UnixListener::bind(&socket_path).map_err(EngineError::io("binding the agent socket"))?;
        listener.set_nonblocking(true).map_err(EngineError::io("socket mode"))?;
        Ok(listener)
    }

    /// Where an image a sandbox starts from keeps its root and memory.
    fn image_dir(&self, from: &StartFrom) -> Option<PathBuf> {
        match from {
            StartFrom::Template { .. }
            | StartFrom::Suspended {}
            | StartFrom::Clone { .. }
            | StartFrom::Layer { .. } => None,
            StartFrom::Image { source, image } => Some(self.layout().image_dir(source, image)),
            StartFrom::TemplateImage { template } => Some(self.layout().template_dir(template)),
        }
    }

    /// The status runsc recorded for the sandbox, if its state file reads
    /// and names a sandbox process; Missing when that process is not runsc's.
    fn recorded_state(&self, sandbox: &SandboxId) -> Option<EngineState> {
        let file = self.config.state_dir.join(format!("{0}_sandbox:{0}.state", sandbox.as_str()));
        let state: serde_json::Value = match fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes).ok()?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Some(EngineState::Missing),
            Err(_) => return None,
        };
        let pid = state["sandbox"]["pid"].as_u64()?;
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let alive = String::from_utf8_lossy(&cmdline).contains(sandbox.as_str());
        Some(if alive { engine_state(state["status"].as_str()) } else { EngineState::Missing })
    }

    /// The agent's socket bound, then `runsc run` (no `memory`) or `runsc
    /// restore` of the bundle; the volumes' views go once runsc returned
    /// (the sandbox's mounts are its own copies by then).
    fn launch(
        &self,
        sandbox: &SandboxId,
        memory: Option<PathBuf>,
        lap: Instant,
        mut steps: Steps,
    ) -> Result<Launched, EngineError> {
        let views = self.layout().volume_views(sandbox);
        let listener = self.bind_agent(sandbox)?;
        steps.push(("bundle and agent socket", lap.elapsed()));

        let log_path = self.layout().engine_log(sandbox);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(EngineError::io("opening runsc.log"))?;
        let log_err = log.try_clone().map_err(EngineError::io("runsc.log"))?;
        let mut run = self.runsc();
        let how = match &memory {
            None => {
                run.args(["run", "--detach"]);
                "run"
            }
            Some(memory) => {
                run.args(["restore", "--detach", "--image-path"]).arg(memory);
                "restore"
            }
        };
        run.arg("--bundle")
            .arg(self.layout().bundle_dir(sandbox))
            .arg(sandbox.as_str())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = Reaper::global().spawn(&mut run).map_err(EngineError::io("starting runsc"))?;
        let pid = child.id();
        let finished = Box::new(move || {
            let status = child.wait();
            crate::volumes::drop_views(&views);
            if status.success() {
                Ok(())
            } else {
                Err(EngineError::Runtime(format!("runsc {how} failed ({status:?}): {}", log_tail(&log_path))))
            }
        });
        Ok(Launched { listener, pid, finished, steps })
    }
}

impl EngineHost for LocalHost {
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<Launched, EngineError> {
        // A new root (a template's, another sandbox's image) goes into a new
        // sandbox only: whoever asks may not replace a root someone else's
        // sandbox runs on. A sandbox going back to its own image or
        // snapshot keeps its id; every caller destroys a failed start's
        // leftovers before starting again.
        let new_root = match from {
            StartFrom::Clone { .. } => {
                return Err(EngineError::Runtime("gVisor sandboxes are no clones of a saved microVM".into()))
            }
            StartFrom::Template { .. } | StartFrom::TemplateImage { .. } | StartFrom::Layer { .. } => true,
            StartFrom::Image { source, .. } => source != sandbox,
            StartFrom::Suspended {} => false,
        };
        if new_root && fs::symlink_metadata(self.layout().sandbox_dir(sandbox)).is_ok() {
            return Err(EngineError::Runtime(format!(
                "sandbox {sandbox} exists: a start from a template or another sandbox's image makes a new one"
            )));
        }
        let mut steps = Steps::new();
        let (memory, lap) = match from {
            StartFrom::Template { template } => (None, self.prepare_root(sandbox, template, shape, &mut steps)?),
            StartFrom::Layer { chain } => (None, self.prepare_from_chain(sandbox, chain, shape, &mut steps)?),
            StartFrom::Suspended {} => (Some(self.layout().snapshot_dir(sandbox)), Instant::now()),
            StartFrom::Image { .. } | StartFrom::TemplateImage { .. } | StartFrom::Clone { .. } => {
                let image = self.image_dir(from).unwrap_or_default();
                self.prepare_from_image(sandbox, &image, shape)?;
                (Some(image.join(IMAGE_MEMORY)), Instant::now())
            }
        };
        // Every start writes its bundle anew, a restore from a suspend too:
        // the volumes are the spec's now, never those of an older bundle.
        let views = self.layout().volume_views(sandbox);
        let launched =
            self.write_bundle(sandbox, shape, mounts).and_then(|()| self.launch(sandbox, memory, lap, steps));
        if launched.is_err() {
            crate::volumes::drop_views(&views);
        }
        launched
    }

    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.runsc_run(["pause", sandbox.as_str()])
    }

    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.runsc_run(["resume", sandbox.as_str()])
    }

    fn freeze(&self, sandbox: &SandboxId, frozen: bool) -> Result<(), EngineError> {
        set_frozen(sandbox.as_str(), frozen)
    }

    fn set_timer_slack(&self, sandbox: &SandboxId, slack: Option<SlackNs>) -> Result<usize, EngineError> {
        set_timer_slack(sandbox.as_str(), slack.map(SlackNs::get))
    }

    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        let snapshot = self.layout().snapshot_dir(sandbox);
        let _ = fs::remove_dir_all(&snapshot);
        fs::create_dir_all(&snapshot).map_err(EngineError::io("creating the snapshot dir"))?;
        let image = snapshot.to_string_lossy().into_owned();
        self.runsc_run(["checkpoint", "--image-path", &image, sandbox.as_str()])?;
        // The checkpointed container has stopped; free its runsc state so
        // no engine process of it is left while it is suspended.
        self.runsc_run(["delete", "--force", sandbox.as_str()])
    }

    /// Frozen (`runsc pause`) for the instant: the root is snapshotted
    /// (btrfs, atomic) and the memory checkpointed with `--leave-running`
    /// (which keeps a paused sandbox paused), then thawed, so disk and
    /// memory are of the same instant.
    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError> {
        let image = self.layout().image_dir(sandbox, image);
        let memory = image.join(IMAGE_MEMORY);
        fs::create_dir_all(&memory).map_err(EngineError::io("creating the image dir"))?;
        self.runsc_run(["pause", sandbox.as_str()])?;
        let frozen = Instant::now();
        let saved = btrfs::snapshot(&self.layout().sandbox_root(sandbox), &image.join(IMAGE_ROOT))
            .map_err(EngineError::from)
            .and_then(|()| {
                let memory = memory.to_string_lossy().into_owned();
                self.runsc_run(["checkpoint", "--leave-running", "--image-path", &memory, sandbox.as_str()])
            });
        let thawed = self.runsc_run(["resume", sandbox.as_str()]);
        let frozen = frozen.elapsed();
        saved?;
        thawed?;
        Ok(frozen)
    }

    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError> {
        // Its memory files and its disk (a subvolume of its own).
        btrfs::remove_tree(&self.layout().image_dir(sandbox, image)).map_err(EngineError::from)
    }

    fn drop_snapshot(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        let _ = fs::remove_dir_all(self.layout().snapshot_dir(sandbox));
        Ok(())
    }

    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        // A frozen sandbox takes no signal, not even SIGKILL, until thawed.
        let _ = set_frozen(sandbox.as_str(), false);
        let deleted = space_host::run(self.runsc().args(["delete", "--force", sandbox.as_str()]));
        // runsc removes only cgroups it made: not those of a sandbox whose
        // processes a restarted server killed (a warm member it swept).
        remove_cgroups(sandbox.as_str());
        deleted.map(drop).map_err(|e| EngineError::Runtime(e.to_string()))
    }

    /// Every process started with this `--root` that names the sandbox
    /// (its id as an argument, or a path in its directory) is killed —
    /// thawed first — and waited for.
    fn stop_strays(&self, sandbox: &SandboxId) {
        let root = format!("--root={}", self.config.state_dir.display());
        let dir = format!("{}/", self.layout().sandbox_dir(sandbox).display());
        let strays = processes_where(|args| {
            args.iter().any(|a| *a == root) && args.iter().any(|a| *a == sandbox.as_str() || a.contains(&dir))
        });
        if strays.is_empty() {
            return;
        }
        tracing::info!(sandbox = %sandbox, count = strays.len(), "killing engine processes a previous server left");
        let _ = set_frozen(sandbox.as_str(), false);
        for pid in &strays {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
        }
        let deadline = Instant::now() + FREEZE_PATIENCE;
        while strays.iter().any(|pid| alive(*pid)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The commands are `runsc` processes with this `--root` (not the
    /// sandboxes' own `runsc-sandbox` and `runsc-gofer`).
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
    fn settle_orphans(&self, sandboxes: &[SandboxId], patience: PatienceMs) {
        if sandboxes.is_empty() {
            return;
        }
        let patience = Duration::from_millis(u64::from(patience.get()));
        let root = format!("--root={}", self.config.state_dir.display());
        let orphans = || {
            processes_where(|args| {
                Path::new(args[0]).file_name().is_some_and(|name| name == "runsc")
                    && args.contains(&root.as_str())
                    && args.iter().any(|arg| sandboxes.iter().any(|id| id.as_str() == *arg))
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

    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        // `delete --force` kills the sandbox if it still runs (thawed first:
        // a frozen one takes no signal). A container that never existed
        // makes it fail, which is fine here.
        let _ = set_frozen(sandbox.as_str(), false);
        let _ = space_host::run(self.runsc().args(["delete", "--force", sandbox.as_str()]));
        remove_cgroups(sandbox.as_str());
        // A start killed before its runsc returned leaves its views mounted:
        // they go before anything below the sandbox's dir is removed.
        crate::volumes::drop_views(&self.layout().volume_views(sandbox));
        btrfs::delete_subvolume(&self.layout().sandbox_root(sandbox))?;
        // Images (a fork's, checkpoints) hold subvolumes of their own.
        let dir = self.layout().sandbox_dir(sandbox);
        btrfs::remove_tree(&dir)?;
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(EngineError::io("removing the sandbox dir"))?;
        }
        Ok(())
    }

    fn state(&self, sandbox: &SandboxId) -> EngineState {
        let Ok(out) = space_host::run(self.runsc().args(["state", sandbox.as_str()])) else {
            return EngineState::Missing;
        };
        let state: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        engine_state(state["status"].as_str())
    }

    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState> {
        sandboxes.iter().map(|id| self.recorded_state(id).unwrap_or_else(|| self.state(id))).collect()
    }

    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        self.bind_agent(sandbox)
    }

    fn close_agent(&self, sandbox: &SandboxId) {
        // The agent is in, so its cgroup exists: looked after from now,
        // before anything runs in it, not from the next rescan.
        crate::oom_relief::started();
        let _ = fs::remove_file(self.layout().socket_dir(sandbox).join(SOCKET_NAME));
    }

    fn availability(&self) -> (bool, String) {
        match space_host::run(self.runsc().arg("--version")) {
            Err(err) => (false, format!("runsc is not usable ({err}); run `space setup` to install it")),
            Ok(_) if !self.config.agent_bin.is_file() => {
                (false, format!("the agent binary {} is missing", self.config.agent_bin.display()))
            }
            Ok(out) => (true, String::from_utf8_lossy(&out).lines().next().unwrap_or("runsc").to_string()),
        }
    }

    fn engine_log(&self, sandbox: &SandboxId) -> String {
        log_tail(&self.layout().engine_log(sandbox))
    }
}

/// What runsc's status of a container says of its sandbox.
fn engine_state(status: Option<&str>) -> EngineState {
    match status {
        Some("running") => EngineState::Running,
        Some("paused") => EngineState::Paused,
        Some(_) => EngineState::Stopped,
        None => EngineState::Missing,
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

/// How long a starting server waits for a killed one's `runsc pause` or
/// `resume` before it kills it (see `Gvisor::settle_running`).
const PAUSE_PATIENCE: Duration = Duration::from_secs(60);

/// Whether process `pid` is a `runsc pause` or `runsc resume`.
fn pausing(pid: i32) -> bool {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let text = String::from_utf8_lossy(&cmdline);
    text.split('\0').any(|arg| arg == "pause" || arg == "resume")
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
        done.extend(new.into_iter().filter(|tid| fs::write(super::slack_file(*tid), &value).is_ok()));
    }
    Ok(done.len())
}

/// Linux's timer slack for a task nobody set one for, in ns.
const DEFAULT_TIMER_SLACK_NS: u64 = 50_000;

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

/// The size of `/dev/shm`: a quarter of the sandbox's memory.
fn shm_kib(memory_mib: u32) -> u32 {
    memory_mib.max(4) * 1024 / 4
}

/// The sandbox's hostname at boot, the platform's rule for it
/// (`space_core::ids::hostname_for`); the agent sets the one its welcome
/// names at every handshake.
fn hostname_of(sandbox: &SandboxId) -> String {
    sandbox.as_str().replace('_', "-")
}

/// The sandbox's OCI spec, made from its id and sizes alone: whoever asks
/// for a start cannot add a mount, a capability or a path.
pub(super) fn oci_config(
    layout: &Layout,
    sandbox: &SandboxId,
    shape: Shape,
    agent_bin: &Path,
    volumes: &[Mount],
) -> Result<Spec, EngineError> {
    let invalid = |e: oci_spec::OciSpecError| EngineError::Runtime(format!("building the OCI spec: {e}"));
    let (memory_mib, vcpus) = (shape.memory_mib.get(), shape.vcpus.get());
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
    let rootfs = layout.sandbox_root(sandbox);
    let root = RootBuilder::default().path(&rootfs).readonly(false).build().map_err(invalid)?;

    let mut mounts = Spec::default().mounts().clone().unwrap_or_default();
    // `/dev/shm` is memory: a quarter of the sandbox's, so filling it can
    // never take the sandbox's memory alone. (`/dev` itself takes no size
    // from here: runsc mounts a `/dev` of its own whatever the spec says,
    // and the agent puts a capped tmpfs over it, `init::cap_dev`.)
    for mount in mounts.iter_mut().filter(|m| m.destination() == Path::new("/dev/shm")) {
        let mut options = mount.options().clone().unwrap_or_default();
        options.retain(|o| !o.starts_with("size="));
        options.push(format!("size={}k", shm_kib(memory_mib)));
        mount.set_options(Some(options));
    }
    // `/tmp` is disk, as on a normal machine, under the sandbox's disk
    // quota: runsc would otherwise put a tmpfs there (memory), and a build
    // that fills `/tmp` would take the sandbox's memory.
    mounts.push(
        MountBuilder::default()
            .destination("/tmp")
            .typ("bind")
            .source(rootfs.join("tmp"))
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
            .source(layout.socket_dir(sandbox))
            // Read-only: connecting to the host's socket needs no write to
            // the directory, and nothing the sandbox writes may land in a
            // host directory outside its disk quota.
            .options(vec!["rbind".to_string(), "ro".to_string()])
            .build()
            .map_err(invalid)?,
    );
    // Volumes after the platform's own mounts (whose places a mount path
    // can never be, `MountPath`): each one's `data` subvolume, through the
    // gofer like the root, so the sentry resolves every link in it inside
    // the sandbox's own view. A read-only one binds the volume's read-only
    // view, which the host's kernel keeps read-only whatever the engine
    // does (`volumes::mount_view`).
    for volume in volumes {
        let (access, source) = match volume.read_only {
            true => ("ro", layout.volume_view(sandbox, &volume.volume)),
            false => ("rw", layout.volume_data(&volume.volume)),
        };
        mounts.push(
            MountBuilder::default()
                .destination(volume.path.as_str())
                .typ("bind")
                .source(source)
                .options(vec!["rbind".to_string(), access.to_string()])
                .build()
                .map_err(invalid)?,
        );
    }

    // The sentry and gofer run in a cgroup of their own (`space/<id>`):
    // memory (the guest's share plus the sentry's own), CPU quota, and
    // host tasks (the sentry's threads; guest processes are not host tasks).
    let resources = LinuxResourcesBuilder::default()
        .memory(
            LinuxMemoryBuilder::default()
                .limit(memory_limit_bytes(memory_mib))
                .swap(memory_limit_bytes(memory_mib))
                .build()
                .map_err(invalid)?,
        )
        .cpu(
            LinuxCpuBuilder::default()
                .period(CPU_PERIOD_US)
                .quota(i64::from(vcpus) * CPU_PERIOD_US as i64)
                .build()
                .map_err(invalid)?,
        )
        .pids(LinuxPidsBuilder::default().limit(HOST_TASKS_LIMIT).build().map_err(invalid)?)
        .build()
        .map_err(invalid)?;
    let mut linux = Spec::default().linux().clone().unwrap_or_default();
    linux.set_cgroups_path(Some(cgroup_path(sandbox.as_str())));
    linux.set_resources(Some(resources));

    let mut config = Spec::default();
    config.set_linux(Some(linux));
    config.set_process(Some(process));
    config.set_root(Some(root));
    config.set_hostname(Some(hostname_of(sandbox)));
    config.set_mounts(Some(mounts));
    Ok(config)
}

#[cfg(test)]
mod tests {
    use space_privsep::proto::{DiskMib, MemoryMib, Vcpus};

    use super::*;

    #[test]
    fn the_bundle_runs_the_agent_with_its_two_binds() {
        let layout = Layout::new("/data");
        let sandbox = SandboxId::parse("sbx_0123456789abcdef0123").unwrap();
        let shape = Shape {
            memory_mib: MemoryMib::new(256).unwrap(),
            vcpus: Vcpus::new(2).unwrap(),
            disk_mib: DiskMib::new(1024).unwrap(),
        };
        let config =
            serde_json::to_value(oci_config(&layout, &sandbox, shape, Path::new("/opt/space-agent"), &[]).unwrap())
                .unwrap();
        assert_eq!(config["process"]["args"][0], "/.space/space-agent");
        assert_eq!(config["root"]["path"], "/data/sandboxes/sbx_0123456789abcdef0123/rootfs");
        assert_eq!(config["hostname"], "sbx-0123456789abcdef0123");
        let mounts = config["mounts"].as_array().unwrap();
        let bind_sources: Vec<&str> =
            mounts.iter().filter(|m| m["type"] == "bind").map(|m| m["source"].as_str().unwrap()).collect();
        assert_eq!(
            bind_sources,
            [
                "/data/sandboxes/sbx_0123456789abcdef0123/rootfs/tmp",
                "/opt/space-agent",
                "/data/sandboxes/sbx_0123456789abcdef0123/sock"
            ]
        );
        let host_dir = mounts.iter().find(|m| m["destination"] == "/.space/host").unwrap();
        assert!(host_dir["options"].as_array().unwrap().contains(&"ro".into()), "read-only: {host_dir}");
        let shm = mounts.iter().find(|m| m["destination"] == "/dev/shm").unwrap();
        assert!(shm["options"].as_array().unwrap().contains(&"size=65536k".into()), "{shm}");
        assert_eq!(config["linux"]["cgroupsPath"], "/space/sbx_0123456789abcdef0123");
        assert_eq!(config["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert_eq!(config["linux"]["resources"]["memory"]["limit"], (256 + 128) << 20);
        let namespaces: Vec<&str> =
            config["linux"]["namespaces"].as_array().unwrap().iter().map(|n| n["type"].as_str().unwrap()).collect();
        assert!(namespaces.contains(&"network") && namespaces.contains(&"pid"), "{namespaces:?}");
    }

    #[test]
    fn each_volume_is_bound_at_its_path_after_the_platforms_mounts() {
        use space_privsep::proto::{MountPath, VolumeId};
        let layout = Layout::new("/data");
        let sandbox = SandboxId::parse("sbx_0123456789abcdef0123").unwrap();
        let shape = Shape {
            memory_mib: MemoryMib::new(256).unwrap(),
            vcpus: Vcpus::new(1).unwrap(),
            disk_mib: DiskMib::new(1024).unwrap(),
        };
        let mount = |volume: &str, path: &str, read_only| Mount {
            volume: VolumeId::parse(volume).unwrap(),
            path: MountPath::parse(path).unwrap(),
            read_only,
        };
        let volumes = [
            mount("vol_0123456789abcdef0123", "/workspace", false),
            mount("vol_fedcba9876543210fedc", "/srv/shared", true),
        ];
        let config = oci_config(&layout, &sandbox, shape, Path::new("/opt/space-agent"), &volumes).unwrap();
        let config = serde_json::to_value(config).unwrap();
        let mounts = config["mounts"].as_array().unwrap();
        let last: Vec<(&str, &str, Vec<&str>)> = mounts[mounts.len() - 2..]
            .iter()
            .map(|m| {
                let options = m["options"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
                (m["destination"].as_str().unwrap(), m["source"].as_str().unwrap(), options)
            })
            .collect();
        assert_eq!(
            last,
            [
                ("/workspace", "/data/volumes/vol_0123456789abcdef0123/data", vec!["rbind", "rw"]),
                (
                    "/srv/shared",
                    "/data/sandboxes/sbx_0123456789abcdef0123/volume-views/vol_fedcba9876543210fedc",
                    vec!["rbind", "ro"]
                ),
            ]
        );
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
