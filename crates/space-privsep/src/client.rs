//! A blocking client of the helper's socket: the same frames, descriptors
//! and checks as [`crate::peer::HelperClient`], for callers on blocking
//! threads (the engine's host calls block, and may be made from inside an
//! async runtime, where no other runtime can be entered).
//!
//! Every wait has a deadline: a helper that stops answering is an error,
//! never a hung caller.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, recv, recvmsg, sendmsg, sockopt, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::peer::{expect_fds, io_err, PeerCred, PeerError, FRAME_DEADLINE};
use crate::proto::{self, Engine, Reply, Request, HEADER_LEN, MAX_FDS, PROTOCOL_VERSION};

/// A blocking connection to the helper.
#[derive(Debug)]
pub struct BlockingClient {
    stream: UnixStream,
}

impl BlockingClient {
    /// Connects to the helper at `path`, checks that uid `helper_uid`
    /// serves it, and exchanges hellos, all within `patience`: a
    /// connection about gVisor sandboxes.
    pub fn connect(path: &Path, helper_uid: u32, patience: Duration) -> Result<BlockingClient, PeerError> {
        BlockingClient::connect_for(path, helper_uid, Engine::Gvisor, patience)
    }

    /// [`BlockingClient::connect`] for a connection about `engine`'s sandboxes.
    pub fn connect_for(
        path: &Path,
        helper_uid: u32,
        engine: Engine,
        patience: Duration,
    ) -> Result<BlockingClient, PeerError> {
        let stream = UnixStream::connect(path).map_err(io_err("connecting to the helper"))?;
        let cred = getsockopt(&stream, sockopt::PeerCredentials)
            .map_err(|e| PeerError::Io { context: "reading SO_PEERCRED", source: io::Error::from(e) })?;
        let server = PeerCred { uid: cred.uid(), gid: cred.gid(), pid: cred.pid() };
        if server.uid != helper_uid {
            return Err(PeerError::UnexpectedHelper { uid: server.uid, expected: helper_uid });
        }
        let client = BlockingClient { stream };
        match client.call(&Request::Hello { version: PROTOCOL_VERSION, engine }, &[], patience)? {
            (Reply::Hello { .. }, _) => Ok(client),
            (other, _) => Err(PeerError::UnexpectedReply(Box::new(other))),
        }
    }

    /// A client over a connected stream, without the hello (tests).
    pub fn over(stream: UnixStream) -> BlockingClient {
        BlockingClient { stream }
    }

    /// Sends `request` and waits up to `patience` for its reply. A refusal
    /// is a reply, not an error.
    pub fn call(
        &self,
        request: &Request,
        fds: &[BorrowedFd<'_>],
        patience: Duration,
    ) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        self.send(request, fds)?;
        self.recv(patience)
    }

    /// Sends one request (a frame fits the socket's buffer; a peer that
    /// reads nothing for [`FRAME_DEADLINE`] is an error).
    pub fn send(&self, request: &Request, fds: &[BorrowedFd<'_>]) -> Result<(), PeerError> {
        request.check()?;
        expect_fds(request.fds(), fds)?;
        let frame = proto::encode(request)?;
        self.stream.set_write_timeout(Some(FRAME_DEADLINE)).map_err(io_err("socket timeout"))?;
        let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        let mut sent = 0;
        while sent < frame.len() {
            let rights = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() { &rights } else { &[] };
            let iov = [IoSlice::new(&frame[sent..])];
            match sendmsg::<()>(self.stream.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
                Ok(n) => sent += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => return Err(PeerError::Slow),
                Err(e) => return Err(PeerError::Io { context: "writing to the helper", source: e.into() }),
            }
        }
        Ok(())
    }

    /// The next reply, within `patience`.
    pub fn recv(&self, patience: Duration) -> Result<(Reply, Vec<OwnedFd>), PeerError> {
        let deadline = Instant::now() + patience;
        let mut fds = Vec::new();
        let mut header = [0u8; HEADER_LEN];
        self.recv_exact(&mut header, &mut fds, deadline, patience)?;
        let len = proto::body_len(header)?;
        let mut body = vec![0u8; len];
        // The rest of a frame, once begun, comes at once.
        let deadline = deadline.max(Instant::now() + FRAME_DEADLINE);
        self.recv_exact(&mut body, &mut fds, deadline, patience)?;
        let reply = proto::decode_reply(&body)?;
        expect_fds(reply.fds(), &fds)?;
        Ok((reply, fds))
    }

    /// Whether the helper closed this connection (it restarted, or gave up
    /// on it): checked without waiting before a pooled connection is used.
    pub fn closed(&self) -> bool {
        let mut byte = [0u8; 1];
        match recv(self.stream.as_raw_fd(), &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
            Ok(0) => true,
            // A byte nobody asked for: the connection is out of step.
            Ok(_) => true,
            Err(nix::errno::Errno::EAGAIN) => false,
            Err(_) => true,
        }
    }

    fn recv_exact(
        &self,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
        deadline: Instant,
        patience: Duration,
    ) -> Result<(), PeerError> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(PeerError::NoReply(patience));
            }
            self.stream.set_read_timeout(Some(left)).map_err(io_err("socket timeout"))?;
            match self.recv_some(&mut buf[filled..], fds) {
                Ok(0) if filled == 0 => return Err(PeerError::Closed),
                Ok(0) => return Err(PeerError::Truncated),
                Ok(n) => filled += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => return Err(PeerError::NoReply(patience)),
                Err(nix::errno::Errno::EMSGSIZE) => return Err(PeerError::TooManyDescriptors),
                Err(e) => return Err(PeerError::Io { context: "reading from the helper", source: e.into() }),
            }
            if fds.len() > MAX_FDS {
                return Err(PeerError::TooManyDescriptors);
            }
        }
        Ok(())
    }

    /// One `recvmsg`; descriptors that came with it are added to `fds`.
    fn recv_some(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<usize, nix::errno::Errno> {
        let mut iov = [IoSliceMut::new(buf)];
        let mut space = nix::cmsg_space!([RawFd; proto::RECV_FDS]);
        let msg = recvmsg::<()>(self.stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(list) = cmsg {
                for fd in list {
                    // SAFETY: the kernel just installed `fd` in this process
                    // for this message; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(nix::errno::Errno::EMSGSIZE);
        }
        Ok(msg.bytes)
    }
}
