//! `space-agent`: PID 1 in every sandbox.
//!
//! It dials home to the host over one connection (a Unix socket bind-mounted
//! into the sandbox under gVisor), introduces itself, receives the sandbox's
//! identity, and then serves requests: health checks and commands, each on
//! its own stream. As init it also reaps every orphan.
//!
//! The agent trusts the host and nothing else; it must stay statically
//! linked and small, because it runs in roots it did not build.

mod exec;
mod pool;
mod spawn;
mod users;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use std::{env, io, process, thread};

use space_proto::{
    read_frame, write_frame, ExecRequest, Frame, FrameKind, Hello, ProtocolErrorMessage, SignalRequest, Welcome,
    CONTROL_STREAM, PROTOCOL_VERSION,
};

/// Where the host's socket appears inside the sandbox unless told otherwise.
const DEFAULT_SOCKET: &str = "/.space/host/agent.sock";
/// Frames queued for the socket before senders block (backpressure).
const OUTBOX_DEPTH: usize = 256;

fn main() {
    if let Err(err) = run() {
        eprintln!("space-agent: {err}");
        process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let socket_path = env::var("SPACE_AGENT_SOCKET").unwrap_or_else(|_| DEFAULT_SOCKET.to_string());
    let stream = dial(&socket_path, Duration::from_secs(10)).map_err(|e| format!("dialing {socket_path}: {e}"))?;
    let mut reader = stream.try_clone().map_err(|e| e.to_string())?;
    let mut writer = stream;

    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").into(),
        pid: process::id(),
    };
    write_frame(&mut writer, &Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello)).map_err(|e| e.to_string())?;
    let welcome: Welcome = read_frame(&mut reader)
        .and_then(|frame| frame.expect(FrameKind::Welcome))
        .map_err(|e| format!("handshake: {e}"))?;
    if welcome.protocol_version != PROTOCOL_VERSION {
        return Err(format!("host speaks protocol {}, agent {PROTOCOL_VERSION}", welcome.protocol_version));
    }
    if let Err(err) = nix::unistd::sethostname(&welcome.hostname) {
        eprintln!("space-agent: setting hostname: {err}");
    }

    let (outbox, queued) = sync_channel::<Frame>(OUTBOX_DEPTH);
    thread::Builder::new()
        .name("writer".into())
        .spawn(move || write_loop(writer, queued))
        .map_err(|e| e.to_string())?;

    let agent = Agent { identity: Arc::new(welcome), outbox, sessions: Arc::default() };
    agent.serve(&mut reader);
    // The host went away: the sandbox has no one to serve.
    Ok(())
}

/// Connects to the host, retrying while its socket is not there yet.
fn dial(path: &str, patience: Duration) -> io::Result<UnixStream> {
    let deadline = Instant::now() + patience;
    loop {
        match UnixStream::connect(path) {
            Ok(stream) => return Ok(stream),
            Err(err) if Instant::now() >= deadline => return Err(err),
            Err(_) => thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn write_loop(mut writer: UnixStream, queued: Receiver<Frame>) {
    for frame in queued {
        if write_frame(&mut writer, &frame).is_err() {
            // The reader sees the same failure and ends the agent.
            return;
        }
    }
}

/// What the agent keeps about each running command.
pub(crate) type Sessions = Arc<Mutex<HashMap<u32, exec::SessionControl>>>;

struct Agent {
    identity: Arc<Welcome>,
    outbox: SyncSender<Frame>,
    sessions: Sessions,
}

impl Agent {
    fn serve(&self, reader: &mut UnixStream) {
        loop {
            let frame = match read_frame(reader) {
                Ok(frame) => frame,
                Err(err) => {
                    eprintln!("space-agent: connection closed: {err}");
                    return;
                }
            };
            if let Err(message) = self.handle(frame) {
                let error = ProtocolErrorMessage { message };
                let _ = self.outbox.send(Frame::message(CONTROL_STREAM, FrameKind::Error, &error));
            }
        }
    }

    fn handle(&self, frame: Frame) -> Result<(), String> {
        match frame.kind {
            FrameKind::Ping => {
                let _ = self.outbox.send(Frame::new(frame.stream, FrameKind::Pong, frame.payload));
            }
            FrameKind::Exec => {
                let request: ExecRequest = frame.parse().map_err(|e| e.to_string())?;
                exec::start(frame.stream, request, &self.identity, &self.outbox, &self.sessions);
            }
            FrameKind::Stdin => exec::write_stdin(&self.sessions, frame.stream, &frame.payload),
            FrameKind::StdinEof => exec::close_stdin(&self.sessions, frame.stream),
            FrameKind::Signal => {
                let request: SignalRequest = frame.parse().map_err(|e| e.to_string())?;
                exec::signal(&self.sessions, frame.stream, request.signal);
            }
            FrameKind::Error => {
                let message: ProtocolErrorMessage = frame.parse().map_err(|e| e.to_string())?;
                eprintln!("space-agent: host reported: {}", message.message);
            }
            other => return Err(format!("the agent does not accept {other:?} frames")),
        }
        Ok(())
    }
}
