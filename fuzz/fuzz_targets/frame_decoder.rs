//! The host↔agent frame decoder against arbitrary bytes, as a hostile
//! guest could send them: it must never panic, never return a payload past
//! the limit, and whatever it decodes must encode back to the same bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use space_proto::*;

fn parse_all(frame: &Frame) {
    let _ = frame.parse::<Hello>();
    let _ = frame.parse::<Welcome>();
    let _ = frame.parse::<Identity>();
    let _ = frame.parse::<ExecRequest>();
    let _ = frame.parse::<Started>();
    let _ = frame.parse::<ExecFailed>();
    let _ = frame.parse::<Exited>();
    let _ = frame.parse::<SignalRequest>();
    let _ = frame.parse::<TerminalSize>();
    let _ = frame.parse::<FileRequest>();
    let _ = frame.parse::<FileInfo>();
    let _ = frame.parse::<FileListing>();
    let _ = frame.parse::<FileError>();
    let _ = frame.parse::<PathRequest>();
    let _ = frame.parse::<PathInfo>();
    let _ = frame.parse::<ProtocolErrorMessage>();
}

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode(rest) {
        assert!(used > 0 && used <= rest.len());
        assert!(frame.payload.len() <= MAX_PAYLOAD);
        parse_all(&frame);
        let encoded = frame.encode().expect("a decoded frame encodes");
        assert_eq!(&encoded[..], &rest[..used]);
        rest = &rest[used..];
    }
    let mut reader = std::io::Cursor::new(data);
    while let Ok(frame) = read_frame(&mut reader) {
        assert!(frame.payload.len() <= MAX_PAYLOAD);
    }
});
