//! Running one command: spawn, pump its output, report how it ended.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use space_process::{ExitStatus, Reaper};
use space_proto::{ExecFailed, ExecFailure, ExecRequest, Exited, Frame, FrameKind, Started, Welcome, MAX_OUTPUT_CHUNK};

use crate::cgroup::{self, CommandGroup, MAX_PROCESSES};
use crate::users::{self, Account};
use crate::{pool, spawn, Sessions};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// After the process exits, how long a background job of it (which holds
/// its pipes) may go on adding output. After that the pumps take what is in
/// the pipes and stop, so a session ends when its own process does. What
/// the process itself wrote is in the pipes by the time it is reaped: that
/// is always sent before the exit, however late the pumps run.
const DRAIN_GRACE: Duration = Duration::from_millis(250);
/// The most a pump takes from its pipe once told to finish: a background
/// job that keeps writing cannot hold the exit back.
const FINISH_LIMIT: usize = 1 << 20;
/// How long a command's processes have to end after a TERM before every
/// one of them left is killed.
const TERM_GRACE: Duration = Duration::from_secs(10);

/// The host's handle on a running command.
pub struct SessionControl {
    pgid: i32,
    /// Every process the command started, wherever it went (None: the
    /// sandbox gives commands no cgroup; the process group is all there is).
    group: Option<Arc<CommandGroup>>,
    gate: Arc<StreamGate>,
    /// Feeds a writer thread, so a process that does not read its stdin
    /// never stalls the agent's connection. Dropping it closes stdin.
    // The queue is not bounded yet: flow control for stdin is future work.
    stdin: Option<mpsc::Sender<Vec<u8>>>,
    /// The terminal's master side, for resizes (tty sessions only).
    terminal: Option<File>,
}

/// Copies queued bytes into the process's stdin until the queue closes.
fn feed_stdin(mut pipe: File) -> mpsc::Sender<Vec<u8>> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    pool::run(move || {
        for bytes in rx {
            if pipe.write_all(&bytes).is_err() {
                return;
            }
        }
    });
    tx
}

/// Output frames and the exit frame of one stream go through this gate, so
/// that no output frame can follow the exit frame.
struct StreamGate {
    open: Mutex<bool>,
    outbox: SyncSender<Frame>,
    stream: u32,
}

impl StreamGate {
    fn send(&self, kind: FrameKind, payload: Vec<u8>) -> bool {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        *open && self.outbox.send(Frame::new(self.stream, kind, payload)).is_ok()
    }

    /// Stops the stream without an exit frame (its host session is gone).
    fn silence(&self) {
        *self.open.lock().unwrap_or_else(|e| e.into_inner()) = false;
    }

    /// Sends `frame` as the stream's last; whether it was queued.
    fn close_with(&self, frame: Frame) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *open, false) && self.outbox.send(frame).is_ok()
    }
}

/// Everything needed to start the process, checked up front.
struct Plan {
    program: PathBuf,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    cwd: String,
    account: Account,
    stdin: bool,
    tty: bool,
}

/// A started process: its pid, its exit status to come, and its pipes.
struct Spawned {
    pid: u32,
    exit: Receiver<ExitStatus>,
    pipes: spawn::Pipes,
}

pub fn start(stream: u32, request: ExecRequest, identity: &Welcome, outbox: &SyncSender<Frame>, sessions: &Sessions) {
    // How the exit tells the output pumps to finish: by closing `finish`.
    let (finishing, finish) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok((read, write)) => (Arc::new(read), write),
        Err(err) => {
            let failure = failed(ExecFailure::Spawn, format!("no pipe for the command's output: {err}"));
            let _ = outbox.send(Frame::message(stream, FrameKind::ExecFailed, &failure));
            return;
        }
    };
    let (spawned, group) = match plan(&request, identity) {
        Ok(plan) => cgroup::spawn_in_new_group(|| launch(&plan)),
        Err(failure) => (Err(failure), None),
    };
    let spawned = spawned.inspect(|spawned| {
        set_limit(spawned.pid, libc::RLIMIT_NPROC, MAX_PROCESSES);
        if crate::init::booted_vm() {
            crate::memory::reset_kernel_oom_score(spawned.pid);
        }
    });
    let Spawned { pid, exit, pipes } = match spawned {
        Ok(spawned) => spawned,
        Err(failure) => {
            let _ = outbox.send(Frame::message(stream, FrameKind::ExecFailed, &failure));
            return;
        }
    };
    let gate = Arc::new(StreamGate { open: Mutex::new(true), outbox: outbox.clone(), stream });
    let terminal = if request.tty { pipes.stdout.try_clone().ok() } else { None };
    let control = SessionControl {
        pgid: pid as i32,
        group: group.map(Arc::new),
        gate: gate.clone(),
        stdin: pipes.stdin.map(feed_stdin),
        terminal,
    };
    sessions.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, control);
    let _ = outbox.send(Frame::message(stream, FrameKind::Started, &Started { pid }));

    let (drained_tx, drained) = mpsc::channel();
    pump(pipes.stdout, FrameKind::Stdout, gate.clone(), drained_tx.clone(), finishing.clone());
    pump(pipes.stderr, FrameKind::Stderr, gate.clone(), drained_tx, finishing);

    let sessions = sessions.clone();
    pool::run(move || {
        let status = exit.recv().unwrap_or(ExitStatus::Signaled(9));
        // Both pumps report when their pipe hits EOF, which comes once the
        // command's last process is gone. A background job may hold a pipe
        // for good: after a short grace the pumps are told to finish, take
        // what is in their pipes now and stop. Whatever the process wrote
        // before it ended is in there, and is sent before its exit: the
        // pumps are waited for, however late they run on a busy sandbox.
        let deadline = Instant::now() + DRAIN_GRACE;
        let mut left = 2;
        while left > 0 && drained.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_ok() {
            left -= 1;
        }
        drop(finish);
        while left > 0 && drained.recv().is_ok() {
            left -= 1;
        }
        let oom_killed = crate::memory::take_killed(pid as i32);
        let exited = match status {
            ExitStatus::Exited(code) => Exited { exit_code: Some(code), signal: None, oom_killed },
            ExitStatus::Signaled(sig) => Exited { exit_code: None, signal: Some(sig), oom_killed },
        };
        // Owed before the session goes, so a redial names the stream in
        // one or the other (it reads the sessions first).
        owe(stream, true);
        sessions.lock().unwrap_or_else(|e| e.into_inner()).remove(&stream);
        if !gate.close_with(Frame::message(stream, FrameKind::Exit, &exited)) {
            owe(stream, false);
        }
    });
}

/// Streams whose exit frame is queued but not yet written to a host
/// connection. A redial names them with the running ones: a command that
/// ended while the host was away (a restart) has its exit, and the output
/// before it, waiting in the outbox for the next connection, and the new
/// host must take its stream over to get them.
static OWED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn owe(stream: u32, owed: bool) {
    let mut streams = OWED.lock().unwrap_or_else(|e| e.into_inner());
    streams.retain(|s| *s != stream);
    if owed {
        streams.push(stream);
    }
}

/// The exit frame of `stream` went out on a connection.
pub fn exit_written(stream: u32) {
    owe(stream, false);
}

/// The streams a redialing agent still serves: running commands, and
/// ended ones whose exit has not gone out yet.
pub fn served_streams(sessions: &Sessions) -> Vec<u32> {
    let mut streams: Vec<u32> = sessions.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
    streams.extend(OWED.lock().unwrap_or_else(|e| e.into_inner()).iter().copied());
    streams.sort_unstable();
    streams.dedup();
    streams
}

/// Sends what comes out of `pipe` until EOF, or, once `finishing` reads
/// (its write end is closed when the command has ended), until the pipe
/// holds nothing more.
fn pump(mut pipe: File, kind: FrameKind, gate: Arc<StreamGate>, drained: mpsc::Sender<()>, finishing: Arc<OwnedFd>) {
    pool::run(move || {
        let mut buf = vec![0u8; MAX_OUTPUT_CHUNK];
        let mut taken_finishing: Option<usize> = None;
        loop {
            let ready = match taken_finishing {
                None => {
                    let mut fds = [
                        PollFd::new(pipe.as_fd(), PollFlags::POLLIN),
                        PollFd::new(finishing.as_fd(), PollFlags::POLLIN),
                    ];
                    match poll(&mut fds, PollTimeout::NONE) {
                        Ok(_) if fds[1].any().unwrap_or(true) => {
                            taken_finishing = Some(0);
                            continue;
                        }
                        Ok(_) => fds[0].any().unwrap_or(true),
                        Err(nix::errno::Errno::EINTR) => continue,
                        Err(_) => break,
                    }
                }
                Some(taken) if taken >= FINISH_LIMIT => break,
                Some(_) => {
                    let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLIN)];
                    match poll(&mut fds, PollTimeout::ZERO) {
                        Ok(_) => fds[0].any().unwrap_or(true),
                        Err(nix::errno::Errno::EINTR) => continue,
                        Err(_) => break,
                    }
                }
            };
            if !ready {
                break;
            }
            // Ready: the read does not block (only this pump reads the pipe).
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if let Some(taken) = taken_finishing.as_mut() {
                        *taken += n;
                    }
                    if !gate.send(kind, buf[..n].to_vec()) {
                        break;
                    }
                }
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = drained.send(());
    });
}

fn failed(reason: ExecFailure, message: impl Into<String>) -> ExecFailed {
    ExecFailed { reason, message: message.into() }
}

/// Resolves user, working directory, environment and program, so every
/// failure is a precise error before anything is spawned.
fn plan(request: &ExecRequest, identity: &Welcome) -> Result<Plan, ExecFailed> {
    let Some(program) = request.argv.first().filter(|p| !p.is_empty()) else {
        return Err(failed(ExecFailure::Invalid, "argv must name a program"));
    };
    let user = request.user.as_deref().or(identity.user.as_deref());
    let account = users::resolve(user).map_err(|m| failed(ExecFailure::BadUser, m))?;
    let cwd = match &request.cwd {
        Some(cwd) if Path::new(cwd).is_dir() => cwd.clone(),
        Some(cwd) => return Err(failed(ExecFailure::BadCwd, format!("working directory does not exist: {cwd}"))),
        // The template's workdir (for the template's user), else the user's
        // home, else `/`: a default that does not exist is not the caller's
        // fault. A command run as another user starts in that user's home.
        None => [identity.workdir.as_deref().filter(|_| request.user.is_none()), Some(account.home.as_str())]
            .into_iter()
            .flatten()
            .find(|dir| Path::new(dir).is_dir())
            .unwrap_or("/")
            .to_string(),
    };

    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), account.home.clone());
    env.insert("USER".into(), account.name.clone());
    env.insert("LOGNAME".into(), account.name.clone());
    env.insert("HOSTNAME".into(), identity.hostname.clone());
    env.extend(crate::egress::proxy_env().iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env.extend(crate::egress::trust_env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env.extend(identity.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(request.env.iter().map(|(k, v)| (k.clone(), v.clone())));

    let search_path = env.get("PATH").map(String::as_str).unwrap_or(DEFAULT_PATH);
    let program = resolve_program(program, search_path)?;
    if request.tty {
        env.entry("TERM".into()).or_insert_with(|| "xterm-256color".into());
    }
    Ok(Plan { program, argv: request.argv.clone(), env, cwd, account, stdin: request.stdin, tty: request.tty })
}

/// Finds `program` the way `execvp` would, so "not found" is told apart
/// from "not executable" before anything is spawned.
fn resolve_program(program: &str, path: &str) -> Result<PathBuf, ExecFailed> {
    let candidates: Vec<PathBuf> = if program.contains('/') {
        vec![PathBuf::from(program)]
    } else {
        path.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(program)).collect()
    };
    let mut not_executable = None;
    for candidate in candidates {
        match candidate.metadata() {
            Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => return Ok(candidate),
            Ok(_) => not_executable = Some(candidate),
            Err(_) => {}
        }
    }
    match not_executable {
        Some(path) => Err(failed(ExecFailure::PermissionDenied, format!("not an executable file: {}", path.display()))),
        None => Err(failed(ExecFailure::NotFound, format!("executable file not found: {program}"))),
    }
}

fn spawn_failure(err: std::io::Error) -> ExecFailed {
    match err.kind() {
        ErrorKind::NotFound => failed(ExecFailure::NotFound, err.to_string()),
        ErrorKind::PermissionDenied => failed(ExecFailure::PermissionDenied, err.to_string()),
        _ => failed(ExecFailure::Spawn, err.to_string()),
    }
}

/// Caps a new command (and what it starts): its processes at
/// [`MAX_PROCESSES`] per user, as its cgroup does for the command as a
/// whole (when it has one). The agent itself stays unlimited, so it can always
/// start the command that cleans up. Set right after the spawn returns
/// (the child has exec'd by then). Memory is not capped per process
/// (runtimes reserve far more address space than they use): the memory
/// watcher (`memory.rs`) contains a hog.
fn set_limit(pid: u32, resource: libc::__rlimit_resource_t, value: u64) {
    let limit = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: prlimit reads `limit` and writes nothing (old is null).
    let result = unsafe { libc::prlimit(pid as libc::pid_t, resource, &limit, std::ptr::null_mut()) };
    if result != 0 {
        eprintln!("space-agent: limiting {pid} ({resource}): {}", std::io::Error::last_os_error());
    }
}

fn launch(plan: &Plan) -> Result<Spawned, ExecFailed> {
    crate::memory::process_starting();
    let reaper = Reaper::global();
    if plan.tty {
        return launch_on_tty(plan);
    }
    if plan.account.uid == 0 && plan.account.gid == 0 {
        let env: Vec<(String, String)> = plan.env.clone().into_iter().collect();
        let mut pipes = None;
        let (pid, exit) = reaper
            .spawn_with(|| {
                let (pid, spawned) = spawn::spawn(&plan.program, &plan.argv, &env, &plan.cwd, plan.stdin)?;
                pipes = Some(spawned);
                Ok(pid)
            })
            .map_err(spawn_failure)?;
        let pipes = pipes.ok_or_else(|| failed(ExecFailure::Spawn, "spawn returned no pipes"))?;
        return Ok(Spawned { pid, exit, pipes });
    }
    // Dropping privileges needs code between fork and exec: std does it.
    let mut command = base_command(plan);
    command
        .process_group(0)
        .uid(plan.account.uid)
        .gid(plan.account.gid)
        .stdin(if plan.stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let reaped = reaper.spawn(&mut command).map_err(spawn_failure)?;
    let pid = reaped.id();
    let (mut child, exit) = reaped.into_parts();
    let take = |fd: Option<std::os::fd::OwnedFd>| fd.map(File::from);
    let pipes = spawn::Pipes {
        stdin: take(child.stdin.take().map(Into::into)),
        stdout: take(child.stdout.take().map(Into::into))
            .ok_or_else(|| failed(ExecFailure::Spawn, "no stdout pipe"))?,
        stderr: take(child.stderr.take().map(Into::into))
            .ok_or_else(|| failed(ExecFailure::Spawn, "no stderr pipe"))?,
    };
    Ok(Spawned { pid, exit, pipes })
}

/// The program, its arguments, environment and working directory.
fn base_command(plan: &Plan) -> Command {
    let mut command = Command::new(&plan.program);
    command.arg0(&plan.argv[0]).args(&plan.argv[1..]).env_clear().envs(&plan.env).current_dir(&plan.cwd);
    command
}

/// Starts the command on a new pseudo-terminal: its own session with the
/// terminal as controlling tty; stdout and stderr both go to the terminal.
fn launch_on_tty(plan: &Plan) -> Result<Spawned, ExecFailed> {
    let size = nix::pty::Winsize { ws_row: 24, ws_col: 80, ws_xpixel: 0, ws_ypixel: 0 };
    let pty = nix::pty::openpty(Some(&size), None).map_err(|e| failed(ExecFailure::Spawn, format!("openpty: {e}")))?;
    let slave = |pty: &nix::pty::OpenptyResult| {
        pty.slave.try_clone().map(Stdio::from).map_err(|e| failed(ExecFailure::Spawn, e.to_string()))
    };
    let mut command = base_command(plan);
    command.stdin(slave(&pty)?).stdout(slave(&pty)?).stderr(slave(&pty)?);
    if plan.account.uid != 0 || plan.account.gid != 0 {
        command.uid(plan.account.uid).gid(plan.account.gid);
    }
    // SAFETY: between fork and exec this only calls async-signal-safe
    // functions (setsid, ioctl) and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let reaped = Reaper::global().spawn(&mut command).map_err(spawn_failure)?;
    let pid = reaped.id();
    let (_, exit) = reaped.into_parts();
    drop(command); // closes our copies of the terminal's slave side
    let master = File::from(pty.master);
    let pipes = spawn::Pipes {
        stdin: Some(master.try_clone().map_err(|e| failed(ExecFailure::Spawn, e.to_string()))?),
        stdout: master,
        // Everything arrives on the terminal: an empty stream stands for stderr.
        stderr: File::open("/dev/null").map_err(|e| failed(ExecFailure::Spawn, e.to_string()))?,
    };
    drop(pty.slave);
    Ok(Spawned { pid, exit, pipes })
}

/// Sets the size of a command's terminal.
pub fn resize(sessions: &Sessions, stream: u32, size: space_proto::TerminalSize) {
    use std::os::fd::AsRawFd;
    let sessions = sessions.lock().unwrap_or_else(|e| e.into_inner());
    let Some(terminal) = sessions.get(&stream).and_then(|s| s.terminal.as_ref()) else { return };
    let winsize = libc::winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: the fd is open (owned by the session) and winsize is a valid,
    // initialised struct of the type TIOCSWINSZ expects.
    unsafe {
        libc::ioctl(terminal.as_raw_fd(), libc::TIOCSWINSZ, &winsize);
    }
}

pub fn write_stdin(sessions: &Sessions, stream: u32, bytes: &[u8]) {
    if let Some(stdin) = sessions.lock().unwrap_or_else(|e| e.into_inner()).get(&stream).and_then(|s| s.stdin.as_ref())
    {
        let _ = stdin.send(bytes.to_vec());
    }
}

/// Forgets every stream: after a new host session, nobody listens to them.
/// The processes keep running.
pub fn forget_streams(sessions: &Sessions) {
    for (_, session) in sessions.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        session.gate.silence();
    }
    OWED.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

pub fn close_stdin(sessions: &Sessions, stream: u32) {
    if let Some(session) = sessions.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&stream) {
        session.stdin = None;
    }
}

/// Signals a command's process group. KILL (which a timeout sends) and
/// TERM end the whole command: KILL every process of its cgroup until none
/// is left, TERM every one of them, then KILL what is left after
/// [`TERM_GRACE`]. Other commands' processes, background jobs included,
/// are in cgroups of their own and untouched.
pub fn signal(sessions: &Sessions, stream: u32, signal: i32) {
    let target = sessions.lock().unwrap_or_else(|e| e.into_inner()).get(&stream).map(|s| (s.pgid, s.group.clone()));
    let (Some((pgid, group)), Ok(signal)) = (target, Signal::try_from(signal)) else { return };
    let _ = killpg(Pid::from_raw(pgid), signal);
    let Some(group) = group else { return };
    match signal {
        Signal::SIGKILL => pool::run(move || {
            group.kill_all();
        }),
        Signal::SIGTERM => {
            group.signal_all(Signal::SIGTERM);
            pool::run(move || {
                let deadline = Instant::now() + TERM_GRACE;
                while !group.members().is_empty() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(100));
                }
                group.kill_all();
            });
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;
    use std::time::{Duration, Instant};

    use space_proto::{ExecRequest, Exited, Frame, FrameKind, Welcome};

    use super::DRAIN_GRACE;
    use crate::Sessions;

    fn identity() -> Welcome {
        Welcome::plain("sbx_t", "t", 1)
    }

    /// The host reads nothing until well after the process has ended and
    /// the grace for background output has passed, so the pump is still
    /// holding most of the output then (blocked on a full outbox). All of
    /// it still comes before the exit.
    #[test]
    fn output_written_before_the_exit_comes_before_it_however_late_the_pumps_run() {
        // What one pipe holds: the command ends even if the pump took none.
        const BYTES: usize = 60_000;
        // Several rounds: when the pump gives up the gate between two
        // chunks, which of it and the exit takes it next is a race.
        for round in 0..4 {
            let (outbox, frames) = sync_channel::<Frame>(1);
            let sessions = Sessions::default();
            // A background job keeps the pipes open: no EOF tells the pumps
            // it is over. The marker says the command is about to end.
            let marker = std::env::temp_dir().join(format!("space-agent-test-{}-{round}", std::process::id()));
            let _ = std::fs::remove_file(&marker);
            let script = format!("head -c {BYTES} /dev/zero; sleep 3 & touch {}", marker.display());
            let request = ExecRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), script],
                env: Default::default(),
                cwd: Some("/".into()),
                user: None,
                stdin: false,
                tty: false,
            };
            super::start(round + 1, request, &identity(), &outbox, &sessions);
            // Nothing is read yet: `Started` fills the outbox, so the stdout
            // pump is stuck with its first chunk and the rest stays in the
            // pipe until the process has ended and the grace after it is over.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !marker.exists() {
                assert!(Instant::now() < deadline, "the command ended within 30 s");
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = std::fs::remove_file(&marker);
            std::thread::sleep(DRAIN_GRACE * 4);

            let next = || frames.recv_timeout(Duration::from_secs(30)).expect("a frame within 30 s");
            assert_eq!(next().kind, FrameKind::Started);
            let mut stdout = 0;
            loop {
                let frame = next();
                match frame.kind {
                    FrameKind::Stdout => stdout += frame.payload.len(),
                    FrameKind::Exit => {
                        assert_eq!(frame.parse::<Exited>().unwrap().exit_code, Some(0));
                        break;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(stdout, BYTES, "every byte the command wrote came before its exit (round {round})");
        }
    }

    /// A command that ended while no host listened (a restart) is still
    /// named at the redial until its exit frame has gone out, so the new
    /// host takes its stream over and gets its end.
    #[test]
    fn a_stream_is_served_until_its_exit_went_out() {
        let (outbox, frames) = sync_channel::<Frame>(8);
        let sessions = Sessions::default();
        let request = ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), "echo done".into()],
            env: Default::default(),
            cwd: Some("/".into()),
            user: None,
            stdin: false,
            tty: false,
        };
        const STREAM: u32 = 1001;
        super::start(STREAM, request, &identity(), &outbox, &sessions);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let frame = frames.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("the exit");
            if frame.kind == FrameKind::Exit {
                break;
            }
        }
        assert!(sessions.lock().unwrap().is_empty(), "the command ended");
        assert!(super::served_streams(&sessions).contains(&STREAM), "its exit is owed to the host");
        super::exit_written(STREAM);
        assert!(!super::served_streams(&sessions).contains(&STREAM), "no longer, once it went out");
    }
}
