//! The data directory: where templates, sandboxes and state live.
//!
//! ```text
//! DIR/space.db                      state (SQLite, WAL)
//! DIR/dev-api-key                   the dev-mode key (0600)
//! DIR/templates/NAME/VERSION/       rootfs/ (read-only subvolume), template.json,
//!                                   rootfs.ext4 (Firecracker's root drive, when built)
//! DIR/sandboxes/ID/                 rootfs/ (snapshot), bundle/, sock/, commands/
//! DIR/run/                          engine state
//! ```
//!
//! It must be on btrfs; when it is not, [`ensure_btrfs`] puts a loop-mounted
//! btrfs image there.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::btrfs::is_btrfs;
use crate::template::TemplateInfo;
use crate::{run, HostError};

/// The name of the loop image inside a data dir that is not on btrfs.
pub const LOOP_IMAGE: &str = ".space-btrfs.img";

#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
    ext4_images: bool,
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
        let dir = DataDir { root, ext4_images: crate::hardware_virtualization() };
        for sub in [dir.templates_dir(), dir.sandboxes_dir(), dir.run_dir()] {
            fs::create_dir_all(&sub).map_err(HostError::io(format!("creating {}", sub.display())))?;
        }
        Ok(dir)
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
    pub fn db_path(&self) -> PathBuf {
        self.root.join("space.db")
    }
    pub fn dev_key_path(&self) -> PathBuf {
        self.root.join("dev-api-key")
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
        self.root.join("logs").join(format!("{operation_id}.log"))
    }

    /// The newest complete version of template `name`, if any.
    pub fn template(&self, name: &str) -> Option<TemplateInfo> {
        if !crate::template::valid_name(name) {
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

    /// Free and total bytes of the filesystem holding the data dir.
    pub fn disk_space(&self) -> (u64, u64) {
        match nix::sys::statvfs::statvfs(&self.root) {
            Ok(s) => (s.blocks_available() * s.fragment_size(), s.blocks() * s.fragment_size()),
            Err(_) => (0, 0),
        }
    }
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
