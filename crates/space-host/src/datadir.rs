//! The data directory: where templates, sandboxes and state live.
//!
//! ```text
//! DIR/state/                        what the unprivileged server writes (0700):
//!   space.db                        state (SQLite, WAL)
//!   secrets.key                     the sealing key of secrets at rest (0600)
//!   dev-api-key                     the dev-mode key (0600)
//!   sandboxes/ID/commands/          command transcripts
//!   sandboxes/ID/checkpoints/N.json a whole checkpoint's record
//! DIR/logs/                         template builds' logs
//! DIR/templates/NAME/VERSION/       rootfs/ (read-only subvolume), template.json,
//!                                   rootfs.ext4 (Firecracker's root drive, when built)
//! DIR/sandboxes/ID/                 rootfs/ (snapshot), bundle/, sock/, images,
//!                                   checkpoints' images: the engine's, root's
//! DIR/run/                          engine state; run/uploads/ archives being uploaded
//! ```
//!
//! The split keeps what the server writes apart from what the engine (root)
//! makes, so the server can run as a user of its own whose writable paths are
//! `state/`, `logs/` and `run/uploads/` alone. A data dir of an older layout
//! (state files at the top, transcripts beside the sandbox's root) is moved
//! into this one when it is opened with the right to do so ([`DataDir::open`]).
//!
//! It must be on btrfs; when it is not, [`ensure_btrfs`] puts a loop-mounted
//! btrfs image there.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::btrfs::is_btrfs;
use crate::template_meta::{valid_name, TemplateInfo};
use crate::{run, HostError};

/// The name of the loop image inside a data dir that is not on btrfs.
pub const LOOP_IMAGE: &str = ".space-btrfs.img";

#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
    ext4_images: bool,
    space: DiskSpace,
}

/// Where the free space of a directory is read: its own filesystem and,
/// when that is a btrfs on a loop-mounted file, the filesystem holding the
/// file. The image is sparse, so what the btrfs may still write is bounded
/// by that filesystem's free space too.
#[derive(Debug, Clone)]
pub struct DiskSpace {
    dir: PathBuf,
    image_host: Option<PathBuf>,
}

impl DiskSpace {
    /// The space of `dir` (found out once: which loop image it is on).
    pub fn of(dir: &Path) -> DiskSpace {
        DiskSpace { dir: dir.to_path_buf(), image_host: image_host(dir) }
    }

    /// Free and total bytes of the directory's filesystem. On a loop-mounted
    /// image, free is also bounded by what the filesystem under the image has
    /// left: the image grows as it is written, and a btrfs whose image cannot
    /// grow fails its writes instead of reporting a full disk.
    pub fn free_and_total(&self) -> (u64, u64) {
        let Some((free, total)) = statvfs_bytes(&self.dir) else {
            return (0, 0);
        };
        match self.image_host.as_deref().and_then(statvfs_bytes) {
            Some((host_free, _)) => (free.min(host_free), total),
            None => (free, total),
        }
    }

    /// Where the directory's btrfs image lives, when it is a loop-mounted file.
    pub fn image_host(&self) -> Option<&Path> {
        self.image_host.as_deref()
    }
}

impl DataDir {
    /// Opens an existing data dir; it must already be on btrfs.
    pub fn open(root: &Path) -> Result<DataDir, HostError> {
        let root = fs::canonicalize(root).map_err(HostError::io(format!("opening data dir {}", root.display())))?;
        if !is_btrfs(&root) {
            return Err(HostError::Invalid(format!(
                "data dir {} is not on btrfs; run `space setup --data-dir {}` first",
                root.display(),
                root.display()
            )));
        }
        DataDir::open_on_any_filesystem(&root)
    }

    /// Opens a data dir on whatever filesystem holds it: for an engine that
    /// copies no template root (the test engine), where nothing needs
    /// btrfs's snapshots or quotas.
    pub fn open_on_any_filesystem(root: &Path) -> Result<DataDir, HostError> {
        let root = fs::canonicalize(root).map_err(HostError::io(format!("opening data dir {}", root.display())))?;
        let space = DiskSpace::of(&root);
        let dir = DataDir { root, ext4_images: crate::hardware_virtualization(), space };
        for sub in [dir.templates_dir(), dir.sandboxes_dir(), dir.run_dir()] {
            if !sub.is_dir() {
                fs::create_dir_all(&sub).map_err(HostError::io(format!("creating {}", sub.display())))?;
            }
        }
        let state = dir.state_dir();
        if !state.is_dir() {
            fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(&state)
                .map_err(HostError::io(format!("creating {}", state.display())))?;
        }
        // The database and the keys are in it: its owner's alone.
        let mode = fs::metadata(&state).map_err(HostError::io(format!("reading {}", state.display())))?.mode();
        if mode & 0o077 != 0 {
            fs::set_permissions(&state, fs::Permissions::from_mode(0o700))
                .map_err(HostError::io(format!("making {} its owner's alone", state.display())))?;
        }
        dir.move_old_layout()?;
        Ok(dir)
    }

    /// The paths the server itself writes: `state/`, `logs/` and
    /// `run/uploads/`.
    pub fn server_paths(&self) -> [PathBuf; 3] {
        server_paths(&self.root)
    }

    /// Gives the server's paths ([`DataDir::server_paths`]), made if
    /// missing, and everything in them to `uid`:`gid`, for a server that
    /// runs as that user beside a root helper. Links are changed, never
    /// followed; what that user already owns is left alone, so a second
    /// call changes nothing. How many entries changed hands.
    pub fn hand_over(&self, uid: u32, gid: u32) -> Result<usize, HostError> {
        let mut changed = 0;
        for top in self.server_paths() {
            fs::create_dir_all(&top).map_err(HostError::io(format!("creating {}", top.display())))?;
            let mut pending = vec![top];
            while let Some(path) = pending.pop() {
                let meta = fs::symlink_metadata(&path).map_err(HostError::io(format!("reading {}", path.display())))?;
                if meta.is_dir() {
                    for entry in fs::read_dir(&path).map_err(HostError::io(format!("listing {}", path.display())))? {
                        pending.push(entry.map_err(HostError::io(format!("listing {}", path.display())))?.path());
                    }
                }
                if (meta.uid(), meta.gid()) != (uid, gid) {
                    std::os::unix::fs::lchown(&path, Some(uid), Some(gid))
                        .map_err(HostError::io(format!("giving {} to uid {uid}", path.display())))?;
                    changed += 1;
                }
            }
        }
        Ok(changed)
    }

    /// Moves what an older layout kept at the top of the data dir or beside
    /// a sandbox's root into `state/`. Each move is a rename inside one
    /// filesystem, so a crash leaves every file whole in one place or the
    /// other, and the next open finishes the rest. Nothing is overwritten:
    /// a file already in `state/` wins.
    fn move_old_layout(&self) -> Result<(), HostError> {
        let state = self.state_dir();
        let mut moves: Vec<(PathBuf, PathBuf)> =
            ["space.db", "space.db-wal", "space.db-shm", "secrets.key", "dev-api-key"]
                .iter()
                .map(|name| (self.root.join(name), state.join(name)))
                .collect();
        for entry in fs::read_dir(self.sandboxes_dir()).into_iter().flatten().flatten() {
            let (old, id) = (entry.path(), entry.file_name());
            let new = state.join("sandboxes").join(&id);
            moves.push((old.join("commands"), new.join("commands")));
            for checkpoint in fs::read_dir(old.join("checkpoints")).into_iter().flatten().flatten() {
                let name = checkpoint.file_name();
                let json = new.join("checkpoints").join(format!("{}.json", name.to_string_lossy()));
                moves.push((checkpoint.path().join("meta.json"), json));
            }
        }
        for (old, new) in moves {
            if fs::symlink_metadata(&old).is_err() || fs::symlink_metadata(&new).is_ok() {
                continue;
            }
            if let Some(parent) = new.parent() {
                fs::create_dir_all(parent).map_err(HostError::io(format!("creating {}", parent.display())))?;
            }
            fs::rename(&old, &new).map_err(HostError::io(format!("moving {} to {}", old.display(), new.display())))?;
            tracing::info!("moved {} to {}", old.display(), new.display());
        }
        Ok(())
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether template builds also make an ext4 image of each root (what
    /// the Firecracker engine boots from). By default, when this host has
    /// hardware virtualization.
    pub fn ext4_images(&self) -> bool {
        self.ext4_images
    }

    pub fn set_ext4_images(&mut self, build: bool) {
        self.ext4_images = build;
    }
    /// What the server writes, apart from what the engine makes.
    pub fn state_dir(&self) -> PathBuf {
        state_dir(&self.root)
    }
    pub fn db_path(&self) -> PathBuf {
        self.state_dir().join("space.db")
    }
    pub fn dev_key_path(&self) -> PathBuf {
        dev_key_path(&self.root)
    }
    /// The key sealing secrets at rest (0600, the server's alone).
    pub fn secrets_key_path(&self) -> PathBuf {
        self.state_dir().join("secrets.key")
    }
    /// What the server keeps of a sandbox: transcripts, checkpoints' records.
    pub fn sandbox_state_dir(&self, id: &str) -> PathBuf {
        self.state_dir().join("sandboxes").join(id)
    }
    pub fn templates_dir(&self) -> PathBuf {
        self.root.join("templates")
    }
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.root.join("sandboxes")
    }
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes_dir().join(id)
    }
    pub fn run_dir(&self) -> PathBuf {
        self.root.join("run")
    }
    /// Debian packages downloaded by template builds, shared between them.
    pub fn apt_cache_dir(&self) -> PathBuf {
        self.root.join("cache").join("apt")
    }
    /// Logs of operations (template builds), by operation id.
    pub fn log_path(&self, operation_id: &str) -> PathBuf {
        self.logs_dir().join(format!("{operation_id}.log"))
    }
    pub fn logs_dir(&self) -> PathBuf {
        self.root.join("logs")
    }

    /// The newest complete version of template `name`, if any.
    pub fn template(&self, name: &str) -> Option<TemplateInfo> {
        if !valid_name(name) {
            return None;
        }
        let dir = self.templates_dir().join(name);
        let mut versions: Vec<u32> =
            fs::read_dir(&dir).ok()?.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()).collect();
        versions.sort_unstable();
        versions.into_iter().rev().find_map(|version| TemplateInfo::load(&dir.join(version.to_string())).ok())
    }

    /// Every template's newest complete version.
    pub fn templates(&self) -> Vec<TemplateInfo> {
        let Ok(entries) = fs::read_dir(self.templates_dir()) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
        names.sort();
        names.iter().filter_map(|name| self.template(name)).collect()
    }

    /// A fresh, isolated data dir at `scratch/<name>` inside this one, holding
    /// writable snapshots of the newest versions of `templates`. Tests and
    /// benchmarks use it so they never touch a serving data dir's state.
    pub fn scratch(&self, name: &str, templates: &[&str]) -> Result<DataDir, HostError> {
        let root = self.root.join("scratch").join(name);
        if root.exists() {
            crate::btrfs::remove_tree(&root)?;
        }
        for template_name in templates {
            let template = self.template(template_name).ok_or_else(|| {
                HostError::Invalid(format!("no template {template_name:?} in {}", self.root.display()))
            })?;
            let version_dir = root.join("templates").join(template_name).join(template.meta.version.to_string());
            fs::create_dir_all(&version_dir).map_err(HostError::io("creating a scratch template dir"))?;
            crate::btrfs::snapshot(&template.rootfs(), &version_dir.join("rootfs"))?;
            fs::copy(template.dir.join("template.json"), version_dir.join("template.json"))
                .map_err(HostError::io("copying template.json"))?;
        }
        fs::create_dir_all(&root).map_err(HostError::io("creating a scratch data dir"))?;
        DataDir::open(&root)
    }

    /// Free and total bytes of the filesystem holding the data dir (see
    /// [`DiskSpace::free_and_total`]).
    pub fn disk_space(&self) -> (u64, u64) {
        self.space.free_and_total()
    }

    /// Where the data dir's free space is read.
    pub fn space(&self) -> &DiskSpace {
        &self.space
    }
}

/// `state/` of the data dir at `root`.
pub fn state_dir(root: &Path) -> PathBuf {
    root.join("state")
}

/// [`DataDir::server_paths`] of the data dir at `root`, without opening
/// it (which may make or move files).
pub fn server_paths(root: &Path) -> [PathBuf; 3] {
    [state_dir(root), root.join("logs"), root.join("run").join("uploads")]
}

/// The dev-mode key of the data dir at `root`, read by the CLI without
/// opening the data dir.
pub fn dev_key_path(root: &Path) -> PathBuf {
    state_dir(root).join("dev-api-key")
}

/// Free (to unprivileged writers) and total bytes of the filesystem at `path`.
fn statvfs_bytes(path: &Path) -> Option<(u64, u64)> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    Some((s.blocks_available() * s.fragment_size(), s.blocks() * s.fragment_size()))
}

/// A directory on the filesystem holding the image file of the loop device
/// `root`'s filesystem is mounted from, or None when it is not a loop device
/// over a file. The image may sit under the mount point itself (as
/// [`ensure_btrfs`] puts it), hidden by the mount: then the mount point's
/// parent, which is on the same filesystem as the hidden directory.
fn image_host(root: &Path) -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let root = fs::canonicalize(root).ok()?;
    let (mount_point, source) = mount_of(&mountinfo, &root)?;
    let device = source.strip_prefix("/dev/")?;
    if !device.starts_with("loop") {
        return None;
    }
    let backing = fs::read_to_string(format!("/sys/block/{device}/loop/backing_file")).ok()?;
    let backing = PathBuf::from(backing.trim_end().trim_end_matches(" (deleted)"));
    let dir = backing.parent()?;
    if dir.starts_with(&mount_point) {
        return mount_point.parent().map(Path::to_path_buf);
    }
    Some(dir.to_path_buf())
}

/// The mount point and source of the mount `path` is on, from the text of
/// `/proc/self/mountinfo`: the last-mounted of those with the longest mount
/// point that holds `path`.
fn mount_of(mountinfo: &str, path: &Path) -> Option<(PathBuf, String)> {
    let mut best: Option<(PathBuf, String)> = None;
    for line in mountinfo.lines() {
        let Some((mount, rest)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = mount.split(' ').nth(4).map(unescape_mount_field) else {
            continue;
        };
        let Some(source) = rest.split(' ').nth(1).map(unescape_mount_field) else {
            continue;
        };
        let point = PathBuf::from(point);
        let longer = best.as_ref().is_none_or(|(b, _)| point.as_os_str().len() >= b.as_os_str().len());
        if path.starts_with(&point) && longer {
            best = Some((point, source));
        }
    }
    best
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape_mount_field(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|d| d.bytes().all(|c| matches!(c, b'0'..=b'7')))
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Makes sure `dir` is on btrfs: it already is, or a loop image inside it is
/// mounted over it (created first, sparse, `size_gib` large, if missing).
/// Returns what was done, for the setup log.
pub fn ensure_btrfs(dir: &Path, size_gib: u64) -> Result<String, HostError> {
    fs::create_dir_all(dir).map_err(HostError::io(format!("creating {}", dir.display())))?;
    if is_btrfs(dir) {
        return Ok(format!("{} is on btrfs", dir.display()));
    }
    let image = dir.join(LOOP_IMAGE);
    let mut said = String::new();
    if !image.exists() {
        let others: Vec<String> = fs::read_dir(dir)
            .map_err(HostError::io(format!("reading {}", dir.display())))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        if !others.is_empty() {
            return Err(HostError::Invalid(format!(
                "{} is not on btrfs and not empty ({} entries); mounting a btrfs image over it would hide them. \
                 Use an empty directory or one on btrfs.",
                dir.display(),
                others.len()
            )));
        }
        let file = fs::File::create(&image).map_err(HostError::io(format!("creating {}", image.display())))?;
        file.set_len(size_gib << 30).map_err(HostError::io("sizing the btrfs image"))?;
        drop(file);
        run(Command::new("mkfs.btrfs").arg("-q").arg(&image))?;
        said.push_str(&format!("created a {size_gib} GiB sparse btrfs image; "));
    }
    run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(dir))?;
    if !is_btrfs(dir) {
        return Err(HostError::Invalid(format!(
            "mounted {} but {} is still not btrfs",
            image.display(),
            dir.display()
        )));
    }
    said.push_str(&format!("mounted it on {}", dir.display()));
    Ok(said)
}

/// The content of a file that many may need first at once (the sealing
/// key, the dev key): the one that is there, or else `make`'s, written
/// whole to a file of its own (`mode`, synced) and linked into place, so
/// that exactly one maker wins and every other, in this process or
/// another, reads the winner's complete content.
pub fn create_once(
    path: &Path,
    mode: u32,
    make: impl FnOnce() -> std::io::Result<Vec<u8>>,
) -> std::io::Result<Vec<u8>> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    match fs::read(path) {
        Ok(content) => return Ok(content),
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err),
        Err(_) => {}
    }
    let content = make()?;
    let mut suffix = [0u8; 8];
    getrandom::getrandom(&mut suffix).map_err(std::io::Error::other)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let staged = path.with_file_name(format!(
        ".{name}.{}.{}",
        std::process::id(),
        suffix.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let written = (|| {
        let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&staged)?;
        file.write_all(&content)?;
        file.sync_all()?;
        // A link never replaces: the first one made is the file.
        fs::hard_link(&staged, path)
    })();
    let _ = fs::remove_file(&staged);
    match written {
        Ok(()) => Ok(content),
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => fs::read(path),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_many_create_at_once_is_made_once_and_read_whole_by_all() {
        let dir = std::env::temp_dir().join(format!("space-create-once-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shared.key");
        let start = std::sync::Barrier::new(32);
        let seen: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let users: Vec<_> = (0..32u8)
                .map(|n| {
                    let (path, start) = (&path, &start);
                    scope.spawn(move || {
                        start.wait();
                        create_once(path, 0o600, || Ok(vec![n; 4096])).unwrap()
                    })
                })
                .collect();
            users.into_iter().map(|u| u.join().unwrap()).collect()
        });
        let on_disk = fs::read(&path).unwrap();
        assert_eq!(on_disk.len(), 4096);
        assert!(seen.iter().all(|content| *content == on_disk), "every user got the one file's whole content");
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no staged file is left");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_older_layout_moves_into_state_whole_and_a_newer_file_wins() {
        let root = std::env::temp_dir().join(format!("space-layout-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let sandbox = root.join("sandboxes").join("sbx_00000000000000000001");
        let transcript = sandbox.join("commands").join("cmd_1").join("transcript");
        let meta = sandbox.join("checkpoints").join("before").join("meta.json");
        for (path, text) in [
            (root.join("space.db"), "db"),
            (root.join("secrets.key"), "key"),
            (root.join("dev-api-key"), "old dev key"),
            (transcript.clone(), "out"),
            (meta.clone(), "{}"),
            (root.join("state").join("dev-api-key"), "new dev key"),
        ] {
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        let data = DataDir::open_on_any_filesystem(&root).unwrap();
        let read = |path: PathBuf| fs::read_to_string(path).unwrap();
        assert_eq!(read(data.db_path()), "db");
        assert_eq!(read(data.secrets_key_path()), "key");
        assert_eq!(read(data.dev_key_path()), "new dev key", "a file already in state/ is not overwritten");
        let kept = data.sandbox_state_dir("sbx_00000000000000000001");
        assert_eq!(read(kept.join("commands/cmd_1/transcript")), "out");
        assert_eq!(read(kept.join("checkpoints/before.json")), "{}");
        assert!(!root.join("space.db").exists() && !transcript.exists() && !meta.exists());
        assert!(sandbox.join("checkpoints").join("before").is_dir(), "the image stays where the engine put it");
        assert_eq!(fs::metadata(data.state_dir()).unwrap().permissions().mode() & 0o777, 0o700);
        // Opened again, nothing moves and nothing fails.
        DataDir::open_on_any_filesystem(&root).unwrap();
        assert_eq!(read(data.db_path()), "db");
        fs::remove_dir_all(&root).unwrap();
    }

    const MOUNTINFO: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /var/lib rw shared:9 - tmpfs tmpfs rw
41 30 7:0 / /var/lib/space rw,relatime shared:20 - btrfs /dev/loop0 rw,discard=async
42 30 7:1 / /var/lib/space\\040two rw,relatime shared:21 - btrfs /dev/loop1 rw
43 41 0:27 / /var/lib/space/sandboxes/a/rootfs/proc rw - proc proc rw
";

    #[test]
    fn the_mount_of_a_path_is_the_longest_mount_point_holding_it() {
        let of =
            |p: &str| mount_of(MOUNTINFO, Path::new(p)).map(|(point, source)| (point.display().to_string(), source));
        assert_eq!(of("/var/lib/space/templates"), Some(("/var/lib/space".into(), "/dev/loop0".into())));
        assert_eq!(of("/var/lib/space"), Some(("/var/lib/space".into(), "/dev/loop0".into())));
        assert_eq!(of("/var/lib/space two/x"), Some(("/var/lib/space two".into(), "/dev/loop1".into())));
        // A path component that merely starts like a mount point is not under it.
        assert_eq!(of("/var/lib/spacex"), Some(("/var/lib".into(), "tmpfs".into())));
        assert_eq!(of("/home"), Some(("/".into(), "/dev/vda".into())));
        assert_eq!(mount_of("garbage\n", Path::new("/")), None);
    }

    #[test]
    fn mount_fields_lose_their_octal_escapes_only() {
        assert_eq!(unescape_mount_field("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape_mount_field("end\\04"), "end\\04");
        assert_eq!(unescape_mount_field("\\999"), "\\999");
        assert_eq!(unescape_mount_field("\\777x"), "\\777x");
    }
}
