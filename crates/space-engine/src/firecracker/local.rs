//! The Firecracker engine's root half: jails, root drives, VMM processes
//! and their cgroups, the VMMs' API sockets, snapshots and their files.
//! [`FirecrackerHost`] is the [`EngineHost`] of microVMs, in this process
//! or in the root helper (`space helper`), which answers the same requests
//! as for gVisor on connections whose hello names Firecracker.
//!
//! What it never does is talk to an agent: it binds the agent's listener
//! and hands it over; waiting for the agent, its handshake and quiescing a
//! template's microVM are the engine's ([`super::Firecracker`]), on the
//! unprivileged side when there is one.
//!
//! Every path a VMM is given for its own files is relative to its working
//! directory (the sandbox's directory, or `/` of its jail), so a snapshot
//! names the same files wherever it is loaded.

use std::collections::HashMap;
use std::fs;
use std::future::Future;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use space_privsep::layout::Layout;
use space_privsep::proto::{
    EngineState, ImageRef, Mount, PatienceMs, SandboxId, Shape, SlackNs, StartFrom, TemplateRef,
};

use super::api::{BootSource, Drive, MachineConfig, MemBackend, SnapshotCreate, SnapshotLoad, Vsock, VsockOverride};
use super::engine::FirecrackerConfig;
use super::{Vmm, VmmLimits};
use crate::host::{EngineHost, Launched};
use crate::EngineError;

const GUEST_CID: u32 = 3;
pub(super) const AGENT_PORT: u32 = 1024;
const BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off quiet";
/// What a guest with volume drives boots with besides: the keyboard
/// controller Firecracker emulates, found at once, so Ctrl-Alt-Del reaches
/// the agent (which unmounts the volumes before the guest stops).
pub const KEYBOARD_ARGS: &str = "i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd";
/// In a sandbox's directory: present when its microVM mounts volumes, so
/// it is stopped by Ctrl-Alt-Del before it is killed; it names the
/// volumes mounted read-write, whose images go back to root afterwards.
const HAS_VOLUMES: &str = "volume-drives";
/// How long a microVM with volumes has to stop by itself.
const STOP_PATIENCE: Duration = Duration::from_secs(5);
/// The ext4 root drive: in a template version's directory, in a sandbox's
/// and in a template snapshot.
const ROOT_DRIVE: &str = space_host::template::EXT4_IMAGE;
/// A snapshot's device state and memory.
const STATE: &str = "vm.state";
/// The VMM's end of the hybrid vsock (the host listens on `<it>_<port>`).
const VSOCK: &str = "vsock.sock";
const MEMORY: &str = "vm.mem";
/// How many uids jailed VMMs take one each from, from `jail_uid`.
const JAIL_UIDS: u32 = 65536;
/// How long a VMM a previous server (or helper) left has to tell its state.
const ADOPT_PATIENCE: Duration = Duration::from_secs(2);

/// The jailer and firecracker take letters, digits and `-` in an id.
pub(super) fn jail_id(id: &str) -> String {
    id.replace('_', "-")
}

/// Where a VMM's files are, as the host and as the VMM see them.
struct VmmFiles {
    /// The VMM's working directory on the host: the sandbox's directory,
    /// or the root of its jail.
    host: PathBuf,
    /// Whether the VMM is chrooted there.
    jailed: bool,
}

impl VmmFiles {
    /// A file of the VMM's own, as the VMM names it: relative to its
    /// working directory, so a snapshot's paths hold for every clone.
    fn own(name: &str) -> PathBuf {
        PathBuf::from(name)
    }

    /// A file shared with other VMMs (kernel, a template snapshot): linked
    /// into a jail under `name`, else named where it is.
    fn shared(&self, name: &str, host: &Path) -> PathBuf {
        if self.jailed {
            PathBuf::from(name)
        } else {
            host.to_path_buf()
        }
    }

    fn host(&self, name: &str) -> PathBuf {
        self.host.join(name)
    }

    /// Where the host listens for the agent (Firecracker's hybrid vsock
    /// connects the guest's CID 2 port to `<uds_path>_<port>`).
    fn agent_socket(&self) -> PathBuf {
        self.host(&format!("{VSOCK}_{AGENT_PORT}"))
    }
}

/// A VMM this host runs, whether it is paused, and the shape it was
/// started with (unknown for one taken back from a previous process).
struct Running {
    vmm: Vmm,
    paused: bool,
    shape: Option<Shape>,
}

/// The root work of Firecracker microVMs (see the module's doc).
pub struct FirecrackerHost {
    config: FirecrackerConfig,
    layout: Layout,
    vmms: Mutex<HashMap<SandboxId, Running>>,
    /// Held while a jail's uid is chosen and its root made, so two jails
    /// never take the same uid.
    jail_uids: Mutex<()>,
}

impl FirecrackerHost {
    pub fn new(config: FirecrackerConfig) -> FirecrackerHost {
        let layout = Layout::new(config.data_dir.clone());
        FirecrackerHost { config, layout, vmms: Mutex::new(HashMap::new()), jail_uids: Mutex::new(()) }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The sandbox's own snapshot.
    fn snapshot_dir(&self, sandbox: &SandboxId) -> PathBuf {
        self.layout.sandbox_dir(sandbox).join("snapshot")
    }

    /// The VMM's working directory: its jail's root, or the sandbox's dir.
    fn vmm_dir(&self, sandbox: &SandboxId) -> PathBuf {
        match &self.config.jailer {
            Some(_) => Vmm::jail_root(&self.config.firecracker, &self.config.jail_base, &jail_id(sandbox.as_str())),
            None => self.layout.sandbox_dir(sandbox),
        }
    }

    fn files(&self, sandbox: &SandboxId) -> VmmFiles {
        VmmFiles { host: self.vmm_dir(sandbox), jailed: self.config.jailer.is_some() }
    }

    /// A fresh listener where the agent dials (whatever stood there goes).
    fn listen(&self, files: &VmmFiles) -> Result<UnixListener, EngineError> {
        let path = files.agent_socket();
        let _ = fs::remove_file(&path);
        let listener = super::at_socket(&path, |p| UnixListener::bind(p))
            .and_then(|listener| listener.set_nonblocking(true).map(|()| listener))
            .map_err(EngineError::io("listening for the agent"))?;
        if files.jailed {
            // The jailed VMM connects as its own uid.
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o777)).map_err(EngineError::io("socket mode"))?;
        }
        Ok(listener)
    }

    /// Prepares where this sandbox's VMM will find its files. Under the
    /// jailer they are placed in its chroot — `own` files hard-linked and
    /// owned by the VMM's uid, `shared` ones (the kernel and initramfs it
    /// boots, a template snapshot) hard-linked read-only — and a uid no
    /// other jail holds is chosen (the jail root's owner records it).
    ///
    /// A volume's own image (a read-write mount) cannot be linked there
    /// (it is in another subvolume): it is bound onto a file of the jail,
    /// and given to the VMM's uid; a read-only mount's copy is the
    /// sandbox's own, linked like its root drive.
    fn prepare(
        &self,
        sandbox: &SandboxId,
        own: &[(&str, &Path)],
        shared: &[(&str, &Path)],
        volumes: &[VolumeDrive],
    ) -> Result<(VmmFiles, Option<u32>), EngineError> {
        let files = self.files(sandbox);
        if !files.jailed {
            // A previous VMM's vsock socket would keep this one from binding.
            let _ = fs::remove_file(files.host(VSOCK));
            return Ok((files, None));
        }
        let root = files.host.clone();
        // A volume bound into a previous jail is let go before it goes.
        super::unmount_under(&root);
        let _ = fs::remove_dir_all(&root);
        let uid = {
            let _choosing = self.jail_uids.lock().unwrap_or_else(|e| e.into_inner());
            let uid = self.free_uid()?;
            fs::create_dir_all(&root).map_err(EngineError::io("creating the jail"))?;
            std::os::unix::fs::chown(&root, Some(uid), Some(uid)).map_err(EngineError::io("chown of the jail"))?;
            uid
        };
        for (name, source) in shared {
            link_or_copy(source, &root.join(name))?;
        }
        let copies = volumes.iter().filter(|v| v.read_only).map(|v| (v.name.as_str(), v.host.as_path()));
        for (name, source) in own.iter().copied().chain(copies) {
            let target = root.join(name);
            fs::hard_link(source, &target).map_err(EngineError::io(format!("linking {name} into the jail")))?;
            std::os::unix::fs::chown(&target, Some(uid), Some(uid)).map_err(EngineError::io("chown into the jail"))?;
        }
        for volume in volumes.iter().filter(|v| !v.read_only) {
            let target = root.join(&volume.name);
            fs::File::create(&target).map_err(EngineError::io("a volume's place in the jail"))?;
            nix::mount::mount(Some(&volume.host), &target, None::<&str>, nix::mount::MsFlags::MS_BIND, None::<&str>)
                .map_err(|e| EngineError::io("binding a volume into the jail")(e.into()))?;
            std::os::unix::fs::chown(&volume.host, Some(uid), Some(uid))
                .map_err(EngineError::io("giving a volume's image to the jail"))?;
        }
        Ok((files, Some(uid)))
    }

    /// The lowest uid of the jail range that no jail root is owned by.
    fn free_uid(&self) -> Result<u32, EngineError> {
        use std::os::unix::fs::MetadataExt;
        let jails = self.config.jail_base.join(super::exec_name(&self.config.firecracker));
        let taken: std::collections::HashSet<u32> = fs::read_dir(&jails)
            .map(|entries| entries.flatten().filter_map(|e| fs::metadata(e.path().join("root")).ok()))
            .into_iter()
            .flatten()
            .map(|meta| meta.uid())
            .collect();
        (self.config.jail_uid..self.config.jail_uid.saturating_add(JAIL_UIDS))
            .find(|uid| !taken.contains(uid))
            .ok_or_else(|| EngineError::Runtime(format!("all {JAIL_UIDS} jail uids are in use")))
    }

    /// Starts the sandbox's VMM (as `uid` under the jailer) and records it.
    async fn spawn(&self, sandbox: &SandboxId, shape: Shape, uid: Option<u32>) -> Result<super::Api, EngineError> {
        let id = jail_id(sandbox.as_str());
        let vmm = match (&self.config.jailer, uid) {
            (Some(jailer), Some(uid)) => {
                let limits = VmmLimits { vcpus: shape.vcpus.get(), memory_mib: shape.memory_mib.get() };
                Vmm::spawn_jailed(jailer, &self.config.firecracker, &self.config.jail_base, &id, uid, uid, limits).await
            }
            // Firecracker's --id takes the same characters as the jailer's.
            _ => Vmm::spawn(&self.config.firecracker, &self.layout.sandbox_dir(sandbox), &id).await,
        }?;
        // VMMs outlive this process; a restarted one finds them by this.
        let _ = fs::write(self.layout.sandbox_dir(sandbox).join("vmm.pid"), vmm.pid().to_string());
        let api = vmm.api.clone();
        let running = Running { vmm, paused: false, shape: Some(shape) };
        let replaced = self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(sandbox.clone(), running);
        if let Some(mut replaced) = replaced {
            replaced.vmm.kill().await;
        }
        Ok(api)
    }

    /// A VMM started by an earlier process and still running, not yet
    /// taken back: found by its pid file, and recognised by the binary it
    /// runs (the configured firecracker, or its copy in the sandbox's
    /// jail), not by its name.
    fn adoptable(&self, sandbox: &SandboxId) -> Option<Vmm> {
        if self.vmms.lock().unwrap_or_else(|e| e.into_inner()).contains_key(sandbox) {
            return None;
        }
        let pid_file = self.layout.sandbox_dir(sandbox).join("vmm.pid");
        let pid = fs::read_to_string(pid_file).ok()?.trim().parse::<i32>().ok()?;
        let dir = self.vmm_dir(sandbox);
        let binary = &self.config.firecracker;
        match &self.config.jailer {
            Some(_) => super::runs_binary(pid, &dir.join(super::exec_name(binary)))
                .then(|| Vmm::adopted_jailed(binary, &self.config.jail_base, &jail_id(sandbox.as_str()), pid)),
            None => super::runs_binary(pid, binary).then(|| Vmm::adopted(&dir, pid)),
        }
    }

    /// Takes back the sandbox's VMM a previous process left running, in
    /// the state its API tells (it may have been paused), unless another
    /// caller took it back first. Blocking.
    fn adopt(&self, sandbox: &SandboxId) {
        let Some(vmm) = self.adoptable(sandbox) else { return };
        let paused = match vmm.api.instance_info_blocking(ADOPT_PATIENCE) {
            Ok(info) => info.state == "Paused",
            Err(err) => {
                tracing::warn!(%sandbox, "a VMM left running does not tell its state, taken as running: {err}");
                false
            }
        };
        let mut vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        match vmms.entry(sandbox.clone()) {
            std::collections::hash_map::Entry::Occupied(_) => vmm.release(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                entry.insert(Running { vmm, paused, shape: None });
            }
        }
    }

    fn with_vmm<T>(&self, sandbox: &SandboxId, f: impl FnOnce(&mut Running) -> T) -> Result<T, EngineError> {
        self.adopt(sandbox);
        let mut vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        let running = vmms.get_mut(sandbox).ok_or_else(|| EngineError::Runtime(format!("no microVM for {sandbox}")))?;
        Ok(f(running))
    }

    fn api(&self, sandbox: &SandboxId) -> Result<super::Api, EngineError> {
        self.with_vmm(sandbox, |running| running.vmm.api.clone())
    }

    /// Stops the sandbox's VMM (its jail, log and cgroup go with it).
    fn kill(&self, sandbox: &SandboxId) {
        self.adopt(sandbox);
        let running = self.vmms.lock().unwrap_or_else(|e| e.into_inner()).remove(sandbox);
        if let Some(mut running) = running {
            running.vmm.kill_blocking();
        }
    }

    /// The sandbox's root drive: a reflink copy of `image`, grown by
    /// `extra_mib` (what the sandbox asks for over the template's default).
    fn copy_root_drive(&self, sandbox: &SandboxId, image: &Path, extra_mib: u32) -> Result<PathBuf, EngineError> {
        let dir = self.layout.sandbox_dir(sandbox);
        fs::create_dir_all(&dir).map_err(EngineError::io("creating the sandbox dir"))?;
        let root = dir.join(ROOT_DRIVE);
        space_host::run(Command::new("cp").arg("--reflink=auto").arg(image).arg(&root))?;
        if extra_mib > 0 {
            let size = fs::metadata(&root).map_err(EngineError::io("the root drive"))?.len();
            let grown = size.div_ceil(1 << 20) + u64::from(extra_mib);
            space_host::run(Command::new("resize2fs").arg("-f").arg(&root).arg(format!("{grown}M")))?;
        }
        Ok(root)
    }

    /// Boots a new microVM from the template's ext4 image, up to its start.
    async fn boot(
        &self,
        sandbox: &SandboxId,
        template: &TemplateRef,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<(UnixListener, u32), EngineError> {
        let version = self.layout.template_dir(template);
        let image = version.join(ROOT_DRIVE);
        if !image.is_file() {
            return Err(EngineError::Runtime(
                "the template has no ext4 image; rebuild it on this host (or with --ext4-images true)".into(),
            ));
        }
        let extra = template_defaults(&version).map_or(0, |d| shape.disk_mib.get().saturating_sub(d.disk_mib));
        let root = self.copy_root_drive(sandbox, &image, extra)?;
        let volumes = self.volume_drives(sandbox, mounts, true)?;
        let guest = [("vmlinux", self.config.kernel.as_path()), ("initramfs.cpio", self.config.initramfs.as_path())];
        let (files, uid) = self.prepare(sandbox, &[(ROOT_DRIVE, &root)], &guest, &volumes)?;
        let mut boot_args = BOOT_ARGS.to_string();
        if !volumes.is_empty() {
            boot_args = format!("{boot_args} {KEYBOARD_ARGS}");
        }
        let listener = self.listen(&files)?;
        let api = self.spawn(sandbox, shape, uid).await?;
        api.boot_source(&BootSource {
            kernel_image_path: files.shared("vmlinux", &self.config.kernel),
            initrd_path: Some(files.shared("initramfs.cpio", &self.config.initramfs)),
            boot_args,
        })
        .await?;
        api.machine_config(&MachineConfig {
            vcpu_count: shape.vcpus.get(),
            mem_size_mib: shape.memory_mib.get(),
            smt: false,
            track_dirty_pages: false,
        })
        .await?;
        api.drive(&Drive {
            drive_id: "root".into(),
            path_on_host: VmmFiles::own(ROOT_DRIVE),
            is_root_device: true,
            is_read_only: false,
        })
        .await?;
        // After the root (`vda`), in the mounts' order: `vdb` onwards, as
        // the engine tells the agent.
        for (index, volume) in volumes.iter().enumerate() {
            api.drive(&Drive {
                drive_id: format!("volume{index}"),
                path_on_host: files.volume(volume),
                is_root_device: false,
                is_read_only: volume.read_only,
            })
            .await?;
        }
        api.vsock(&Vsock { guest_cid: GUEST_CID, uds_path: VmmFiles::own(VSOCK) }).await?;
        api.start().await?;
        Ok((listener, self.pid_of(sandbox)))
    }

    fn pid_of(&self, sandbox: &SandboxId) -> u32 {
        self.with_vmm(sandbox, |running| running.vmm.pid() as u32).unwrap_or_default()
    }

    /// Pauses the VMM (if it is not) and saves a full snapshot of it into
    /// `target` (`vm.state`, `vm.mem`).
    async fn save(&self, sandbox: &SandboxId, target: &Path) -> Result<(), EngineError> {
        let api = self.api(sandbox)?;
        if !self.with_vmm(sandbox, |running| running.paused)? {
            api.pause().await?;
            self.with_vmm(sandbox, |running| running.paused = true)?;
        }
        let cwd = self.vmm_dir(sandbox);
        for name in [STATE, MEMORY] {
            let _ = fs::remove_file(cwd.join(name));
        }
        api.snapshot_create(&SnapshotCreate {
            snapshot_type: "Full",
            snapshot_path: VmmFiles::own(STATE),
            mem_file_path: VmmFiles::own(MEMORY),
        })
        .await?;
        fs::create_dir_all(target).map_err(EngineError::io("creating the snapshot dir"))?;
        for name in [STATE, MEMORY] {
            let (from, to) = (cwd.join(name), target.join(name));
            if fs::rename(&from, &to).is_err() {
                // Another file system (or subvolume): copy, then let go.
                space_host::run(Command::new("cp").arg("--reflink=auto").arg(&from).arg(&to))?;
                let _ = fs::remove_file(&from);
            }
        }
        Ok(())
    }

    /// Loads the snapshot `state` + `memory` into a new VMM for `sandbox`
    /// on the root drive `drive` (in the sandbox's directory), resumed. The
    /// memory file is mapped privately. A `shared` snapshot (a template's,
    /// an image) is only read; a sandbox's own becomes its new VMM's.
    async fn load(
        &self,
        sandbox: &SandboxId,
        shape: Shape,
        drive: &Path,
        (state, memory): (&Path, &Path),
        shared: bool,
        volumes: &[VolumeDrive],
    ) -> Result<(UnixListener, u32), EngineError> {
        let snapshot = [(STATE, state), (MEMORY, memory)];
        let drive = [(ROOT_DRIVE, drive)];
        let (files, uid) = if shared {
            self.prepare(sandbox, &drive, &snapshot, volumes)?
        } else {
            self.prepare(sandbox, &[drive[0], snapshot[0], snapshot[1]], &[], volumes)?
        };
        let listener = self.listen(&files)?;
        let api = self.spawn(sandbox, shape, uid).await?;
        // Linked into a jail under their names; else named where they are.
        api.snapshot_load(&SnapshotLoad {
            snapshot_path: files.shared(STATE, state),
            mem_backend: MemBackend { backend_type: "File", backend_path: files.shared(MEMORY, memory) },
            resume_vm: true,
            vsock_override: Some(VsockOverride { uds_path: VmmFiles::own(VSOCK) }),
        })
        .await?;
        Ok((listener, self.pid_of(sandbox)))
    }

    /// Where the template's microVM is saved for clones of `shape`, when
    /// `shape` is the template's default one (clones have exactly the
    /// template microVM's vCPUs, memory and disk). Named by the guest
    /// kernel and initramfs too, so a new agent makes a new snapshot.
    pub fn clone_base_dir(&self, template: &TemplateRef, shape: Shape) -> Option<PathBuf> {
        let version = self.layout.template_dir(template);
        let defaults = template_defaults(&version)?;
        let wanted = (shape.vcpus.get(), shape.memory_mib.get(), shape.disk_mib.get());
        if wanted != (defaults.vcpus, defaults.memory_mib, defaults.disk_mib) {
            return None;
        }
        let mut guest = Vec::new();
        for file in [&self.config.kernel, &self.config.initramfs] {
            let meta = fs::metadata(file).ok()?;
            guest.push((meta.len(), meta.modified().ok()));
        }
        let name = format!("{}cpu-{}mib-{:016x}", wanted.0, wanted.1, hash_of(&guest));
        Some(version.join("firecracker").join(name))
    }

    fn image_dir(&self, sandbox: &SandboxId, image: &ImageRef) -> PathBuf {
        self.layout.image_dir(sandbox, image)
    }

    /// The VMM's log lines, for an error message.
    fn log_tail(&self, sandbox: &SandboxId) -> String {
        let path = self.vmm_dir(sandbox).join("firecracker.log");
        let text = fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(5).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    async fn start_async(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<(UnixListener, u32), EngineError> {
        match from {
            StartFrom::Template { template } => self.boot(sandbox, template, shape, mounts).await,
            StartFrom::Clone { template } => {
                let dir = self.clone_base_dir(template, shape).ok_or_else(|| {
                    EngineError::Runtime(format!("a clone of {} has its default shape", template.name))
                })?;
                if !complete(&dir) {
                    return Err(EngineError::Runtime(format!("template {} has no clone base", template.name)));
                }
                // A clone has its template's default shape: the drive as saved.
                let root = self.copy_root_drive(sandbox, &dir.join(ROOT_DRIVE), 0)?;
                self.load(sandbox, shape, &root, (&dir.join(STATE), &dir.join(MEMORY)), true, &[]).await
            }
            StartFrom::Suspended {} => {
                let snapshot = self.snapshot_dir(sandbox);
                if !(snapshot.join(STATE).is_file() && snapshot.join(MEMORY).is_file()) {
                    return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
                }
                let root = self.layout.sandbox_dir(sandbox).join(ROOT_DRIVE);
                // The drives the snapshot names, as they were: a read-only
                // mount keeps the copy it started with.
                let volumes = self.volume_drives(sandbox, mounts, false)?;
                let snapshot = (snapshot.join(STATE), snapshot.join(MEMORY));
                self.load(sandbox, shape, &root, (&snapshot.0, &snapshot.1), false, &volumes).await
            }
            StartFrom::Image { source, image } => {
                let image = self.image_dir(source, image);
                self.load_image(sandbox, shape, &image).await
            }
            StartFrom::TemplateImage { template } => {
                let image = self.layout.template_dir(template);
                self.load_image(sandbox, shape, &image).await
            }
            StartFrom::Layer { .. } => Err(no_build_sandboxes()),
        }
    }

    /// A new microVM loads the image's snapshot (its memory mapped
    /// privately, as clones of a template's are) on its own reflink copy
    /// of the image's root drive.
    async fn load_image(
        &self,
        sandbox: &SandboxId,
        shape: Shape,
        image: &Path,
    ) -> Result<(UnixListener, u32), EngineError> {
        if !(image.join(STATE).is_file() && image.join(MEMORY).is_file()) {
            return Err(EngineError::Runtime("the image is not whole".into()));
        }
        self.kill(sandbox);
        let root = self.copy_root_drive(sandbox, &image.join(ROOT_DRIVE), 0)?;
        let _ = fs::remove_dir_all(self.snapshot_dir(sandbox));
        self.load(sandbox, shape, &root, (&image.join(STATE), &image.join(MEMORY)), true, &[]).await
    }
}

/// Why a microVM that mounts volumes is not checkpointed or started from
/// a snapshot other than its own (decision 031).
pub(super) fn no_volume_checkpoints() -> EngineError {
    EngineError::Runtime(
        "a Firecracker sandbox that mounts volumes cannot be checkpointed, forked or cloned: its memory holds \
         its view of the volumes"
            .into(),
    )
}

/// The guest's name for the `index`th volume drive: `vdb` onwards (the
/// root drive is `vda`).
pub(super) fn volume_device(index: usize) -> String {
    let letter = b'b' + u8::try_from(index).unwrap_or(u8::MAX).min(b'z' - b'b');
    format!("vd{}", letter as char)
}

/// A volume drive of a microVM: the file on the host, the name the VMM
/// knows it by (in its jail, or beside its root drive), and whether the
/// guest only reads it.
struct VolumeDrive {
    name: String,
    host: PathBuf,
    read_only: bool,
}

impl VmmFiles {
    /// The path the VMM opens a volume drive at: its name in a jail; the
    /// sandbox's copy by name (the sandbox's dir is the VMM's working
    /// directory), a volume's own image where it is.
    fn volume(&self, volume: &VolumeDrive) -> PathBuf {
        match self.jailed || volume.read_only {
            true => PathBuf::from(&volume.name),
            false => volume.host.clone(),
        }
    }
}

impl FirecrackerHost {
    /// Lets a running microVM that mounts volumes stop by itself first:
    /// Ctrl-Alt-Del, on which its agent kills every process, unmounts the
    /// volumes (what the guest had not written back is written) and
    /// restarts the guest, which ends the VMM; waited for at most
    /// [`STOP_PATIENCE`] (then it is killed as any other). Blocking.
    fn stop_cleanly(&self, sandbox: &SandboxId) {
        if !self.layout.sandbox_dir(sandbox).join(HAS_VOLUMES).exists() {
            return;
        }
        let Ok((api, pid, paused)) =
            self.with_vmm(sandbox, |running| (running.vmm.api.clone(), running.vmm.pid(), running.paused))
        else {
            return;
        };
        let pressed = block_on(async {
            if paused {
                api.resume().await?;
            }
            api.send_ctrl_alt_del().await
        });
        if let Err(err) = pressed {
            tracing::warn!(%sandbox, "stopping a microVM with volumes by Ctrl-Alt-Del: {err}");
            return;
        }
        let deadline = Instant::now() + STOP_PATIENCE;
        while super::alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if super::alive(pid) {
            tracing::warn!(%sandbox, "a microVM with volumes did not stop within {STOP_PATIENCE:?}: killed");
        }
    }

    /// The images of the volumes the sandbox mounted read-write go back to
    /// root once its VMM is gone (a jailed VMM was given them).
    fn give_back_volumes(&self, sandbox: &SandboxId) {
        let listed = fs::read_to_string(self.layout.sandbox_dir(sandbox).join(HAS_VOLUMES)).unwrap_or_default();
        for volume in listed.lines().filter_map(|line| space_privsep::proto::VolumeId::parse(line).ok()) {
            let image = self.layout.volume_image(&volume);
            if fs::symlink_metadata(&image).is_ok_and(|meta| meta.is_file()) {
                if let Err(err) = std::os::unix::fs::chown(&image, Some(0), Some(0)) {
                    tracing::warn!(%sandbox, %volume, "giving a volume's image back to root: {err}");
                }
            }
        }
    }

    /// The mounted volume's ext4 image (a restore a killed process left
    /// half done finished first).
    fn volume_image(&self, mount: &Mount) -> Result<PathBuf, EngineError> {
        crate::volumes::settle(&self.layout, &mount.volume)?;
        let image = self.layout.volume_image(&mount.volume);
        match fs::symlink_metadata(&image).is_ok_and(|meta| meta.is_file()) {
            true => Ok(image),
            false => Err(EngineError::Runtime(format!(
                "volume {} has no ext4 image: it was made for gVisor (a Firecracker node's volumes are images)",
                mount.volume
            ))),
        }
    }

    /// The sandbox's volume drives, one per mount in order: a read-write
    /// mount's is the volume's own image; a read-only mount's is a copy
    /// of it, taken now (`fresh`) or at the sandbox's start — a reflink
    /// (one atomic clone of the file, however a writer's VMM is writing
    /// it), its journal replayed, so the reader's file system is whole: the
    /// volume as a power cut at that instant would have left it.
    fn volume_drives(
        &self,
        sandbox: &SandboxId,
        mounts: &[Mount],
        fresh: bool,
    ) -> Result<Vec<VolumeDrive>, EngineError> {
        if fresh && !mounts.is_empty() {
            let writers: String = mounts.iter().filter(|m| !m.read_only).map(|m| format!("{}\n", m.volume)).collect();
            fs::create_dir_all(self.layout.sandbox_dir(sandbox)).map_err(EngineError::io("the sandbox dir"))?;
            fs::write(self.layout.sandbox_dir(sandbox).join(HAS_VOLUMES), writers)
                .map_err(EngineError::io("marking a sandbox with volumes"))?;
        }
        let mut drives = Vec::with_capacity(mounts.len());
        for (index, mount) in mounts.iter().enumerate() {
            let image = self.volume_image(mount)?;
            let name = format!("volume-{index}.ext4");
            if !mount.read_only {
                drives.push(VolumeDrive { name, host: image, read_only: false });
                continue;
            }
            let copy = self.layout.volume_copy(sandbox, index);
            if fresh {
                fs::create_dir_all(self.layout.sandbox_dir(sandbox)).map_err(EngineError::io("the sandbox dir"))?;
                let _ = fs::remove_file(&copy);
                space_host::run(Command::new("cp").arg("--reflink=always").arg(&image).arg(&copy))?;
                crate::volumes::replay_journal(&copy)?;
            } else if !copy.is_file() {
                return Err(EngineError::Runtime(format!(
                    "the copy of volume {} the sandbox started with is gone",
                    mount.volume
                )));
            }
            drives.push(VolumeDrive { name, host: copy, read_only: true });
        }
        Ok(drives)
    }
}

/// A build sandbox's root is a layer chain's directory tree, written back
/// as the next chain; a microVM's is an ext4 image of a published template.
pub(super) fn no_build_sandboxes() -> EngineError {
    EngineError::Runtime(
        "the Firecracker engine does not run build sandboxes on layer chains: Dockerfile steps run on gVisor".into(),
    )
}

/// Whether a clone base (or a snapshot with its drive) is whole in `dir`.
fn complete(dir: &Path) -> bool {
    [STATE, MEMORY, ROOT_DRIVE].iter().all(|name| dir.join(name).is_file())
}

/// Runs `future` to its end on the runtime of the thread (a blocking
/// thread of it: the engine's and the helper's calls come on those), or
/// on a runtime of its own when there is none.
fn block_on<F: Future>(future: F) -> F::Output {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle.block_on(future),
        Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the VMM's API")
            .block_on(future),
    }
}

/// The template version's default sandbox shape, from its metadata.
fn template_defaults(version: &Path) -> Option<space_host::template::TemplateDefaults> {
    space_host::template::TemplateInfo::load(version).ok().map(|t| t.meta.defaults)
}

/// A short name for a value (not across Rust releases: it names caches).
fn hash_of<T: std::hash::Hash + ?Sized>(value: &T) -> u64 {
    use std::hash::Hasher;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// A hard link where the file system allows one (clones then share the
/// file's pages), else a reflink or plain copy.
fn link_or_copy(source: &Path, target: &Path) -> Result<(), EngineError> {
    let _ = fs::remove_file(target);
    if fs::hard_link(source, target).is_ok() {
        return Ok(());
    }
    space_host::run(Command::new("cp").arg("--reflink=auto").arg(source).arg(target))?;
    Ok(())
}

impl EngineHost for FirecrackerHost {
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<Launched, EngineError> {
        // Volume drives go into a boot (the template has none in its clone
        // base) or back into their own sandbox's snapshot.
        if !mounts.is_empty() && !matches!(from, StartFrom::Template { .. } | StartFrom::Suspended {}) {
            return Err(no_volume_checkpoints());
        }
        space_privsep::proto::check_mounts(mounts).map_err(|e| EngineError::Runtime(e.to_string()))?;
        for mount in mounts {
            self.volume_image(mount)?;
        }
        // A new root (a template's, another sandbox's image) goes into a
        // new sandbox only, as with gVisor; going back to its own image or
        // snapshot keeps the sandbox.
        let new_root = match from {
            StartFrom::Layer { .. } => return Err(no_build_sandboxes()),
            StartFrom::Template { .. } | StartFrom::TemplateImage { .. } | StartFrom::Clone { .. } => true,
            StartFrom::Image { source, .. } => source != sandbox,
            StartFrom::Suspended {} => false,
        };
        if new_root && fs::symlink_metadata(self.layout.sandbox_dir(sandbox)).is_ok() {
            return Err(EngineError::Runtime(format!(
                "sandbox {sandbox} exists: a start from a template or another sandbox's image makes a new one"
            )));
        }
        let started = Instant::now();
        let (listener, pid) = block_on(self.start_async(sandbox, from, shape, mounts))?;
        Ok(Launched {
            listener,
            pid,
            // The VMM runs once its API took the start (or the load).
            finished: Box::new(|| Ok(())),
            steps: vec![("microVM configured and started", started.elapsed())],
        })
    }

    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        let api = self.api(sandbox)?;
        block_on(api.pause())?;
        self.with_vmm(sandbox, |running| running.paused = true)
    }

    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        let api = self.api(sandbox)?;
        block_on(api.resume())?;
        self.with_vmm(sandbox, |running| running.paused = false)
    }

    /// A paused microVM's vCPUs do not run: there is nothing to freeze.
    fn freeze(&self, _sandbox: &SandboxId, _frozen: bool) -> Result<(), EngineError> {
        Ok(())
    }

    fn set_timer_slack(&self, _sandbox: &SandboxId, _slack: Option<SlackNs>) -> Result<usize, EngineError> {
        Ok(0)
    }

    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        let target = self.snapshot_dir(sandbox);
        let _ = fs::remove_dir_all(&target);
        block_on(self.save(sandbox, &target))?;
        self.kill(sandbox);
        Ok(())
    }

    /// The microVM paused for the instant: a full snapshot (state and
    /// memory, whose page cache holds what the guest has not yet written
    /// back) and a reflink copy of its root drive, then resumed.
    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError> {
        let target = self.image_dir(sandbox, image);
        let was_paused = self.with_vmm(sandbox, |running| running.paused)?;
        let started = Instant::now();
        let saved = block_on(self.save(sandbox, &target)).and_then(|()| {
            let (root, copy) = (self.layout.sandbox_dir(sandbox).join(ROOT_DRIVE), target.join(ROOT_DRIVE));
            space_host::run(Command::new("cp").arg("--reflink=auto").arg(&root).arg(&copy))
                .map(drop)
                .map_err(EngineError::from)
        });
        let thawed = match was_paused {
            true => Ok(()),
            false => self.resume(sandbox),
        };
        let frozen = started.elapsed();
        saved?;
        thawed?;
        Ok(frozen)
    }

    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError> {
        match fs::remove_dir_all(self.image_dir(sandbox, image)) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(EngineError::io("removing the image")(err)),
            _ => Ok(()),
        }
    }

    /// A restored VMM maps its own links of the snapshot's files (or, not
    /// jailed, the files themselves, which stay its until it stops): kept.
    fn drop_snapshot(&self, _sandbox: &SandboxId) -> Result<(), EngineError> {
        Ok(())
    }

    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.stop_cleanly(sandbox);
        self.kill(sandbox);
        self.give_back_volumes(sandbox);
        Ok(())
    }

    fn stop_strays(&self, _sandbox: &SandboxId) {}

    fn settle_orphans(&self, _sandboxes: &[SandboxId], _patience: PatienceMs) {}

    /// Stops the sandbox's VMM and removes its directory.
    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.stop_cleanly(sandbox);
        self.kill(sandbox);
        self.give_back_volumes(sandbox);
        let dir = self.layout.sandbox_dir(sandbox);
        match fs::remove_dir_all(&dir) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                Err(EngineError::io("removing the sandbox dir")(err))
            }
            _ => Ok(()),
        }
    }

    fn state(&self, sandbox: &SandboxId) -> EngineState {
        self.adopt(sandbox);
        let vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        match vmms.get(sandbox) {
            Some(running) if super::alive(running.vmm.pid()) => match running.paused {
                true => EngineState::Paused,
                false => EngineState::Running,
            },
            _ => EngineState::Missing,
        }
    }

    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState> {
        sandboxes.iter().map(|sandbox| self.state(sandbox)).collect()
    }

    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        self.listen(&self.files(sandbox))
    }

    fn close_agent(&self, sandbox: &SandboxId) {
        let _ = fs::remove_file(self.files(sandbox).agent_socket());
    }

    fn availability(&self) -> (bool, String) {
        let availability =
            super::availability(Some(&self.config.firecracker), Some((&self.config.kernel, &self.config.initramfs)));
        (availability.available, availability.detail)
    }

    fn engine_log(&self, sandbox: &SandboxId) -> String {
        self.log_tail(sandbox)
    }

    fn has_clone_base(&self, template: &TemplateRef, shape: Shape) -> Result<bool, EngineError> {
        Ok(self.clone_base_dir(template, shape).is_some_and(|dir| complete(&dir)))
    }

    /// Saves the template's microVM (booted here from the template with
    /// its default shape; its agent quiesced by the engine) for clones,
    /// then stops it. Its files become root's, read-only to the clones'
    /// uids; bases made for an older guest go.
    fn save_clone_base(&self, sandbox: &SandboxId, template: &TemplateRef) -> Result<(), EngineError> {
        let shape = self
            .with_vmm(sandbox, |running| running.shape)?
            .ok_or_else(|| EngineError::Runtime(format!("{sandbox}'s microVM was not started here")))?;
        let dir = self.clone_base_dir(template, shape).ok_or_else(|| {
            EngineError::Runtime(format!("{sandbox} does not have template {}'s default shape", template.name))
        })?;
        let building = dir.with_extension("building");
        let _ = fs::remove_dir_all(&building);
        let made = block_on(self.save(sandbox, &building)).and_then(|()| {
            let root = self.layout.sandbox_dir(sandbox).join(ROOT_DRIVE);
            space_host::run(Command::new("cp").arg("--reflink=auto").arg(&root).arg(building.join(ROOT_DRIVE)))?;
            Ok(())
        });
        self.kill(sandbox);
        let kept = made.and_then(|()| {
            // Clones read it as their own uids: root's, read-only for them.
            use std::os::unix::fs::PermissionsExt;
            for name in [STATE, MEMORY, ROOT_DRIVE] {
                let path = building.join(name);
                std::os::unix::fs::chown(&path, Some(0), Some(0)).map_err(EngineError::io("chown of the snapshot"))?;
                fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
                    .map_err(EngineError::io("the snapshot's mode"))?;
            }
            // Bases made for an older guest are of no more use.
            if let Some(parent) = dir.parent() {
                for entry in fs::read_dir(parent).into_iter().flatten().flatten() {
                    if entry.path() != building && entry.path() != dir {
                        let _ = fs::remove_dir_all(entry.path());
                    }
                }
            }
            fs::rename(&building, &dir).map_err(EngineError::io("keeping the template snapshot"))
        });
        if kept.is_err() {
            let _ = fs::remove_dir_all(&building);
        }
        kept
    }
}

#[cfg(test)]
mod tests {
    use space_privsep::proto::{DiskMib, MemoryMib, MountPath, TemplateName, TemplateVersion, Vcpus};

    use super::*;
    use crate::firecracker::{BOOT_PATIENCE, JAIL_UID};

    /// A data dir with template `t` version 1 of the default shape 1 vCPU
    /// / 128 MiB / 16 MiB of disk and its ext4 image.
    fn data_dir(name: &str) -> (PathBuf, TemplateRef) {
        let data = std::env::temp_dir().join(format!("space-fc-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&data);
        let version = data.join("templates/t/1");
        fs::create_dir_all(version.join("rootfs/etc")).unwrap();
        fs::write(version.join("rootfs/etc/hostname"), "t\n").unwrap();
        space_host::template::make_ext4(&version.join("rootfs"), &version.join(ROOT_DRIVE), 16).unwrap();
        let meta = serde_json::json!({
            "name": "t", "version": 1, "created_at": "2026-12-02T00:00:00Z", "source": {},
            "defaults": {"vcpus": 1, "memory_mib": 128, "disk_mib": 16, "env": {}, "workdir": "/", "user": "root"},
        });
        fs::write(version.join("template.json"), meta.to_string()).unwrap();
        let template =
            TemplateRef { name: TemplateName::parse("t").unwrap(), version: TemplateVersion::new(1).unwrap() };
        (data, template)
    }

    fn host(data: &Path, firecracker: &Path) -> FirecrackerHost {
        let version = data.join("templates/t/1");
        FirecrackerHost::new(FirecrackerConfig {
            firecracker: firecracker.to_path_buf(),
            kernel: version.join("template.json"),
            initramfs: version.join(ROOT_DRIVE),
            jailer: None,
            jail_base: data.join("jail"),
            jail_uid: JAIL_UID,
            boot_patience: BOOT_PATIENCE,
            data_dir: data.to_path_buf(),
        })
    }

    fn shape(vcpus: u32, memory_mib: u32, disk_mib: u32) -> Shape {
        Shape {
            vcpus: Vcpus::new(vcpus).unwrap(),
            memory_mib: MemoryMib::new(memory_mib).unwrap(),
            disk_mib: DiskMib::new(disk_mib).unwrap(),
        }
    }

    fn sandbox() -> SandboxId {
        SandboxId::parse("sbx_000000000000000fc001").unwrap()
    }

    fn block_count(image: &Path) -> u64 {
        let out = space_host::run(Command::new("dumpe2fs").arg("-h").arg(image)).unwrap();
        let text = String::from_utf8_lossy(&out);
        text.lines().find_map(|l| l.strip_prefix("Block count:")).unwrap().trim().parse().unwrap()
    }

    #[test]
    fn a_root_drive_grows_by_the_disk_asked_for_over_the_template_default() {
        let (data, template) = data_dir("grow");
        let host = host(&data, Path::new("/nonexistent/firecracker"));
        let version = host.layout().template_dir(&template);
        let image = version.join(ROOT_DRIVE);
        let default = template_defaults(&version).unwrap().disk_mib;
        assert_eq!((16u32.saturating_sub(default), 48u32.saturating_sub(default)), (0, 32));
        let same = host.copy_root_drive(&sandbox(), &image, 0).unwrap();
        assert_eq!(fs::metadata(&same).unwrap().len(), fs::metadata(&image).unwrap().len(), "the default: a copy");
        let grown = host.copy_root_drive(&sandbox(), &image, 32).unwrap();
        let extra = fs::metadata(&grown).unwrap().len() - fs::metadata(&image).unwrap().len();
        assert_eq!(extra, 32 << 20, "32 MiB more than the template's default");
        assert!(block_count(&grown) > block_count(&image), "the file system was resized too");
        space_host::run(Command::new("e2fsck").arg("-fn").arg(&grown)).expect("and is clean");
        // The template's image is untouched.
        space_host::run(Command::new("e2fsck").arg("-fn").arg(&image)).unwrap();
        let _ = fs::remove_dir_all(&data);
    }

    /// A VMM a previous process left is taken back only if it runs the
    /// configured binary: another program that is merely called
    /// `firecracker` is not (its pid file may name a reused pid).
    #[test]
    fn only_a_process_of_the_configured_binary_is_adopted() {
        let (data, _) = data_dir("adopt");
        // Two different programs called `firecracker`: copies of `sleep`.
        let (configured, impostor) = (data.join("configured/firecracker"), data.join("impostor/firecracker"));
        for copy in [&configured, &impostor] {
            fs::create_dir_all(copy.parent().unwrap()).unwrap();
            fs::copy("/bin/sleep", copy).unwrap();
        }
        let dir = host(&data, &configured).layout().sandbox_dir(&sandbox());
        fs::create_dir_all(&dir).unwrap();
        let running = space_process::Reaper::global().spawn(Command::new(&configured).arg("30")).unwrap();
        fs::write(dir.join("vmm.pid"), running.id().to_string()).unwrap();
        // Until its exec has set up its arguments (the kernel switches its
        // binary first), its command line reads empty.
        let (exe, cmdline) = (format!("/proc/{}/exe", running.id()), format!("/proc/{}/cmdline", running.id()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs::read_link(&exe).ok().as_deref() != Some(configured.as_path())
            || fs::read(&cmdline).unwrap_or_default().is_empty()
        {
            assert!(Instant::now() < deadline, "the program never started");
            std::thread::sleep(Duration::from_millis(2));
        }
        let state = host(&data, &impostor).state(&sandbox());
        assert_eq!(state, EngineState::Missing, "a process of another binary is not the VMM");
        let owner = host(&data, &configured);
        assert_eq!(owner.state(&sandbox()), EngineState::Running, "the configured binary's process is");
        owner.stop(&sandbox()).unwrap();
        assert!(running.wait_timeout(Duration::from_secs(5)).is_some(), "and stopping the sandbox stops it");
        let _ = fs::remove_dir_all(&data);
    }

    /// A read-only mount's drive is a copy of the volume's image taken at
    /// the sandbox's start, while a writer has it mounted (here the host
    /// kernel through a loop device, in place of a writer's microVM): the
    /// copy's journal is replayed, so the reader's file system is whole
    /// (a read-only drive could not take the recovery a writer's image
    /// always needs) and holds what the writer had synced; the writer's
    /// later writes are not in it. A read-write mount's drive is the
    /// image itself.
    #[test]
    fn a_read_only_mount_gets_a_whole_copy_of_an_image_a_writer_has_mounted() {
        use crate::volumes::{LocalVolumes, VolumeHost};
        let data = space_testkit::TestDataDir::with_templates(&[]);
        let layout = Layout::new(data.root());
        let volume = space_privsep::proto::VolumeId::parse("vol_00000000000000fc0a01").unwrap();
        let volumes = LocalVolumes::new(layout.clone(), "/nonexistent/space");
        volumes.create_image_volume(&volume, DiskMib::new(32).unwrap()).unwrap();
        let image = layout.volume_image(&volume);
        let writer = data.root().join("writer");
        fs::create_dir_all(&writer).unwrap();
        space_host::run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&writer)).unwrap();
        /// Unmounts the writer's view however the test ends.
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = space_host::run(Command::new("umount").arg(self.0));
            }
        }
        let mounted = Unmount(&writer);
        fs::write(writer.join("synced"), "before the start").unwrap();
        nix::unistd::sync();
        let config_host = host(data.root(), Path::new("/nonexistent/firecracker"));
        let mounts = [
            Mount { volume: volume.clone(), path: MountPath::parse("/ro").unwrap(), read_only: true },
            Mount { volume: volume.clone(), path: MountPath::parse("/rw").unwrap(), read_only: false },
        ];
        let copied = config_host.volume_drives(&sandbox(), &mounts, true).unwrap();
        fs::write(writer.join("later"), "after the start").unwrap();
        drop(mounted);
        let (ro, rw) = (&copied[0], &copied[1]);
        assert!(ro.read_only && !rw.read_only);
        assert_eq!(rw.host, image, "the writer's drive is the image itself");
        assert_eq!(ro.host, layout.volume_copy(&sandbox(), 0), "the reader's is the sandbox's own copy");
        let dumped = space_host::run(Command::new("dumpe2fs").arg("-h").arg(&ro.host)).unwrap();
        let features = String::from_utf8_lossy(&dumped);
        let features = features.lines().find(|l| l.starts_with("Filesystem features:")).unwrap();
        assert!(!features.contains("needs_recovery"), "the copy's journal was replayed: {features}");
        space_host::run(Command::new("e2fsck").arg("-fn").arg(&ro.host)).expect("the copy is whole");
        let read = |path: &str| {
            let out = space_host::run(Command::new("debugfs").args(["-R", &format!("cat {path}")]).arg(&ro.host));
            String::from_utf8_lossy(&out.unwrap()).into_owned()
        };
        assert_eq!(read("/synced"), "before the start", "what the writer synced is in the copy");
        assert_eq!(read("/later"), "", "the writer's later writes are not");
        // Restored from its snapshot, the sandbox finds the copy it started with.
        let again = host(data.root(), Path::new("/nonexistent/firecracker"))
            .volume_drives(
                &sandbox(),
                &[Mount { volume, path: MountPath::parse("/ro").unwrap(), read_only: true }],
                false,
            )
            .unwrap();
        assert_eq!(again[0].host, ro.host);
    }

    /// Under the jailer a read-write mount's image (in the volume's own
    /// subvolume: no hard link reaches it) is bound onto a file of the
    /// jail and given to the VMM's uid; a read-only mount's copy is linked
    /// in like the root drive. The jail goes without its binds: a new
    /// jail's preparation and the VMM's leftovers let go of them first,
    /// and the volume's image is untouched.
    #[test]
    fn a_jail_gets_its_volumes_bound_and_lets_go_of_them() {
        use std::os::unix::fs::MetadataExt;

        use crate::volumes::{LocalVolumes, VolumeHost};
        let data = space_testkit::TestDataDir::with_templates(&[]);
        let layout = Layout::new(data.root());
        let volume = space_privsep::proto::VolumeId::parse("vol_00000000000000fc0a02").unwrap();
        LocalVolumes::new(layout.clone(), "/nonexistent/space")
            .create_image_volume(&volume, DiskMib::new(16).unwrap())
            .unwrap();
        let image = layout.volume_image(&volume);
        let mut config_host = host(data.root(), Path::new("/nonexistent/firecracker"));
        config_host.config.jailer = Some(PathBuf::from("/nonexistent/jailer"));
        let mounts = [
            Mount { volume: volume.clone(), path: MountPath::parse("/rw").unwrap(), read_only: false },
            Mount { volume: volume.clone(), path: MountPath::parse("/ro").unwrap(), read_only: true },
        ];
        let drives = config_host.volume_drives(&sandbox(), &mounts, true).unwrap();
        let (files, uid) = config_host.prepare(&sandbox(), &[], &[], &drives).unwrap();
        let uid = uid.expect("a jail's uid");
        let (bound, linked) = (files.host.join("volume-0.ext4"), files.host.join("volume-1.ext4"));
        let (bound_meta, image_meta) = (fs::metadata(&bound).unwrap(), fs::metadata(&image).unwrap());
        assert_eq!((bound_meta.dev(), bound_meta.ino()), (image_meta.dev(), image_meta.ino()), "the image itself");
        assert_eq!(image_meta.uid(), uid, "given to the VMM's uid");
        let copy = fs::metadata(layout.volume_copy(&sandbox(), 1)).unwrap();
        assert_eq!(fs::metadata(&linked).unwrap().ino(), copy.ino(), "the copy, linked");
        assert_eq!(files.volume(&drives[0]), PathBuf::from("volume-0.ext4"), "named in the jail");
        // A new jail for the same sandbox (a restore) starts clean.
        let (files, _) = config_host.prepare(&sandbox(), &[], &[], &drives).unwrap();
        // Its destroy gives the image back to root.
        config_host.destroy(&sandbox()).unwrap();
        assert_eq!(fs::metadata(&image).unwrap().uid(), 0, "the image is root's again");
        super::super::unmount_under(&files.host);
        fs::remove_dir_all(files.host.parent().unwrap()).expect("nothing bound is left in the jail");
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mountinfo.contains(files.host.to_str().unwrap()), "{mountinfo}");
        assert_eq!(fs::metadata(&image).unwrap().len(), 16 << 20, "the image stays");
        space_host::run(Command::new("e2fsck").arg("-fn").arg(&image)).expect("and is whole");
    }

    #[test]
    fn only_the_template_default_shape_has_a_clone_base() {
        let (data, template) = data_dir("shape");
        let host = host(&data, Path::new("/nonexistent/firecracker"));
        let default = shape(1, 128, 16);
        let dir = host.clone_base_dir(&template, default).expect("the default shape is cloned");
        let version = host.layout().template_dir(&template);
        assert!(dir.starts_with(version.join("firecracker")), "kept with the template version: {}", dir.display());
        assert_eq!(host.clone_base_dir(&template, default), Some(dir.clone()), "the same base every time");
        for other in [shape(1, 128, 48), shape(1, 256, 16), shape(2, 128, 16)] {
            assert_eq!(host.clone_base_dir(&template, other), None, "another shape boots");
        }
        assert!(!host.has_clone_base(&template, default).unwrap(), "none is made yet");
        // A clone's start needs the base; the host never boots one itself.
        let err = host.start(&sandbox(), &StartFrom::Clone { template: template.clone() }, default, &[]).err().unwrap();
        assert!(err.to_string().contains("has no clone base"), "{err}");
        // Nor does it run build sandboxes (their roots are layer chains).
        let chain = space_privsep::proto::ChainId::parse(&"ab".repeat(32)).unwrap();
        let err = host.start(&sandbox(), &StartFrom::Layer { chain }, default, &[]).err().unwrap();
        assert!(err.to_string().contains("does not run build sandboxes"), "{err}");
        // Nor a sandbox that mounts a volume without an image.
        let mount = Mount {
            volume: space_privsep::proto::VolumeId::parse("vol_0123456789abcdef0123").unwrap(),
            path: space_privsep::proto::MountPath::parse("/workspace").unwrap(),
            read_only: false,
        };
        let from = StartFrom::Template { template: template.clone() };
        let err = host.start(&sandbox(), &from, shape(1, 256, 16), &[mount]).err().unwrap();
        assert!(err.to_string().contains("has no ext4 image"), "{err}");
        assert!(!host.layout().sandbox_dir(&sandbox()).exists(), "a refused start makes nothing");
        // A new guest (kernel or initramfs) means a new base.
        std::thread::sleep(Duration::from_millis(10));
        fs::write(version.join("template.json"), fs::read(version.join("template.json")).unwrap()).unwrap();
        assert_ne!(host.clone_base_dir(&template, default), Some(dir));
        let _ = fs::remove_dir_all(&data);
    }
}
