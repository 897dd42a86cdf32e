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

/// Turns on quota groups for the filesystem holding `path` (idempotent):
/// what lets a sandbox's writes be capped at its `disk_mib`.
pub fn enable_quotas(path: &Path) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["quota", "enable"]).arg(path)).map(drop)
}

/// Caps the data a subvolume may hold beyond what it shares with its
/// origin (its own writes) at `mib`; writes past it fail with EDQUOT.
pub fn limit_exclusive(path: &Path, mib: u32) -> Result<(), HostError> {
    run(Command::new("btrfs").args(["qgroup", "limit", "-e", &format!("{mib}M")]).arg(path)).map(drop)
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
