//! Volumes (issue 37) on real gVisor sandboxes and real btrfs: storage that
//! outlives a sandbox, one writer and any number of readers, the size
//! quota inside, files without a sandbox, snapshots, links that never
//! leave the sandbox's (or the volume's) view, tenants, bad input, and
//! mounts across pause, suspend, resume and a server restart.

mod common;

use common::TestServer;
use serde_json::{json, Value};
use space_server::tenants::create_key;
use space_testkit::TestDataDir;

fn create_volume(server: &TestServer, name: &str, size_mib: u32) -> Value {
    let (status, volume) = server.call("POST", "/v1/volumes", Some(json!({"name": name, "size_mib": size_mib})));
    assert_eq!(status, 201, "{volume}");
    volume
}

fn put(server: &TestServer, volume: &str, path: &str, bytes: &[u8]) -> (u16, Vec<u8>) {
    let answer = server
        .client()
        .call_bytes("PUT", &format!("/v1/volumes/{volume}/files?path={path}"), &[], Some(bytes))
        .unwrap();
    (answer.status, answer.body)
}

fn get(server: &TestServer, volume: &str, path: &str) -> (u16, Vec<u8>) {
    let answer =
        server.client().call_bytes("GET", &format!("/v1/volumes/{volume}/files?path={path}"), &[], None).unwrap();
    (answer.status, answer.body)
}

fn sh(server: &TestServer, id: &str, cmd: &str) -> Value {
    server.exec(id, json!({"cmd": cmd}))
}

fn stdout(result: &Value) -> &str {
    result["stdout"].as_str().unwrap_or_default()
}

#[test]
fn data_written_by_one_sandbox_is_read_by_another_after_the_first_is_deleted() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "ws", 256);
    let a = server.create_sandbox(json!({"template": "base", "volumes": [{"name": "ws", "path": "/workspace"}]}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{a}"), None);
    assert_eq!(sandbox["volumes"], json!([{"name": "ws", "path": "/workspace", "read_only": false}]));
    let wrote = sh(&server, &a, "mkdir -p /workspace/src && echo 'print(6*7)' > /workspace/src/main.py && sync");
    assert_eq!(wrote["result"]["exit_code"], 0, "{wrote}");
    let volume = server.ok("GET", "/v1/volumes/ws", None);
    assert_eq!(volume["mounted_by"], json!([{"sandbox_id": a, "path": "/workspace", "read_only": false}]));
    assert_eq!(server.delete_sandbox(&a)["state"], "succeeded");
    assert_eq!(server.ok("GET", "/v1/volumes/ws", None)["mounted_by"], json!([]));

    // Read-only, twice at once: both read, neither may write.
    let mount = json!([{"name": "ws", "path": "/data", "read_only": true}]);
    let b = server.create_sandbox(json!({"template": "base", "volumes": mount}));
    let c = server.create_sandbox(json!({"template": "base", "volumes": mount}));
    for id in [&b, &c] {
        assert_eq!(stdout(&sh(&server, id, "python3 /data/src/main.py")), "42\n");
        let refused = sh(&server, id, "(echo x > /data/new) 2>&1; echo $?");
        assert!(stdout(&refused).contains("Read-only file system"), "{refused}");
    }
    assert_eq!(server.ok("GET", "/v1/volumes/ws", None)["mounted_by"].as_array().unwrap().len(), 2);
}

#[test]
fn a_volume_has_one_writer_and_nothing_removes_it_from_under_a_sandbox() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "ws", 64);
    let writer = server.create_sandbox(json!({"template": "base", "volumes": [{"name": "ws", "path": "/w"}]}));
    let sandboxes_before = server.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().len();

    let second = json!({"template": "base", "volumes": [{"name": "ws", "path": "/w"}]});
    let refused = server.error("POST", "/v1/sandboxes", Some(second), 409, "volume_in_use");
    assert_eq!(refused["error"]["details"]["sandbox_id"], writer, "{refused}");
    let refused = server.error("DELETE", "/v1/volumes/ws", None, 409, "volume_in_use");
    assert_eq!(refused["error"]["details"]["sandbox_id"], writer);
    let (status, body) = put(&server, "ws", "/x", b"x");
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
    let fork = server.error("POST", &format!("/v1/sandboxes/{writer}/fork"), Some(json!({})), 409, "volume_in_use");
    assert!(fork["error"]["message"].as_str().unwrap().contains("second writer"), "{fork}");
    server.ok("POST", "/v1/volumes/ws/snapshots", Some(json!({"name": "s1"})));
    server.error("POST", "/v1/volumes/ws/snapshots/s1/restore", None, 409, "volume_in_use");
    let template = json!({"name": "from-ws", "from": {"sandbox": writer}});
    let (status, refused) = server.call("POST", "/v1/templates", Some(template));
    assert_eq!((status, refused["error"]["code"].as_str()), (409, Some("not_supported")), "{refused}");
    // Nothing of the refusals was made.
    assert_eq!(server.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().len(), sandboxes_before);

    // Reading through the files routes goes on meanwhile.
    assert_eq!(sh(&server, &writer, "echo hi > /w/note")["result"]["exit_code"], 0);
    assert_eq!(get(&server, "ws", "/note"), (200, b"hi\n".to_vec()));
    // Once the writer is gone, another may write.
    assert_eq!(server.delete_sandbox(&writer)["state"], "succeeded");
    assert_eq!(put(&server, "ws", "/x", b"x").0, 201);
    server.ok("POST", "/v1/volumes/ws/snapshots/s1/restore", None);
    assert_eq!(get(&server, "ws", "/x").0, 404, "restored to before /x");
    server.call("DELETE", "/v1/volumes/ws", None);
}

#[test]
fn writes_past_the_size_fail_inside_and_through_the_files_routes() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "small", 16);
    let id = server.create_sandbox(json!({"template": "base", "volumes": [{"name": "small", "path": "/s"}]}));
    let full = sh(&server, &id, "dd if=/dev/zero of=/s/big bs=1M count=64 2>&1; echo exit=$?");
    assert!(stdout(&full).contains("Disk quota exceeded"), "{full}");
    assert!(!stdout(&full).contains("exit=0"), "{full}");
    // The sandbox's own root is not the volume's quota.
    assert_eq!(
        sh(&server, &id, "rm /s/big && dd if=/dev/zero of=/root/big bs=1M count=32 2>&1")["result"]["exit_code"],
        0
    );
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    let (status, body) = put(&server, "small", "/big", &vec![7u8; 32 << 20]);
    let error: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, error["error"]["code"].as_str()), (422, Some("io_error")), "{error}");
    assert_eq!(get(&server, "small", "/big").0, 404, "a write that failed leaves nothing");
}

#[test]
fn the_files_routes_work_without_a_sandbox_and_links_never_leave_the_volume() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "seed", 64);
    assert_eq!(put(&server, "seed", "/project/readme.md", b"# hello\n").0, 201);
    let (status, listing) = server.call("GET", "/v1/volumes/seed/files?path=/project", None);
    assert_eq!(status, 200);
    assert_eq!(listing["entries"][0]["name"], "readme.md");
    // A tar down and up again into another directory.
    let tar = server.client().call_bytes("GET", "/v1/volumes/seed/files?path=/project&format=tar", &[], None).unwrap();
    assert_eq!(tar.status, 200);
    let up = server
        .client()
        .call_bytes("PUT", "/v1/volumes/seed/files?path=/copy&format=tar", &[], Some(&tar.body))
        .unwrap();
    assert_eq!(up.status, 201, "{}", String::from_utf8_lossy(&up.body));
    assert_eq!(get(&server, "seed", "/copy/readme.md"), (200, b"# hello\n".to_vec()));
    server.error("DELETE", "/v1/volumes/seed/files?path=/copy", None, 409, "directory_not_empty");
    let (status, _) = server.call("DELETE", "/v1/volumes/seed/files?path=/copy&recursive=true", None);
    assert_eq!(status, 204);
    server.error("GET", "/v1/volumes/seed/files?path=relative", None, 400, "invalid_request");

    // A sandbox plants links to `/`, `..` and `/proc/1/root`.
    let id = server.create_sandbox(json!({"template": "base", "volumes": [{"name": "seed", "path": "/v"}]}));
    let planted = sh(&server, &id, "ln -s / /v/root && ln -s .. /v/up && ln -s /proc/1/root /v/init && echo ok");
    assert_eq!(stdout(&planted), "ok\n", "{planted}");
    // Inside, each resolves in the sandbox's own view.
    let hostname = stdout(&sh(&server, &id, "cat /etc/hostname")).to_string();
    assert_eq!(stdout(&sh(&server, &id, "cat /v/root/etc/hostname")), hostname);
    assert_eq!(stdout(&sh(&server, &id, "cat /v/up/etc/hostname")), hostname);
    let through_init = sh(&server, &id, "cat /v/init/etc/hostname 2>&1");
    assert!(!stdout(&through_init).contains(&read_host_hostname()), "{through_init}");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    // Through the files routes, inside the volume: the host's files are
    // not there, whatever the link says.
    assert!(std::path::Path::new("/etc/hostname").exists());
    for link in ["/root/etc/hostname", "/up/etc/hostname", "/init/etc/hostname", "/up/up/etc/passwd"] {
        let (status, body) = get(&server, "seed", link);
        assert_eq!(status, 404, "{link}: {}", String::from_utf8_lossy(&body));
    }
    let (status, listing) = server.call("GET", "/v1/volumes/seed/files?path=/root", None);
    assert_eq!(status, 200, "{listing}");
    let names: Vec<&str> = listing["entries"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"project") && !names.contains(&"etc"), "/root is the volume's root: {names:?}");
    // A write through a link lands inside the volume too.
    assert_eq!(put(&server, "seed", "/root/through-link", b"in").0, 201);
    assert_eq!(get(&server, "seed", "/through-link"), (200, b"in".to_vec()));
}

fn read_host_hostname() -> String {
    std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "no hostname file".into())
}

#[test]
fn snapshots_branch_a_workspace_cheaply() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "main", 64);
    assert_eq!(put(&server, "main", "/state", b"v1").0, 201);
    let (status, snapshot) = server.call("POST", "/v1/volumes/main/snapshots", Some(json!({"name": "s1"})));
    assert_eq!(status, 201, "{snapshot}");
    assert_eq!(put(&server, "main", "/state", b"v2").0, 201);
    server.error("POST", "/v1/volumes/main/snapshots", Some(json!({"name": "s1"})), 409, "already_exists");

    // A branch from the snapshot sees v1; the volume still has v2.
    let (status, branch) = server.call(
        "POST",
        "/v1/volumes",
        Some(json!({"name": "branch", "from_snapshot": {"volume": "main", "snapshot": "s1"}})),
    );
    assert_eq!(status, 201, "{branch}");
    assert_eq!(branch["from_snapshot"], json!({"volume": "main", "snapshot": "s1"}));
    assert_eq!(get(&server, "branch", "/state"), (200, b"v1".to_vec()));
    assert_eq!(get(&server, "main", "/state"), (200, b"v2".to_vec()));
    assert_eq!(put(&server, "branch", "/state", b"b1").0, 201);
    assert_eq!(get(&server, "main", "/state"), (200, b"v2".to_vec()), "the branch writes on its own");

    // Restore rolls the volume back; the snapshot stays.
    let restored = server.ok("POST", "/v1/volumes/main/snapshots/s1/restore", None);
    assert_eq!(restored["snapshots"][0]["name"], "s1");
    assert_eq!(get(&server, "main", "/state"), (200, b"v1".to_vec()));
    let listed = server.ok("GET", "/v1/volumes/main/snapshots", None);
    assert_eq!(listed["snapshots"].as_array().unwrap().len(), 1);
    server.error("POST", "/v1/volumes/main/snapshots/nope/restore", None, 404, "snapshot_not_found");
    let (status, _) = server.call("DELETE", "/v1/volumes/main/snapshots/s1", None);
    assert_eq!(status, 204);
    server.error("DELETE", "/v1/volumes/main/snapshots/s1", None, 404, "snapshot_not_found");
    // The branch made from it is its own.
    assert_eq!(get(&server, "branch", "/state"), (200, b"b1".to_vec()));
}

#[test]
fn another_tenant_cannot_see_mount_or_delete_a_volume() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let (_, a) = create_key(server.platform.store(), "team-a", None).unwrap();
    let (_, b) = create_key(server.platform.store(), "team-b", None).unwrap();
    let (status, _) = server.call_as(&a, "POST", "/v1/volumes", Some(json!({"name": "secret", "size_mib": 32})));
    assert_eq!(status, 201);
    let written =
        server.client_as(&a).call_bytes("PUT", "/v1/volumes/secret/files?path=/k", &[], Some(b"a's")).unwrap();
    assert_eq!(written.status, 201);
    for (method, path) in [
        ("GET", "/v1/volumes/secret"),
        ("DELETE", "/v1/volumes/secret"),
        ("GET", "/v1/volumes/secret/files?path=/k"),
        ("PUT", "/v1/volumes/secret/files?path=/k"),
        ("POST", "/v1/volumes/secret/snapshots"),
        ("GET", "/v1/volumes/secret/snapshots"),
    ] {
        let body = (method == "POST").then(|| json!({"name": "s"}));
        let (status, answer) = server.call_as(&b, method, path, body);
        assert_eq!((status, answer["error"]["code"].as_str()), (404, Some("volume_not_found")), "{method} {path}");
    }
    assert_eq!(server.call_as(&b, "GET", "/v1/volumes", None).1["volumes"], json!([]));
    let mount = json!({"template": "base", "volumes": [{"name": "secret", "path": "/s"}]});
    let (status, answer) = server.call_as(&b, "POST", "/v1/sandboxes", Some(mount));
    assert_eq!((status, answer["error"]["code"].as_str()), (404, Some("volume_not_found")), "{answer}");
    // B may have a volume of the same name: its own.
    let (status, _) = server.call_as(&b, "POST", "/v1/volumes", Some(json!({"name": "secret", "size_mib": 32})));
    assert_eq!(status, 201);
    let (status, body) = server
        .client_as(&b)
        .call_bytes("GET", "/v1/volumes/secret/files?path=/k", &[], None)
        .map(|a| (a.status, a.body))
        .unwrap();
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    let read = server.client_as(&a).call_bytes("GET", "/v1/volumes/secret/files?path=/k", &[], None).unwrap();
    assert_eq!((read.status, read.body), (200, b"a's".to_vec()));
}

#[test]
fn bad_input_is_a_clear_error_and_changes_nothing() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "ws", 32);
    assert_eq!(put(&server, "ws", "/keep", b"kept").0, 201);
    let cases = [
        (json!([{"name": "nope", "path": "/w"}]), 404, "volume_not_found"),
        (json!([{"name": "ws", "path": "relative"}]), 422, "invalid_value"),
        (json!([{"name": "ws", "path": "/"}]), 422, "invalid_value"),
        (json!([{"name": "ws", "path": "/proc"}]), 422, "invalid_value"),
        (json!([{"name": "ws", "path": "/proc/x"}]), 422, "invalid_value"),
        (json!([{"name": "ws", "path": "/sys"}]), 422, "invalid_value"),
        (json!([{"name": "ws", "path": "/a/../etc"}]), 422, "invalid_value"),
        (
            json!([{"name": "ws", "path": "/w", "read_only": true}, {"name": "ws", "path": "/w", "read_only": true}]),
            422,
            "invalid_value",
        ),
        (json!([{"name": "ws", "path": "/w", "shared": true}]), 400, "invalid_request"),
    ];
    for (volumes, status, code) in cases {
        let body = json!({"template": "base", "volumes": volumes});
        let (got, answer) = server.call("POST", "/v1/sandboxes", Some(body));
        assert_eq!((got, answer["error"]["code"].as_str()), (status, Some(code)), "{volumes}: {answer}");
    }
    assert_eq!(server.ok("GET", "/v1/sandboxes", None)["sandboxes"], json!([]));
    for (body, status, code) in [
        (json!({"name": "ws"}), 409, "name_taken"),
        (json!({"name": "Bad Name"}), 422, "invalid_value"),
        (json!({"name": "big", "size_mib": 0}), 422, "invalid_value"),
        (json!({"name": "x", "from_snapshot": {"volume": "ws", "snapshot": "none"}}), 404, "snapshot_not_found"),
        (json!({"name": "x", "size": 3}), 400, "invalid_request"),
    ] {
        server.error("POST", "/v1/volumes", Some(body), status, code);
    }
    server.error("GET", "/v1/volumes/nope", None, 404, "volume_not_found");
    let listed = server.ok("GET", "/v1/volumes", None);
    assert_eq!(listed["volumes"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(get(&server, "ws", "/keep"), (200, b"kept".to_vec()), "nothing changed");
}

#[test]
fn a_mount_survives_pause_suspend_resume_and_a_server_restart() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "ws", 64);
    let id = server.create_sandbox(json!({"template": "base", "volumes": [{"name": "ws", "path": "/ws"}]}));
    assert_eq!(sh(&server, &id, "echo one > /ws/f")["result"]["exit_code"], 0);
    for action in ["pause", "resume", "suspend", "resume"] {
        let accepted = server.ok("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
        let operation = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
        assert_eq!(operation["state"], "succeeded", "{action}: {operation}");
    }
    assert_eq!(stdout(&sh(&server, &id, "echo two >> /ws/f && cat /ws/f")), "one\ntwo\n");
    server.stop();

    let server = TestServer::start(&data);
    assert_eq!(stdout(&sh(&server, &id, "echo three >> /ws/f && cat /ws/f")), "one\ntwo\nthree\n");
    let volume = server.ok("GET", "/v1/volumes/ws", None);
    assert_eq!(volume["mounted_by"][0]["sandbox_id"], id, "{volume}");
    let second = json!({"template": "base", "volumes": [{"name": "ws", "path": "/ws"}]});
    server.error("POST", "/v1/sandboxes", Some(second), 409, "volume_in_use");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    assert_eq!(get(&server, "ws", "/f"), (200, b"one\ntwo\nthree\n".to_vec()));
}

/// The accepted operation of a lifecycle call, waited for; it succeeded.
fn succeeded(server: &TestServer, path: &str, body: Option<Value>) -> Value {
    let (status, accepted) = server.call("POST", path, body);
    assert_eq!(status, 202, "{path}: {accepted}");
    let operation = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    assert_eq!(operation["state"], "succeeded", "{path}: {operation}");
    accepted
}

#[test]
fn a_fork_shares_read_only_mounts_and_a_checkpoint_leaves_the_volume_as_it_is() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    create_volume(&server, "lib", 32);
    create_volume(&server, "ws", 32);
    assert_eq!(put(&server, "lib", "/version", b"1").0, 201);

    // A reader forks: the fork reads the same volume, read-only too.
    let mounts = json!([{"name": "lib", "path": "/lib-data", "read_only": true}]);
    let reader = server.create_sandbox(json!({"template": "base", "volumes": mounts}));
    let accepted = succeeded(&server, &format!("/v1/sandboxes/{reader}/fork"), Some(json!({})));
    let fork = accepted["sandboxes"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(accepted["sandboxes"][0]["volumes"], mounts);
    assert_eq!(stdout(&sh(&server, &fork, "cat /lib-data/version")), "1");
    let refused = sh(&server, &fork, "(echo 2 > /lib-data/version) 2>&1");
    assert!(stdout(&refused).contains("Read-only file system"), "{refused}");
    let holders = server.ok("GET", "/v1/volumes/lib", None)["mounted_by"].as_array().unwrap().len();
    assert_eq!(holders, 2, "the source and its fork");

    // A writer's checkpoint saves the sandbox, not the volume: a restore
    // finds the volume as it is now, still mounted and writable.
    let writer = server.create_sandbox(json!({"template": "base", "volumes": [{"name": "ws", "path": "/ws"}]}));
    assert_eq!(sh(&server, &writer, "echo before > /ws/f && echo before > /root/f")["result"]["exit_code"], 0);
    succeeded(&server, &format!("/v1/sandboxes/{writer}/checkpoints"), Some(json!({"name": "one"})));
    assert_eq!(sh(&server, &writer, "echo after > /ws/f && echo after > /root/f")["result"]["exit_code"], 0);
    succeeded(&server, &format!("/v1/sandboxes/{writer}/checkpoints/one/restore"), None);
    assert_eq!(stdout(&sh(&server, &writer, "cat /root/f")), "before\n", "the sandbox's own disk rolled back");
    assert_eq!(stdout(&sh(&server, &writer, "cat /ws/f")), "after\n", "the volume did not");
    assert_eq!(sh(&server, &writer, "echo again >> /ws/f")["result"]["exit_code"], 0);
    assert_eq!(server.delete_sandbox(&writer)["state"], "succeeded");
    assert_eq!(get(&server, "ws", "/f"), (200, b"after\nagain\n".to_vec()));
}
