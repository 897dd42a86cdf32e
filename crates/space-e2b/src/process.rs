//! envd's `process.Process` service over SPACE's commands: every process
//! the SDK starts is a SPACE command (with its transcript), and E2B's pid
//! is the process's real pid in the sandbox.

use space_http::server::ResetOnClose;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{json, Value};
use space_api::{Command, CommandRequest, ProcessResult};
use space_engine::AgentConn;
use tokio::sync::mpsc;

use super::connect::{end, message, stream_response, Envelopes, RpcError};
use super::envd::acting;
use super::target::Target;
use super::wire::header;
use crate::domain::CommandSpec;
use crate::transcript::Stream;
use crate::E2bState;
use space_node::follow::{follow, Emitted};

/// How often an idle stream says it is alive, unless the client asks
/// (`Keepalive-Ping-Interval`, seconds).
const KEEPALIVE: Duration = Duration::from_secs(50);

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn text<'a>(value: &'a Value, field: &str) -> Option<&'a str> {
    value.get(field).and_then(Value::as_str)
}

/// The command's lifetime from `Connect-Timeout-Ms` (whole seconds, up):
/// E2B's command timeout; absent means none.
fn timeout_s(headers: &HeaderMap) -> u64 {
    header(headers, "connect-timeout-ms").and_then(|v| v.parse::<u64>().ok()).map_or(0, |ms| ms.div_ceil(1000))
}

/// `ProcessEvent.end` for how a command ended, as envd words it (Go's
/// wait status: `exit status 3`, `signal: killed`).
fn end_event(result: &ProcessResult) -> Value {
    let mut end = match (result.exit_code, result.signal.as_deref()) {
        (Some(code), _) => json!({"exitCode": code, "exited": true, "status": format!("exit status {code}")}),
        (None, Some(signal)) => {
            let word = match signal {
                "KILL" => "killed".to_string(),
                "TERM" => "terminated".to_string(),
                "INT" => "interrupt".to_string(),
                "HUP" => "hangup".to_string(),
                "QUIT" => "quit".to_string(),
                "SEGV" => "segmentation fault".to_string(),
                "ABRT" => "aborted".to_string(),
                other => other.to_ascii_lowercase(),
            };
            json!({"exitCode": -1, "exited": false, "status": format!("signal: {word}")})
        }
        (None, None) => json!({"exitCode": -1, "exited": false, "status": "unknown"}),
    };
    let why = match (&result.error, result.timed_out, result.oom_killed) {
        (Some(error), _, _) => Some(error.clone()),
        (None, true, _) => Some("the command's timeout elapsed".to_string()),
        (None, false, true) => Some("killed: the sandbox ran out of memory".to_string()),
        (None, false, false) => None,
    };
    if let Some(why) = why {
        end["error"] = json!(why);
    }
    json!({"event": {"end": end}})
}

/// How a stream of a command's events ends, given how the command did.
enum Ending {
    /// Its `end` event, then end-of-stream.
    Event(Value),
    /// No `end` event: the command's deadline (`Connect-Timeout-Ms`)
    /// passed, which envd reports as the call's own error.
    Error(RpcError),
    /// The stream breaks off: the sandbox went away under it (killed, or
    /// stopped), as a connection to envd inside it would. The SDK then asks
    /// `/health` and says the sandbox is gone.
    Break,
}

fn ending(result: &ProcessResult) -> Ending {
    if result.timed_out {
        return Ending::Error(RpcError::new("deadline_exceeded", "the command's timeout elapsed: it was killed"));
    }
    if result.exit_code.is_none() && result.signal.is_none() {
        // The platform's record for a command whose end it could not see.
        return Ending::Break;
    }
    Ending::Event(end_event(result))
}

/// Streams a command's events: `start` with its pid, its output as it
/// comes (keepalives while it is quiet), then how it ended ([`Ending`]).
/// `deadline`: when the call itself ends with `deadline_exceeded` (a
/// `Connect` past its `Connect-Timeout-Ms`; the process goes on). A break
/// resets the connection (`reset`), as one to envd in a killed sandbox
/// ends: E2B's SDK names the sandbox killed only then.
fn events(
    state: &E2bState,
    sandbox_id: &str,
    command: &Command,
    tty: bool,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
    reset: Option<ResetOnClose>,
) -> Response {
    let followed = match follow(&state.platform, sandbox_id, &command.id, 0, true) {
        Ok(followed) => followed,
        Err(err) => return RpcError::from(err).into_response(),
    };
    let (frames, out) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let pid = command.pid;
    tokio::spawn(async move {
        let mut followed = followed;
        let _ = frames.send(Ok(message(&json!({"event": {"start": {"pid": pid}}})))).await;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let outcome = loop {
            let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
            let item = tokio::select! {
                item = followed.recv() => item,
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => {
                    break Ending::Error(RpcError::new("deadline_exceeded", "the call's timeout elapsed"));
                }
                _ = ticker.tick() => {
                    if frames.send(Ok(message(&json!({"event": {"keepalive": {}}})))).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let frame = match item {
                Some(Emitted::Chunk(chunk)) => {
                    let name = match (tty, chunk.stream) {
                        (true, _) => "pty",
                        (false, Stream::Stdout) => "stdout",
                        (false, Stream::Stderr) => "stderr",
                    };
                    json!({"event": {"data": {name: b64(&chunk.bytes)}}})
                }
                Some(Emitted::Exit(result)) => break ending(&result),
                None => break Ending::Break,
            };
            if frames.send(Ok(message(&frame))).await.is_err() {
                return; // the client went away; the process goes on
            }
            ticker.reset();
        };
        let _ = match outcome {
            Ending::Event(end_event) => {
                let _ = frames.send(Ok(message(&end_event))).await;
                frames.send(Ok(end(None))).await
            }
            Ending::Error(error) => frames.send(Ok(end(Some(&error)))).await,
            Ending::Break => {
                if let Some(reset) = &reset {
                    reset.arm();
                }
                frames.send(Err(std::io::Error::other("the sandbox went away under the stream"))).await
            }
        };
    });
    stream_response(out)
}

fn keepalive(headers: &HeaderMap) -> Duration {
    header(headers, "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(KEEPALIVE, Duration::from_secs)
}

/// The first (and only) message of a server-streaming call.
async fn only_message(body: Body) -> Result<Value, RpcError> {
    Envelopes::new(body).next().await?.ok_or_else(|| RpcError::invalid("the request holds no message"))
}

/// `Start`: runs `process.cmd` with `process.args` (the SDK sends
/// `/bin/bash -l -c <command>`), answering with its events.
pub async fn start(
    state: E2bState,
    target: Target,
    headers: &HeaderMap,
    body: Body,
    reset: Option<ResetOnClose>,
) -> Response {
    let request = match only_message(body).await {
        Ok(request) => request,
        Err(err) => return err.into_response(),
    };
    let process = &request["process"];
    let Some(cmd) = text(process, "cmd") else {
        return RpcError::invalid("process.cmd is required").into_response();
    };
    let mut argv = vec![cmd.to_string()];
    for arg in process.get("args").and_then(Value::as_array).into_iter().flatten() {
        match arg.as_str() {
            Some(arg) => argv.push(arg.to_string()),
            None => return RpcError::invalid("process.args must be strings").into_response(),
        }
    }
    let env = match process.get("envs") {
        None | Some(Value::Null) => Default::default(),
        Some(envs) => match serde_json::from_value(envs.clone()) {
            Ok(env) => env,
            Err(_) => return RpcError::invalid("process.envs must map names to strings").into_response(),
        },
    };
    let pty = request.get("pty").filter(|p| p.is_object());
    // As E2B's default user (in its home) unless the call names another.
    let mut target = target;
    let (agent, work) = match acting(&state, &mut target).await {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    let spec = CommandSpec::try_from(CommandRequest {
        argv: Some(argv),
        cmd: None,
        env,
        // None: the account's own home (from the sandbox's passwd).
        cwd: text(process, "cwd").filter(|c| !c.is_empty()).map(|c| target.path(c)),
        user: target.user.clone(),
        // A pty is the process's input whatever `stdin` says, as in E2B's envd.
        stdin: Some(request.get("stdin").and_then(Value::as_bool).unwrap_or(false) || pty.is_some()),
        tty: pty.is_some(),
        timeout_s: timeout_s(headers),
        tag: text(&request, "tag").map(str::to_string),
    });
    let spec = match spec {
        Ok(spec) => spec,
        Err(err) => return RpcError::from(err).into_response(),
    };
    let command = match state.platform.start_command(&work, spec).await {
        Ok(command) => command,
        Err(err) => return RpcError::from(err).into_response(),
    };
    drop(work); // a running command keeps the sandbox from being idle
    if let Some(size) = pty.and_then(|p| terminal_size(&p["size"])) {
        if let Some((_, stream, _)) = state.platform.live_command(&command.id) {
            let _ = agent.resize(stream, size).await;
        }
    }
    // Start's deadline is the command's own timeout (it is killed then).
    events(&state, &target.id, &command, pty.is_some(), keepalive(headers), None, reset)
}

fn terminal_size(size: &Value) -> Option<space_proto::TerminalSize> {
    let dim = |name: &str| size.get(name).and_then(Value::as_u64).and_then(|v| u16::try_from(v).ok());
    Some(space_proto::TerminalSize { cols: dim("cols")?, rows: dim("rows")? })
}

/// A running command named by a `ProcessSelector` (`{"pid": N}` or
/// `{"tag": "..."}`), with its agent stream.
fn running(state: &E2bState, target: &Target, selector: &Value) -> Result<(Command, u32, AgentConn), RpcError> {
    let pid = selector.get("pid").and_then(Value::as_u64);
    let tag = text(selector, "tag");
    if pid.is_none() && tag.is_none() {
        return Err(RpcError::invalid("name the process by pid or tag"));
    }
    let commands = state.platform.commands_of(&target.sandbox).map_err(RpcError::from)?;
    commands
        .into_iter()
        .filter(|c| c.result.is_none())
        .filter(|c| pid.is_none_or(|pid| u64::from(c.pid) == pid) && tag.is_none_or(|t| c.tag.as_deref() == Some(t)))
        .find_map(|c| state.platform.live_command(&c.id).map(|(_, stream, agent)| (c, stream, agent)))
        .ok_or_else(|| match (pid, tag) {
            (Some(pid), _) => RpcError::not_found(format!("process with pid {pid} not found")),
            (None, tag) => RpcError::not_found(format!("process with tag {} not found", tag.unwrap_or_default())),
        })
}

/// `Connect`: the events of a running process, its output so far first
/// (envd sends only what comes after; replaying loses nothing).
pub async fn connect(
    state: E2bState,
    target: Target,
    headers: &HeaderMap,
    body: Body,
    reset: Option<ResetOnClose>,
) -> Response {
    let request = match only_message(body).await {
        Ok(request) => request,
        Err(err) => return err.into_response(),
    };
    let (command, _, _) = match running(&state, &target, &request["process"]) {
        Ok(found) => found,
        Err(err) => return err.into_response(),
    };
    let tty = command.tty == Some(true);
    let deadline = header(headers, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    events(&state, &target.id, &command, tty, keepalive(headers), deadline, reset)
}

fn decode_input(input: &Value) -> Result<Vec<u8>, RpcError> {
    let data = text(input, "stdin").or_else(|| text(input, "pty")).unwrap_or_default();
    base64::engine::general_purpose::STANDARD.decode(data).map_err(|_| RpcError::invalid("input must be base64"))
}

async fn send_input(agent: &AgentConn, stream: u32, bytes: &[u8]) -> Result<(), RpcError> {
    for chunk in bytes.chunks(space_proto::MAX_OUTPUT_CHUNK) {
        agent.send_stdin(stream, chunk.to_vec()).await.map_err(|_| RpcError::not_found("the process has exited"))?;
    }
    Ok(())
}

/// `StreamInput`: a client stream of stdin for one process.
pub async fn stream_input(state: E2bState, target: Target, body: Body) -> Response {
    let mut envelopes = Envelopes::new(body);
    let result = async {
        let first = envelopes.next().await?.ok_or_else(|| RpcError::invalid("the stream holds no message"))?;
        let selector = first.get("start").map(|s| &s["process"]).ok_or_else(|| RpcError::invalid("start first"))?;
        let (_, stream, agent) = running(&state, &target, selector)?;
        while let Some(next) = envelopes.next().await? {
            if let Some(input) = next.get("data").map(|d| &d["input"]) {
                send_input(&agent, stream, &decode_input(input)?).await?;
            }
        }
        Ok::<(), RpcError>(())
    }
    .await;
    let (frames, out) = mpsc::channel::<Result<Bytes, std::io::Error>>(2);
    match result {
        Ok(()) => {
            let _ = frames.try_send(Ok(message(&json!({}))));
            let _ = frames.try_send(Ok(end(None)));
        }
        Err(err) => {
            let _ = frames.try_send(Ok(end(Some(&err))));
        }
    }
    drop(frames);
    stream_response(out)
}

/// The unary methods: `List`, `SendSignal`, `SendInput`, `CloseStdin`, `Update`.
pub async fn unary(state: &E2bState, target: &Target, method: &str, request: Value) -> Result<Value, RpcError> {
    match method {
        "List" => {
            let commands = state.platform.commands_of(&target.sandbox).map_err(RpcError::from)?;
            let processes: Vec<Value> = commands
                .into_iter()
                .filter(|c| c.result.is_none() && state.platform.live_command(&c.id).is_some())
                .map(|c| {
                    let mut process = json!({
                        "pid": c.pid,
                        "config": {"cmd": c.argv.first().cloned().unwrap_or_default(), "args": c.argv.get(1..).unwrap_or_default(), "envs": {}},
                    });
                    if let Some(tag) = c.tag {
                        process["tag"] = json!(tag);
                    }
                    process
                })
                .collect();
            Ok(json!({"processes": processes}))
        }
        "SendSignal" => {
            let (_, stream, agent) = running(state, target, &request["process"])?;
            let signal = match &request["signal"] {
                Value::String(name) => name.trim_start_matches("SIGNAL_").parse::<nix::sys::signal::Signal>().ok(),
                Value::Number(n) => n.as_i64().and_then(|n| nix::sys::signal::Signal::try_from(n as i32).ok()),
                _ => None,
            }
            .ok_or_else(|| RpcError::invalid(format!("unknown signal {}", request["signal"])))?;
            agent.signal(stream, signal as i32).await.map_err(|_| RpcError::not_found("the process has exited"))?;
            Ok(json!({}))
        }
        "SendInput" => {
            let (_, stream, agent) = running(state, target, &request["process"])?;
            send_input(&agent, stream, &decode_input(&request["input"])?).await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let (_, stream, agent) = running(state, target, &request["process"])?;
            agent.close_stdin(stream).await.map_err(|_| RpcError::not_found("the process has exited"))?;
            Ok(json!({}))
        }
        "Update" => {
            let (_, stream, agent) = running(state, target, &request["process"])?;
            if let Some(size) = terminal_size(&request["pty"]["size"]) {
                agent.resize(stream, size).await.map_err(|_| RpcError::not_found("the process has exited"))?;
            }
            Ok(json!({}))
        }
        _ => Err(RpcError::new("unimplemented", format!("process.Process/{method} is not served by SPACE"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(exit_code: Option<i32>, signal: Option<&str>) -> ProcessResult {
        ProcessResult {
            exit_code,
            signal: signal.map(str::to_string),
            timed_out: false,
            oom_killed: false,
            duration_ms: 1,
            stdout_bytes: 0,
            stderr_bytes: 0,
            finished_at: space_api::Timestamp::now(),
            error: None,
        }
    }

    #[test]
    fn ends_are_worded_as_envd_words_them() {
        let exited = end_event(&result(Some(3), None));
        assert_eq!(exited["event"]["end"], json!({"exitCode": 3, "exited": true, "status": "exit status 3"}));
        let killed = end_event(&result(None, Some("KILL")));
        assert_eq!(killed["event"]["end"]["status"], "signal: killed");
        assert_eq!(killed["event"]["end"]["exitCode"], -1);
        let mut timed_out = result(None, Some("KILL"));
        timed_out.timed_out = true;
        assert!(end_event(&timed_out)["event"]["end"]["error"].as_str().unwrap().contains("timeout"));
    }

    #[test]
    fn a_deadline_ends_with_its_error_and_a_lost_sandbox_breaks_the_stream() {
        let mut timed_out = result(None, Some("KILL"));
        timed_out.timed_out = true;
        assert!(matches!(ending(&timed_out), Ending::Error(e) if e.code == "deadline_exceeded"));
        let command: Command = serde_json::from_value(json!({
            "id": "cmd_1", "sandbox_id": "sbx_1", "state": "running", "argv": ["sleep", "60"], "pid": 7,
            "started_at": "2026-01-01T00:00:00Z", "attach": {"output": "", "stdin": "", "ws": ""}
        }))
        .unwrap();
        let lost = space_node::commands::lost_result(&command, "the sandbox was deleted");
        assert!(matches!(ending(&lost), Ending::Break));
        assert!(matches!(ending(&result(Some(0), None)), Ending::Event(_)));
        assert!(matches!(ending(&result(None, Some("TERM"))), Ending::Event(_)));
    }
}
