//! btrfs subvolumes: the cheap copy-on-write roots sandboxes start from.

use std::path::Path;
use std::process::Command;

use nix::sys::statfs::{statfs, BTRFS_SUPER_MAGIC};

use crate::{run, HostError};

/// Whether `path` lives on a btrfs filesystem.
pub fn is_btrfs(path: &Path) -> bool {
    statfs(path).map(|s| s.filesystem_type() == BTRFS_SUPER_MAGIC).unwrap_or(false)
}

pub fn create_subvolume(path: &Path) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["subvolume", "create"]).arg(path)).map(drop)
}

/// A writable snapshot of `source` at `dest` (the source may be read-only).
pub fn snapshot(source: &Path, dest: &Path) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["subvolume", "snapshot"]).arg(source).arg(dest)).map(drop)
}

/// A read-only snapshot of `source` at `dest`, made read-only as it is
/// made (never writable for an instant).
pub fn snapshot_read_only(source: &Path, dest: &Path) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["subvolume", "snapshot", "-r"]).arg(source).arg(dest)).map(drop)
}

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    rest: [u8; 1024 - 32],
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

nix::ioctl_readwrite!(btrfs_quota_ctl, 0x94, 40, QuotaCtlArgs);
nix::ioctl_read!(btrfs_fs_info, 0x94, 31, FsInfoArgs);
nix::ioctl_readwrite!(btrfs_ino_lookup, 0x94, 18, InoLookupArgs);

/// The sysfs directory of the btrfs filesystem holding the open `dir`.
fn sysfs_dir(dir: &std::fs::File) -> std::io::Result<String> {
    let mut info = FsInfoArgs { max_id: 0, num_devices: 0, fsid: [0; 16], rest: [0; 1024 - 32] };
    // SAFETY: the fd is a directory on btrfs and `info` is the 1024-byte
    // struct the ioctl fills.
    unsafe { btrfs_fs_info(std::os::fd::AsRawFd::as_raw_fd(dir), &mut info) }?;
    let hex: String = info.fsid.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("/sys/fs/btrfs/{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]))
}

/// The bytes a subvolume holds on its own (its quota group's exclusive
/// count: under simple quotas, what it wrote itself), when quotas are on.
/// `path` must be the subvolume's root directory.
pub fn exclusive_bytes(path: &Path) -> Option<u64> {
    qgroup_counter(path, "exclusive")
}

/// The bytes a subvolume's files reference, shared or not (its quota
/// group's referenced count), when quotas are on. `path` must be the
/// subvolume's root directory.
pub fn referenced_bytes(path: &Path) -> Option<u64> {
    qgroup_counter(path, "referenced")
}

/// One counter of the quota group of the subvolume whose root is `path`.
fn qgroup_counter(path: &Path, counter: &str) -> Option<u64> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    // objectid 256 is a subvolume's root directory; treeid 0 asks for the
    // tree (subvolume id) of the fd itself.
    let mut args = InoLookupArgs { treeid: 0, objectid: 256, name: [0; 4080] };
    // SAFETY: the fd is a directory and `args` is the struct the ioctl fills.
    unsafe { btrfs_ino_lookup(std::os::fd::AsRawFd::as_raw_fd(&dir), &mut args) }.ok()?;
    let file = format!("{}/qgroups/0_{}/{counter}", sysfs_dir(&dir).ok()?, args.treeid);
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

const QUOTA_CTL_DISABLE: u64 = 2;
const QUOTA_CTL_ENABLE_SIMPLE: u64 = 4;

/// How quotas run on a filesystem, as its sysfs says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    Off,
    /// Full qgroups: shared extents are tracked; deleting a big snapshot
    /// can leave the numbers inconsistent, and then limits lapse.
    Full,
    /// Simple quotas (kernel 6.7+): each extent is charged to the
    /// subvolume that wrote it; never inconsistent.
    Simple,
}

/// The quota mode of the btrfs filesystem holding `path`.
pub fn quota_mode(path: &Path) -> Result<QuotaMode, HostError> {
    let dir = std::fs::File::open(path).map_err(HostError::io(format!("opening {}", path.display())))?;
    let sysfs =
        sysfs_dir(&dir).map_err(|e| HostError::Invalid(format!("reading btrfs info of {}: {e}", path.display())))?;
    let mode = std::fs::read_to_string(format!("{sysfs}/qgroups/mode"));
    Ok(match mode.as_deref().map(str::trim) {
        Ok("squota") => QuotaMode::Simple,
        Ok(_) => QuotaMode::Full,
        Err(_) => QuotaMode::Off,
    })
}

fn quota_ctl(path: &Path, cmd: u64) -> std::io::Result<()> {
    let dir = std::fs::File::open(path)?;
    let mut args = QuotaCtlArgs { cmd, status: 0 };
    // SAFETY: the fd is a directory on btrfs and `args` is the struct the
    // ioctl reads and writes.
    unsafe { btrfs_quota_ctl(std::os::fd::AsRawFd::as_raw_fd(&dir), &mut args) }?;
    Ok(())
}

/// Turns on simple quotas for the filesystem holding `path`: what caps a
/// sandbox's own writes at its `disk_mib`. Full qgroups left by an older
/// setup are replaced (their limits are set again by the caller). Returns
/// the mode in force; kernels before 6.7 keep full qgroups.
pub fn enable_quotas(path: &Path) -> Result<QuotaMode, HostError> {
    let mode = quota_mode(path)?;
    if mode == QuotaMode::Simple {
        return Ok(mode);
    }
    if mode == QuotaMode::Full {
        quota_ctl(path, QUOTA_CTL_DISABLE).map_err(HostError::io("turning full btrfs quotas off"))?;
    }
    match quota_ctl(path, QUOTA_CTL_ENABLE_SIMPLE) {
        Ok(()) => Ok(QuotaMode::Simple),
        Err(err) => {
            tracing::warn!("btrfs simple quotas are not available ({err}); using full qgroups");
            run(Command::new("btrfs").args(["quota", "enable"]).arg(path))?;
            Ok(QuotaMode::Full)
        }
    }
}

/// Caps the data a subvolume may hold beyond what it shares with its
/// origin (its own writes) at `mib`; writes past it fail with EDQUOT.
pub fn limit_exclusive(path: &Path, mib: u32) -> Result<(), HostError> {
    limit_exclusive_bytes(path, u64::from(mib) << 20)
}

/// [`limit_exclusive`] in bytes.
pub fn limit_exclusive_bytes(path: &Path, bytes: u64) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["qgroup", "limit", "-e", &bytes.to_string()]).arg(path)).map(drop)
}

/// Removes the quota groups of deleted subvolumes once btrfs has cleaned
/// them up (until then they are busy; a later call gets them).
pub fn clear_stale_qgroups(path: &Path) {
    let _ = run(Command::new("btrfs").args(["qgroup", "clear-stale"]).arg(path));
}

pub fn set_read_only(path: &Path) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["property", "set", "-ts"]).arg(path).args(["ro", "true"])).map(drop)
}

/// Deletes a subvolume; a path that is already gone is not an error.
pub fn delete_subvolume(path: &Path) -> Result<(), HostError> {
    if !path.exists() {
        return Ok(());
    }
    if is_subvolume(path) {
        // A read-only subvolume must be made writable before deletion of its
        // nested content; `subvolume delete` itself handles ro.
        run(Command::new("btrfs").args(["subvolume", "delete"]).arg(path)).map(drop)
    } else {
        std::fs::remove_dir_all(path).map_err(HostError::io(format!("removing {}", path.display())))
    }
}

/// A btrfs subvolume's root directory always has inode number 256.
pub fn is_subvolume(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    is_btrfs(path) && std::fs::symlink_metadata(path).map(|m| m.is_dir() && m.ino() == 256).unwrap_or(false)
}

/// Deletes a directory tree, deleting the btrfs subvolumes inside it as
/// subvolumes (plain `remove_dir_all` cannot remove them).
pub fn remove_tree(path: &Path) -> Result<(), HostError> {
    let Ok(entries) = std::fs::read_dir(path) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let child = entry.path();
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            if is_subvolume(&child) {
                delete_subvolume(&child)?;
            } else {
                remove_tree(&child)?;
            }
        }
    }
    std::fs::remove_dir_all(path).map_err(HostError::io(format!("removing {}", path.display())))
}
