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
}

pub struct Firecracker {
    config: FirecrackerConfig,
    vmms: Mutex<HashMap<String, (Vmm, bool)>>,
}

impl Firecracker {
    pub fn new(config: FirecrackerConfig) -> Firecracker {
        Firecracker { config, vmms: Mutex::new(HashMap::new()) }
    }

    fn vsock_base(dir: &Path) -> PathBuf {
        dir.join("vsock.sock")
    }

    /// Where the host listens for the agent.
    fn agent_socket(dir: &Path) -> PathBuf {
        PathBuf::from(format!("{}_{AGENT_PORT}", Self::vsock_base(dir).display()))
    }

    fn snapshot(dir: &Path) -> (PathBuf, PathBuf) {
        (dir.join("snapshot/vm.state"), dir.join("snapshot/vm.mem"))
    }

    fn listen(dir: &Path) -> Result<UnixListener, EngineError> {
        let path = Self::agent_socket(dir);
        let _ = fs::remove_file(&path);
        UnixListener::bind(&path).map_err(EngineError::io("listening for the agent"))
    }

    async fn accept(listener: UnixListener, dir: &Path) -> Result<tokio::net::UnixStream, EngineError> {
        let (socket, _) = tokio::time::timeout(BOOT_PATIENCE, listener.accept())
            .await
            .map_err(|_| EngineError::Runtime(format!("the agent did not dial home within {BOOT_PATIENCE:?}")))?
            .map_err(EngineError::io("accepting the agent"))?;
        let _ = fs::remove_file(Self::agent_socket(dir));
        Ok(socket)
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
        let listener = Self::listen(&spec.dir)?;
        let started = Instant::now();
        let vmm = Vmm::spawn(&self.config.firecracker, &spec.dir.join("vmm"), &spec.id).await?;
        let api = vmm.api.clone();
        self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(spec.id.clone(), (vmm, false));
        api.boot_source(&BootSource {
            kernel_image_path: self.config.kernel.clone(),
            initrd_path: Some(self.config.initramfs.clone()),
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
        api.drive(&Drive { drive_id: "root".into(), path_on_host: root, is_root_device: true, is_read_only: false })
            .await?;
        api.vsock(&Vsock { guest_cid: GUEST_CID, uds_path: Self::vsock_base(&spec.dir) }).await?;
        api.start().await?;
        let socket = Self::accept(listener, &spec.dir).await?;
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
        self.api(&spec.id)?.pause().await?;
        self.with_vmm(&spec.id, |(_, paused)| *paused = true)
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.api(&spec.id)?.resume().await?;
        self.with_vmm(&spec.id, |(_, paused)| *paused = false)
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        let api = self.api(&spec.id)?;
        let paused = self.with_vmm(&spec.id, |(_, paused)| *paused)?;
        if !paused {
            api.pause().await?;
        }
        let (state, memory) = Self::snapshot(&spec.dir);
        let _ = fs::remove_dir_all(state.parent().unwrap_or(&spec.dir));
        fs::create_dir_all(state.parent().unwrap_or(&spec.dir))
            .map_err(EngineError::io("creating the snapshot dir"))?;
        api.snapshot_create(&SnapshotCreate { snapshot_type: "Full", snapshot_path: state, mem_file_path: memory })
            .await?;
        self.kill(&spec.id);
        Ok(())
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        let (state, memory) = Self::snapshot(&spec.dir);
        if !self.has_snapshot(spec) {
            return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
        }
        let listener = Self::listen(&spec.dir)?;
        let vmm = Vmm::spawn(&self.config.firecracker, &spec.dir.join("vmm"), &spec.id).await?;
        let api = vmm.api.clone();
        self.vmms.lock().unwrap_or_else(|e| e.into_inner()).insert(spec.id.clone(), (vmm, false));
        api.snapshot_load(&SnapshotLoad {
            snapshot_path: state,
            mem_backend: MemBackend { backend_type: "File", backend_path: memory },
            resume_vm: true,
            vsock_override: Some(VsockOverride { uds_path: Self::vsock_base(&spec.dir) }),
        })
        .await?;
        Self::accept(listener, &spec.dir).await
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        let (state, memory) = Self::snapshot(&spec.dir);
        state.is_file() && memory.is_file()
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
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
        let listener = Self::listen(&spec.dir)?;
        Self::accept(listener, &spec.dir).await
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.kill(&spec.id);
        Ok(())
    }

    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.kill(&spec.id);
        if spec.dir.exists() {
            fs::remove_dir_all(&spec.dir).map_err(EngineError::io("removing the sandbox dir"))?;
        }
        Ok(())
    }
}
