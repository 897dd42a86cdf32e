//! Resource limits that hold, on real runsc: memory, disk, processes and
//! CPU stay inside the sandbox that asked for them.

mod common;

use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::json;
use space_testkit::TestDataDir;

fn free_bytes(path: &std::path::Path) -> u64 {
    let stat = nix::sys::statvfs::statvfs(path).unwrap();
    stat.blocks_available() * stat.fragment_size()
}

#[test]
fn memory_past_the_limit_is_reclaimed_inside_never_from_the_host() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 256}));
    let neighbour = server.create_sandbox(json!({"template": "base", "memory_mib": 256}));

    // One process touching 2 GiB is killed inside, and its result says why;
    // the sandbox lives on.
    let hog = server.exec(&id, json!({"argv": ["python3", "-c", "x = bytearray(2 << 30); print(len(x))"]}));
    assert_eq!(hog["result"]["signal"], "KILL", "{hog}");
    assert_eq!(hog["result"]["oom_killed"], true, "{hog}");
    let total = server.exec(&id, json!({"cmd": "grep MemTotal /proc/meminfo"}));
    let kib: u64 = total["stdout"].as_str().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(kib < 512 * 1024, "the guest sees about its own memory, not the host's: {kib} KiB");
    assert_eq!(server.exec(&id, json!({"cmd": "echo fine"}))["stdout"], "fine\n");

    // Address space is not memory: reserving 4 GiB and touching little works.
    let reserve = "import mmap\nm = mmap.mmap(-1, 4 << 30)\nm[0] = 1\nprint('reserved')";
    assert_eq!(server.exec(&id, json!({"argv": ["python3", "-c", reserve]}))["stdout"], "reserved\n");

    // Several processes, each under the limit, together far over it: the
    // largest are killed inside until the rest fit; never more than the
    // limit is granted, and the sandbox keeps running.
    let together = "for i in 1 2 3 4; do python3 -c \"
import time
x = bytearray(150 << 20)
for i in range(0, len(x), 4096): x[i] = 1
print('touched', flush=True)
time.sleep(3)\" & done; wait";
    let (status, started) =
        server.call("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"cmd": together, "timeout_s": 60})));
    assert_eq!(status, 201, "{started}");
    let cid = started["command"]["id"].as_str().unwrap();
    let ended = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=60"), None);
    assert_eq!(ended["result"]["oom_killed"], true, "processes of the command were killed for memory: {ended}");
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["state"], "running", "the sandbox itself never stopped: {sandbox}");
    assert_eq!(server.exec(&id, json!({"cmd": "echo alive"}))["stdout"], "alive\n");
    assert_eq!(server.exec(&neighbour, json!({"cmd": "echo unharmed"}))["stdout"], "unharmed\n");
    let (status, _) = server.raw("GET", "/v1/health", &[], None);
    assert_eq!(status, 200);
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    server.delete_sandbox(&neighbour);
}

#[test]
fn writes_past_disk_mib_fail_and_the_host_loses_at_most_that() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base", "disk_mib": 1024}));
    let before = free_bytes(data.root());
    let fill = server.exec(
        &id,
        json!({"cmd": "dd if=/dev/zero of=/root/fill bs=1M count=3000 2>&1; echo dd=$?; stat -c %s /root/fill",
               "timeout_s": 120}),
    );
    let out = fill["stdout"].as_str().unwrap();
    assert!(out.contains("Disk quota exceeded") && out.contains("dd=1"), "{out}");
    let written: u64 = out.lines().last().unwrap().trim().parse().unwrap();
    assert!(written <= 1025 << 20, "at most disk_mib was written: {written}");
    let lost = before.saturating_sub(free_bytes(data.root()));
    assert!(lost < 1400 << 20, "the host lost {} MiB", lost >> 20);
    // The sandbox still works (reads, and writes once there is room again).
    let after = server.exec(&id, json!({"cmd": "rm /root/fill && echo ok > /root/small && cat /root/small"}));
    assert_eq!(after["stdout"], "ok\n", "{after}");
    server.delete_sandbox(&id);
}

#[test]
fn a_fork_bomb_stays_in_its_sandbox_and_a_cpu_hog_gets_its_vcpus() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let bomb = server.create_sandbox(json!({"template": "base", "vcpus": 1}));
    let other = server.create_sandbox(json!({"template": "base"}));
    let (status, _) = server.call(
        "POST",
        &format!("/v1/sandboxes/{bomb}/commands"),
        Some(json!({"cmd": "f(){ f|f& }; f; sleep 20", "timeout_s": 25})),
    );
    assert_eq!(status, 201);
    std::thread::sleep(Duration::from_secs(2));
    for _ in 0..5 {
        let started = Instant::now();
        let answer = server.exec(&other, json!({"argv": ["echo", "alive"]}));
        assert_eq!(answer["stdout"], "alive\n");
        assert!(started.elapsed() < Duration::from_secs(1), "the neighbour took {:?}", started.elapsed());
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, _) = server.raw("GET", "/v1/health", &[], None);
    assert_eq!(status, 200, "the server stays healthy");
    // The bomb hit the process limit inside; the agent can still run commands there.
    let inside = server.exec(&bomb, json!({"argv": ["echo", "still answering"]}));
    assert_eq!(inside["stdout"], "still answering\n", "{inside}");
    assert_eq!(server.delete_sandbox(&bomb)["state"], "succeeded");
    assert_eq!(space_testkit::processes_mentioning(&bomb), 0, "nothing of the bombed sandbox is left");

    // Two busy loops in a one-vCPU sandbox get one CPU's worth of time.
    let hog = server.create_sandbox(json!({"template": "base", "vcpus": 1}));
    let burn = "timeout 3 sh -c 'while :; do :; done' & timeout 3 sh -c 'while :; do :; done'; wait; \
                cat /proc/self/stat >/dev/null";
    let started = Instant::now();
    server.exec(&hog, json!({"cmd": burn, "timeout_s": 20}));
    let wall = started.elapsed().as_secs_f64();
    let usage = cpu_seconds(&hog).expect("the sandbox's CPU accounting");
    assert!(usage < wall * 1.25, "two loops used {usage:.2} s of CPU in {wall:.2} s with vcpus=1");
    server.delete_sandbox(&hog);
    server.delete_sandbox(&other);
}

/// CPU time the sandbox's engine processes used, from its cgroup (v1 or v2).
fn cpu_seconds(id: &str) -> Option<f64> {
    let v1 = std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/space/{id}/cpuacct.usage"));
    if let Ok(ns) = v1 {
        return ns.trim().parse::<f64>().ok().map(|ns| ns / 1e9);
    }
    let v2 = std::fs::read_to_string(format!("/sys/fs/cgroup/space/{id}/cpu.stat")).ok()?;
    let line = v2.lines().find(|l| l.starts_with("usage_usec "))?;
    line.split_whitespace().nth(1)?.parse::<f64>().ok().map(|us| us / 1e6)
}
