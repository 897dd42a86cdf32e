//! Disk a tenant causes on the host, its bounds, and the host's reserve.
//!
//! What a tenant holds on the data dir's filesystem, and what bounds it:
//! - each sandbox's root: its btrfs quota (`disk_mib`), reserved in full
//!   while the sandbox can still write (a failed one counts what it holds);
//! - each sandbox's command transcripts: per command
//!   (`--max-output-mib`) and per sandbox (`--max-sandbox-output-mib`);
//! - each suspended sandbox's snapshot: its memory image, at most the
//!   sandbox's memory limit (the engine's cgroup holds it there);
//! - its templates' roots: each build's root subvolume is capped at what
//!   the tenant's quota has left (and what the host has above its reserve);
//! - image archives being uploaded (`run/uploads/<tenant>.<id>.tar`).
//!
//! All of it counts against the tenant's `max_disk_mib` (429
//! `quota_exceeded`, resource `disk`). Apart from tenants, the host keeps a
//! reserve of free space (`--disk-reserve-mib`): under it, creates,
//! suspends, builds and uploads are refused (507 `insufficient_storage`)
//! and output is counted instead of kept, so the database and the running
//! sandboxes never meet a full disk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use space_api::{DiskUsage, ErrorCode, SandboxState};

use crate::error::NodeError;
use crate::platform::Platform;
pub use crate::state::disk::{
    tree_bytes, ToldQuota, DEFAULT_DISK_RESERVE_MIB, DEFAULT_MAX_SANDBOX_OUTPUT_BYTES, SNAPSHOT_OVERHEAD_BYTES,
};
use crate::store::SandboxRecord;
pub use crate::tenants::{quota_exceeded, quota_limits};

/// What a tenant's disk quota leaves it.
pub(crate) struct QuotaLeft {
    /// Bytes it may still add.
    pub left: u64,
    /// What it holds here.
    pub usage: DiskUsage,
    /// Its quota, in bytes.
    pub max: u64,
    /// What it holds on a cluster's other nodes (0 on a single host).
    pub elsewhere: u64,
}

const MIB: u64 = 1 << 20;

/// The uploads directory and the name prefix of `tenant`'s uploads in it.
pub fn upload_prefix(tenant: &str) -> String {
    format!("{tenant}.")
}

impl Platform {
    /// Free bytes of the data dir's filesystem above the reserve (0 under it).
    pub fn free_above_reserve(&self) -> u64 {
        let (free, _) = self.data.disk_space();
        free.saturating_sub(self.disk_reserve_bytes.load(Ordering::Relaxed))
    }

    /// 507 when the data dir's free space is under the reserve (or would be
    /// after `adding` more bytes): `what` is refused before anything runs out.
    pub fn check_reserve(&self, what: &str, adding: u64) -> Result<(), NodeError> {
        let (free, _) = self.data.disk_space();
        let reserve = self.disk_reserve_bytes.load(Ordering::Relaxed);
        if free >= reserve.saturating_add(adding) {
            return Ok(());
        }
        Err(NodeError::new(
            ErrorCode::InsufficientStorage,
            format!(
                "the host is low on disk ({} MiB free, {} MiB kept in reserve): cannot {what} now; \
                 delete sandboxes or templates, or try later",
                free / MIB,
                reserve / MIB
            ),
        )
        .with_details(serde_json::json!({"resource": "host_disk", "free_bytes": free, "reserve_bytes": reserve})))
    }

    /// The transcript bytes a sandbox holds, shared by its writers.
    pub(crate) fn output_use(&self, sandbox_id: &str) -> Arc<AtomicU64> {
        let mut map = self.output_use.by_sandbox.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(sandbox_id.to_string())
            .or_insert_with(|| Arc::new(tree_bytes(&self.data.sandbox_state_dir(sandbox_id).join("commands")).into()))
            .clone()
    }

    /// Forgets a deleted sandbox: what the server kept of it (transcripts,
    /// checkpoints' records) and their count.
    pub(crate) async fn forget_sandbox_state(&self, sandbox_id: &str) {
        let dir = self.data.sandbox_state_dir(sandbox_id);
        if let Err(err) = tokio::fs::remove_dir_all(&dir).await {
            if err.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox = sandbox_id, "removing {}: {err}", dir.display());
            }
        }
        self.output_use.by_sandbox.lock().unwrap_or_else(|e| e.into_inner()).remove(sandbox_id);
    }

    /// What `tenant` holds on the host's disk now.
    pub fn disk_usage(&self, tenant: &str) -> Result<DiskUsage, NodeError> {
        let records: Vec<SandboxRecord> =
            self.store.node().live_sandboxes()?.into_iter().filter(|r| r.tenant == tenant).collect();
        let mut usage = DiskUsage::default();
        for record in &records {
            let dir = self.data.sandbox_dir(&record.sandbox.id);
            let used = space_host::btrfs::exclusive_bytes(&dir.join("rootfs")).unwrap_or(0);
            usage.roots_used_bytes += used;
            usage.roots_reserved_bytes += match record.sandbox.state {
                // It can no longer write: what it holds is what counts.
                SandboxState::Failed | SandboxState::Deleting => used,
                _ => (u64::from(record.sandbox.disk_mib) * MIB).max(used),
            };
            usage.transcripts_bytes += self.output_use(&record.sandbox.id).load(Ordering::Relaxed);
            usage.snapshots_bytes += tree_bytes(&dir.join("snapshot"));
            // Checkpoints, and the image a fork is being made from.
            for kind in ["checkpoints", "images"] {
                for image in std::fs::read_dir(dir.join(kind)).into_iter().flatten().flatten() {
                    usage.snapshots_bytes += crate::checkpoints::image_bytes(&image.path());
                }
            }
        }
        for name_dir in std::fs::read_dir(self.data.templates_dir()).into_iter().flatten().flatten() {
            let name = name_dir.file_name().to_string_lossy().into_owned();
            if self.template_owner(&name).flatten().as_deref() != Some(tenant) {
                continue;
            }
            // Every version, and a build in progress (`.N.partial`).
            for version in std::fs::read_dir(name_dir.path()).into_iter().flatten().flatten() {
                let dir = version.path();
                // Its root, and its ext4 drive and saved memory if it has them.
                usage.templates_bytes += crate::checkpoints::image_bytes(&dir);
            }
        }
        let prefix = upload_prefix(tenant);
        for entry in std::fs::read_dir(self.uploads_dir()).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                usage.uploads_bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        (usage.volumes_reserved_bytes, usage.volume_snapshots_bytes) = self.volumes_disk(tenant)?;
        usage.total_bytes = usage.roots_reserved_bytes
            + usage.volumes_reserved_bytes
            + usage.volume_snapshots_bytes
            + usage.transcripts_bytes
            + usage.snapshots_bytes
            + usage.templates_bytes
            + usage.uploads_bytes;
        Ok(usage)
    }

    /// What `tenant`'s volumes hold against its disk quota: each volume's
    /// size, and what only its snapshots hold.
    fn volumes_disk(&self, tenant: &str) -> Result<(u64, u64), NodeError> {
        let mut reserved = 0;
        let mut snapshots = 0;
        let root = self.data.root().join("volumes");
        for record in self.store.node().tenant_volumes(tenant)? {
            let dir = root.join(&record.id);
            let used = space_host::btrfs::exclusive_bytes(&dir.join("data")).unwrap_or(0);
            reserved += (u64::from(record.size_mib) << 20).max(used);
            for snapshot in self.store.node().volume_snapshots(&record.id)? {
                snapshots +=
                    space_host::btrfs::exclusive_bytes(&dir.join("snapshots").join(&snapshot.name)).unwrap_or(0);
            }
        }
        Ok((reserved, snapshots))
    }

    /// Bytes `tenant` may still add under its disk quota (`None`: no quota).
    pub(crate) fn disk_quota_left(&self, tenant: &str) -> Result<Option<QuotaLeft>, NodeError> {
        let told = self.told_disk_quotas.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied();
        let (max_mib, elsewhere) = match told {
            Some(told) => (told.map(|t| t.max_mib), told.map(|t| t.elsewhere_bytes).unwrap_or(0)),
            None => (self.store.tenancy().tenant_quotas(tenant)?.max_disk_mib, 0),
        };
        let Some(max_mib) = max_mib else {
            return Ok(None);
        };
        let usage = self.disk_usage(tenant)?;
        let max = max_mib.saturating_mul(MIB);
        let left = max.saturating_sub(usage.total_bytes).saturating_sub(elsewhere);
        Ok(Some(QuotaLeft { left, usage, max, elsewhere }))
    }

    /// 429 `quota_exceeded` (resource `disk`) when `tenant` cannot add
    /// `adding` bytes to what it holds; `what` says what was refused.
    pub(crate) fn check_disk_quota(&self, tenant: &str, adding: u64, what: &str) -> Result<(), NodeError> {
        let Some(QuotaLeft { left, usage, max, elsewhere }) = self.disk_quota_left(tenant)? else {
            return Ok(());
        };
        if adding <= left && (adding > 0 || left > 0) {
            return Ok(());
        }
        let other_nodes = match elsewhere {
            0 => String::new(),
            bytes => format!(", and {} MiB on the cluster's other nodes", bytes.div_ceil(MIB)),
        };
        Err(quota_exceeded(
            tenant,
            "disk",
            format!(
                "tenant {tenant:?} may use at most {} MiB of disk and holds {} MiB (roots {} MiB reserved, \
                 output {} MiB, snapshots {} MiB, templates {} MiB, uploads {} MiB{other_nodes}): cannot {what}; \
                 delete sandboxes or templates first",
                max / MIB,
                (usage.total_bytes + elsewhere).div_ceil(MIB),
                usage.roots_reserved_bytes / MIB,
                usage.transcripts_bytes.div_ceil(MIB),
                usage.snapshots_bytes.div_ceil(MIB),
                usage.templates_bytes.div_ceil(MIB),
                usage.uploads_bytes.div_ceil(MIB),
            ),
        ))
    }

    /// The most a new template root (or upload) of `tenant` may hold: what
    /// its quota has left and what the host has above its reserve, less
    /// what builds of the tenant still running were granted.
    pub fn build_allowance(&self, tenant: &str) -> Result<u64, NodeError> {
        let granted = self.build_grants.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied().unwrap_or(0);
        Ok(self.room(tenant)?.saturating_sub(granted))
    }

    /// What `tenant`'s quota has left, within the host's free space above
    /// its reserve.
    fn room(&self, tenant: &str) -> Result<u64, NodeError> {
        let host = self.free_above_reserve();
        Ok(match self.disk_quota_left(tenant)? {
            Some(quota) => quota.left.min(host),
            None => host,
        })
    }

    /// [`Platform::build_allowance`], held for the tenant until the grant
    /// is dropped (the build ended), so concurrent builds share it.
    pub fn grant_build_allowance(&self, tenant: &str) -> Result<BuildGrant<'_>, NodeError> {
        let mut grants = self.build_grants.lock().unwrap_or_else(|e| e.into_inner());
        // Measured with the lock held: two builds never count the same room.
        let bytes = self.room(tenant)?.saturating_sub(grants.get(tenant).copied().unwrap_or(0));
        *grants.entry(tenant.to_string()).or_default() += bytes;
        Ok(BuildGrant { platform: self, tenant: tenant.to_string(), bytes })
    }

    pub fn uploads_dir(&self) -> std::path::PathBuf {
        self.data.run_dir().join("uploads")
    }
}

/// Disk granted to one running build of a tenant; given back when dropped.
pub struct BuildGrant<'a> {
    platform: &'a Platform,
    tenant: String,
    pub bytes: u64,
}

impl Drop for BuildGrant<'_> {
    fn drop(&mut self) {
        let mut grants = self.platform.build_grants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(granted) = grants.get_mut(&self.tenant) {
            *granted = granted.saturating_sub(self.bytes);
            if *granted == 0 {
                grants.remove(&self.tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_bytes_counts_files_and_never_follows_links() {
        let dir = std::env::temp_dir().join(format!("space-tree-bytes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("a/one"), vec![0u8; 1000]).unwrap();
        std::fs::write(dir.join("a/b/two"), vec![0u8; 24]).unwrap();
        let outside = dir.with_extension("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("big"), vec![0u8; 100_000]).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("a/link")).unwrap();
        std::os::unix::fs::symlink(outside.join("big"), dir.join("file-link")).unwrap();
        nix::unistd::mkfifo(&dir.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(tree_bytes(&dir), 1024);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&outside).unwrap();
    }
}
