//! The host side of the agent channel: handshake, health, command streams.
//!
//! One reader task owns the socket's read half and routes frames to the
//! stream they belong to; one writer task owns the write half. Everything the
//! guest sends is untrusted: headers are validated before any allocation,
//! frames for unknown streams are dropped, and a protocol violation closes
//! the connection.
//!
//! A connection can be quiesced (before a snapshot: the agent lets go of its
//! socket) and re-attached to the agent's next socket after a restore; the
//! command streams survive both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use space_proto::{
    decode_header, ExecFailed, ExecRequest, Exited, FileError, FileInfo, FileListing, FileRequest, Frame, FrameKind,
    Hello, Identity, PathInfo, PathOpKind, PathRequest, ProtoError, ProtocolErrorMessage, SignalRequest, Started,
    Welcome, AGENT_STREAM_BIT, CONTROL_STREAM, EGRESS_WINDOW, HEADER_LEN, MAX_PAYLOAD, PORT_STREAM_BIT,
    PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// Frames buffered per stream before the reader waits (backpressure).
const STREAM_DEPTH: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent connection is closed")]
    Disconnected,
    #[error("the agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("could not start the process: {}", .0.message)]
    ExecFailed(ExecFailed),
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtoError),
    #[error("{}", .0.message)]
    File(FileError),
    /// A connection that did not present the sandbox's channel key: some
    /// other process in the sandbox dialed in before its agent.
    #[error("the connection did not prove it is the sandbox's agent")]
    Impostor,
    /// Nothing accepted the connection to a port in the sandbox.
    #[error("{0}")]
    PortClosed(String),
}

struct Shared {
    streams: Mutex<HashMap<u32, mpsc::Sender<Frame>>>,
    next_stream: AtomicU32,
    closed: AtomicBool,
    closed_notify: tokio::sync::Notify,
    /// Set while a quiesce is asked for; the reader then ends quietly.
    quiescing: AtomicBool,
    /// Told when the agent acknowledged a quiesce and closed its socket.
    detached: tokio::sync::Notify,
    /// Hands the writer task the write half of each new socket.
    writers: mpsc::UnboundedSender<OwnedWriteHalf>,
    welcome: Welcome,
    /// Takes the egress connections the agent opens; none: they are closed.
    egress: Mutex<Option<EgressHandler>>,
    /// The socket in use, for [`AgentConn::hang_up`].
    socket: Mutex<Option<std::os::unix::net::UnixStream>>,
}

/// What the host does with each egress connection the agent relays.
pub type EgressHandler = Arc<dyn Fn(EgressStream) + Send + Sync>;

/// One connection a program in the sandbox made to its egress proxy,
/// relayed by the agent over the channel.
pub struct EgressStream {
    pub stream: u32,
    frames: mpsc::Receiver<Frame>,
    conn: AgentConn,
}

impl EgressStream {
    /// The connection as a byte stream. Two tasks carry it: the agent's
    /// bytes in (acknowledged as they are taken, so the agent never has more
    /// than [`EGRESS_WINDOW`] in flight), and what is written to the
    /// returned end out, never more than the agent has acknowledged.
    /// When the returned end is dropped, the agent is told the connection
    /// is over.
    pub fn into_io(self) -> tokio::io::DuplexStream {
        let (near, far) = tokio::io::duplex(EGRESS_WINDOW);
        let (mut near_read, mut near_write) = tokio::io::split(near);
        let EgressStream { stream, mut frames, conn } = self;
        let credit = Arc::new(tokio::sync::Semaphore::new(EGRESS_WINDOW));
        let (up_credit, up_conn) = (credit.clone(), conn.clone());
        let upward = tokio::spawn(async move {
            let mut buf = vec![0u8; space_proto::MAX_OUTPUT_CHUNK];
            loop {
                let n = match near_read.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                match up_credit.acquire_many(n as u32).await {
                    Ok(permits) => permits.forget(),
                    Err(_) => return,
                }
                if up_conn.send(Frame::new(stream, FrameKind::EgressData, buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
        });
        tokio::spawn(async move {
            let mut upward = upward;
            loop {
                tokio::select! {
                    // The host's side is done (the gateway let go of it).
                    _ = &mut upward => break,
                    frame = frames.recv() => match frame {
                        Some(frame) if frame.kind == FrameKind::EgressData => {
                            let n = frame.payload.len() as u32;
                            if near_write.write_all(&frame.payload).await.is_err() {
                                break;
                            }
                            let _ = conn.send(Frame::new(stream, FrameKind::EgressAck, n.to_le_bytes().to_vec())).await;
                        }
                        Some(frame) if frame.kind == FrameKind::EgressEof => {
                            let _ = near_write.shutdown().await;
                        }
                        Some(frame) if frame.kind == FrameKind::EgressAck => {
                            let n = frame.payload.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                            credit.add_permits(n.unwrap_or(0).min(EGRESS_WINDOW as u32) as usize);
                        }
                        // Closed by the agent, or the channel is gone.
                        _ => {
                            upward.abort();
                            break;
                        }
                    },
                }
            }
            credit.close();
            conn.close_stream(stream);
            let _ = conn.send(Frame::new(stream, FrameKind::EgressClose, Vec::new())).await;
        });
        far
    }
}

/// A connected, handshaken agent. Cheap to clone.
#[derive(Clone)]
pub struct AgentConn {
    outbox: mpsc::Sender<Frame>,
    shared: Arc<Shared>,
    hello: Arc<Hello>,
}

/// Reads the agent's hello on a new socket and answers with `welcome`.
async fn greet(
    socket: UnixStream,
    welcome: &Welcome,
    patience: Duration,
) -> Result<(OwnedReadHalf, OwnedWriteHalf, Hello, String), AgentError> {
    let (mut read_half, mut write_half) = socket.into_split();
    let hello: Hello = tokio::time::timeout(patience, read_frame(&mut read_half))
        .await
        .map_err(|_| AgentError::Timeout(patience))??
        .expect(FrameKind::Hello)?;
    let refuse = |message: String| Frame::message(CONTROL_STREAM, FrameKind::Error, &ProtocolErrorMessage { message });
    if hello.protocol_version != PROTOCOL_VERSION {
        let message = format!("host speaks protocol {PROTOCOL_VERSION}, agent {}", hello.protocol_version);
        let _ = write_frame(&mut write_half, &refuse(message)).await;
        return Err(ProtoError::Version { theirs: hello.protocol_version }.into());
    }
    // With a key on record, only the agent holding it is let in; without
    // one (the sandbox's first connection), this one gets a fresh key.
    let (key, issued) = match &welcome.channel_key {
        Some(expected) => {
            let presented = hello.channel_key.as_deref().unwrap_or("");
            if !space_proto::constant_time_eq(presented.as_bytes(), expected.as_bytes()) {
                let _ = write_frame(&mut write_half, &refuse("not this sandbox's agent".into())).await;
                return Err(AgentError::Impostor);
            }
            (expected.clone(), None)
        }
        None => {
            let key = new_channel_key();
            (key.clone(), Some(key))
        }
    };
    // Stamped as it leaves: a restored microVM sets its clock from it.
    let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok();
    let welcome =
        Welcome { clock_unix_ms: clock.map(|c| c.as_millis() as u64), channel_key: issued, ..welcome.clone() };
    write_frame(&mut write_half, &Frame::message(CONTROL_STREAM, FrameKind::Welcome, &welcome)).await?;
    Ok((read_half, write_half, hello, key))
}

/// 256 random bits, hex.
fn new_channel_key() -> String {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).expect("the kernel's random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a command stream delivers, in order; `Exit` is always last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(Exited),
}

/// What reading a path gives.
pub enum FileRead {
    /// A regular file: its size and mode, then its bytes from `data`.
    File {
        info: FileInfo,
        data: FileStream,
    },
    Dir(FileListing),
}

/// The bytes of a file being read.
pub struct FileStream {
    frames: mpsc::Receiver<Frame>,
    _guard: StreamGuard,
}

/// A file being written: send its bytes, then `finish`.
pub struct FileUpload {
    frames: mpsc::Receiver<Frame>,
    guard: StreamGuard,
}

/// Unregisters a stream when dropped.
struct StreamGuard {
    stream: u32,
    conn: AgentConn,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.conn.close_stream(self.stream);
    }
}

fn file_failure(frame: &Frame) -> AgentError {
    match frame.parse::<FileError>() {
        Ok(error) => AgentError::File(error),
        Err(err) => err.into(),
    }
}

impl FileStream {
    /// The next chunk; `None` at the end of the file.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, AgentError> {
        let frame = self.frames.recv().await.ok_or(AgentError::Disconnected)?;
        match frame.kind {
            FrameKind::FileData => Ok(Some(frame.payload)),
            FrameKind::FileEnd => Ok(None),
            FrameKind::FileFailed => Err(file_failure(&frame)),
            got => Err(ProtoError::Unexpected { expected: FrameKind::FileData, got }.into()),
        }
    }
}

impl FileUpload {
    pub async fn send(&self, bytes: Vec<u8>) -> Result<(), AgentError> {
        self.guard.conn.send(Frame::new(self.guard.stream, FrameKind::FileData, bytes)).await
    }

    /// Ends the file and waits for the agent to confirm it is written.
    pub async fn finish(mut self) -> Result<(), AgentError> {
        self.guard.conn.send(Frame::new(self.guard.stream, FrameKind::FileEnd, Vec::new())).await?;
        let frame = self.frames.recv().await.ok_or(AgentError::Disconnected)?;
        match frame.kind {
            FrameKind::FileDone => Ok(()),
            FrameKind::FileFailed => Err(file_failure(&frame)),
            got => Err(ProtoError::Unexpected { expected: FrameKind::FileDone, got }.into()),
        }
    }
}

/// A running command's stream.
pub struct ExecStream {
    pub stream: u32,
    pub pid: u32,
    frames: mpsc::Receiver<Frame>,
    conn: AgentConn,
}

impl AgentConn {
    /// Reads the agent's hello, answers with its identity, starts the I/O
    /// tasks and checks health with a ping.
    pub async fn handshake(socket: UnixStream, welcome: Welcome, patience: Duration) -> Result<AgentConn, AgentError> {
        Self::handshake_adopting(socket, welcome, patience, &[]).await.map(|(conn, _)| conn)
    }

    /// A handshake that also takes over streams the agent still has from an
    /// earlier connection of the same session (`(stream, pid)` pairs): a
    /// restarted server picking up running commands, or a fork its
    /// source's. Of these, only those the agent says it still serves are
    /// taken (all, if it does not say). Their streams are registered before
    /// anything is read, so no frame of theirs is lost.
    pub async fn handshake_adopting(
        socket: UnixStream,
        welcome: Welcome,
        patience: Duration,
        adopt: &[(u32, u32)],
    ) -> Result<(AgentConn, Vec<ExecStream>), AgentError> {
        let (read_half, write_half, hello, key) = greet(socket, &welcome, patience).await?;
        // Closes the connection if the handshake fails from here on: its I/O
        // tasks would keep it open, and the agent, connected to a host that
        // gave up on it, would never dial again.
        let closer = {
            use std::os::fd::AsFd;
            let fd = read_half.as_ref().as_fd().try_clone_to_owned();
            fd.map(std::os::unix::net::UnixStream::from).map_err(ProtoError::from)?
        };
        let adopt: Vec<(u32, u32)> = match &hello.streams {
            Some(served) => adopt.iter().filter(|(stream, _)| served.contains(stream)).copied().collect(),
            None => adopt.to_vec(),
        };
        // What later redials must present.
        let welcome = Welcome { channel_key: Some(key), ..welcome };
        let (writers, new_writers) = mpsc::unbounded_channel();
        let _ = writers.send(write_half);
        let mut streams = HashMap::new();
        let mut receivers = Vec::new();
        for &(stream, pid) in &adopt {
            let (tx, rx) = mpsc::channel(STREAM_DEPTH);
            streams.insert(stream, tx);
            receivers.push((stream, pid, rx));
        }
        // New streams start past every stream the previous host opened,
        // taken over or not: a frame the agent still owes one of those (an
        // exit) must not reach a request that happens to get its number.
        let served = hello.streams.iter().flatten().chain(hello.last_stream.as_ref());
        let next_stream = adopt.iter().map(|(stream, _)| stream).chain(served).map(|s| s + 1).max().unwrap_or(1);
        let shared = Arc::new(Shared {
            streams: Mutex::new(streams),
            next_stream: AtomicU32::new(next_stream),
            closed: AtomicBool::new(false),
            closed_notify: tokio::sync::Notify::new(),
            quiescing: AtomicBool::new(false),
            detached: tokio::sync::Notify::new(),
            writers,
            welcome,
            egress: Mutex::new(None),
            socket: Mutex::new(closer.try_clone().ok()),
        });
        let (outbox, queued) = mpsc::channel(256);
        tokio::spawn(write_loop(queued, new_writers));
        let conn = AgentConn { outbox, shared, hello: Arc::new(hello) };
        tokio::spawn(read_loop(read_half, conn.clone()));
        let adopted = receivers
            .into_iter()
            .map(|(stream, pid, frames)| ExecStream { stream, pid, frames, conn: conn.clone() })
            .collect();
        if let Err(err) = conn.ping(patience).await {
            let _ = closer.shutdown(std::net::Shutdown::Both);
            return Err(err);
        }
        Ok((conn, adopted))
    }

    /// The identity this connection gives its agent.
    pub fn welcome(&self) -> &Welcome {
        &self.shared.welcome
    }

    /// Asks the agent to let go of its socket (before a snapshot) and waits
    /// until it has: it answers `QuiesceAck` and closes its end. Command
    /// streams stay open for [`AgentConn::reattach`].
    pub async fn quiesce(&self, patience: Duration) -> Result<(), AgentError> {
        if self.is_closed() {
            return Err(AgentError::Disconnected);
        }
        let detached = self.shared.detached.notified();
        tokio::pin!(detached);
        detached.as_mut().enable();
        self.shared.quiescing.store(true, Ordering::Release);
        self.send(Frame::new(CONTROL_STREAM, FrameKind::Quiesce, Vec::new())).await?;
        let waited = tokio::select! {
            () = &mut detached => Ok(()),
            () = self.closed() => Err(AgentError::Disconnected),
            () = tokio::time::sleep(patience) => Err(AgentError::Timeout(patience)),
        };
        if waited.is_err() {
            self.shared.quiescing.store(false, Ordering::Release);
        }
        waited
    }

    /// Continues a quiesced connection on the agent's new socket (after a
    /// restore): same identity, same streams; checks health with a ping.
    pub async fn reattach(&self, socket: UnixStream, patience: Duration) -> Result<(), AgentError> {
        let (read_half, write_half, _hello, _key) = greet(socket, &self.shared.welcome, patience).await?;
        let socket = {
            use std::os::fd::AsFd;
            read_half.as_ref().as_fd().try_clone_to_owned().ok().map(std::os::unix::net::UnixStream::from)
        };
        *self.shared.socket.lock().unwrap_or_else(|e| e.into_inner()) = socket;
        self.shared.quiescing.store(false, Ordering::Release);
        self.shared.writers.send(write_half).map_err(|_| AgentError::Disconnected)?;
        tokio::spawn(read_loop(read_half, self.clone()));
        self.ping(patience).await.map(drop)
    }

    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Ends the connection from this side: its socket is shut down, so
    /// the peer sees its end (a volume's files child then exits) and every
    /// call on it fails. A sandbox's agent would redial; this is for peers
    /// that serve one connection.
    pub fn hang_up(&self) {
        if let Some(socket) = self.shared.socket.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// Resolves once the connection is gone (the sandbox stopped or died).
    pub async fn closed(&self) {
        let notified = self.shared.closed_notify.notified();
        if self.is_closed() {
            return;
        }
        notified.await;
    }

    fn open_stream(&self) -> Result<(u32, mpsc::Receiver<Frame>), AgentError> {
        if self.is_closed() {
            return Err(AgentError::Disconnected);
        }
        let stream = self.shared.next_stream.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(STREAM_DEPTH);
        self.shared.streams.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, tx);
        Ok((stream, rx))
    }

    /// A connection to `port` on the sandbox's loopback (a server running
    /// there), carried like an egress connection; `PortClosed` when nothing
    /// accepts it. It ends at a quiesce.
    pub async fn open_port(&self, port: u16, patience: Duration) -> Result<EgressStream, AgentError> {
        if self.is_closed() {
            return Err(AgentError::Disconnected);
        }
        let stream = PORT_STREAM_BIT | (self.shared.next_stream.fetch_add(1, Ordering::Relaxed) & !PORT_STREAM_BIT);
        let (tx, mut frames) = mpsc::channel(STREAM_DEPTH);
        self.shared.streams.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, tx);
        self.send(Frame::new(stream, FrameKind::PortOpen, port.to_le_bytes().to_vec())).await?;
        let answer = tokio::time::timeout(patience, frames.recv()).await;
        match answer {
            Ok(Some(frame)) if frame.kind == FrameKind::PortOpened => {
                Ok(EgressStream { stream, frames, conn: self.clone() })
            }
            Ok(Some(frame)) => {
                self.close_stream(stream);
                Err(AgentError::PortClosed(String::from_utf8_lossy(&frame.payload).into_owned()))
            }
            Ok(None) => Err(AgentError::Disconnected),
            Err(_) => {
                self.close_stream(stream);
                let _ = self.send(Frame::new(stream, FrameKind::EgressClose, Vec::new())).await;
                Err(AgentError::Timeout(patience))
            }
        }
    }

    /// Hands every egress connection the agent relays to `handler`.
    pub fn on_egress(&self, handler: EgressHandler) {
        *self.shared.egress.lock().unwrap_or_else(|e| e.into_inner()) = Some(handler);
    }

    fn close_stream(&self, stream: u32) {
        self.shared.streams.lock().unwrap_or_else(|e| e.into_inner()).remove(&stream);
    }

    async fn send(&self, frame: Frame) -> Result<(), AgentError> {
        self.outbox.send(frame).await.map_err(|_| AgentError::Disconnected)
    }

    /// A health check: the agent echoes the ping. Returns the round trip.
    pub async fn ping(&self, patience: Duration) -> Result<Duration, AgentError> {
        let (stream, mut rx) = self.open_stream()?;
        let started = Instant::now();
        let result = async {
            self.send(Frame::new(stream, FrameKind::Ping, b"health".to_vec())).await?;
            match tokio::time::timeout(patience, rx.recv()).await {
                Err(_) => Err(AgentError::Timeout(patience)),
                Ok(None) => Err(AgentError::Disconnected),
                Ok(Some(frame)) if frame.kind == FrameKind::Pong => Ok(started.elapsed()),
                Ok(Some(frame)) => Err(ProtoError::Unexpected { expected: FrameKind::Pong, got: frame.kind }.into()),
            }
        }
        .await;
        self.close_stream(stream);
        result
    }

    /// Gives a sandbox handed out from a warm pool its own environment and
    /// fresh entropy; returns once the agent has taken them.
    pub async fn set_identity(&self, identity: &Identity, patience: Duration) -> Result<(), AgentError> {
        let (stream, mut rx) = self.open_stream()?;
        let result = async {
            self.send(Frame::message(stream, FrameKind::Identity, identity)).await?;
            match tokio::time::timeout(patience, rx.recv()).await {
                Err(_) => Err(AgentError::Timeout(patience)),
                Ok(None) => Err(AgentError::Disconnected),
                Ok(Some(frame)) if frame.kind == FrameKind::IdentityAck => Ok(()),
                Ok(Some(frame)) => {
                    Err(ProtoError::Unexpected { expected: FrameKind::IdentityAck, got: frame.kind }.into())
                }
            }
        }
        .await;
        self.close_stream(stream);
        result
    }

    /// Reads a path inside the sandbox: a file's bytes or a directory's
    /// listing; with `tar`, a directory as a tar archive (as `File`).
    pub async fn read_file(&self, path: &str, tar: bool) -> Result<FileRead, AgentError> {
        let (stream, mut frames) = self.open_stream()?;
        let guard = StreamGuard { stream, conn: self.clone() };
        let request = FileRequest { path: path.into(), tar, ..FileRequest::default() };
        self.send(Frame::message(stream, FrameKind::FileRead, &request)).await?;
        let first = frames.recv().await.ok_or(AgentError::Disconnected)?;
        match first.kind {
            FrameKind::FileInfo => {
                Ok(FileRead::File { info: first.parse()?, data: FileStream { frames, _guard: guard } })
            }
            FrameKind::FileListing => Ok(FileRead::Dir(first.parse()?)),
            FrameKind::FileFailed => Err(file_failure(&first)),
            got => Err(ProtoError::Unexpected { expected: FrameKind::FileInfo, got }.into()),
        }
    }

    /// Starts writing a file (parents are created; an existing file is replaced).
    /// With `tar`, the bytes are a tar archive unpacked into directory `path`.
    pub async fn write_file(&self, path: &str, mode: u32, tar: bool) -> Result<FileUpload, AgentError> {
        self.write_file_with(FileRequest { path: path.into(), mode: Some(mode), tar, ..FileRequest::default() }).await
    }

    /// Starts a write as `request` asks (its owner, in place or not).
    pub async fn write_file_with(&self, request: FileRequest) -> Result<FileUpload, AgentError> {
        let (stream, frames) = self.open_stream()?;
        let guard = StreamGuard { stream, conn: self.clone() };
        self.send(Frame::message(stream, FrameKind::FileWrite, &request)).await?;
        Ok(FileUpload { frames, guard })
    }

    /// Deletes a path; a directory only when empty unless `recursive`.
    pub async fn delete_path(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        let (stream, mut frames) = self.open_stream()?;
        let _guard = StreamGuard { stream, conn: self.clone() };
        let request = FileRequest { path: path.into(), recursive, ..FileRequest::default() };
        self.send(Frame::message(stream, FrameKind::FileDelete, &request)).await?;
        let frame = frames.recv().await.ok_or(AgentError::Disconnected)?;
        match frame.kind {
            FrameKind::FileDone => Ok(()),
            FrameKind::FileFailed => Err(file_failure(&frame)),
            got => Err(ProtoError::Unexpected { expected: FrameKind::FileDone, got }.into()),
        }
    }

    /// Stats a path, makes a directory or moves a path (see [`PathOpKind`]).
    pub async fn path_op(&self, op: PathOpKind, path: &str, to: Option<&str>) -> Result<PathInfo, AgentError> {
        self.path_op_with(PathRequest { op, path: path.into(), to: to.map(str::to_string), owner: None }).await
    }

    /// A path operation as `request` asks (a mkdir's owner).
    pub async fn path_op_with(&self, request: PathRequest) -> Result<PathInfo, AgentError> {
        let (stream, mut frames) = self.open_stream()?;
        let _guard = StreamGuard { stream, conn: self.clone() };
        self.send(Frame::message(stream, FrameKind::PathOp, &request)).await?;
        let frame = frames.recv().await.ok_or(AgentError::Disconnected)?;
        match frame.kind {
            FrameKind::PathInfo => Ok(frame.parse()?),
            FrameKind::FileFailed => Err(file_failure(&frame)),
            got => Err(ProtoError::Unexpected { expected: FrameKind::PathInfo, got }.into()),
        }
    }

    /// Starts a process; returns once it runs (or could not be started).
    pub async fn exec(&self, request: &ExecRequest) -> Result<ExecStream, AgentError> {
        let (stream, mut frames) = self.open_stream()?;
        let result = async {
            self.send(Frame::message(stream, FrameKind::Exec, request)).await?;
            let first = frames.recv().await.ok_or(AgentError::Disconnected)?;
            match first.kind {
                FrameKind::Started => Ok(first.parse::<Started>()?.pid),
                FrameKind::ExecFailed => Err(AgentError::ExecFailed(first.parse()?)),
                got => Err(ProtoError::Unexpected { expected: FrameKind::Started, got }.into()),
            }
        }
        .await;
        match result {
            Ok(pid) => Ok(ExecStream { stream, pid, frames, conn: self.clone() }),
            Err(err) => {
                self.close_stream(stream);
                Err(err)
            }
        }
    }

    /// Sends bytes to a command's stdin.
    pub async fn send_stdin(&self, stream: u32, bytes: Vec<u8>) -> Result<(), AgentError> {
        self.send(Frame::new(stream, FrameKind::Stdin, bytes)).await
    }

    pub async fn close_stdin(&self, stream: u32) -> Result<(), AgentError> {
        self.send(Frame::new(stream, FrameKind::StdinEof, Vec::new())).await
    }

    /// Resizes a tty command's terminal.
    pub async fn resize(&self, stream: u32, size: space_proto::TerminalSize) -> Result<(), AgentError> {
        self.send(Frame::message(stream, FrameKind::Resize, &size)).await
    }

    /// Sends `signal` (a number) to a command's process group.
    pub async fn signal(&self, stream: u32, signal: i32) -> Result<(), AgentError> {
        self.send(Frame::message(stream, FrameKind::Signal, &SignalRequest { signal })).await
    }
}

impl ExecStream {
    /// The next event; `None` only if the connection broke before the exit.
    pub async fn next(&mut self) -> Option<ExecEvent> {
        let frame = self.frames.recv().await?;
        let event = match frame.kind {
            FrameKind::Stdout => ExecEvent::Stdout(frame.payload),
            FrameKind::Stderr => ExecEvent::Stderr(frame.payload),
            FrameKind::Exit => match frame.parse::<Exited>() {
                Ok(exited) => {
                    self.conn.close_stream(self.stream);
                    ExecEvent::Exit(exited)
                }
                Err(_) => return None,
            },
            _ => return None,
        };
        Some(event)
    }

    pub fn conn(&self) -> &AgentConn {
        &self.conn
    }
}

impl Drop for ExecStream {
    fn drop(&mut self) {
        self.conn.close_stream(self.stream);
    }
}

async fn read_frame(reader: &mut OwnedReadHalf) -> Result<Frame, ProtoError> {
    let mut header_bytes = [0u8; HEADER_LEN];
    reader.read_exact(&mut header_bytes).await?;
    let header = decode_header(&header_bytes)?;
    debug_assert!(header.len <= MAX_PAYLOAD);
    let mut payload = vec![0u8; header.len];
    reader.read_exact(&mut payload).await?;
    Ok(Frame { stream: header.stream, kind: header.kind, payload })
}

async fn write_frame(writer: &mut OwnedWriteHalf, frame: &Frame) -> Result<(), ProtoError> {
    writer.write_all(&frame.encode()?).await?;
    Ok(())
}

/// Writes queued frames to the current socket; a new socket's write half
/// replaces the old one (after a quiesce and restore).
async fn write_loop(mut queued: mpsc::Receiver<Frame>, mut writers: mpsc::UnboundedReceiver<OwnedWriteHalf>) {
    let Some(mut writer) = writers.recv().await else { return };
    let mut buf = Vec::new();
    loop {
        let frame = tokio::select! {
            biased;
            next = writers.recv() => {
                match next {
                    Some(next) => writer = next,
                    None => return,
                }
                continue;
            }
            frame = queued.recv() => match frame {
                Some(frame) => frame,
                None => return,
            },
        };
        buf.clear();
        let _ = frame.encode_into(&mut buf);
        // Coalesce what is already queued into one write.
        while buf.len() < 256 * 1024 {
            match queued.try_recv() {
                Ok(next) => {
                    let _ = next.encode_into(&mut buf);
                }
                Err(_) => break,
            }
        }
        if writer.write_all(&buf).await.is_err() {
            // Wait for the next socket; what was in this write is lost.
            match writers.recv().await {
                Some(next) => writer = next,
                None => return,
            }
        }
    }
}

async fn read_loop(mut reader: OwnedReadHalf, conn: AgentConn) {
    let shared = conn.shared.clone();
    let mut acknowledged = false;
    loop {
        let frame = match read_frame(&mut reader).await {
            Ok(frame) => frame,
            Err(err) => {
                tracing::debug!("agent connection closed: {err}");
                break;
            }
        };
        if frame.stream == CONTROL_STREAM {
            match frame.kind {
                FrameKind::QuiesceAck if shared.quiescing.load(Ordering::Acquire) => acknowledged = true,
                FrameKind::Error => {
                    let message = frame.parse::<ProtocolErrorMessage>().map(|m| m.message).unwrap_or_default();
                    tracing::warn!("the agent reported a protocol error: {message}");
                }
                _ => {}
            }
            continue;
        }
        if frame.kind == FrameKind::EgressOpen && frame.stream & AGENT_STREAM_BIT != 0 {
            open_egress(&conn, frame.stream).await;
            continue;
        }
        let target = shared.streams.lock().unwrap_or_else(|e| e.into_inner()).get(&frame.stream).cloned();
        if let Some(target) = target {
            // A receiver that went away just means nobody listens any more.
            let _ = target.send(frame).await;
        }
    }
    if acknowledged {
        // The agent let go on purpose; its streams go on after reattach,
        // but not its egress connections: it cut them.
        shared
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|stream, _| stream & (AGENT_STREAM_BIT | PORT_STREAM_BIT) == 0);
        shared.detached.notify_waiters();
        return;
    }
    shared.closed.store(true, Ordering::Release);
    // Dropping every sender ends every open stream with `None`.
    shared.streams.lock().unwrap_or_else(|e| e.into_inner()).clear();
    shared.closed_notify.notify_waiters();
}

/// Registers an egress connection the agent opened and hands it over (or
/// closes it at once when nobody takes egress).
async fn open_egress(conn: &AgentConn, stream: u32) {
    let handler = conn.shared.egress.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let Some(handler) = handler else {
        let _ = conn.send(Frame::new(stream, FrameKind::EgressClose, Vec::new())).await;
        return;
    };
    let (tx, frames) = mpsc::channel(STREAM_DEPTH);
    conn.shared.streams.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, tx);
    handler(EgressStream { stream, frames, conn: conn.clone() });
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use tokio::io::AsyncWriteExt;

    use super::*;

    fn welcome() -> Welcome {
        Welcome::plain("sbx_t", "t", 1)
    }

    fn exec_x() -> ExecRequest {
        ExecRequest { argv: vec!["x".into()], env: BTreeMap::new(), cwd: None, user: None, stdin: false, tty: false }
    }

    /// Plays an agent up to its first exec request: hello, welcome, pong.
    async fn greet_and_take_exec(guest: UnixStream) -> (OwnedReadHalf, OwnedWriteHalf, Frame) {
        let (mut read, mut write) = guest.into_split();
        write.write_all(&hello_frame(PROTOCOL_VERSION)).await.unwrap();
        let _welcome = read_frame(&mut read).await.unwrap();
        let ping = read_frame(&mut read).await.unwrap();
        write.write_all(&Frame::new(ping.stream, FrameKind::Pong, ping.payload).encode().unwrap()).await.unwrap();
        let exec = read_frame(&mut read).await.unwrap();
        assert_eq!(exec.kind, FrameKind::Exec);
        (read, write, exec)
    }

    fn hello_frame(version: u32) -> Vec<u8> {
        let hello = Hello {
            protocol_version: version,
            agent_version: "test".into(),
            pid: 1,
            reconnect: false,
            channel_key: None,
            streams: None,
            last_stream: None,
        };
        Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello).encode().unwrap()
    }

    #[tokio::test]
    async fn a_hostile_or_wrong_agent_is_refused_without_harm() {
        // A header announcing a 4 GiB payload is refused before allocation.
        let (host, mut guest) = UnixStream::pair().unwrap();
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(&0u32.to_le_bytes());
        huge.push(FrameKind::Hello as u8);
        guest.write_all(&huge).await.unwrap();
        let refused = AgentConn::handshake(host, welcome(), Duration::from_secs(2)).await;
        assert!(matches!(refused, Err(AgentError::Protocol(ProtoError::TooLarge(_)))));

        // Another protocol version is refused, and told so.
        let (host, mut guest) = UnixStream::pair().unwrap();
        guest.write_all(&hello_frame(PROTOCOL_VERSION + 1)).await.unwrap();
        let refused = AgentConn::handshake(host, welcome(), Duration::from_secs(2)).await;
        assert!(matches!(refused, Err(AgentError::Protocol(ProtoError::Version { .. }))));

        // Silence is a timeout, not a hang.
        let (host, _guest) = UnixStream::pair().unwrap();
        let silent = AgentConn::handshake(host, welcome(), Duration::from_millis(100)).await;
        assert!(matches!(silent, Err(AgentError::Timeout(_))));
    }

    #[tokio::test]
    async fn a_handshake_that_fails_after_the_welcome_closes_the_connection() {
        let (host, guest) = UnixStream::pair().unwrap();
        let (mut read, mut write) = guest.into_split();
        write.write_all(&hello_frame(PROTOCOL_VERSION)).await.unwrap();
        // The agent's answers are lost (its writer is elsewhere): no pong.
        let refused = AgentConn::handshake(host, welcome(), Duration::from_millis(200)).await;
        assert!(matches!(refused, Err(AgentError::Timeout(_))), "{:?}", refused.err());
        assert_eq!(read_frame(&mut read).await.unwrap().kind, FrameKind::Welcome);
        assert_eq!(read_frame(&mut read).await.unwrap().kind, FrameKind::Ping);
        // Closed, so the agent dials again.
        let mut rest = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(5), read.read_to_end(&mut rest)).await;
        assert!(end.is_ok(), "the host closed the connection it gave up on");
        let _keep = write;
    }

    #[tokio::test]
    async fn garbage_after_the_handshake_closes_the_connection_and_ends_streams() {
        let (host, guest) = UnixStream::pair().unwrap();
        let fake_agent = tokio::spawn(async move {
            let (read, mut write, exec) = greet_and_take_exec(guest).await;
            let started = Frame::message(exec.stream, FrameKind::Started, &Started { pid: 7 });
            write.write_all(&started.encode().unwrap()).await.unwrap();
            // Frames for streams nobody opened are dropped; an unknown kind
            // is a protocol violation that ends the connection.
            write.write_all(&Frame::new(999, FrameKind::Stdout, b"stray".to_vec()).encode().unwrap()).await.unwrap();
            write.write_all(&[1, 0, 0, 0, 1, 0, 0, 0, 250, 0]).await.unwrap();
            (read, write)
        });
        let conn = AgentConn::handshake(host, welcome(), Duration::from_secs(2)).await.unwrap();
        let request = exec_x();
        let mut stream = conn.exec(&request).await.unwrap();
        assert_eq!(stream.pid, 7);
        let _keep_open = fake_agent.await.unwrap();
        assert_eq!(tokio::time::timeout(Duration::from_secs(2), stream.next()).await.unwrap(), None);
        tokio::time::timeout(Duration::from_secs(2), conn.closed()).await.expect("closed() resolves");
        assert!(conn.is_closed());
        assert!(matches!(conn.exec(&request).await, Err(AgentError::Disconnected)));
    }

    #[tokio::test]
    async fn streams_survive_a_quiesce_and_reattach() {
        let (host, guest) = UnixStream::pair().unwrap();
        let first = tokio::spawn(async move {
            let (mut read, mut write, exec) = greet_and_take_exec(guest).await;
            let started = Frame::message(exec.stream, FrameKind::Started, &Started { pid: 9 });
            write.write_all(&started.encode().unwrap()).await.unwrap();
            write
                .write_all(&Frame::new(exec.stream, FrameKind::Stdout, b"before".to_vec()).encode().unwrap())
                .await
                .unwrap();
            let quiesce = read_frame(&mut read).await.unwrap();
            assert_eq!(quiesce.kind, FrameKind::Quiesce);
            write
                .write_all(&Frame::new(CONTROL_STREAM, FrameKind::QuiesceAck, vec![]).encode().unwrap())
                .await
                .unwrap();
            exec.stream // both halves drop here: the agent let go
        });
        let conn = AgentConn::handshake(host, welcome(), Duration::from_secs(2)).await.unwrap();
        let request = exec_x();
        let mut stream = conn.exec(&request).await.unwrap();
        assert_eq!(stream.next().await, Some(ExecEvent::Stdout(b"before".to_vec())));
        conn.quiesce(Duration::from_secs(2)).await.expect("quiesced");
        let stream_id = first.await.unwrap();
        assert!(!conn.is_closed(), "a quiesced connection is not closed");

        // Another process dialing in without the key (or with a wrong one)
        // is turned away, and the connection is unharmed.
        let key = conn.welcome().channel_key.clone();
        assert!(key.as_ref().is_some_and(|k| k.len() == 64), "the first handshake issued a key");
        for presented in [None, Some("0".repeat(64))] {
            let (host, guest) = UnixStream::pair().unwrap();
            let (mut read, mut write) = guest.into_split();
            let hello = Hello {
                protocol_version: PROTOCOL_VERSION,
                agent_version: "fake".into(),
                pid: 1,
                reconnect: true,
                channel_key: presented,
                streams: None,
                last_stream: None,
            };
            write.write_all(&Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello).encode().unwrap()).await.unwrap();
            let refused = conn.reattach(host, Duration::from_secs(2)).await;
            assert!(matches!(refused, Err(AgentError::Impostor)), "{refused:?}");
            assert_eq!(read_frame(&mut read).await.unwrap().kind, FrameKind::Error, "told, and given no welcome");
        }

        let (host, guest) = UnixStream::pair().unwrap();
        let second = tokio::spawn(async move {
            let (mut read, mut write) = guest.into_split();
            let hello = Hello {
                protocol_version: PROTOCOL_VERSION,
                agent_version: "t".into(),
                pid: 1,
                reconnect: true,
                channel_key: key,
                streams: None,
                last_stream: None,
            };
            write.write_all(&Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello).encode().unwrap()).await.unwrap();
            let welcome: Welcome = read_frame(&mut read).await.unwrap().expect(FrameKind::Welcome).unwrap();
            assert_eq!(welcome.session, 1, "the same session goes on");
            assert_eq!(welcome.channel_key, None, "a redial is never sent the key");
            let ping = read_frame(&mut read).await.unwrap();
            write.write_all(&Frame::new(ping.stream, FrameKind::Pong, ping.payload).encode().unwrap()).await.unwrap();
            write
                .write_all(&Frame::new(stream_id, FrameKind::Stdout, b"after".to_vec()).encode().unwrap())
                .await
                .unwrap();
            let exit = Frame::message(
                stream_id,
                FrameKind::Exit,
                &Exited { exit_code: Some(0), signal: None, oom_killed: false },
            );
            write.write_all(&exit.encode().unwrap()).await.unwrap();
            (read, write)
        });
        conn.reattach(host, Duration::from_secs(2)).await.expect("reattached");
        assert_eq!(stream.next().await, Some(ExecEvent::Stdout(b"after".to_vec())));
        assert_eq!(
            stream.next().await,
            Some(ExecEvent::Exit(Exited { exit_code: Some(0), signal: None, oom_killed: false }))
        );
        let _keep_open = second.await.unwrap();
    }
}
