//! Volumes from the CLI and MCP: files put and got without a sandbox,
//! a volume mounted by one sandbox and read after it is gone, snapshots,
//! and bad input shown as the server's clear error.

use space_testkit::TestDataDir;

use super::{mcp, mcp_ask, mcp_initialize, printed, serve, space};
use crate::common::stop;

/// A failed `space` call's stderr.
fn refused(out: space_process::Output) -> String {
    assert!(!out.status.success(), "expected a failure: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn volumes_from_the_cli_files_without_a_sandbox_and_a_mount_that_outlives_it() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let run = |args: &[&str]| space(&data, &url, args);
    let made: serde_json::Value =
        serde_json::from_str(&printed(run(&["volume", "create", "ws", "--size-mib", "64"]))).unwrap();
    assert_eq!((made["name"].as_str(), made["size_mib"].as_u64()), (Some("ws"), Some(64)), "{made}");

    // Files in and out, a file and a tree, no sandbox anywhere.
    let local = data.root().join("vol-local");
    std::fs::create_dir_all(local.join("tree/sub")).unwrap();
    std::fs::write(local.join("notes.txt"), "put without a sandbox\n").unwrap();
    std::fs::write(local.join("tree/sub/deep.txt"), "deep\n").unwrap();
    let path = |name: &str| local.join(name).to_str().unwrap().to_string();
    printed(run(&["cp", &path("notes.txt"), "vol:ws:/notes.txt"]));
    printed(run(&["cp", &path("tree"), "vol:ws:/tree"]));
    let listed = printed(run(&["volume", "ls", "ws"]));
    assert!(listed.contains("notes.txt") && listed.contains("tree"), "{listed}");
    assert!(printed(run(&["volume", "ls", "ws", "/tree/sub"])).contains("deep.txt"));
    printed(run(&["cp", "vol:ws:/notes.txt", &path("back.txt")]));
    assert_eq!(std::fs::read_to_string(local.join("back.txt")).unwrap(), "put without a sandbox\n");
    printed(run(&["cp", "vol:ws:/tree", &path("tree-back")]));
    assert_eq!(std::fs::read_to_string(local.join("tree-back/sub/deep.txt")).unwrap(), "deep\n");
    assert!(printed(run(&["volume", "list"])).lines().any(|l| l.starts_with("ws ")));

    // Mounted read-write by one sandbox: it reads what was put and writes
    // what is read after it is gone; nobody else writes meanwhile.
    let id = printed(run(&["sandbox", "create", "--quiet", "--volume", "ws:/workspace"])).trim().to_string();
    assert_eq!(printed(run(&["exec", &id, "--", "cat", "/workspace/notes.txt"])), "put without a sandbox\n");
    printed(run(&["exec", &id, "--", "sh", "-c", "echo from the sandbox > /workspace/out.txt"]));
    let got: serde_json::Value = serde_json::from_str(&printed(run(&["volume", "get", "ws"]))).unwrap();
    assert_eq!(got["mounted_by"][0]["sandbox_id"], id.as_str(), "{got}");
    assert!(printed(run(&["sandbox", "get", &id])).contains("\"/workspace\""));
    let second = refused(run(&["sandbox", "create", "--quiet", "--volume", "ws:/w"]));
    assert!(second.contains("volume_in_use") && second.contains("409"), "{second}");
    assert!(refused(run(&["volume", "delete", "ws"])).contains("volume_in_use"));
    assert!(refused(run(&["cp", &path("notes.txt"), "vol:ws:/again.txt"])).contains("volume_in_use"));
    printed(run(&["sandbox", "rm", &id]));
    printed(run(&["cp", "vol:ws:/out.txt", &path("out.txt")]));
    assert_eq!(std::fs::read_to_string(local.join("out.txt")).unwrap(), "from the sandbox\n");
    // Read-only mounts, any number, straight after.
    let readers: Vec<String> = (0..2)
        .map(|_| printed(run(&["sandbox", "create", "--quiet", "--volume", "ws:/data:ro"])).trim().to_string())
        .collect();
    for reader in &readers {
        assert_eq!(printed(run(&["exec", reader, "--", "cat", "/data/out.txt"])), "from the sandbox\n");
        for write in ["echo x > /data/new.txt", "echo x > /data/out.txt", "echo x >> /data/out.txt"] {
            let refused = run(&["exec", reader, "--", "sh", "-c", write]);
            assert!(!refused.status.success(), "a read-only mount refuses {write:?}");
        }
        assert_eq!(
            printed(run(&["exec", reader, "--", "cat", "/data/out.txt"])),
            "from the sandbox\n",
            "a refused write through a read-only mount leaves the file whole"
        );
    }
    // Between a sandbox and a volume, a file and a tree, through here.
    let reader = readers[0].as_str();
    printed(run(&["exec", reader, "--", "sh", "-c", "mkdir -p /root/made/sub && echo made > /root/made/sub/m.txt"]));
    printed(run(&["cp", &format!("{reader}:/root/made"), "vol:ws:/made"]));
    printed(run(&["cp", &format!("{reader}:/root/made/sub/m.txt"), "vol:ws:/m.txt"]));
    assert_eq!(printed(run(&["exec", reader, "--", "cat", "/data/made/sub/m.txt", "/data/m.txt"])), "made\nmade\n");
    printed(run(&["cp", "vol:ws:/tree", &format!("{reader}:/root/tree")]));
    assert_eq!(printed(run(&["exec", reader, "--", "cat", "/root/tree/sub/deep.txt"])), "deep\n");
    for reader in &readers {
        printed(run(&["sandbox", "rm", reader]));
    }

    // Snapshots: taken, restored over a change, branched into a new volume.
    assert!(printed(run(&["volume", "snapshot", "create", "ws", "first"])).contains("\"first\""));
    assert!(printed(run(&["volume", "snapshot", "list", "ws"])).lines().any(|l| l.starts_with("first ")));
    printed(run(&["volume", "rm", "ws", "/notes.txt"]));
    printed(run(&["volume", "rm", "ws", "/tree", "--recursive"]));
    assert!(!printed(run(&["volume", "ls", "ws"])).contains("notes.txt"));
    printed(run(&["volume", "snapshot", "restore", "ws", "first"]));
    assert!(printed(run(&["volume", "ls", "ws"])).contains("notes.txt"));
    printed(run(&["volume", "create", "branch", "--from-snapshot", "ws/first"]));
    assert!(printed(run(&["volume", "ls", "branch", "/tree/sub"])).contains("deep.txt"));
    printed(run(&["volume", "snapshot", "delete", "ws", "first"]));
    assert!(!printed(run(&["volume", "snapshot", "list", "ws"])).contains("first"));

    // Bad input: the server's error, clearly, and nothing made.
    assert!(refused(run(&["volume", "get", "nope"])).contains("volume_not_found"));
    assert!(refused(run(&["cp", &path("notes.txt"), "vol:nope:/x"])).contains("volume_not_found"));
    assert!(refused(run(&["sandbox", "create", "--volume", "nope:/w"])).contains("volume_not_found"));
    assert!(refused(run(&["volume", "snapshot", "restore", "ws", "nope"])).contains("snapshot_not_found"));
    assert!(refused(run(&["volume", "create", "again", "--from-snapshot", "ws/nope"])).contains("snapshot_not_found"));
    for bad in ["ws:relative/path", "ws:/", "ws:/proc/x"] {
        let stderr = refused(run(&["sandbox", "create", "--volume", bad]));
        assert!(stderr.contains("HTTP 422") || stderr.contains("HTTP 400"), "{bad}: {stderr}");
    }
    let twice = refused(run(&["sandbox", "create", "--volume", "ws:/a:ro", "--volume", "branch:/a:ro"]));
    assert!(twice.contains("HTTP 422") || twice.contains("HTTP 400"), "{twice}");
    assert!(refused(run(&["sandbox", "create", "--volume", "ws"])).contains("NAME:/PATH"));
    assert!(refused(run(&["cp", &path("notes.txt"), "vol:ws:relative"])).contains("vol:NAME:/absolute/path"));
    assert!(refused(run(&["volume", "create", "ws"])).contains("name_taken"));
    assert!(refused(run(&["volume", "move", "ws", "--node", "n1"])).contains("not_in_cluster_mode"));
    let sandboxes = printed(run(&["sandbox", "ls", "--state", "running"]));
    assert_eq!(sandboxes.lines().count(), 1, "no sandbox was made by bad input: {sandboxes}");
    printed(run(&["volume", "delete", "branch"]));
    printed(run(&["volume", "delete", "ws"]));
    assert!(!printed(run(&["volume", "list"])).lines().any(|l| l.starts_with("ws ")));
    stop(server);
}

#[test]
fn mcp_makes_mounts_snapshots_and_deletes_volumes() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let (child, mut stdin, mut lines) = mcp(&data, &url);
    let mut ask =
        |id: u64, method: &str, params: serde_json::Value| mcp_ask(&mut stdin, &mut lines, id, method, params);
    ask(1, "initialize", mcp_initialize());
    let tools = ask(2, "tools/list", serde_json::json!({}));
    let names: Vec<&str> =
        tools["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    for expected in ["volume_create", "volume_list", "volume_delete", "volume_snapshot"] {
        assert!(names.contains(&expected), "{expected} in {names:?}");
    }
    let mut call = |n: u64, tool: &str, args: serde_json::Value| {
        let answer = ask(n, "tools/call", serde_json::json!({"name": tool, "arguments": args}));
        let text = answer["result"]["content"][0]["text"].as_str().unwrap_or_default().to_string();
        (answer["result"]["isError"] == true, text)
    };
    let (failed, made) = call(3, "volume_create", serde_json::json!({"name": "mcp-ws", "size_mib": 32}));
    assert!(!failed, "{made}");
    let (failed, created) =
        call(4, "create_sandbox", serde_json::json!({"volumes": [{"name": "mcp-ws", "path": "/workspace"}]}));
    assert!(!failed, "{created}");
    let sandbox: serde_json::Value = serde_json::from_str(&created).unwrap();
    let id = sandbox["id"].as_str().unwrap().to_string();
    assert_eq!(sandbox["volumes"][0]["path"], "/workspace", "{sandbox}");
    let (failed, ran) =
        call(5, "run_command", serde_json::json!({"sandbox_id": id, "command": "echo kept > /workspace/kept.txt"}));
    assert!(!failed, "{ran}");
    let (failed, busy) = call(6, "volume_delete", serde_json::json!({"name": "mcp-ws"}));
    assert!(failed && busy.contains("volume_in_use"), "{busy}");
    let (failed, _) = call(7, "delete_sandbox", serde_json::json!({"sandbox_id": id}));
    assert!(!failed);
    let (failed, snapshot) = call(8, "volume_snapshot", serde_json::json!({"volume": "mcp-ws", "name": "s1"}));
    assert!(!failed && snapshot.contains("\"s1\""), "{snapshot}");
    let (failed, branch) = call(
        9,
        "volume_create",
        serde_json::json!({"name": "mcp-branch", "from_snapshot": {"volume": "mcp-ws", "snapshot": "s1"}}),
    );
    assert!(!failed, "{branch}");
    let (failed, reader) = call(
        10,
        "create_sandbox",
        serde_json::json!({"volumes": [{"name": "mcp-branch", "path": "/data", "read_only": true}]}),
    );
    assert!(!failed, "{reader}");
    let reader = serde_json::from_str::<serde_json::Value>(&reader).unwrap()["id"].as_str().unwrap().to_string();
    let (_, read) = call(11, "read_file", serde_json::json!({"sandbox_id": reader, "path": "/data/kept.txt"}));
    assert_eq!(read, "kept\n");
    call(12, "delete_sandbox", serde_json::json!({"sandbox_id": reader}));
    let (failed, listed) = call(13, "volume_list", serde_json::json!({}));
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert!(!failed);
    let ws = listed.as_array().unwrap().iter().find(|v| v["name"] == "mcp-ws").expect("mcp-ws listed");
    assert_eq!(ws["snapshots"], serde_json::json!(["s1"]), "{listed}");
    for (n, volume) in [(14, "mcp-branch"), (15, "mcp-ws")] {
        let (failed, text) = call(n, "volume_delete", serde_json::json!({"name": volume}));
        assert!(!failed, "{text}");
    }
    let (failed, missing) = call(16, "volume_delete", serde_json::json!({"name": "mcp-ws"}));
    assert!(failed && missing.contains("volume_not_found"), "{missing}");
    let (failed, bad) =
        call(17, "create_sandbox", serde_json::json!({"volumes": [{"name": "mcp-ws", "path": "relative"}]}));
    assert!(failed, "{bad}");
    drop(stdin);
    assert!(child.wait_timeout(std::time::Duration::from_secs(10)).is_some_and(|s| s.success()), "mcp ends");
    stop(server);
}

/// A reader cannot change a volume: a shell's `>` (open with O_TRUNC)
/// and `>>` on a read-only mount are refused and the file stays whole,
/// inside and on the host.
#[test]
fn a_refused_write_through_a_read_only_mount_leaves_the_file_whole() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let run = |args: &[&str]| space(&data, &url, args);
    let local = data.root().join("whole.txt");
    std::fs::write(&local, "seventeen bytes!\n").unwrap();
    printed(run(&["volume", "create", "ws", "--size-mib", "16"]));
    printed(run(&["cp", local.to_str().unwrap(), "vol:ws:/whole.txt"]));
    let reader = printed(run(&["sandbox", "create", "--quiet", "--volume", "ws:/data:ro"])).trim().to_string();
    for write in ["echo x > /data/whole.txt", "echo x >> /data/whole.txt", "truncate -s 0 /data/whole.txt"] {
        let refused = run(&["exec", &reader, "--", "sh", "-c", &format!("({write}) 2>&1")]);
        assert!(!refused.status.success(), "a read-only mount refuses {write:?}");
        assert!(String::from_utf8_lossy(&refused.stdout).contains("Read-only file system"), "{write:?}");
        let inside = printed(run(&["exec", &reader, "--", "cat", "/data/whole.txt"]));
        assert_eq!(inside, "seventeen bytes!\n", "after {write:?}, inside");
        let back = data.root().join("back.txt");
        printed(run(&["cp", "vol:ws:/whole.txt", back.to_str().unwrap()]));
        assert_eq!(std::fs::read_to_string(&back).unwrap(), "seventeen bytes!\n", "after {write:?}, on the host");
    }
    printed(run(&["sandbox", "rm", &reader]));
    printed(run(&["volume", "delete", "ws"]));
    stop(server);
}
