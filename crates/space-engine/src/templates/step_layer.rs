//! What a build sandbox's root holds that its step did not make, taken out
//! before the root is kept as a layer chain (`SaveLayer`): the agent and
//! its directory, the mount points a start made for a chain that had none,
//! the hostname files the start and the agent write, the egress CA the
//! agent adds to the trusted certificates, and its `sudo` socket and shim. What the chain below had at
//! those places is put back, so the next chain holds exactly the step's
//! work on its parent, as Docker commits a RUN without its `/etc/hostname`.
//!
//! Everything here works on the new chain's own snapshot, which no
//! sandbox can reach and nothing else writes: a name is looked at, then
//! acted on, and no link the step left is followed (a link where a
//! directory was is the step's, and what lies under it is left alone).

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::EngineError;

/// `/.space`: the agent, its host directory, its cgroup mount points.
const AGENT_DIR: &str = ".space";
/// The agent's egress CA (its `egress::CA_FILE`) and the bundle it appends
/// the CA to (`egress::BUNDLE`).
const CA_FILE: &str = "usr/local/share/ca-certificates/space-egress-ca.crt";
const BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";
/// Written by the start (a neutral name) and the agent (the sandbox's,
/// through the file beside it): the chain's own goes back.
/// The agent's `sudo` socket and the shim it links (decision 034) go too.
const PUT_BACK: &[&str] =
    &["etc/hostname", "etc/.hostname.space-agent", CA_FILE, "run/space-sudo.sock", "usr/local/bin/sudo"];
/// Directories the start or the agent make when the chain lacks them
/// (mount points; the CA's and the bundle's), deepest first: removed when
/// the chain had none and the step left them empty.
const MADE_DIRS: &[&str] = &[
    "usr/local/share/ca-certificates",
    "usr/local/share",
    "usr/local/bin",
    "usr/local",
    "usr",
    "etc/ssl/certs",
    "etc/ssl",
    "etc",
    "proc",
    "dev",
    "sys",
    "tmp",
    "run",
];
/// The most of a CA file read (a certificate is a few KiB).
const MAX_CA: u64 = 64 << 10;
/// The most of a bundle rewritten (Debian's is ≈ 200 KiB).
const MAX_BUNDLE: u64 = 16 << 20;

/// Takes what the platform put into `root` out of it, putting back what
/// the chain below (`parent`, read-only) had there. `root` is a writable
/// snapshot of a stopped build sandbox's root that only this holds.
pub(super) fn strip_runtime(root: &Path, parent: &Path) -> Result<(), EngineError> {
    // Read before it is put back: the text to take out of the bundle.
    let ca = real(root, CA_FILE).filter(|path| is_file(path)).and_then(|path| read_bounded(&path, MAX_CA));
    remove(&root.join(AGENT_DIR))?;
    for name in PUT_BACK {
        put_back(root, parent, name)?;
    }
    if let Some(ca) = ca.as_deref().map(str::trim_end).filter(|ca| !ca.is_empty()) {
        strip_bundle(root, parent, ca)?;
    }
    for name in MADE_DIRS {
        let ours = real(root, name).filter(|path| is_empty_dir(path));
        if let (Some(path), None) = (ours, exists(parent, name)) {
            fs::remove_dir(&path).map_err(EngineError::io(format!("removing /{name} from a saved layer")))?;
        }
    }
    Ok(())
}

/// `base/name` when every directory on the way is a real one (no link).
fn real(base: &Path, name: &str) -> Option<PathBuf> {
    let mut path = base.to_path_buf();
    let parts: Vec<&str> = name.split('/').collect();
    for dir in &parts[..parts.len() - 1] {
        path.push(dir);
        if !fs::symlink_metadata(&path).is_ok_and(|meta| meta.is_dir()) {
            return None;
        }
    }
    path.push(parts[parts.len() - 1]);
    Some(path)
}

/// `base/name` when it exists (whatever it is), reached through real
/// directories only.
fn exists(base: &Path, name: &str) -> Option<PathBuf> {
    real(base, name).filter(|path| fs::symlink_metadata(path).is_ok())
}

fn is_file(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|meta| meta.is_file())
}

fn is_empty_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|meta| meta.is_dir())
        && fs::read_dir(path).is_ok_and(|mut entries| entries.next().is_none())
}

fn read_bounded(path: &Path, max: u64) -> Option<String> {
    let mut text = String::new();
    fs::File::open(path).ok()?.take(max + 1).read_to_string(&mut text).ok()?;
    (text.len() as u64 <= max).then_some(text)
}

/// Removes whatever stands at `path` (a link itself, never its target).
fn remove(path: &Path) -> Result<(), EngineError> {
    let removed = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => return Ok(()),
    };
    removed.map_err(EngineError::io(format!("removing {} from a saved layer", path.display())))
}

/// Makes `root/name` what `parent/name` is: a file (its bytes, mode,
/// owner and times), a link, or nothing. When the step removed or replaced
/// a directory on the way, the place is the step's and left alone.
fn put_back(root: &Path, parent: &Path, name: &str) -> Result<(), EngineError> {
    let Some(ours) = real(root, name) else { return Ok(()) };
    let io = |what: &str| EngineError::io(format!("{what} /{name} in a saved layer"));
    let theirs = exists(parent, name);
    let meta = theirs.as_deref().and_then(|path| fs::symlink_metadata(path).ok());
    if meta.as_ref().is_some_and(|meta| meta.is_dir()) {
        // The start replaced a directory there (install_agent does); a
        // directory's whole tree is not copied back: the step's view of
        // the place stands.
        return Ok(());
    }
    remove(&ours)?;
    let (Some(theirs), Some(meta)) = (theirs, meta) else { return Ok(()) };
    if meta.file_type().is_symlink() {
        let target = fs::read_link(&theirs).map_err(io("reading the link"))?;
        std::os::unix::fs::symlink(target, &ours).map_err(io("putting back the link"))?;
        return lchown(&ours, &meta).map_err(io("owning"));
    }
    if !meta.is_file() {
        return Ok(());
    }
    fs::copy(&theirs, &ours).map_err(io("putting back"))?;
    lchown(&ours, &meta).map_err(io("owning"))?;
    fs::set_permissions(&ours, std::os::unix::fs::PermissionsExt::from_mode(meta.mode() & 0o7777))
        .map_err(io("chmod of"))?;
    set_times(&ours, &meta).map_err(io("dating"))
}

fn lchown(path: &Path, meta: &fs::Metadata) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(meta.uid()), Some(meta.gid()))
}

fn set_times(path: &Path, meta: &fs::Metadata) -> std::io::Result<()> {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    let atime = TimeSpec::new(meta.atime(), meta.atime_nsec());
    let mtime = TimeSpec::new(meta.mtime(), meta.mtime_nsec());
    utimensat(None, path, &atime, &mtime, UtimensatFlags::NoFollowSymlink).map_err(std::io::Error::from)
}

/// Takes the egress CA's text out of the bundle of trusted certificates
/// (the agent appended it; an `update-ca-certificates` of the step wrote
/// it in again from the CA file). A bundle left empty that the chain did
/// not have goes.
fn strip_bundle(root: &Path, parent: &Path, ca: &str) -> Result<(), EngineError> {
    let Some(bundle) = real(root, BUNDLE).filter(|path| is_file(path)) else { return Ok(()) };
    let Some(text) = read_bounded(&bundle, MAX_BUNDLE) else { return Ok(()) };
    if !text.contains(ca) {
        return Ok(());
    }
    let kept = text.replace(&format!("{ca}\n"), "").replace(ca, "");
    let io = EngineError::io("taking the egress CA out of a saved layer's bundle");
    if kept.trim().is_empty() && exists(parent, BUNDLE).is_none() {
        return fs::remove_file(&bundle).map_err(io);
    }
    // In place: the file keeps its owner and mode.
    fs::write(&bundle, kept).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("space-step-layer-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("parent")).unwrap();
        fs::create_dir_all(dir.join("root")).unwrap();
        dir
    }

    fn write(base: &Path, name: &str, text: &str) {
        let path = base.join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn tree(base: &Path) -> Vec<String> {
        fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
            for entry in fs::read_dir(dir).unwrap().flatten() {
                let path = entry.path();
                out.push(path.strip_prefix(base).unwrap().display().to_string());
                if fs::symlink_metadata(&path).unwrap().is_dir() {
                    walk(base, &path, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(base, base, &mut out);
        out.sort();
        out
    }

    const CA: &str = "-----BEGIN CERTIFICATE-----\nTESTCA\n-----END CERTIFICATE-----\n";

    #[test]
    fn what_the_platform_put_in_goes_and_what_the_chain_had_comes_back() {
        let dir = scratch("back");
        let (parent, root) = (dir.join("parent"), dir.join("root"));
        write(&parent, "etc/hostname", "image-host\n");
        write(&parent, "etc/ssl/certs/ca-certificates.crt", "IMAGE CAS\n");
        write(&parent, "bin/tool", "tool");
        // The root as a stopped build sandbox leaves it.
        write(&root, "bin/tool", "tool");
        write(&root, ".space/space-agent", "agent");
        fs::create_dir_all(root.join(".space/host")).unwrap();
        write(&root, "etc/hostname", "sbx-build\n");
        write(&root, CA_FILE, CA);
        write(&root, BUNDLE, &format!("IMAGE CAS\n{CA}STEP CA\n"));
        for made in ["proc", "dev", "sys"] {
            fs::create_dir(root.join(made)).unwrap();
        }
        // The step's own work, including in a mount point it wrote to.
        write(&root, "tmp/built", "by the step");
        write(&root, "work/out", "by the step");
        strip_runtime(&root, &parent).unwrap();
        assert_eq!(
            tree(&root),
            [
                "bin",
                "bin/tool",
                "etc",
                "etc/hostname",
                "etc/ssl",
                "etc/ssl/certs",
                "etc/ssl/certs/ca-certificates.crt",
                "tmp",
                "tmp/built",
                "work",
                "work/out"
            ]
        );
        assert_eq!(fs::read_to_string(root.join("etc/hostname")).unwrap(), "image-host\n");
        assert_eq!(fs::read_to_string(root.join(BUNDLE)).unwrap(), "IMAGE CAS\nSTEP CA\n");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_chain_without_them_gets_none_and_links_the_step_left_are_not_followed() {
        let dir = scratch("links");
        let (parent, root) = (dir.join("parent"), dir.join("root"));
        let outside = dir.join("outside");
        write(&outside, "hostname", "not the layer's");
        write(&outside, "ssl/certs/ca-certificates.crt", CA);
        // A chain with no /etc at all: what the agent made of it goes.
        write(&root, CA_FILE, CA);
        write(&root, BUNDLE, CA);
        strip_runtime(&root, &parent).unwrap();
        assert_eq!(tree(&root), Vec::<String>::new());

        // The step made /etc a link out of its root: nothing through it moves.
        std::os::unix::fs::symlink(&outside, root.join("etc")).unwrap();
        write(&root, CA_FILE, CA);
        strip_runtime(&root, &parent).unwrap();
        assert_eq!(fs::read_to_string(outside.join("hostname")).unwrap(), "not the layer's");
        assert_eq!(fs::read_to_string(outside.join("ssl/certs/ca-certificates.crt")).unwrap(), CA);
        assert_eq!(tree(&root), ["etc"]);
        fs::remove_dir_all(dir).unwrap();
    }
}
