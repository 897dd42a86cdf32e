//! [`LocalVolumes`]: a volume's root work in this process, as root
//! (decision 031). Every path comes from [`Layout`] and checked ids.
//!
//! A restore makes the snapshot's writable copy as `data.new`, then
//! renames `data` to `data.old`, `data.new` to `data`, and removes
//! `data.old`; [`settle`], which every request on a volume calls first,
//! finishes what a killed process left of that: between the renames the
//! new data goes in, before them the half-made copy goes.
//!
//! A sandbox's read-only mount binds a read-only view of `data`
//! ([`mount_view`]) that its start makes and takes away once the engine
//! has its own copy of the mount: gVisor's own check of a read-only bind
//! is not enough (the runsc this host runs truncates a file opened with
//! `O_TRUNC` before it answers `EROFS`), the kernel's is.

use std::fs;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use space_host::btrfs;
use space_privsep::layout::Layout;
use space_privsep::proto::{DiskMib, SnapshotName, VolumeId, MAX_LISTED, MAX_VOLUME_SNAPSHOTS};

use super::shared::SharedStore;
use super::{VolumeHost, VolumeOnDisk, VolumeUsage};
use crate::EngineError;

/// Over twice an image volume's size, what its subvolume may hold.
const IMAGE_SLACK_MIB: u32 = 64;

/// [`VolumeHost`] in this process (which must be root), its files served
/// by a confined child started from `files_bin` (the `space` binary).
pub struct LocalVolumes {
    layout: Layout,
    files_bin: PathBuf,
    /// Where volumes are kept when not on this node's own disk.
    shared: Option<SharedStore>,
    /// One change of volumes at a time: a restore's renames and a
    /// snapshot of the same `data` never interleave.
    changing: Mutex<()>,
}

impl LocalVolumes {
    pub fn new(layout: Layout, files_bin: impl Into<PathBuf>) -> LocalVolumes {
        LocalVolumes { layout, files_bin: files_bin.into(), shared: None, changing: Mutex::new(()) }
    }

    /// Keeps volumes as images in `store` (decision 032), taking the lock
    /// of each one still mounted here.
    pub fn with_shared(mut self, store: SharedStore) -> LocalVolumes {
        store.relock(&self.layout.volumes_dir());
        self.shared = Some(store);
        self
    }

    fn shared(&self) -> Result<&SharedStore, EngineError> {
        self.shared.as_ref().ok_or_else(|| EngineError::Runtime("this node keeps volumes on its own disk".into()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.changing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The volume's `data`, settled, when the volume is there.
    fn data_of(&self, volume: &VolumeId) -> Result<PathBuf, EngineError> {
        settle(&self.layout, volume)?;
        let data = self.layout.volume_data(volume);
        match is_dir(&data) {
            true => Ok(data),
            false => Err(not_here(volume)),
        }
    }

    /// The limit a volume was made with, for a restore's new `data`.
    fn limit_of(&self, volume: &VolumeId) -> Result<DiskMib, EngineError> {
        let path = self.layout.volume_limit(volume);
        let text = fs::read_to_string(&path).map_err(EngineError::io(format!("reading {}", path.display())))?;
        text.trim()
            .parse::<u32>()
            .ok()
            .and_then(|mib| DiskMib::new(mib).ok())
            .ok_or_else(|| EngineError::Runtime(format!("{} holds no size: {text:?}", path.display())))
    }

    /// The volume's snapshots by name, in order (others in the directory
    /// are not the platform's and are left out).
    fn snapshots_of(&self, volume: &VolumeId) -> Vec<SnapshotName> {
        let Ok(entries) = fs::read_dir(self.layout.volume_snapshots(volume)) else { return Vec::new() };
        let mut names: Vec<SnapshotName> =
            entries.flatten().filter_map(|entry| SnapshotName::parse(entry.file_name().to_str()?).ok()).collect();
        names.sort();
        names.truncate(MAX_VOLUME_SNAPSHOTS);
        names
    }

    /// A new volume (see [`VolumeHost::create_volume`]), an image one
    /// when `image`.
    fn make(
        &self,
        volume: &VolumeId,
        size: DiskMib,
        from: Option<(&VolumeId, &SnapshotName)>,
        image: bool,
    ) -> Result<(), EngineError> {
        let _changing = self.lock();
        let dir = self.layout.volume_dir(volume);
        if fs::symlink_metadata(&dir).is_ok() {
            return Err(EngineError::Runtime(format!("volume {volume} exists")));
        }
        let source = match from {
            Some((source, snapshot)) => {
                let path = self.layout.volume_snapshot(source, snapshot);
                if !is_dir(&path) {
                    return Err(EngineError::Runtime(format!("volume {source} has no snapshot {snapshot}")));
                }
                Some(path)
            }
            None => None,
        };
        if let Some(store) = &self.shared {
            if store.has_image(volume) {
                return Err(EngineError::Runtime(format!("volume {volume} exists in the shared store")));
            }
            store.make(volume, size, &dir)?;
        }
        let made = (|| {
            fs::create_dir_all(self.layout.volume_snapshots(volume))
                .map_err(EngineError::io("creating the volume dir"))?;
            fs::write(self.layout.volume_limit(volume), size.get().to_string())
                .map_err(EngineError::io("recording the volume's size"))?;
            let data = self.layout.volume_data(volume);
            match (&source, &self.shared) {
                (Some(snapshot), None) => btrfs::snapshot(snapshot, &data)?,
                // Another image is another filesystem: its files are copied.
                (Some(snapshot), Some(_)) => {
                    btrfs::create_subvolume(&data)?;
                    let mut copy = std::process::Command::new("cp");
                    copy.args(["-a", "--reflink=auto", "--"]).arg(snapshot.join(".")).arg(&data);
                    space_host::run(&mut copy)?;
                }
                (None, _) => btrfs::create_subvolume(&data)?,
            }
            if image {
                space_host::template::make_volume_image(&self.layout.volume_image(volume), size.get())?;
            }
            btrfs::limit_exclusive(&data, subvolume_limit(&data, size))?;
            Ok(())
        })();
        if made.is_err() {
            // Nothing of a volume that could not be made stays.
            match &self.shared {
                Some(store) => {
                    let _ = store.remove(volume, &dir);
                }
                None => {
                    let _ = btrfs::remove_tree(&dir);
                }
            }
        }
        made
    }
}

impl VolumeHost for LocalVolumes {
    fn create_volume(
        &self,
        volume: &VolumeId,
        size: DiskMib,
        from: Option<(&VolumeId, &SnapshotName)>,
    ) -> Result<(), EngineError> {
        self.make(volume, size, from, false)
    }

    fn create_image_volume(&self, volume: &VolumeId, size: DiskMib) -> Result<(), EngineError> {
        self.make(volume, size, None, true)
    }

    fn delete_volume(&self, volume: &VolumeId) -> Result<(), EngineError> {
        let _changing = self.lock();
        // A files child's mount of its image a killed process left.
        crate::firecracker::unmount_under(&self.layout.volume_dir(volume));
        match &self.shared {
            Some(store) => store.remove(volume, &self.layout.volume_dir(volume)),
            None => btrfs::remove_tree(&self.layout.volume_dir(volume)).map_err(EngineError::from),
        }
    }

    fn snapshot_volume(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError> {
        let _changing = self.lock();
        let data = self.data_of(volume)?;
        let path = self.layout.volume_snapshot(volume, snapshot);
        if fs::symlink_metadata(&path).is_ok() {
            return Err(EngineError::Runtime(format!("volume {volume} has a snapshot {snapshot}")));
        }
        fs::create_dir_all(self.layout.volume_snapshots(volume)).map_err(EngineError::io("creating snapshots"))?;
        // Made read-only as it is made: one atomic btrfs operation.
        btrfs::snapshot_read_only(&data, &path).map_err(EngineError::from)
    }

    fn delete_volume_snapshot(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError> {
        let _changing = self.lock();
        settle(&self.layout, volume)?;
        btrfs::delete_subvolume(&self.layout.volume_snapshot(volume, snapshot)).map_err(EngineError::from)
    }

    fn restore_volume(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError> {
        let _changing = self.lock();
        let data = self.data_of(volume)?;
        let source = self.layout.volume_snapshot(volume, snapshot);
        if !is_dir(&source) {
            return Err(EngineError::Runtime(format!("volume {volume} has no snapshot {snapshot}")));
        }
        let limit = self.limit_of(volume)?;
        let (new, old) = (self.layout.volume_data_new(volume), self.layout.volume_data_old(volume));
        let made =
            btrfs::snapshot(&source, &new).and_then(|()| btrfs::limit_exclusive(&new, subvolume_limit(&new, limit)));
        if let Err(err) = made {
            let _ = btrfs::delete_subvolume(&new);
            return Err(err.into());
        }
        // The swap: from the first rename on, `settle` finishes it.
        fs::rename(&data, &old).map_err(EngineError::io("moving the volume's data aside"))?;
        fs::rename(&new, &data).map_err(EngineError::io("putting the restored data in place"))?;
        btrfs::delete_subvolume(&old).map_err(EngineError::from)
    }

    fn volume_usage(&self, volume: &VolumeId) -> Result<VolumeUsage, EngineError> {
        let _changing = self.lock();
        let data = self.data_of(volume)?;
        // No quotas (a host that never turned them on): nothing is counted.
        let used_bytes = btrfs::referenced_bytes(&data).unwrap_or(0);
        let snapshots = self
            .snapshots_of(volume)
            .into_iter()
            .map(|name| {
                let bytes = btrfs::exclusive_bytes(&self.layout.volume_snapshot(volume, &name)).unwrap_or(0);
                (name, bytes)
            })
            .collect();
        Ok(VolumeUsage { used_bytes, snapshots })
    }

    fn list_volumes(&self) -> Result<Vec<VolumeOnDisk>, EngineError> {
        let _changing = self.lock();
        let entries = match fs::read_dir(self.layout.volumes_dir()) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(EngineError::io("listing the volumes")(err)),
        };
        let mut volumes: Vec<VolumeId> =
            entries.flatten().filter_map(|entry| VolumeId::parse(entry.file_name().to_str()?).ok()).collect();
        if let Some(store) = &self.shared {
            // Those mounted here; the directory a detach left goes.
            volumes.retain(|volume| {
                let dir = self.layout.volume_dir(volume);
                let attached = store.is_attached(volume, &dir);
                if !attached {
                    let _ = fs::remove_dir(&dir);
                }
                attached
            });
        }
        volumes.sort();
        volumes.truncate(MAX_LISTED);
        Ok(volumes
            .into_iter()
            .map(|volume| {
                if let Err(err) = settle(&self.layout, &volume) {
                    tracing::warn!(%volume, "finishing a restore: {err}");
                }
                VolumeOnDisk { snapshots: self.snapshots_of(&volume), volume }
            })
            .collect())
    }

    fn shared_store(&self) -> Result<Option<String>, EngineError> {
        Ok(self.shared.as_ref().map(|store| store.id().to_string()))
    }

    fn attach_volume(&self, volume: &VolumeId) -> Result<(), EngineError> {
        let _changing = self.lock();
        self.shared()?.attach(volume, &self.layout.volume_dir(volume))?;
        settle(&self.layout, volume)
    }

    fn detach_volume(&self, volume: &VolumeId) -> Result<(), EngineError> {
        let _changing = self.lock();
        self.shared()?.detach(volume, &self.layout.volume_dir(volume))
    }

    fn volume_files(&self, volume: &VolumeId, write: bool) -> Result<UnixStream, EngineError> {
        let data = {
            let _changing = self.lock();
            self.data_of(volume)?
        };
        let image = self.layout.volume_image(volume);
        if !fs::symlink_metadata(&image).is_ok_and(|meta| meta.is_file()) {
            return super::files_child::spawn(&self.files_bin, &data, Box::new(|| {}));
        }
        let mounted = ImageMount::new(&self.layout.volume_dir(volume), &image, write)?;
        let root = mounted.dir.clone();
        // Unmounted (and its copy removed) once the child has ended.
        super::files_child::spawn(&self.files_bin, &root, Box::new(move || drop(mounted)))
    }
}

/// The quota group limit of a volume's subvolume `data` of `size`: the
/// size itself; for an image volume (`data` holds its image, where ext4
/// has all of the size) a backstop, looser by what btrfs may keep of
/// extents a rewrite only partly replaced (more than the file's size at
/// worst).
fn subvolume_limit(data: &Path, size: DiskMib) -> u32 {
    match fs::symlink_metadata(data.join(space_privsep::layout::VOLUME_IMAGE)).is_ok_and(|m| m.is_file()) {
        true => size.get().saturating_mul(2).saturating_add(IMAGE_SLACK_MIB),
        false => size.get(),
    }
}

/// An image volume's file system mounted for its files child: through a
/// loop device, `nosuid,nodev,noexec`, at a fresh directory of the
/// volume's own (root's, mode 0700). Unmounted, with its directory and
/// any copy, when dropped.
struct ImageMount {
    dir: PathBuf,
    copy: Option<PathBuf>,
}

impl ImageMount {
    /// The image itself (`write`), or a reflink copy of it taken now with
    /// its journal replayed, read-only: a reader never sees a file system
    /// a sandbox's microVM is halfway through writing, and the host never
    /// mounts an image a guest has mounted.
    fn new(volume_dir: &Path, image: &Path, write: bool) -> Result<ImageMount, EngineError> {
        use std::os::unix::fs::DirBuilderExt;
        let mut tag = [0u8; 8];
        getrandom::getrandom(&mut tag).map_err(|e| EngineError::Runtime(format!("no random bytes: {e}")))?;
        let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        let dir = volume_dir.join(format!("files-{tag}"));
        fs::DirBuilder::new().mode(0o700).create(&dir).map_err(EngineError::io("a mount point for a volume"))?;
        let mut mounted = ImageMount { dir, copy: None };
        let source = match write {
            true => image.to_path_buf(),
            false => {
                let copy = volume_dir.join(format!("files-{tag}.ext4"));
                mounted.copy = Some(copy.clone());
                space_host::run(std::process::Command::new("cp").arg("--reflink=always").arg(image).arg(&copy))?;
                replay_journal(&copy)?;
                copy
            }
        };
        let options = if write { "loop,nosuid,nodev,noexec" } else { "loop,ro,nosuid,nodev,noexec" };
        let mut mount = std::process::Command::new("mount");
        mount.args(["-t", "ext4", "-o", options]).arg(&source).arg(&mounted.dir);
        space_host::run(&mut mount)?;
        Ok(mounted)
    }
}

impl Drop for ImageMount {
    fn drop(&mut self) {
        // The loop device goes with the mount (mount's autoclear).
        if let Err(err) = space_host::run(std::process::Command::new("umount").arg(&self.dir)) {
            tracing::warn!(dir = %self.dir.display(), "unmounting a volume's image: {err}");
            let _ = nix::mount::umount2(&self.dir, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = fs::remove_dir(&self.dir);
        if let Some(copy) = &self.copy {
            let _ = fs::remove_file(copy);
        }
    }
}

fn is_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|meta| meta.is_dir())
}

fn not_here(volume: &VolumeId) -> EngineError {
    EngineError::Runtime(format!("volume {volume} is not on this host"))
}

/// Replays the journal of the ext4 image `image` (a copy of a volume a
/// writer had mounted: its journal needs recovery, which a read-only drive
/// could not take), and nothing else.
pub(crate) fn replay_journal(image: &Path) -> Result<(), EngineError> {
    let mut fsck = std::process::Command::new("e2fsck");
    fsck.args(["-y", "-E", "journal_only"]).arg(image);
    // Through the reaper: the helper reaps its children there.
    let out = space_process::Reaper::global().output(&mut fsck).map_err(EngineError::io("running e2fsck"))?;
    // 0: clean; 1: the journal was replayed.
    match out.status {
        space_process::ExitStatus::Exited(0 | 1) => Ok(()),
        _ => Err(EngineError::Runtime(format!(
            "replaying the journal of a volume's copy: e2fsck {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim()
        ))),
    }
}

/// Finishes what a killed process left of a restore of `volume`: with the
/// old data moved aside, the new goes in (whether it was in yet or not),
/// then the old goes; a new copy made before the first rename goes (that
/// restore never happened). Anything else is left as it is.
pub(crate) fn settle(layout: &Layout, volume: &VolumeId) -> Result<(), EngineError> {
    let (data, new, old) = (layout.volume_data(volume), layout.volume_data_new(volume), layout.volume_data_old(volume));
    let there = |path: &Path| fs::symlink_metadata(path).is_ok();
    match (there(&data), there(&new), there(&old)) {
        (false, true, true) => {
            tracing::info!(%volume, "finishing a restore a killed process left between its renames");
            fs::rename(&new, &data).map_err(EngineError::io("putting the restored data in place"))?;
            btrfs::delete_subvolume(&old)?;
        }
        (true, new_there, true) => {
            btrfs::delete_subvolume(&old)?;
            if new_there {
                btrfs::delete_subvolume(&new)?;
            }
        }
        (true, true, false) => {
            tracing::info!(%volume, "removing a restore's copy a killed process left before its swap");
            btrfs::delete_subvolume(&new)?;
        }
        // Neither `data` nor a copy to swap in: the old data is put back.
        (false, false, true) => {
            fs::rename(&old, &data).map_err(EngineError::io("putting the volume's data back"))?;
        }
        _ => {}
    }
    Ok(())
}

/// Mounts at `view` a read-only bind of a volume's `data` (a directory
/// made for it; whatever was mounted there goes first).
pub(crate) fn mount_view(data: &Path, view: &Path) -> Result<(), EngineError> {
    use nix::mount::{mount, MntFlags, MsFlags};
    unmount_all(view)?;
    match fs::create_dir_all(view) {
        Ok(()) => {}
        Err(err) => return Err(EngineError::io("making a volume's read-only view")(err)),
    }
    let io = |what: &'static str| move |err: nix::Error| EngineError::io(what)(std::io::Error::from(err));
    mount(Some(data), view, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(io("binding a volume"))?;
    let read_only =
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    let made_read_only = mount(None::<&str>, view, None::<&str>, read_only, None::<&str>)
        .map_err(io("making a volume's view read-only"))
        .and_then(|()| match nix::sys::statvfs::statvfs(view) {
            Ok(stat) if stat.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY) => Ok(()),
            _ => Err(EngineError::Runtime(format!("{} did not come up read-only", view.display()))),
        });
    if made_read_only.is_err() {
        let _ = nix::mount::umount2(view, MntFlags::MNT_DETACH);
    }
    made_read_only
}

/// Takes away every view under `views` (each mount detached, then its
/// empty directory), and `views` itself. Never removes a file: what is
/// still there is left.
pub(crate) fn drop_views(views: &Path) {
    if let Ok(entries) = fs::read_dir(views) {
        for entry in entries.flatten() {
            let view = entry.path();
            if let Err(err) = unmount_all(&view) {
                tracing::warn!(view = %view.display(), "{err}");
            }
            let _ = fs::remove_dir(&view);
        }
    }
    let _ = fs::remove_dir(views);
}

/// Detaches every mount stacked at `path` (none there is no error).
fn unmount_all(path: &Path) -> Result<(), EngineError> {
    loop {
        match nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => continue,
            // Not a mount point (any more), or not there at all.
            Err(nix::Error::EINVAL | nix::Error::ENOENT) => return Ok(()),
            Err(err) => return Err(EngineError::io("unmounting a volume's view")(err.into())),
        }
    }
}
