//! A peer of the host that speaks the agent's protocol but serves only
//! file requests: the volume files child (decision 031). It greets as the
//! agent does (`Hello`, then the host's `Welcome`), then answers `Ping`,
//! `FileRead`, `FileWrite`/`FileData`/`FileEnd`, `FileDelete` and
//! `PathOp`; any other request is answered with an `Error` frame and
//! nothing else happens (no command, no egress, no port).

use std::os::unix::net::UnixStream;
use std::sync::mpsc::{sync_channel, Receiver};

use space_proto::{
    read_frame, write_frame, Frame, FrameKind, Hello, ProtocolErrorMessage, Welcome, CONTROL_STREAM, PROTOCOL_VERSION,
};

use crate::files;

/// Frames queued for the socket before senders block.
const OUTBOX_DEPTH: usize = 256;

/// Greets the host on `stream` as `agent_version`, then serves its file
/// requests until it hangs up. Uploads not finished then are dropped
/// (their temporary files removed: nothing half written is left in
/// place).
pub fn serve(stream: UnixStream, agent_version: &str) -> Result<(), String> {
    let mut writer = stream.try_clone().map_err(|e| format!("the host's socket: {e}"))?;
    let mut reader = stream;
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: agent_version.into(),
        pid: std::process::id(),
        reconnect: false,
        channel_key: None,
        last_stream: None,
        streams: None,
    };
    write_frame(&mut writer, &Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello)).map_err(|e| e.to_string())?;
    let welcome: Welcome = read_frame(&mut reader)
        .and_then(|frame| frame.expect(FrameKind::Welcome))
        .map_err(|e| format!("handshake: {e}"))?;
    if welcome.protocol_version != PROTOCOL_VERSION {
        return Err(format!("host speaks protocol {}, this {PROTOCOL_VERSION}", welcome.protocol_version));
    }
    let (outbox, queued) = sync_channel::<Frame>(OUTBOX_DEPTH);
    let writing = std::thread::Builder::new()
        .name("writer".into())
        .spawn(move || write_loop(queued, writer))
        .map_err(|e| format!("starting the writer: {e}"))?;
    let uploads = files::Uploads::default();
    loop {
        let frame = match read_frame(&mut reader) {
            Ok(frame) => frame,
            // The host hung up (or reset): the end of the work.
            Err(space_proto::ProtoError::Io(_)) => break,
            Err(err) => {
                drop(outbox);
                let _ = writing.join();
                return Err(format!("the host's connection: {err}"));
            }
        };
        if let Err(message) = handle(frame, &uploads, &outbox) {
            let _ = outbox.send(Frame::message(CONTROL_STREAM, FrameKind::Error, &ProtocolErrorMessage { message }));
        }
    }
    uploads.lock().unwrap_or_else(|e| e.into_inner()).clear();
    drop(outbox);
    let _ = writing.join();
    Ok(())
}

/// One request: a file request or a ping; anything else is refused.
fn handle(frame: Frame, uploads: &files::Uploads, outbox: &std::sync::mpsc::SyncSender<Frame>) -> Result<(), String> {
    match frame.kind {
        FrameKind::Ping => {
            let _ = outbox.send(Frame::new(frame.stream, FrameKind::Pong, frame.payload));
        }
        FrameKind::FileRead => files::read(frame.stream, frame.parse().map_err(|e| e.to_string())?, outbox),
        FrameKind::FileWrite => files::begin_write(frame.stream, frame.parse().map_err(|e| e.to_string())?, uploads),
        FrameKind::FileData => files::write_data(frame.stream, &frame.payload, uploads),
        FrameKind::FileEnd => files::end_write(frame.stream, uploads, outbox),
        FrameKind::FileDelete => files::delete(frame.stream, frame.parse().map_err(|e| e.to_string())?, outbox),
        FrameKind::PathOp => files::path_op(frame.stream, frame.parse().map_err(|e| e.to_string())?, outbox),
        // The host's word on something this sent: nothing to answer.
        FrameKind::Error => {}
        other => return Err(format!("a volume's files answer file requests only, not {other:?}")),
    }
    Ok(())
}

fn write_loop(queued: Receiver<Frame>, mut writer: UnixStream) {
    for frame in queued {
        if write_frame(&mut writer, &frame).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use space_proto::{ExecRequest, FileRequest};

    use super::*;

    /// After the greeting a ping is answered, a file request is served,
    /// and a command is refused with an error frame.
    #[test]
    fn only_file_requests_and_pings_are_served() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let served = std::thread::spawn(move || serve(theirs, "test"));
        let mut host = ours;
        host.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let hello: Hello = read_frame(&mut host).unwrap().expect(FrameKind::Hello).unwrap();
        assert!(!hello.reconnect);
        let welcome = Welcome::plain("vol_0123456789abcdef0123", "volume", 1);
        write_frame(&mut host, &Frame::message(CONTROL_STREAM, FrameKind::Welcome, &welcome)).unwrap();
        write_frame(&mut host, &Frame::new(1, FrameKind::Ping, b"hi".to_vec())).unwrap();
        let pong = read_frame(&mut host).unwrap();
        assert_eq!((pong.stream, pong.kind, pong.payload.as_slice()), (1, FrameKind::Pong, &b"hi"[..]));
        let exec: ExecRequest = serde_json::from_value(serde_json::json!({"argv": ["/bin/true"]})).unwrap();
        write_frame(&mut host, &Frame::message(3, FrameKind::Exec, &exec)).unwrap();
        let refused = read_frame(&mut host).unwrap();
        assert_eq!(refused.kind, FrameKind::Error, "{refused:?}");
        let missing = FileRequest { path: "/no/such/file".into(), ..FileRequest::default() };
        write_frame(&mut host, &Frame::message(5, FrameKind::FileRead, &missing)).unwrap();
        let failed = read_frame(&mut host).unwrap();
        assert_eq!((failed.stream, failed.kind), (5, FrameKind::FileFailed));
        drop(host);
        served.join().unwrap().unwrap();
    }
}
