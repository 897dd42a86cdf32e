//! What a program in a sandbox sends its egress proxy (relayed as is to
//! the host's gateway), and the first bytes of a tunnel it opens: any bytes
//! at all. The gateway must answer every one
//! with an HTTP refusal under a policy that allows nothing, never dial
//! anything, never panic and never hang.

#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use space_egress::gateway::{GatewayConfig, SandboxEgress, StaticResolver};
use space_egress::policy::{Mode, Policy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

fuzz_target!(|data: &[u8]| {
    // The ClientHello reader sees a tunnel's first bytes, whatever they are.
    let _ = space_egress::tls::client_hello(data);
    runtime().block_on(async {
        let resolver = Arc::new(StaticResolver::default());
        let (events, mut received) = tokio::sync::mpsc::channel(4);
        let policy = Policy::new(Mode::Allowlist, &[], &[]).unwrap();
        let egress = SandboxEgress::new("sbx_fuzz".into(), policy, events, GatewayConfig::new(resolver.clone()));
        let (mut ours, theirs) = tokio::io::duplex(1 << 17);
        let _ = ours.write_all(data).await;
        let _ = ours.shutdown().await;
        let served = tokio::time::timeout(std::time::Duration::from_secs(5), egress.handle(theirs)).await;
        assert!(served.is_ok(), "the gateway hung");
        let mut answer = Vec::new();
        let _ = ours.read_to_end(&mut answer).await;
        assert!(answer.starts_with(b"HTTP/1.1 4"), "{:?}", String::from_utf8_lossy(&answer));
        assert!(resolver.lookups.lock().unwrap().is_empty(), "nothing is looked up when nothing is allowed");
        let (_, event) = received.try_recv().expect("every connection is an event");
        assert_eq!(event.decision, "denied");
    });
});
