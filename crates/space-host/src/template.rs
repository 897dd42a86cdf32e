//! Templates: a read-only root filesystem plus runtime defaults.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use space_process::Reaper;

use crate::datadir::DataDir;
use crate::layer::apply_tar;
pub use crate::template_meta::{valid_name, TemplateDefaults, TemplateImage, TemplateInfo, TemplateMeta};
use crate::{btrfs, packages, HostError};

/// Where the agent sits inside every template root.
pub const AGENT_PATH_IN_ROOT: &str = ".space/space-agent";
/// The directory inside the root where the host's socket directory is mounted.
pub const HOST_DIR_IN_ROOT: &str = ".space/host";
/// Firecracker's root drive inside a template version's directory.
pub const EXT4_IMAGE: &str = "rootfs.ext4";
/// The default template and what it holds: Python, and what E2B's base
/// has that code written for it expects (`sudo`, `curl`, `python` on PATH).
pub const BASE_TEMPLATE: &str = "base";
pub const BASE_PACKAGES: &[&str] =
    &["python3", "python-is-python3", "coreutils", "procps", "ca-certificates", "curl", "sudo"];

/// The unprivileged account every Debian template has (E2B's default user):
/// uid 1000, home `/home/user`, in group `sudo` (the sandbox's `sudo`, the
/// agent's, lets that group run anything: decision 034), and passwordless
/// in sudoers where the template has sudo. SPACE's own API runs as the template's user (root) unless a
/// request names another.
pub const DEFAULT_ACCOUNT: &str = "user";

/// mmdebstrap hooks that add [`DEFAULT_ACCOUNT`] to a fresh root.
fn account_hooks() -> [String; 2] {
    [
        format!("--customize-hook=chroot \"$1\" useradd --create-home --user-group --groups sudo --shell /bin/bash --uid 1000 {DEFAULT_ACCOUNT}"),
        format!(
            "--customize-hook=if [ -d \"$1/etc/sudoers.d\" ]; then echo '{DEFAULT_ACCOUNT} ALL=(ALL:ALL) NOPASSWD: ALL' \
             > \"$1/etc/sudoers.d/{DEFAULT_ACCOUNT}\" && chmod 0440 \"$1/etc/sudoers.d/{DEFAULT_ACCOUNT}\"; fi"
        ),
    ]
}
/// The developer's toolbox, built on request (`space setup --with-template
/// polyglot`; the test command builds it): a JDK, Go, Node, a C toolchain,
/// git and Python.
pub const POLYGLOT_TEMPLATE: &str = "polyglot";
pub const POLYGLOT_PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "python3-venv",
    "curl",
    "coreutils",
    "procps",
    "ca-certificates",
    "default-jdk-headless",
    "golang-go",
    "nodejs",
    "gcc",
    "libc6-dev",
    "make",
    "git",
];

/// Code contexts' template: Python with a Jupyter kernel and the usual
/// data stack (charts come back as images and as data), and Node.js with
/// TypeScript's compiler (TypeScript cells).
pub const CODE_INTERPRETER_TEMPLATE: &str = "code-interpreter";
pub const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3",
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "nodejs",
    "node-typescript",
    "coreutils",
    "procps",
    "ca-certificates",
];

/// The Debian packages of a template `space setup` knows how to build.
pub fn known_packages(name: &str) -> Option<&'static [&'static str]> {
    match name {
        BASE_TEMPLATE => Some(BASE_PACKAGES),
        POLYGLOT_TEMPLATE => Some(POLYGLOT_PACKAGES),
        CODE_INTERPRETER_TEMPLATE => Some(CODE_INTERPRETER_PACKAGES),
        _ => None,
    }
}

/// Build steps every source goes through (reading, root, content, agent).
pub const BUILD_STEPS: u64 = 4;

/// A step of a build, for progress display, with how much of the step's
/// work (bytes, packages) is done when that is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildProgress {
    pub step: String,
    pub done: u64,
    pub total: u64,
    pub amount: Option<Amount>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Amount {
    /// `bytes` or `packages`.
    pub unit: &'static str,
    pub done: u64,
    pub total: u64,
}

impl BuildProgress {
    pub fn step(step: &str, done: u64) -> BuildProgress {
        BuildProgress { step: step.into(), done, total: BUILD_STEPS, amount: None }
    }

    pub fn bytes(step: &str, done: u64, bytes_done: u64, bytes_total: u64) -> BuildProgress {
        let amount = Amount { unit: "bytes", done: bytes_done.min(bytes_total), total: bytes_total };
        BuildProgress { amount: Some(amount), ..BuildProgress::step(step, done) }
    }
}

/// Defaults given with a build request; unset values come from the image
/// (for OCI imports) or the platform.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultsOverride {
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u32>,
    pub disk_mib: Option<u32>,
    /// Added to (and overriding) the image's variables.
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub network: Option<serde_json::Value>,
    #[serde(default)]
    pub command: Option<Vec<String>>,
}

impl DefaultsOverride {
    /// `self` over `under`: set values win, env maps merge.
    pub fn over(&self, under: DefaultsOverride) -> DefaultsOverride {
        let mut env = under.env;
        env.extend(self.env.clone());
        DefaultsOverride {
            vcpus: self.vcpus.or(under.vcpus),
            memory_mib: self.memory_mib.or(under.memory_mib),
            disk_mib: self.disk_mib.or(under.disk_mib),
            env,
            workdir: self.workdir.clone().or(under.workdir),
            user: self.user.clone().or(under.user),
            network: self.network.clone().or(under.network),
            command: self.command.clone().or(under.command),
        }
    }

    /// `self` over `image` over the platform's defaults.
    pub fn apply(&self, image: DefaultsOverride) -> TemplateDefaults {
        let merged = self.over(image);
        let base = TemplateDefaults::default();
        TemplateDefaults {
            vcpus: merged.vcpus.unwrap_or(base.vcpus),
            memory_mib: merged.memory_mib.unwrap_or(base.memory_mib),
            disk_mib: merged.disk_mib.unwrap_or(base.disk_mib),
            env: merged.env,
            workdir: merged.workdir.unwrap_or(base.workdir),
            user: merged.user.unwrap_or(base.user),
            network: merged.network,
            command: merged.command,
        }
    }
}

/// What to build a Debian template from.
#[derive(Debug, Clone)]
pub struct DebianBuild {
    pub name: String,
    pub suite: String,
    pub packages: Vec<String>,
    pub defaults: TemplateDefaults,
    /// The tenant it is built for; `None`: shared.
    pub owner: Option<String>,
    /// The engine its sandboxes run on; `None`: the server's default.
    pub engine: Option<String>,
    /// Where the build log goes (it outlives a failed build).
    pub log: PathBuf,
    /// Downloaded packages kept between builds, so the next build reuses them.
    pub apt_cache: Option<PathBuf>,
    /// The most the new root may hold (the owner's disk quota left, or the
    /// host's free space above its reserve); `None`: no cap.
    pub max_bytes: Option<u64>,
}

/// Builds template `name` from Debian `suite` with `packages`, as the next
/// version. Nothing is visible until the build is complete.
pub fn build_debian(
    data: &DataDir,
    build: &DebianBuild,
    agent_bin: &Path,
    mut progress: impl FnMut(BuildProgress),
) -> Result<TemplateInfo, HostError> {
    let packages: Vec<&str> = build.packages.iter().map(String::as_str).collect();
    let source = serde_json::json!({"debian": {"suite": build.suite, "packages": packages}});
    let labels = (build.owner.clone(), build.engine.clone());
    let log = open_log(&build.log)?;
    publish(data, &build.name, labels, build.max_bytes, &mut progress, |partial, progress| {
        fill_debian(partial, &build.suite, &packages, agent_bin, &log, build.apt_cache.as_deref(), progress)?;
        Ok((source, build.defaults.clone()))
    })
}

fn open_log(path: &Path) -> Result<fs::File, HostError> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(HostError::io("creating the log dir"))?;
    }
    fs::File::create(path).map_err(HostError::io("creating the build log"))
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
    publish(data, name, (None, None), None, &mut progress, |partial, progress| {
        let rootfs = partial.join("rootfs");
        let step = BuildProgress::step;
        progress(step("copying the directory", 1));
        let mut from = source_dir.as_os_str().to_owned();
        from.push("/.");
        crate::run(Command::new("cp").args(["-a", "--reflink=auto"]).arg(from).arg(&rootfs))?;
        progress(step("installing the agent", 2));
        install_agent(&rootfs, agent_bin)?;
        progress(step("sealing the root (read-only)", 3));
        btrfs::set_read_only(&rootfs)?;
        Ok((source, defaults.clone()))
    })
}

/// What a build made: its source description and the template's defaults.
pub(crate) type Built = (serde_json::Value, TemplateDefaults);

/// Builds the next version of template `name` in a hidden directory with
/// `fill`, then publishes it by writing `template.json` and renaming; on
/// failure nothing of it is left. `fill` finds the root subvolume made at
/// `rootfs/`, capped at `max_bytes` when given (a write past it fails with
/// EDQUOT, and so does the build).
pub(crate) fn publish(
    data: &DataDir,
    name: &str,
    (owner, engine): (Option<String>, Option<String>),
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
    fill: impl FnOnce(&Path, &mut dyn FnMut(BuildProgress)) -> Result<Built, HostError>,
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
    let finish = create_root(&partial.join("rootfs"), max_bytes, progress)
        .and_then(|()| fill(&partial, progress))
        .and_then(|(source, defaults)| {
            if data.ext4_images() {
                progress(BuildProgress::step("making the ext4 root drive", BUILD_STEPS - 1));
                make_ext4(&partial.join("rootfs"), &partial.join(EXT4_IMAGE), defaults.disk_mib)?;
            }
            let meta = TemplateMeta {
                version,
                created_at: crate::now_rfc3339(),
                ..TemplateMeta::unpublished(name, source, defaults, owner, engine)
            };
            seal(&partial, &meta, progress)
        });
    if finish.is_err() {
        let _ = remove_partial(&partial);
        // A first version that failed leaves no empty template directory.
        let _ = fs::remove_dir(&template_dir);
    }
    finish
}

/// Writes `template.json` into a finished build and publishes it under
/// its version.
fn seal(
    partial: &Path,
    meta: &TemplateMeta,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<TemplateInfo, HostError> {
    let json = serde_json::to_vec_pretty(meta).map_err(|e| HostError::Invalid(e.to_string()))?;
    fs::write(partial.join("template.json"), json).map_err(HostError::io("writing template.json"))?;
    let final_dir = partial.with_file_name(meta.version.to_string());
    fs::rename(partial, &final_dir).map_err(HostError::io("publishing the template"))?;
    progress(BuildProgress::step("done", BUILD_STEPS));
    TemplateInfo::load(&final_dir)
}

fn create_root(
    rootfs: &Path,
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), HostError> {
    progress(BuildProgress::step("creating the root subvolume", 0));
    btrfs::create_subvolume(rootfs)?;
    match max_bytes {
        Some(bytes) => btrfs::limit_exclusive_bytes(rootfs, bytes),
        None => Ok(()),
    }
}

fn remove_partial(partial: &Path) -> Result<(), HostError> {
    if partial.exists() {
        btrfs::delete_subvolume(&partial.join("rootfs"))?;
        fs::remove_dir_all(partial).map_err(HostError::io("removing an unfinished build"))?;
    }
    Ok(())
}

/// Fills a build dir's root subvolume (`dir/rootfs`, made and capped by
/// the caller) with Debian `suite` and `packages` (mmdebstrap), installs
/// the agent and seals the root read-only; mmdebstrap's output goes to
/// `log`, which whoever owns the log dir opened.
pub fn fill_debian(
    dir: &Path,
    suite: &str,
    packages: &[&str],
    agent_bin: &Path,
    log: &fs::File,
    apt_cache: Option<&Path>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), HostError> {
    let rootfs = dir.join("rootfs");
    let step = BuildProgress::step;
    progress(step("installing Debian packages (mmdebstrap)", 1));
    let mut log = log;
    let mirror = packages::configured_mirror();
    let mut command = Command::new("mmdebstrap");
    command
        .args(["--variant=minbase", "--mode=root", "--format=directory", "--verbose"])
        .arg(format!("--include={}", packages.join(",")))
        .args(account_hooks());
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
    // Both streams feed one loop: the log keeps everything, progress counts
    // packages apt says it will install and dpkg says it set up.
    let (lines, received) = std::sync::mpsc::channel::<String>();
    let stdout = child.child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    let stderr = child.child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    for stream in [stdout, stderr].into_iter().flatten() {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(lines);
    let mut tail = Vec::new();
    let (mut set_up, mut to_install) = (0u64, 0u64);
    let mut what = "installing Debian packages (mmdebstrap)".to_string();
    for line in received {
        let _ = writeln!(log, "{line}");
        let mut changed = false;
        if let Some(step) = line.strip_prefix("I: ") {
            what = format!("mmdebstrap: {}", step.trim_end_matches("..."));
            changed = true;
        } else if line.starts_with("Setting up ") {
            set_up += 1;
            changed = true;
        } else if let Some(count) = newly_installed(&line) {
            to_install += count;
            changed = true;
        }
        if changed {
            let amount = Amount { unit: "packages", done: set_up.min(to_install), total: to_install.max(set_up) };
            progress(BuildProgress { amount: Some(amount), ..step(&what, 1) });
        }
        tail.push(line);
        if tail.len() > 20 {
            tail.remove(0);
        }
    }
    let status = child.wait();
    if !status.success() {
        return Err(HostError::CommandFailed {
            command: "mmdebstrap".into(),
            status: format!("{status:?}"),
            stderr: tail.join("\n"),
        });
    }

    progress(step("installing the agent", 2));
    write_etc_file(&rootfs, "resolv.conf", TEMPLATE_RESOLV_CONF)?;
    install_agent(&rootfs, agent_bin)?;

    progress(step("sealing the root (read-only)", 3));
    btrfs::set_read_only(&rootfs)?;
    Ok(())
}

/// Writes an ext4 image of `rootfs` (owners, modes, links kept; no mount
/// needed), sized from the content plus `disk_mib` of room for the
/// sandbox's own writes. The file is sparse: unused room costs no disk.
pub fn make_ext4(rootfs: &Path, image: &Path, disk_mib: u32) -> Result<u64, HostError> {
    let usage = crate::run(Command::new("du").args(["-s", "--block-size=1"]).arg(rootfs))?;
    let content: u64 = String::from_utf8_lossy(&usage)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| HostError::Invalid("du printed no size".into()))?;
    const MIB: u64 = 1 << 20;
    // Room for ext4's own metadata (inode tables, journal) over the content.
    let size = (content + content / 5 + 64 * MIB + u64::from(disk_mib) * MIB).div_ceil(MIB) * MIB;
    let file = fs::File::create(image).map_err(HostError::io("creating the ext4 image"))?;
    file.set_len(size).map_err(HostError::io("sizing the ext4 image"))?;
    drop(file);
    crate::run(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "space-root", "-E", "root_owner=0:0", "-d"])
            .arg(rootfs)
            .arg(image),
    )?;
    Ok(size)
}

/// Writes a Firecracker volume's empty ext4 image of exactly `size_mib`
/// (decision 031): sparse (unused room costs no disk), its root directory
/// root's with mode 0755 like a gVisor volume's subvolume, no blocks
/// reserved for root (the tenant gets the whole size), and a journal, so a
/// microVM killed mid-write leaves a file system the next mount recovers.
/// The file itself is root's alone (mode 0600).
pub fn make_volume_image(image: &Path, size_mib: u32) -> Result<(), HostError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(image)
        .map_err(HostError::io("creating the volume's image"))?;
    file.set_len(u64::from(size_mib) << 20).map_err(HostError::io("sizing the volume's image"))?;
    drop(file);
    crate::run(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-L", "space-volume", "-E", "root_owner=0:0"])
            .arg(image),
    )?;
    Ok(())
}

/// apt's summary line: "0 upgraded, 37 newly installed, 0 to remove ...".
fn newly_installed(line: &str) -> Option<u64> {
    let (_, rest) = line.split_once(" upgraded, ")?;
    rest.split_once(" newly installed")?.0.trim().parse().ok()
}

/// What a template's root calls itself in `/etc/hostname`: a neutral name,
/// never the build host's (mmdebstrap copies the host's file in; an image
/// may carry its builder's). A sandbox's agent writes the sandbox's own
/// name over it when it starts.
const TEMPLATE_HOSTNAME: &str = "localhost\n";

/// What a Debian template's `/etc/resolv.conf` holds instead of the build
/// host's resolvers (mmdebstrap copies the host's file in): a sandbox has
/// no network device, and names travel in the egress proxy's requests.
const TEMPLATE_RESOLV_CONF: &str = "# No resolver: names travel in the egress proxy's requests (HTTP_PROXY).\n";

/// Writes [`TEMPLATE_HOSTNAME`] to the root's `/etc/hostname`.
fn write_neutral_hostname(rootfs: &Path) -> Result<(), HostError> {
    write_etc_file(rootfs, "hostname", TEMPLATE_HOSTNAME)
}

/// Writes `content` to the root's `/etc/NAME`, replacing whatever stood
/// there (a link is removed, never followed). A root whose `/etc` is not a
/// real directory (an image may make it a link) is left alone.
fn write_etc_file(rootfs: &Path, name: &str, content: &str) -> Result<(), HostError> {
    use std::os::unix::fs::OpenOptionsExt;
    let etc = rootfs.join("etc");
    if !fs::symlink_metadata(&etc).is_ok_and(|meta| meta.is_dir()) {
        return Ok(());
    }
    let file = etc.join(name);
    match fs::symlink_metadata(&file) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(&file),
        Ok(_) => fs::remove_file(&file),
        Err(_) => Ok(()),
    }
    .map_err(HostError::io(format!("clearing /etc/{name} in the root")))?;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&file)
        .and_then(|mut out| out.write_all(content.as_bytes()))
        .map_err(HostError::io(format!("writing /etc/{name} in the root")))
}

/// Puts the agent and its mount points into a template root, and a neutral
/// `/etc/hostname`. Whatever the root had at `/.space` (an image may put a
/// symlink there) is replaced first, so nothing here ever follows a link
/// out of the root.
pub fn install_agent(rootfs: &Path, agent_bin: &Path) -> Result<(), HostError> {
    use std::os::unix::fs::PermissionsExt;
    let space_dir = rootfs.join(".space");
    match fs::symlink_metadata(&space_dir) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(&space_dir),
        Ok(_) => fs::remove_file(&space_dir),
        Err(_) => Ok(()),
    }
    .map_err(HostError::io("clearing /.space in the root"))?;
    fs::create_dir(&space_dir).map_err(HostError::io("creating /.space in the root"))?;
    // Mount points the engine needs, for minimal images that lack them.
    for dir in ["proc", "dev", "sys", "tmp"] {
        let path = rootfs.join(dir);
        if fs::symlink_metadata(&path).is_err() {
            fs::create_dir(&path).map_err(HostError::io(format!("creating /{dir} in the root")))?;
            let mode = if dir == "tmp" { 0o1777 } else { 0o755 };
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).map_err(HostError::io("chmod"))?;
        }
    }
    let target = rootfs.join(AGENT_PATH_IN_ROOT);
    fs::create_dir_all(rootfs.join(HOST_DIR_IN_ROOT)).map_err(HostError::io("creating /.space in the root"))?;
    fs::copy(agent_bin, &target).map_err(HostError::io(format!("copying the agent from {}", agent_bin.display())))?;
    fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).map_err(HostError::io("chmod of the agent"))?;
    write_neutral_hostname(rootfs)
}

/// Writes the root of a template version (`rootfs`) as a tar into `out`,
/// for another host of a cluster: links stored as links, never followed.
pub fn write_root_tar(rootfs: &Path, out: fs::File) -> Result<(), HostError> {
    let mut builder = tar::Builder::new(std::io::BufWriter::new(out));
    builder.follow_symlinks(false);
    builder.append_dir_all(".", rootfs).map_err(HostError::io("writing an export"))?;
    builder
        .into_inner()
        .and_then(|w| w.into_inner().map_err(|e| e.into_error()))
        .and_then(|file| file.sync_all())
        .map_err(HostError::io("writing an export"))
}

/// Applies another host's export of a template root (a plain tar, as
/// [`write_root_tar`] writes it) to `rootfs`: the importer child's work
/// for a template pulled from another node of a cluster. Steps go to
/// `progress`, what went wrong to `log`.
pub fn extract_root_tar(
    rootfs: &Path,
    archive: &fs::File,
    log: &fs::File,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), HostError> {
    progress(BuildProgress::step("applying the pulled root", 2));
    let mut log = log;
    let mut entries = 0u64;
    let applied =
        apply_tar(rootfs, std::io::BufReader::with_capacity(1 << 20, archive), &mut log, &mut || entries += 1);
    if let Err(err) = &applied {
        let _ = writeln!(log, "import failed: {err}");
    }
    applied.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apt_summaries_give_package_counts() {
        assert_eq!(newly_installed("0 upgraded, 37 newly installed, 0 to remove and 0 not upgraded."), Some(37));
        assert_eq!(newly_installed("Setting up jq (1.6-2.1) ..."), None);
    }

    #[test]
    fn request_defaults_win_over_the_image() {
        let image = DefaultsOverride {
            env: [("PATH".to_string(), "/bin".to_string()), ("A".into(), "image".into())].into(),
            workdir: Some("/srv".into()),
            user: Some("1000".into()),
            ..Default::default()
        };
        let request = DefaultsOverride {
            env: [("A".to_string(), "request".to_string())].into(),
            memory_mib: Some(1024),
            user: Some("root".into()),
            ..Default::default()
        };
        let merged = request.apply(image);
        assert_eq!(merged.env["PATH"], "/bin");
        assert_eq!(merged.env["A"], "request");
        assert_eq!((merged.workdir.as_str(), merged.user.as_str(), merged.memory_mib), ("/srv", "root", 1024));
        assert_eq!(merged.vcpus, TemplateDefaults::default().vcpus);
    }

    #[test]
    fn a_root_names_itself_neutrally_and_no_link_is_followed() {
        let scratch = std::env::temp_dir().join(format!("space-hostname-{}", std::process::id()));
        let _ = fs::remove_dir_all(&scratch);
        let (root, outside) = (scratch.join("root"), scratch.join("outside"));
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        // The build host's name, as mmdebstrap leaves it.
        fs::write(root.join("etc/hostname"), "build-host\n").unwrap();
        write_neutral_hostname(&root).unwrap();
        assert_eq!(fs::read_to_string(root.join("etc/hostname")).unwrap(), TEMPLATE_HOSTNAME);
        // A link to a host file: replaced, its target untouched.
        fs::write(outside.join("hostname"), "host file").unwrap();
        fs::remove_file(root.join("etc/hostname")).unwrap();
        std::os::unix::fs::symlink(outside.join("hostname"), root.join("etc/hostname")).unwrap();
        write_neutral_hostname(&root).unwrap();
        assert!(!fs::symlink_metadata(root.join("etc/hostname")).unwrap().file_type().is_symlink());
        assert_eq!(fs::read_to_string(outside.join("hostname")).unwrap(), "host file");
        // An /etc that is a link to a host directory: left alone.
        fs::remove_dir_all(root.join("etc")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("etc")).unwrap();
        write_neutral_hostname(&root).unwrap();
        assert_eq!(fs::read_to_string(outside.join("hostname")).unwrap(), "host file");
        // The build host's resolvers, as mmdebstrap leaves them.
        fs::remove_file(root.join("etc")).unwrap();
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/resolv.conf"), "nameserver 192.0.2.53\n").unwrap();
        write_etc_file(&root, "resolv.conf", TEMPLATE_RESOLV_CONF).unwrap();
        assert!(!fs::read_to_string(root.join("etc/resolv.conf")).unwrap().contains("nameserver"));
        fs::remove_dir_all(&scratch).unwrap();
    }
}
