//! What a process inside a sandbox can send when it dials the host's agent
//! socket while the host waits for its agent to redial (after a resume or
//! a server restart): any bytes at all. The host must never take such a
//! connection for the agent unless it presented the channel key, must not
//! panic, and must not hang (a silent or cut-off peer is an error).

#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use space_engine::{AgentConn, AgentError};

use tokio::io::AsyncWriteExt;

const KEY: &str = "6b6579206f6620746865206167656e74206f662074686973207361616e64626f";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

fuzz_target!(|data: &[u8]| {
    runtime().block_on(async {
        let (host, mut guest) = tokio::net::UnixStream::pair().unwrap();
        let bytes = data.to_vec();
        let writer = tokio::spawn(async move {
            let _ = guest.write_all(&bytes).await;
            // Closing at once: whatever the host waits for next never comes.
            drop(guest);
        });
        let welcome = space_proto::Welcome {
            protocol_version: space_proto::PROTOCOL_VERSION,
            sandbox_id: "sbx_fuzz".into(),
            hostname: "sbx-fuzz".into(),
            env: Default::default(),
            workdir: None,
            user: None,
            memory_mib: None,
            session: 7,
            clock_unix_ms: None,
            channel_key: Some(KEY.to_string()),
            trust_pem: None,
            volumes: Vec::new(),
        };
        let taken = AgentConn::handshake(host, welcome, Duration::from_millis(200)).await;
        let _ = writer.await;
        // A whole hello is read before anything else happens: without the
        // key it is an impostor; with it, never (whatever follows).
        if let Some(hello) = first_hello(data) {
            let impostor = matches!(taken, Err(AgentError::Impostor));
            assert_eq!(impostor, hello.channel_key.as_deref() != Some(KEY), "{hello:?} -> {:?}", taken.err());
        }
    });
});

/// The hello the bytes start with, if they start with a whole one of this
/// protocol version (the host then reads it before anything else).
fn first_hello(data: &[u8]) -> Option<space_proto::Hello> {
    let header = data.get(..9)?;
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    if header[8] != space_proto::FrameKind::Hello as u8 || len > space_proto::MAX_PAYLOAD {
        return None;
    }
    let hello: space_proto::Hello = serde_json::from_slice(data.get(9..9 + len)?).ok()?;
    (hello.protocol_version == space_proto::PROTOCOL_VERSION).then_some(hello)
}
