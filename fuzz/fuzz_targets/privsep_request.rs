//! The privileged helper's request decoder against arbitrary bytes, as a
//! compromised unprivileged process could send them: it must never panic;
//! whatever it accepts must encode back into one frame that decodes to the
//! same request, carry at most the descriptors a message may, and lead
//! the helper to no path outside its data dir.

#![no_main]

use std::path::{Component, Path};

use libfuzzer_sys::fuzz_target;
use space_privsep::layout::Layout;
use space_privsep::proto::{self, HEADER_LEN, MAX_FDS, MAX_FRAME};

fuzz_target!(|data: &[u8]| {
    // The bytes as a frame: a header's length is checked before any body.
    if let Some(header) = data.get(..HEADER_LEN) {
        if let Ok(len) = proto::body_len(header.try_into().unwrap()) {
            assert!((1..=MAX_FRAME).contains(&len));
        }
    }
    // The bytes as a frame's body.
    if let Ok(request) = proto::decode_request(data) {
        let frame = proto::encode(&request).expect("an accepted request fits in a frame");
        assert_eq!(proto::decode_request(&frame[HEADER_LEN..]).expect("and decodes again"), request);
        assert!(request.fds() <= MAX_FDS);
        let layout = Layout::new("/var/lib/space");
        for path in layout.paths_of(&request) {
            let rest = path.strip_prefix(layout.data_dir()).expect("every path is under the data dir");
            assert!(rest.components().all(|c| matches!(c, Component::Normal(_))), "{path:?}");
            assert!(path.starts_with(Path::new("/var/lib/space/")));
        }
    }
    let _ = proto::decode_reply(data);
});
