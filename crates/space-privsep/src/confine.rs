//! What an unprivileged SPACE process does to itself before it reads a
//! byte from a tenant, a sandbox or a peer: `no_new_privs`, no
//! capabilities in any set, optionally a switch to its own user, a
//! Landlock ruleset limited to the paths it needs, and a seccomp filter.
//!
//! Capabilities, Landlock and seccomp act per thread, and a thread made
//! before they are applied keeps none of them: [`confine`] refuses to run
//! in a process that already has more than one thread, so call it first
//! thing in `main`, before a runtime starts.
//!
//! The seccomp filter is a deny-list (answering `EPERM`), not an
//! allow-list: the processes it covers are large (an async HTTP server,
//! TLS, SQLite, DNS through the C library), and an allow-list that misses
//! a rare path's system call kills a server in production. What it denies
//! is what no SPACE process outside the helper has a use for and what
//! hands an attacker the kernel's larger surfaces: mounts, namespaces
//! (`unshare`, `setns`, `clone` with a namespace flag; `clone3`, whose
//! flags a filter cannot read, answers `ENOSYS` so the C library falls
//! back to `clone`), modules and kexec, BPF, perf, userfaultfd, io_uring,
//! keyrings, tracing and other processes' memory, file handles, swap,
//! reboot, clocks. Most need a capability the process no longer has; the
//! filter is the second wall and shuts the ones an unprivileged user may
//! otherwise call (user namespaces, io_uring, userfaultfd, keyrings).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use landlock::{
    path_beneath_rules, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, ABI,
};
use nix::libc;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// The newest Landlock ABI this code asks for; an older kernel enforces
/// what it knows (see [`Confined::landlock`]).
const LANDLOCK_ABI: ABI = ABI::V6;

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("confinement must come before any thread is started, but this process has {0} threads")]
    Threads(usize),
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the Landlock ruleset: {0}")]
    Landlock(#[from] landlock::RulesetError),
    #[error("the kernel does not enforce Landlock fully ({0:?}) and full enforcement was required")]
    LandlockNotEnforced(Landlock),
    #[error("the seccomp filter: {0}")]
    Seccomp(#[from] seccompiler::Error),
    #[error("the seccomp filter: {0}")]
    SeccompBackend(#[from] seccompiler::BackendError),
}

fn os_err(what: &'static str) -> impl FnOnce(io::Error) -> ConfineError {
    move |source| ConfineError::Os { what, source }
}

/// What a process may keep.
#[derive(Debug, Clone, Default)]
pub struct Confinement {
    /// Paths it reads and writes, with everything beneath them.
    pub read_write: Vec<PathBuf>,
    /// Paths it only reads (and may execute from).
    pub read_only: Vec<PathBuf>,
    /// Become this uid and gid (no supplementary groups) on the way: for a
    /// process started as root.
    pub user: Option<(u32, u32)>,
    /// Fail unless the kernel enforces every Landlock right asked for.
    pub require_full_landlock: bool,
}

/// How much of the Landlock ruleset the kernel enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landlock {
    Full,
    /// An older kernel: the rights it knows.
    Partial,
    /// No Landlock in this kernel.
    None,
}

impl From<RulesetStatus> for Landlock {
    fn from(status: RulesetStatus) -> Landlock {
        match status {
            RulesetStatus::FullyEnforced => Landlock::Full,
            RulesetStatus::PartiallyEnforced => Landlock::Partial,
            RulesetStatus::NotEnforced => Landlock::None,
        }
    }
}

/// What [`confine`] achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confined {
    pub landlock: Landlock,
    /// Paths of the confinement that did not exist, so got no rule.
    pub missing: Vec<PathBuf>,
    /// Whether the bounding set was emptied (only a process holding
    /// `CAP_SETPCAP` can; without it, `no_new_privs` already keeps execve
    /// from granting anything the bounding set holds).
    pub bounding_set_emptied: bool,
}

/// Confines the calling process; see the module's documentation.
pub fn confine(confinement: &Confinement) -> Result<Confined, ConfineError> {
    let threads = thread_count().map_err(os_err("counting this process's threads"))?;
    if threads != 1 {
        return Err(ConfineError::Threads(threads));
    }
    set_no_new_privs()?;
    let bounding_set_emptied = drop_bounding_set()?;
    clear_ambient()?;
    if let Some((uid, gid)) = confinement.user {
        switch_user(uid, gid)?;
    }
    clear_capabilities()?;
    let (landlock, missing) = restrict_paths(&confinement.read_write, &confinement.read_only)?;
    if confinement.require_full_landlock && landlock != Landlock::Full {
        return Err(ConfineError::LandlockNotEnforced(landlock));
    }
    apply_seccomp()?;
    Ok(Confined { landlock, missing, bounding_set_emptied })
}

/// Capability numbers (capability.h) a [`confine_keeping`] may keep.
pub mod cap {
    pub const CHOWN: u32 = 0;
    pub const DAC_OVERRIDE: u32 = 1;
    pub const FOWNER: u32 = 3;
    pub const FSETID: u32 = 4;
}

/// What a root process that must keep a few capabilities (the template
/// importer, decision 027) may keep: those capabilities, and the
/// directories it writes; it reads no path but its own `/proc/self`.
#[derive(Debug, Clone, Default)]
pub struct Keeping {
    /// Capability numbers ([`cap`]) left in the bounding, permitted and
    /// effective sets; every other one goes from all of them.
    pub capabilities: Vec<u32>,
    /// Directories it reads and writes, with everything beneath them, but
    /// executes nothing from: what it writes is a tenant's.
    pub writable: Vec<PathBuf>,
    /// Make this directory its root (and working directory) once the
    /// Landlock rules are made: Landlock governs reading and writing but
    /// not changing owners or modes, which the kept capabilities allow on
    /// any file the process can name; in this root it names none outside.
    pub root: Option<PathBuf>,
    /// Refuse it every new process and thread (`clone`, `fork`, `vfork`):
    /// once it ends, nothing it ran is left to race whoever reads what it
    /// wrote.
    pub no_new_processes: bool,
    /// With [`Keeping::no_new_processes`], still allow threads of this
    /// process (`clone` with `CLONE_THREAD`): a new process stays refused.
    pub threads: bool,
}

/// The mask of capability numbers `caps`, as `/proc/PID/status` shows one.
pub fn capability_mask(caps: &[u32]) -> u64 {
    caps.iter().fold(0, |mask, cap| mask | (1u64 << cap))
}

/// Confines the calling process, which stays root, to what `keeping`
/// allows: `no_new_privs`, every capability but the kept ones gone from
/// every set (ambient and inheritable empty), Landlock to its writable
/// directories, optionally a root of its own, the deny-list of
/// [`confine`] (and with [`Keeping::no_new_processes`] no process or
/// thread creation).
pub fn confine_keeping(keeping: &Keeping) -> Result<Confined, ConfineError> {
    let threads = thread_count().map_err(os_err("counting this process's threads"))?;
    if threads != 1 {
        return Err(ConfineError::Threads(threads));
    }
    let kept = capability_mask(&keeping.capabilities);
    set_no_new_privs()?;
    // Dropping from the bounding set needs CAP_SETPCAP, which goes with
    // the capset below: this comes first.
    let last = last_cap()?;
    for cap in (0..=last).filter(|cap| kept & (1u64 << cap) == 0) {
        // SAFETY: PR_CAPBSET_DROP takes a capability number; no memory is passed.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(ConfineError::Os { what: "PR_CAPBSET_DROP", source: io::Error::last_os_error() });
        }
    }
    clear_ambient()?;
    let read_write = AccessFs::from_all(LANDLOCK_ABI) & !AccessFs::Execute;
    let (landlock, missing) = restrict_paths_with(&keeping.writable, read_write, &[])?;
    if let Some(root) = &keeping.root {
        // Still holding CAP_SYS_CHROOT, which the capset below takes.
        nix::unistd::chroot(root).map_err(|e| ConfineError::Os { what: "chroot", source: e.into() })?;
        // A working directory left outside the new root would be a way out of it.
        nix::unistd::chdir("/").map_err(|e| ConfineError::Os { what: "chdir to the new root", source: e.into() })?;
    }
    set_capabilities(kept)?;
    apply_seccomp()?;
    if keeping.no_new_processes {
        seccompiler::apply_filter(&no_new_processes_program(keeping.threads)?)?;
    }
    Ok(Confined { landlock, missing, bounding_set_emptied: kept == 0 })
}

/// Sets the effective and permitted sets to `mask`, the inheritable set empty.
fn set_capabilities(mask: u64) -> Result<(), ConfineError> {
    let mut header = CapHeader { version: CAP_V3, pid: 0 };
    let word = |n: u32| (mask >> (32 * n)) as u32;
    let data = [0, 1].map(|n| CapData { effective: word(n), permitted: word(n), inheritable: 0 });
    // SAFETY: a v3 header and two data structs, as capset(2) documents.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(ConfineError::Os { what: "capset", source: io::Error::last_os_error() });
    }
    Ok(())
}

/// Refuses (`EPERM`) every way to a new process or thread: `clone` and
/// `fork`/`vfork` (`clone3` already answers `ENOSYS`). With `threads`, a
/// `clone` with `CLONE_THREAD` (a thread of this process, what
/// `pthread_create` falls back to) is let through.
fn no_new_processes_program(threads: bool) -> Result<BpfProgram, ConfineError> {
    let clone_rules = match threads {
        false => Vec::new(),
        // Refused when the flags (the first argument) lack CLONE_THREAD.
        true => vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
            0,
        )?])?],
    };
    let mut denied = BTreeMap::from([(libc::SYS_clone, clone_rules)]);
    #[cfg(target_arch = "x86_64")]
    denied.extend([(libc::SYS_fork, Vec::new()), (libc::SYS_vfork, Vec::new())]);
    let filter = SeccompFilter::new(denied, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), ARCH)?;
    Ok(filter.try_into()?)
}

fn thread_count() -> io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

pub fn set_no_new_privs() -> Result<(), ConfineError> {
    nix::sys::prctl::set_no_new_privs().map_err(|e| ConfineError::Os { what: "PR_SET_NO_NEW_PRIVS", source: e.into() })
}

/// The highest capability number this kernel knows.
fn last_cap() -> Result<u32, ConfineError> {
    let text = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").map_err(os_err("reading cap_last_cap"))?;
    text.trim().parse().map_err(|_| ConfineError::Os {
        what: "reading cap_last_cap",
        source: io::Error::new(io::ErrorKind::InvalidData, text.trim().to_string()),
    })
}

/// Empties the bounding set if this process may; says whether it is empty.
pub fn drop_bounding_set() -> Result<bool, ConfineError> {
    let last = last_cap()?;
    let may = has_effective(CAP_SETPCAP)?;
    let mut empty = true;
    for cap in 0..=last {
        // SAFETY: PR_CAPBSET_READ takes a capability number and reads.
        let held = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
        if held != 1 {
            continue;
        }
        if !may {
            empty = false;
            continue;
        }
        // SAFETY: PR_CAPBSET_DROP takes a capability number; no memory is passed.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(ConfineError::Os { what: "PR_CAPBSET_DROP", source: io::Error::last_os_error() });
        }
    }
    Ok(empty)
}

pub fn clear_ambient() -> Result<(), ConfineError> {
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL passes no memory.
    let done = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) };
    if done != 0 {
        return Err(ConfineError::Os { what: "PR_CAP_AMBIENT_CLEAR_ALL", source: io::Error::last_os_error() });
    }
    Ok(())
}

/// `capget`/`capset`'s header and data, version 3 (two 32-bit words).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_V3: u32 = 0x2008_0522;
/// capability.h's number for CAP_SETPCAP (libc does not export it).
const CAP_SETPCAP: u32 = 8;

fn capget() -> Result<[CapData; 2], ConfineError> {
    let mut header = CapHeader { version: CAP_V3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: a v3 header and two data structs, as capget(2) documents.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(ConfineError::Os { what: "capget", source: io::Error::last_os_error() });
    }
    Ok(data)
}

fn has_effective(cap: u32) -> Result<bool, ConfineError> {
    let data = capget()?;
    Ok(data[(cap / 32) as usize].effective & (1 << (cap % 32)) != 0)
}

/// Empties the effective, permitted and inheritable sets.
pub fn clear_capabilities() -> Result<(), ConfineError> {
    let mut header = CapHeader { version: CAP_V3, pid: 0 };
    let data = [CapData::default(); 2];
    // SAFETY: a v3 header and two data structs, as capset(2) documents.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(ConfineError::Os { what: "capset", source: io::Error::last_os_error() });
    }
    Ok(())
}

/// Becomes `uid`:`gid` with no supplementary groups, all three ids of each.
pub fn switch_user(uid: u32, gid: u32) -> Result<(), ConfineError> {
    use nix::unistd::{setgroups, setresgid, setresuid, Gid, Uid};
    let os = |what: &'static str| move |e: nix::Error| ConfineError::Os { what, source: e.into() };
    setgroups(&[]).map_err(os("setgroups"))?;
    let gid = Gid::from_raw(gid);
    setresgid(gid, gid, gid).map_err(os("setresgid"))?;
    let uid = Uid::from_raw(uid);
    setresuid(uid, uid, uid).map_err(os("setresuid"))?;
    Ok(())
}

/// Limits the file system to `read_write` and `read_only` (and what lies
/// beneath them) and the process's own `/proc/self`, and scopes abstract Unix sockets and signals to this
/// process and its children.
pub fn restrict_paths(read_write: &[PathBuf], read_only: &[PathBuf]) -> Result<(Landlock, Vec<PathBuf>), ConfineError> {
    restrict_paths_with(read_write, AccessFs::from_all(LANDLOCK_ABI), read_only)
}

/// [`restrict_paths`] with `read_write_access` the rights beneath `read_write`.
fn restrict_paths_with(
    read_write: &[PathBuf],
    read_write_access: landlock::BitFlags<AccessFs>,
    read_only: &[PathBuf],
) -> Result<(Landlock, Vec<PathBuf>), ConfineError> {
    let existing = |paths: &[PathBuf], missing: &mut Vec<PathBuf>| -> Vec<PathBuf> {
        let (here, gone): (Vec<_>, Vec<_>) = paths.iter().cloned().partition(|p| Path::exists(p));
        missing.extend(gone);
        here
    };
    let mut missing = Vec::new();
    let read_write = existing(read_write, &mut missing);
    let mut read_only = existing(read_only, &mut missing);
    // Its own /proc entry (which shows only itself): its status, for
    // `space doctor`, and its descriptors.
    read_only.push(PathBuf::from("/proc/self"));
    let all = AccessFs::from_all(LANDLOCK_ABI);
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)?
        .scope(Scope::AbstractUnixSocket | Scope::Signal)?
        .create()?
        .add_rules(path_beneath_rules(&read_write, read_write_access))?
        .add_rules(path_beneath_rules(&read_only, AccessFs::from_read(LANDLOCK_ABI)))?
        .restrict_self()?;
    Ok((status.ruleset.into(), missing))
}

/// System calls the unprivileged processes never make (see the module's
/// documentation for why a deny-list).
pub const DENIED_SYSCALLS: &[(&str, i64)] = &[
    // Mounts and the root.
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    // Namespaces (clone's namespace flags are refused below).
    ("unshare", libc::SYS_unshare),
    ("setns", libc::SYS_setns),
    // Kernel code, boot, swap, accounting.
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("reboot", libc::SYS_reboot),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("acct", libc::SYS_acct),
    ("quotactl", libc::SYS_quotactl),
    ("quotactl_fd", libc::SYS_quotactl_fd),
    ("syslog", libc::SYS_syslog),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    // Large kernel surfaces an unprivileged user may otherwise reach.
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("fanotify_init", libc::SYS_fanotify_init),
    // Other processes' memory and descriptors.
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    // Files by handle, around the path checks.
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    // Legacy and port I/O.
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
    #[cfg(target_arch = "x86_64")]
    ("uselib", libc::SYS_uselib),
    ("vhangup", libc::SYS_vhangup),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
];

/// `clone` flags that make a namespace.
const NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWCGROUP,
    libc::CLONE_NEWTIME,
];

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// The filters, in the order they are installed: the deny-list (`EPERM`)
/// and `clone3` (`ENOSYS`). A system call of another architecture kills
/// the process (seccompiler's architecture check).
pub fn seccomp_programs() -> Result<[BpfProgram; 2], ConfineError> {
    let mut denied: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED_SYSCALLS.iter().map(|(_, number)| (*number, Vec::new())).collect();
    // clone's flags are its first argument on x86_64 and aarch64.
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            let flag = *flag as u64;
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    denied.insert(libc::SYS_clone, clone_rules);
    let deny = SeccompFilter::new(denied, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), ARCH)?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        ARCH,
    )?;
    Ok([deny.try_into()?, clone3.try_into()?])
}

pub fn apply_seccomp() -> Result<(), ConfineError> {
    for program in seccomp_programs()? {
        seccompiler::apply_filter(&program)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// What `space doctor` shows of a process.

/// A process's privileges as the kernel reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The effective uid.
    pub uid: u32,
    pub cap_effective: u64,
    pub cap_permitted: u64,
    pub cap_inheritable: u64,
    pub cap_bounding: u64,
    pub cap_ambient: u64,
    pub no_new_privs: bool,
    /// 0 none, 1 strict, 2 filter.
    pub seccomp: u8,
    pub seccomp_filters: u32,
}

/// The calling thread's status (the one [`confine`] acted on).
pub fn status() -> io::Result<Status> {
    parse_status(&std::fs::read_to_string("/proc/thread-self/status")?)
}

/// Process `pid`'s status (its main thread's).
pub fn status_of(pid: u32) -> io::Result<Status> {
    parse_status(&std::fs::read_to_string(format!("/proc/{pid}/status"))?)
}

/// The Landlock ABI the running kernel offers, or None without Landlock.
/// Whether a given process is landlocked is not in `/proc`; it reports
/// that itself from [`Confined`].
pub fn landlock_abi() -> Option<i32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute, size 0 and the VERSION flag the call
    // only returns the ABI version; no memory is read or written.
    let version = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    (version > 0).then_some(version as i32)
}

pub fn parse_status(text: &str) -> io::Result<Status> {
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(':')).map(str::trim))
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no {name} in the status")))
    };
    let bad = |name: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{name} does not parse"));
    let hex = |name: &str| field(name).and_then(|v| u64::from_str_radix(v, 16).map_err(|_| bad(name)));
    let number = |name: &str| field(name).and_then(|v| v.parse::<u64>().map_err(|_| bad(name)));
    let uid = field("Uid")?.split_whitespace().nth(1).and_then(|v| v.parse().ok()).ok_or_else(|| bad("Uid"))?;
    Ok(Status {
        uid,
        cap_effective: hex("CapEff")?,
        cap_permitted: hex("CapPrm")?,
        cap_inheritable: hex("CapInh")?,
        cap_bounding: hex("CapBnd")?,
        cap_ambient: hex("CapAmb")?,
        no_new_privs: number("NoNewPrivs")? == 1,
        seccomp: number("Seccomp")? as u8,
        seccomp_filters: number("Seccomp_filters").unwrap_or(0) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tspace\nUid:\t0\t65534\t65534\t65534\nCapInh:\t0000000000000000\n\
        CapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t000001ffffffffff\n\
        CapAmb:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t2\n";

    #[test]
    fn a_status_file_reads_as_its_fields() {
        let status = parse_status(STATUS).unwrap();
        assert_eq!(status.uid, 65534);
        assert_eq!(status.cap_effective, 0);
        assert_eq!(status.cap_bounding, 0x1ff_ffff_ffff);
        assert!(status.no_new_privs);
        assert_eq!((status.seccomp, status.seccomp_filters), (2, 2));
        assert!(parse_status("Name:\tx\n").is_err());
        assert!(parse_status(&STATUS.replace("CapEff:\t0000000000000000", "CapEff:\tzz")).is_err());
    }

    #[test]
    fn this_process_status_reads() {
        let status = status().unwrap();
        assert_eq!(status.uid, nix::unistd::geteuid().as_raw());
    }

    #[test]
    fn the_filters_compile_and_name_no_syscall_twice() {
        seccomp_programs().unwrap();
        let mut numbers: Vec<i64> = DENIED_SYSCALLS.iter().map(|(_, n)| *n).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), DENIED_SYSCALLS.len());
        assert!(!numbers.contains(&libc::SYS_clone) && !numbers.contains(&libc::SYS_clone3));
    }
}
