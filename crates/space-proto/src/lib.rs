//! The protocol spoken between the host and `space-agent`, the guest's PID 1.
//!
//! One connection (a Unix socket under gVisor, vsock under Firecracker)
//! carries many streams. Every frame is
//!
//! ```text
//! +-----------------+------------------+-----------+-------------------+
//! | len: u32 LE     | stream: u32 LE   | kind: u8  | payload: len bytes |
//! +-----------------+------------------+-----------+-------------------+
//! ```
//!
//! Stream 0 is the control stream (handshake, health). The host opens every
//! other stream (one per command) by choosing a fresh id. Control payloads
//! are JSON; output and stdin payloads are raw bytes.
//!
//! The host must treat everything the guest sends as hostile: [`decode`]
//! refuses unknown kinds and payloads over [`MAX_PAYLOAD`] before allocating.
//! This crate does no I/O of its own beyond the blocking helpers the agent
//! uses; it must stay small, since it is linked into the static agent.

mod messages;

use std::io::{self, Read, Write};

pub use messages::*;

/// Bumped on any incompatible change; the handshake refuses a mismatch.
pub const PROTOCOL_VERSION: u32 = 2;
/// Largest payload either side may send.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Largest chunk of output the agent puts in one frame.
pub const MAX_OUTPUT_CHUNK: usize = 32 * 1024;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 9;
/// The stream that carries the handshake and health checks.
pub const CONTROL_STREAM: u32 = 0;

macro_rules! frame_kinds {
    ($($(#[$doc:meta])* $name:ident = $value:literal,)*) => {
        /// What a frame carries.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum FrameKind { $($(#[$doc])* $name = $value,)* }

        impl TryFrom<u8> for FrameKind {
            type Error = ProtoError;
            fn try_from(value: u8) -> Result<Self, ProtoError> {
                match value {
                    $($value => Ok(FrameKind::$name),)*
                    other => Err(ProtoError::UnknownKind(other)),
                }
            }
        }
    };
}

frame_kinds! {
    /// agent → host, first frame: [`Hello`].
    Hello = 1,
    /// host → agent, answer to hello: [`Welcome`] (the sandbox's identity).
    Welcome = 2,
    /// host → agent: health check; the payload is echoed back.
    Ping = 3,
    /// agent → host: answer to a ping.
    Pong = 4,
    /// host → agent, opens a stream: [`ExecRequest`].
    Exec = 5,
    /// agent → host: the process runs: [`Started`].
    Started = 6,
    /// agent → host: the process could not be started: [`ExecFailed`].
    ExecFailed = 7,
    /// agent → host: raw stdout bytes.
    Stdout = 8,
    /// agent → host: raw stderr bytes.
    Stderr = 9,
    /// agent → host, last frame of a stream: [`Exited`].
    Exit = 10,
    /// host → agent: raw stdin bytes.
    Stdin = 11,
    /// host → agent: close the process's stdin.
    StdinEof = 12,
    /// host → agent: [`SignalRequest`] for the process group.
    Signal = 13,
    /// either way: [`ProtocolErrorMessage`]; the sender closes afterwards.
    Error = 14,
    /// host → agent, control stream: let go of the channel (before a
    /// snapshot); the agent answers `QuiesceAck`, closes its socket and
    /// dials home again, keeping its commands running.
    Quiesce = 15,
    /// agent → host: the last frame before the agent closes its socket.
    QuiesceAck = 16,
    /// host → agent, opens a stream: [`Identity`] for a sandbox handed out
    /// from a warm pool; answered with `IdentityAck` on the same stream.
    Identity = 17,
    /// agent → host: the identity is in place.
    IdentityAck = 18,
    /// host → agent, opens a stream: [`FileRequest`] to read a path.
    FileRead = 19,
    /// host → agent, opens a stream: [`FileRequest`] to write a file; raw
    /// `FileData` frames follow, then `FileEnd`.
    FileWrite = 20,
    /// host → agent, opens a stream: [`FileRequest`] to delete a path.
    FileDelete = 21,
    /// agent → host: a regular file follows: [`FileInfo`], then `FileData`
    /// frames, then `FileEnd`.
    FileInfo = 22,
    /// agent → host: the path is a directory: [`FileListing`].
    FileListing = 23,
    /// either way: raw file bytes.
    FileData = 24,
    /// either way: no more data.
    FileEnd = 25,
    /// agent → host: the write or delete is done.
    FileDone = 26,
    /// agent → host: [`FileError`]; the stream ends.
    FileFailed = 27,
    /// host → agent: [`TerminalSize`] for a command's pseudo-terminal.
    Resize = 28,
    /// agent → host, opens a stream (an id with [`AGENT_STREAM_BIT`]): a
    /// program connected to the egress proxy in the sandbox; its bytes
    /// follow as `EgressData` either way.
    EgressOpen = 29,
    /// either way: raw bytes of an egress connection, at most
    /// [`EGRESS_WINDOW`] not yet acknowledged per direction.
    EgressData = 30,
    /// either way: the sender sends no more bytes (a half close).
    EgressEof = 31,
    /// either way: the connection is gone; the stream ends.
    EgressClose = 32,
    /// either way: `u32` LE, the number of `EgressData` bytes passed on,
    /// which the other side may now send again.
    EgressAck = 33,
    /// host → agent, opens a stream (an id with [`PORT_STREAM_BIT`]): `u16`
    /// LE, a port to connect to on the sandbox's loopback (a server in the
    /// sandbox, reached through the API); answered with `PortOpened`, or
    /// `EgressClose` with the reason as text. Its bytes then go as egress
    /// frames.
    PortOpen = 34,
    /// agent → host: the port's connection is open.
    PortOpened = 35,
    /// host → agent, opens a stream: [`PathRequest`] (stat, make a
    /// directory, move); answered with `PathInfo` or `FileFailed`.
    PathOp = 36,
    /// agent → host: [`PathInfo`] of the path (of the destination, for a move).
    PathInfo = 37,
}

/// Streams the agent opens carry this bit; the host's never do.
pub const AGENT_STREAM_BIT: u32 = 1 << 31;
/// The host's streams to a port in the sandbox carry this bit: like egress
/// connections, they end at a quiesce.
pub const PORT_STREAM_BIT: u32 = 1 << 30;
/// Egress bytes in flight per connection and direction, at most: a slow
/// reader holds back its own connection, never the channel.
pub const EGRESS_WINDOW: usize = 256 * 1024;

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub stream: u32,
    pub kind: FrameKind,
    pub payload: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame payload of {0} bytes exceeds the limit of {MAX_PAYLOAD}")]
    TooLarge(usize),
    #[error("malformed {kind:?} message: {source}")]
    BadMessage {
        kind: FrameKind,
        #[source]
        source: serde_json::Error,
    },
    #[error("expected a {expected:?} frame, got {got:?}")]
    Unexpected { expected: FrameKind, got: FrameKind },
    #[error("protocol version {theirs} is not supported (this side speaks {PROTOCOL_VERSION})")]
    Version { theirs: u32 },
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// A validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub len: usize,
    pub stream: u32,
    pub kind: FrameKind,
}

/// Validates a header before anything is allocated for its payload.
pub fn decode_header(bytes: &[u8; HEADER_LEN]) -> Result<Header, ProtoError> {
    let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let stream = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let kind = FrameKind::try_from(bytes[8])?;
    if len > MAX_PAYLOAD {
        return Err(ProtoError::TooLarge(len));
    }
    Ok(Header { len, stream, kind })
}

/// Decodes one frame from the front of `buf`: `Ok(None)` if more bytes are
/// needed, otherwise the frame and how many bytes it used.
pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, ProtoError> {
    let Some(header_bytes) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = decode_header(header_bytes)?;
    let end = HEADER_LEN + header.len;
    if buf.len() < end {
        return Ok(None);
    }
    let frame = Frame { stream: header.stream, kind: header.kind, payload: buf[HEADER_LEN..end].to_vec() };
    Ok(Some((frame, end)))
}

impl Frame {
    pub fn new(stream: u32, kind: FrameKind, payload: Vec<u8>) -> Frame {
        Frame { stream, kind, payload }
    }

    /// A frame whose payload is `message` as JSON.
    pub fn message<M: serde::Serialize>(stream: u32, kind: FrameKind, message: &M) -> Frame {
        // Serializing our own message types cannot fail: they hold no maps
        // with non-string keys and no failing Serialize impls.
        let payload = serde_json::to_vec(message).unwrap_or_default();
        Frame { stream, kind, payload }
    }

    /// Parses the JSON payload as `M`.
    pub fn parse<M: serde::de::DeserializeOwned>(&self) -> Result<M, ProtoError> {
        serde_json::from_slice(&self.payload).map_err(|source| ProtoError::BadMessage { kind: self.kind, source })
    }

    /// Parses the payload, insisting on the frame kind.
    pub fn expect<M: serde::de::DeserializeOwned>(&self, expected: FrameKind) -> Result<M, ProtoError> {
        if self.kind != expected {
            return Err(ProtoError::Unexpected { expected, got: self.kind });
        }
        self.parse()
    }

    /// Appends the encoded frame to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        if self.payload.len() > MAX_PAYLOAD {
            return Err(ProtoError::TooLarge(self.payload.len()));
        }
        out.reserve(HEADER_LEN + self.payload.len());
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.stream.to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&self.payload);
        Ok(())
    }

    pub fn encode(&self) -> Result<Vec<u8>, ProtoError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }
}

/// Blocking read of one frame (used by the agent).
pub fn read_frame<R: Read>(reader: &mut R) -> Result<Frame, ProtoError> {
    let mut header_bytes = [0u8; HEADER_LEN];
    reader.read_exact(&mut header_bytes)?;
    let header = decode_header(&header_bytes)?;
    let mut payload = vec![0u8; header.len];
    reader.read_exact(&mut payload)?;
    Ok(Frame { stream: header.stream, kind: header.kind, payload })
}

/// Blocking write of one frame (used by the agent).
pub fn write_frame<W: Write>(writer: &mut W, frame: &Frame) -> Result<(), ProtoError> {
    writer.write_all(&frame.encode()?)?;
    Ok(())
}

/// Compares secrets without leaking, through timing, how much matched.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_through_decode() {
        let frame = Frame::new(7, FrameKind::Stdout, b"hello\xff\x00".to_vec());
        let mut bytes = frame.encode().unwrap();
        bytes.extend_from_slice(b"\x01\x02"); // start of the next frame
        let (decoded, used) = decode(&bytes).unwrap().unwrap();
        assert_eq!(decoded, frame);
        assert_eq!(used, HEADER_LEN + 7);
        assert!(decode(&bytes[used..]).unwrap().is_none());
    }

    #[test]
    fn partial_input_asks_for_more() {
        let bytes = Frame::new(1, FrameKind::Ping, vec![1; 100]).encode().unwrap();
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).unwrap().is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn hostile_headers_are_refused_before_allocation() {
        let mut huge = Vec::new();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&1u32.to_le_bytes());
        huge.push(FrameKind::Stdout as u8);
        assert!(matches!(decode(&huge), Err(ProtoError::TooLarge(_))));
        let mut unknown = Frame::new(1, FrameKind::Stdout, vec![]).encode().unwrap();
        unknown[8] = 200;
        assert!(matches!(decode(&unknown), Err(ProtoError::UnknownKind(200))));
        // A truncated stream through the blocking reader is an I/O error, not a panic.
        let bytes = Frame::new(1, FrameKind::Stdout, vec![9; 10]).encode().unwrap();
        assert!(read_frame(&mut &bytes[..12]).is_err());
    }

    #[test]
    fn messages_reject_unknown_fields_and_wrong_kinds() {
        let frame = Frame::new(
            0,
            FrameKind::Hello,
            br#"{"protocol_version":2,"agent_version":"x","pid":1,"reconnect":false,"evil":true}"#.to_vec(),
        );
        assert!(frame.parse::<Hello>().is_err());
        let ping = Frame::new(0, FrameKind::Ping, vec![]);
        assert!(matches!(ping.expect::<Hello>(FrameKind::Hello), Err(ProtoError::Unexpected { .. })));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic stand-in for the fuzzer: every prefix of a
        // pseudo-random stream decodes to a frame, an error, or "need more".
        let mut state = 0x9e3779b97f4a7c15u64;
        let bytes: Vec<u8> = (0..4096)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        for start in 0..bytes.len() {
            let _ = decode(&bytes[start..]);
        }
    }
}
