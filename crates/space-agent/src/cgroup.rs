//! Every command's processes in a cgroup of their own, so that killing a
//! command kills all it started.
//!
//! A command's process group does not hold everything it started: a child
//! that calls `setsid` or `setpgid` leaves it, and one whose parent exits is
//! re-parented to the agent (PID 1), after which nothing in `/proc` says
//! which command it came from. Cgroup membership is inherited by every
//! child and kept through all of that; only a write into a cgroupfs moves a
//! process out, and commands cannot mount one (no `CAP_SYS_ADMIN`). So the
//! agent mounts the `pids` hierarchy once (gVisor's kernel serves cgroup v1
//! hierarchies, and so does a guest Linux), keeps a descriptor of its root
//! and unmounts it again: no path of the sandbox's tree leads to it.
//!
//! Each command is born in its cgroup: the agent's spawning thread enters
//! it just for the spawn, so the child is inside before it can fork. Its
//! processes are capped there too ([`MAX_PROCESSES`]), whatever uid they
//! switch to. Killing a command kills every process its cgroup lists, again
//! and again until none is left, since a process may fork between a
//! listing and its kill (a killed process forks no more). gVisor has no
//! freezer or `cgroup.kill` to do it in one step.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::signal::Signal;
use nix::sys::stat::Mode;
use nix::unistd::{unlinkat, UnlinkatFlags};

/// Processes (threads, as the kernel counts them) one command and what it
/// starts may have at once, so a fork bomb gets EAGAIN inside instead of
/// exhausting the sandbox.
pub const MAX_PROCESSES: u64 = 512;
/// How long a kill keeps sweeping a command's cgroup before it gives up.
const KILL_DEADLINE: Duration = Duration::from_secs(30);
/// The pause between two sweeps: long enough for the killed to die.
const SWEEP_PAUSE: Duration = Duration::from_millis(5);

/// The root of the agent's `pids` hierarchy, when it could be mounted.
static HIERARCHY: OnceLock<Option<OwnedFd>> = OnceLock::new();
/// Cgroups of ended commands still holding processes (a background job),
/// removed once empty.
static LINGERING: Mutex<Vec<String>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(1);

/// Mounts the hierarchy and keeps its root. Called once at start, before
/// any command runs; without it commands are tracked by their process
/// group alone.
pub fn init() {
    HIERARCHY.get_or_init(|| match open_hierarchy() {
        Ok(root) => Some(root),
        Err(err) => {
            eprintln!("space-agent: no cgroup for commands ({err}): a kill reaches only a command's process group");
            None
        }
    });
}

fn open_hierarchy() -> io::Result<OwnedFd> {
    // A fresh name: whatever the sandbox left under /.space is not used.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let point = format!("/.space/.cgroup-{}-{nanos}", std::process::id());
    std::fs::create_dir(&point)?;
    let opened = mount(Some("none"), point.as_str(), Some("cgroup"), MsFlags::empty(), Some("pids"))
        .map_err(io::Error::from)
        .and_then(|()| {
            let root = nix::fcntl::open(
                point.as_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            );
            // The descriptor keeps the hierarchy; the mount point goes.
            let _ = umount2(point.as_str(), MntFlags::MNT_DETACH);
            // SAFETY: open returned a new descriptor that nothing else owns.
            root.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }).map_err(io::Error::from)
        });
    let _ = std::fs::remove_dir(&point);
    opened
}

fn hierarchy() -> Option<&'static OwnedFd> {
    HIERARCHY.get().and_then(Option::as_ref)
}

fn open_at(root: &OwnedFd, path: &str, flags: OFlag) -> io::Result<File> {
    let fd = nix::fcntl::openat(Some(root.as_raw_fd()), path, flags | OFlag::O_CLOEXEC, Mode::empty())?;
    // SAFETY: openat returned a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Writes a control file in one write, as cgroupfs wants it.
fn write_at(root: &OwnedFd, path: &str, value: &str) -> io::Result<()> {
    open_at(root, path, OFlag::O_WRONLY)?.write_all(value.as_bytes())
}

/// Moves the calling thread (only it) into the cgroup at `dir` ("" for the
/// root). Its children are born where it is.
fn move_this_thread(root: &OwnedFd, dir: &str) -> io::Result<()> {
    let tasks = if dir.is_empty() { "tasks".to_string() } else { format!("{dir}/tasks") };
    write_at(root, &tasks, &nix::unistd::gettid().to_string())
}

/// One command's cgroup. Dropping it removes the cgroup, at once when it is
/// empty, else once its last process is gone.
#[derive(Debug)]
pub struct CommandGroup {
    name: String,
}

/// Runs `spawn` on a thread inside a new cgroup, so whatever it starts is
/// born there. Returns its result and the cgroup (None when commands cannot
/// be given one: `spawn` then runs as it is).
pub fn spawn_in_new_group<T>(spawn: impl FnOnce() -> T) -> (T, Option<CommandGroup>) {
    let Some(root) = hierarchy() else { return (spawn(), None) };
    remove_lingering(root);
    let name = format!("cmd-{}", NEXT.fetch_add(1, Ordering::Relaxed));
    let made = nix::sys::stat::mkdirat(Some(root.as_raw_fd()), name.as_str(), Mode::from_bits_truncate(0o755))
        .map_err(io::Error::from)
        .and_then(|()| write_at(root, &format!("{name}/pids.max"), &MAX_PROCESSES.to_string()))
        .and_then(|()| move_this_thread(root, &name));
    let group = CommandGroup { name };
    if let Err(err) = made {
        eprintln!("space-agent: a cgroup for a command: {err}");
        drop(group);
        return (spawn(), None);
    }
    let spawned = spawn();
    if let Err(err) = move_this_thread(root, "") {
        // The thread stays behind; `members` never lists the agent, so a
        // kill of this command cannot reach it.
        eprintln!("space-agent: leaving a command's cgroup: {err}");
    }
    (spawned, Some(group))
}

/// Runs `spawn` on a thread inside the cgroup of process `pid` (a command
/// the agent started, or what it started), so whatever it starts belongs
/// to that command: a kill of the command reaches it. Where `pid` is in no
/// command's cgroup, or commands have none, `spawn` runs as it is.
pub fn spawn_in_group_of<T>(pid: i32, spawn: impl FnOnce() -> T) -> T {
    let Some(root) = hierarchy() else { return spawn() };
    let listing = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let Some(name) = command_group_in(&listing) else { return spawn() };
    if let Err(err) = move_this_thread(root, &name) {
        eprintln!("space-agent: joining {name}: {err}");
        return spawn();
    }
    let spawned = spawn();
    if let Err(err) = move_this_thread(root, "") {
        eprintln!("space-agent: leaving a command's cgroup: {err}");
    }
    spawned
}

/// The command's cgroup (`cmd-N`) a `/proc/PID/cgroup` listing names in
/// the `pids` hierarchy, if any.
fn command_group_in(listing: &str) -> Option<String> {
    listing.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        if !controllers.split(',').any(|c| c == "pids") {
            return None;
        }
        let name = path.strip_prefix('/')?;
        let number = name.strip_prefix("cmd-")?;
        (!number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())).then(|| name.to_string())
    })
}

impl CommandGroup {
    /// The processes in the cgroup now, never the agent.
    pub fn members(&self) -> Vec<i32> {
        let Some(root) = hierarchy() else { return Vec::new() };
        let mut text = String::new();
        let read = open_at(root, &format!("{}/cgroup.procs", self.name), OFlag::O_RDONLY)
            .and_then(|mut file| file.read_to_string(&mut text));
        if read.is_err() {
            return Vec::new();
        }
        parse_members(&text, std::process::id() as i32)
    }

    /// Sends `signal` to every process in the cgroup once.
    pub fn signal_all(&self, signal: Signal) {
        for pid in self.members() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }

    /// Kills every process in the cgroup, sweeping until none is left or
    /// [`KILL_DEADLINE`] passes. Returns how many are left.
    pub fn kill_all(&self) -> usize {
        let deadline = Instant::now() + KILL_DEADLINE;
        loop {
            let members = self.members();
            if members.is_empty() || Instant::now() >= deadline {
                if !members.is_empty() {
                    eprintln!("space-agent: {} processes of {} outlived its kill", members.len(), self.name);
                }
                return members.len();
            }
            for pid in members {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            }
            std::thread::sleep(SWEEP_PAUSE);
        }
    }
}

impl Drop for CommandGroup {
    fn drop(&mut self) {
        let Some(root) = hierarchy() else { return };
        if remove(root, &self.name).is_err() {
            LINGERING.lock().unwrap_or_else(|e| e.into_inner()).push(std::mem::take(&mut self.name));
        }
    }
}

fn remove(root: &OwnedFd, name: &str) -> nix::Result<()> {
    match unlinkat(Some(root.as_raw_fd()), name, UnlinkatFlags::RemoveDir) {
        Err(nix::errno::Errno::ENOENT) => Ok(()),
        other => other,
    }
}

/// Removes the cgroups of ended commands whose processes are all gone.
fn remove_lingering(root: &OwnedFd) {
    LINGERING.lock().unwrap_or_else(|e| e.into_inner()).retain(|name| remove(root, name).is_err());
}

/// The pids of a `cgroup.procs` listing, without `agent`.
fn parse_members(listing: &str, agent: i32) -> Vec<i32> {
    listing.split_whitespace().filter_map(|pid| pid.parse().ok()).filter(|&pid| pid != agent && pid > 1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_is_never_a_member() {
        assert_eq!(parse_members("1\n17\n42\n", 1), vec![17, 42]);
        assert_eq!(parse_members("5\n17\nx\n", 17), vec![5]);
        assert!(parse_members("", 1).is_empty());
    }

    #[test]
    fn only_a_commands_own_cgroup_is_joined() {
        assert_eq!(command_group_in("3:cpu:/\n5:pids:/cmd-12\n").as_deref(), Some("cmd-12"));
        assert_eq!(command_group_in("5:pids:/\n"), None);
        assert_eq!(command_group_in("5:pids:/cmd-1/../x\n"), None);
        assert_eq!(command_group_in("5:memory:/cmd-3\n"), None);
    }

    #[test]
    fn without_a_hierarchy_a_spawn_runs_as_it_is() {
        // The unit tests never call `init`: no hierarchy, no cgroup.
        let (value, group) = spawn_in_new_group(|| 7);
        assert_eq!(value, 7);
        assert!(group.is_none());
    }
}
