//! The helper's Unix socket: a listener that serves one unprivileged uid
//! alone, and the client that uid's processes call it with.
//!
//! The socket file is owned by that uid with mode 0600, and every accepted
//! connection's `SO_PEERCRED` is checked as well: a file mode can be
//! loosened by mistake, and root passes it anyway. The client checks the
//! other way round that the socket is served by the helper's uid, so a
//! process that bound the path first cannot pose as the helper.
//!
//! Descriptors travel beside the frame that names them (`SCM_RIGHTS`,
//! received close-on-exec); a message arriving with more or fewer than it
//! says is refused and what came with it is closed.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{getsockopt, recvmsg, sendmsg, sockopt, ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};

use crate::proto::{self, Engine, ProtoError, Refusal, Reply, Request, HEADER_LEN, MAX_FDS, PROTOCOL_VERSION};

/// How long the rest of a frame may take once its first byte arrived.
pub const FRAME_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("refused a connection from uid {uid} (pid {pid}): only uid {allowed} may use the helper")]
    UnexpectedPeer { uid: u32, pid: i32, allowed: u32 },
    #[error("the helper's socket is served by uid {uid}, not {expected}")]
    UnexpectedHelper { uid: u32, expected: u32 },
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the peer closed the connection")]
    Closed,
    #[error("the peer closed the connection in the middle of a frame")]
    Truncated,
    #[error("a frame took over {FRAME_DEADLINE:?} to arrive")]
    Slow,
    #[error("no reply within {0:?}")]
    NoReply(Duration),
    #[error("more than {MAX_FDS} descriptor(s) came with a message")]
    TooManyDescriptors,
    #[error("the first message was not a hello")]
    NoHello,
    #[error("the helper answered {0:?}")]
    UnexpectedReply(Box<Reply>),
}

pub(crate) fn io_err(context: &'static str) -> impl FnOnce(io::Error) -> PeerError {
    move |source| PeerError::Io { context, source }
}

/// Who is at the other end of a Unix socket, by the kernel's word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub uid: u32,
    pub gid: u32,
    pub pid: i32,
}

pub fn peer_cred(stream: &UnixStream) -> Result<PeerCred, PeerError> {
    let cred = getsockopt(stream, sockopt::PeerCredentials)
        .map_err(|e| PeerError::Io { context: "reading SO_PEERCRED", source: io::Error::from(e) })?;
    Ok(PeerCred { uid: cred.uid(), gid: cred.gid(), pid: cred.pid() })
}

/// The helper's listening socket.
pub struct HelperListener {
    listener: UnixListener,
    allowed_uid: u32,
}

impl HelperListener {
    /// Binds `path` for `allowed_uid` alone: a stale socket there is
    /// replaced (anything else is an error), and the new one is made mode
    /// 0600 and, when this process may, owned by `allowed_uid`.
    pub fn bind(path: &Path, allowed_uid: u32) -> Result<HelperListener, PeerError> {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                std::fs::remove_file(path).map_err(io_err("removing the stale helper socket"))?
            }
            Ok(_) => {
                return Err(PeerError::Io {
                    context: "binding the helper socket",
                    source: io::Error::new(io::ErrorKind::AlreadyExists, "the path exists and is not a socket"),
                })
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(path).map_err(io_err("binding the helper socket"))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io_err("chmod of the helper socket"))?;
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(path, Some(allowed_uid), None).map_err(io_err("chown of the helper socket"))?;
        }
        Ok(HelperListener { listener, allowed_uid })
    }

    /// A listener made elsewhere (systemd's socket activation, tests).
    pub fn from_listener(listener: UnixListener, allowed_uid: u32) -> HelperListener {
        HelperListener { listener, allowed_uid }
    }

    /// The next connection, or `UnexpectedPeer` for one from another uid,
    /// which is closed unread. The caller logs that and accepts again.
    pub async fn accept(&self) -> Result<Connection, PeerError> {
        let (stream, _) = self.listener.accept().await.map_err(io_err("accepting on the helper socket"))?;
        Connection::checked(stream, self.allowed_uid)
    }
}

/// The helper's end of one connection.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    peer: PeerCred,
}

/// A request and the descriptors it carried.
#[derive(Debug)]
pub struct Incoming {
    pub request: Request,
    pub fds: Vec<OwnedFd>,
}

impl Connection {
    /// Serves `stream` only if its peer is `allowed_uid`.
    pub fn checked(stream: UnixStream, allowed_uid: u32) -> Result<Connection, PeerError> {
        let peer = peer_cred(&stream)?;
        if peer.uid != allowed_uid {
            return Err(PeerError::UnexpectedPeer { uid: peer.uid, pid: peer.pid, allowed: allowed_uid });
        }
        Ok(Connection { stream, peer })
    }

    pub fn peer(&self) -> PeerCred {
        self.peer
    }

    /// The next request, or None when the peer closed between requests.
    /// A request that does not parse is an error; answer it with
    /// [`Connection::refuse`] and close the connection.
    pub async fn recv(&self) -> Result<Option<Incoming>, PeerError> {
        let Some((body, fds)) = recv_frame(&self.stream).await? else { return Ok(None) };
        let request = proto::decode_request(&body)?;
        expect_fds(request.fds(), &fds)?;
        Ok(Some(Incoming { request, fds }))
    }

    /// Takes the peer's hello and answers it: the first exchange on every
    /// connection. Returns the engine the connection is about.
    pub async fn hello(&self) -> Result<Engine, PeerError> {
        match self.recv().await? {
            Some(Incoming { request: Request::Hello { engine, .. }, .. }) => {
                self.send(&Reply::Hello { version: PROTOCOL_VERSION }, &[]).await?;
                Ok(engine)
            }
            Some(_) => {
                self.send(&Reply::refused(Refusal::BadRequest, "the first message must be a hello"), &[]).await?;
                Err(PeerError::NoHello)
            }
            None => Err(PeerError::Closed),
        }
    }

    pub async fn send(&self, reply: &Reply, fds: &[BorrowedFd<'_>]) -> Result<(), PeerError> {
        reply.check()?;
        expect_fds(reply.fds(), fds)?;
        send_frame(&self.stream, &proto::encode(reply)?, fds).await
    }

    /// Answers a request that could not be read with what was wrong.
    pub async fn refuse(&self, error: &PeerError) -> Result<(), PeerError> {
        self.send(&Reply::refused(Refusal::BadRequest, error.to_string()), &[]).await
    }
}

/// The unprivileged side's connection to the helper.
#[derive(Debug)]
pub struct HelperClient {
    stream: UnixStream,
}

impl HelperClient {
    /// Connects to the helper at `path`, checks that uid `helper_uid`
    /// serves it, and exchanges hellos.
    pub async fn connect(path: &Path, helper_uid: u32) -> Result<HelperClient, PeerError> {
        let stream = UnixStream::connect(path).await.map_err(io_err("connecting to the helper"))?;
        let server = peer_cred(&stream)?;
        if server.uid != helper_uid {
            return Err(PeerError::UnexpectedHelper { uid: server.uid, expected: helper_uid });
        }
        let mut client = HelperClient { stream };
        match client.call(&Request::Hello { version: PROTOCOL_VERSION, engine: Engine::Gvisor }, &[]).await? {
            (Reply::Hello { .. }, _) => Ok(client),
            (other, _) => Err(PeerError::UnexpectedReply(Box::new(other))),
        }
    }

    /// A client over a connected stream, without the hello (tests, a
    /// socketpair made before a fork).
    pub fn over(stream: UnixStream) -> HelperClient {
        HelperClient { stream }
    }

    /// Sends `request` with its descriptors and waits for the reply. A
    /// refusal is a reply, not an error: the caller knows what it asked.
    pub async fn call(
        &mut self,
        request: &Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        request.check()?;
        expect_fds(request.fds(), fds)?;
        send_frame(&self.stream, &proto::encode(request)?, fds).await?;
        let Some((body, received)) = recv_frame(&self.stream).await? else { return Err(PeerError::Closed) };
        let reply = proto::decode_reply(&body)?;
        expect_fds(reply.fds(), &received)?;
        Ok((reply, received))
    }
}

pub(crate) fn expect_fds<T>(expected: usize, fds: &[T]) -> Result<(), ProtoError> {
    if fds.len() == expected {
        Ok(())
    } else {
        Err(ProtoError::Descriptors { expected, received: fds.len() })
    }
}

/// Writes one frame, the descriptors attached to its first byte.
async fn send_frame(stream: &UnixStream, frame: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), PeerError> {
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let mut sent = 0;
    while sent < frame.len() {
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() { &rights } else { &[] };
        let n = stream
            .async_io(Interest::WRITABLE, || {
                let iov = [IoSlice::new(&frame[sent..])];
                sendmsg::<()>(stream.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None).map_err(io::Error::from)
            })
            .await
            .map_err(io_err("writing to the peer"))?;
        sent += n;
    }
    Ok(())
}

/// Reads one frame: None on a clean close before it, its body and
/// descriptors otherwise. The length is checked before the body is read.
async fn recv_frame(stream: &UnixStream) -> Result<Option<(Vec<u8>, Vec<OwnedFd>)>, PeerError> {
    let mut fds = Vec::new();
    let mut header = [0u8; HEADER_LEN];
    // An idle connection may wait for its next request as long as it likes;
    // a frame, once begun, must arrive whole in time.
    let first = recv_some(stream, &mut header, &mut fds).await?;
    if first == 0 {
        return Ok(None);
    }
    let rest = async {
        recv_exact(stream, &mut header[first..], &mut fds).await?;
        let len = proto::body_len(header)?;
        let mut body = vec![0u8; len];
        recv_exact(stream, &mut body, &mut fds).await?;
        Ok::<_, PeerError>(body)
    };
    let body = tokio::time::timeout(FRAME_DEADLINE, rest).await.map_err(|_| PeerError::Slow)??;
    if fds.len() > MAX_FDS {
        return Err(PeerError::TooManyDescriptors);
    }
    Ok(Some((body, fds)))
}

async fn recv_exact(stream: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<(), PeerError> {
    let mut filled = 0;
    while filled < buf.len() {
        match recv_some(stream, &mut buf[filled..], fds).await? {
            0 => return Err(PeerError::Truncated),
            n => filled += n,
        }
    }
    Ok(())
}

/// One `recvmsg`: the bytes read (0 at the end of the stream), any
/// descriptors that came with them added to `fds`.
async fn recv_some(stream: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<usize, PeerError> {
    let (n, received, truncated) = stream
        .async_io(Interest::READABLE, || {
            let mut iov = [IoSliceMut::new(&mut *buf)];
            let mut space = nix::cmsg_space!([RawFd; proto::RECV_FDS]);
            let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(io::Error::from)?;
            let mut received = Vec::new();
            for cmsg in msg.cmsgs().map_err(io::Error::from)? {
                if let ControlMessageOwned::ScmRights(list) = cmsg {
                    received.extend(list);
                }
            }
            Ok((msg.bytes, received, msg.flags.contains(MsgFlags::MSG_CTRUNC)))
        })
        .await
        .map_err(io_err("reading from the peer"))?;
    for fd in received {
        // SAFETY: the kernel just installed `fd` in this process for this
        // message; nothing else owns it.
        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    if truncated {
        return Err(PeerError::TooManyDescriptors);
    }
    Ok(n)
}
