//! Lifecycle on real runsc: pause and resume in memory.

mod common;

use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::{json, Value};
use space_testkit::{processes_mentioning, wait_until, TestDataDir, PATIENCE};

/// A background process holding a random token in memory; it writes
/// `pid token counter` to /root/state every 50 ms.
const KEEPER: &str = "nohup python3 -c '
import os, time
token = os.urandom(8).hex()
n = 0
while True:
    n += 1
    with open(\"/root/state.new\", \"w\") as f:
        f.write(f\"{os.getpid()} {token} {n}\")
    os.replace(\"/root/state.new\", \"/root/state\")
    time.sleep(0.05)
' >/dev/null 2>&1 &";

fn keeper_state(server: &TestServer, id: &str) -> (String, String, u64) {
    let read = server.exec(
        id,
        json!({"cmd": "for i in $(seq 50); do [ -s /root/state ] && break; sleep 0.1; done; cat /root/state"}),
    );
    let text = read["stdout"].as_str().unwrap().to_string();
    let parts: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(parts.len(), 3, "{read}");
    (parts[0].to_string(), parts[1].to_string(), parts[2].parse().unwrap())
}

fn lifecycle(server: &TestServer, id: &str, action: &str) -> Value {
    let (status, accepted) = server.call("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
    assert_eq!(status, 202, "{action}: {accepted}");
    assert_eq!(accepted["operation"]["kind"], action);
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap())
}

#[test]
fn pause_freezes_processes_in_memory_and_resume_brings_them_back() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    server.exec(&id, json!({"cmd": KEEPER}));
    let (pid, token, _) = keeper_state(&server, &id);
    let host_view = data.data.sandbox_dir(&id).join("rootfs/root/state");
    let running_a = std::fs::read_to_string(&host_view).ok();
    assert!(running_a.is_some(), "the state file is visible in the sandbox root on the host");
    wait_until("the host to see the file change while running", PATIENCE, || {
        std::fs::read_to_string(&host_view).ok() != running_a
    });

    let paused = lifecycle(&server, &id, "pause");
    assert_eq!(paused["state"], "succeeded", "{paused}");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "paused");
    let before = std::fs::read_to_string(&host_view).ok();
    let refused = server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"argv": ["true"]})),
        409,
        "invalid_state",
    );
    assert_eq!(refused["error"]["details"]["state"], "paused");
    server.error("POST", &format!("/v1/sandboxes/{id}/pause"), None, 409, "invalid_state");
    server.error("GET", &format!("/v1/sandboxes/{id}/files?path=/root"), None, 409, "invalid_state");
    let cpu_before = engine_cpu_ns(&id);
    std::thread::sleep(Duration::from_millis(1000));
    let after = std::fs::read_to_string(&host_view).ok();
    assert!(before.is_some(), "the state file is visible in the sandbox root on the host");
    assert_eq!(before, after, "nothing runs while paused");
    // Not even gVisor's own kernel: its cgroup is frozen, it costs no CPU.
    assert_eq!(engine_cpu_ns(&id), cpu_before, "the paused sandbox's engine used CPU");

    let resumed = lifecycle(&server, &id, "resume");
    assert_eq!(resumed["state"], "succeeded", "{resumed}");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "running");
    let (pid_after, token_after, _) = keeper_state(&server, &id);
    assert_eq!((pid_after, token_after), (pid, token), "the same process with the same memory");
    server.error("POST", &format!("/v1/sandboxes/{id}/resume"), None, 409, "invalid_state");

    // A paused sandbox can be deleted, and nothing of it is left.
    assert_eq!(lifecycle(&server, &id, "pause")["state"], "succeeded");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    assert!(!data.data.sandbox_dir(&id).exists());
    assert_eq!(processes_mentioning(&id), 0, "no process of the deleted sandbox is left");
}

#[test]
fn lifecycle_calls_replay_their_idempotency_key_and_refuse_unknown_sandboxes() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let auth = format!("Bearer {}", server.key);
    let headers = [("Authorization", auth.as_str()), ("Idempotency-Key", "pause-once")];
    let first = server.raw("POST", &format!("/v1/sandboxes/{id}/pause"), &headers, None);
    let second = server.raw("POST", &format!("/v1/sandboxes/{id}/pause"), &headers, None);
    assert_eq!((first.0, second.0), (202, 202), "{second:?}");
    let (first, second): (Value, Value) =
        (serde_json::from_str(&first.1).unwrap(), serde_json::from_str(&second.1).unwrap());
    assert_eq!(first["operation"]["id"], second["operation"]["id"]);
    let resume_with_same_key = server.raw("POST", &format!("/v1/sandboxes/{id}/resume"), &headers, None);
    assert_eq!(resume_with_same_key.0, 422, "{resume_with_same_key:?}");
    server.error("POST", "/v1/sandboxes/sbx_00000000000000000000/pause", None, 404, "not_found");
    server.error("POST", "/v1/sandboxes/sbx_00000000000000000000/resume", None, 404, "not_found");
}

#[test]
fn suspend_writes_a_snapshot_and_resume_brings_back_processes_memory_and_commands() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    server.exec(&id, json!({"cmd": KEEPER}));
    server.exec(&id, json!({"cmd": "echo on disk > /root/file.txt"}));
    let (pid, token, _) = keeper_state(&server, &id);
    // A command that runs across the suspend.
    let counter = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.3; done"})),
    );
    let cid = counter["command"]["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(400));

    let suspended = lifecycle(&server, &id, "suspend");
    assert_eq!(suspended["state"], "succeeded", "{suspended}");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "suspended");
    assert_eq!(processes_mentioning(&id), 0, "no engine process exists while suspended");
    assert!(data.data.sandbox_dir(&id).join("snapshot/checkpoint.img").is_file());
    server.error("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");
    server.error("POST", &format!("/v1/sandboxes/{id}/pause"), None, 409, "invalid_state");
    server.error("POST", &format!("/v1/sandboxes/{id}/suspend"), None, 409, "invalid_state");

    let resumed = lifecycle(&server, &id, "resume");
    assert_eq!(resumed["state"], "succeeded", "{resumed}");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "running");
    let (pid_after, token_after, _) = keeper_state(&server, &id);
    assert_eq!((pid_after, token_after), (pid, token), "the same process with the same memory");
    assert_eq!(server.exec(&id, json!({"argv": ["cat", "/root/file.txt"]}))["stdout"], "on disk\n");

    // The command that ran across the suspend finished with all its output.
    let frames = server.output(&id, &cid, "?follow=true");
    assert_eq!(common::text_of(&frames, "stdout"), "tick1\ntick2\ntick3\ntick4\ntick5\ntick6\n");
    assert_eq!(frames.last().unwrap()["result"]["exit_code"], 0, "{frames:?}");
    assert!(!data.data.sandbox_dir(&id).join("snapshot").exists(), "the snapshot is freed after resume");

    // A suspended sandbox deletes cleanly: snapshot, disk and runsc state.
    assert_eq!(lifecycle(&server, &id, "suspend")["state"], "succeeded");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    assert!(!data.data.sandbox_dir(&id).exists());
    let runsc_state: Vec<String> = std::fs::read_dir(data.data.run_dir().join("runsc"))
        .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(!runsc_state.iter().any(|name| name.contains(&id)), "no runsc state is left: {runsc_state:?}");
}

#[test]
fn a_suspended_sandbox_survives_a_server_restart_and_pause_works_from_suspend_too() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    server.exec(&id, json!({"cmd": KEEPER}));
    let (pid, token, _) = keeper_state(&server, &id);
    assert_eq!(lifecycle(&server, &id, "pause")["state"], "succeeded");
    assert_eq!(lifecycle(&server, &id, "suspend")["state"], "succeeded", "a paused sandbox can be suspended");
    server.stop();

    let server = TestServer::start(&data);
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "suspended");
    let resumed = lifecycle(&server, &id, "resume");
    assert_eq!(resumed["state"], "succeeded", "{resumed}");
    let (pid_after, token_after, _) = keeper_state(&server, &id);
    assert_eq!((pid_after, token_after), (pid, token));
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    assert!(!data.data.sandbox_dir(&id).exists());
    assert_eq!(processes_mentioning(&id), 0);
}

#[test]
fn a_restarted_server_readopts_live_sandboxes_with_their_processes_and_commands() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let running = server.create_sandbox(json!({"template": "base"}));
    let paused = server.create_sandbox(json!({"template": "base"}));
    for id in [&running, &paused] {
        server.exec(id, json!({"cmd": KEEPER}));
    }
    let (pid, token, _) = keeper_state(&server, &running);
    let (paused_pid, paused_token, _) = keeper_state(&server, &paused);
    // Commands that run in paused sandboxes through the restart: one is
    // resumed and ends with its real result, the other's sandbox is deleted.
    let start = |id: &str, cmd: &str| {
        let started = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"cmd": cmd})));
        started["command"]["id"].as_str().unwrap().to_string()
    };
    let counter = start(&paused, "for i in 1 2 3 4 5 6; do echo count$i; sleep 0.5; done; exit 4");
    let doomed = server.create_sandbox(json!({"template": "base"}));
    let sleeper = start(&doomed, "sleep 600");
    assert_eq!(lifecycle(&server, &paused, "pause")["state"], "succeeded");
    assert_eq!(lifecycle(&server, &doomed, "pause")["state"], "succeeded");
    let saved = server.create_sandbox(json!({"template": "base"}));
    server.exec(&saved, json!({"cmd": "echo kept > /root/note"}));
    assert_eq!(lifecycle(&server, &saved, "pause")["state"], "succeeded");
    let ticker = server.ok(
        "POST",
        &format!("/v1/sandboxes/{running}/commands"),
        Some(json!({"cmd": "for i in 1 2 3 4 5 6 7 8; do echo tick$i; sleep 0.25; done; exit 3"})),
    );
    let cid = ticker["command"]["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(300));
    // The server goes away without cleaning up, as if killed.
    server.stop();
    assert!(processes_mentioning(&running) > 0, "engine processes do not die with the server");

    let server = TestServer::start(&data);
    // It answers at once, re-adopting in the background; a request for a
    // sandbox waits until it is.
    let health = server.ok("GET", "/v1/health", None);
    // (Paused ones are settled at once, so how many are left varies.)
    assert!(health["reconciling"].as_u64().is_some_and(|n| n <= 4), "of the four it found: {health}");
    let (pid_after, token_after, _) = keeper_state(&server, &running);
    assert_eq!((pid_after, token_after), (pid, token), "the background process kept running");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{running}"), None)["state"], "running");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{paused}"), None)["state"], "paused");
    wait_until("the re-adoption to end", PATIENCE, || server.ok("GET", "/v1/health", None)["reconciling"] == 0);

    // The command that ran through the restart is picked up and ends with its real result.
    let finished = server.ok("GET", &format!("/v1/sandboxes/{running}/commands/{cid}?wait=20"), None);
    assert_eq!(finished["result"]["exit_code"], 3, "{finished}");
    let frames = server.output(&running, &cid, "");
    let stdout = common::text_of(&frames, "stdout");
    assert!(stdout.starts_with("tick1\n") && stdout.ends_with("tick8\n"), "{stdout:?}");

    // The paused ones were left frozen: their agents are taken back when
    // they are next used, not at the restart.
    assert!(!server.platform.holds_agent(&paused) && !server.platform.holds_agent(&doomed));
    // Its command cannot take a signal until then, and says why.
    let refused = server.error(
        "POST",
        &format!("/v1/sandboxes/{paused}/commands/{counter}/signal"),
        Some(json!({"signal": "TERM"})),
        409,
        "invalid_state",
    );
    assert_eq!(refused["error"]["details"]["state"], "paused", "{refused}");
    assert_eq!(lifecycle(&server, &paused, "resume")["state"], "succeeded");
    let (pid_after, token_after, _) = keeper_state(&server, &paused);
    assert_eq!((pid_after, token_after), (paused_pid, paused_token));
    let counted = server.ok("GET", &format!("/v1/sandboxes/{paused}/commands/{counter}?wait=30"), None);
    assert_eq!(counted["result"]["exit_code"], 4, "{counted}");
    let stdout = common::text_of(&server.output(&paused, &counter, ""), "stdout");
    assert!(stdout.starts_with("count1\n") && stdout.ends_with("count6\n"), "{stdout:?}");
    assert_eq!(server.delete_sandbox(&doomed)["state"], "succeeded");
    // Suspended (its agent taken back for the snapshot, frozen again in
    // between), then resumed.
    assert!(!server.platform.holds_agent(&saved));
    assert_eq!(lifecycle(&server, &saved, "suspend")["state"], "succeeded");
    assert_eq!(lifecycle(&server, &saved, "resume")["state"], "succeeded");
    assert_eq!(server.exec(&saved, json!({"cmd": "cat /root/note"}))["stdout"], "kept\n");
    let slept = server.platform.store().node().command(&sleeper).unwrap().unwrap();
    assert!(slept.result.is_some(), "a deleted sandbox's command has ended: {slept:?}");
}

fn wait_for_state(server: &TestServer, id: &str, state: &str) -> Value {
    space_testkit::wait_for(&format!("{id} to become {state}"), PATIENCE, || {
        let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
        (sandbox["state"] == state).then_some(sandbox)
    })
}

#[test]
fn idle_and_lifetime_policies_act_on_time() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let idle = |on_idle: &str| json!({"template": "base", "lifecycle": {"idle_timeout_s": 1, "on_idle": on_idle}});
    let pauses = server.create_sandbox(idle("pause"));
    let suspends = server.create_sandbox(idle("suspend"));
    let deletes = server.create_sandbox(idle("delete"));
    let mortal = server.create_sandbox(json!({"template": "base", "lifecycle": {"max_lifetime_s": 3}}));
    let busy = server.create_sandbox(idle("pause"));
    // A running command is activity: this one is not idle while it runs.
    server.ok("POST", &format!("/v1/sandboxes/{busy}/commands"), Some(json!({"argv": ["sleep", "4"]})));

    wait_for_state(&server, &pauses, "paused");
    wait_for_state(&server, &suspends, "suspended");
    wait_for_state(&server, &deletes, "deleted");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{busy}"), None)["state"], "running", "busy is not idle");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{mortal}"), None)["state"], "running", "no idle policy");
    wait_for_state(&server, &mortal, "deleted");
    wait_for_state(&server, &busy, "paused");
    let operations = server.ok("GET", &format!("/v1/operations?sandbox_id={pauses}"), None);
    let kinds: Vec<&str> =
        operations["operations"].as_array().unwrap().iter().map(|o| o["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["create", "pause"], "policies act through ordinary operations");
}

#[test]
fn commands_can_ask_to_resume_a_paused_or_suspended_sandbox() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    assert_eq!(lifecycle(&server, &id, "pause")["state"], "succeeded");
    server.error("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");
    let ran =
        server.ok("POST", &format!("/v1/sandboxes/{id}/exec?auto_resume=true"), Some(json!({"cmd": "echo awake"})));
    assert_eq!(ran["stdout"], "awake\n");
    assert_eq!(lifecycle(&server, &id, "suspend")["state"], "succeeded");
    let started =
        server.ok("POST", &format!("/v1/sandboxes/{id}/commands?auto_resume=true"), Some(json!({"argv": ["true"]})));
    assert_eq!(started["command"]["state"], "running");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "running");
}

#[test]
fn a_starting_server_sweeps_leftovers_of_unknown_sandboxes() {
    let data = TestDataDir::new();
    let stray = data.data.sandbox_dir("sbx_0123456789abcdef0123");
    std::fs::create_dir_all(&stray).unwrap();
    space_host::btrfs::create_subvolume(&stray.join("rootfs")).unwrap();
    std::fs::write(stray.join("rootfs/junk"), "left behind").unwrap();
    let mut config = common::platform_config(&data);
    config.warm_pool = 1;
    let server = TestServer::start_with(config);
    // Swept in the background: the server answers meanwhile.
    assert_eq!(server.ok("GET", "/v1/health", None)["status"], "ok");
    wait_until("the leftover directory and its subvolume to go", PATIENCE, || !stray.exists());
    let kept = server.create_sandbox(json!({"template": "base"}));
    wait_until("the pool to fill again", PATIENCE, || server.platform.warm().count() == 1);
    server.stop();
    // What the killed server left running that no record names: its pool member.
    let members: Vec<String> = std::fs::read_dir(data.data.sandboxes_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|id| *id != kept)
        .collect();
    assert_eq!(members.len(), 1, "{members:?}");
    assert!(processes_mentioning(&members[0]) > 0, "the member runs on after its server");
    let server = TestServer::start(&data);
    wait_until("the re-adoption to end", PATIENCE, || server.ok("GET", "/v1/health", None)["reconciling"] == 0);
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{kept}"), None)["state"], "running");
    assert!(data.data.sandbox_dir(&kept).join("rootfs").exists(), "a known sandbox is kept");
    wait_until("the member to be swept", PATIENCE, || !data.data.sandbox_dir(&members[0]).exists());
    assert_eq!(processes_mentioning(&members[0]), 0);
    // Its cgroups too: runsc removes only those it made, not a killed one's.
    let cgroups = space_testkit::sandbox_cgroups(&members[0]);
    assert!(cgroups.is_empty(), "left behind: {cgroups:?}");
}

#[test]
fn warm_pool_sandboxes_get_their_own_identity() {
    pool_sandboxes_get_their_own_identity(2, 0, "waking a warm sandbox");
}

#[test]
fn hot_pool_sandboxes_get_their_own_identity() {
    pool_sandboxes_get_their_own_identity(0, 2, "handing out a hot sandbox");
}

/// Two creates of the default shape are served by the pool (`warm` paused
/// members or `hot` running ones, whose create operation says `step`),
/// two others start cold; each has its own hostname, env, entropy, clock.
fn pool_sandboxes_get_their_own_identity(warm: u32, hot: u32, step: &str) {
    let data = TestDataDir::new();
    let mut config = common::platform_config(&data);
    (config.warm_pool, config.hot_pool) = (warm, hot);
    let server = TestServer::start_with(config);
    wait_until("the pool to fill in the background", PATIENCE, || server.platform.warm().count() == 2);
    assert_eq!(server.platform.warm().hot_count(), hot as usize);

    let identity = |id: &str| {
        let out = server.exec(
            id,
            json!({"cmd": "hostname; echo $WHO; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s"}),
        );
        out["stdout"].as_str().unwrap().to_string()
    };
    let warm: Vec<String> =
        ["a", "b"].iter().map(|who| server.create_sandbox(json!({"template": "base", "env": {"WHO": who}}))).collect();
    let cold: Vec<String> = ["c", "d"]
        .iter()
        .map(|who| server.create_sandbox(json!({"template": "base", "env": {"WHO": who}, "memory_mib": 300})))
        .collect();
    // A warm sandbox was booted before anyone asked for it; a cold one after.
    let booted_before_asked = |id: &str| {
        let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
        let asked = humantime::parse_rfc3339_weak(sandbox["created_at"].as_str().unwrap()).unwrap();
        let booted =
            std::fs::metadata(data.data.sandbox_dir(id).join("bundle/config.json")).unwrap().modified().unwrap();
        booted < asked
    };
    assert!(warm.iter().all(|id| booted_before_asked(id)), "the first two came from the pool");
    assert!(cold.iter().all(|id| !booted_before_asked(id)), "other sizes start cold");
    let mut seen = Vec::new();
    for (id, who) in warm.iter().chain(&cold).zip(["a", "b", "c", "d"]) {
        let text = identity(id);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], id.replace('_', "-"), "each sandbox has its own hostname");
        assert_eq!(lines[1], who, "the create request's env is in place");
        assert_eq!(lines[2].len(), 32);
        seen.push(lines[2].to_string());
        let guest_clock: i64 = lines[3].parse().unwrap();
        let host_clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        assert!((guest_clock - host_clock).abs() <= 2, "the clock is right: guest {guest_clock}, host {host_clock}");
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 4, "no two sandboxes read the same random bytes");
    // Each create's operation tells its steps and how long each took: a
    // pool member's was the hand-out alone; a cold one's, the engine's
    // start in its parts. Together they make the whole operation.
    let create_of = |id: &str| {
        let operations = server.ok("GET", &format!("/v1/operations?sandbox_id={id}"), None);
        let operation = operations["operations"][0].clone();
        assert_eq!(operation["state"], "succeeded");
        let timings = operation["progress"]["timings"].as_array().unwrap().clone();
        let steps: Vec<String> = timings.iter().map(|t| t["step"].as_str().unwrap().to_string()).collect();
        let sum: f64 = timings.iter().map(|t| t["ms"].as_f64().unwrap()).sum();
        let at = |field: &str| humantime::parse_rfc3339_weak(operation[field].as_str().unwrap()).unwrap();
        let whole = at("finished_at").duration_since(at("created_at")).unwrap().as_secs_f64() * 1000.0;
        assert!((sum - whole).abs() <= 5.0, "steps {timings:?} make {sum} ms of {whole} ms");
        steps
    };
    for id in &warm {
        assert_eq!(create_of(id), ["queued", step], "served by the pool");
    }
    for id in &cold {
        let steps = create_of(id);
        for part in ["root snapshot (btrfs)", "runsc until the agent dials", "agent handshake"] {
            assert!(steps.contains(&format!("starting the sandbox: {part}")), "{part} in {steps:?}");
        }
        assert!(!steps.contains(&"starting the sandbox".to_string()), "the parts stand for the whole: {steps:?}");
    }

    // Shut down while the pool refills (two members were just taken): the
    // members still starting are waited for and destroyed, none outlives it.
    let one_more = server.create_sandbox(json!({"template": "base"}));
    assert!(!one_more.is_empty());
    drop(server);
    let runsc_root = format!("--root={}/", data.root().display());
    assert_eq!(processes_mentioning(&runsc_root), 0, "an engine process outlived the server's shutdown");
}

#[test]
fn a_template_can_set_its_own_pool_sizes_and_a_taken_hot_member_is_replaced_by_a_warm_one() {
    let data = TestDataDir::new();
    let template = data.data.template("base").unwrap();
    let path = template.dir.join("template.json");
    let mut meta: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    (meta["warm_pool"], meta["hot_pool"]) = (json!(1), json!(1));
    std::fs::write(&path, meta.to_string()).unwrap();
    let server = TestServer::start(&data); // the server's own settings are 0 here
    let pools = &server.platform.warm();
    let settled = |pools: &space_server::warm::WarmPools| pools.count() == 2 && pools.hot_count() == 1;
    wait_until("one hot and one warm member", PATIENCE, || settled(pools));
    // The pools settle at the template's sizes, not above them.
    let since = Instant::now();
    while since.elapsed() < Duration::from_millis(500) {
        assert!(settled(pools), "the template's sizes win: {:?}", pools.members());
        std::thread::sleep(Duration::from_millis(50));
    }
    let members = pools.members();
    let hot = members.iter().find(|(_, hot)| *hot).unwrap().0.clone();
    let warm = members.iter().find(|(_, hot)| !*hot).unwrap().0.clone();
    // A create takes the hot member; the warm one is thawed in its place
    // and a new warm one started behind it. The taken one never comes back.
    let id = server.create_sandbox(json!({"template": "base"}));
    assert_eq!(id, hot);
    wait_until("the pools to refill", PATIENCE, || settled(pools) && !pools.members().contains(&(warm.clone(), false)));
    let members = pools.members();
    assert!(members.contains(&(warm, true)), "the warm member became the hot one: {members:?}");
    assert!(members.iter().all(|(member, _)| *member != hot), "a member is handed out once");
    assert_eq!(server.exec(&id, json!({"cmd": "hostname"}))["stdout"], format!("{}\n", hot.replace('_', "-")));
}

#[test]
fn creates_beyond_the_hosts_capacity_are_refused_and_warm_members_count() {
    let data = TestDataDir::new();
    let mut config = common::platform_config(&data);
    config.capacity_mib = Some(1200);
    config.warm_pool = 2;
    let server = TestServer::start_with(config);
    wait_until("two 512 MiB members in 1200 MiB", PATIENCE, || server.platform.warm().count() == 2);
    // A cold create (other size) of 256 MiB does not fit beside them.
    let refused =
        server.error("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256})), 503, "capacity");
    assert_eq!(refused["error"]["details"]["capacity_mib"], 1200);
    // Taking a warm member moves its memory from the pool to the sandbox;
    // the pool may not refill beyond the capacity.
    let id = server.create_sandbox(json!({"template": "base"}));
    wait_until("the pool to give up its member", PATIENCE, || server.platform.warm().count() == 1);
    // A refill would have had time to start; none does, for want of room.
    let settled = Instant::now();
    while settled.elapsed() < Duration::from_secs(1) {
        assert_eq!(server.platform.warm().count(), 1, "no room to refill");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(lifecycle(&server, &id, "suspend")["state"], "succeeded", "suspended sandboxes hold no memory");
    wait_until("the pool to refill into the freed memory", PATIENCE, || server.platform.warm().count() == 2);
    let refused = server.error("POST", &format!("/v1/sandboxes/{id}/resume"), None, 503, "capacity");
    assert!(refused["error"]["message"].as_str().unwrap().contains("MiB"));
    assert_eq!(
        server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"],
        "suspended",
        "a refused resume changes nothing"
    );
}

#[test]
fn idle_sandboxes_are_paused_by_the_server_and_woken_by_their_next_request() {
    let data = TestDataDir::new();
    let mut config = common::platform_config(&data);
    config.auto_pause_s = 1;
    let server = TestServer::start_with(config);
    let id = server.create_sandbox(json!({"template": "base"}));
    let awake = server.create_sandbox(json!({"template": "base", "lifecycle": {"auto_pause": false}}));

    // A running command keeps its sandbox from being idle.
    let started = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "sleep 3; echo done", "timeout_s": 30})),
    );
    let cid = started["command"]["id"].as_str().unwrap();
    let ended = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=30"), None);
    assert_eq!(ended["result"]["exit_code"], 0, "the command ran to its end: {ended}");
    let frames = server.output(&id, cid, "");
    assert_eq!(common::text_of(&frames, "stdout"), "done\n");

    // Idle, it is paused by the server, and says so.
    let paused = wait_for_state(&server, &id, "paused");
    assert_eq!(paused["auto_paused"], true, "{paused}");
    let ops = server.ok("GET", &format!("/v1/operations?sandbox_id={id}"), None);
    let idle_pause = |op: &&Value| op["kind"] == "pause" && op["origin"] == "idle" && op["state"] == "succeeded";
    assert!(ops["operations"].as_array().unwrap().iter().any(|op| idle_pause(&op)), "{ops}");

    // The next command wakes it before it is served.
    assert_eq!(server.exec(&id, json!({"cmd": "echo awake"}))["stdout"], "awake\n");
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!((sandbox["state"].as_str(), sandbox["auto_paused"].as_bool()), (Some("running"), Some(false)));

    // So does a file request.
    server.exec(&id, json!({"cmd": "echo noted > /root/note.txt"}));
    wait_for_state(&server, &id, "paused");
    let auth = format!("Bearer {}", server.key);
    let (status, note) =
        server.raw("GET", &format!("/v1/sandboxes/{id}/files?path=/root/note.txt"), &[("Authorization", &auth)], None);
    assert_eq!((status, note.as_str()), (200, "noted\n"));

    // So does a request to a port: the proxy reaches the agent through a
    // session as commands and files do.
    server.exec(&id, json!({"cmd": "cd /root && nohup python3 -m http.server 8000 >/dev/null 2>&1 &"}));
    let page = format!("/v1/sandboxes/{id}/ports/8000/note.txt");
    space_testkit::wait_for("the server in the sandbox to answer", PATIENCE, || {
        (server.raw("GET", &page, &[("Authorization", &auth)], None).0 == 200).then_some(())
    });
    wait_for_state(&server, &id, "paused");
    let (status, note) = server.raw("GET", &page, &[("Authorization", &auth)], None);
    assert_eq!((status, note.as_str()), (200, "noted\n"));

    // Concurrent requests to a sleeping sandbox are all served.
    wait_for_state(&server, &id, "paused");
    let (server_ref, id_ref) = (&server, id.as_str());
    std::thread::scope(|scope| {
        let answers: Vec<_> = (0..3)
            .map(|n| {
                scope.spawn(move || server_ref.exec(id_ref, json!({"cmd": format!("echo {n}")}))["stdout"].clone())
            })
            .collect();
        for (n, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer.join().unwrap(), format!("{n}\n"));
        }
    });

    // A pause a client asked for is not undone by a request.
    assert_eq!(lifecycle(&server, &id, "pause")["state"], "succeeded");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["auto_paused"], false);
    server.error("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");

    // A sandbox that opted out was left running all along.
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{awake}"), None)["state"], "running");
}

/// CPU time the sandbox's engine processes used, from its cgroup (v1 or v2).
fn engine_cpu_ns(id: &str) -> u64 {
    if let Ok(ns) = std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/space/{id}/cpuacct.usage")) {
        return ns.trim().parse().unwrap();
    }
    let stat = std::fs::read_to_string(format!("/sys/fs/cgroup/space/{id}/cpu.stat")).expect("the sandbox's cgroup");
    let usec: u64 = stat.lines().find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok()).unwrap();
    usec * 1000
}

#[test]
fn requests_for_a_sandbox_wait_until_a_restarted_server_has_readopted_it() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    server.stop();
    // Frozen, its agent cannot dial the new server: re-adopting it waits.
    let frozen = space_testkit::processes_matching(&id);
    assert!(!frozen.is_empty());
    let signal_all = |signal| {
        frozen.iter().for_each(|pid| {
            let _ = kill(Pid::from_raw(*pid), signal);
        })
    };
    signal_all(Signal::SIGSTOP);
    let server = std::sync::Arc::new(TestServer::start(&data));
    assert_eq!(server.ok("GET", "/v1/health", None)["reconciling"], 1, "the server answers at once");
    let exec = {
        let server = server.clone();
        let id = id.clone();
        std::thread::spawn(move || server.exec(&id, json!({"cmd": "echo adopted"})))
    };
    // Not refused for want of an agent: it waits for the re-adoption.
    std::thread::sleep(Duration::from_secs(1));
    assert!(!exec.is_finished(), "the request waits while the sandbox is being re-adopted");
    // A request that waited past the server's patience is told to come back.
    let patience = server.platform.set_reconcile_patience(Duration::from_millis(300));
    let head = format!("GET /v1/sandboxes/{id} HTTP/1.1\r\nAuthorization: Bearer {}", server.key);
    let answer = server.early_answer(&head, b"");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"), "{answer}");
    assert!(answer.contains("being re-adopted after a restart"), "{answer}");
    server.platform.set_reconcile_patience(patience);
    // A stranger is not made to wait (which would tell it the sandbox
    // exists): it is answered before the re-adoption can end, as for any
    // id (a wait would end in the 503 above, after the patience).
    let (_, stranger) = space_server::tenants::create_key(server.platform.store(), "stranger", None).unwrap();
    for key in [stranger.as_str(), "space_not-a-key"] {
        let head = format!("GET /v1/sandboxes/{id} HTTP/1.1\r\nAuthorization: Bearer {key}");
        let answer = server.early_answer(&head, b"");
        assert!(answer.starts_with("HTTP/1.1 404") || answer.starts_with("HTTP/1.1 401"), "{answer}");
    }
    assert!(!exec.is_finished(), "the first request still waits");
    signal_all(Signal::SIGCONT);
    let ran = exec.join().unwrap();
    assert_eq!(ran["stdout"], "adopted\n", "{ran}");
    assert_eq!(server.ok("GET", "/v1/health", None)["reconciling"], 0);
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

/// Running sandboxes that are idle doze (their engine's timers coarsened:
/// under gVisor ≈ 3.5 % of a core down to ≈ 0.3 %), hot pool members while
/// they wait too; anything that uses one wakes it first.
#[test]
fn idle_running_sandboxes_and_hot_members_doze_and_wake_to_be_used() {
    use space_engine::gvisor::{timer_slacks, IDLE_TIMER_SLACK_NS};
    let data = TestDataDir::new();
    let mut config = common::platform_config(&data);
    (config.warm_pool, config.hot_pool) = (0, 1);
    let server = TestServer::start_with(config);
    let usual = std::fs::read_to_string("/proc/self/timerslack_ns").unwrap().trim().parse::<u64>().unwrap();
    let all =
        |id: &str, ns: u64| timer_slacks(id).is_ok_and(|slacks| !slacks.is_empty() && slacks.iter().all(|s| *s == ns));
    let hot_member = || server.platform.warm().members().into_iter().find(|(_, hot)| *hot).map(|(id, _)| id);
    wait_until("a hot member", PATIENCE, || hot_member().is_some());
    let member = hot_member().unwrap();
    wait_until("the hot member to doze", PATIENCE, || all(&member, IDLE_TIMER_SLACK_NS));

    // Handed out, it is woken: a command that runs keeps it awake.
    let id = server.create_sandbox(json!({"template": "base", "lifecycle": {"auto_pause": false}}));
    assert_eq!(id, member, "the create took the hot member");
    let sleeper = |id: &str| {
        let started = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"cmd": "sleep 3"})));
        started["command"]["id"].as_str().unwrap().to_string()
    };
    let command = sleeper(&id);
    assert!(all(&id, usual), "woken as it was handed out: {:?}", timer_slacks(&id));
    server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{command}?wait=30"), None);

    // Idle again, it dozes (auto_pause is off: it stays running), and
    // the next request wakes it before it is served.
    wait_until("the idle sandbox to doze", PATIENCE, || all(&id, IDLE_TIMER_SLACK_NS));
    let auth = format!("Bearer {}", server.key);
    let (_, metrics) = server.raw("GET", "/metrics", &[("Authorization", &auth)], None);
    assert!(metrics.contains("\nspace_sandboxes_dozing 1\n"), "the sandbox, not the hot member: {metrics}");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "running");
    sleeper(&id);
    assert!(all(&id, usual), "woken for the command: {:?}", timer_slacks(&id));

    // The member that replaced the taken one dozes as it waits.
    wait_until("a new hot member", PATIENCE, || hot_member().is_some_and(|m| m != member));
    let next = hot_member().unwrap();
    wait_until("the new hot member to doze", PATIENCE, || all(&next, IDLE_TIMER_SLACK_NS));

    // A server killed while the sandbox dozes: the next one knows nothing
    // of it, and wakes it all the same before it serves it.
    wait_until("the sandbox to doze again", PATIENCE, || all(&id, IDLE_TIMER_SLACK_NS));
    server.stop();
    let server = TestServer::start(&data);
    wait_until("the re-adoption to end", PATIENCE, || server.ok("GET", "/v1/health", None)["reconciling"] == 0);
    let started = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"cmd": "sleep 3"})));
    assert!(started["command"]["id"].is_string());
    assert!(all(&id, usual), "woken after the restart: {:?}", timer_slacks(&id));
}
