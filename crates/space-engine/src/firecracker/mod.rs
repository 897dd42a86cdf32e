//! Firecracker: microVMs on hosts with hardware virtualization. This part
//! is the VMM side: finding the binaries, telling whether this host can run
//! them (and why not), starting a `firecracker` process — directly or under
//! the `jailer` — and driving it through its API socket.

pub mod api;
mod engine;
mod local;

pub use self::engine::{guest_volumes, Firecracker, FirecrackerConfig, BOOT_PATIENCE, JAIL_UID};
pub use self::local::{FirecrackerHost, KEYBOARD_ARGS};

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
        "{}: each microVM chrooted, in its own PID namespace, as a uid of its own, in a cgroup of its own \
         (the CPU of its vCPUs, its memory + {VMM_OVERHEAD_MIB} MiB, {VMM_OWN_TASKS} tasks + one per vCPU); {linking}",
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

/// What a jailed VMM's cgroup lets it use: the CPU of its vCPUs, the memory
/// of its guest and its own, and a few tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmLimits {
    pub vcpus: u32,
    pub memory_mib: u32,
}

/// The cgroup every sandbox's own is made in, in each hierarchy: the
/// gVisor engine's (a jailed VMM's is `space/<jail id>`; gVisor's ids have
/// `_` where jail ids have `-`, so they never meet).
const PARENT_CGROUP: &str = "space";
/// The CFS period a VMM's CPU quota is given in (the gVisor engine's).
const CPU_PERIOD_US: u64 = 100_000;
/// Memory a VMM's cgroup holds beyond its guest's. Firecracker's own
/// threads take ≤ 5 MiB (its specification, for 1 vCPU and 128 MiB, more
/// with many vsock connections); KVM charges the guest's vCPU state and
/// page tables to it; and what the VMM writes for the guest's drive and
/// into a snapshot's memory file passes through the page cache, charged to
/// it too — room for that lets the kernel write it back and reclaim it
/// rather than stall the VMM at its limit. No slack for a guest going past
/// its memory, as gVisor's overhead has: the guest's own kernel keeps it
/// inside what it was given.
pub const VMM_OVERHEAD_MIB: u32 = 64;
/// Tasks a VMM may have beyond one per vCPU: its main (device emulation)
/// and API threads, with room to spare. A VMM starts no processes.
pub const VMM_OWN_TASKS: u32 = 16;

impl VmmLimits {
    pub fn memory_bytes(&self) -> u64 {
        u64::from(self.memory_mib + VMM_OVERHEAD_MIB) << 20
    }

    pub fn tasks(&self) -> u32 {
        self.vcpus + VMM_OWN_TASKS
    }

    /// The jailer's `--cgroup` values for them: cgroup v2's files, or v1's.
    /// Memory and swap together are held to the same limit, as gVisor's
    /// sandboxes' are, where the kernel accounts swap.
    fn cgroup_values(&self, v2: bool) -> Vec<String> {
        let quota = u64::from(self.vcpus) * CPU_PERIOD_US;
        let memory = self.memory_bytes();
        let mut values = if v2 {
            vec![format!("cpu.max={quota} {CPU_PERIOD_US}"), format!("memory.max={memory}")]
        } else {
            vec![
                format!("cpu.cfs_period_us={CPU_PERIOD_US}"),
                format!("cpu.cfs_quota_us={quota}"),
                format!("memory.limit_in_bytes={memory}"),
            ]
        };
        match v2 {
            true if v2_swap_accounted() => values.push("memory.swap.max=0".into()),
            // After the memory limit: v1 keeps memory+swap at or above it.
            false if Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists() => {
                values.push(format!("memory.memsw.limit_in_bytes={memory}"))
            }
            _ => {}
        }
        values.push(format!("pids.max={}", self.tasks()));
        values
    }
}

fn cgroup_v2() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

/// Whether cgroup v2 offers `memory.swap.max` to the sandboxes' cgroups.
/// Their parent is made, and memory turned on for its children (what the
/// jailer does too), first: the file shows only where memory is on.
fn v2_swap_accounted() -> bool {
    let parent = Path::new("/sys/fs/cgroup").join(PARENT_CGROUP);
    let _ = fs::create_dir_all(&parent);
    let _ = fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory");
    parent.join("memory.swap.max").exists()
}

/// The directories of the cgroup `space/<id>` that exist: one per v1
/// hierarchy, or the v2 one.
fn cgroup_dirs(id: &str) -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    let hierarchies = fs::read_dir(root).into_iter().flatten().flatten().map(|entry| entry.path());
    hierarchies
        .chain([root.to_path_buf()])
        .map(|hierarchy| hierarchy.join(PARENT_CGROUP).join(id))
        .filter(|dir| dir.is_dir())
        .collect()
}

/// Removes the cgroup `space/<id>` everywhere. Blocking: a cgroup whose
/// last task is still leaving is busy for a moment.
fn remove_cgroups(id: &str) {
    for dir in cgroup_dirs(id) {
        let deadline = Instant::now() + Duration::from_secs(1);
        while let Err(err) = fs::remove_dir(&dir) {
            if err.raw_os_error() != Some(nix::libc::EBUSY) || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Whether process `pid` runs `binary`: the same file (device and inode),
/// or, replaced since it started, a deleted file at its path. A process
/// that only has the name, or a pid since taken by another program, does
/// not.
pub(crate) fn runs_binary(pid: i32, binary: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    if let (Ok(running), Ok(expected)) = (fs::metadata(&exe), fs::metadata(binary)) {
        if (running.dev(), running.ino()) == (expected.dev(), expected.ino()) {
            return true;
        }
    }
    let (Ok(running), Ok(expected)) = (fs::read_link(&exe), fs::canonicalize(binary)) else { return false };
    running.as_os_str().as_encoded_bytes() == format!("{} (deleted)", expected.display()).as_bytes()
}

/// Detaches every mount at or under `dir` in this process's mount
/// namespace (a volume's image bound into a jail), deepest first.
pub(crate) fn unmount_under(dir: &Path) {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(unescape_mount_point(point)))
        .filter(|point| point.starts_with(dir))
        .collect();
    points.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    for point in points {
        if let Err(err) = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(mount = %point.display(), "detaching a volume from a jail: {err}");
        }
    }
}

/// A mount point as mountinfo shows it, with its octal escapes (`\040`
/// for a space) undone.
fn unescape_mount_point(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal =
            bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(digits) => {
                out.push(digits.iter().fold(0u8, |n, d| n.wrapping_mul(8).wrapping_add(d - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `pid` is a process that has not ended (a zombie has).
fn alive(pid: i32) -> bool {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    !stat.is_empty() && !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z')
}

/// How long a killed VMM has to be gone.
const KILL_PATIENCE: Duration = Duration::from_secs(5);

/// A running `firecracker` process and its API.
pub struct Vmm {
    child: Option<ReapedChild>,
    /// The VMM's own pid (under the jailer with a new PID namespace it is
    /// not the process we spawned).
    pid: i32,
    pub api: Api,
    /// From spawning the process to its API answering.
    pub ready_after: Duration,
    /// What to remove when it is gone (its jail and the jailer's log).
    leftovers: Vec<PathBuf>,
    /// Its cgroup `space/<this>`, when jailed.
    cgroup: Option<String>,
    /// Killed and cleared, or handed over: nothing more to do (its pid may
    /// be another process's by now).
    finished: bool,
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
        let mut vmm = Vmm::adopted(dir, pid);
        vmm.child = Some(child);
        vmm.ready_after = vmm.wait_for_api(started).await?;
        Ok(vmm)
    }

    /// The directory the jailer makes the VMM's root: files the VMM needs
    /// go there (owned by its uid) before [`Vmm::spawn_jailed`].
    pub fn jail_root(binary: &Path, chroot_base: &Path, id: &str) -> PathBuf {
        chroot_base.join(exec_name(binary)).join(id).join("root")
    }

    /// Starts firecracker under the jailer: its own uid/gid, a chroot under
    /// `chroot_base`, a new PID namespace and its own cgroup `space/<id>`
    /// holding it to `limits`. The jailer copies the binary into the
    /// chroot; the libraries a dynamically linked build loads are put
    /// there first. Files already placed in [`Vmm::jail_root`] stay. The
    /// jail is made and the jailer waited for on a blocking thread.
    pub async fn spawn_jailed(
        jailer: &Path,
        binary: &Path,
        chroot_base: &Path,
        id: &str,
        uid: u32,
        gid: u32,
        limits: VmmLimits,
    ) -> Result<Vmm, EngineError> {
        let started = Instant::now();
        let (jailer, binary_owned, base, id_owned) =
            (jailer.to_path_buf(), binary.to_path_buf(), chroot_base.to_path_buf(), id.to_string());
        let pid =
            tokio::task::spawn_blocking(move || run_jailer(&jailer, &binary_owned, &base, &id_owned, uid, gid, limits))
                .await
                .map_err(|e| EngineError::Runtime(format!("starting the jailer: {e}")))??;
        let mut vmm = Vmm::adopted_jailed(binary, chroot_base, id, pid);
        vmm.ready_after = vmm.wait_for_api(started).await?;
        Ok(vmm)
    }

    /// A VMM started in `dir`, unjailed, by an earlier server process and
    /// still running as `pid`.
    pub(crate) fn adopted(dir: &Path, pid: i32) -> Vmm {
        Vmm {
            child: None,
            pid,
            api: Api::new(&dir.join("api.sock")),
            ready_after: Duration::ZERO,
            leftovers: Vec::new(),
            cgroup: None,
            finished: false,
        }
    }

    /// A VMM jailed as `id` under `chroot_base`, running as `pid`: its jail,
    /// the jailer's log and its cgroup go with it.
    pub(crate) fn adopted_jailed(binary: &Path, chroot_base: &Path, id: &str, pid: i32) -> Vmm {
        let root = Vmm::jail_root(binary, chroot_base, id);
        let jail = root.parent().map_or_else(|| root.clone(), Path::to_path_buf);
        let mut vmm = Vmm::adopted(&root, pid);
        vmm.leftovers = vec![jail, jailer_log(chroot_base, id)];
        vmm.cgroup = Some(id.to_string());
        vmm
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
                    self.child = None;
                    self.kill().await;
                    return Err(EngineError::Runtime(format!("firecracker exited at start ({status:?})")));
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.kill().await;
        Err(EngineError::Runtime(format!("firecracker's API did not answer within {API_PATIENCE:?}")))
    }

    /// Stops the VMM and removes its socket, jail and cgroup: waits (at
    /// most [`KILL_PATIENCE`]) without holding the thread, and clears on a
    /// blocking one.
    pub async fn kill(&mut self) {
        if self.finished {
            return;
        }
        self.signal();
        let deadline = Instant::now() + KILL_PATIENCE;
        while !self.gone() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let clear = self.take_leftovers();
        let _ = tokio::task::spawn_blocking(clear).await;
    }

    /// [`Vmm::kill`] for callers off the async threads.
    pub fn kill_blocking(&mut self) {
        if self.finished {
            return;
        }
        self.signal();
        let deadline = Instant::now() + KILL_PATIENCE;
        while !self.gone() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.take_leftovers()();
    }

    /// Lets go of the VMM without stopping it (another owner has it).
    pub(crate) fn release(mut self) {
        self.finished = true;
    }

    fn signal(&self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), nix::sys::signal::Signal::SIGKILL);
    }

    fn gone(&mut self) -> bool {
        if let Some(child) = &self.child {
            if child.wait_timeout(Duration::ZERO).is_none() {
                return false;
            }
            self.child = None;
        }
        // A jailed or adopted VMM is reaped by whoever is its parent now.
        !alive(self.pid)
    }

    /// What removes the VMM's socket, leftovers and cgroup; the VMM counts
    /// as finished from here on.
    fn take_leftovers(&mut self) -> impl FnOnce() + Send + 'static {
        self.finished = true;
        let socket = self.api.socket().to_path_buf();
        let (leftovers, cgroup) = (std::mem::take(&mut self.leftovers), self.cgroup.take());
        move || {
            let _ = fs::remove_file(socket);
            for path in leftovers {
                // A volume bound into the jail is let go first (were it
                // not, its file is a busy mount point: never removed).
                unmount_under(&path);
                let _ = fs::remove_dir_all(&path).or_else(|_| fs::remove_file(&path));
            }
            if let Some(id) = cgroup {
                remove_cgroups(&id);
            }
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        self.kill_blocking();
    }
}

/// Where the jailer's (and the VMM's) output for jail `id` goes.
fn jailer_log(chroot_base: &Path, id: &str) -> PathBuf {
    chroot_base.join(format!("{id}.jailer.log"))
}

/// Runs the jailer for jail `id` and returns the VMM's pid once it has
/// written it. Blocking.
fn run_jailer(
    jailer: &Path,
    binary: &Path,
    chroot_base: &Path,
    id: &str,
    uid: u32,
    gid: u32,
    limits: VmmLimits,
) -> Result<i32, EngineError> {
    let exec_name = exec_name(binary);
    let root = chroot_base.join(&exec_name).join(id).join("root");
    let _ = fs::remove_file(root.join(&exec_name));
    let _ = fs::remove_file(root.join(format!("{exec_name}.pid")));
    fs::create_dir_all(chroot_base).map_err(EngineError::io("creating the chroot base"))?;
    provide_libraries(binary, chroot_base, &root)?;
    // One a killed server left would keep its limits (and, on v1, its
    // memory+swap limit can refuse the new memory limit).
    remove_cgroups(id);
    let v2 = cgroup_v2();
    let mut command = Command::new(jailer);
    command
        .args(["--id", id])
        .arg("--exec-file")
        .arg(binary)
        .args(["--uid", &uid.to_string(), "--gid", &gid.to_string()])
        .arg("--chroot-base-dir")
        .arg(chroot_base)
        .args(["--cgroup-version", if v2 { "2" } else { "1" }])
        .args(["--parent-cgroup", PARENT_CGROUP]);
    for value in limits.cgroup_values(v2) {
        command.arg("--cgroup").arg(value);
    }
    command.arg("--new-pid-ns").args(["--", "--api-sock", "/api.sock"]);
    // The VMM inherits the jailer's output: a file, not a pipe we would
    // wait on.
    let log_path = jailer_log(chroot_base, id);
    let log = fs::File::create(&log_path).map_err(EngineError::io("creating the jailer log"))?;
    let err = log.try_clone().map_err(EngineError::io("the jailer log"))?;
    command.stdin(Stdio::null()).stdout(log).stderr(err);
    // With a new PID namespace the jailer forks the VMM, records its pid
    // and exits; the VMM is then our child by the subreaper rule.
    let jailer_process = Reaper::global().spawn(&mut command).map_err(EngineError::io("starting the jailer"))?;
    let status = jailer_process.wait_timeout(API_PATIENCE);
    if status.is_none_or(|s| !s.success()) {
        let said = fs::read_to_string(&log_path).unwrap_or_default();
        remove_cgroups(id);
        return Err(EngineError::Runtime(format!("the jailer failed ({status:?}): {}", said.trim())));
    }
    let pid_file = root.join(format!("{exec_name}.pid"));
    let deadline = Instant::now() + API_PATIENCE;
    let pid = loop {
        if let Some(pid) = fs::read_to_string(&pid_file).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
            break pid;
        }
        if Instant::now() >= deadline {
            return Err(EngineError::Runtime("the jailer wrote no pid file".into()));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    if !v2 {
        join_cpuacct(id, pid);
    }
    Ok(pid)
}

/// On cgroup v1 a VMM's CPU time is counted by `cpuacct`, which the jailer
/// cannot put it in (it first copies each file's value from the parent,
/// and `cpuacct.usage` takes only 0): it joins `space/<id>` there
/// afterwards, whole (every thread).
fn join_cpuacct(id: &str, pid: i32) {
    let hierarchy = Path::new("/sys/fs/cgroup/cpuacct");
    if !hierarchy.is_dir() {
        return;
    }
    let dir = hierarchy.join(PARENT_CGROUP).join(id);
    let joined = fs::create_dir_all(&dir).and_then(|()| fs::write(dir.join("cgroup.procs"), pid.to_string()));
    if let Err(err) = joined {
        tracing::warn!(jail = id, "the VMM's CPU time is not counted: joining {}: {err}", dir.display());
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
        // One refresh at a time: jails made at once (two clones) would all
        // find the copy stale, and one's rename over it takes the file
        // another is about to link from away (a link to a file no name
        // holds any more fails).
        static REFRESHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let refreshing = REFRESHING.lock().unwrap_or_else(|e| e.into_inner());
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
        drop(refreshing);
        let target = root.join(relative);
        fs::create_dir_all(target.parent().unwrap_or(root)).map_err(EngineError::io("creating the jail's /lib"))?;
        let _ = fs::remove_file(&target);
        fs::hard_link(&cached, &target)
            .map_err(EngineError::io(format!("linking {} into the jail", library.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jails made at once for a dynamically linked binary all get its
    /// libraries, though each finds the shared cache stale and refreshes it.
    #[test]
    fn jails_made_at_once_all_get_their_libraries() {
        let binary = Path::new("/bin/sleep");
        let libraries = shared_libraries(binary).unwrap();
        assert!(!libraries.is_empty(), "a dynamically linked binary");
        let base = std::env::temp_dir().join(format!("space-fc-libraries-{}", std::process::id()));
        for round in 0..20 {
            let base = base.join(round.to_string());
            let start = std::sync::Barrier::new(4);
            let made: Vec<Result<(), EngineError>> = std::thread::scope(|scope| {
                let jails: Vec<_> = (0..4)
                    .map(|jail| {
                        let (base, start) = (&base, &start);
                        scope.spawn(move || {
                            start.wait();
                            provide_libraries(binary, base, &base.join(format!("jail-{jail}/root")))
                        })
                    })
                    .collect();
                jails.into_iter().map(|jail| jail.join().unwrap()).collect()
            });
            for (jail, made) in made.iter().enumerate() {
                assert!(made.is_ok(), "round {round}, jail {jail}: {made:?}");
                for library in &libraries {
                    let linked = base.join(format!("jail-{jail}/root")).join(library.strip_prefix("/").unwrap());
                    assert!(linked.is_file(), "{}", linked.display());
                }
            }
        }
        let _ = fs::remove_dir_all(&base);
    }
}
