//! The memory watcher: a process that uses more memory than the sandbox
//! has is killed inside the sandbox, as a kernel's OOM killer would, before
//! the engine's own limit (the host cgroup of gVisor's sentry, or the
//! microVM's memory) is reached and the whole sandbox has to stop.
//!
//! Runtimes reserve far more address space than they use (the JVM's heap,
//! Go's arenas, an 8 GiB `mmap` that is never touched), so the limit is on
//! memory in use, never on address space. The watcher reads how much of
//! the sandbox's memory is in use — `/proc/meminfo`, which gVisor's sentry
//! and a guest kernel both keep — often while usage is high and rarely
//! while it is low, so an idle sandbox costs next to nothing. Past the
//! sandbox's `memory_mib` it kills the process with the largest resident
//! set (never the agent) and remembers its process group, so the command
//! that owned it reports it was killed for memory. While nothing but the
//! agent runs, nothing can allocate: the watcher then looks once a second
//! (each look wakes the sandbox's kernel, which an idle sandbox should not
//! pay ten times a second), and at once when a command starts.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The sandbox's memory in bytes (0: not told yet, nothing is enforced).
static LIMIT: AtomicU64 = AtomicU64::new(0);
/// Process groups in which the watcher killed a process.
static KILLED_GROUPS: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

/// How often usage is read while it is below [`BUSY_SHARE`] of the limit:
/// a hog touching memory at ~2 GB/s must not cross from there past the
/// engine's limit between two reads.
const CALM_INTERVAL: Duration = Duration::from_millis(100);
/// How often while it is above: a hog allocates hundreds of MiB a second,
/// and the engine's headroom over `memory_mib` is ~128 MiB.
const BUSY_INTERVAL: Duration = Duration::from_millis(10);
/// How often while it is above [`CLOSE_SHARE`]: several hogs on a loaded
/// host can cross the rest of the headroom within a busy interval.
const CLOSE_INTERVAL: Duration = Duration::from_millis(2);
/// The share of the limit (in 1/64ths) above which usage is read often.
const BUSY_SHARE: u64 = 16;
/// The share of the limit (in 1/64ths) above which it is read very often.
const CLOSE_SHARE: u64 = 48;

/// How often usage is read while no process but the agent runs.
const ALONE_INTERVAL: Duration = Duration::from_secs(1);
/// A process started this recently may not show in `/proc` yet.
const SPAWN_GRACE: Duration = Duration::from_secs(1);
/// When a process was last started, and the watcher's bell for it.
static STARTED: Mutex<Option<Instant>> = Mutex::new(None);
static STARTING: Condvar = Condvar::new();

/// Called before the agent starts a process: the watcher looks often again.
pub fn process_starting() {
    *STARTED.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    STARTING.notify_all();
}

/// Waits `interval`, or (nothing but the agent runs) up to
/// [`ALONE_INTERVAL`] unless a process starts meanwhile.
fn pause(interval: Duration) {
    if interval != CALM_INTERVAL || !alone() {
        return std::thread::sleep(interval);
    }
    let started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    if started.is_some_and(|at| at.elapsed() < SPAWN_GRACE) {
        drop(started);
        return std::thread::sleep(interval);
    }
    let last = *started;
    let _ = STARTING.wait_timeout_while(started, ALONE_INTERVAL, |now| *now == last);
}

/// Whether the agent is the only process in the sandbox.
fn alone() -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else { return false };
    let me = std::process::id();
    let pid = |entry: std::fs::DirEntry| entry.file_name().to_str()?.parse::<u32>().ok();
    entries.flatten().filter_map(pid).all(|p| p == me)
}

/// Sets the sandbox's memory (from the host's welcome; a clone may get
/// another size).
pub fn set_limit(memory_mib: Option<u32>) {
    LIMIT.store(memory_mib.map_or(0, |mib| u64::from(mib) << 20), Ordering::Relaxed);
}

/// Starts the watcher thread.
pub fn start() {
    let spawned = std::thread::Builder::new().name("memory".into()).spawn(|| loop {
        let limit = LIMIT.load(Ordering::Relaxed);
        let used = if limit == 0 { None } else { in_use() };
        let interval = match used {
            Some(used) if used >= limit => {
                kill_largest(used, limit);
                CLOSE_INTERVAL
            }
            Some(used) if used * 64 >= limit * CLOSE_SHARE => CLOSE_INTERVAL,
            Some(used) if used * 64 >= limit * BUSY_SHARE => BUSY_INTERVAL,
            _ => CALM_INTERVAL,
        };
        pause(interval);
    });
    if let Err(err) = spawned {
        eprintln!("space-agent: starting the memory watcher: {err}");
    }
}

/// In a microVM the guest kernel's own OOM killer stands behind the
/// watcher: it must never pick the agent, and must be free to pick any
/// command (which would otherwise inherit the agent's exemption).
pub fn exempt_agent_from_kernel_oom() {
    if let Err(err) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        eprintln!("space-agent: exempting itself from the OOM killer: {err}");
    }
}

/// Gives a command the ordinary OOM score again (see above).
pub fn reset_kernel_oom_score(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "0");
}

/// Whether the watcher killed a process of `pgid` (and forgets it).
pub fn take_killed(pgid: i32) -> bool {
    KILLED_GROUPS.lock().unwrap_or_else(|e| e.into_inner()).as_mut().is_some_and(|groups| groups.remove(&pgid))
}

/// Memory in use in the sandbox, in bytes: what is neither free nor
/// reclaimable page cache. File data in memory-backed filesystems (tmpfs,
/// `/dev/shm`) counts as in use: it cannot be dropped.
fn in_use() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(':'))?;
        line[name.len() + 1..].split_whitespace().next()?.parse::<u64>().ok().map(|kib| kib << 10)
    };
    let total = field("MemTotal")?;
    let available = field("MemAvailable").or_else(|| Some(field("MemFree")? + field("Cached")?))?;
    Some(total.saturating_sub(available))
}

/// The kills the watcher made that may not show in usage yet — victims
/// that still hold memory (a process dies a little after SIGKILL, the more
/// so on a loaded host) or whose memory the kernel under the sandbox has
/// not given back yet (gVisor's sentry releases a dead process's pages in
/// the background, seconds later on a loaded host) — and when the last
/// kill was and what the other processes used then.
struct Kills {
    victims: Vec<Victim>,
    last: Option<(Instant, u64)>,
}
/// A process the watcher killed, and the most memory it was seen to hold:
/// what may still count in usage until the kernel has freed it.
struct Victim {
    pid: i32,
    peak: u64,
}
static KILLS: Mutex<Kills> = Mutex::new(Kills { victims: Vec::new(), last: None });
/// How long after a kill usage may stay high before another process is
/// killed, while nothing else grows: the kernel under the sandbox frees a
/// dead process's memory some time after the process is gone.
const AFTER_KILL: Duration = Duration::from_secs(3);
/// Growth in use since the last kill that shows another process is still
/// allocating: then it is not worth waiting for the victims' memory.
const STILL_GROWING: u64 = 16 << 20;

/// Whether to wait for earlier kills to free memory rather than kill
/// again: a victim still holds memory, or the last kill was less than
/// [`AFTER_KILL`] ago — unless the other processes' use (all but the
/// victims) has grown by [`STILL_GROWING`] since it. Then they are still
/// allocating, and waiting for a slow death would let them carry the
/// sandbox past the engine's limit (which stops the whole sandbox, or
/// under gVisor kills the host process behind one of its processes and
/// leaves that process hung). A victim's own memory is not theirs: a
/// killed JVM's threads go on touching memory until the kill lands, and
/// its pages count in usage until the kernel has taken them back; neither
/// is a reason to kill a neighbour.
fn wait_for_earlier_kills(victims_dying: bool, last: Option<(Duration, u64)>, others: u64) -> bool {
    let Some((since, others_then)) = last else { return false };
    (victims_dying || since < AFTER_KILL) && others < others_then.saturating_add(STILL_GROWING)
}

/// What the processes other than the victims use of `used`: each victim's
/// peak taken off (once it is gone, its memory may still count).
fn others_use(used: u64, victims: &[Victim]) -> u64 {
    used.saturating_sub(victims.iter().map(|victim| victim.peak).sum())
}

/// Kills the process with the largest resident set, as the kernel's OOM
/// killer would pick it (never one already killed), and records its
/// process group.
fn kill_largest(used: u64, limit: u64) {
    let mut kills = KILLS.lock().unwrap_or_else(|e| e.into_inner());
    let mut dying = false;
    for victim in &mut kills.victims {
        let rss = resident(victim.pid).unwrap_or(0);
        victim.peak = victim.peak.max(rss);
        dying |= rss > 0;
    }
    let last = kills.last.map(|(at, others_then)| (at.elapsed(), others_then));
    if wait_for_earlier_kills(dying, last, others_use(used, &kills.victims)) {
        return;
    }
    // The earlier victims' memory has had its time: gone, or not theirs.
    kills.victims.retain(|victim| resident(victim.pid).is_some_and(|rss| rss > 0));
    let me = std::process::id() as i32;
    let killed = |pid: i32| kills.victims.iter().any(|victim| victim.pid == pid);
    let Some((pid, rss)) =
        processes().filter(|&(pid, _)| pid != me && pid > 1 && !killed(pid)).max_by_key(|&(_, rss)| rss)
    else {
        return;
    };
    // SAFETY: getpgid and kill take plain integers and touch no memory of ours.
    let pgid = unsafe { libc::getpgid(pid) };
    if pgid > 0 {
        KILLED_GROUPS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert(pgid);
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    kills.victims.push(Victim { pid, peak: rss });
    // What the others used then: the victims (this one too) taken off.
    kills.last = Some((Instant::now(), others_use(used, &kills.victims)));
    eprintln!(
        "space-agent: out of memory ({} of {} MiB in use): killed process {pid} ({} MiB resident)",
        used >> 20,
        limit >> 20,
        rss >> 20
    );
}

/// Every process's pid and resident set in bytes.
fn processes() -> impl Iterator<Item = (i32, u64)> {
    std::fs::read_dir("/proc").into_iter().flatten().filter_map(|entry| {
        let pid: i32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        Some((pid, resident(pid)?))
    })
}

/// A process's resident set in bytes (a zombie has none).
fn resident(pid: i32) -> Option<u64> {
    const PAGE: u64 = 4096;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    statm.split_whitespace().nth(1)?.parse::<u64>().ok().map(|pages| pages * PAGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_this_kernel() {
        let used = in_use().expect("/proc/meminfo has MemTotal and MemAvailable");
        assert!(used > 0);
    }

    #[test]
    fn a_slow_death_is_waited_for_only_while_usage_holds_still() {
        const MIB: u64 = 1 << 20;
        let ms = Duration::from_millis;
        assert!(!wait_for_earlier_kills(false, None, 300 * MIB), "no kill yet");
        // The victim still holds memory: wait, however long ago it was
        // killed, while usage stays where it was...
        assert!(wait_for_earlier_kills(true, Some((ms(5000), 300 * MIB)), 310 * MIB));
        // ...but not while others carry on allocating.
        assert!(!wait_for_earlier_kills(true, Some((ms(20), 300 * MIB)), 316 * MIB));
        // Gone a moment ago: its memory may not be free yet.
        assert!(wait_for_earlier_kills(false, Some((ms(200), 300 * MIB)), 300 * MIB));
        assert!(!wait_for_earlier_kills(false, Some((ms(200), 300 * MIB)), 320 * MIB));
        // Gone long ago and usage still over: the next one goes.
        assert!(!wait_for_earlier_kills(false, Some((AFTER_KILL + ms(500), 300 * MIB)), 290 * MIB));
    }

    /// A victim's memory is not another process allocating: while it is
    /// dying (a JVM's threads touch memory until the kill lands) and after
    /// it is gone (the kernel under the sandbox takes its pages back
    /// later), what is compared leaves its peak out.
    #[test]
    fn a_victims_own_memory_kills_no_neighbour() {
        const MIB: u64 = 1 << 20;
        let ms = Duration::from_millis;
        // Killed at 600 MiB in use, 500 of them its own: the others had 100.
        let mut victims = vec![Victim { pid: -1, peak: 500 * MIB }];
        assert_eq!(others_use(600 * MIB, &victims), 100 * MIB);
        // It grew to 560 MiB before dying; usage went to 660 MiB.
        victims[0].peak = 560 * MIB;
        assert!(wait_for_earlier_kills(true, Some((ms(300), 100 * MIB)), others_use(660 * MIB, &victims)));
        // Gone, its pages still counted two seconds on: still waiting.
        assert!(wait_for_earlier_kills(false, Some((ms(2000), 100 * MIB)), others_use(660 * MIB, &victims)));
        // But a neighbour that grows by 16 MiB meanwhile is allocating.
        assert!(!wait_for_earlier_kills(false, Some((ms(2000), 100 * MIB)), others_use(676 * MIB, &victims)));
    }

    #[test]
    fn a_killed_group_is_reported_once() {
        KILLED_GROUPS.lock().unwrap().get_or_insert_with(HashSet::new).insert(4242);
        assert!(take_killed(4242));
        assert!(!take_killed(4242));
    }
}
