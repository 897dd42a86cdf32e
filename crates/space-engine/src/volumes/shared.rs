//! Volumes on a filesystem every node mounts (NFS, CephFS): the shared
//! store of decision 032. Each volume is one btrfs image file in the
//! store, `<id>.img`, which the node that holds the volume loop-mounts at
//! `volumes/<id>`; inside it the volume is laid out as on a node's own
//! disk (`data` under a quota group limit, `snapshots/`, `limit-mib`), so
//! everything else about volumes works unchanged, snapshots included, and
//! a volume changes node by being unmounted on one and mounted on the
//! other, without a copy.
//!
//! A filesystem must never be mounted on two hosts at once. The control
//! plane's record of a volume's node is the first fence; the second is a
//! lock held by the process that mounted it, on `<id>.lock` in the store
//! (`flock`, which NFS and CephFS carry across hosts): a node attaches
//! only an image whose lock it took, and lets go of the lock only once
//! the image is unmounted.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use space_privsep::proto::{DiskMib, VolumeId};

use crate::EngineError;

/// The file naming the store, made by the first node that opens it.
const STORE_ID: &str = "store-id";
/// The smallest image (btrfs needs room for its metadata whatever the
/// volume's size); images are sparse, so the room costs nothing unused.
const MIN_IMAGE_MIB: u64 = 256;

/// A shared store of volume images, opened by the process that does
/// volumes' root work.
pub struct SharedStore {
    dir: PathBuf,
    id: String,
    /// The lock of every volume this process holds, kept open while it is
    /// mounted here.
    held: Mutex<HashMap<VolumeId, File>>,
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStore").field("dir", &self.dir).field("id", &self.id).finish()
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> EngineError {
    EngineError::io(what)
}

impl SharedStore {
    /// Opens the store at `dir`: an absolute directory owned by root that
    /// no one else may write to (its images are filesystems root mounts).
    pub fn open(dir: &Path) -> Result<SharedStore, EngineError> {
        if !dir.is_absolute() {
            return Err(EngineError::Runtime(format!("the shared volume store {} is not absolute", dir.display())));
        }
        // As the kernel names a loop device's file.
        let dir = &fs::canonicalize(dir).map_err(io(format!("opening the shared volume store {}", dir.display())))?;
        let meta = fs::metadata(dir).map_err(io(format!("opening the shared volume store {}", dir.display())))?;
        if !meta.is_dir() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
            return Err(EngineError::Runtime(format!(
                "the shared volume store {} must be a directory owned by root that only root may write to",
                dir.display()
            )));
        }
        let made = space_host::datadir::create_once(&dir.join(STORE_ID), 0o644, || {
            let mut bytes = [0u8; 16];
            getrandom::getrandom(&mut bytes).map_err(std::io::Error::other)?;
            Ok(bytes.iter().map(|b| format!("{b:02x}")).collect::<String>().into_bytes())
        })
        .map_err(io("naming the shared volume store"))?;
        let id = String::from_utf8_lossy(&made).trim().to_string();
        if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(EngineError::Runtime(format!(
                "{} does not name a store: {id:?}",
                dir.join(STORE_ID).display()
            )));
        }
        Ok(SharedStore { dir: dir.to_path_buf(), id, held: Mutex::new(HashMap::new()) })
    }

    /// The store's name: nodes that report the same one share it.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn image(&self, volume: &VolumeId) -> PathBuf {
        self.dir.join(format!("{volume}.img"))
    }

    fn lock_file(&self, volume: &VolumeId) -> PathBuf {
        self.dir.join(format!("{volume}.lock"))
    }

    /// Whether the store holds an image of `volume`.
    pub fn has_image(&self, volume: &VolumeId) -> bool {
        fs::symlink_metadata(self.image(volume)).is_ok()
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<VolumeId, File>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `volume`'s lock for this process (held already is no error);
    /// refused while another node holds it.
    fn lock(&self, volume: &VolumeId) -> Result<(), EngineError> {
        let mut held = self.held();
        if held.contains_key(volume) {
            return Ok(());
        }
        let path = self.lock_file(volume);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io(format!("opening {}", path.display())))?;
        match file.try_lock() {
            Ok(()) => {
                held.insert(volume.clone(), file);
                Ok(())
            }
            Err(fs::TryLockError::WouldBlock) => Err(EngineError::Runtime(format!(
                "volume {volume} is attached on another node (its lock in the shared store is held)"
            ))),
            Err(fs::TryLockError::Error(err)) => Err(io(format!("locking {}", path.display()))(err)),
        }
    }

    fn unlock(&self, volume: &VolumeId) {
        // Closing the only descriptor lets go of the lock.
        self.held().remove(volume);
    }

    /// Makes `volume`'s image, for `size` of files (and room for its
    /// snapshots), and mounts it at `at`. Refused if there is one.
    pub fn make(&self, volume: &VolumeId, size: DiskMib, at: &Path) -> Result<(), EngineError> {
        self.lock(volume)?;
        let image = self.image(volume);
        let made = (|| {
            let file = OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&image)
                .map_err(io(format!("creating {}", image.display())))?;
            let mib = (u64::from(size.get()) * 2).max(MIN_IMAGE_MIB);
            file.set_len(mib << 20).map_err(io("sizing a volume's image"))?;
            file.sync_all().map_err(io("syncing a volume's image"))?;
            drop(file);
            space_host::run(Command::new("mkfs.btrfs").arg("-q").arg(&image))?;
            self.mount(volume, at)?;
            space_host::btrfs::enable_quotas(at)?;
            Ok(())
        })();
        if made.is_err() {
            let _ = self.unmount(at);
            let _ = fs::remove_file(&image);
            self.unlock(volume);
        }
        made
    }

    /// Mounts `volume`'s image at `at` (mounted there already is no error),
    /// once this process holds its lock.
    pub fn attach(&self, volume: &VolumeId, at: &Path) -> Result<(), EngineError> {
        if !self.has_image(volume) {
            return Err(EngineError::Runtime(format!("the shared store has no volume {volume}")));
        }
        self.lock(volume)?;
        let attached = self.mount(volume, at);
        if attached.is_err() {
            self.unlock(volume);
        }
        attached
    }

    fn mount(&self, volume: &VolumeId, at: &Path) -> Result<(), EngineError> {
        let image = self.image(volume);
        if self.mounted(&image, at) {
            return Ok(());
        }
        fs::create_dir_all(at).map_err(io(format!("making {}", at.display())))?;
        space_host::run(Command::new("mount").args(["-t", "btrfs", "-o", "loop,nosuid,nodev"]).arg(&image).arg(at))?;
        match self.mounted(&image, at) {
            true => Ok(()),
            false => Err(EngineError::Runtime(format!("mounted {} but {} is not it", image.display(), at.display()))),
        }
    }

    /// Whether `at` is a mount of a loop device over `image`.
    fn mounted(&self, image: &Path, at: &Path) -> bool {
        mount_source(at).is_some_and(|device| loop_backing(&device).is_some_and(|backing| backing == image))
    }

    /// Unmounts `volume` from `at` and lets go of its lock (not mounted is
    /// no error). Refused while anything holds a file of it open: a lazy
    /// unmount would leave it written to here while another node mounts it.
    pub fn detach(&self, volume: &VolumeId, at: &Path) -> Result<(), EngineError> {
        self.unmount(at)?;
        let _ = fs::remove_dir(at);
        self.unlock(volume);
        Ok(())
    }

    fn unmount(&self, at: &Path) -> Result<(), EngineError> {
        loop {
            match nix::mount::umount(at) {
                Ok(()) => continue,
                Err(nix::Error::EINVAL | nix::Error::ENOENT) => return Ok(()),
                Err(nix::Error::EBUSY) => {
                    return Err(EngineError::Runtime(format!("{} is in use: it cannot be detached", at.display())))
                }
                Err(err) => return Err(io(format!("unmounting {}", at.display()))(err.into())),
            }
        }
    }

    /// Unmounts `volume` from `at` and removes its image and lock file.
    pub fn remove(&self, volume: &VolumeId, at: &Path) -> Result<(), EngineError> {
        // Only the holder removes it: a volume attached elsewhere stays.
        self.lock(volume)?;
        self.unmount(at)?;
        let _ = fs::remove_dir(at);
        match fs::remove_file(self.image(volume)) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(io("removing a volume's image")(err)),
        }
        let _ = fs::remove_file(self.lock_file(volume));
        self.unlock(volume);
        Ok(())
    }

    /// Takes the lock of every image of this store mounted under `volumes`
    /// (what a restart of this process found still mounted); an image whose
    /// lock another node holds is reported, and left mounted.
    pub fn relock(&self, volumes: &Path) {
        let Ok(entries) = fs::read_dir(volumes) else { return };
        for entry in entries.flatten() {
            let Some(volume) = entry.file_name().to_str().and_then(|name| VolumeId::parse(name).ok()) else {
                continue;
            };
            if self.mounted(&self.image(&volume), &entry.path()) {
                if let Err(err) = self.lock(&volume) {
                    tracing::error!(%volume, "a volume mounted here is locked by another node: {err}");
                }
            }
        }
    }

    /// Whether `volume`'s image is mounted at `at`.
    pub fn is_attached(&self, volume: &VolumeId, at: &Path) -> bool {
        self.mounted(&self.image(volume), at)
    }
}

/// The source of the mount at exactly `at` (the last one mounted there).
fn mount_source(at: &Path) -> Option<String> {
    let at = fs::canonicalize(at).ok()?;
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().rev().find_map(|line| {
        let (mount, rest) = line.split_once(" - ")?;
        let point = mount.split(' ').nth(4)?;
        let source = rest.split(' ').nth(1)?;
        (Path::new(point) == at).then(|| source.to_string())
    })
}

/// The file a loop device (`/dev/loopN`) reads, if it is one.
fn loop_backing(device: &str) -> Option<PathBuf> {
    let name = device.strip_prefix("/dev/")?;
    if !name.starts_with("loop") {
        return None;
    }
    let backing = fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(backing.trim_end()))
}
