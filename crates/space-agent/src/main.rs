//! `space-agent`: PID 1 in every sandbox.
//!
//! It dials home to the host over one connection (a Unix socket bind-mounted
//! into the sandbox under gVisor), introduces itself, receives the sandbox's
//! identity, and then serves requests: health checks and commands, each on
//! its own stream. As init it also reaps every orphan.
//!
//! The agent trusts the host and nothing else; it must stay statically
//! linked and small, because it runs in roots it did not build.

mod cgroup;
mod egress;
mod exec;
mod init;
mod memory;
mod spawn;
mod sudo;
mod watch;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use std::{env, io, process, thread};

// The file code, shared with the host's volume files child.
use space_agent::{files, pool, users};
use space_proto::{
    read_frame, write_frame, ExecRequest, Frame, FrameKind, Hello, Identity, ProtocolErrorMessage, SignalRequest,
    Welcome, CONTROL_STREAM, PROTOCOL_VERSION,
};

/// Where the host's socket appears inside the sandbox unless told otherwise.
const DEFAULT_SOCKET: &str = "/.space/host/agent.sock";
/// The host over vsock (CID 2), instead of a socket path.
const VSOCK: &str = "vsock:2:1024";
/// `CAP_SYS_ADMIN` (linux/capability.h).
const CAP_SYS_ADMIN: libc::c_ulong = 21;
/// Frames queued for the socket before senders block (backpressure).
const OUTBOX_DEPTH: usize = 256;

fn main() {
    // Run as a program in the sandbox, not as its init (see `watch`).
    let args: Vec<String> = env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("watch") {
        process::exit(watch::main(&args[1..]));
    }
    // Installed as the sandbox's `sudo` (a link to the agent), or asked by name.
    let name = env::args_os().next().map(std::path::PathBuf::from);
    if name.as_deref().and_then(std::path::Path::file_name).is_some_and(|n| n == "sudo") {
        process::exit(sudo::main(&args));
    }
    if args.first().map(String::as_str) == Some("sudo") {
        process::exit(sudo::main(&args[1..]));
    }
    if let Err(err) = run() {
        eprintln!("space-agent: {err}");
        process::exit(1);
    }
}

fn run() -> Result<(), String> {
    // In a Firecracker guest the agent is the initramfs's /init: it boots
    // the root drive first, then reaches the host over vsock.
    let socket_path = if init::in_initramfs() {
        init::boot()?;
        init::stop_on_ctrl_alt_del()?;
        memory::exempt_agent_from_kernel_oom();
        VSOCK.to_string()
    } else {
        env::var("SPACE_AGENT_SOCKET").unwrap_or_else(|_| DEFAULT_SOCKET.to_string())
    };
    // Nothing else in the sandbox may read this process's memory (where
    // the channel key lives) or trace it: no core dumps, no /proc/1/mem.
    if let Err(err) = nix::sys::prctl::set_dumpable(false) {
        eprintln!("space-agent: PR_SET_DUMPABLE: {err}");
    }
    if !init::in_initramfs() {
        // Under gVisor the agent may hold CAP_SYS_ADMIN (for a fork's new
        // hostname); nothing it runs may: out of the bounding set, no
        // program it starts gets it. Without that, it does not serve.
        // SAFETY: prctl with integer arguments only.
        let dropped = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) };
        if dropped != 0 {
            return Err(format!("dropping CAP_SYS_ADMIN from the bounding set: {}", io::Error::last_os_error()));
        }
    }
    // Before any command runs, so every command gets a cgroup of its own
    // and finds /dev capped.
    cgroup::init();
    sudo::serve();
    if !init::booted_vm() {
        if let Err(err) = init::cap_dev() {
            eprintln!("space-agent: /dev keeps no size limit: {err}");
        }
    }
    let mut key = None;
    let (mut reader, writer, welcome) = connect(&socket_path, Some(Duration::from_secs(10)), false, &mut key, None)?;
    take_welcome(&welcome);
    if init::booted_vm() {
        // Before the first request is served: no command runs without them.
        init::mount_volumes(&welcome.volumes).map_err(|e| format!("mounting the volumes: {e}"))?;
    }
    memory::start();

    let (outbox, queued) = sync_channel::<Frame>(OUTBOX_DEPTH);
    let (sockets, new_sockets) = mpsc::channel::<UnixStream>();
    let _ = sockets.send(writer);
    thread::Builder::new()
        .name("writer".into())
        .spawn(move || write_loop(queued, new_sockets))
        .map_err(|e| e.to_string())?;

    let mut session = welcome.session;
    let outbox_for_relay = outbox.clone();
    let agent = Agent {
        uploads: Arc::default(),
        identity: Arc::new(Mutex::new(welcome)),
        outbox,
        sessions: Arc::default(),
        relay: egress::Relay::start(outbox_for_relay),
    };
    loop {
        agent.serve(&mut reader);
        // Quiesced for a snapshot, or the host went away: either way let go
        // of the socket entirely and dial again until the host listens.
        // Commands keep running; their output waits in the pipes.
        drop(reader);
        // A refused handshake (another process in the sandbox took the
        // host's socket first, and the host turned it away) is retried.
        let (new_reader, new_writer, welcome) = loop {
            let streams = exec::served_streams(&agent.sessions);
            match connect(&socket_path, None, true, &mut key, Some(streams)) {
                Ok(connected) => break connected,
                Err(err) => {
                    eprintln!("space-agent: redialing: {err}");
                    thread::sleep(Duration::from_millis(50));
                }
            }
        };
        take_welcome(&welcome);
        if welcome.session != session {
            // A new host session knows nothing of the old streams.
            exec::forget_streams(&agent.sessions);
            session = welcome.session;
        }
        let mut identity = agent.identity.lock().unwrap_or_else(|e| e.into_inner());
        if identity.sandbox_id != welcome.sandbox_id {
            // A clone of a template's snapshot woke up as a new sandbox: it
            // takes that sandbox's whole identity.
            *identity = welcome;
        }
        drop(identity);
        let _ = sockets.send(new_writer);
        reader = new_reader;
    }
}

/// What every handshake sets in the sandbox: its hostname and, in a
/// microVM (whose clock stood still while it was a snapshot), the time.
fn take_welcome(welcome: &Welcome) {
    memory::set_limit(welcome.memory_mib);
    if let Some(pem) = &welcome.trust_pem {
        egress::install_trust(pem);
    }
    if nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).as_deref() != Some(welcome.hostname.as_str())
    {
        if let Err(err) = nix::unistd::sethostname(&welcome.hostname) {
            eprintln!("space-agent: setting hostname: {err}");
        }
    }
    write_hostname_file(&welcome.hostname);
    if let (true, Some(host_ms)) = (init::booted_vm(), welcome.clock_unix_ms) {
        init::set_clock(host_ms);
    }
}

/// Makes `/etc/hostname` name the sandbox, as on a machine of its own. A
/// template's root holds whatever its build left there: a neutral name, or
/// in templates built before that was written, the build host's.
fn write_hostname_file(hostname: &str) {
    const FILE: &str = "/etc/hostname";
    let wanted = format!("{hostname}\n");
    if std::fs::read_to_string(FILE).is_ok_and(|now| now == wanted) || !std::path::Path::new("/etc").is_dir() {
        return;
    }
    // Written beside it and renamed over it: whatever stands there (a link
    // included) is replaced, never written through.
    let beside = "/etc/.hostname.space-agent";
    let _ = std::fs::remove_file(beside);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(beside)
        .and_then(|mut file| std::io::Write::write_all(&mut file, wanted.as_bytes()))
        .and_then(|()| std::fs::set_permissions(beside, std::os::unix::fs::PermissionsExt::from_mode(0o644)))
        .and_then(|()| std::fs::rename(beside, FILE));
    if let Err(err) = written {
        let _ = std::fs::remove_file(beside);
        eprintln!("space-agent: writing {FILE}: {err}");
    }
}

/// The highest stream number the host has opened (told on a redial).
static LAST_STREAM: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Dials the host and does the handshake; returns the reading half, the
/// writing half and the host's welcome. `patience` None: dial forever.
/// `key` is the channel key the host gave (presented on every dial, and
/// replaced when the host gives a new one); it never leaves this process's
/// memory otherwise.
fn connect(
    path: &str,
    patience: Option<Duration>,
    reconnect: bool,
    key: &mut Option<String>,
    streams: Option<Vec<u32>>,
) -> Result<(UnixStream, UnixStream, Welcome), String> {
    let stream = dial(path, patience).map_err(|e| format!("dialing {path}: {e}"))?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    let mut reader = stream;
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").into(),
        pid: process::id(),
        reconnect,
        channel_key: key.clone(),
        last_stream: streams.as_ref().map(|_| LAST_STREAM.load(std::sync::atomic::Ordering::Relaxed)),
        streams,
    };
    write_frame(&mut writer, &Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello)).map_err(|e| e.to_string())?;
    let welcome: Welcome = read_frame(&mut reader)
        .and_then(|frame| frame.expect(FrameKind::Welcome))
        .map_err(|e| format!("handshake: {e}"))?;
    if welcome.protocol_version != PROTOCOL_VERSION {
        return Err(format!("host speaks protocol {}, agent {PROTOCOL_VERSION}", welcome.protocol_version));
    }
    let mut welcome = welcome;
    if let Some(new) = welcome.channel_key.take() {
        *key = Some(new);
    }
    Ok((reader, writer, welcome))
}

/// Connects to the host, retrying (with backoff up to a second) while its
/// socket is not there.
fn dial(path: &str, patience: Option<Duration>) -> io::Result<UnixStream> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(2);
    loop {
        let attempt = if path == VSOCK { init::dial_vsock() } else { UnixStream::connect(path) };
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(err) if patience.is_some_and(|p| started.elapsed() >= p) => return Err(err),
            Err(_) => {
                thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(if started.elapsed() < Duration::from_secs(5) {
                    20
                } else {
                    1000
                }));
            }
        }
    }
}

/// Writes queued frames to the current socket. After a `QuiesceAck` (or a
/// failed write) it drops the socket and waits for the next one.
fn write_loop(queued: Receiver<Frame>, sockets: Receiver<UnixStream>) {
    let Ok(mut writer) = sockets.recv() else { return };
    for frame in queued {
        let quiesce_ack = frame.kind == FrameKind::QuiesceAck;
        let mut written = write_frame(&mut writer, &frame).is_ok();
        if written && frame.kind == FrameKind::Exit {
            exec::exit_written(frame.stream);
        }
        // A frame that could not be written goes out on the next socket,
        // except the ack of a quiesce: it answers the connection that asked,
        // which is gone. Sent on the next one it made the agent drop that
        // socket too, with no redial to follow (its reader still served):
        // a host restarted during a suspend never heard from it again.
        while !written {
            drop(writer);
            writer = match sockets.recv() {
                Ok(next) => next,
                Err(_) => return,
            };
            if quiesce_ack {
                break;
            }
            written = write_frame(&mut writer, &frame).is_ok();
            if written && frame.kind == FrameKind::Exit {
                exec::exit_written(frame.stream);
            }
        }
        if quiesce_ack && written {
            drop(writer);
            writer = match sockets.recv() {
                Ok(next) => next,
                Err(_) => return,
            };
        }
    }
}

/// What the agent keeps about each running command.
pub(crate) type Sessions = Arc<Mutex<HashMap<u32, exec::SessionControl>>>;

/// Becomes the sandbox a warm-pool member is handed out as: its env for
/// every later command, and fresh entropy for the kernel's random state.
fn take_identity(current: &Mutex<Welcome>, identity: Identity) {
    if let Some(pem) = &identity.trust_pem {
        egress::install_trust(pem);
    }
    current.lock().unwrap_or_else(|e| e.into_inner()).env = identity.env;
    let entropy: Vec<u8> = (0..identity.entropy_hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(identity.entropy_hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    init::add_entropy(&entropy);
}

/// What handling one frame means for the connection.
enum Served {
    Continue,
    Quiesced,
}

struct Agent {
    uploads: files::Uploads,
    identity: Arc<Mutex<Welcome>>,
    outbox: SyncSender<Frame>,
    sessions: Sessions,
    relay: egress::Relay,
}

impl Agent {
    /// Serves frames until the host asks for a quiesce or the connection ends.
    fn serve(&self, reader: &mut UnixStream) {
        loop {
            let frame = match read_frame(reader) {
                Ok(frame) => frame,
                Err(err) => {
                    eprintln!("space-agent: connection closed: {err}");
                    return;
                }
            };
            if frame.stream & space_proto::AGENT_STREAM_BIT == 0 {
                LAST_STREAM
                    .fetch_max(frame.stream & !space_proto::PORT_STREAM_BIT, std::sync::atomic::Ordering::Relaxed);
            }
            match self.handle(frame) {
                Ok(Served::Continue) => {}
                Ok(Served::Quiesced) => return,
                Err(message) => {
                    let error = ProtocolErrorMessage { message };
                    let _ = self.outbox.send(Frame::message(CONTROL_STREAM, FrameKind::Error, &error));
                }
            }
        }
    }

    fn handle(&self, frame: Frame) -> Result<Served, String> {
        match frame.kind {
            FrameKind::Quiesce => {
                // A snapshot must hold no host socket: relayed egress goes too.
                self.relay.cut_all();
                // The writer sends the ack after everything queued before
                // it, then drops its socket; `serve` returns and the reader
                // drops the other half, so no socket of ours is left open.
                let _ = self.outbox.send(Frame::new(CONTROL_STREAM, FrameKind::QuiesceAck, Vec::new()));
                return Ok(Served::Quiesced);
            }
            FrameKind::EgressData | FrameKind::EgressEof | FrameKind::EgressAck | FrameKind::EgressClose => {
                self.relay.take_frame(frame).map_err(|e| e.to_string())?
            }
            FrameKind::PortOpen => self.relay.open_port(frame.stream, &frame.payload),
            FrameKind::Resize => exec::resize(&self.sessions, frame.stream, frame.parse().map_err(|e| e.to_string())?),
            FrameKind::FileRead => files::read(frame.stream, frame.parse().map_err(|e| e.to_string())?, &self.outbox),
            FrameKind::FileWrite => {
                files::begin_write(frame.stream, frame.parse().map_err(|e| e.to_string())?, &self.uploads)
            }
            FrameKind::FileData => files::write_data(frame.stream, &frame.payload, &self.uploads),
            FrameKind::FileEnd => files::end_write(frame.stream, &self.uploads, &self.outbox),
            FrameKind::FileDelete => {
                files::delete(frame.stream, frame.parse().map_err(|e| e.to_string())?, &self.outbox)
            }
            FrameKind::PathOp => files::path_op(frame.stream, frame.parse().map_err(|e| e.to_string())?, &self.outbox),
            FrameKind::Identity => {
                let identity: Identity = frame.parse().map_err(|e| e.to_string())?;
                take_identity(&self.identity, identity);
                let _ = self.outbox.send(Frame::new(frame.stream, FrameKind::IdentityAck, Vec::new()));
            }
            FrameKind::Ping => {
                let _ = self.outbox.send(Frame::new(frame.stream, FrameKind::Pong, frame.payload));
            }
            FrameKind::Exec => {
                let request: ExecRequest = frame.parse().map_err(|e| e.to_string())?;
                let identity = self.identity.lock().unwrap_or_else(|e| e.into_inner()).clone();
                exec::start(frame.stream, request, &identity, &self.outbox, &self.sessions);
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
        Ok(Served::Continue)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;
    use std::time::Duration;

    use space_proto::{read_frame, Frame, FrameKind, CONTROL_STREAM};

    /// The host went away as the agent acked its quiesce: the ack is not
    /// carried over to the next connection, and what follows it is sent
    /// there.
    #[test]
    fn an_ack_to_a_quiesce_whose_connection_is_gone_is_not_sent_on_the_next() {
        let (queue, queued) = mpsc::sync_channel(8);
        let (sockets, new_sockets) = mpsc::channel();
        let (gone, host_gone) = UnixStream::pair().unwrap();
        drop(host_gone);
        sockets.send(gone).unwrap();
        std::thread::spawn(move || super::write_loop(queued, new_sockets));
        queue.send(Frame::new(CONTROL_STREAM, FrameKind::QuiesceAck, Vec::new())).unwrap();
        let (next, mut host) = UnixStream::pair().unwrap();
        sockets.send(next).unwrap();
        queue.send(Frame::new(5, FrameKind::Pong, b"health".to_vec())).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let frame = read_frame(&mut host).expect("a frame on the new connection within 10 s");
        assert_eq!((frame.stream, frame.kind), (5, FrameKind::Pong), "the pong, not the stale ack");
        drop(queue);
        let mut rest = Vec::new();
        let _ = host.read_to_end(&mut rest);
        assert!(rest.is_empty(), "nothing else: {rest:?}");
    }
}
