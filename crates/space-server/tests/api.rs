//! The first sandbox, end to end: the real API over HTTP, real runsc
//! sandboxes, a real SQLite file. Every JSON answer is checked against the
//! server's OpenAPI document.

mod common;

use std::time::{Duration, Instant};

use common::{text_of, TestServer};
use serde_json::json;
use space_testkit::TestDataDir;

#[test]
fn a_sandbox_is_a_debian_machine_with_its_own_kernel() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base", "labels": {"suite": "e2e"}}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["state"], "running");
    assert_eq!(sandbox["engine"], "gvisor");
    assert_eq!(sandbox["labels"]["suite"], "e2e");

    let kernel = server.exec(&id, json!({"argv": ["uname", "-r"]}));
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(kernel["result"]["exit_code"], 0);
    assert_ne!(
        kernel["stdout"].as_str().unwrap().trim(),
        host_kernel.trim(),
        "the sandbox must not share the host kernel"
    );

    let os = server.exec(&id, json!({"cmd": "cat /etc/os-release"}));
    assert!(os["stdout"].as_str().unwrap().contains("VERSION_CODENAME=bookworm"), "{os}");

    let python = server.exec(&id, json!({"argv": ["python3", "-c", "print(6*7)"]}));
    assert_eq!(python["stdout"], "42\n");
    assert_eq!(python["truncated"], false);

    let listed = server.ok("GET", "/v1/sandboxes?state=running&label=suite=e2e", None);
    assert!(listed["sandboxes"].as_array().unwrap().iter().any(|s| s["id"] == id.as_str()));
    let none = server.ok("GET", "/v1/sandboxes?label=suite=other", None);
    assert!(none["sandboxes"].as_array().unwrap().is_empty());
}

#[test]
fn state_persists_between_commands_and_results_are_exact() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base", "env": {"GREETING": "hello"}}));

    let write = server.exec(&id, json!({"cmd": "echo \"$GREETING from one\" > /root/note.txt", "cwd": "/root"}));
    assert_eq!(write["result"]["exit_code"], 0);
    let read = server.exec(&id, json!({"argv": ["cat", "/root/note.txt"]}));
    assert_eq!(read["stdout"], "hello from one\n", "the second command sees the first one's file");

    let mixed = server.exec(&id, json!({"cmd": "echo out; echo err >&2; exit 7"}));
    assert_eq!(mixed["stdout"], "out\n");
    assert_eq!(mixed["stderr"], "err\n");
    assert_eq!(mixed["result"]["exit_code"], 7);
    assert_eq!(mixed["result"]["signal"], serde_json::Value::Null);
    assert_eq!(mixed["result"]["stdout_bytes"], 4);
    assert_eq!(mixed["result"]["stderr_bytes"], 4);

    let killed = server.exec(&id, json!({"cmd": "kill -KILL $$"}));
    assert_eq!(killed["result"]["exit_code"], serde_json::Value::Null);
    assert_eq!(killed["result"]["signal"], "KILL");

    let env = server
        .exec(&id, json!({"argv": ["sh", "-c", "echo $GREETING $EXTRA; pwd"], "env": {"EXTRA": "x"}, "cwd": "/tmp"}));
    assert_eq!(env["stdout"], "hello x\n/tmp\n");

    let nobody = server.exec(&id, json!({"argv": ["id", "-u"], "user": "nobody"}));
    assert_eq!(nobody["stdout"], "65534\n");

    server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["no-such-binary"]})),
        422,
        "executable_not_found",
    );
    server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["ls"], "cwd": "/nope"})),
        422,
        "invalid_cwd",
    );
    server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["ls"], "user": "mallory"})),
        422,
        "invalid_user",
    );

    let commands = server.ok("GET", &format!("/v1/sandboxes/{id}/commands"), None);
    let commands = commands["commands"].as_array().unwrap();
    assert_eq!(commands.len(), 6, "failed starts leave no command record");
    assert!(commands.iter().all(|c| c["state"] == "exited" && c["result"].is_object()));
    assert_eq!(
        server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"],
        "running",
        "the sandbox outlives its commands"
    );
}

#[test]
fn output_streams_while_running_and_replays_from_any_offset() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let created = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "for i in 1 2 3; do echo line$i; sleep 0.4; done; echo done >&2", "tag": "slow"})),
    );
    let command = &created["command"];
    assert_eq!(command["state"], "running");
    assert!(command["pid"].as_u64().unwrap() > 1);
    let cid = command["id"].as_str().unwrap().to_string();

    // Follow the live stream: the first line arrives long before the end.
    let started = Instant::now();
    let path = format!("{}/v1/sandboxes/{id}/commands/{cid}/output?follow=true", server.url);
    let response =
        space_testkit::http().get(&path).set("Authorization", &format!("Bearer {}", server.key)).call().unwrap();
    assert_eq!(response.header("content-type"), Some("application/x-ndjson"));
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(response.into_reader()));
    let first: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let first_at = started.elapsed();
    assert_eq!(first["type"], "stdout");
    assert_eq!(first["data"], "line1\n");
    let running = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}"), None);
    assert_eq!(running["state"], "running", "the first frame came while the command ran");
    let rest: Vec<serde_json::Value> = lines.map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect();
    let last = rest.last().unwrap();
    assert_eq!(last["type"], "exit", "the stream ends with the exit frame");
    assert_eq!(last["result"]["exit_code"], 0);
    assert!(first_at < Duration::from_millis(1000), "first frame after {first_at:?}");

    // Replays after the end.
    let all = server.output(&id, &cid, "");
    assert_eq!(text_of(&all, "stdout"), "line1\nline2\nline3\n");
    assert_eq!(text_of(&all, "stderr"), "done\n");
    assert_eq!(all.last().unwrap()["type"], "exit");
    let tail = server.output(&id, &cid, "?from=8");
    assert_eq!(tail[0]["offset"], 8);
    assert_eq!(text_of(&tail, "stdout"), "ne2\nline3\n");
    let past_end = server.output(&id, &cid, "?from=1000");
    assert_eq!(past_end.len(), 1, "only the exit frame: {past_end:?}");

    let waited = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=5"), None);
    assert_eq!(waited["result"]["stdout_bytes"], 18);
    assert_eq!(waited["tag"], "slow");

    // SSE carries the same frames.
    let (status, sse) = server.raw(
        "GET",
        &format!("/v1/sandboxes/{id}/commands/{cid}/output"),
        &[("Authorization", &format!("Bearer {}", server.key)), ("Accept", "text/event-stream")],
        None,
    );
    assert_eq!(status, 200);
    assert!(sse.starts_with("event: stdout\ndata: "), "{sse}");
    assert!(sse.trim_end().rsplit("\n\n").next().unwrap().starts_with("event: exit"), "{sse}");
}

#[test]
fn binary_output_survives_and_exec_output_is_bounded() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let created =
        server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"cmd": "printf 'a\\000b\\377c'"})));
    let cid = created["command"]["id"].as_str().unwrap();
    let frames = server.output(&id, cid, "?follow=true");
    let bytes: Vec<u8> = frames
        .iter()
        .filter(|f| f["type"] == "stdout")
        .flat_map(|f| match f["data"].as_str() {
            Some(text) => text.as_bytes().to_vec(),
            None => base64_decode(f["data_b64"].as_str().unwrap()),
        })
        .collect();
    assert_eq!(bytes, b"a\x00b\xffc");

    let big = server.exec(&id, json!({"cmd": "head -c 3000000 /dev/zero | tr '\\0' x"}));
    assert_eq!(big["truncated"], true);
    assert_eq!(big["stdout"].as_str().unwrap().len(), 1 << 20);
    assert_eq!(big["result"]["stdout_bytes"], 3_000_000, "the transcript keeps everything");
}

fn base64_decode(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        acc = (acc << 6) | ALPHABET.iter().position(|&a| a == c).unwrap() as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[test]
fn the_sandbox_sees_neither_host_files_nor_any_network() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let secret = std::env::temp_dir().join(format!("space-host-secret-{}", std::process::id()));
    std::fs::write(&secret, "host only").unwrap();

    let read = server.exec(&id, json!({"argv": ["cat", secret.to_str().unwrap()]}));
    assert_ne!(read["result"]["exit_code"], 0, "{read}");
    assert!(!read["stdout"].as_str().unwrap().contains("host only"));
    let api_port = server.url.rsplit(':').next().unwrap();
    let probe = format!(
        "import socket\nfor host, port in [('127.0.0.1', {api_port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n    \
         try:\n        socket.create_connection((host, port), timeout=2); print('REACHED', host)\n    \
         except OSError as e:\n        print('blocked', host, e.errno)\n\
         print(sorted(open('/proc/net/dev').read().split()[::17]))"
    );
    let net = server.exec(&id, json!({"argv": ["python3", "-c", probe]}));
    let out = net["stdout"].as_str().unwrap();
    assert!(!out.contains("REACHED"), "the sandbox reached something: {out}");
    assert_eq!(out.matches("blocked").count(), 3, "{out}");
    let devices = server.exec(&id, json!({"argv": ["cat", "/proc/net/dev"]}));
    let names: Vec<&str> = devices["stdout"]
        .as_str()
        .unwrap()
        .lines()
        .skip(2)
        .filter_map(|line| line.split(':').next().map(str::trim))
        .collect();
    assert_eq!(names, ["lo"], "no network device but loopback: {devices}");
    std::fs::remove_file(&secret).unwrap();
}

#[test]
fn delete_frees_everything_and_is_idempotent() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    server.exec(&id, json!({"cmd": "echo keep > /root/f"}));
    let sandbox_dir = data.data.sandbox_dir(&id);
    assert!(sandbox_dir.join("rootfs").exists());

    let operation = server.delete_sandbox(&id);
    assert_eq!(operation["state"], "succeeded", "{operation}");
    assert_eq!(operation["kind"], "delete");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "deleted");
    assert!(!sandbox_dir.exists(), "the sandbox's root and files are gone");
    assert_eq!(space_testkit::processes_mentioning(&id), 0, "no process mentions the sandbox");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&id), "no mount is left");
    let subvolumes = space_testkit::run_within(
        std::process::Command::new("btrfs").args(["subvolume", "list", "-o"]).arg(data.root()),
        space_testkit::PATIENCE,
    )
    .unwrap();
    assert!(!String::from_utf8_lossy(&subvolumes).contains(&id), "no subvolume is left");
    let runsc_state: Vec<String> = std::fs::read_dir(data.data.run_dir().join("runsc"))
        .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(!runsc_state.iter().any(|name| name.contains(&id)), "no runsc state is left: {runsc_state:?}");

    server.error("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");
    let again = server.delete_sandbox(&id);
    assert_eq!(again["state"], "succeeded", "deleting twice is fine");
}

#[test]
fn bad_input_gets_the_error_shape_and_changes_nothing() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    server.error("POST", "/v1/sandboxes", Some(json!({"template": "no-such-template"})), 404, "template_not_found");
    server.error("POST", "/v1/sandboxes", Some(json!({"template": "base", "colour": "blue"})), 400, "invalid_request");
    server.error("POST", "/v1/sandboxes", Some(json!({"template": "base", "vcpus": "two"})), 400, "invalid_request");
    server.error("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": -5})), 400, "invalid_request");
    server.error("POST", "/v1/sandboxes", Some(json!({"template": "base", "vcpus": 0})), 422, "invalid_value");
    server.error(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "base", "memory_mib": 99999999})),
        422,
        "invalid_value",
    );
    server.error(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "base", "network": {"egress": "everywhere"}})),
        400,
        "invalid_request",
    );
    server.error("GET", "/v1/sandboxes/sbx_00000000000000000000", None, 404, "not_found");
    server.error("GET", &format!("/v1/sandboxes/{}", "x".repeat(5000)), None, 404, "not_found");
    server.error("GET", "/v1/operations/op_00000000000000000000?wait=1", None, 404, "not_found");
    // What the path names is found (or not) before the query is read: an
    // unknown operation is 404 whatever the query (a bad wait on a real one
    // is 400: below).
    server.error("GET", "/v1/operations/op_00000000000000000000?wait=999", None, 404, "not_found");
    server.error("GET", "/v1/sandboxes?state=sleepy", None, 400, "invalid_request");

    let auth = format!("Bearer {}", server.key);
    let malformed = server.raw(
        "POST",
        "/v1/sandboxes",
        &[("Authorization", &auth), ("Content-Type", "application/json")],
        Some("{\"template\":"),
    );
    assert_eq!(malformed.0, 400);
    assert!(malformed.1.contains("\"malformed_json\""), "{}", malformed.1);
    // The server may answer these before reading the body, so they go
    // through a raw socket that reads the answer whatever happens to the body.
    let no_type = server
        .early_answer(&format!("POST /v1/sandboxes HTTP/1.1\r\nAuthorization: {auth}"), br#"{"template":"base"}"#);
    assert!(no_type.starts_with("HTTP/1.1 415"), "{no_type}");
    assert!(no_type.contains("\"unsupported_media_type\""), "{no_type}");
    let huge = vec![b'x'; 2 << 20];
    let too_big = server.early_answer(
        &format!("POST /v1/sandboxes HTTP/1.1\r\nAuthorization: {auth}\r\nContent-Type: application/json"),
        &huge,
    );
    assert!(too_big.starts_with("HTTP/1.1 413"), "{}", too_big.lines().next().unwrap_or(""));
    assert!(too_big.contains("\"too_large\""), "{too_big}");
    // An answer given without reading the body says the connection ends
    // with it, so no client sends its next request on a closing connection;
    // one that read the body keeps the connection.
    let head_of = |head: &str, body: &str| {
        let mut socket = std::net::TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
        socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let request = format!("{head}\r\nHost: test\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        std::io::Write::write_all(&mut socket, request.as_bytes()).unwrap();
        let mut answer = Vec::new();
        let mut byte = [0u8; 1];
        while !answer.ends_with(b"\r\n\r\n") && std::io::Read::read(&mut socket, &mut byte).unwrap_or(0) == 1 {
            answer.push(byte[0]);
        }
        String::from_utf8_lossy(&answer).to_lowercase()
    };
    let unread = head_of(&format!("POST /v1/sandboxes HTTP/1.1\r\nAuthorization: {auth}"), r#"{"template":"base"}"#);
    assert!(unread.starts_with("http/1.1 415") && unread.contains("connection: close"), "{unread}");
    let read = head_of(
        &format!("POST /v1/sandboxes HTTP/1.1\r\nAuthorization: {auth}\r\nContent-Type: application/json"),
        "{\"template\":",
    );
    assert!(read.starts_with("http/1.1 400") && !read.contains("connection: close"), "{read}");

    for (headers, what) in [
        (vec![], "no key"),
        (vec![("Authorization", "Bearer wrong")], "a wrong key"),
        (vec![("Authorization", "Basic Zm9v")], "another scheme"),
    ] {
        let (status, body) = server.raw("GET", "/v1/sandboxes", &headers, None);
        assert_eq!(status, 401, "{what}: {body}");
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(value["error"]["code"], "unauthorized");
        server.check("GET", "/v1/sandboxes", 401, "application/json", &value);
    }
    let (status, health) = server.raw("GET", "/v1/health", &[], None);
    assert_eq!(status, 200, "health needs no key");
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    server.check("GET", "/v1/health", 200, "application/json", &health);
    assert_eq!(health["engine"], "gvisor");
    assert_eq!(server.raw("GET", "/v1/nowhere", &[("Authorization", &auth)], None).0, 404);

    // Nothing was created by any of it.
    assert!(server.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().is_empty());
    assert!(server.ok("GET", "/v1/operations", None)["operations"].as_array().unwrap().is_empty());
    assert_eq!(std::fs::read_dir(data.data.sandboxes_dir()).unwrap().count(), 0);
    for body in [json!({"argv": ["ls"], "cmd": "ls"}), json!({}), json!({"argv": []})] {
        let (status, _) = server.call("POST", "/v1/sandboxes/sbx_00000000000000000000/commands", Some(body));
        assert_eq!(status, 404);
    }
    let (_, accepted) = server.call("POST", "/v1/sandboxes", Some(serde_json::json!({"template": "base"})));
    let operation = accepted["operation"]["id"].as_str().unwrap().to_string();
    server.error("GET", &format!("/v1/operations/{operation}?wait=999"), None, 400, "invalid_request");
    server.error("GET", &format!("/v1/operations/{}?wait=1", operation.to_uppercase()), None, 404, "not_found");
}

#[test]
fn idempotency_keys_replay_the_original_operation() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let auth = format!("Bearer {}", server.key);
    let headers =
        [("Authorization", auth.as_str()), ("Content-Type", "application/json"), ("Idempotency-Key", "create-once")];
    let (first_status, first) = server.raw("POST", "/v1/sandboxes", &headers, Some(r#"{"template":"base"}"#));
    let (second_status, second) = server.raw("POST", "/v1/sandboxes", &headers, Some(r#"{"template":"base"}"#));
    assert_eq!((first_status, second_status), (202, 202));
    let (first, second): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&first).unwrap(), serde_json::from_str(&second).unwrap());
    assert_eq!(first["operation"]["id"], second["operation"]["id"]);
    assert_eq!(first["sandbox"]["id"], second["sandbox"]["id"]);
    assert_eq!(server.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().len(), 1);
    let operation = server.wait_operation(first["operation"]["id"].as_str().unwrap());
    assert_eq!(operation["state"], "succeeded");
    let operations =
        server.ok("GET", &format!("/v1/operations?sandbox_id={}", first["sandbox"]["id"].as_str().unwrap()), None);
    assert_eq!(operations["operations"].as_array().unwrap().len(), 1);
    // The key is for that request only: another body under it is refused,
    // not answered with the first sandbox.
    for other in [
        r#"{"template":"base","memory_mib":1024}"#,
        r#"{"template":"base","labels":{"team":"b"}}"#,
        r#"{"template":"base","env":{"A":"1"}}"#,
        r#"{"template":"base","network":{"egress":"public"}}"#,
    ] {
        let (status, body) = server.raw("POST", "/v1/sandboxes", &headers, Some(other));
        assert_eq!(status, 422, "{other}: {body}");
        assert!(body.contains("already used for a different request"), "{body}");
    }
    // A fork's key likewise: another count or labels is refused.
    let source = first["sandbox"]["id"].as_str().unwrap();
    let fork_headers =
        [("Authorization", auth.as_str()), ("Content-Type", "application/json"), ("Idempotency-Key", "fork-once")];
    let (status, forked) =
        server.raw("POST", &format!("/v1/sandboxes/{source}/fork"), &fork_headers, Some(r#"{"labels":{"n":"1"}}"#));
    assert_eq!(status, 202, "{forked}");
    let (status, again) =
        server.raw("POST", &format!("/v1/sandboxes/{source}/fork"), &fork_headers, Some(r#"{"labels":{"n":"1"}}"#));
    assert_eq!(status, 202, "{again}");
    for other in [r#"{"count":2,"labels":{"n":"1"}}"#, r#"{"labels":{"n":"2"}}"#] {
        let (status, body) = server.raw("POST", &format!("/v1/sandboxes/{source}/fork"), &fork_headers, Some(other));
        assert_eq!(status, 422, "{other}: {body}");
    }
    let forked: serde_json::Value = serde_json::from_str(&forked).unwrap();
    server.wait_operation(forked["operation"]["id"].as_str().unwrap());
}

#[test]
fn records_and_transcripts_survive_a_server_restart() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let doomed = server.create_sandbox(json!({"template": "base"}));
    let done = server.exec(&id, json!({"cmd": "echo before restart"}));
    let cid = done["command"]["id"].as_str().unwrap().to_string();
    server.stop();
    // One sandbox dies while no server watches it.
    kill_sandbox_kernel(&doomed);

    let server = TestServer::start(&data);
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["state"], "running", "a live sandbox is re-adopted");
    assert_eq!(server.exec(&id, json!({"cmd": "echo after restart"}))["stdout"], "after restart\n");
    let command = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}"), None);
    assert_eq!(command["result"]["exit_code"], 0);
    assert_eq!(text_of(&server.output(&id, &cid, ""), "stdout"), "before restart\n");
    let operations = server.ok("GET", &format!("/v1/operations?sandbox_id={id}"), None);
    assert_eq!(operations["operations"][0]["state"], "succeeded");

    let lost = server.ok("GET", &format!("/v1/sandboxes/{doomed}"), None);
    assert_eq!(lost["state"], "failed", "{lost}");
    assert!(lost["failure_reason"].as_str().unwrap().contains("could not re-adopt"), "{lost}");
    assert_eq!(server.delete_sandbox(&doomed)["state"], "succeeded", "a failed sandbox can still be freed");
    assert!(!data.data.sandbox_dir(&doomed).exists());
}

/// Kills a sandbox's runsc sandbox process (its kernel) from the host.
fn kill_sandbox_kernel(id: &str) {
    let victim = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let entry = e.ok()?;
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = String::from_utf8_lossy(&std::fs::read(entry.path().join("cmdline")).ok()?).into_owned();
            (cmdline.starts_with("runsc-sandbox") && cmdline.contains(id)).then_some(pid)
        })
        .next()
        .expect("the sandbox's runsc process");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), nix::sys::signal::Signal::SIGKILL).unwrap();
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn the_agent_reaps_orphans_and_commands_can_be_timed_out_signalled_and_fed() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));

    // An orphan re-parented to the agent (PID 1) is reaped, not left a zombie.
    server.exec(&id, json!({"cmd": "(sleep 0.2 &) ; true"}));
    let orphans = || {
        let ps = server.exec(&id, json!({"argv": ["ps", "-eo", "pid,ppid,stat,comm"]}));
        let zombies: Vec<String> = ps["stdout"]
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| {
                let fields: Vec<&str> = l.split_whitespace().collect();
                fields.get(2).is_some_and(|s| s.starts_with('Z')) || fields.get(3) == Some(&"sleep")
            })
            .map(str::to_string)
            .collect();
        zombies
    };
    // Gone altogether: neither still sleeping nor left a zombie (an orphan
    // nobody reaps stays listed as `Z`, and this wait fails).
    space_testkit::wait_until("the orphan to exit and be reaped", space_testkit::PATIENCE, || orphans().is_empty());

    let started = Instant::now();
    let timed = server.exec(&id, json!({"argv": ["sleep", "30"], "timeout_s": 1}));
    assert_eq!(timed["result"]["timed_out"], true, "{timed}");
    assert_eq!(timed["result"]["signal"], "KILL");
    assert!(started.elapsed() < Duration::from_secs(10));

    let sleeper = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": ["sleep", "30"]})));
    let cid = sleeper["command"]["id"].as_str().unwrap();
    let (status, _) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{cid}/signal"),
        &[("Authorization", &format!("Bearer {}", server.key)), ("Content-Type", "application/json")],
        Some(r#"{"signal":"TERM"}"#),
    );
    assert_eq!(status, 204);
    let ended = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=10"), None);
    assert_eq!(ended["result"]["signal"], "TERM", "{ended}");
    server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{cid}/signal"),
        Some(json!({"signal": "TERM"})),
        409,
        "invalid_state",
    );
    server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{cid}/signal"),
        Some(json!({"signal": "NOPE"})),
        400,
        "invalid_request",
    );

    let cat = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": ["cat"], "stdin": true})));
    let cid = cat["command"]["id"].as_str().unwrap();
    let (status, _) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{cid}/stdin?eof=true"),
        &[("Authorization", &format!("Bearer {}", server.key))],
        Some("round trip\n"),
    );
    assert_eq!(status, 204);
    let frames = server.output(&id, cid, "?follow=true");
    assert_eq!(text_of(&frames, "stdout"), "round trip\n");
    assert_eq!(frames.last().unwrap()["result"]["exit_code"], 0);
}

#[test]
fn an_engine_failure_fails_the_operation_and_leaves_nothing_behind() {
    let data = TestDataDir::new();
    // A runsc that answers --version but cannot run anything.
    let fake = data.root().join("broken-runsc");
    std::fs::write(&fake, "#!/bin/sh\ncase \"$*\" in\n  *--version*) echo 'runsc version broken';;\n  *\" run \"*) echo 'boom' >&2; exit 1;;\n  *) exec runsc \"$@\";;\nesac\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut config = common::platform_config(&data);
    config.runsc = fake;
    let server = TestServer::start_with(config);

    let (status, accepted) = server.call("POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202);
    let operation = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    assert_eq!(operation["state"], "failed");
    assert_eq!(operation["error"]["code"], "engine_failed");
    let message = operation["error"]["message"].as_str().unwrap();
    assert!(!message.contains(data.root().to_str().unwrap()), "no host paths leak: {message}");
    let id = accepted["sandbox"]["id"].as_str().unwrap();
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["state"], "failed");
    assert!(sandbox["failure_reason"].is_string());
    assert!(!data.data.sandbox_dir(id).exists(), "no half-created root or bundle is left");
}

#[test]
fn a_sandbox_that_dies_is_marked_failed_and_its_commands_get_a_clear_end() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let sleeper = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": ["sleep", "60"]})));
    let cid = sleeper["command"]["id"].as_str().unwrap();

    kill_sandbox_kernel(&id);

    let command = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=20"), None);
    assert_eq!(command["state"], "exited", "{command}");
    assert_eq!(command["result"]["exit_code"], serde_json::Value::Null);
    assert!(command["result"]["error"].as_str().is_some_and(|e| e.contains("stopped")), "{command}");
    let frames = server.output(&id, cid, "");
    assert_eq!(frames.last().unwrap()["type"], "exit", "the stream still ends with an exit frame");

    let mut sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    for _ in 0..50 {
        if sandbox["state"] == "failed" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    }
    assert_eq!(sandbox["state"], "failed", "{sandbox}");
    assert!(sandbox["failure_reason"].as_str().unwrap().contains("unexpectedly"));
    server.error("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    assert!(!data.data.sandbox_dir(&id).exists());
}

#[test]
fn tty_commands_run_on_a_pseudo_terminal_that_can_be_resized() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    // A terminal is the command's stdin, so `tty` alone opens stdin too.
    let tty = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": ["tty"], "tty": true})));
    assert_eq!((&tty["command"]["stdin"], &tty["command"]["tty"]), (&json!(true), &json!(true)), "{tty}");
    let frames = server.output(&id, tty["command"]["id"].as_str().unwrap(), "?follow=true");
    assert!(text_of(&frames, "stdout").starts_with("/dev/pts/"), "{frames:?}");
    let plain = server.exec(&id, json!({"argv": ["tty"]}));
    assert_eq!(plain["stdout"], "not a tty\n");

    let auth = format!("Bearer {}", server.key);
    let shell = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "read line; stty size; echo \"got $line\"", "tty": true})),
    );
    let cid = shell["command"]["id"].as_str().unwrap();
    let (status, _) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{cid}/resize"),
        &[("Authorization", &auth), ("Content-Type", "application/json")],
        Some(r#"{"cols": 100, "rows": 30}"#),
    );
    assert_eq!(status, 204);
    let (status, _) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{cid}/stdin"),
        &[("Authorization", &auth)],
        Some("hello\n"),
    );
    assert_eq!(status, 204);
    let frames = server.output(&id, cid, "?follow=true");
    let text = text_of(&frames, "stdout");
    assert!(text.contains("30 100"), "the terminal has the new size: {text:?}");
    assert!(text.contains("got hello"), "{text:?}");
    assert_eq!(frames.last().unwrap()["result"]["exit_code"], 0);
}

#[test]
fn a_websocket_attach_drives_an_interactive_shell() {
    use tungstenite::client::IntoClientRequest;
    use tungstenite::Message;

    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let shell = server.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": ["sh"], "tty": true})));
    let cid = shell["command"]["id"].as_str().unwrap();

    let url = format!("{}/v1/sandboxes/{id}/commands/{cid}/attach", server.url.replace("http://", "ws://"));
    let mut request = url.as_str().into_client_request().unwrap();
    request.headers_mut().insert("Authorization", format!("Bearer {}", server.key).parse().unwrap());
    let (mut socket, response) = tungstenite::connect(request).expect("the WebSocket upgrade");
    assert_eq!(response.status(), 101);
    socket.send(Message::Text(r#"{"resize": {"cols": 120, "rows": 40}}"#.into())).unwrap();
    socket.send(Message::Binary(b"stty size; echo marker-$((6*7)); exit 5\n".to_vec().into())).unwrap();

    let mut screen = Vec::new();
    let exit = loop {
        match socket.read().expect("the attach stays open until the exit") {
            Message::Binary(bytes) => screen.extend_from_slice(&bytes),
            Message::Text(text) => break serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            Message::Close(_) => panic!("closed before the exit frame"),
            _ => {}
        }
    };
    let screen = String::from_utf8_lossy(&screen);
    assert!(screen.contains("40 120"), "the resize reached the terminal: {screen:?}");
    assert!(screen.contains("marker-42"), "{screen:?}");
    assert_eq!(exit["exit"]["exit_code"], 5);

    // Without a WebSocket upgrade the route says so in the error shape.
    server.error("GET", &format!("/v1/sandboxes/{id}/commands/{cid}/attach"), None, 400, "invalid_request");
}

/// An attach session with a deadline on every read.
fn attach_socket(
    server: &TestServer,
    sandbox: &str,
    command: &str,
) -> tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>> {
    use tungstenite::client::IntoClientRequest;
    let url = format!("{}/v1/sandboxes/{sandbox}/commands/{command}/attach", server.url.replace("http://", "ws://"));
    let mut request = url.as_str().into_client_request().unwrap();
    request.headers_mut().insert("Authorization", format!("Bearer {}", server.key).parse().unwrap());
    let (mut socket, _) = tungstenite::connect(request).expect("the WebSocket upgrade");
    if let tungstenite::stream::MaybeTlsStream::Plain(tcp) = socket.get_mut() {
        tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    }
    socket
}

/// Reads an attach session to its exit frame: (output, error frames, exit).
fn read_to_exit(
    socket: &mut tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>,
) -> (String, Vec<serde_json::Value>, serde_json::Value) {
    use tungstenite::Message;
    let (mut output, mut errors) = (Vec::new(), Vec::new());
    loop {
        match socket.read().expect("the attach stays open until the exit") {
            Message::Binary(bytes) => output.extend_from_slice(&bytes),
            Message::Text(text) => {
                let frame: serde_json::Value = serde_json::from_str(&text).unwrap();
                if frame.get("exit").is_some() {
                    return (String::from_utf8_lossy(&output).into_owned(), errors, frame["exit"].clone());
                }
                errors.push(frame["error"].clone());
            }
            Message::Close(_) => panic!("closed before the exit frame"),
            _ => {}
        }
    }
}

#[test]
fn input_a_command_was_not_started_for_is_refused_never_dropped() {
    use tungstenite::Message;

    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let commands = format!("/v1/sandboxes/{id}/commands");
    let auth = format!("Bearer {}", server.key);

    // Exec waits for the exit with nobody to type into its terminal (the
    // timeout only bounds this test if the request were accepted).
    let refused = server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"cmd": "read x", "tty": true, "timeout_s": 5})),
        400,
        "invalid_request",
    );
    assert!(refused["error"]["message"].as_str().unwrap().contains("terminal"), "{refused}");
    // A terminal is stdin: it cannot be had closed.
    server.error("POST", &commands, Some(json!({"argv": ["sh"], "tty": true, "stdin": false})), 422, "invalid_value");

    let sleeper = server.ok("POST", &commands, Some(json!({"argv": ["sleep", "60"]})));
    assert_eq!((&sleeper["command"]["stdin"], &sleeper["command"]["tty"]), (&json!(false), &json!(false)));
    let sleeper = sleeper["command"]["id"].as_str().unwrap().to_string();
    let cat = server.ok("POST", &commands, Some(json!({"argv": ["cat"], "stdin": true})));
    let cat = cat["command"]["id"].as_str().unwrap().to_string();

    let refusal = |path: String, headers: &[(&str, &str)], body: &str, why: &str| {
        let (status, answer) = server.raw("POST", &path, headers, Some(body));
        assert_eq!(status, 409, "{path}: {answer}");
        let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(answer["error"]["code"], "invalid_state", "{answer}");
        assert!(answer["error"]["message"].as_str().unwrap().contains(why), "{answer}");
    };
    let json_headers = [("Authorization", auth.as_str()), ("Content-Type", "application/json")];
    refusal(format!("{commands}/{sleeper}/stdin"), &[("Authorization", &auth)], "lost?\n", "without stdin");
    refusal(format!("{commands}/{sleeper}/stdin?eof=true"), &[("Authorization", &auth)], "", "without stdin");
    refusal(format!("{commands}/{sleeper}/resize"), &json_headers, r#"{"cols": 90, "rows": 20}"#, "without a terminal");
    refusal(format!("{commands}/{cat}/resize"), &json_headers, r#"{"cols": 90, "rows": 20}"#, "without a terminal");

    // Over the WebSocket, each such frame gets an error frame back and the
    // session goes on.
    let mut socket = attach_socket(&server, &id, &sleeper);
    socket.send(Message::Binary(b"lost?\n".to_vec().into())).unwrap();
    socket.send(Message::Text(r#"{"resize": {"cols": 90, "rows": 20}}"#.into())).unwrap();
    socket.send(Message::Text(r#"{"eof": true}"#.into())).unwrap();
    socket.send(Message::Text(r#"{"resise": {"cols": 90, "rows": 20}}"#.into())).unwrap();
    socket.send(Message::Text("eof".into())).unwrap();
    let mut read = 0;
    let mut codes = Vec::new();
    while read < 5 {
        match socket.read().expect("an answer to each refused frame") {
            Message::Text(text) => {
                let frame: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert!(frame["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{frame}");
                codes.push(frame["error"]["code"].as_str().unwrap().to_string());
                read += 1;
            }
            Message::Close(_) => panic!("closed instead of answering"),
            _ => {}
        }
    }
    assert_eq!(codes, ["invalid_state", "invalid_state", "invalid_state", "invalid_request", "invalid_request"]);
    // Killed only now, so the refusals cannot race the exit frame.
    let (status, _) =
        server.raw("POST", &format!("{commands}/{sleeper}/signal"), &json_headers, Some(r#"{"signal": "KILL"}"#));
    assert_eq!(status, 204);
    let (_, errors, exit) = read_to_exit(&mut socket);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(exit["signal"], "KILL", "{exit}");

    let mut socket = attach_socket(&server, &id, &cat);
    socket.send(Message::Text(r#"{"resize": {"cols": 90, "rows": 20}}"#.into())).unwrap();
    socket.send(Message::Binary(b"still here\n".to_vec().into())).unwrap();
    socket.send(Message::Text(r#"{"eof": true}"#.into())).unwrap();
    let (output, errors, exit) = read_to_exit(&mut socket);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["code"], "invalid_state");
    assert_eq!(output, "still here\n");
    assert_eq!(exit["exit_code"], 0, "{exit}");
}

#[test]
fn a_background_process_outlives_the_command_that_started_it() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let started = Instant::now();
    // No redirection: the background job still holds the command's output pipes.
    let run = server.exec(&id, json!({"cmd": "nohup sleep 30 & echo started $!"}));
    assert!(started.elapsed() < Duration::from_secs(5), "the command returned at once ({:?})", started.elapsed());
    assert_eq!(run["result"]["exit_code"], 0);
    let pid = run["stdout"].as_str().unwrap().trim().trim_start_matches("started ").to_string();
    let alive = server.exec(&id, json!({"cmd": format!("kill -0 {pid} && echo alive")}));
    assert_eq!(alive["stdout"], "alive\n", "the background process keeps running");
}

#[test]
fn many_readers_follow_the_same_command_and_get_the_same_bytes() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let created = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "for i in $(seq 1 200); do echo line-$i; done; sleep 0.5; seq 1 5000"})),
    );
    let cid = created["command"]["id"].as_str().unwrap().to_string();
    let readers: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            (0..4).map(|_| scope.spawn(|| text_of(&server.output(&id, &cid, "?follow=true"), "stdout"))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(readers[0].starts_with("line-1\n") && readers[0].ends_with("\n5000\n"), "{}", &readers[0][..40]);
    assert!(readers.iter().all(|r| *r == readers[0]), "every reader saw the same bytes");
}

#[test]
fn a_sandbox_reports_what_it_uses_with_a_short_history() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 512, "disk_mib": 1024}));
    // A busy loop and 64 MiB held in memory and written to disk.
    let started = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["python3", "-c",
            "import time\nblob = bytearray(64 << 20)\nopen('/root/blob', 'wb').write(blob)\nend = time.time() + 60\nwhile time.time() < end:\n    pass"]})),
    );
    let cid = started["command"]["id"].as_str().unwrap().to_string();
    let usage = space_testkit::wait_for("two samples while it is busy", space_testkit::PATIENCE, || {
        // The disk figure is btrfs's, updated as it commits: commit now.
        data.sync();
        let usage = server.ok("GET", &format!("/v1/sandboxes/{id}/metrics"), None);
        let busy = usage["history"].as_array().is_some_and(|h| h.len() >= 2)
            && usage["cpu_percent"].as_f64().unwrap_or(0.0) > 20.0
            && usage["disk_bytes"].as_u64().unwrap_or(0) >= 64 << 20;
        busy.then_some(usage)
    });
    assert_eq!(usage["state"], "running");
    assert!(usage["memory_bytes"].as_u64().unwrap() >= 64 << 20, "{usage}");
    assert_eq!(usage["memory_limit_bytes"], 512u64 << 20);
    assert_eq!(usage["disk_quota_bytes"], 1024u64 << 20);
    assert!(usage["cpu_seconds"].as_f64().unwrap() > 0.5, "{usage}");
    assert_eq!((usage["commands"].as_u64(), usage["commands_running"].as_u64()), (Some(1), Some(1)));
    let auth = format!("Bearer {}", server.key);
    let signal = format!("/v1/sandboxes/{id}/commands/{cid}/signal");
    let (status, _) = server.raw(
        "POST",
        &signal,
        &[("Authorization", &auth), ("Content-Type", "application/json")],
        Some(r#"{"signal": "KILL"}"#),
    );
    assert_eq!(status, 204);
    server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=30"), None);

    // Paused, it uses no CPU; its history stays.
    let paused = server.call("POST", &format!("/v1/sandboxes/{id}/pause"), None).1;
    server.wait_operation(paused["operation"]["id"].as_str().unwrap());
    let usage = server.ok("GET", &format!("/v1/sandboxes/{id}/metrics"), None);
    assert_eq!((usage["state"].as_str(), usage["cpu_percent"].as_f64()), (Some("paused"), Some(0.0)));
    assert!(!usage["history"].as_array().unwrap().is_empty());
    assert_eq!(usage["commands_running"], 0);
    server.error("GET", "/v1/sandboxes/sbx_00000000000000000000/metrics", None, 404, "not_found");
}
