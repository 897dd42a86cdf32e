//! Templates: a read-only root filesystem plus runtime defaults.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use space_process::Reaper;

use crate::datadir::DataDir;
use crate::{btrfs, packages, HostError};

/// Where the agent sits inside every template root.
pub const AGENT_PATH_IN_ROOT: &str = ".space/space-agent";
/// The directory inside the root where the host's socket directory is mounted.
pub const HOST_DIR_IN_ROOT: &str = ".space/host";
/// The default template and what it holds.
pub const BASE_TEMPLATE: &str = "base";
pub const BASE_PACKAGES: &[&str] = &["python3", "coreutils", "procps", "ca-certificates"];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateDefaults {
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub user: String,
}

impl Default for TemplateDefaults {
    fn default() -> Self {
        TemplateDefaults {
            vcpus: 1,
            memory_mib: 512,
            disk_mib: 2048,
            env: BTreeMap::new(),
            workdir: "/root".into(),
            user: "root".into(),
        }
    }
}

/// `template.json`, written last: its presence marks a complete build.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateMeta {
    pub name: String,
    pub version: u32,
    pub created_at: String,
    pub source: serde_json::Value,
    pub defaults: TemplateDefaults,
    /// Warm sandboxes to keep for this template; the server's setting when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct TemplateInfo {
    pub meta: TemplateMeta,
    pub dir: PathBuf,
}

impl TemplateInfo {
    pub fn load(dir: &Path) -> Result<TemplateInfo, HostError> {
        let path = dir.join("template.json");
        let text = fs::read_to_string(&path).map_err(HostError::io(format!("reading {}", path.display())))?;
        let meta = serde_json::from_str(&text).map_err(|e| HostError::Invalid(format!("{}: {e}", path.display())))?;
        Ok(TemplateInfo { meta, dir: dir.to_path_buf() })
    }

    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
}

/// Template names: short, lowercase, safe as a path component.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

/// A step of a build, for progress display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildProgress {
    pub step: String,
    pub done: u64,
    pub total: u64,
}

/// Builds template `name` from Debian `suite` with `packages`, as the next
/// version. Nothing is visible until the build is complete.
/// What to build a Debian template from.
#[derive(Debug, Clone)]
pub struct DebianBuild {
    pub name: String,
    pub suite: String,
    pub packages: Vec<String>,
    pub defaults: TemplateDefaults,
    /// Where the build log goes (it outlives a failed build).
    pub log: PathBuf,
    /// Downloaded packages kept between builds, so the next build reuses them.
    pub apt_cache: Option<PathBuf>,
}

pub fn build_debian(
    data: &DataDir,
    build: &DebianBuild,
    agent_bin: &Path,
    mut progress: impl FnMut(BuildProgress),
) -> Result<TemplateInfo, HostError> {
    let packages: Vec<&str> = build.packages.iter().map(String::as_str).collect();
    let source = serde_json::json!({"debian": {"suite": build.suite, "packages": packages}});
    publish(data, &build.name, source, &build.defaults, &mut progress, |partial, progress| {
        build_into(partial, &build.suite, &packages, agent_bin, &build.log, build.apt_cache.as_deref(), progress)
    })
}

/// Makes a template of a directory on the host (for local admins): its
/// content is copied (modes, owners, links kept) into a new version.
pub fn import_dir(
    data: &DataDir,
    name: &str,
    source_dir: &Path,
    defaults: &TemplateDefaults,
    agent_bin: &Path,
    mut progress: impl FnMut(BuildProgress),
) -> Result<TemplateInfo, HostError> {
    if !source_dir.is_dir() {
        return Err(HostError::Invalid(format!("{} is not a directory", source_dir.display())));
    }
    let source = serde_json::json!({"dir": source_dir.display().to_string()});
    publish(data, name, source, defaults, &mut progress, |partial, progress| {
        let rootfs = partial.join("rootfs");
        let step = |step: &str, done| BuildProgress { step: step.into(), done, total: 4 };
        progress(step("creating the root subvolume", 0));
        btrfs::create_subvolume(&rootfs)?;
        progress(step("copying the directory", 1));
        let mut from = source_dir.as_os_str().to_owned();
        from.push("/.");
        crate::run(Command::new("cp").args(["-a", "--reflink=auto"]).arg(from).arg(&rootfs))?;
        progress(step("installing the agent", 2));
        install_agent(&rootfs, agent_bin)?;
        progress(step("sealing the root (read-only)", 3));
        btrfs::set_read_only(&rootfs)
    })
}

/// Builds the next version of template `name` in a hidden directory with
/// `fill`, then publishes it by writing `template.json` and renaming; on
/// failure nothing of it is left.
fn publish(
    data: &DataDir,
    name: &str,
    source: serde_json::Value,
    defaults: &TemplateDefaults,
    progress: &mut dyn FnMut(BuildProgress),
    fill: impl FnOnce(&Path, &mut dyn FnMut(BuildProgress)) -> Result<(), HostError>,
) -> Result<TemplateInfo, HostError> {
    if !valid_name(name) {
        return Err(HostError::Invalid(format!("invalid template name {name:?}")));
    }
    let template_dir = data.templates_dir().join(name);
    fs::create_dir_all(&template_dir).map_err(HostError::io("creating the template dir"))?;
    let version = data.template(name).map(|t| t.meta.version + 1).unwrap_or(1);
    let partial = template_dir.join(format!(".{version}.partial"));
    remove_partial(&partial)?;
    fs::create_dir_all(&partial).map_err(HostError::io("creating the build dir"))?;
    let finish = fill(&partial, progress).and_then(|()| {
        let meta = TemplateMeta {
            name: name.into(),
            version,
            created_at: crate::now_rfc3339(),
            source,
            defaults: defaults.clone(),
            warm_pool: None,
        };
        let json = serde_json::to_vec_pretty(&meta).map_err(|e| HostError::Invalid(e.to_string()))?;
        fs::write(partial.join("template.json"), json).map_err(HostError::io("writing template.json"))?;
        let final_dir = template_dir.join(version.to_string());
        fs::rename(&partial, &final_dir).map_err(HostError::io("publishing the template"))?;
        progress(BuildProgress { step: "done".into(), done: 4, total: 4 });
        TemplateInfo::load(&final_dir)
    });
    if finish.is_err() {
        let _ = remove_partial(&partial);
        // A first version that failed leaves no empty template directory.
        let _ = fs::remove_dir(&template_dir);
    }
    finish
}

fn remove_partial(partial: &Path) -> Result<(), HostError> {
    if partial.exists() {
        btrfs::delete_subvolume(&partial.join("rootfs"))?;
        fs::remove_dir_all(partial).map_err(HostError::io("removing an unfinished build"))?;
    }
    Ok(())
}

fn build_into(
    dir: &Path,
    suite: &str,
    packages: &[&str],
    agent_bin: &Path,
    log_path: &Path,
    apt_cache: Option<&Path>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), HostError> {
    let rootfs = dir.join("rootfs");
    let step = |step: &str, done| BuildProgress { step: step.into(), done, total: 4 };
    progress(step("creating the root subvolume", 0));
    btrfs::create_subvolume(&rootfs)?;

    progress(step("installing Debian packages (mmdebstrap)", 1));
    if let Some(parent) = log_path.parent() {
        fs::create_dir_all(parent).map_err(HostError::io("creating the log dir"))?;
    }
    let mut log = fs::File::create(log_path).map_err(HostError::io("creating the build log"))?;
    let mirror = packages::configured_mirror();
    let mut command = Command::new("mmdebstrap");
    command
        .args(["--variant=minbase", "--mode=root", "--format=directory", "--verbose"])
        .arg(format!("--include={}", packages.join(",")));
    if let Some(cache) = apt_cache {
        // mmdebstrap's documented way to share /var/cache/apt/archives:
        // copy the cache in before, and the (grown) cache out after; the
        // root's own copy is cleaned up as usual.
        fs::create_dir_all(cache).map_err(HostError::io("creating the apt cache"))?;
        let cache = cache.display();
        command
            .arg("--skip=essential/unlink")
            .arg("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/")
            .arg(format!("--setup-hook=sync-in {cache} /var/cache/apt/archives/"))
            .arg(format!("--customize-hook=sync-out /var/cache/apt/archives {cache}"));
    }
    command.arg(suite).arg(&rootfs).arg(&mirror).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = Reaper::global().spawn(&mut command).map_err(HostError::io("starting mmdebstrap"))?;
    let stdout = child.child.stdout.take();
    let copier = std::thread::spawn(move || {
        let mut text = Vec::new();
        if let Some(mut out) = stdout {
            let _ = std::io::Read::read_to_end(&mut out, &mut text);
        }
        text
    });
    let mut tail = Vec::new();
    if let Some(stderr) = child.child.stderr.take() {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(log, "{line}");
            if let Some(what) = line.strip_prefix("I: ") {
                progress(step(&format!("mmdebstrap: {}", what.trim_end_matches("...")), 1));
            }
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
    }
    let _ = log.write_all(&copier.join().unwrap_or_default());
    let status = child.wait();
    if !status.success() {
        return Err(HostError::CommandFailed {
            command: "mmdebstrap".into(),
            status: format!("{status:?}"),
            stderr: tail.join("\n"),
        });
    }

    progress(step("installing the agent", 2));
    install_agent(&rootfs, agent_bin)?;

    progress(step("sealing the root (read-only)", 3));
    btrfs::set_read_only(&rootfs)?;
    Ok(())
}

/// Puts the agent and its mount points into a template root.
pub fn install_agent(rootfs: &Path, agent_bin: &Path) -> Result<(), HostError> {
    use std::os::unix::fs::PermissionsExt;
    let target = rootfs.join(AGENT_PATH_IN_ROOT);
    fs::create_dir_all(rootfs.join(HOST_DIR_IN_ROOT)).map_err(HostError::io("creating /.space in the root"))?;
    fs::copy(agent_bin, &target).map_err(HostError::io(format!("copying the agent from {}", agent_bin.display())))?;
    fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).map_err(HostError::io("chmod of the agent"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_are_path_safe() {
        assert!(valid_name("base"));
        assert!(valid_name("py-data_2"));
        for bad in ["", "..", "a/b", "Base", "-x", &"x".repeat(64)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
