//! Spawning and reaping child processes in a process that reaps orphans.
//!
//! Both the guest agent (PID 1 of a sandbox) and the server (a child
//! subreaper, so that `runsc` sandbox processes are reaped promptly) inherit
//! orphans they never spawned. Reaping them with `waitpid(-1)` would steal the
//! exit status of children spawned by `std::process`, so every child of such a
//! process must be spawned through [`Reaper::spawn`]: one thread reaps every
//! child and hands each status to whoever registered that pid.
//!
//! This crate owns no policy: it never kills, never retries, never logs.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// The process called `exit` with this code.
    Exited(i32),
    /// The process was killed by this signal number.
    Signaled(i32),
}

impl ExitStatus {
    pub fn success(self) -> bool {
        self == ExitStatus::Exited(0)
    }
}

#[derive(Default)]
struct Registry {
    waiters: HashMap<i32, Sender<ExitStatus>>,
    /// Statuses reaped before anyone registered their pid, and when: a
    /// child spawned without the lock held (a fork and exec can take long
    /// on a loaded host, and every other spawn would queue behind it) may
    /// end before its spawner registers it. Orphans' statuses land here
    /// too and are dropped after [`UNCLAIMED_KEPT`].
    unclaimed: HashMap<i32, (ExitStatus, Instant)>,
    /// Bumped on every spawn, so the reaper never sleeps through a new child.
    generation: u64,
}

/// How long a status nobody registered is kept for its spawner.
const UNCLAIMED_KEPT: Duration = Duration::from_secs(10);
/// Unclaimed statuses kept at the most (many orphans end in a sandbox).
const UNCLAIMED_MAX: usize = 4096;

/// The process-wide reaper. Obtain it with [`Reaper::global`].
pub struct Reaper {
    registry: Mutex<Registry>,
    spawned: Condvar,
}

/// A child spawned through the reaper; its status arrives on `exit`.
pub struct ReapedChild {
    pub child: Child,
    exit: Receiver<ExitStatus>,
}

impl ReapedChild {
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Blocks until the child has been reaped.
    pub fn wait(&self) -> ExitStatus {
        // The reaper thread never drops a registered sender before sending.
        self.exit.recv().unwrap_or(ExitStatus::Signaled(9))
    }

    /// Waits at most `timeout`; `None` if the child is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitStatus> {
        self.exit.recv_timeout(timeout).ok()
    }

    /// The receiving end, for callers that wait elsewhere.
    pub fn into_parts(self) -> (Child, Receiver<ExitStatus>) {
        (self.child, self.exit)
    }
}

impl Reaper {
    /// The reaper of this process, started on first use.
    pub fn global() -> &'static Reaper {
        static REAPER: OnceLock<&'static Reaper> = OnceLock::new();
        REAPER.get_or_init(|| {
            let reaper: &'static Reaper =
                Box::leak(Box::new(Reaper { registry: Mutex::new(Registry::default()), spawned: Condvar::new() }));
            thread::Builder::new()
                .name("reaper".into())
                .spawn(move || reaper.reap_forever())
                .expect("spawning the reaper thread");
            reaper
        })
    }

    /// Spawns `command`; its exit status is delivered to the returned child.
    /// Never call `Child::wait` on it: the reaper owns the status.
    pub fn spawn(&self, command: &mut Command) -> io::Result<ReapedChild> {
        let began = Instant::now();
        let child = command.spawn()?;
        let exit = self.register(child.id() as i32, began);
        Ok(ReapedChild { child, exit })
    }

    /// Registers a child started by `spawn` (which returns its pid), for
    /// callers that spawn without `std::process` (for example with
    /// `posix_spawn`).
    pub fn spawn_with(&self, spawn: impl FnOnce() -> io::Result<u32>) -> io::Result<(u32, Receiver<ExitStatus>)> {
        let began = Instant::now();
        let pid = spawn()?;
        Ok((pid, self.register(pid as i32, began)))
    }

    /// Registers `pid`, spawned after `began`: its status arrives on the
    /// receiver, also if the reaper already took it (a status reaped
    /// before `began` is another, older process's with a reused pid).
    fn register(&self, pid: i32, began: Instant) -> Receiver<ExitStatus> {
        let (tx, rx) = mpsc::channel();
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        match registry.unclaimed.remove(&pid) {
            Some((exit, reaped)) if reaped >= began => {
                let _ = tx.send(exit);
            }
            _ => {
                registry.waiters.insert(pid, tx);
            }
        }
        registry.generation += 1;
        drop(registry);
        self.spawned.notify_all();
        rx
    }

    /// Runs `command` to completion, capturing stdout and stderr.
    pub fn output(&self, command: &mut Command) -> io::Result<Output> {
        use std::io::Read;
        use std::process::Stdio;
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut reaped = self.spawn(command)?;
        let mut stderr_pipe = reaped.child.stderr.take();
        let stderr_reader = thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(pipe) = stderr_pipe.as_mut() {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        });
        let mut stdout = Vec::new();
        if let Some(pipe) = reaped.child.stdout.as_mut() {
            pipe.read_to_end(&mut stdout)?;
        }
        let stderr = stderr_reader.join().unwrap_or_default();
        let status = reaped.wait();
        Ok(Output { status, stdout, stderr })
    }

    fn reap_forever(&self) {
        loop {
            let generation = self.registry.lock().unwrap_or_else(|e| e.into_inner()).generation;
            match waitpid(Pid::from_raw(-1), None) {
                Ok(status) => {
                    let (pid, exit) = match status {
                        WaitStatus::Exited(pid, code) => (pid, ExitStatus::Exited(code)),
                        WaitStatus::Signaled(pid, sig, _) => (pid, ExitStatus::Signaled(sig as i32)),
                        _ => continue,
                    };
                    let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
                    match registry.waiters.remove(&pid.as_raw()) {
                        Some(waiter) => {
                            let _ = waiter.send(exit);
                        }
                        None => {
                            let now = Instant::now();
                            let keep = if registry.unclaimed.len() < UNCLAIMED_MAX {
                                UNCLAIMED_KEPT
                            } else {
                                Duration::from_secs(1)
                            };
                            registry.unclaimed.retain(|_, (_, at)| now.duration_since(*at) < keep);
                            registry.unclaimed.insert(pid.as_raw(), (exit, now));
                        }
                    }
                }
                Err(Errno::ECHILD) => {
                    let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
                    // Sleep until something is spawned; the timeout only
                    // bounds how long an adopted orphan may stay a zombie.
                    let _ = self
                        .spawned
                        .wait_timeout_while(registry, Duration::from_millis(500), |r| r.generation == generation);
                }
                Err(Errno::EINTR) => {}
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

/// The result of [`Reaper::output`].
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Makes this process a child subreaper, so orphaned descendants (such as
/// `runsc` sandbox processes) are re-parented to it and reaped by [`Reaper`].
pub fn become_subreaper() -> io::Result<()> {
    nix::sys::prctl::set_child_subreaper(true).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_reaped_before_it_is_registered_still_gets_its_status() {
        let reaper = Reaper::global();
        let (_, exit) = reaper
            .spawn_with(|| {
                let child = Command::new("sh").args(["-c", "exit 5"]).spawn()?;
                // The reaper takes its status before the pid is registered.
                let deadline = Instant::now() + Duration::from_secs(10);
                let gone = || !std::path::Path::new(&format!("/proc/{}", child.id())).exists();
                while !gone() && Instant::now() < deadline {
                    thread::sleep(Duration::from_millis(5));
                }
                assert!(gone(), "the reaper did not reap it");
                Ok(child.id())
            })
            .unwrap();
        assert_eq!(exit.recv_timeout(Duration::from_secs(10)), Ok(ExitStatus::Exited(5)));
    }

    #[test]
    fn statuses_reach_their_own_waiters() {
        let reaper = Reaper::global();
        let a = reaper.spawn(Command::new("sh").args(["-c", "exit 3"])).unwrap();
        let b = reaper.spawn(Command::new("sh").args(["-c", "kill -TERM $$"])).unwrap();
        assert_eq!(a.wait(), ExitStatus::Exited(3));
        assert_eq!(b.wait(), ExitStatus::Signaled(15));
    }

    #[test]
    fn output_captures_both_streams() {
        let out = Reaper::global().output(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 7"])).unwrap();
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert_eq!(out.status, ExitStatus::Exited(7));
    }
}
