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
//! What needs root — jails, root drives, the VMMs, their cgroups and API
//! sockets, snapshots — the engine asks of an [`EngineHost`]
//! ([`FirecrackerHost`] in this process, or the root helper's); what it
//! keeps is talking to agents: waiting for one to dial, its handshake, and
//! quiescing a template's microVM before it is saved.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use space_privsep::layout::Layout;
use space_privsep::proto::{Mount, SandboxId, Shape, StartFrom, TemplateRef};
use tokio::net::UnixListener;

use super::local::{jail_id, FirecrackerHost};
use crate::host::{EngineHost, Hosted, Placed};
use crate::{AgentConn, AgentListener, Availability, Engine, EngineError, LiveStatus, SandboxSpec, Started};

/// How long a microVM may take from start to the agent's hello, unless
/// configured.
pub const BOOT_PATIENCE: Duration = Duration::from_secs(20);
/// How long an agent has to let go of its socket before a snapshot.
const QUIESCE_PATIENCE: Duration = Duration::from_secs(10);
/// A snapshot's device state and memory (where `has_snapshot` looks).
const STATE: &str = "vm.state";
const MEMORY: &str = "vm.mem";
/// The first uid a jailed VMM runs as: far above the ranges distributions
/// give users and subordinate ids, so no account on the host shares one.
pub const JAIL_UID: u32 = 1_900_000_000;

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
    /// The data dir whose sandboxes and templates these are.
    pub data_dir: PathBuf,
}

/// A template's name and version, and a shape's vCPUs, memory and disk.
type CloneBaseKey = (String, u32, (u32, u32, u32));

pub struct Firecracker {
    hosted: Hosted,
    boot_patience: Duration,
    /// One lock per template clone base, so each is made once.
    clone_bases: Mutex<HashMap<CloneBaseKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl Firecracker {
    /// The engine doing its root work in this process.
    pub fn new(config: FirecrackerConfig) -> Firecracker {
        let layout = Layout::new(config.data_dir.clone());
        let patience = config.boot_patience;
        Firecracker::with_host(layout, Arc::new(FirecrackerHost::new(config)), patience)
    }

    /// The engine asking the root helper at `socket` (served by
    /// `helper_uid`) for its root work, on sandboxes of `data_dir`.
    pub fn through_helper(data_dir: &Path, socket: &Path, helper_uid: u32, boot_patience: Duration) -> Firecracker {
        let host = crate::helper::HelperHost::for_engine(socket, helper_uid, space_privsep::proto::Engine::Firecracker);
        Firecracker::with_host(Layout::new(data_dir), Arc::new(host), boot_patience)
    }

    /// The engine asking `host` for its root work, with sandboxes' paths
    /// checked against `layout`.
    pub fn with_host(layout: Layout, host: Arc<dyn EngineHost>, boot_patience: Duration) -> Firecracker {
        Firecracker { hosted: Hosted::new(layout, host), boot_patience, clone_bases: Mutex::new(HashMap::new()) }
    }

    /// Asks the host to start `sandbox` from `from`, then waits for its
    /// agent to dial. Returns the agent's socket (before any handshake)
    /// and how long it took from the request.
    async fn launch(
        &self,
        sandbox: &SandboxId,
        from: StartFrom,
        shape: Shape,
        mounts: Vec<Mount>,
    ) -> Result<(tokio::net::UnixStream, Duration), EngineError> {
        let started = Instant::now();
        let id = sandbox.clone();
        let launched = self.hosted.on_host(move |host| host.start(&id, &from, shape, &mounts)).await??;
        // The VMM runs once its API took the start; its host says so.
        tokio::task::spawn_blocking(launched.finished).await.map_err(|e| EngineError::Runtime(e.to_string()))??;
        let listener = UnixListener::from_std(launched.listener).map_err(EngineError::io("socket"))?;
        let patience = self.boot_patience;
        let accepted = match tokio::time::timeout(patience, listener.accept()).await {
            Ok(accepted) => accepted.map_err(EngineError::io("accepting the agent")),
            Err(_) => {
                let id = sandbox.clone();
                let log = self.hosted.on_host(move |host| host.engine_log(&id)).await?;
                Err(EngineError::Runtime(format!("the agent did not dial home within {patience:?}: {log}")))
            }
        };
        // Nobody else may connect: the socket goes away once the agent is in.
        let id = sandbox.clone();
        self.hosted.on_host(move |host| host.close_agent(&id)).await?;
        let (socket, _) = accepted?;
        Ok((socket, started.elapsed()))
    }

    /// Whether `spec` has its template's default shape: a clone of the
    /// template's saved microVM (with exactly its vCPUs, memory and disk).
    /// A sandbox that mounts volumes boots: a snapshot's devices are fixed,
    /// and the template's has no volume drives.
    fn is_clone(spec: &SandboxSpec) -> bool {
        spec.volumes.is_empty()
            && template_defaults(spec)
                .is_some_and(|d| (spec.vcpus, spec.memory_mib, spec.disk_mib) == (d.vcpus, d.memory_mib, d.disk_mib))
    }

    /// Makes the template's clone base for `shape` unless there is one:
    /// the template's microVM is booted as a sandbox of its own, its agent
    /// quiesced (it will redial from every clone), and the host saves it.
    /// The maker is gone afterwards, whatever happened.
    async fn clone_base(&self, spec: &SandboxSpec, template: &TemplateRef, shape: Shape) -> Result<(), EngineError> {
        let has = |template: TemplateRef| move |host: &dyn EngineHost| host.has_clone_base(&template, shape);
        if self.hosted.on_host(has(template.clone())).await?? {
            return Ok(());
        }
        let shape_key = (shape.vcpus.get(), shape.memory_mib.get(), shape.disk_mib.get());
        let key = (template.name.to_string(), template.version.get(), shape_key);
        let lock = self.clone_bases.lock().unwrap_or_else(|e| e.into_inner()).entry(key).or_default().clone();
        let _making = lock.lock().await;
        if self.hosted.on_host(has(template.clone())).await?? {
            return Ok(());
        }
        let maker = SandboxId::parse(&format!("sbx_{:020x}", random_u128() >> 48))
            .map_err(|e| EngineError::Runtime(e.to_string()))?;
        let spec = SandboxSpec {
            id: maker.to_string(),
            dir: self.hosted.placed.layout().sandbox_dir(&maker),
            hostname: "template".into(),
            env: Default::default(),
            ..spec.clone()
        };
        let made = async {
            let from = StartFrom::Template { template: template.clone() };
            let (socket, _) = self.launch(&maker, from, shape, Vec::new()).await?;
            let agent = AgentConn::handshake(socket, crate::welcome_for(&spec), self.boot_patience).await?;
            agent.quiesce(QUIESCE_PATIENCE).await?;
            let (id, template) = (maker.clone(), template.clone());
            self.hosted.on_host(move |host| host.save_clone_base(&id, &template)).await?
        }
        .await;
        let id = maker.clone();
        if let Err(err) = self.hosted.on_host(move |host| host.destroy(&id)).await? {
            tracing::warn!(sandbox = %maker, "removing a template's microVM: {err}");
        }
        made
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        if self.hosted.placed.chain(&spec.template_rootfs).is_some() {
            return Err(super::local::no_build_sandboxes());
        }
        let (sandbox, template, shape) =
            (self.hosted.placed.sandbox(spec)?, self.hosted.placed.template(spec)?, Placed::shape(spec)?);
        if !Self::is_clone(spec) {
            let mounts = Placed::mounts(spec)?;
            let from = StartFrom::Template { template };
            let (socket, boot) = self.launch(&sandbox, from, shape, mounts).await?;
            let mut welcome = crate::welcome_for(spec);
            welcome.volumes = guest_volumes(spec);
            let agent = AgentConn::handshake(socket, welcome, self.boot_patience).await?;
            if !spec.volumes.is_empty() {
                // The agent mounts them before it serves anything; one
                // that could not ends (and the microVM with it).
                agent.ping(self.boot_patience).await.map_err(|e| {
                    EngineError::Runtime(format!("the guest did not mount its volumes (see its console): {e}"))
                })?;
            }
            return Ok(Started { agent, boot, steps: Vec::new() });
        }
        self.clone_base(spec, &template, shape).await?;
        let (socket, boot) = self.launch(&sandbox, StartFrom::Clone { template }, shape, Vec::new()).await?;
        // The welcome makes the clone this sandbox (id, hostname, env); the
        // entropy reseeds the random state every clone woke up with.
        let agent = AgentConn::handshake(socket, crate::welcome_for(spec), self.boot_patience).await?;
        agent.set_identity(&crate::fresh_identity(&spec.env, spec.trust_pem.as_deref())?, self.boot_patience).await?;
        Ok(Started { agent, boot, steps: Vec::new() })
    }

    /// The sandbox's own snapshot.
    fn snapshot_dir(spec: &SandboxSpec) -> PathBuf {
        spec.dir.join("snapshot")
    }
}

/// A random number for a template microVM's sandbox id.
fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes).expect("the kernel's random numbers");
    u128::from_le_bytes(bytes)
}

/// The template's default sandbox shape, from the version's metadata.
fn template_defaults(spec: &SandboxSpec) -> Option<space_host::template::TemplateDefaults> {
    let version = spec.template_rootfs.parent()?;
    space_host::template::TemplateInfo::load(version).ok().map(|t| t.meta.defaults)
}

#[async_trait::async_trait]
impl Engine for Firecracker {
    fn name(&self) -> &'static str {
        "firecracker"
    }

    fn availability(&self) -> Availability {
        // Whoever runs the VMMs (this process or the root helper) knows.
        let (available, detail) = self.hosted.host.availability();
        Availability { name: "firecracker", available, detail }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        let started = self.start(spec).await;
        if started.is_err() {
            if let Err(cleanup) = self.destroy(spec).await {
                tracing::warn!(sandbox = %spec.id, "cleaning up after a failed create: {cleanup}");
            }
        }
        started
    }

    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.pause(id)).await
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.resume(id)).await
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.suspend(id)).await
    }

    /// A suspended sandbox's snapshot names its volume drives: they are
    /// attached again as they were (the guest's mounts come back with its
    /// memory).
    async fn restore(&self, spec: &SandboxSpec) -> Result<tokio::net::UnixStream, EngineError> {
        if !self.has_snapshot(spec) {
            return Err(EngineError::Runtime("the sandbox has no complete snapshot".into()));
        }
        let (sandbox, shape, mounts) = (self.hosted.placed.sandbox(spec)?, Placed::shape(spec)?, Placed::mounts(spec)?);
        let (socket, _) = self.launch(&sandbox, StartFrom::Suspended {}, shape, mounts).await?;
        Ok(socket)
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        let snapshot = Self::snapshot_dir(spec);
        snapshot.join(STATE).is_file() && snapshot.join(MEMORY).is_file()
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
        no_volumes(spec)?;
        self.hosted.save_image(spec, image).await
    }

    async fn drop_image(&self, spec: &SandboxSpec, image: &Path) -> Result<(), EngineError> {
        self.hosted.drop_image(spec, image).await
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.stop(spec)
    }

    /// Not of a microVM that mounts volumes: see [`no_volumes`].
    fn saves_images(&self, spec: &SandboxSpec) -> bool {
        spec.volumes.is_empty()
    }

    /// A new microVM loads the image's snapshot (its memory mapped
    /// privately, as clones of a template's are) on its own reflink copy
    /// of the image's root drive.
    async fn start_from_image(&self, spec: &SandboxSpec, image: &Path) -> Result<tokio::net::UnixStream, EngineError> {
        no_volumes(spec)?;
        let from = self.hosted.placed.start_from_image(image)?;
        if !(image.join(STATE).is_file() && image.join(MEMORY).is_file()) {
            return Err(EngineError::Runtime("the image is not whole".into()));
        }
        let (sandbox, shape) = (self.hosted.placed.sandbox(spec)?, Placed::shape(spec)?);
        let (socket, _) = self.launch(&sandbox, from, shape, Vec::new()).await?;
        Ok(socket)
    }

    fn resource_use(&self, spec: &SandboxSpec) -> Option<crate::ResourceUse> {
        // Only a jailed microVM has a cgroup of its own (none is read else).
        crate::cgroup_use(&Path::new(super::PARENT_CGROUP).join(jail_id(&spec.id)))
    }

    /// Stops the sandbox's VMM and removes its directory.
    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.hosted.ask(spec, |host, id| host.destroy(id)).await
    }
}

/// A checkpoint of a microVM holds its guest's page cache of each volume:
/// loaded later (or into a fork) over the volume as it is by then, that
/// cache would tear the file system. A microVM that mounts volumes is not
/// checkpointed (decision 031).
fn no_volumes(spec: &SandboxSpec) -> Result<(), EngineError> {
    match spec.volumes.is_empty() {
        true => Ok(()),
        false => Err(super::local::no_volume_checkpoints()),
    }
}

/// The volume drives as the guest finds them: after the root drive
/// (`vda`), one per mount in the sandbox's order, as the host attaches
/// them.
pub fn guest_volumes(spec: &SandboxSpec) -> Vec<space_proto::GuestVolume> {
    spec.volumes
        .iter()
        .enumerate()
        .map(|(index, mount)| space_proto::GuestVolume {
            device: super::local::volume_device(index),
            path: mount.path.clone(),
            read_only: mount.read_only,
        })
        .collect()
}
