//! Running one command: spawn, pump its output, report how it ended.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use space_process::{ExitStatus, Reaper};
use space_proto::{
    ExecFailed, ExecFailure, ExecRequest, Exited, Frame, FrameKind, Started, Welcome,
    MAX_OUTPUT_CHUNK,
};

use crate::users;
use crate::Sessions;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// After the process exits, how long its pipes may take to drain. Anything
/// still holding them afterwards (a background job) is detached from the
/// session, so a session ends when its own process does.
const DRAIN_GRACE: Duration = Duration::from_millis(250);

/// The host's handle on a running command.
pub struct SessionControl {
    pgid: i32,
    stdin: Option<ChildStdin>,
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
        *open
            && self
                .outbox
                .send(Frame::new(self.stream, kind, payload))
                .is_ok()
    }

    fn close_with(&self, frame: Frame) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        *open = false;
        let _ = self.outbox.send(frame);
    }
}

pub fn start(
    stream: u32,
    request: ExecRequest,
    identity: &Welcome,
    outbox: &SyncSender<Frame>,
    sessions: &Sessions,
) {
    let reply = |kind, payload: Frame| {
        let _ = outbox.send(Frame {
            stream,
            kind,
            payload: payload.payload,
        });
    };
    let spawned = prepare(&request, identity).and_then(|mut command| spawn(&mut command));
    let reaped = match spawned {
        Ok(reaped) => reaped,
        Err(failure) => {
            reply(
                FrameKind::ExecFailed,
                Frame::message(stream, FrameKind::ExecFailed, &failure),
            );
            return;
        }
    };
    let pid = reaped.id();
    let (mut child, exit) = reaped.into_parts();
    sessions.lock().unwrap_or_else(|e| e.into_inner()).insert(
        stream,
        SessionControl {
            pgid: pid as i32,
            stdin: child.stdin.take(),
        },
    );
    reply(
        FrameKind::Started,
        Frame::message(stream, FrameKind::Started, &Started { pid }),
    );

    let gate = Arc::new(StreamGate {
        open: Mutex::new(true),
        outbox: outbox.clone(),
        stream,
    });
    let pumps: Vec<_> = [
        child
            .stdout
            .take()
            .map(|pipe| pump(pipe, FrameKind::Stdout, gate.clone())),
        child
            .stderr
            .take()
            .map(|pipe| pump(pipe, FrameKind::Stderr, gate.clone())),
    ]
    .into_iter()
    .flatten()
    .collect();

    let sessions = sessions.clone();
    let _ = thread::Builder::new()
        .name(format!("wait-{stream}"))
        .spawn(move || {
            let status = exit.recv().unwrap_or(ExitStatus::Signaled(9));
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            for pump in pumps {
                let done_tx = done_tx.clone();
                thread::spawn(move || {
                    let _ = pump.join();
                    let _ = done_tx.send(());
                });
            }
            drop(done_tx);
            let deadline = std::time::Instant::now() + DRAIN_GRACE;
            loop {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                match done_rx.recv_timeout(left) {
                    Ok(()) => continue,
                    Err(_) => break, // all pumps done, or the grace ran out
                }
            }
            sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&stream);
            let exited = match status {
                ExitStatus::Exited(code) => Exited {
                    exit_code: Some(code),
                    signal: None,
                },
                ExitStatus::Signaled(sig) => Exited {
                    exit_code: None,
                    signal: Some(sig),
                },
            };
            gate.close_with(Frame::message(stream, FrameKind::Exit, &exited));
        });
}

fn pump<R: Read + Send + 'static>(
    mut pipe: R,
    kind: FrameKind,
    gate: Arc<StreamGate>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut buf = vec![0u8; MAX_OUTPUT_CHUNK];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if !gate.send(kind, buf[..n].to_vec()) {
                        return;
                    }
                }
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    })
}

fn failed(reason: ExecFailure, message: impl Into<String>) -> ExecFailed {
    ExecFailed {
        reason,
        message: message.into(),
    }
}

/// Builds the command, checking what would otherwise be an ambiguous spawn error.
fn prepare(request: &ExecRequest, identity: &Welcome) -> Result<Command, ExecFailed> {
    let Some(program) = request.argv.first().filter(|p| !p.is_empty()) else {
        return Err(failed(ExecFailure::Invalid, "argv must name a program"));
    };
    let account =
        users::resolve(request.user.as_deref()).map_err(|m| failed(ExecFailure::BadUser, m))?;
    let cwd = request.cwd.clone().unwrap_or_else(|| account.home.clone());
    let cwd = if Path::new(&cwd).is_dir() {
        cwd
    } else if request.cwd.is_none() {
        "/".to_string() // a home that does not exist is not the caller's fault
    } else {
        return Err(failed(
            ExecFailure::BadCwd,
            format!("working directory does not exist: {cwd}"),
        ));
    };

    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), account.home.clone());
    env.insert("USER".into(), account.name.clone());
    env.insert("LOGNAME".into(), account.name.clone());
    env.insert("HOSTNAME".into(), identity.hostname.clone());
    env.extend(identity.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(request.env.iter().map(|(k, v)| (k.clone(), v.clone())));

    let resolved = resolve_program(
        program,
        env.get("PATH").map(String::as_str).unwrap_or(DEFAULT_PATH),
    )?;
    let mut command = Command::new(resolved);
    command
        .arg0(program)
        .args(&request.argv[1..])
        .env_clear()
        .envs(&env)
        .current_dir(&cwd)
        .process_group(0)
        .stdin(if request.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if account.uid != 0 || account.gid != 0 {
        command.uid(account.uid).gid(account.gid);
    }
    Ok(command)
}

/// Finds `program` the way `execvp` would, so "not found" is told apart
/// from "not executable" before anything is spawned.
fn resolve_program(program: &str, path: &str) -> Result<PathBuf, ExecFailed> {
    let candidates: Vec<PathBuf> = if program.contains('/') {
        vec![PathBuf::from(program)]
    } else {
        path.split(':')
            .filter(|d| !d.is_empty())
            .map(|d| Path::new(d).join(program))
            .collect()
    };
    let mut not_executable = None;
    for candidate in candidates {
        match candidate.metadata() {
            Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => {
                return Ok(candidate)
            }
            Ok(_) => not_executable = Some(candidate),
            Err(_) => {}
        }
    }
    match not_executable {
        Some(path) => Err(failed(
            ExecFailure::PermissionDenied,
            format!("not an executable file: {}", path.display()),
        )),
        None => Err(failed(
            ExecFailure::NotFound,
            format!("executable file not found: {program}"),
        )),
    }
}

fn spawn(command: &mut Command) -> Result<space_process::ReapedChild, ExecFailed> {
    Reaper::global()
        .spawn(command)
        .map_err(|err| match err.kind() {
            ErrorKind::NotFound => failed(ExecFailure::NotFound, err.to_string()),
            ErrorKind::PermissionDenied => failed(ExecFailure::PermissionDenied, err.to_string()),
            _ => failed(ExecFailure::Spawn, err.to_string()),
        })
}

pub fn write_stdin(sessions: &Sessions, stream: u32, bytes: &[u8]) {
    // Take the pipe out while writing so a slow reader inside the sandbox
    // does not hold the sessions lock.
    let pipe = sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&stream)
        .and_then(|s| s.stdin.take());
    if let Some(mut pipe) = pipe {
        let ok = pipe.write_all(bytes).is_ok();
        if ok {
            if let Some(session) = sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(&stream)
            {
                session.stdin = Some(pipe);
            }
        }
    }
}

pub fn close_stdin(sessions: &Sessions, stream: u32) {
    if let Some(session) = sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&stream)
    {
        session.stdin = None;
    }
}

pub fn signal(sessions: &Sessions, stream: u32, signal: i32) {
    let pgid = sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&stream)
        .map(|s| s.pgid);
    if let (Some(pgid), Ok(signal)) = (pgid, Signal::try_from(signal)) {
        let _ = killpg(Pid::from_raw(pgid), signal);
    }
}
