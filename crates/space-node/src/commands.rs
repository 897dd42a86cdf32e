//! Command sessions: start a process through the agent, keep its output in
//! a transcript on the host, record how it ended.

use std::time::Instant;

use space_api::{Attach, Command, CommandState, ErrorCode, ProcessResult};
use space_engine::{AgentConn, ExecEvent, ExecStream};
use space_proto::{ExecRequest, Exited};
use tokio::sync::watch;

use crate::domain::CommandSpec;
pub use crate::error::exec_failure;
use crate::error::NodeError;
use crate::ids;
use crate::platform::Platform;
use crate::transcript::{self, OutputLimits, Progress, Stream, TranscriptWriter};

pub fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map(|s| s.as_str().trim_start_matches("SIG").to_string())
        .unwrap_or_else(|_| signal.to_string())
}

/// The result recorded for a session the platform had to abandon.
pub fn lost_result(command: &Command, why: &str) -> ProcessResult {
    ProcessResult {
        exit_code: None,
        signal: None,
        timed_out: false,
        oom_killed: false,
        duration_ms: 0,
        stdout_bytes: 0,
        stderr_bytes: 0,
        finished_at: ids::now(),
        error: Some(format!("the command's end was not observed: {why} (started {})", command.started_at)),
    }
}

/// What a client sends a running command, beyond signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Bytes for its stdin, or the end of them.
    Stdin,
    /// A new terminal size.
    Resize,
}

/// Refuses input the command was not started to take (the agent would drop
/// it and the caller would never know). A command recorded by an older
/// server carries no flags and takes everything, as it did then.
pub fn check_input(command: &Command, input: Input) -> Result<(), NodeError> {
    let (started_with, without, field) = match input {
        Input::Stdin => (command.stdin, "stdin", "stdin"),
        Input::Resize => (command.tty, "a terminal", "tty"),
    };
    if started_with == Some(false) {
        return Err(NodeError::new(
            ErrorCode::InvalidState,
            format!("this command was started without {without}; start one with \"{field}\": true"),
        )
        .with_details(serde_json::json!({ "field": field })));
    }
    Ok(())
}

/// Where a command's output, stdin and attach are served.
fn attach_for(sandbox_id: &str, command_id: &str) -> Attach {
    let base = format!("/v1/sandboxes/{sandbox_id}/commands/{command_id}");
    Attach { output: format!("{base}/output"), stdin: format!("{base}/stdin"), ws: format!("{base}/attach") }
}

impl Platform {
    /// Starts a command; returns once the process runs.
    pub async fn start_command(
        self: &std::sync::Arc<Self>,
        session: &crate::session::Session,
        spec: CommandSpec,
    ) -> Result<Command, NodeError> {
        let sandbox_id = session.id();
        let agent = session.agent("run a command")?;
        // After a `PUT .../network`, the placeholders of its bindings now.
        self.give_current_env(sandbox_id, agent).await?;
        let id = ids::new_id("cmd");
        let sandbox_dir = self.data.sandbox_state_dir(sandbox_id);
        let transcript_path = transcript::path_for(&sandbox_dir, &id);
        let writer = TranscriptWriter::create(&transcript_path)
            .map_err(|e| NodeError::internal("creating the transcript", e))?;
        let writer = writer.with_limits(self.output_limits(sandbox_id));
        let request = ExecRequest {
            argv: spec.argv.clone(),
            env: spec.env,
            cwd: spec.cwd,
            user: spec.user,
            stdin: spec.stdin,
            tty: spec.tty,
        };
        let started = Instant::now();
        let stream = match agent.exec(&request).await {
            Ok(stream) => stream,
            Err(err) => {
                let _ = std::fs::remove_dir_all(transcript_path.parent().unwrap_or(&transcript_path));
                return Err(exec_failure(err));
            }
        };
        let command = Command {
            id: id.clone(),
            sandbox_id: sandbox_id.to_string(),
            state: CommandState::Running,
            argv: spec.argv,
            pid: stream.pid,
            tag: spec.tag,
            started_at: ids::now(),
            attach: attach_for(sandbox_id, &id),
            stdin: Some(spec.stdin),
            tty: Some(spec.tty),
            result: None,
        };
        self.store.node().put_command(&command)?;
        self.metrics.command_starts.inc();
        self.store.node().put_command_stream(&id, stream.stream, spec.timeout_s)?;
        self.store.node().touch_sandbox(sandbox_id, command.started_at)?;
        self.follow(command.clone(), stream, writer, started, spec.timeout_s);
        self.changed();
        Ok(command)
    }

    /// A fork's copy of a command that was running in its source when the
    /// fork was made: a command of its own (new id, empty transcript) that
    /// follows the process the fork's agent still serves on `stream`.
    pub(crate) fn follow_copy(
        self: &std::sync::Arc<Self>,
        original: &Command,
        sandbox_id: &str,
        stream: ExecStream,
        timeout_s: u64,
    ) -> Result<(), NodeError> {
        let id = ids::new_id("cmd");
        let path = transcript::path_for(&self.data.sandbox_state_dir(sandbox_id), &id);
        let writer = TranscriptWriter::create(&path).map_err(|e| NodeError::internal("creating the transcript", e))?;
        let command = Command {
            id: id.clone(),
            sandbox_id: sandbox_id.to_string(),
            attach: attach_for(sandbox_id, &id),
            ..original.clone()
        };
        self.store.node().put_command(&command)?;
        self.store.node().put_command_stream(&id, stream.stream, timeout_s)?;
        let started = crate::ids::started_instant(command.started_at);
        let writer = writer.with_limits(self.output_limits(sandbox_id));
        self.follow(command, stream, writer, started, timeout_s);
        Ok(())
    }

    /// Registers a running command and moves its output into its transcript
    /// until it ends (also used for commands re-adopted after a restart).
    pub(crate) fn follow(
        self: &std::sync::Arc<Self>,
        command: Command,
        stream: ExecStream,
        writer: TranscriptWriter,
        started: Instant,
        timeout_s: u64,
    ) {
        let live = crate::platform::LiveCommand {
            progress: writer.subscribe(),
            stream: stream.stream,
            agent: stream.conn().clone(),
        };
        self.commands.lock().unwrap_or_else(|e| e.into_inner()).insert(command.id.clone(), live);
        let platform = self.clone();
        tokio::spawn(async move { platform.pump(command, stream, writer, started, timeout_s).await });
    }

    /// Moves a command's output into its transcript until it exits, then
    /// records the result (before readers are told the transcript is done).
    async fn pump(
        self: std::sync::Arc<Self>,
        mut command: Command,
        mut stream: ExecStream,
        mut writer: TranscriptWriter,
        started: Instant,
        timeout_s: u64,
    ) {
        let deadline = (timeout_s > 0)
            .then(|| tokio::time::Instant::from_std(started) + std::time::Duration::from_secs(timeout_s));
        let mut timed_out = false;
        let mut write_failed = false;
        let exited: Option<Exited> = loop {
            let event = match deadline {
                Some(deadline) if !timed_out => tokio::select! {
                    event = stream.next() => event,
                    () = tokio::time::sleep_until(deadline) => {
                        timed_out = true;
                        let _ = stream.conn().signal(stream.stream, nix::sys::signal::Signal::SIGKILL as i32).await;
                        continue;
                    }
                },
                _ => stream.next().await,
            };
            let appended = match event {
                Some(ExecEvent::Stdout(bytes)) => writer.append(Stream::Stdout, &bytes),
                Some(ExecEvent::Stderr(bytes)) => writer.append(Stream::Stderr, &bytes),
                Some(ExecEvent::Exit(exited)) => break Some(exited),
                None => break None,
            };
            if let Err(err) = appended {
                if !write_failed {
                    tracing::error!(command = %command.id, "writing the transcript: {err}");
                    write_failed = true;
                }
            }
        };
        let mut result = match exited {
            Some(exited) => ProcessResult {
                exit_code: exited.exit_code,
                signal: exited.signal.map(signal_name),
                timed_out,
                oom_killed: exited.oom_killed,
                duration_ms: started.elapsed().as_millis() as u64,
                stdout_bytes: writer.stdout_bytes,
                stderr_bytes: writer.stderr_bytes,
                finished_at: ids::now(),
                error: if write_failed {
                    Some("the host could not keep all of the output".to_string())
                } else {
                    writer.dropped_note()
                },
            },
            None => lost_result(&command, "the sandbox stopped before the command ended"),
        };
        result.stdout_bytes = writer.stdout_bytes;
        result.stderr_bytes = writer.stderr_bytes;
        self.metrics.command_ended(&result);
        command.state = CommandState::Exited;
        command.result = Some(result);
        if let Err(err) = self.store.node().put_command(&command) {
            tracing::error!(command = %command.id, "recording the result: {err}");
        }
        let _ = self.store.node().touch_sandbox(&command.sandbox_id, ids::now());
        writer.finish();
        self.commands.lock().unwrap_or_else(|e| e.into_inner()).remove(&command.id);
        self.changed();
    }

    /// The bounds on what a command of `sandbox_id` may keep of its output.
    pub(crate) fn output_limits(&self, sandbox_id: &str) -> OutputLimits {
        use std::sync::atomic::Ordering::Relaxed;
        OutputLimits {
            per_command: self.max_output_bytes.load(Relaxed),
            sandbox: Some((self.output_use(sandbox_id), self.max_sandbox_output_bytes.load(Relaxed))),
            host: Some((self.data.space().clone(), self.disk_reserve_bytes.load(Relaxed))),
        }
    }

    /// Command `command_id` of a sandbox its caller may act on.
    pub fn command(&self, sandbox: &crate::access::OwnedSandbox, command_id: &str) -> Result<Command, NodeError> {
        self.command_of(sandbox.id(), command_id)
    }

    pub(crate) fn command_of(&self, sandbox_id: &str, command_id: &str) -> Result<Command, NodeError> {
        if !ids::plausible(command_id, "cmd") {
            return Err(NodeError::not_found("command", command_id));
        }
        self.store
            .node()
            .command(command_id)?
            .filter(|c| c.sandbox_id == sandbox_id)
            .ok_or_else(|| NodeError::not_found("command", command_id))
    }

    pub fn live_command(&self, command_id: &str) -> Option<(watch::Receiver<Progress>, u32, AgentConn)> {
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        commands.get(command_id).map(|c| (c.progress.clone(), c.stream, c.agent.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(stdin: Option<bool>, tty: Option<bool>) -> Command {
        Command {
            id: "cmd_1".into(),
            sandbox_id: "sbx_1".into(),
            state: CommandState::Running,
            argv: vec!["sh".into()],
            pid: 1,
            tag: None,
            started_at: ids::now(),
            attach: attach_for("sbx_1", "cmd_1"),
            stdin,
            tty,
            result: None,
        }
    }

    #[test]
    fn input_is_refused_only_when_the_command_was_started_without_it() {
        let plain = command(Some(false), Some(false));
        assert_eq!(check_input(&plain, Input::Stdin).unwrap_err().code.http_status(), 409);
        assert_eq!(check_input(&plain, Input::Resize).unwrap_err().code.http_status(), 409);
        let piped = command(Some(true), Some(false));
        assert!(check_input(&piped, Input::Stdin).is_ok());
        assert_eq!(check_input(&piped, Input::Resize).unwrap_err().code, space_api::ErrorCode::InvalidState);
        assert!(check_input(&command(Some(true), Some(true)), Input::Resize).is_ok());
        // Recorded before the flags were: everything goes through, as then.
        let older: Command = serde_json::from_value(serde_json::json!({
            "id": "cmd_1", "sandbox_id": "sbx_1", "state": "running", "argv": ["sh"], "pid": 1,
            "started_at": "2024-01-01T00:00:00Z",
            "attach": {"output": "o", "stdin": "s", "ws": "w"}
        }))
        .unwrap();
        assert!(check_input(&older, Input::Stdin).is_ok());
        assert!(check_input(&older, Input::Resize).is_ok());
    }
}
