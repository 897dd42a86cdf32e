//! Memory relief for gVisor sandboxes under cgroup v1.
//!
//! The agent's memory watcher kills a process that takes a sandbox past
//! its `memory_mib`, from inside, before the host cgroup's limit (that plus
//! the gVisor engine's overhead) is reached. It polls, and on a
//! loaded host, with several processes allocating at once, it can be late.
//! The kernel's OOM killer would then pick a host process of the sandbox:
//! the sentry (the whole sandbox stops) or, as often, the host process
//! behind one of its guest processes — and gVisor leaves that guest
//! process hung for good (a command that never ends).
//!
//! So the kernel's OOM killer is turned off in each sandbox's memory
//! cgroup: at the limit, what allocates waits instead, and the cgroup's OOM
//! event (an eventfd, no polling) wakes one thread here, which lends the
//! sandbox [`OVERDRAFT`] more. The watcher runs again and kills inside;
//! once usage is back under the limit the loan is taken back. A sandbox
//! that reaches the limit again while it holds the loan is past saving:
//! its sentry is made the kernel's choice and the OOM killer turned back
//! on, so it stops as a whole, counted as killed for memory (what the
//! engine reports as the sandbox's stop reason).
//!
//! Only sandboxes whose state is under a registered runsc root are looked
//! after: other servers on the host (tests run several) look after theirs.

use std::collections::HashMap;
use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

/// What a sandbox at its limit is lent, once, for its watcher to act.
pub const OVERDRAFT: u64 = 128 << 20;
/// The cgroup v1 memory hierarchy's directory holding the sandboxes'.
const PARENT: &str = "/sys/fs/cgroup/memory/space";
/// How often new sandboxes are looked for.
const RESCAN: Duration = Duration::from_secs(1);
/// How often a sandbox holding a loan is checked for giving it back.
const WHILE_LENT: Duration = Duration::from_millis(20);

/// runsc roots (`--root`) of this process's engines.
static ROOTS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Wakes the thread to look for new sandboxes at once (set once it runs).
static KICK: OnceLock<EventFd> = OnceLock::new();

/// Looks after the sandboxes under runsc root `state_dir` from now on (on
/// cgroup v1 hosts; elsewhere nothing is done).
pub fn watch(state_dir: &Path) {
    if !Path::new("/sys/fs/cgroup/memory").is_dir() {
        return;
    }
    let mut roots = ROOTS.lock().unwrap_or_else(|e| e.into_inner());
    if !roots.iter().any(|r| r == state_dir) {
        roots.push(state_dir.to_path_buf());
    }
    drop(roots);
    let mut first = false;
    KICK.get_or_init(|| {
        first = true;
        EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).expect("an eventfd")
    });
    if first {
        let spawned = std::thread::Builder::new().name("oom-relief".into()).spawn(run);
        if let Err(err) = spawned {
            tracing::warn!("starting the memory relief thread: {err}");
        }
    }
}

/// A sandbox started (or was restored): look after it now, not at the
/// next rescan.
pub fn started() {
    if let Some(kick) = KICK.get() {
        let _ = kick.write(1);
    }
}

/// A sandbox's memory cgroup being looked after.
struct Watched {
    dir: PathBuf,
    /// The cgroup's inode: a suspended and restored sandbox gets a new
    /// cgroup at the same path, which is looked after anew.
    ino: u64,
    /// runsc's state file of the sandbox (it names the sentry's pid).
    state: PathBuf,
    /// Signalled by the kernel on each OOM of the cgroup (and its removal).
    event: EventFd,
    /// Kept open: the registration lives as long as this file.
    _control: OwnedFd,
    /// The limit before a loan, and when it was lent.
    lent: Option<(u64, Instant)>,
}

fn run() {
    let Some(kick) = KICK.get() else { return };
    let mut watched: HashMap<String, Watched> = HashMap::new();
    let mut scanned: Option<Instant> = None;
    loop {
        let kicked = kick.read().is_ok();
        if kicked || scanned.is_none_or(|at| at.elapsed() >= RESCAN) {
            rescan(&mut watched);
            scanned = Some(Instant::now());
        }
        let lending = watched.values().any(|w| w.lent.is_some());
        let wait = if lending { WHILE_LENT } else { RESCAN };
        let ids: Vec<String> = watched.keys().cloned().collect();
        let signalled: Vec<String> = {
            let mut fds: Vec<PollFd> =
                ids.iter().map(|id| PollFd::new(watched[id].event.as_fd(), PollFlags::POLLIN)).collect();
            fds.push(PollFd::new(kick.as_fd(), PollFlags::POLLIN));
            let timeout = PollTimeout::try_from(wait.as_millis() as i32).unwrap_or(PollTimeout::NONE);
            match nix::poll::poll(&mut fds, timeout) {
                Ok(0) | Err(_) => Vec::new(),
                Ok(_) => ids
                    .iter()
                    .zip(&fds)
                    .filter(|(_, fd)| fd.revents().is_some_and(|r| r.intersects(PollFlags::POLLIN)))
                    .map(|(id, _)| id.clone())
                    .collect(),
            }
        };
        for id in &signalled {
            if let Some(w) = watched.get(id) {
                let _ = w.event.read();
            }
        }
        for (id, w) in watched.iter_mut() {
            if signalled.contains(id) || w.lent.is_some() {
                relieve(id, w);
            }
        }
        watched.retain(|_, w| w.current());
    }
}

/// Starts looking after the sandboxes of the registered roots that are
/// not looked after yet.
fn rescan(watched: &mut HashMap<String, Watched>) {
    let Ok(entries) = fs::read_dir(PARENT) else { return };
    let roots = ROOTS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().map(str::to_string) else { continue };
        if watched.get(&id).is_some_and(Watched::current) {
            continue;
        }
        let Some(state) = roots.iter().map(|root| root.join(format!("{id}_sandbox:{id}.state"))).find(|s| s.exists())
        else {
            continue;
        };
        match watch_cgroup(&entry.path(), state) {
            Ok(mut w) => {
                // It may have reached its limit while nobody looked after it
                // (between a server's stop and the next one's start).
                relieve(&id, &mut w);
                watched.insert(id, w);
            }
            Err(err) => tracing::debug!(sandbox = %id, "looking after its memory cgroup: {err}"),
        }
    }
}

/// Turns the cgroup's OOM killer off and registers for its OOM events.
fn watch_cgroup(dir: &Path, state: PathBuf) -> std::io::Result<Watched> {
    let control: OwnedFd = fs::File::open(dir.join("memory.oom_control"))?.into();
    let event = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
    fs::write(dir.join("cgroup.event_control"), format!("{} {}", event.as_fd().as_raw_fd(), control.as_raw_fd()))?;
    fs::write(dir.join("memory.oom_control"), "1")?;
    let ino = fs::metadata(dir)?.ino();
    Ok(Watched { dir: dir.to_path_buf(), ino, state, event, _control: control, lent: None })
}

impl Watched {
    /// Whether its cgroup is still there (and not another at its path).
    fn current(&self) -> bool {
        fs::metadata(&self.dir).is_ok_and(|m| m.ino() == self.ino)
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn under_oom(dir: &Path) -> bool {
    fs::read_to_string(dir.join("memory.oom_control"))
        .map(|text| text.lines().any(|line| line.trim() == "under_oom 1"))
        .unwrap_or(false)
}

/// Sets the cgroup's memory and memory+swap limits, in the order v1 needs
/// (memory+swap never below memory).
fn set_limits(dir: &Path, bytes: u64, raising: bool) -> std::io::Result<()> {
    let (first, second) = if raising {
        ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes")
    } else {
        ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
    };
    for file in [first, second] {
        let path = dir.join(file);
        // memsw is there only when swap accounting is on.
        if path.exists() {
            fs::write(&path, bytes.to_string())?;
        }
    }
    Ok(())
}

/// Lends a sandbox at its limit [`OVERDRAFT`], takes a loan back once usage
/// is under the limit again, or stops a sandbox that is at the limit while
/// it holds one.
fn relieve(id: &str, w: &mut Watched) {
    let at_limit = under_oom(&w.dir);
    match w.lent {
        None if at_limit => {
            let Some(limit) = read_u64(&w.dir.join("memory.limit_in_bytes")) else { return };
            match set_limits(&w.dir, limit + OVERDRAFT, true) {
                Ok(()) => {
                    tracing::info!(sandbox = %id, limit_mib = limit >> 20, "at its memory limit: lent more while it frees some");
                    w.lent = Some((limit, Instant::now()));
                }
                Err(err) => {
                    tracing::warn!(sandbox = %id, "lending memory: {err}");
                    give_up(id, w);
                }
            }
        }
        None => {}
        Some((limit, since)) => {
            let used = read_u64(&w.dir.join("memory.usage_in_bytes")).unwrap_or(u64::MAX);
            // `under_oom` stays set until the tasks that waited at the old
            // limit wake, which under load takes longer than a check's
            // period: only a sandbox that also uses well past its old limit
            // reached the loan's end. (Taking the stale flag for that gave
            // a sandbox up right after its loan: its killer back on and
            // the loan never taken back.)
            if at_limit && used > limit + OVERDRAFT / 2 {
                give_up(id, w);
            } else if used < limit && set_limits(&w.dir, limit, false).is_ok() {
                tracing::info!(sandbox = %id, ms = since.elapsed().as_millis() as u64, "back under its memory limit");
                w.lent = None;
            }
        }
    }
}

/// Stops a sandbox that cannot get under its limit: its sentry becomes the
/// OOM killer's choice, and the killer is turned back on.
fn give_up(id: &str, w: &mut Watched) {
    tracing::warn!(sandbox = %id, "still at its memory limit with more lent: stopped for memory");
    // The host processes behind the guest's processes are forks of the
    // sentry, with its command line: the state file tells which it is.
    let state: serde_json::Value =
        fs::read(&w.state).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default();
    if let Some(pid) = state["sandbox"]["pid"].as_u64() {
        let _ = fs::write(format!("/proc/{pid}/oom_score_adj"), "1000");
    }
    let _ = fs::write(w.dir.join("memory.oom_control"), "0");
    w.lent = None;
}
