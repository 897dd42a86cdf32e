//! What a killed test leaves behind, and removing it.
//!
//! A test that ends normally removes what it made when its fixtures drop.
//! One killed instead (the test runner's watchdog ends a stuck test with
//! SIGTERM, then SIGKILL; an OOM kill; Ctrl-C) runs no destructor, and
//! what it made outlives it: runsc sandboxes (they run in sessions of their
//! own, out of reach of a signal to the test's process group) with their
//! cgroups, the btrfs subvolumes of its scratch data dir, its network
//! namespaces and a throwaway PostgreSQL (`pg_ctl` starts it in a session
//! of its own). A stuck sandbox spinning a core would slow every later
//! test.
//!
//! So each of those names the test process that made it (its pid and start
//! time: a pid alone may belong to another process by then), and [`sweep`]
//! removes those whose maker is gone. A scratch data dir holds its maker in
//! a file ([`OWNER_FILE`]) rather than in its name: sockets of sandboxes
//! live under it, and a socket's path must fit in 108 bytes. Every new
//! [`crate::TestDataDir`] sweeps first, so a killed test's leftovers go as
//! soon as the next test starts, and `scripts/test.sh` sweeps once more
//! after the run (`space-test-sweep`). Only makers that are gone are swept:
//! tests of other runs on the same host are left alone.

use std::path::{Path, PathBuf};

use crate::{processes_matching, shared_data_dir};

/// This process as the maker of what it names: `PID.STARTTIME`.
pub(crate) fn owner_tag() -> String {
    owner_tag_of(std::process::id() as i32).expect("this process's start time, from /proc/self/stat")
}

/// Process `pid` as a maker, or None when it does not run.
pub(crate) fn owner_tag_of(pid: i32) -> Option<String> {
    Some(format!("{pid}.{}", start_time(pid)?))
}

/// The file in a scratch data dir that names the test process that made it.
const OWNER_FILE: &str = ".space-test-owner";

/// Records `owner` as the maker of data dir `root`.
pub(crate) fn mark_owner(root: &Path, owner: &str) {
    std::fs::write(root.join(OWNER_FILE), owner).expect("writing a test data dir's owner");
}

/// When process `pid` started, in clock ticks since boot (field 22 of its
/// stat), or None when there is no such process.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: fields are counted
    // after it. The state is field 3, the start time field 22.
    stat.rsplit(')').next()?.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the maker named by `tag` (`PID.STARTTIME`) is still running.
/// A tag that does not read is taken as alive: what it names is not ours
/// to remove.
fn maker_alive(tag: &str) -> bool {
    let Some((pid, start)) = tag.split_once('.') else { return true };
    let (Ok(pid), Ok(start)) = (pid.parse::<i32>(), start.parse::<u64>()) else { return true };
    start_time(pid) == Some(start)
}

/// The maker's tag in a name made as `PREFIX{tag}-{random}`.
fn tag_in<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    name.strip_prefix(prefix)?.split_once('-').map(|(tag, _)| tag)
}

/// What one sweep removed.
#[derive(Debug, Default)]
pub struct Swept {
    pub data_dirs: Vec<PathBuf>,
    pub netns: Vec<String>,
    pub postgres: Vec<PathBuf>,
}

impl Swept {
    pub fn is_empty(&self) -> bool {
        self.data_dirs.is_empty() && self.netns.is_empty() && self.postgres.is_empty()
    }
}

/// Removes what tests that are no longer running left: their scratch data
/// dirs (with the servers and sandboxes over them), network namespaces
/// (with the processes in them) and throwaway PostgreSQL clusters. One
/// sweep runs at a time on a host; with `wait` false, a sweep that finds
/// another under way leaves the work to it.
pub fn sweep(wait: bool) -> Swept {
    let mut swept = Swept::default();
    let Ok(lock) = std::fs::File::create(std::env::temp_dir().join("space-test-sweep.lock")) else { return swept };
    let mode = if wait { nix::fcntl::FlockArg::LockExclusive } else { nix::fcntl::FlockArg::LockExclusiveNonblock };
    // Held until it drops at the end of this function (or the process ends).
    let Ok(_held) = nix::fcntl::Flock::lock(lock, mode) else { return swept };

    let scratch = shared_data_dir().join("scratch");
    for entry in std::fs::read_dir(&scratch).into_iter().flatten().flatten() {
        // A dir without the file (made before it was written, or by an
        // older test kit) is left alone.
        let owner = std::fs::read_to_string(entry.path().join(OWNER_FILE));
        if owner.is_ok_and(|tag| !maker_alive(tag.trim())) {
            remove_data_dir(&entry.path());
            swept.data_dirs.push(entry.path());
        }
    }
    for entry in std::fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // `sp-ROLE-TAG-RANDOM`: the role holds no dash.
        let Some((_, rest)) = name.strip_prefix("sp-").and_then(|rest| rest.split_once('-')) else { continue };
        if rest.split_once('-').is_some_and(|(tag, _)| !maker_alive(tag)) {
            remove_netns(&name);
            swept.netns.push(name);
        }
    }
    for entry in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // `space-pg-PID-NANOS` (space_host::postgres): the pid alone names
        // the maker, so one reused since is taken as the maker alive.
        let Some(pid) = tag_in(&name, "space-pg-").and_then(|pid| pid.parse::<i32>().ok()) else { continue };
        if start_time(pid).is_none() {
            remove_postgres(&entry.path());
            swept.postgres.push(entry.path());
        }
    }
    swept
}

/// Stops whatever runs over data dir `root` and removes it: the servers
/// over it (`space serve` or `space node` a test spawned), then its runsc
/// sandboxes (thawed first: a paused one is frozen and would not die) and
/// their cgroups, then its subvolumes and files.
pub(crate) fn remove_data_dir(root: &Path) {
    let root_text = root.to_string_lossy().into_owned();
    // The servers first: alive, they would start sandboxes (warm members, a
    // create in flight) after the sweep below, which outlive them once the
    // dir is gone.
    let servers: Vec<i32> = [format!("--data-dir\0{root_text}\0"), format!("--data-dir={root_text}\0")]
        .iter()
        .flat_map(|arg| processes_matching(arg))
        .collect();
    for pid in &servers {
        kill(*pid);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while servers.iter().any(|pid| running(*pid)) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Killed rather than deleted by runsc, sandboxes leave their cgroups:
    // removed once empty.
    let mut cgroups = Vec::new();
    for pid in processes_matching(&format!("--root={root_text}/")) {
        cgroups.extend(cgroups_of(pid).into_iter().map(|(_, dir)| dir));
        thaw(pid);
        kill(pid);
    }
    cgroups.sort();
    cgroups.dedup();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    cgroups.retain(|dir| std::fs::remove_dir(dir).is_err());
    while !cgroups.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        cgroups.retain(|dir| std::fs::remove_dir(dir).is_err());
    }
    unmount_under(root);
    if let Err(err) = space_host::btrfs::remove_tree(root) {
        eprintln!("removing a test data dir: {err}");
    }
}

/// Detaches every mount under `root`, deepest first: what a test that
/// failed half way left mounted there (a volume's image, a read-only view).
fn unmount_under(root: &Path) {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4).map(PathBuf::from))
        .filter(|point| point.starts_with(root) && point != root)
        .collect();
    points.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    for point in points {
        let _ = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Kills the processes in network namespace `name` and deletes it (its
/// veth links go with it, and their peers with them).
fn remove_netns(name: &str) {
    let pids = crate::bounded::run_within(std::process::Command::new("ip").args(["netns", "pids", name]), PATIENCE)
        .unwrap_or_default();
    for pid in String::from_utf8_lossy(&pids).split_whitespace().filter_map(|p| p.parse().ok()) {
        kill(pid);
    }
    let _ = crate::bounded::run_within(std::process::Command::new("ip").args(["netns", "del", name]), PATIENCE);
}

/// Kills a throwaway cluster's postmaster (its pid is the first line of
/// `postmaster.pid`; its children end with it) and removes its files.
fn remove_postgres(dir: &Path) {
    let pid = std::fs::read_to_string(dir.join("data/postmaster.pid"))
        .ok()
        .and_then(|text| text.lines().next()?.trim().parse::<i32>().ok());
    if let Some(pid) = pid {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains("postgres") {
            kill(pid);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

const PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

fn kill(pid: i32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
}

/// Whether a process still runs (a zombie waiting to be reaped does not).
fn running(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    !stat.is_empty() && !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z')
}

/// The cgroups (v1 controllers' and v2) a process is in, other than the
/// root, as (controllers, directory).
fn cgroups_of(pid: i32) -> Vec<(String, PathBuf)> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    cgroups
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            if path == "/" {
                return None;
            }
            // `name=systemd` is mounted as `systemd`; v2 has no controllers.
            let mount = controllers.split(',').next().unwrap_or("").trim_start_matches("name=");
            let dir = Path::new("/sys/fs/cgroup").join(mount).join(path.trim_start_matches('/'));
            Some((controllers.to_string(), dir))
        })
        .collect()
}

/// Thaws the freezer cgroup (v1 or v2) a process is in, if it has one.
fn thaw(pid: i32) {
    for (controllers, dir) in cgroups_of(pid) {
        if controllers.split(',').any(|c| c == "freezer") {
            let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        } else if controllers.is_empty() {
            let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        }
    }
}
