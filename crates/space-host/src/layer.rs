//! An uncompressed tar applied under a root the way an OCI layer is: whiteouts
//! remove, opaque directories hide, and no path the archive names (through
//! `..`, absolute names or links already in the root) lands outside the
//! root. Image layers and templates pulled from another host both arrive
//! this way; it knows nothing of either.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::HostError;

/// How many symlinks one path may pass through before it is refused.
const MAX_LINK_HOPS: u32 = 40;

fn bad(reason: impl Into<String>) -> HostError {
    HostError::Invalid(reason.into())
}

/// Applies one uncompressed layer tar under `root` (whiteouts, opaque
/// directories, every path kept inside `root`) and hands the reader back
/// for whatever follows the archive. `progress` is called after each entry.
pub fn apply_tar<R: Read>(
    root: &Path,
    layer: R,
    log: &mut dyn Write,
    progress: &mut dyn FnMut(),
) -> Result<R, HostError> {
    let mut tar = tar::Archive::new(layer);
    let mut created: HashSet<PathBuf> = HashSet::new();
    for entry in tar.entries().map_err(|e| bad(format!("not a tar: {e}")))? {
        let mut entry = entry.map_err(|e| bad(format!("not a valid tar: {e}")))?;
        apply_entry(root, &mut entry, &mut created, log)?;
        progress();
    }
    Ok(tar.into_inner())
}

/// Applies one layer entry under `root`, OCI-style: whiteouts remove what
/// lower layers made, an opaque directory hides its lower content, and
/// everything else replaces what was at its path.
fn apply_entry<R: Read>(
    root: &Path,
    entry: &mut tar::Entry<R>,
    created: &mut HashSet<PathBuf>,
    log: &mut dyn Write,
) -> Result<(), HostError> {
    let raw = entry.path().map_err(|e| bad(format!("unreadable entry name: {e}")))?.into_owned();
    let rel = clean_relative(&raw).map_err(|why| bad(format!("entry {raw:?}: {why}")))?;
    let (Some(name), Some(parent_rel)) = (rel.file_name().map(OsString::from), rel.parent()) else {
        return Ok(()); // the root itself
    };
    let parent = resolve_in_root(root, parent_rel)?;
    fs::create_dir_all(&parent).map_err(HostError::io(format!("creating {}", parent_rel.display())))?;
    let name_str = name.to_string_lossy();
    if name_str == ".wh..wh..opq" {
        for child in fs::read_dir(&parent).map_err(HostError::io("reading a directory"))?.flatten() {
            if !created.contains(&parent_rel.join(child.file_name())) {
                remove_any(&child.path())?;
            }
        }
        return Ok(());
    }
    if let Some(hidden) = name_str.strip_prefix(".wh.") {
        if hidden.is_empty() || hidden == "." || hidden == ".." {
            return Err(bad(format!("entry {raw:?}: not a valid whiteout")));
        }
        return remove_any(&parent.join(hidden));
    }
    let dst = parent.join(&name);
    created.insert(rel.clone());
    let header = entry.header();
    let kind = header.entry_type();
    let mode = header.mode().map_err(|e| bad(format!("entry {raw:?}: {e}")))? & 0o7777;
    let uid = header.uid().unwrap_or(0) as u32;
    let gid = header.gid().unwrap_or(0) as u32;
    let mtime = header.mtime().ok().map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s));
    let io_err = |what: &str| HostError::io(format!("{what} {}", rel.display()));
    if kind.is_dir() {
        if !fs::symlink_metadata(&dst).map(|m| m.is_dir()).unwrap_or(false) {
            remove_any(&dst)?;
            fs::create_dir(&dst).map_err(io_err("creating"))?;
        }
        std::os::unix::fs::chown(&dst, Some(uid), Some(gid)).map_err(io_err("chown of"))?;
        fs::set_permissions(&dst, fs::Permissions::from_mode(mode)).map_err(io_err("chmod of"))?;
    } else if kind.is_file() {
        remove_any(&dst)?;
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&dst)
            .map_err(io_err("creating"))?;
        io::copy(entry, &mut file).map_err(|e| bad(format!("entry {raw:?}: {e}")))?;
        std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(io_err("chown of"))?;
        file.set_permissions(fs::Permissions::from_mode(mode)).map_err(io_err("chmod of"))?;
        if let Some(mtime) = mtime {
            let _ = file.set_modified(mtime);
        }
    } else if kind.is_symlink() {
        let target = link_target(entry, &raw)?;
        if symlink_escapes(&rel, &target) {
            return Err(bad(format!("symlink {raw:?} points outside the image root ({})", target.display())));
        }
        remove_any(&dst)?;
        std::os::unix::fs::symlink(&target, &dst).map_err(io_err("creating symlink"))?;
        std::os::unix::fs::lchown(&dst, Some(uid), Some(gid)).map_err(io_err("chown of"))?;
    } else if kind.is_hard_link() {
        let target = link_target(entry, &raw)?;
        let target_rel = clean_relative(&target)
            .map_err(|why| bad(format!("hard link {raw:?} points outside the image root ({why})")))?;
        let (Some(target_name), Some(target_parent)) = (target_rel.file_name(), target_rel.parent()) else {
            return Err(bad(format!("hard link {raw:?} points at the root")));
        };
        let source = resolve_in_root(root, target_parent)?.join(target_name);
        match fs::symlink_metadata(&source) {
            Ok(meta) if !meta.is_dir() => {}
            _ => return Err(bad(format!("hard link {raw:?}: no file at {}", target.display()))),
        }
        if source != dst {
            remove_any(&dst)?;
            fs::hard_link(&source, &dst).map_err(io_err("linking"))?;
        }
    } else if kind == tar::EntryType::Fifo {
        remove_any(&dst)?;
        nix::unistd::mkfifo(&dst, nix::sys::stat::Mode::from_bits_truncate(mode))
            .map_err(|e| HostError::Io { what: format!("creating fifo {}", rel.display()), source: e.into() })?;
        std::os::unix::fs::chown(&dst, Some(uid), Some(gid)).map_err(io_err("chown of"))?;
    } else {
        // Devices come from the engine, never from an image.
        let _ = writeln!(log, "  skipped {} ({kind:?})", rel.display());
    }
    Ok(())
}

fn link_target<R: Read>(entry: &tar::Entry<R>, raw: &Path) -> Result<PathBuf, HostError> {
    Ok(entry
        .link_name()
        .map_err(|e| bad(format!("entry {raw:?}: {e}")))?
        .ok_or_else(|| bad(format!("link {raw:?} has no target")))?
        .into_owned())
}

/// A relative symlink whose target climbs above the image root.
fn symlink_escapes(entry: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false; // resolved inside the sandbox, where / is the image root
    }
    let mut depth = entry.components().count().saturating_sub(1);
    for component in target.components() {
        match component {
            Component::ParentDir if depth == 0 => return true,
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            _ => {}
        }
    }
    false
}

/// `root/rel` with every symlink on the way resolved as the sandbox would
/// see it: absolute targets start again at `root`, and `..` stops at
/// `root`, so the result is always inside `root`.
fn resolve_in_root(root: &Path, rel: &Path) -> Result<PathBuf, HostError> {
    let mut resolved: Vec<OsString> = Vec::new();
    let mut pending: std::collections::VecDeque<OsString> =
        rel.components().filter_map(|c| normal_or_parent(c)).collect();
    let mut hops = 0;
    while let Some(part) = pending.pop_front() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let candidate: PathBuf = root.join(resolved.iter().collect::<PathBuf>()).join(&part);
        match fs::symlink_metadata(&candidate) {
            Ok(meta) if meta.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return Err(bad(format!("too many symlinks under {}", rel.display())));
                }
                let target = fs::read_link(&candidate).map_err(HostError::io("reading a symlink"))?;
                if target.is_absolute() {
                    resolved.clear();
                }
                let mut next: std::collections::VecDeque<OsString> =
                    target.components().filter_map(|c| normal_or_parent(c)).collect();
                next.extend(pending);
                pending = next;
            }
            Ok(meta) if !meta.is_dir() => {
                return Err(bad(format!("{} is not a directory", rel.display())));
            }
            _ => resolved.push(part),
        }
    }
    Ok(root.join(resolved.iter().collect::<PathBuf>()))
}

fn normal_or_parent(component: Component) -> Option<OsString> {
    match component {
        Component::Normal(part) => Some(part.to_os_string()),
        Component::ParentDir => Some("..".into()),
        _ => None,
    }
}

/// Removes whatever is at `path` (without following a symlink there).
fn remove_any(path: &Path) -> Result<(), HostError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => {
            fs::remove_dir_all(path).map_err(HostError::io(format!("removing {}", path.display())))
        }
        Ok(_) => fs::remove_file(path).map_err(HostError::io(format!("removing {}", path.display()))),
        Err(_) => Ok(()),
    }
}

/// `path` without `.` components, refusing absolute paths and `..`.
pub(crate) fn clean_relative(path: &Path) -> Result<PathBuf, &'static str> {
    let mut clean = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => clean.push(part),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return Err("absolute paths are not allowed"),
            Component::ParentDir => return Err("paths with `..` are not allowed"),
        }
    }
    Ok(clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_that_climb_out_are_caught() {
        assert!(symlink_escapes(Path::new("a"), Path::new("../etc")));
        assert!(symlink_escapes(Path::new("a/b/c"), Path::new("../../../x")));
        assert!(!symlink_escapes(Path::new("a/b/c"), Path::new("../../x")));
        assert!(!symlink_escapes(Path::new("bin/sh"), Path::new("/bin/busybox")));
        assert!(!symlink_escapes(Path::new("lib"), Path::new("usr/lib")));
    }

    #[test]
    fn paths_resolve_inside_the_root() {
        let root = std::env::temp_dir().join(format!("space-oci-resolve-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("usr/lib")).unwrap();
        std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("etc-link")).unwrap();
        std::os::unix::fs::symlink("../../../../..", root.join("up")).unwrap();
        assert_eq!(resolve_in_root(&root, Path::new("lib/x")).unwrap(), root.join("usr/lib/x"));
        assert_eq!(resolve_in_root(&root, Path::new("etc-link")).unwrap(), root.join("etc"));
        assert_eq!(resolve_in_root(&root, Path::new("up/tmp")).unwrap(), root.join("tmp"));
        fs::remove_dir_all(&root).unwrap();
    }
}
