//! Blocking calls with a deadline, for tests: a child process that does not
//! end, or a server that does not answer, fails the test naming what it
//! waited for instead of holding it until the runner's watchdog.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use space_process::{Output, Reaper};

/// An HTTP client whose every wait has a deadline: connecting, and each
/// read and write (a streamed answer may take long as a whole, but is never
/// silent for this long).
pub fn http() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .timeout_write(Duration::from_secs(120))
        .build()
}

/// Runs `command` to its end with stdin closed, capturing its stdout and
/// stderr, for at most `patience`: past it the process is killed and this
/// panics naming the command and what it had said.
pub fn output_within(command: &mut Command, patience: Duration) -> Output {
    let rendered = format!("{command:?}");
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = Reaper::global().spawn(command).unwrap_or_else(|e| panic!("starting {rendered}: {e}"));
    // Read on threads of their own: a full pipe would stop the child, and
    // a grandchild holding a pipe open must not hold the test.
    let pipe = |pipe: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut buf);
            }
            let _ = tx.send(buf);
        });
        rx
    };
    let stdout = pipe(child.child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = pipe(child.child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let Some(status) = child.wait_timeout(patience) else {
        let _ =
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL);
        let said = stderr.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
        panic!("{rendered} did not end within {patience:?} (killed); it said: {}", String::from_utf8_lossy(&said));
    };
    // Once the child is gone its pipes end, unless a process it left
    // behind holds them: then what was read so far is not waited for.
    let rest = Duration::from_secs(10);
    Output {
        status,
        stdout: stdout.recv_timeout(rest).unwrap_or_default(),
        stderr: stderr.recv_timeout(rest).unwrap_or_default(),
    }
}

/// Like [`output_within`], for a command that must succeed: its stdout, or
/// an error with the end of what it said on stderr.
pub fn run_within(command: &mut Command, patience: Duration) -> Result<Vec<u8>, String> {
    let rendered = format!("{command:?}");
    let output = output_within(command, patience);
    if output.status.success() {
        return Ok(output.stdout);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(8).collect();
    Err(format!("{rendered}: {:?}: {}", output.status, tail.into_iter().rev().collect::<Vec<_>>().join("\n")))
}

/// Runs `call` (a blocking call with no deadline of its own: a pipe's read,
/// a thread's join) on a thread of its own and waits for it at most
/// `patience`; past it, panics naming `what` (the call is left behind). A
/// panic in `call` is this caller's.
pub fn within<T: Send + 'static>(what: &str, patience: Duration, call: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = tx.send(call());
    });
    match rx.recv_timeout(patience) {
        Ok(value) => value,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("waited {patience:?} for {what}"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the call's thread ended without an answer or a panic"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "did not end within 1s (killed)")]
    fn a_child_that_does_not_end_fails_the_wait_naming_itself() {
        output_within(Command::new("sleep").arg("600"), Duration::from_secs(1));
    }

    #[test]
    fn a_child_that_ends_gives_its_output() {
        let out = output_within(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]), PATIENCE);
        assert_eq!(
            (out.status, &out.stdout[..], &out.stderr[..]),
            (space_process::ExitStatus::Exited(3), &b"out\n"[..], &b"err\n"[..])
        );
    }

    #[test]
    #[should_panic(expected = "waited 100ms for a read that never ends")]
    fn a_call_past_its_patience_fails_naming_it() {
        within("a read that never ends", Duration::from_millis(100), || std::thread::sleep(Duration::from_secs(600)));
    }

    #[test]
    #[should_panic(expected = "its own panic")]
    fn a_panic_in_the_call_is_the_callers() {
        within("a call", PATIENCE, || panic!("its own panic"));
    }

    const PATIENCE: Duration = Duration::from_secs(30);
}
