//! The volume files child (decision 031): a volume's files are a tenant's
//! bytes and links, so the root process that serves the files routes of a
//! volume (the helper, or a server without one) never opens a path in it.
//! It starts `space` again as [`SUBCOMMAND`] with one end of a socket pair
//! as its stdin and stdout; the child confines itself as the importer does
//! ([`space_privsep::confine::confine_keeping`]: root, but only the four
//! file-owner capabilities, `no_new_privs`, Landlock to the volume's
//! `data`, that `data` as its root directory, the seccomp deny-list, no
//! new processes — threads of its own only), says so, and waits until the
//! parent, having checked its `/proc/PID/status`, answers. Then it speaks
//! the agent's protocol on the socket (`space_agent::files_only`): its
//! `Hello`, the host's `Welcome`, then file requests only. A link in the
//! volume resolves inside the volume there, never on the host.
//!
//! The parent hands its end of the socket to whoever asked (the server,
//! through the helper's socket); the child ends when that end closes.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use space_privsep::confine::{self, Keeping};
use space_process::{ExitStatus, Reaper};

use crate::templates::importer::{check_confined, KEPT_CAPABILITIES};
use crate::EngineError;

/// The hidden `space` subcommand the child runs as.
pub const SUBCOMMAND: &str = "volume-files-child";

/// What the child says once it is confined, before anything else.
const CONFINED: &[u8] = b"confined\n";
/// How long the child may take to start and confine itself.
const CONFINE_PATIENCE: Duration = Duration::from_secs(10);
/// The longest line the child sends before the agent's protocol.
const MAX_LINE: usize = 4096;

/// Starts the confined child on the volume's `data` and returns the
/// parent's end of its socket, the agent's protocol next on it. `after`
/// runs once the child has ended (or was never started).
pub(super) fn spawn(files_bin: &Path, data: &Path, after: Box<dyn FnOnce() + Send>) -> Result<UnixStream, EngineError> {
    let after = After(Some(after));
    let starting = |source| EngineError::Io {
        what: format!("starting the volume files child {} (only it opens a volume's files)", files_bin.display()),
        source,
    };
    // Checked before the spawn: std's spawn waits for a child whose exec
    // failed, and the process-wide reaper may have taken that status first.
    match std::fs::metadata(files_bin) {
        Ok(meta) if meta.is_file() => {}
        Ok(_) => return Err(starting(io::Error::from(io::ErrorKind::InvalidInput))),
        Err(err) => return Err(starting(err)),
    }
    let (mut ours, theirs) = UnixStream::pair().map_err(EngineError::io("a socket for the volume files child"))?;
    let theirs_too = theirs.try_clone().map_err(EngineError::io("a socket for the volume files child"))?;
    let mut command = Command::new(files_bin);
    command
        .arg(SUBCOMMAND)
        .arg("--data")
        .arg(data)
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::from(OwnedFd::from(theirs_too)))
        .stderr(Stdio::inherit());
    // No parent-death signal: it would come when the thread that spawned
    // the child ends (a blocking pool's), while the socket is still in use.
    // The child ends when its socket closes.
    let child = Reaper::global().spawn(&mut command).map_err(starting)?;
    // This process's copies of the child's end go, so that the child's
    // exit is the socket's end.
    drop(command);
    let pid = child.id();
    let stop = |message: String| {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGKILL);
        child.wait();
        EngineError::Runtime(format!("the volume files child: {message}"))
    };
    let line = match read_line(&mut ours) {
        Ok(line) => line,
        Err(err) => return Err(stop(format!("it did not say it was confined: {err}"))),
    };
    if line != CONFINED {
        let said = String::from_utf8_lossy(&line).trim().chars().take(500).collect::<String>();
        return Err(stop(format!("it did not confine itself: {said}")));
    }
    if let Err(message) = check_confined(pid, "the volume files child") {
        return Err(stop(message));
    }
    let answered = ours.write_all(b"\n").and_then(|()| ours.set_read_timeout(None));
    if let Err(err) = answered {
        return Err(stop(format!("answering it: {err}")));
    }
    // Its status is taken when it ends, whoever holds the socket then.
    let waiting = std::thread::Builder::new().name("volume-files-child".into()).spawn(move || {
        match child.wait() {
            ExitStatus::Exited(0) => {}
            status => tracing::warn!(pid, "the volume files child ended {status:?}"),
        };
        drop(after);
    });
    if let Err(err) = waiting {
        tracing::warn!(pid, "waiting for the volume files child: {err}");
    }
    Ok(ours)
}

/// What runs when it is dropped: after the child, on every path.
struct After(Option<Box<dyn FnOnce() + Send>>);

impl Drop for After {
    fn drop(&mut self) {
        if let Some(after) = self.0.take() {
            after();
        }
    }
}

/// The child's first line, within [`CONFINE_PATIENCE`].
fn read_line(socket: &mut UnixStream) -> io::Result<Vec<u8>> {
    socket.set_read_timeout(Some(CONFINE_PATIENCE))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_LINE {
        match socket.read(&mut byte)? {
            0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            _ => line.push(byte[0]),
        }
        if byte[0] == b'\n' {
            break;
        }
    }
    Ok(line)
}

// ---------------------------------------------------------------------------
// The child's side.

/// The arguments of [`SUBCOMMAND`].
#[derive(Debug, Clone)]
pub struct FilesChildArgs {
    /// The volume's `data`: the child's root and all it may touch.
    pub data: PathBuf,
}

/// The child: confines itself, then serves the agent's file protocol on
/// its stdin/stdout socket. Call it first thing in `main`, with no other
/// thread started. Returns the process's exit code.
pub fn child_main(args: &FilesChildArgs) -> i32 {
    let socket = match io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => UnixStream::from(fd),
        Err(err) => {
            eprintln!("space {SUBCOMMAND}: taking the socket: {err}");
            return 1;
        }
    };
    let mut said = &socket;
    let keeping = Keeping {
        capabilities: KEPT_CAPABILITIES.to_vec(),
        writable: vec![args.data.clone()],
        root: Some(args.data.clone()),
        no_new_processes: true,
        // The file code's workers and writer are threads of this process.
        threads: true,
    };
    match confine::confine_keeping(&keeping) {
        Ok(confined) if confined.missing.is_empty() => {}
        Ok(confined) => {
            let _ = writeln!(said, "failed: the volume lacks {:?}", confined.missing);
            return 1;
        }
        Err(err) => {
            let _ = writeln!(said, "failed: confining: {err}");
            return 1;
        }
    }
    if said.write_all(CONFINED).is_err() {
        return 1;
    }
    // Nothing of the volume is served before the parent has seen this
    // process confined; a parent gone (EOF) ends it.
    let mut go = [0u8; 1];
    if !matches!((&socket).read(&mut go), Ok(1)) || go[0] != b'\n' {
        return 1;
    }
    // Nothing but this socket stays open: the inherited stdout and the
    // spare copy of the socket go (stderr is the parent's log).
    let _ = nix::unistd::close(1);
    let _ = nix::unistd::close(0);
    match space_agent::files_only::serve(socket, concat!("space-volume-files/", env!("CARGO_PKG_VERSION"))) {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("space {SUBCOMMAND}: {err}");
            1
        }
    }
}
