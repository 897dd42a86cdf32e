//! The whole guest path on Firecracker through the API: create (a cold
//! boot, and clones of the template's snapshot), exec, suspend, resume,
//! delete. It needs hardware virtualization (vmx/svm) and
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
    // Not the template's shape: a cold boot.
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 768}));
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

    // The template's default shape: the first such create saved the
    // template's microVM, and these are clones of it. Each is its own
    // sandbox (hostname), with its own random state and the host's time.
    let snapshots = base.dir.join("firecracker");
    let clones: Vec<String> = (0..2).map(|_| server.create_sandbox(json!({"template": "base"}))).collect();
    assert!(std::fs::read_dir(&snapshots).is_ok_and(|mut d| d.next().is_some()), "the template snapshot is kept");
    let mut seen = Vec::new();
    for clone in &clones {
        let ran = server.exec(clone, json!({"cmd": "hostname; head -c 16 /dev/urandom | od -An -tx1; date +%s"}));
        let out = ran["stdout"].as_str().unwrap().to_string();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], clone.replace('_', "-"), "the clone took its own hostname: {out}");
        let guest_time: u64 = lines[2].trim().parse().unwrap();
        let host_time = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        assert!(host_time.abs_diff(guest_time) < 5, "the clone's clock is the host's: {guest_time} vs {host_time}");
        seen.push(lines[1].to_string());
    }
    assert_ne!(seen[0], seen[1], "clones never share random state");

    // Forks of a running microVM, and a checkpoint rolled back to.
    let (status, forked) = server.call("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({"count": 2})));
    assert_eq!(status, 202, "{forked}");
    let done = server.wait_operation(forked["operation"]["id"].as_str().unwrap());
    assert_eq!(done["state"], "succeeded", "{done}");
    for fork in forked["sandboxes"].as_array().unwrap() {
        let fork = fork["id"].as_str().unwrap();
        let ran = server.exec(fork, json!({"cmd": "hostname; cat /root/note"}));
        assert_eq!(ran["stdout"], format!("{}\nhello from a microVM\n", fork.replace('_', "-")), "{ran}");
        assert_eq!(server.delete_sandbox(fork)["state"], "succeeded");
    }
    let (status, saved) = server.call("POST", &format!("/v1/sandboxes/{id}/checkpoints"), Some(json!({"name": "c"})));
    assert_eq!(status, 202, "{saved}");
    assert_eq!(server.wait_operation(saved["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    server.exec(&id, json!({"cmd": "rm /root/note"}));
    let (status, back) = server.call("POST", &format!("/v1/sandboxes/{id}/checkpoints/c/restore"), Some(json!({})));
    assert_eq!(status, 202, "{back}");
    assert_eq!(server.wait_operation(back["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    assert_eq!(server.exec(&id, json!({"cmd": "cat /root/note"}))["stdout"], "hello from a microVM\n");
    for sandbox in clones.iter().chain([&id]) {
        assert_eq!(server.delete_sandbox(sandbox)["state"], "succeeded");
    }
}
