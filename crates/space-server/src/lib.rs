//! The SPACE server: the control plane (HTTP API, operations, state) and,
//! on a single host, the local node (engines, transcripts).
//!
//! `app` builds the router, separate from `serve`, so tests drive the real
//! API over a real socket against real sandboxes.

mod actor;
pub mod api;
mod capacity;
pub mod commands;
pub mod domain;
pub mod error;
pub mod http;
pub mod ids;
pub mod platform;
mod policies;
mod recovery;
pub mod store;
mod templates;
pub mod tenants;
pub mod transcript;
mod warm;

use std::path::PathBuf;
use std::sync::Arc;

pub use api::{app, AppState};
use space_engine::gvisor::{Gvisor, GvisorConfig};
use space_host::datadir::DataDir;

pub use crate::platform::Platform;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
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
    /// Warm sandboxes kept per template (0: every create is a cold start).
    pub warm_pool: u32,
    /// Memory the host may promise to sandboxes, in MiB (default: the
    /// host's memory less 1 GiB).
    pub capacity_mib: Option<u64>,
    /// Whether template builds also make ext4 root drives (Firecracker's);
    /// `None`: when the host has hardware virtualization.
    pub ext4_images: Option<bool>,
}

/// Opens the data dir and state, reconciles what a previous run left, and
/// wires the engine. The process becomes a child subreaper here, so
/// sandbox processes that outlive `runsc` are reaped promptly.
pub fn start_platform(config: &PlatformConfig) -> Result<Arc<Platform>, ServerError> {
    space_process::become_subreaper()
        .map_err(|source| ServerError::Io { what: "becoming a subreaper".into(), source })?;
    let mut data = DataDir::open(&config.data_dir)?;
    // Sandboxes' disk_mib is a btrfs quota on their root.
    let quotas_before = space_host::btrfs::quota_mode(data.root())?;
    let quotas = space_host::btrfs::enable_quotas(data.root())?;
    if let Some(build) = config.ext4_images {
        data.set_ext4_images(build);
    }
    let store = store::Store::open(&data.db_path())?;
    if quotas != quotas_before {
        // Limits do not survive a change of quota mode: set them again.
        for record in store.sandboxes()? {
            let rootfs = data.sandbox_dir(&record.sandbox.id).join("rootfs");
            if rootfs.exists() {
                let _ = space_host::btrfs::limit_exclusive(&rootfs, record.sandbox.disk_mib);
            }
        }
    }
    let engine = Arc::new(Gvisor::new(GvisorConfig {
        runsc: config.runsc.clone(),
        agent_bin: config.agent_bin.clone(),
        state_dir: data.run_dir().join("runsc"),
    }));
    let capacity = config.capacity_mib.unwrap_or_else(capacity::default_capacity_mib);
    let platform = Platform::new(data, store, engine, config.warm_pool, capacity, config.agent_bin.clone());
    platform.reconcile().map_err(|e| ServerError::Startup(e.message))?;
    Ok(platform)
}

/// Serves the API on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    http::serve_with(listener, state, None, shutdown).await
}
