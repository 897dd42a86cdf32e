//! The node runtime: sandboxes on this host's engines, their operations and
//! actors, commands and transcripts, code contexts, templates, warm and hot
//! pools, idle policies, capacity, disk and egress — and its state.
//!
//! It speaks no transport: its errors are [`NodeError`]s with a stable code,
//! and the HTTP edge (`space-server`) and the E2B adapter map them to their
//! own answers. It never names axum or an HTTP status.

pub mod access;
pub mod actor;
pub mod adoption;
pub mod capacity;
pub mod checkpoints;
pub mod commands;
pub mod contexts;
pub mod disk;
pub mod dockerfile_builds;
pub mod egress;
pub mod error;
mod failures;
pub mod follow;
pub mod idle;
mod images;
mod job;
pub mod lifecycle;
pub mod metrics;
pub mod platform;
pub mod policies;
pub mod recovery;
pub mod sampling;
mod scrape;
pub mod secrets;
pub mod session;
mod state;
pub use space_core::{domain, ids, keyring, tenants};
pub use space_store as store;
pub mod templates;
pub mod transcript;
pub mod volumes;
pub mod warm;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use space_engine::firecracker::{Firecracker, FirecrackerConfig};
use space_engine::gvisor::{Gvisor, GvisorConfig};
use space_engine::templates::{LocalTemplates, TemplateHost};
use space_engine::volumes::VolumeHost;
use space_engine::Engine;
use space_host::datadir::DataDir;

pub use crate::error::NodeError;

/// The largest file a request moves whole (the `/v1` files routes, E2B's).
pub const MAX_FILE_BYTES: usize = 1 << 30;
pub use crate::idle::DEFAULT_AUTO_PAUSE_S;
pub use crate::platform::Platform;
pub use crate::session::Session;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Host(#[from] space_host::HostError),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("{0}")]
    Startup(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// How to run the platform on this host.
#[derive(Debug, Clone)]
pub struct PlatformConfig {
    pub data_dir: PathBuf,
    pub runsc: PathBuf,
    pub agent_bin: PathBuf,
    /// The `space` binary whose confined child parses image archives
    /// (decision 027); the platform never parses one itself.
    pub importer_bin: PathBuf,
    /// Warm (paused) sandboxes kept per template (0 and no hot ones: every
    /// create is a cold start).
    pub warm_pool: u32,
    /// Hot (running, handed out without a thaw) sandboxes kept per template.
    pub hot_pool: u32,
    /// Memory the host may promise to sandboxes, in MiB (default: the
    /// host's memory less 1 GiB).
    pub capacity_mib: Option<u64>,
    /// Whether template builds also make ext4 root drives (Firecracker's);
    /// `None`: when the host has hardware virtualization.
    pub ext4_images: Option<bool>,
    /// Which engine runs sandboxes.
    pub engine: EngineChoice,
    /// The firecracker binary (else `FIRECRACKER_BIN`, else `PATH`).
    pub firecracker_bin: Option<PathBuf>,
    /// Seconds a running sandbox may be idle before the server pauses it
    /// (resumed on its next request); 0 turns that off.
    pub auto_pause_s: u64,
    /// Output kept per command and per sandbox, in MiB.
    pub max_output_mib: u64,
    pub max_sandbox_output_mib: u64,
    /// Free space of the data dir the host keeps, in MiB.
    pub disk_reserve_mib: u64,
    /// The operator's egress settings (static names, internal exceptions).
    pub egress: egress::EgressSettings,
    /// A PostgreSQL URL to keep state in, instead of the data dir's SQLite
    /// file (`None`).
    pub database: Option<String>,
    /// How templates' images are pulled from registries.
    pub registry: space_image::RegistryConfig,
    /// Disk (MiB) the layer chains of pulled images may keep cached; the
    /// least recently used go past it.
    pub layer_cache_mib: u64,
    /// A shared store of volume images (decision 032): a directory every
    /// node mounts (NFS, CephFS), root's. Without one, volumes are
    /// subvolumes of the data dir.
    pub shared_volumes: Option<PathBuf>,
}

/// The layer cache's size by default: a few dozen typical base images.
pub const DEFAULT_LAYER_CACHE_MIB: u64 = 20 << 10;

/// `--engine`: Firecracker where it can run, gVisor otherwise (`auto`), or
/// one of them by name (an error when it cannot run here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EngineChoice {
    #[default]
    Auto,
    Gvisor,
    Firecracker,
}

/// An `--engine` that names none of the engines.
#[derive(Debug, thiserror::Error)]
#[error("unknown engine {0:?}: auto, gvisor or firecracker")]
pub struct UnknownEngine(String);

impl std::str::FromStr for EngineChoice {
    type Err = UnknownEngine;
    fn from_str(text: &str) -> Result<Self, UnknownEngine> {
        match text {
            "auto" => Ok(EngineChoice::Auto),
            "gvisor" => Ok(EngineChoice::Gvisor),
            "firecracker" => Ok(EngineChoice::Firecracker),
            other => Err(UnknownEngine(other.to_string())),
        }
    }
}

/// Both engines as configured for `data`, whether or not they can run here.
pub fn engines(config: &PlatformConfig, data: &DataDir) -> (Gvisor, Option<Firecracker>) {
    engines_on(config, data, None)
}

/// [`engines`], the gVisor engine's root work asked of the helper at
/// `helper_socket` when one is given (decision 024).
fn engines_on(config: &PlatformConfig, data: &DataDir, helper_socket: Option<&Path>) -> (Gvisor, Option<Firecracker>) {
    let gvisor_config = GvisorConfig {
        runsc: config.runsc.clone(),
        agent_bin: config.agent_bin.clone(),
        state_dir: data.run_dir().join("runsc"),
    };
    let gvisor = match helper_socket {
        Some(socket) => Gvisor::through_helper(gvisor_config, socket, 0),
        None => Gvisor::new(gvisor_config),
    };
    let binary = space_engine::firecracker::find_firecracker(config.firecracker_bin.as_deref());
    let firecracker = binary.map(|binary| match helper_socket {
        // The helper runs the VMMs (its own configuration says where the
        // binary, jailer and guest are; its availability is the engine's).
        Some(socket) => Firecracker::through_helper(data.root(), socket, 0, space_engine::firecracker::BOOT_PATIENCE),
        None => Firecracker::new(firecracker_config(data, binary)),
    });
    (gvisor, firecracker)
}

/// How the Firecracker engine runs `binary` on `data`: the guest `space
/// setup` made, and under the jailer when one is beside the binary (its
/// own uid, a chroot in the data dir, cgroups, a new PID namespace).
pub fn firecracker_config(data: &DataDir, binary: PathBuf) -> FirecrackerConfig {
    let (kernel, initramfs) = match space_host::guest::existing(data) {
        Some(guest) => (guest.kernel, guest.initramfs),
        None => {
            let dir = space_host::guest::guest_dir(data);
            (dir.join("vmlinux"), dir.join("initramfs.cpio"))
        }
    };
    let jailer = space_engine::firecracker::find_jailer(None, Some(&binary));
    FirecrackerConfig {
        firecracker: binary,
        kernel,
        initramfs,
        jailer,
        jail_base: data.run_dir().join("jail"),
        jail_uid: space_engine::firecracker::JAIL_UID,
        boot_patience: space_engine::firecracker::BOOT_PATIENCE,
        data_dir: data.root().to_path_buf(),
    }
}

/// Who does templates' root work: this process, or the root helper at
/// `helper_socket` when one is given (as for the gVisor engine).
fn template_host_on(config: &PlatformConfig, data: &DataDir, helper_socket: Option<&Path>) -> Arc<dyn TemplateHost> {
    match helper_socket {
        Some(socket) => Arc::new(space_engine::helper::HelperHost::new(socket, 0)),
        None => Arc::new(
            LocalTemplates::new(space_engine::privsep::layout::Layout::new(data.root()), config.agent_bin.clone())
                .with_importer(&config.importer_bin),
        ),
    }
}

/// Who does volumes' root work: this process, or the root helper at
/// `helper_socket` (the same one templates and the engine use).
fn volume_host_on(
    config: &PlatformConfig,
    data: &DataDir,
    helper_socket: Option<&Path>,
) -> Result<Arc<dyn VolumeHost>, space_engine::EngineError> {
    match helper_socket {
        Some(socket) => Ok(Arc::new(space_engine::helper::HelperHost::new(socket, 0))),
        None => {
            let volumes = space_engine::volumes::LocalVolumes::new(
                space_engine::privsep::layout::Layout::new(data.root()),
                &config.importer_bin,
            );
            match &config.shared_volumes {
                Some(dir) => Ok(Arc::new(volumes.with_shared(space_engine::volumes::SharedStore::open(dir)?))),
                None => Ok(Arc::new(volumes)),
            }
        }
    }
}

/// Each engine's availability on this host, and why.
pub fn engine_report(config: &PlatformConfig, data: &DataDir) -> Vec<space_engine::Availability> {
    let (gvisor, firecracker) = engines(config, data);
    report(config, data, &gvisor, firecracker.as_ref().map(|f| f as &dyn Engine))
}

/// [`engine_report`] for engines already built (each probed once).
fn report(
    config: &PlatformConfig,
    data: &DataDir,
    gvisor: &dyn Engine,
    firecracker: Option<&dyn Engine>,
) -> Vec<space_engine::Availability> {
    let firecracker = match firecracker {
        Some(engine) => engine.availability(),
        None => {
            let guest = space_host::guest::existing(data);
            space_engine::firecracker::availability(
                config.firecracker_bin.as_deref(),
                guest.as_ref().map(|g| (g.kernel.as_path(), g.initramfs.as_path())),
            )
        }
    };
    vec![gvisor.availability(), firecracker]
}

/// Opens the data dir and state, reconciles what a previous run left, and
/// wires the engine. The process becomes a child subreaper here, so
/// sandbox processes that outlive `runsc` are reaped promptly.
pub fn start_platform(config: &PlatformConfig) -> Result<Arc<Platform>, StartError> {
    start_platform_with_helper(config, None)
}

/// [`start_platform`], the gVisor engine asking the root helper at
/// `helper_socket` (`space helper`) for its root work when one is given.
pub fn start_platform_with_helper(
    config: &PlatformConfig,
    helper_socket: Option<&Path>,
) -> Result<Arc<Platform>, StartError> {
    space_process::become_subreaper()
        .map_err(|source| StartError::Io { what: "becoming a subreaper".into(), source })?;
    let mut data = DataDir::open(&config.data_dir)?;
    // Sandboxes' disk_mib is a btrfs quota on their root.
    let quotas_before = space_host::btrfs::quota_mode(data.root())?;
    // Beside a helper, turning them on is the helper's (root's) work.
    let quotas = match helper_socket {
        Some(_) => quotas_before,
        None => space_host::btrfs::enable_quotas(data.root())?,
    };
    if let Some(build) = config.ext4_images {
        data.set_ext4_images(build);
    }
    let store = open_store(config, &data)?;
    if quotas != quotas_before {
        // Limits do not survive a change of quota mode: set them again.
        for record in store.node().live_sandboxes()? {
            let rootfs = data.sandbox_dir(&record.sandbox.id).join("rootfs");
            if rootfs.exists() {
                let _ = space_host::btrfs::limit_exclusive(&rootfs, record.sandbox.disk_mib);
            }
        }
    }
    if let Some(socket) = helper_socket {
        // What the engine says of each sandbox comes from the helper: one
        // not answering yet would make every sandbox look gone to the
        // reconciliation below.
        wait_for_helper(socket, HELPER_PATIENCE)?;
    }
    let (gvisor, firecracker) = engines_on(config, &data, helper_socket);
    let gvisor: Arc<dyn Engine> = Arc::new(gvisor);
    let firecracker: Option<Arc<dyn Engine>> = firecracker.map(|f| Arc::new(f) as Arc<dyn Engine>);
    let report = report(config, &data, gvisor.as_ref(), firecracker.as_deref());
    let firecracker_ready = firecracker.as_ref().map(|_| report[1].clone());
    // The default engine, and the other one for templates that ask for it.
    let (default, other) = match (config.engine, &firecracker, firecracker_ready) {
        (EngineChoice::Gvisor, _, _) => (gvisor, firecracker),
        (_, Some(firecracker), Some(ready)) if ready.available => (firecracker.clone(), Some(gvisor)),
        (EngineChoice::Firecracker, _, ready) => {
            let why = ready.map(|r| r.detail).unwrap_or_else(|| {
                space_engine::firecracker::availability(config.firecracker_bin.as_deref(), None).detail
            });
            return Err(StartError::Startup(format!("the firecracker engine cannot run here: {why}")));
        }
        (EngineChoice::Auto, _, _) => (gvisor, firecracker),
    };
    let engine: Arc<dyn Engine> = Arc::new(space_engine::Engines::new(default, other.into_iter().collect()));
    let volumes = volume_host_on(config, &data, helper_socket).map_err(|e| StartError::Startup(e.to_string()))?;
    let hosts = (template_host_on(config, &data, helper_socket), volumes);
    assemble(config, data, store, engine, report, hosts)
}

/// [`start_platform`] with `engine` in place of this host's engines, on a
/// data dir on any filesystem, touching nothing else of the host (it does
/// not become a subreaper or turn on btrfs quotas): how tests run the
/// platform's logic on a fake engine as an unprivileged user.
pub fn start_platform_with(config: &PlatformConfig, engine: Arc<dyn Engine>) -> Result<Arc<Platform>, StartError> {
    let data = DataDir::open_on_any_filesystem(&config.data_dir)?;
    let store = open_store(config, &data)?;
    let report = vec![engine.availability()];
    let volumes = volume_host_on(config, &data, None).map_err(|e| StartError::Startup(e.to_string()))?;
    let hosts = (template_host_on(config, &data, None), volumes);
    assemble(config, data, store, engine, report, hosts)
}

/// The platform's state: PostgreSQL, or SQLite in the data dir.
fn open_store(config: &PlatformConfig, data: &DataDir) -> Result<store::Store, StartError> {
    let store = match &config.database {
        Some(url) => store::Store::connect(url)?,
        None => store::Store::open(&data.db_path())?,
    };
    store.claim_for_server()?;
    tracing::info!("state: {}", if config.database.is_some() { "PostgreSQL" } else { "SQLite in the data dir" });
    Ok(store)
}

/// Builds the platform over `engine` as `config` says and reconciles what a
/// previous run left.
fn assemble(
    config: &PlatformConfig,
    data: DataDir,
    store: store::Store,
    engine: Arc<dyn Engine>,
    report: Vec<space_engine::Availability>,
    (templates, volumes): (Arc<dyn TemplateHost>, Arc<dyn VolumeHost>),
) -> Result<Arc<Platform>, StartError> {
    let capacity = config.capacity_mib.unwrap_or_else(capacity::default_capacity_mib);
    tracing::info!("engine: {}", engine.name());
    let pools = warm::PoolSizes { warm: config.warm_pool, hot: config.hot_pool };
    let platform = Platform::new(data, store, engine, pools, capacity, config.agent_bin.clone());
    let _ = platform.engine_report.set(report);
    let _ = platform.template_host.set(templates);
    // A volume host that cannot say (a helper that serves no volumes) keeps
    // none in a shared store.
    let store = match (volumes.shared_store(), &config.shared_volumes) {
        (Ok(store), _) => store,
        (Err(err), Some(_)) => return Err(StartError::Startup(format!("asking the volume host: {err}"))),
        (Err(err), None) => {
            tracing::debug!("the volume host names no shared store: {err}");
            None
        }
    };
    match (&config.shared_volumes, &store) {
        (Some(dir), None) => {
            return Err(StartError::Startup(format!(
                "volumes are to be kept in {}, but the root helper keeps them on its own disk: start it with \
                 --shared-volumes too",
                dir.display()
            )))
        }
        (_, Some(store)) => tracing::info!(store, "volumes: images in a shared store"),
        (None, None) => {}
    }
    let _ = platform.volume_store.set(store);
    let _ = platform.volume_host.set(volumes);
    let _ = platform.registry.set(config.registry.clone());
    platform
        .layer_cache_bytes
        .store(config.layer_cache_mib.saturating_mul(1 << 20), std::sync::atomic::Ordering::Relaxed);
    use std::sync::atomic::Ordering::Relaxed;
    platform.auto_pause_s.store(config.auto_pause_s, Relaxed);
    platform.max_output_bytes.store(config.max_output_mib.saturating_mul(1 << 20), Relaxed);
    platform.max_sandbox_output_bytes.store(config.max_sandbox_output_mib.saturating_mul(1 << 20), Relaxed);
    platform.disk_reserve_bytes.store(config.disk_reserve_mib.saturating_mul(1 << 20), Relaxed);
    platform.configure_egress(&config.egress).map_err(|e| StartError::Startup(format!("egress: {e}")))?;
    raise_open_files_limit();
    // A killed server's engine commands still under way would change what
    // the reconciliation reads.
    let unsettled = platform.unsettled().map_err(|e| StartError::Startup(e.message))?;
    platform.engine.settle_orphans(&unsettled, ORPHAN_PATIENCE);
    platform.reconcile().map_err(|e| StartError::Startup(e.message))?;
    platform.sweep_pulled_blobs();
    Ok(platform)
}

/// How long a server started beside the root helper waits for it to answer.
const HELPER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// Waits until the root helper at `socket` accepts a connection (a helper
/// started at the same time may not listen yet).
fn wait_for_helper(socket: &Path, patience: std::time::Duration) -> Result<(), StartError> {
    let deadline = std::time::Instant::now() + patience;
    loop {
        match std::os::unix::net::UnixStream::connect(socket) {
            Ok(_) => return Ok(()),
            Err(err) if std::time::Instant::now() >= deadline => {
                return Err(StartError::Startup(format!(
                    "the root helper at {} does not answer ({err}); start `space helper` first",
                    socket.display()
                )))
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
}

/// How long a starting server waits for a killed one's engine commands.
const ORPHAN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// Lifts the soft limit on open files to the hard one: the server holds a
/// socket per live sandbox (and transcripts), hundreds at a time.
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("raising the open files limit from {soft} to {hard}: {err}");
            }
        }
        Ok(_) => {}
        Err(err) => tracing::warn!("reading the open files limit: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_waits_for_its_helper_and_says_so_when_none_answers() {
        let dir = std::env::temp_dir().join(format!("space-helper-wait-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("helper.sock");
        let refused = wait_for_helper(&socket, std::time::Duration::from_millis(200)).unwrap_err();
        assert!(refused.to_string().contains("does not answer"), "{refused}");
        // One that starts listening a little later is waited for.
        let later = socket.clone();
        let listening = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(150));
            std::os::unix::net::UnixListener::bind(later).unwrap()
        });
        wait_for_helper(&socket, std::time::Duration::from_secs(20)).unwrap();
        drop(listening.join());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
