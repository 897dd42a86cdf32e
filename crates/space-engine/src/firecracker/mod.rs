//! Firecracker: microVMs on hosts with hardware virtualization. This part
//! is the VMM side: finding the binaries, telling whether this host can run
//! them (and why not), starting a `firecracker` process — directly or under
//! the `jailer` — and driving it through its API socket.

pub mod api;
mod engine;

pub use self::engine::{Firecracker, FirecrackerConfig, BOOT_PATIENCE, JAIL_UID};

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use space_process::{ReapedChild, Reaper};

pub use self::api::Api;
use crate::{Availability, EngineError};

/// How long a new VMM may take to answer on its API socket.
const API_PATIENCE: Duration = Duration::from_secs(5);

/// `firecracker`: the configured path, else `FIRECRACKER_BIN`, else `PATH`.
pub fn find_firecracker(configured: Option<&Path>) -> Option<PathBuf> {
    find("firecracker", configured, "FIRECRACKER_BIN")
}

/// `jailer`: the configured path, else `FIRECRACKER_JAILER_BIN`, else next
/// to the firecracker binary, else `PATH`.
pub fn find_jailer(configured: Option<&Path>, firecracker: Option<&Path>) -> Option<PathBuf> {
    find("jailer", configured, "FIRECRACKER_JAILER_BIN")
        .or_else(|| firecracker.and_then(Path::parent).map(|d| d.join("jailer")).filter(|p| p.is_file()))
}

fn find(name: &str, configured: Option<&Path>, env: &str) -> Option<PathBuf> {
    if let Some(path) = configured {
        return path.is_file().then(|| path.to_path_buf());
    }
    if let Some(path) = std::env::var_os(env).map(PathBuf::from) {
        return path.is_file().then_some(path);
    }
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join(name)).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.is_file())
}

/// Whether microVMs started with `binary` run jailed, and how: for
/// `space doctor`.
pub fn jail_report(binary: &Path) -> (bool, String) {
    let Some(jailer) = find_jailer(None, Some(binary)) else {
        return (
            false,
            "no jailer beside firecracker (or FIRECRACKER_JAILER_BIN): microVMs would run unjailed, as root".into(),
        );
    };
    let linking = match shared_libraries(binary) {
        Ok(libraries) if libraries.is_empty() => "firecracker is statically linked".to_string(),
        Ok(libraries) => {
            format!("firecracker is dynamically linked: its {} libraries are linked into each jail", libraries.len())
        }
        Err(err) => format!("firecracker's libraries: {err}"),
    };
    let detail = format!(
        "{}: each microVM chrooted, in its own PID namespace and cgroup, as a uid of its own; {linking}",
        jailer.display()
    );
    (true, detail)
}

/// Whether this host can run Firecracker microVMs, and exactly why not
/// (every reason that applies, hardware first). `guest` is the kernel and
/// initramfs a sandbox boots.
pub fn availability(firecracker: Option<&Path>, guest: Option<(&Path, &Path)>) -> Availability {
    let mut reasons = Vec::new();
    if !Path::new("/dev/kvm").exists() {
        reasons.push("/dev/kvm is missing: the host has no KVM (load kvm_intel or kvm_amd)".to_string());
    } else if let Err(err) = fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        reasons.push(format!("/dev/kvm is not accessible ({err}): run as root or join the kvm group"));
    }
    if !space_host::hardware_virtualization() {
        reasons.push(if Path::new("/sys/module/kvm_pvm").exists() {
            "/dev/kvm is provided by kvm_pvm and the CPU has no vmx/svm: it cannot boot a stock guest kernel \
             (use gVisor here, or a host with hardware virtualization)"
                .to_string()
        } else {
            "the CPU shows no vmx/svm (hardware virtualization is off or not passed through)".to_string()
        });
    }
    let binary = find_firecracker(firecracker);
    if binary.is_none() {
        reasons.push("no firecracker binary: set FIRECRACKER_BIN or pass --firecracker-bin".to_string());
    }
    match guest {
        Some((kernel, initrd)) if !kernel.is_file() || !initrd.is_file() => {
            reasons.push("the guest kernel and initramfs are missing: run `space setup`".to_string());
        }
        None => reasons.push("the guest kernel and initramfs are missing: run `space setup`".to_string()),
        _ => {}
    }
    match (reasons.is_empty(), binary) {
        (true, Some(binary)) => Availability {
            name: "firecracker",
            available: true,
            detail: format!("firecracker at {}", binary.display()),
        },
        _ => Availability { name: "firecracker", available: false, detail: reasons.join("; ") },
    }
}

/// A running `firecracker` process and its API.
pub struct Vmm {
    child: Option<ReapedChild>,
    /// The VMM's own pid (under the jailer with a new PID namespace it is
    /// not the process we spawned).
    pid: i32,
    pub api: Api,
    /// From spawning the process to its API answering.
    pub ready_after: Duration,
    /// What to remove when it is gone (its directory, jailer cgroups).
    leftovers: Vec<PathBuf>,
}

impl Vmm {
    /// Starts `firecracker --api-sock DIR/api.sock --id ID` in `DIR` and
    /// waits until its API answers. Its log goes to `DIR/firecracker.log`.
    pub async fn spawn(binary: &Path, dir: &Path, id: &str) -> Result<Vmm, EngineError> {
        fs::create_dir_all(dir).map_err(EngineError::io("creating the VMM dir"))?;
        let socket = dir.join("api.sock");
        let _ = fs::remove_file(&socket);
        let log = fs::File::create(dir.join("firecracker.log")).map_err(EngineError::io("creating the VMM log"))?;
        let err = log.try_clone().map_err(EngineError::io("the VMM log"))?;
        let mut command = Command::new(binary);
        // Its working directory is `dir`: the paths it is given for its own
        // files are relative to it.
        command
            .current_dir(dir)
            .args(["--api-sock", "api.sock"])
            .args(["--id", id])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        let started = Instant::now();
        let child = Reaper::global().spawn(&mut command).map_err(EngineError::io("starting firecracker"))?;
        let pid = child.id() as i32;
        let mut vmm =
            Vmm { child: Some(child), pid, api: Api::new(&socket), ready_after: Duration::ZERO, leftovers: vec![] };
        vmm.ready_after = vmm.wait_for_api(started).await?;
        Ok(vmm)
    }

    /// The directory the jailer makes the VMM's root: files the VMM needs
    /// go there (owned by its uid) before [`Vmm::spawn_jailed`].
    pub fn jail_root(binary: &Path, chroot_base: &Path, id: &str) -> PathBuf {
        chroot_base.join(exec_name(binary)).join(id).join("root")
    }

    /// Starts firecracker under the jailer: its own uid/gid, a chroot under
    /// `chroot_base`, cgroups and a new PID namespace. The jailer copies the
    /// binary into the chroot; the libraries a dynamically linked build
    /// loads are put there first. Files already placed in
    /// [`Vmm::jail_root`] stay.
    pub async fn spawn_jailed(
        jailer: &Path,
        binary: &Path,
        chroot_base: &Path,
        id: &str,
        uid: u32,
        gid: u32,
    ) -> Result<Vmm, EngineError> {
        let exec_name = exec_name(binary);
        let jail = chroot_base.join(&exec_name).join(id);
        let root = jail.join("root");
        let _ = fs::remove_file(root.join(&exec_name));
        let _ = fs::remove_file(root.join(format!("{exec_name}.pid")));
        fs::create_dir_all(chroot_base).map_err(EngineError::io("creating the chroot base"))?;
        provide_libraries(binary, chroot_base, &root)?;
        let mut command = Command::new(jailer);
        command
            .args(["--id", id])
            .arg("--exec-file")
            .arg(binary)
            .args(["--uid", &uid.to_string(), "--gid", &gid.to_string()])
            .arg("--chroot-base-dir")
            .arg(chroot_base)
            .args(["--cgroup-version", if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() { "2" } else { "1" }])
            .arg("--new-pid-ns")
            .args(["--", "--api-sock", "/api.sock"]);
        // The VMM inherits the jailer's output: a file, not a pipe we would
        // wait on.
        let log_path = chroot_base.join(format!("{id}.jailer.log"));
        let log = fs::File::create(&log_path).map_err(EngineError::io("creating the jailer log"))?;
        let err = log.try_clone().map_err(EngineError::io("the jailer log"))?;
        command.stdin(Stdio::null()).stdout(log).stderr(err);
        let started = Instant::now();
        // With a new PID namespace the jailer forks the VMM, records its pid
        // and exits; the VMM is then our child by the subreaper rule.
        let jailer_process = Reaper::global().spawn(&mut command).map_err(EngineError::io("starting the jailer"))?;
        let status = jailer_process.wait_timeout(API_PATIENCE);
        if status.is_none_or(|s| !s.success()) {
            let said = fs::read_to_string(&log_path).unwrap_or_default();
            return Err(EngineError::Runtime(format!("the jailer failed ({status:?}): {}", said.trim())));
        }
        let pid_file = root.join(format!("{exec_name}.pid"));
        let pid = wait_for(|| fs::read_to_string(&pid_file).ok().and_then(|p| p.trim().parse::<i32>().ok()))
            .await
            .ok_or_else(|| EngineError::Runtime("the jailer wrote no pid file".into()))?;
        let mut leftovers = vec![jail.clone(), log_path];
        for cgroup_root in [
            "/sys/fs/cgroup",
            "/sys/fs/cgroup/cpu",
            "/sys/fs/cgroup/cpuset",
            "/sys/fs/cgroup/pids",
            "/sys/fs/cgroup/memory",
        ] {
            leftovers.push(Path::new(cgroup_root).join(&exec_name).join(id));
        }
        let mut vmm =
            Vmm { child: None, pid, api: Api::new(&root.join("api.sock")), ready_after: Duration::ZERO, leftovers };
        vmm.ready_after = vmm.wait_for_api(started).await?;
        Ok(vmm)
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    async fn wait_for_api(&mut self, started: Instant) -> Result<Duration, EngineError> {
        while started.elapsed() < API_PATIENCE {
            if self.api.instance_info().await.is_ok() {
                return Ok(started.elapsed());
            }
            if let Some(child) = &self.child {
                if let Some(status) = child.wait_timeout(Duration::ZERO) {
                    return Err(EngineError::Runtime(format!("firecracker exited at start ({status:?})")));
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.kill();
        Err(EngineError::Runtime(format!("firecracker's API did not answer within {API_PATIENCE:?}")))
    }

    /// Stops the VMM and removes its socket, jail and cgroups.
    pub fn kill(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), nix::sys::signal::Signal::SIGKILL);
        if let Some(child) = self.child.take() {
            let _ = child.wait_timeout(Duration::from_secs(5));
        } else {
            // Reaped by the subreaper; wait until it is gone.
            let deadline = Instant::now() + Duration::from_secs(5);
            while Path::new(&format!("/proc/{}", self.pid)).exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = fs::remove_file(self.api.socket());
        for path in self.leftovers.drain(..) {
            if path.starts_with("/sys/fs/cgroup") {
                let _ = fs::remove_dir(&path);
            } else {
                let _ = fs::remove_dir_all(&path);
            }
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Calls `f` (a bind or a connect) with a name for the socket `path` that
/// fits a socket address (108 bytes): the path itself when it is short
/// enough, else the socket's name under `/proc/self/fd/N` of its directory
/// opened for the call. Deep data dirs and jails make long paths.
pub(crate) fn at_socket<T>(path: &Path, f: impl FnOnce(&Path) -> std::io::Result<T>) -> std::io::Result<T> {
    const ROOM: usize = 100;
    if path.as_os_str().len() < ROOM {
        return f(path);
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return f(path) };
    let dir = fs::File::open(dir)?;
    f(&Path::new("/proc/self/fd").join(std::os::fd::AsRawFd::as_raw_fd(&dir).to_string()).join(name))
}

/// The name the jailer gives the binary (and its jails' directory).
pub(crate) fn exec_name(binary: &Path) -> String {
    binary.file_name().and_then(|n| n.to_str()).unwrap_or("firecracker").to_string()
}

/// The shared libraries a dynamically linked binary loads (its loader
/// among them), as `ldd` lists them; none for a static binary. Worked out
/// once per binary (and again when it changes): every jailed start asks.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, EngineError> {
    type Known = std::collections::HashMap<PathBuf, (u64, Option<std::time::SystemTime>, Vec<PathBuf>)>;
    static KNOWN: std::sync::Mutex<Option<Known>> = std::sync::Mutex::new(None);
    let meta = fs::metadata(binary).map_err(EngineError::io(format!("reading {}", binary.display())))?;
    let version = (meta.len(), meta.modified().ok());
    if let Some((len, modified, libraries)) =
        KNOWN.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_default().get(binary)
    {
        if (*len, *modified) == version {
            return Ok(libraries.clone());
        }
    }
    let libraries = list_libraries(binary)?;
    KNOWN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_default()
        .insert(binary.to_path_buf(), (version.0, version.1, libraries.clone()));
    Ok(libraries)
}

fn list_libraries(binary: &Path) -> Result<Vec<PathBuf>, EngineError> {
    if space_host::is_static_elf(binary).map_err(EngineError::io(format!("reading {}", binary.display())))? {
        return Ok(Vec::new());
    }
    let output = Reaper::global().output(Command::new("ldd").arg(binary)).map_err(EngineError::io("running ldd"))?;
    // "libc.so.6 => /lib/.../libc.so.6 (0x...)" and the loader as
    // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no path.
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = line.split_once(" => ").map_or(line, |(_, target)| target).split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// Puts the libraries `binary` loads into the jail `root` at the paths its
/// loader looks for them: hard links to one copy per library under
/// `chroot_base`, refreshed when the host's library changes. Root owns
/// them; the VMM can read but not change them.
fn provide_libraries(binary: &Path, chroot_base: &Path, root: &Path) -> Result<(), EngineError> {
    for library in shared_libraries(binary)? {
        let relative = library.strip_prefix("/").unwrap_or(&library);
        let host = fs::metadata(&library).map_err(EngineError::io(format!("reading {}", library.display())))?;
        let cached = chroot_base.join(".libraries").join(relative);
        let fresh = fs::metadata(&cached)
            .is_ok_and(|meta| meta.len() == host.len() && meta.modified().ok() == host.modified().ok());
        if !fresh {
            let parent = cached.parent().unwrap_or(chroot_base);
            fs::create_dir_all(parent).map_err(EngineError::io("creating the library cache"))?;
            let partial = cached.with_extension("partial");
            fs::copy(&library, &partial).map_err(EngineError::io(format!("copying {}", library.display())))?;
            if let Ok(modified) = host.modified() {
                let file =
                    fs::File::options().write(true).open(&partial).map_err(EngineError::io("the library copy"))?;
                file.set_modified(modified).map_err(EngineError::io("the library copy's time"))?;
            }
            fs::rename(&partial, &cached).map_err(EngineError::io("caching a library"))?;
        }
        let target = root.join(relative);
        fs::create_dir_all(target.parent().unwrap_or(root)).map_err(EngineError::io("creating the jail's /lib"))?;
        let _ = fs::remove_file(&target);
        fs::hard_link(&cached, &target)
            .map_err(EngineError::io(format!("linking {} into the jail", library.display())))?;
    }
    Ok(())
}

async fn wait_for<T>(mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + API_PATIENCE;
    while Instant::now() < deadline {
        if let Some(value) = probe() {
            return Some(value);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}
