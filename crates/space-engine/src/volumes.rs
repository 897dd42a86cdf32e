//! The seam between the platform's volumes (issue 37, decision 031) and the
//! root work they need, as [`TemplateHost`](crate::templates::TemplateHost)
//! is for templates.
//!
//! A volume is `volumes/<id>/data`, a btrfs subvolume under a quota group
//! limit, with read-only snapshots in `volumes/<id>/snapshots/<name>`; only
//! root may write there. [`VolumeHost`] is what the platform asks of it,
//! each method one request of `space_privsep::proto`, taking checked ids
//! and names, never a path. [`LocalVolumes`] does it in process (a server
//! that runs as root); [`HelperHost`](crate::helper::HelperHost) asks the
//! root helper, which serves it with a `LocalVolumes` of its own data dir.

mod files_child;
mod local;
mod shared;

use std::os::unix::net::UnixStream;

pub use files_child::{child_main as files_child_main, FilesChildArgs, SUBCOMMAND as FILES_SUBCOMMAND};
pub use local::LocalVolumes;
pub(crate) use local::{drop_views, mount_view, replay_journal, settle};
pub use shared::SharedStore;
pub use space_privsep::proto::{DiskMib, SnapshotName, VolumeId};

use crate::EngineError;

/// What a volume holds on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeUsage {
    /// What its files hold (the `data` subvolume's referenced bytes).
    pub used_bytes: u64,
    /// Each snapshot and what only it holds (its exclusive bytes).
    pub snapshots: Vec<(SnapshotName, u64)>,
}

/// A volume found on disk, with its snapshots (for the sweep at start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeOnDisk {
    pub volume: VolumeId,
    pub snapshots: Vec<SnapshotName>,
}

/// The root work of volumes. Every method blocks. Each request on a volume
/// first finishes a restore a killed process left half done.
pub trait VolumeHost: Send + Sync {
    /// `CreateVolume`: `volumes/<volume>/data`, empty or a writable
    /// snapshot of `from`'s snapshot, under a quota group limit of `size`.
    /// Refused if the volume is there already.
    fn create_volume(
        &self,
        volume: &VolumeId,
        size: DiskMib,
        from: Option<(&VolumeId, &SnapshotName)>,
    ) -> Result<(), EngineError>;

    /// `CreateVolume` with `image`: a Firecracker node's volume (decision
    /// 031), `volumes/<volume>/data` holding `disk.ext4`, an empty ext4
    /// image of exactly `size` (sparse) the microVMs mount as a drive.
    /// Inside, its size is the limit (a full image is `ENOSPC`, where a
    /// gVisor volume's quota says `EDQUOT`); the subvolume's quota group
    /// limit is only a backstop for what btrfs keeps of rewritten extents.
    fn create_image_volume(&self, volume: &VolumeId, size: DiskMib) -> Result<(), EngineError>;

    /// `DeleteVolume`: the volume with its snapshots (none there is not an
    /// error).
    fn delete_volume(&self, volume: &VolumeId) -> Result<(), EngineError>;

    /// `SnapshotVolume`: a read-only snapshot of the volume's `data`, made
    /// atomically (refused if one of that name is there).
    fn snapshot_volume(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError>;

    /// `DeleteVolumeSnapshot` (none there is not an error).
    fn delete_volume_snapshot(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError>;

    /// `RestoreVolume`: the volume's `data` becomes a writable snapshot of
    /// `snapshot`, under the same limit, swapped in by renames (a crash
    /// leaves the old data or the new, finished by the next request).
    fn restore_volume(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError>;

    /// `VolumeUsage`.
    fn volume_usage(&self, volume: &VolumeId) -> Result<VolumeUsage, EngineError>;

    /// `ListVolumes`: every volume on disk.
    fn list_volumes(&self) -> Result<Vec<VolumeOnDisk>, EngineError>;

    /// `VolumeStore`: the name of the shared store volumes are kept in
    /// (decision 032), or `None` when they are on this node's own disk.
    fn shared_store(&self) -> Result<Option<String>, EngineError>;

    /// `AttachVolume`: mounts a volume of the shared store here (mounted
    /// already is no error); refused while another node holds it.
    fn attach_volume(&self, volume: &VolumeId) -> Result<(), EngineError>;

    /// `DetachVolume`: unmounts a volume of the shared store from here,
    /// leaving its image for another node (not mounted is no error).
    fn detach_volume(&self, volume: &VolumeId) -> Result<(), EngineError>;

    /// `VolumeFiles`: one end of a socket whose other end a confined child
    /// serves the agent's file protocol on (its `Hello` first, then file
    /// and path requests only), with the volume's `data` as its root
    /// directory (decision 031): [`crate::AgentConn::handshake`] speaks to
    /// it. The child ends when the socket closes. An image volume's files
    /// are its image's, mounted through a loop device for the child: the
    /// image itself when `write`, else a copy of it taken now, its journal
    /// replayed, mounted read-only (a sandbox may be writing the image).
    fn volume_files(&self, volume: &VolumeId, write: bool) -> Result<UnixStream, EngineError>;
}
