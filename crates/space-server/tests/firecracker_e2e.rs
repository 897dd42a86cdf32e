//! The whole guest path on Firecracker through the API: create, exec,
//! suspend, resume, delete. It needs hardware virtualization (vmx/svm) and
//! `FIRECRACKER_BIN`; elsewhere — such as hosts whose /dev/kvm is kvm_pvm —
//! it skips with one line saying so.

mod common;

use std::io::Write;

use common::{platform_config, TestServer};
use serde_json::json;
use space_testkit::TestDataDir;

#[test]
fn firecracker_sandbox_end_to_end_through_the_api() {
    let binary = std::env::var_os("FIRECRACKER_BIN");
    if !space_host::hardware_virtualization() || binary.is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED firecracker_sandbox_end_to_end_through_the_api: needs vmx/svm and FIRECRACKER_BIN \
             (this host: vmx/svm {}, FIRECRACKER_BIN {})",
            space_host::hardware_virtualization(),
            if binary.is_some() { "set" } else { "unset" }
        );
        return;
    }
    let data = TestDataDir::new();
    // The base snapshot in the test data dir gets its ext4 root drive.
    let base = data.data.template("base").unwrap();
    space_host::template::make_ext4(&base.rootfs(), &base.dir.join("rootfs.ext4"), 1024).unwrap();
    let mut config = platform_config(&data);
    config.engine = space_server::EngineChoice::Firecracker;
    config.firecracker_bin = binary.map(Into::into);
    let server = TestServer::start_with(config);
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 512}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["engine"], "firecracker");
    let ran = server.exec(&id, json!({"cmd": "echo hello from a microVM > /root/note; cat /root/note; uname -r"}));
    assert!(ran["stdout"].as_str().unwrap().starts_with("hello from a microVM\n"), "{ran}");
    for action in ["suspend", "resume"] {
        let (status, accepted) = server.call("POST", &format!("/v1/sandboxes/{id}/{action}"), Some(json!({})));
        assert_eq!(status, 202, "{accepted}");
        let done = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
        assert_eq!(done["state"], "succeeded", "{action}: {done}");
    }
    assert_eq!(server.exec(&id, json!({"cmd": "cat /root/note"}))["stdout"], "hello from a microVM\n");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}
