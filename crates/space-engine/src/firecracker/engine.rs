//! The Firecracker engine: each sandbox is one microVM. Its root drive is
//! a reflink copy of the template's ext4 image; the kernel and initramfs
//! come from `space setup`; the agent (the initramfs's `/init`) dials the
//! host over hybrid vsock — the guest connects to CID 2, port 1024, and
//! Firecracker hands the connection to the host's socket
//! `<uds_path>_1024`. Pause and resume are `PATCH /vm`; suspend is a full
//! snapshot; restore loads it into a new process, and the agent, whose
//! vsock connection did not survive, dials again.
//!
//! A sandbox of its template's default shape is a clone: the template's
//! microVM is booted once, its agent quiesced, and saved (memory, device
//! state, root drive) next to the template; each clone loads that snapshot
//! into a new VMM — the memory file mapped privately, so clones share its
//! pages until they write them — on a reflink copy of the saved drive. Its
//! agent redials, takes the new sandbox's identity from the welcome, and
//! fresh entropy reseeds its kernel's random generator.
//!
//! Every path a VMM is given for its own files is relative to its working
//! directory (the sandbox's directory, or `/` of its jail), so a snapshot
//! names the same files wherever it is loaded.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UnixListener;

use super::api::{BootSource, Drive, MachineConfig, MemBackend, SnapshotCreate, SnapshotLoad, Vsock, VsockOverride};
use super::{Vmm, VmmLimits};
use crate::{AgentConn, Availability, Engine, EngineError, LiveStatus, SandboxSpec, Started};

/// How long a microVM may take from start to the agent's hello, unless
/// configured.
pub const BOOT_PATIENCE: Duration = Duration::from_secs(20);
/// How long an agent has to let go of its socket before a snapshot.
const QUIESCE_PATIENCE: Duration = Duration::from_secs(10);
const GUEST_CID: u32 = 3;
const AGENT_PORT: u32 = 1024;
const BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off quiet";
/// The ext4 root drive: in a template version's directory, in a sandbox's
/// and in a template snapshot.
const ROOT_DRIVE: &str = space_host::template::EXT4_IMAGE;
/// A snapshot's device state and memory.
const STATE: &str = "vm.state";
/// The VMM's end of the hybrid vsock (the host listens on `<it>_<port>`).
const VSOCK: &str = "vsock.sock";
const MEMORY: &str = "vm.mem";
/// The first uid a jailed VMM runs as: far above the ranges distributions
/// give users and subordinate ids, so no account on the host shares one.
pub const JAIL_UID: u32 = 1_900_000_000;
/// How many uids jailed VMMs take one each from, from `jail_uid`.
const JAIL_UIDS: u32 = 65536;
/// How long a VMM a previous server left has to tell its state.
const ADOPT_PATIENCE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct FirecrackerConfig {
    pub firecracker: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// When set, each VMM runs under this jailer, chrooted under
    /// `jail_base`, as a uid (and gid) of its own from `jail_uid` up; else
    /// as a plain child process.
    pub jailer: Option<PathBuf>,
    pub jail_base: PathBuf,
    pub jail_uid: u32,
    /// How long a microVM may take from start (or load) to its agent's
    /// hello: [`BOOT_PATIENCE`].
    pub boot_patience: Duration,
}

/// The jailer and firecracker take letters, digits and `-` in an id.
fn jail_id(id: &str) -> String {
    id.replace('_', "-")
}

/// Where a VMM's files are, as the host and as the VMM see them.
struct Layout {
    /// The VMM's working directory on the host: the sandbox's directory,
    /// or the root of its jail.
    host: PathBuf,
    /// Whether the VMM is chrooted there.
    jailed: bool,
}

impl Layout {
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
}

/// A VMM this engine runs, and whether it is paused.
struct Running {
    vmm: Vmm,
    paused: bool,
}

pub struct Firecracker {
    config: FirecrackerConfig,
    vmms: Mutex<HashMap<String, Running>>,
    /// Held while a jail's uid is chosen and its root made, so two jails
    /// never take the same uid.
    jail_uids: Mutex<()>,
    /// One lock per template snapshot, so each is made once.
    template_snapshots: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
}

impl Firecracker {
    pub fn new(config: FirecrackerConfig) -> Firecracker {
        Firecracker {
            config,
            vmms: Mutex::new(HashMap::new()),
            jail_uids: Mutex::new(()),
            template_snapshots: Mutex::new(HashMap::new()),
        }
    }

    /// Where the host listens for the agent (Firecracker's hybrid vsock
    /// connects the guest's CID 2 port to `<uds_path>_<port>`).
    fn agent_socket(layout: &Layout) -> PathBuf {
        layout.host(&format!("{VSOCK}_{AGENT_PORT}"))
    }

    /// The sandbox's own snapshot.
    fn snapshot_dir(dir: &Path) -> PathBuf {
        dir.join("snapshot")
    }

    /// The VMM's working directory: its jail's root, or the sandbox's dir.
    fn vmm_dir(&self, spec: &SandboxSpec) -> PathBuf {
        match &self.config.jailer {
            Some(_) => Vmm::jail_root(&self.config.firecracker, &self.config.jail_base, &jail_id(&spec.id)),
            None => spec.dir.clone(),
        }
    }

    fn listen(&self, layout: &Layout) -> Result<UnixListener, EngineError> {
        let path = Self::agent_socket(layout);
        let _ = fs::remove_file(&path);
        let listener = super::at_socket(&path, |p| std::os::unix::net::UnixListener::bind(p))
            .and_then(|listener| {
                listener.set_nonblocking(true)?;
                UnixListener::from_std(listener)
            })
            .map_err(EngineError::io("listening for the agent"))?;
        if layout.jailed {
            // The jailed VMM connects as its own uid.
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o777)).map_err(EngineError::io("socket mode"))?;
        }
        Ok(listener)
    }

    async fn accept(&self, listener: UnixListener, layout: &Layout) -> Result<tokio::net::UnixStream, EngineError> {
        let patience = self.config.boot_patience;
        let (socket, _) = tokio::time::timeout(patience, listener.accept())
            .await
            .map_err(|_| EngineError::Runtime(format!("the agent did not dial home within {patience:?}")))?
            .map_err(EngineError::io("accepting the agent"))?;
        let _ = fs::remove_file(Self::agent_socket(layout));
        Ok(socket)
    }

    /// Prepares where this sandbox's VMM will find its files. Under the
    /// jailer they are placed in its chroot — `own` files hard-linked and
    /// owned by the VMM's uid, `shared` ones (the kernel and initramfs it
    /// boots, a template snapshot) hard-linked read-only — and a uid no other jail holds is
    /// chosen (the jail root's owner records it). Returns the layout and
    /// the uid.
    fn layout(
        &self,
        spec: &SandboxSpec,
        own: &[(&str, &Path)],
        shared: &[(&str, &Path)],
    ) -> Result<(Layout, Option<u32>), EngineError> {
        let Some(_) = &self.config.jailer else {
            // A previous VMM's vsock socket would keep this one from binding.
            let _ = fs::remove_file(spec.dir.join(VSOCK));
            return Ok((Layout { host: spec.dir.clone(), jailed: false }, None));
        };
        let root = self.vmm_dir(spec);
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
        for (name, source) in own {
            let target = root.join(name);
            fs::hard_link(source, &target).map_err(EngineError::io(format!("linking {name} into the jail")))?;
            std::os::unix::fs::chown(&target, Some(uid), Some(uid)).map_err(EngineError::io("chown into the jail"))?;
        }
        Ok((Layout { host: root, jailed: true }, Some(uid)))
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
    async fn spawn(&self, spec: &SandboxSpec, uid: Option<u32>) -> Result<super::Api, EngineError> {
        let vmm = match (&self.config.jailer, uid) {
            (Some(jailer), Some(uid)) => {
                let (id, base) = (jail_id(&spec.id), &self.config.jail_base);
                let limits = VmmLimits { vcpus: spec.vcpus, memory_mib: spec.memory_mib };
                Vmm::spawn_jailed(jailer, &self.config.firecracker, base, &id, uid, uid, limits).await
            }
            // Firecracker's --id takes the same characters as the jailer's.
            _ => Vmm::spawn(&self.config.firecracker, &spec.dir, &jail_id(&spec.id)).await,
        }?;
        // VMMs outlive the server; a restarted one finds them by this.
        let _ = fs::write(spec.dir.join("vmm.pid"), vmm.pid().to_string());
        let api = vmm.api.clone();
        let replaced =
            self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(spec.id.clone(), Running { vmm, paused: false });
        if let Some(mut replaced) = replaced {
            replaced.vmm.kill().await;
        }
        Ok(api)
    }

    /// A VMM started by an earlier server process and still running, not
    /// yet taken back: found by its pid file, and recognised by the binary
    /// it runs (this engine's firecracker, or its copy in the sandbox's
    /// jail), not by its name.
    fn adoptable(&self, spec: &SandboxSpec) -> Option<Vmm> {
        if self.vmms.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&spec.id) {
            return None;
        }
        let pid = fs::read_to_string(spec.dir.join("vmm.pid")).ok()?.trim().parse::<i32>().ok()?;
        let dir = self.vmm_dir(spec);
        let binary = &self.config.firecracker;
        match &self.config.jailer {
            Some(_) => super::runs_binary(pid, &dir.join(super::exec_name(binary)))
                .then(|| Vmm::adopted_jailed(binary, &self.config.jail_base, &jail_id(&spec.id), pid)),
            None => super::runs_binary(pid, binary).then(|| Vmm::adopted(&dir, pid)),
        }
    }

    /// Keeps an adopted VMM in the state its API told (a previous server
    /// may have paused it), unless another caller took it back first.
    fn keep_adopted(&self, spec: &SandboxSpec, vmm: Vmm, state: Result<super::api::InstanceInfo, EngineError>) {
        let paused = match state {
            Ok(info) => info.state == "Paused",
            Err(err) => {
                tracing::warn!(sandbox = %spec.id, "a VMM left running does not tell its state, taken as running: {err}");
                false
            }
        };
        let mut vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        match vmms.entry(spec.id.clone()) {
            std::collections::hash_map::Entry::Occupied(_) => vmm.release(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                entry.insert(Running { vmm, paused });
            }
        }
    }

    /// Takes back the sandbox's VMM a previous server left running, asking
    /// its API whether it is paused. Blocking.
    fn adopt(&self, spec: &SandboxSpec) {
        if let Some(vmm) = self.adoptable(spec) {
            let state = vmm.api.instance_info_blocking(ADOPT_PATIENCE);
            self.keep_adopted(spec, vmm, state);
        }
    }

    /// [`Firecracker::adopt`] for the async threads.
    async fn adopt_async(&self, spec: &SandboxSpec) {
        if let Some(vmm) = self.adoptable(spec) {
            let state = tokio::time::timeout(ADOPT_PATIENCE, vmm.api.instance_info()).await.unwrap_or_else(|_| {
                Err(EngineError::Runtime(format!("its API did not answer within {ADOPT_PATIENCE:?}")))
            });
            self.keep_adopted(spec, vmm, state);
        }
    }

    fn with_vmm<T>(&self, id: &str, f: impl FnOnce(&mut Running) -> T) -> Result<T, EngineError> {
        let mut vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        let running = vmms.get_mut(id).ok_or_else(|| EngineError::Runtime(format!("no microVM for {id}")))?;
        Ok(f(running))
    }

    fn api(&self, id: &str) -> Result<super::Api, EngineError> {
        self.with_vmm(id, |running| running.vmm.api.clone())
    }

    /// The sandbox's root drive: a reflink copy of `image`, grown by
    /// `extra_mib` (what the sandbox asks for over the template's default).
    fn copy_root_drive(spec: &SandboxSpec, image: &Path, extra_mib: u32) -> Result<PathBuf, EngineError> {
        fs::create_dir_all(&spec.dir).map_err(EngineError::io("creating the sandbox dir"))?;
        let root = spec.dir.join(ROOT_DRIVE);
        space_host::run(Command::new("cp").arg("--reflink=auto").arg(image).arg(&root))?;
        if extra_mib > 0 {
            let size = fs::metadata(&root).map_err(EngineError::io("the root drive"))?.len();
            let grown = size.div_ceil(1 << 20) + u64::from(extra_mib);
            space_host::run(Command::new("resize2fs").arg("-f").arg(&root).arg(format!("{grown}M")))?;
        }
        Ok(root)
    }

    /// Boots a new microVM from the template's ext4 image.
    async fn boot(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        let template_image = spec.template_rootfs.with_file_name(ROOT_DRIVE);
        if !template_image.is_file() {
            return Err(EngineError::Runtime(
                "the template has no ext4 image; rebuild it on this host (or with --ext4-images true)".into(),
            ));
        }
        let root = Self::copy_root_drive(spec, &template_image, extra_disk_mib(spec))?;
        let guest = [("vmlinux", self.config.kernel.as_path()), ("initramfs.cpio", self.config.initramfs.as_path())];
        let (layout, uid) = self.layout(spec, &[(ROOT_DRIVE, &root)], &guest)?;
        let listener = self.listen(&layout)?;
        let started = Instant::now();
        let api = self.spawn(spec, uid).await?;
        api.boot_source(&BootSource {
            kernel_image_path: layout.shared("vmlinux", &self.config.kernel),
            initrd_path: Some(layout.shared("initramfs.cpio", &self.config.initramfs)),
            boot_args: BOOT_ARGS.into(),
        })
        .await?;
        api.machine_config(&MachineConfig {
            vcpu_count: spec.vcpus,
            mem_size_mib: spec.memory_mib,
            smt: false,
            track_dirty_pages: false,
        })
        .await?;
        api.drive(&Drive {
            drive_id: "root".into(),
            path_on_host: Layout::own(ROOT_DRIVE),
            is_root_device: true,
            is_read_only: false,
        })
        .await?;
        api.vsock(&Vsock { guest_cid: GUEST_CID, uds_path: Layout::own(VSOCK) }).await?;
        api.start().await?;
        let socket = self.accept(listener, &layout).await?;
        let boot = started.elapsed();
        let agent = AgentConn::handshake(socket, crate::welcome_for(spec), self.config.boot_patience).await?;
        Ok(Started { agent, boot, steps: Vec::new() })
    }

    /// Pauses the VMM (if it is not) and saves a full snapshot of it into
    /// `target` (`vm.state`, `vm.mem`).
    async fn save(&self, spec: &SandboxSpec, target: &Path) -> Result<(), EngineError> {
        let api = self.api(&spec.id)?;
        if !self.with_vmm(&spec.id, |running| running.paused)? {
            api.pause().await?;
            self.with_vmm(&spec.id, |running| running.paused = true)?;
        }
        let cwd = self.vmm_dir(spec);
        for name in [STATE, MEMORY] {
            let _ = fs::remove_file(cwd.join(name));
        }
        api.snapshot_create(&SnapshotCreate {
            snapshot_type: "Full",
            snapshot_path: Layout::own(STATE),
            mem_file_path: Layout::own(MEMORY),
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

    /// Loads the snapshot `state` + `memory` into a new VMM for `spec` on
    /// the root drive `drive` (in the sandbox's directory), and returns the
    /// socket its agent dials from and how long that took. The memory file
    /// is mapped privately. A `shared` snapshot (a template's) is only read;
    /// a sandbox's own becomes its new VMM's.
    async fn load(
        &self,
        spec: &SandboxSpec,
        drive: &Path,
        (state, memory): (&Path, &Path),
        shared: bool,
    ) -> Result<(tokio::net::UnixStream, Duration), EngineError> {
        let snapshot = [(STATE, state), (MEMORY, memory)];
        let drive = [(ROOT_DRIVE, drive)];
        let (layout, uid) = if shared {
            self.layout(spec, &drive, &snapshot)?
        } else {
            self.layout(spec, &[drive[0], snapshot[0], snapshot[1]], &[])?
        };
        let listener = self.listen(&layout)?;
        let started = Instant::now();
        let api = self.spawn(spec, uid).await?;
        // Linked into a jail under their names; else named where they are.
        api.snapshot_load(&SnapshotLoad {
            snapshot_path: layout.shared(STATE, state),
            mem_backend: MemBackend { backend_type: "File", backend_path: layout.shared(MEMORY, memory) },
            resume_vm: true,
            vsock_override: Some(VsockOverride { uds_path: Layout::own(VSOCK) }),
        })
        .await?;
        let socket = self.accept(listener, &layout).await?;
        Ok((socket, started.elapsed()))
    }

    /// Where the snapshot of `spec`'s template for its shape is kept, if
    /// the sandbox has its template's default shape (clones have exactly
    /// the template microVM's vCPUs, memory and disk). Named by the guest
    /// kernel and initramfs too, so a new agent makes a new snapshot.
    pub fn template_snapshot_dir(&self, spec: &SandboxSpec) -> Option<PathBuf> {
        let defaults = template_defaults(spec)?;
        if (spec.vcpus, spec.memory_mib, spec.disk_mib) != (defaults.vcpus, defaults.memory_mib, defaults.disk_mib) {
            return None;
        }
        let mut guest = Vec::new();
        for file in [&self.config.kernel, &self.config.initramfs] {
            let meta = fs::metadata(file).ok()?;
            guest.push((meta.len(), meta.modified().ok()));
        }
        let name = format!("{}cpu-{}mib-{:016x}", spec.vcpus, spec.memory_mib, hash_of(&guest));
        Some(spec.template_rootfs.with_file_name("firecracker").join(name))
    }

    /// The template snapshot for `spec`, made first if there is none: the
    /// template's microVM is booted, its agent quiesced (it will redial
    /// from every clone) and the VM saved with its root drive.
    async fn template_snapshot(&self, spec: &SandboxSpec, dir: &Path) -> Result<(), EngineError> {
        let complete = |dir: &Path| [STATE, MEMORY, ROOT_DRIVE].iter().all(|name| dir.join(name).is_file());
        if complete(dir) {
            return Ok(());
        }
        let lock = self
            .template_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(dir.to_path_buf())
            .or_default()
            .clone();
        let _making = lock.lock().await;
        if complete(dir) {
            return Ok(());
        }
        let building = dir.with_extension("building");
        let _ = fs::remove_dir_all(&building);
        // One id per template version and shape: its VMM and jail.
        let template = SandboxSpec {
            id: format!("tpl-{:016x}", hash_of(dir)),
            dir: building.clone(),
            hostname: "template".into(),
            env: Default::default(),
            ..spec.clone()
        };
        let made = async {
            let started = self.boot(&template).await?;
            started.agent.quiesce(QUIESCE_PATIENCE).await?;
            self.save(&template, &building).await
        }
        .await;
        self.kill(&template.id).await;
        let kept = made.and_then(|()| {
            // Clones read it as their own uids: root's, read-only for them.
            for name in [STATE, MEMORY, ROOT_DRIVE] {
                let path = building.join(name);
                std::os::unix::fs::chown(&path, Some(0), Some(0)).map_err(EngineError::io("chown of the snapshot"))?;
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
                    .map_err(EngineError::io("the snapshot's mode"))?;
            }
            for leftover in ["vmm.pid", "api.sock", VSOCK, "firecracker.log"] {
                let _ = fs::remove_file(building.join(leftover));
            }
            // Snapshots made for an older guest are of no more use.
            if let Some(parent) = dir.parent() {
                for entry in fs::read_dir(parent).into_iter().flatten().flatten() {
                    if entry.path() != building && entry.path() != dir {
                        let _ = fs::remove_dir_all(entry.path());
                    }
                }
            }
            fs::rename(&building, dir).map_err(EngineError::io("keeping the template snapshot"))
        });
        if kept.is_err() {
            let _ = fs::remove_dir_all(&building);
        }
        kept
    }

    /// Starts `spec` as a clone of its template's snapshot in `dir`.
    async fn clone_of(&self, spec: &SandboxSpec, dir: &Path) -> Result<Started, EngineError> {
        self.template_snapshot(spec, dir).await?;
        // A clone has its template's default shape: the drive as saved.
        let root = Self::copy_root_drive(spec, &dir.join(ROOT_DRIVE), 0)?;
        let (socket, boot) = self.load(spec, &root, (&dir.join(STATE), &dir.join(MEMORY)), true).await?;
        // The welcome makes the clone this sandbox (id, hostname, env); the
        // entropy reseeds the random state every clone woke up with.
        let agent = AgentConn::handshake(socket, crate::welcome_for(spec), self.config.boot_patience).await?;
        agent
            .set_identity(&crate::fresh_identity(&spec.env, spec.trust_pem.as_deref())?, self.config.boot_patience)
            .await?;
        Ok(Started { agent, boot, steps: Vec::new() })
    }

    async fn kill(&self, id: &str) {
        let running = self.vmms.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        if let Some(mut running) = running {
            running.vmm.kill().await;
        }
    }

    fn kill_blocking(&self, id: &str) {
        let running = self.vmms.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        if let Some(mut running) = running {
            running.vmm.kill_blocking();
        }
    }
}

/// The template's default sandbox shape, from the version's metadata.
fn template_defaults(spec: &SandboxSpec) -> Option<space_host::template::TemplateDefaults> {
    let version = spec.template_rootfs.parent()?;
    space_host::template::TemplateInfo::load(version).ok().map(|t| t.meta.defaults)
}

/// The disk a sandbox asks for over its template's default, in MiB.
fn extra_disk_mib(spec: &SandboxSpec) -> u32 {
    template_defaults(spec).map_or(0, |d| spec.disk_mib.saturating_sub(d.disk_mib))
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

#[async_trait::async_trait]
impl Engine for Firecracker {
    fn name(&self) -> &'static str {
        "firecracker"
    }

    fn availability(&self) -> Availability {
        super::availability(Some(&self.config.firecracker), Some((&self.config.kernel, &self.config.initramfs)))
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        let started = match self.template_snapshot_dir(spec) {
            Some(dir) => self.clone_of(spec, &dir).await,
            None => self.boot(spec).await,
        };
        if started.is_err() {
            let _ = self.destroy(spec).await;
        }
        started
    }

    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt_async(spec).await;
        self.api(&spec.id)?.pause().await?;
        self.with_vmm(&spec.id, |running| running.paused = true)
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt_async(spec).await;
        self.api(&spec.id)?.resume().await?;
        self.with_vmm(&spec.id, |running| running.paused = false)
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt_async(spec).await;
        let target = Self::snapshot_dir(&spec.dir);
        let _ = fs::remove_dir_all(&target);
        self.save(spec, &target).await?;
        self.kill(&spec.id).await;
        Ok(())
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        if !self.has_snapshot(spec) {
            return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
        }
        let snapshot = Self::snapshot_dir(&spec.dir);
        let root = spec.dir.join(ROOT_DRIVE);
        let loaded = self.load(spec, &root, (&snapshot.join(STATE), &snapshot.join(MEMORY)), false).await;
        loaded.map(|(socket, _)| socket)
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        let snapshot = Self::snapshot_dir(&spec.dir);
        snapshot.join(STATE).is_file() && snapshot.join(MEMORY).is_file()
    }

    fn saves_images(&self, _spec: &SandboxSpec) -> bool {
        true
    }

    /// The microVM paused for the instant: a full snapshot (state and
    /// memory, whose page cache holds what the guest has not yet written
    /// back) and a reflink copy of its root drive, then resumed.
    async fn save_image(&self, spec: &SandboxSpec, image: &Path) -> Result<Duration, EngineError> {
        self.adopt_async(spec).await;
        let was_paused = self.with_vmm(&spec.id, |running| running.paused)?;
        let started = Instant::now();
        let saved = async {
            self.save(spec, image).await?;
            let (root, copy) = (spec.dir.join(ROOT_DRIVE), image.join(ROOT_DRIVE));
            space_host::run(Command::new("cp").arg("--reflink=auto").arg(&root).arg(&copy)).map(drop)?;
            Ok::<(), EngineError>(())
        }
        .await;
        let thawed = match was_paused {
            true => Ok(()),
            false => self.resume(spec).await,
        };
        let frozen = started.elapsed();
        saved?;
        thawed?;
        Ok(frozen)
    }

    /// A new microVM loads the image's snapshot (its memory mapped
    /// privately, as clones of a template's are) on its own reflink copy
    /// of the image's root drive.
    async fn start_from_image(&self, spec: &SandboxSpec, image: &Path) -> Result<tokio::net::UnixStream, EngineError> {
        if !(image.join(STATE).is_file() && image.join(MEMORY).is_file()) {
            return Err(EngineError::Runtime("the image is not whole".into()));
        }
        self.kill(&spec.id).await;
        let root = Self::copy_root_drive(spec, &image.join(ROOT_DRIVE), 0)?;
        let _ = fs::remove_dir_all(Self::snapshot_dir(&spec.dir));
        let loaded = self.load(spec, &root, (&image.join(STATE), &image.join(MEMORY)), true).await;
        loaded.map(|(socket, _)| socket)
    }

    fn resource_use(&self, spec: &SandboxSpec) -> Option<crate::ResourceUse> {
        // Only a jailed microVM has a cgroup of its own.
        self.config.jailer.as_ref()?;
        crate::cgroup_use(&Path::new(super::PARENT_CGROUP).join(jail_id(&spec.id)))
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        self.adopt(spec);
        let vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        match vmms.get(&spec.id) {
            Some(running) if super::alive(running.vmm.pid()) => {
                if running.paused {
                    LiveStatus::Paused
                } else {
                    LiveStatus::Running
                }
            }
            _ => LiveStatus::Gone,
        }
    }

    async fn redial(&self, spec: &SandboxSpec) -> Result<crate::AgentListener, EngineError> {
        let layout = Layout { host: self.vmm_dir(spec), jailed: self.config.jailer.is_some() };
        let listener = self.listen(&layout)?;
        Ok(crate::AgentListener::new(listener, Self::agent_socket(&layout)))
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt(spec);
        self.kill_blocking(&spec.id);
        Ok(())
    }

    /// Stops the sandbox's VMM and removes its directory.
    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt_async(spec).await;
        self.kill(&spec.id).await;
        let dir = spec.dir.clone();
        let removed = tokio::task::spawn_blocking(move || match dir.exists() {
            true => fs::remove_dir_all(&dir),
            false => Ok(()),
        });
        removed
            .await
            .map_err(|e| EngineError::Runtime(format!("removing the sandbox dir: {e}")))?
            .map_err(EngineError::io("removing the sandbox dir"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A template version with the default shape 1 vCPU / 128 MiB / 16 MiB
    /// of disk and its ext4 image, in a fresh directory.
    fn template(name: &str) -> PathBuf {
        let version = std::env::temp_dir().join(format!("space-fc-{name}-{}", std::process::id())).join("1");
        let _ = fs::remove_dir_all(&version);
        fs::create_dir_all(version.join("rootfs/etc")).unwrap();
        fs::write(version.join("rootfs/etc/hostname"), "t\n").unwrap();
        space_host::template::make_ext4(&version.join("rootfs"), &version.join(ROOT_DRIVE), 16).unwrap();
        let meta = serde_json::json!({
            "name": "t", "version": 1, "created_at": "2026-12-02T00:00:00Z", "source": {},
            "defaults": {"vcpus": 1, "memory_mib": 128, "disk_mib": 16, "env": {}, "workdir": "/", "user": "root"},
        });
        fs::write(version.join("template.json"), meta.to_string()).unwrap();
        version
    }

    fn spec(version: &Path, disk_mib: u32) -> SandboxSpec {
        SandboxSpec {
            id: "sbx_drive".into(),
            dir: version.parent().unwrap().join(format!("sandbox-{disk_mib}")),
            template_rootfs: version.join("rootfs"),
            hostname: "sbx".into(),
            vcpus: 1,
            memory_mib: 128,
            disk_mib,
            env: Default::default(),
            workdir: None,
            user: None,
            engine: None,
            trust_pem: None,
        }
    }

    fn block_count(image: &Path) -> u64 {
        let out = space_host::run(Command::new("dumpe2fs").arg("-h").arg(image)).unwrap();
        let text = String::from_utf8_lossy(&out);
        text.lines().find_map(|l| l.strip_prefix("Block count:")).unwrap().trim().parse().unwrap()
    }

    #[test]
    fn a_root_drive_grows_by_the_disk_asked_for_over_the_template_default() {
        let version = template("grow");
        let image = version.join(ROOT_DRIVE);
        let extra = extra_disk_mib;
        let (default, bigger) = (spec(&version, 16), spec(&version, 48));
        assert_eq!((extra(&default), extra(&bigger)), (0, 32), "the disk asked for over the template's default");
        let same = Firecracker::copy_root_drive(&default, &image, extra(&default)).unwrap();
        assert_eq!(fs::metadata(&same).unwrap().len(), fs::metadata(&image).unwrap().len(), "the default: a copy");
        let grown = Firecracker::copy_root_drive(&bigger, &image, extra(&bigger)).unwrap();
        let extra = fs::metadata(&grown).unwrap().len() - fs::metadata(&image).unwrap().len();
        assert_eq!(extra, 32 << 20, "32 MiB more than the template's default");
        assert!(block_count(&grown) > block_count(&image), "the file system was resized too");
        space_host::run(Command::new("e2fsck").arg("-fn").arg(&grown)).expect("and is clean");
        // The template's image is untouched.
        space_host::run(Command::new("e2fsck").arg("-fn").arg(&image)).unwrap();
        let _ = fs::remove_dir_all(version.parent().unwrap());
    }

    /// A VMM a previous server left is taken back only if it runs the
    /// configured binary: another program that is merely called
    /// `firecracker` is not (its pid file may name a reused pid).
    #[test]
    fn only_a_process_of_the_configured_binary_is_adopted() {
        let version = template("adopt");
        let dir = version.parent().unwrap().to_path_buf();
        // Two different programs called `firecracker`: copies of `sleep`.
        let (configured, impostor) = (dir.join("configured/firecracker"), dir.join("impostor/firecracker"));
        for copy in [&configured, &impostor] {
            fs::create_dir_all(copy.parent().unwrap()).unwrap();
            fs::copy("/bin/sleep", copy).unwrap();
        }
        let engine = |binary: &Path| {
            Firecracker::new(FirecrackerConfig {
                firecracker: binary.to_path_buf(),
                kernel: version.join("template.json"),
                initramfs: version.join(ROOT_DRIVE),
                jailer: None,
                jail_base: dir.join("jail"),
                jail_uid: JAIL_UID,
                boot_patience: BOOT_PATIENCE,
            })
        };
        let spec = spec(&version, 16);
        fs::create_dir_all(&spec.dir).unwrap();
        let running = space_process::Reaper::global().spawn(Command::new(&configured).arg("30")).unwrap();
        fs::write(spec.dir.join("vmm.pid"), running.id().to_string()).unwrap();
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
        assert_eq!(engine(&impostor).status(&spec), LiveStatus::Gone, "a process of another binary is not the VMM");
        let owner = engine(&configured);
        assert_eq!(owner.status(&spec), LiveStatus::Running, "the configured binary's process is");
        owner.stop(&spec).unwrap();
        assert!(running.wait_timeout(Duration::from_secs(5)).is_some(), "and stopping the sandbox stops it");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_the_template_default_shape_is_a_clone() {
        let version = template("shape");
        let engine = Firecracker::new(FirecrackerConfig {
            firecracker: "/nonexistent/firecracker".into(),
            kernel: version.join("template.json"),
            initramfs: version.join(ROOT_DRIVE),
            jailer: None,
            jail_base: version.join("jail"),
            jail_uid: JAIL_UID,
            boot_patience: BOOT_PATIENCE,
        });
        let default = spec(&version, 16);
        let dir = engine.template_snapshot_dir(&default).expect("the default shape is cloned");
        assert!(dir.starts_with(version.join("firecracker")), "kept with the template version: {}", dir.display());
        assert_eq!(engine.template_snapshot_dir(&default), Some(dir.clone()), "the same snapshot every time");
        for other in [
            SandboxSpec { disk_mib: 48, ..default.clone() },
            SandboxSpec { memory_mib: 256, ..default.clone() },
            SandboxSpec { vcpus: 2, ..default.clone() },
        ] {
            assert_eq!(engine.template_snapshot_dir(&other), None, "another shape boots");
        }
        // A new guest (kernel or initramfs) means a new snapshot.
        std::thread::sleep(std::time::Duration::from_millis(10));
        fs::write(version.join("template.json"), fs::read(version.join("template.json")).unwrap()).unwrap();
        assert_ne!(engine.template_snapshot_dir(&default), Some(dir));
        let _ = fs::remove_dir_all(version.parent().unwrap());
    }
}
