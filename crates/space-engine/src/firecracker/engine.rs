//! The Firecracker engine: each sandbox is one microVM. Its root drive is
//! a reflink copy of the template's ext4 image; the kernel and initramfs
//! come from `space setup`; the agent (the initramfs's `/init`) dials the
//! host over hybrid vsock — the guest connects to CID 2, port 1024, and
//! Firecracker hands the connection to the host's socket
//! `<uds_path>_1024`. Pause and resume are `PATCH /vm`; suspend is a full
//! snapshot; restore loads it into a new process, and the agent, whose
//! vsock connection did not survive, dials again.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::net::UnixListener;

use super::api::{BootSource, Drive, MachineConfig, MemBackend, SnapshotCreate, SnapshotLoad, Vsock, VsockOverride};
use super::Vmm;
use crate::{AgentConn, Availability, Engine, EngineError, LiveStatus, SandboxSpec, Started};

/// How long a microVM may take from start to the agent's hello.
const BOOT_PATIENCE: Duration = Duration::from_secs(20);
const GUEST_CID: u32 = 3;
const AGENT_PORT: u32 = 1024;
const BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off quiet";
/// The ext4 root drive inside a template version's directory.
const TEMPLATE_IMAGE: &str = "rootfs.ext4";

#[derive(Debug, Clone)]
pub struct FirecrackerConfig {
    pub firecracker: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// When set, each VMM runs under this jailer (as `jail_uid`, chrooted
    /// under `jail_base`); else as a plain child process.
    pub jailer: Option<PathBuf>,
    pub jail_base: PathBuf,
    pub jail_uid: u32,
}

/// Whether `pid` is a live firecracker process (not a recycled pid).
fn is_firecracker(pid: i32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|cmdline| cmdline.split(|&b| b == 0).next().is_some_and(|arg0| arg0.ends_with(b"firecracker")))
}

/// The jailer and firecracker take letters, digits and `-` in an id.
fn jail_id(id: &str) -> String {
    id.replace('_', "-")
}

/// Where a VMM's files are, as the host and as the VMM see them.
struct Layout {
    /// The directory on the host.
    host: PathBuf,
    /// Whether the VMM is chrooted there (it then names files from `/`).
    jailed: bool,
}

impl Layout {
    fn vm(&self, name: &str) -> PathBuf {
        if self.jailed {
            Path::new("/").join(name)
        } else {
            self.host.join(name)
        }
    }

    fn host(&self, name: &str) -> PathBuf {
        self.host.join(name)
    }
}

pub struct Firecracker {
    config: FirecrackerConfig,
    vmms: Mutex<HashMap<String, (Vmm, bool)>>,
}

impl Firecracker {
    pub fn new(config: FirecrackerConfig) -> Firecracker {
        Firecracker { config, vmms: Mutex::new(HashMap::new()) }
    }

    /// Where the host listens for the agent (Firecracker's hybrid vsock
    /// connects the guest's CID 2 port to `<uds_path>_<port>`).
    fn agent_socket(layout: &Layout) -> PathBuf {
        layout.host(&format!("vsock.sock_{AGENT_PORT}"))
    }

    /// The sandbox's snapshot, kept in its own directory.
    fn snapshot(dir: &Path) -> (PathBuf, PathBuf) {
        (dir.join("snapshot/vm.state"), dir.join("snapshot/vm.mem"))
    }

    fn listen(&self, layout: &Layout) -> Result<UnixListener, EngineError> {
        let path = Self::agent_socket(layout);
        let _ = fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(EngineError::io("listening for the agent"))?;
        if layout.jailed {
            // The jailed VMM connects as its own uid.
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o777)).map_err(EngineError::io("socket mode"))?;
        }
        Ok(listener)
    }

    async fn accept(listener: UnixListener, layout: &Layout) -> Result<tokio::net::UnixStream, EngineError> {
        let (socket, _) = tokio::time::timeout(BOOT_PATIENCE, listener.accept())
            .await
            .map_err(|_| EngineError::Runtime(format!("the agent did not dial home within {BOOT_PATIENCE:?}")))?
            .map_err(EngineError::io("accepting the agent"))?;
        let _ = fs::remove_file(Self::agent_socket(layout));
        Ok(socket)
    }

    /// Where this sandbox's VMM will find its files. Under the jailer they
    /// are placed in its chroot (the sandbox's own files hard-linked, the
    /// shared kernel and initramfs reflinked) and owned by its uid.
    fn layout(&self, spec: &SandboxSpec, extra: &[(&str, &Path)]) -> Result<Layout, EngineError> {
        let Some(_) = &self.config.jailer else {
            return Ok(Layout { host: spec.dir.clone(), jailed: false });
        };
        let root = Vmm::jail_root(&self.config.firecracker, &self.config.jail_base, &jail_id(&spec.id));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).map_err(EngineError::io("creating the jail"))?;
        let uid = self.config.jail_uid;
        for (name, source) in
            [("vmlinux", self.config.kernel.as_path()), ("initramfs.cpio", self.config.initramfs.as_path())]
        {
            space_host::run(Command::new("cp").arg("--reflink=auto").arg(source).arg(root.join(name)))?;
        }
        for (name, source) in extra {
            fs::hard_link(source, root.join(name)).map_err(EngineError::io(format!("linking {name} into the jail")))?;
        }
        let owned: Vec<PathBuf> =
            ["vmlinux", "initramfs.cpio"].iter().chain(extra.iter().map(|(n, _)| n)).map(|n| root.join(n)).collect();
        for path in owned.iter().chain(std::iter::once(&root)) {
            std::os::unix::fs::chown(path, Some(uid), Some(uid)).map_err(EngineError::io("chown into the jail"))?;
        }
        Ok(Layout { host: root, jailed: true })
    }

    async fn spawn(&self, spec: &SandboxSpec) -> Result<Vmm, EngineError> {
        let vmm = match &self.config.jailer {
            Some(jailer) => {
                let uid = self.config.jail_uid;
                let id = jail_id(&spec.id);
                Vmm::spawn_jailed(jailer, &self.config.firecracker, &self.config.jail_base, &id, uid, uid).await
            }
            // Firecracker's --id takes the same characters as the jailer's.
            None => Vmm::spawn(&self.config.firecracker, &spec.dir.join("vmm"), &jail_id(&spec.id)).await,
        }?;
        // VMMs outlive the server; a restarted one finds them by this.
        let _ = fs::write(spec.dir.join("vmm.pid"), vmm.pid().to_string());
        Ok(vmm)
    }

    /// A VMM started by an earlier server process, still running: taken
    /// back from its pid file, with its API socket and leftovers.
    fn adopt(&self, spec: &SandboxSpec) -> bool {
        if self.vmms.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&spec.id) {
            return true;
        }
        let pid = fs::read_to_string(spec.dir.join("vmm.pid")).ok().and_then(|p| p.trim().parse::<i32>().ok());
        let Some(pid) = pid.filter(|pid| is_firecracker(*pid)) else { return false };
        let (socket, leftovers) = match &self.config.jailer {
            Some(_) => {
                let root = Vmm::jail_root(&self.config.firecracker, &self.config.jail_base, &jail_id(&spec.id));
                (root.join("api.sock"), vec![root.parent().map(Path::to_path_buf).unwrap_or(root.clone())])
            }
            None => (spec.dir.join("vmm/api.sock"), vec![]),
        };
        let vmm = Vmm { child: None, pid, api: super::Api::new(&socket), ready_after: Duration::ZERO, leftovers };
        self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(spec.id.clone(), (vmm, false));
        true
    }

    fn with_vmm<T>(&self, id: &str, f: impl FnOnce(&mut (Vmm, bool)) -> T) -> Result<T, EngineError> {
        let mut vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        let vmm = vmms.get_mut(id).ok_or_else(|| EngineError::Runtime(format!("no microVM for {id}")))?;
        Ok(f(vmm))
    }

    fn api(&self, id: &str) -> Result<super::Api, EngineError> {
        self.with_vmm(id, |(vmm, _)| vmm.api.clone())
    }

    async fn boot(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        fs::create_dir_all(&spec.dir).map_err(EngineError::io("creating the sandbox dir"))?;
        let template_image = spec.template_rootfs.with_file_name(TEMPLATE_IMAGE);
        if !template_image.is_file() {
            return Err(EngineError::Runtime(
                "the template has no ext4 image; rebuild it on this host (or with --ext4-images true)".into(),
            ));
        }
        let root = spec.dir.join("rootfs.ext4");
        space_host::run(Command::new("cp").arg("--reflink=auto").arg(&template_image).arg(&root))?;
        let layout = self.layout(spec, &[("rootfs.ext4", &root)])?;
        let listener = self.listen(&layout)?;
        let started = Instant::now();
        let vmm = self.spawn(spec).await?;
        let api = vmm.api.clone();
        self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(spec.id.clone(), (vmm, false));
        let (kernel, initramfs) = if layout.jailed {
            (layout.vm("vmlinux"), layout.vm("initramfs.cpio"))
        } else {
            (self.config.kernel.clone(), self.config.initramfs.clone())
        };
        api.boot_source(&BootSource {
            kernel_image_path: kernel,
            initrd_path: Some(initramfs),
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
            path_on_host: layout.vm("rootfs.ext4"),
            is_root_device: true,
            is_read_only: false,
        })
        .await?;
        api.vsock(&Vsock { guest_cid: GUEST_CID, uds_path: layout.vm("vsock.sock") }).await?;
        api.start().await?;
        let socket = Self::accept(listener, &layout).await?;
        let boot = started.elapsed();
        let agent = AgentConn::handshake(socket, crate::welcome_for(spec), BOOT_PATIENCE).await?;
        Ok(Started { agent, boot })
    }

    fn kill(&self, id: &str) {
        if let Some((mut vmm, _)) = self.vmms.lock().unwrap_or_else(|e| e.into_inner()).remove(id) {
            vmm.kill();
        }
    }
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
        match self.boot(spec).await {
            Ok(started) => Ok(started),
            Err(err) => {
                let _ = self.destroy(spec).await;
                Err(err)
            }
        }
    }

    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt(spec);
        self.api(&spec.id)?.pause().await?;
        self.with_vmm(&spec.id, |(_, paused)| *paused = true)
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt(spec);
        self.api(&spec.id)?.resume().await?;
        self.with_vmm(&spec.id, |(_, paused)| *paused = false)
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt(spec);
        let api = self.api(&spec.id)?;
        let paused = self.with_vmm(&spec.id, |(_, paused)| *paused)?;
        if !paused {
            api.pause().await?;
        }
        let (state, memory) = Self::snapshot(&spec.dir);
        let snapshot_dir = state.parent().unwrap_or(&spec.dir).to_path_buf();
        let _ = fs::remove_dir_all(&snapshot_dir);
        fs::create_dir_all(&snapshot_dir).map_err(EngineError::io("creating the snapshot dir"))?;
        if self.config.jailer.is_some() {
            // Written inside the jail, then linked out before it goes.
            let root = Vmm::jail_root(&self.config.firecracker, &self.config.jail_base, &jail_id(&spec.id));
            let (jail_state, jail_memory) = (PathBuf::from("/vm.state"), PathBuf::from("/vm.mem"));
            api.snapshot_create(&SnapshotCreate {
                snapshot_type: "Full",
                snapshot_path: jail_state,
                mem_file_path: jail_memory,
            })
            .await?;
            for (name, target) in [("vm.state", &state), ("vm.mem", &memory)] {
                fs::hard_link(root.join(name), target).map_err(EngineError::io("keeping the snapshot"))?;
            }
        } else {
            api.snapshot_create(&SnapshotCreate { snapshot_type: "Full", snapshot_path: state, mem_file_path: memory })
                .await?;
        }
        self.kill(&spec.id);
        Ok(())
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        let (state, memory) = Self::snapshot(&spec.dir);
        if !self.has_snapshot(spec) {
            return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
        }
        let root = spec.dir.join("rootfs.ext4");
        let layout = self.layout(spec, &[("rootfs.ext4", &root), ("vm.state", &state), ("vm.mem", &memory)])?;
        let listener = self.listen(&layout)?;
        let vmm = self.spawn(spec).await?;
        let api = vmm.api.clone();
        self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(spec.id.clone(), (vmm, false));
        let (state, memory) =
            if layout.jailed { (layout.vm("vm.state"), layout.vm("vm.mem")) } else { (state, memory) };
        api.snapshot_load(&SnapshotLoad {
            snapshot_path: state,
            mem_backend: MemBackend { backend_type: "File", backend_path: memory },
            resume_vm: true,
            vsock_override: Some(VsockOverride { uds_path: layout.vm("vsock.sock") }),
        })
        .await?;
        Self::accept(listener, &layout).await
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        let (state, memory) = Self::snapshot(&spec.dir);
        state.is_file() && memory.is_file()
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        self.adopt(spec);
        let vmms = self.vmms.lock().unwrap_or_else(|e| e.into_inner());
        match vmms.get(&spec.id) {
            Some((vmm, paused)) if Path::new(&format!("/proc/{}", vmm.pid())).exists() => {
                if *paused {
                    LiveStatus::Paused
                } else {
                    LiveStatus::Running
                }
            }
            _ => LiveStatus::Gone,
        }
    }

    async fn redial(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        let layout = match &self.config.jailer {
            Some(_) => Layout {
                host: Vmm::jail_root(&self.config.firecracker, &self.config.jail_base, &jail_id(&spec.id)),
                jailed: true,
            },
            None => Layout { host: spec.dir.clone(), jailed: false },
        };
        let listener = self.listen(&layout)?;
        Self::accept(listener, &layout).await
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt(spec);
        self.kill(&spec.id);
        Ok(())
    }

    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.adopt(spec);
        self.kill(&spec.id);
        if spec.dir.exists() {
            fs::remove_dir_all(&spec.dir).map_err(EngineError::io("removing the sandbox dir"))?;
        }
        Ok(())
    }
}
