//! The privilege split end to end: `space helper` (root) beside `space
//! serve --helper-socket --user` (a user of its own, confined). Every engine
//! path is taken through the confined server, and after each the server's
//! `/proc/PID/status` must still show no capabilities, `no_new_privs` and a
//! seccomp filter; then a "compromised" server talks to the helper directly
//! with hostile requests, and each is refused without harm.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use space_api::OperationState;
use space_client::Client;
use space_process::ReapedChild;
use space_testkit::{wait_until, TestDataDir, PATIENCE};

/// What `/proc/PID/status` says of a process's privileges.
#[derive(Debug, PartialEq, Eq)]
struct Privileges {
    uids: String,
    cap_eff: String,
    cap_prm: String,
    no_new_privs: String,
    seccomp: String,
}

fn privileges(pid: u32) -> Privileges {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process runs");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(':')))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    Privileges {
        uids: field("Uid"),
        cap_eff: field("CapEff"),
        cap_prm: field("CapPrm"),
        no_new_privs: field("NoNewPrivs"),
        seccomp: field("Seccomp"),
    }
}

/// The helper and the confined server over one data dir.
struct Split {
    helper: ReapedChild,
    server: ReapedChild,
    socket: PathBuf,
    client: Client,
    uid: u32,
    gid: u32,
}

impl Split {
    fn start(data: &TestDataDir, extra: &[&str]) -> Split {
        let (uid, gid) = common::test_user();
        let socket = data.root().join("run").join("helper.sock");
        let helper = common::spawn_helper(data, &socket, uid);
        let socket_arg = socket.to_str().unwrap().to_string();
        let mut args =
            vec!["--dev", "--listen", "127.0.0.1:0", "--helper-socket", &socket_arg, "--user", common::TEST_USER];
        args.extend_from_slice(extra);
        let (server, url, _, lines) = common::spawn_server(data, &args);
        std::thread::spawn(move || lines.for_each(drop));
        let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap();
        let client = Client::new(&url, key.trim());
        Split { helper, server, socket, client, uid, gid }
    }

    /// The server is confined right now: its user, no capability, no way
    /// to gain one, its seccomp filter on.
    fn assert_confined(&self, after: &str) {
        let seen = privileges(self.server.id());
        let uid = self.uid.to_string();
        let expected = Privileges {
            uids: [uid.as_str(); 4].join(" "),
            cap_eff: "0000000000000000".into(),
            cap_prm: "0000000000000000".into(),
            no_new_privs: "1".into(),
            seccomp: "2".into(),
        };
        assert_eq!(seen, expected, "the server after {after}");
    }

    fn operation(&self, accepted: &space_api::Operation) -> space_api::Operation {
        let done = self.client.wait_for_operation_within(&accepted.id, Duration::from_secs(60)).unwrap();
        assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
        done
    }

    fn exec(&self, id: &str, argv: &[&str]) -> Value {
        self.client.post(&format!("/v1/sandboxes/{id}/exec"), &json!({"argv": argv})).unwrap()
    }

    /// Posts `body` to `path` and waits for the operation it starts.
    fn lifecycle(&self, path: &str, body: Value) -> space_api::Operation {
        let answer = self.client.post(path, &body).unwrap();
        let accepted: space_api::Operation = serde_json::from_value(answer["operation"].clone()).unwrap();
        self.operation(&accepted)
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        for child in [&self.server, &self.helper] {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = self.server.wait_timeout(Duration::from_secs(20));
        let _ = self.helper.wait_timeout(Duration::from_secs(20));
    }
}

/// An HTTP server on loopback standing in for the internet.
fn upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut stream = stream;
                let _ = stream.set_read_timeout(Some(PATIENCE));
                let mut head = [0u8; 4096];
                let n = stream.read(&mut head).unwrap_or(0);
                let line = String::from_utf8_lossy(&head[..n]).lines().next().unwrap_or_default().to_string();
                let body = format!("upstream saw {line}");
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    port
}

#[test]
fn a_confined_server_beside_the_root_helper_serves_every_engine_path() {
    let data = TestDataDir::new();
    let port = upstream();
    let split =
        Split::start(&data, &["--egress-host", "up.space.test=127.0.0.1", "--egress-allow-internal", "127.0.0.1/32"]);
    split.assert_confined("start");
    assert_eq!(privileges(split.helper.id()).uids, "0 0 0 0", "the helper is root");

    // Create, exec, files.
    let allow = format!("up.space.test:{port}");
    let create = json!({"template": "base", "network": {"egress": "allowlist", "allow": [allow]}});
    let done = split.lifecycle("/v1/sandboxes", create);
    let id = done.sandbox_id.clone().expect("the sandbox's id");
    split.assert_confined("create");
    let ran = split.exec(&id, &["sh", "-c", "echo kept > /root/kept; id -u"]);
    assert_eq!(ran["stdout"], "0\n", "{ran}");
    split.assert_confined("exec");
    split.client.upload_bytes(&id, "/root/hello.txt", b"from the host").unwrap();
    let mut read = Vec::new();
    split.client.download(&id, "/root/hello.txt", &mut read).unwrap();
    assert_eq!(read, b"from the host");
    split.assert_confined("files");

    // Egress: the gateway in the confined server dials the upstream.
    let get = format!("import urllib.request\nprint(urllib.request.urlopen('http://up.space.test:{port}/x', timeout=20).read().decode())");
    let ran = split.exec(&id, &["python3", "-c", &get]);
    assert_eq!(ran["stdout"], "upstream saw GET /x HTTP/1.1\n", "{ran}");
    split.assert_confined("egress");

    // Pause, suspend, resume.
    for (path, state) in [("pause", "paused"), ("resume", "running"), ("suspend", "suspended"), ("resume", "running")] {
        split.lifecycle(&format!("/v1/sandboxes/{id}/{path}"), json!({}));
        let sandbox = split.client.get(&format!("/v1/sandboxes/{id}")).unwrap();
        assert_eq!(sandbox["state"], state, "{sandbox}");
        split.assert_confined(path);
    }
    assert_eq!(split.exec(&id, &["cat", "/root/kept"])["stdout"], "kept\n");

    // Fork, checkpoint, restore, delete a checkpoint.
    let done = split.lifecycle(&format!("/v1/sandboxes/{id}/fork"), json!({"count": 1}));
    let fork = done.forks[0].clone();
    assert_eq!(split.exec(&fork, &["cat", "/root/kept"])["stdout"], "kept\n");
    split.assert_confined("fork");
    let images = data.root().join("sandboxes").join(&id).join("images");
    let left: Vec<_> = std::fs::read_dir(&images).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "the fork's image is dropped through the helper: {left:?}");
    split.lifecycle(&format!("/v1/sandboxes/{id}/checkpoints"), json!({"name": "before"}));
    split.exec(&id, &["sh", "-c", "echo changed > /root/kept"]);
    split.lifecycle(&format!("/v1/sandboxes/{id}/checkpoints/before/restore"), json!({}));
    assert_eq!(split.exec(&id, &["cat", "/root/kept"])["stdout"], "kept\n");
    split.assert_confined("checkpoint and restore");
    split.client.delete_empty(&format!("/v1/sandboxes/{id}/checkpoints/before")).unwrap();
    assert!(!data.root().join("sandboxes").join(&id).join("checkpoints").join("before").exists());
    split.assert_confined("deleting a checkpoint");

    // What the server wrote is its user's; what the engine made, root's.
    let owner = |path: &Path| std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(path).unwrap());
    assert_eq!(owner(&data.root().join("state").join("space.db")), split.uid);
    assert_eq!(owner(&data.root().join("sandboxes").join(&id).join("rootfs")), 0);

    for sandbox in [&id, &fork] {
        let answer = split.client.delete(&format!("/v1/sandboxes/{sandbox}")).unwrap();
        let accepted: space_api::Operation = serde_json::from_value(answer["operation"].clone()).unwrap();
        split.operation(&accepted);
        assert!(!data.root().join("sandboxes").join(sandbox.as_str()).exists(), "{sandbox}'s root is gone");
    }
    split.assert_confined("delete");
}

/// What the helper answers a client of `uid`:`gid` (root when None) that
/// sends `frames` one by one, each after the previous reply: each reply's
/// body, or `closed`. The client is a process of its own (`setpriv`), so
/// this one stays root.
fn ask_helper_as(socket: &Path, ids: Option<(u32, u32)>, frames: &[Vec<u8>]) -> Vec<String> {
    const CLIENT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("cannot connect:", e.strerror)
    sys.exit(0)
def read(n):
    got = b""
    while len(got) < n:
        more = s.recv(n - len(got))
        if not more:
            return None
        got += more
    return got
for frame in sys.argv[2:]:
    try:
        s.sendall(bytes.fromhex(frame))
        header = read(4)
    except OSError:
        header = None
    body = header and read(int.from_bytes(header, "big"))
    if body is None:
        print("closed")
        break
    print(body.decode())
"#;
    let mut command = match ids {
        Some((uid, gid)) => {
            let mut command = Command::new("setpriv");
            command.args([format!("--reuid={uid}"), format!("--regid={gid}"), "--clear-groups".into()]);
            command.arg("/usr/bin/python3");
            command
        }
        None => Command::new("/usr/bin/python3"),
    };
    command.args(["-c", CLIENT]).arg(socket);
    command.args(frames.iter().map(|frame| frame.iter().map(|b| format!("{b:02x}")).collect::<String>()));
    let output = space_testkit::output_within(&mut command, Duration::from_secs(60));
    String::from_utf8_lossy(&output.stdout).lines().map(str::to_string).collect()
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(body);
    frame
}

fn request(value: Value) -> Vec<u8> {
    frame(value.to_string().as_bytes())
}

#[test]
fn a_compromised_server_gets_nothing_from_the_helper_but_its_own_sandboxes_work() {
    let data = TestDataDir::new();
    let split = Split::start(&data, &[]);
    let victim = split.lifecycle("/v1/sandboxes", json!({"template": "base"})).sandbox_id.expect("its id");
    let hello = request(json!({"op": "hello", "version": space_privsep::proto::PROTOCOL_VERSION, "engine": "gvisor"}));
    let me = Some((split.uid, split.gid));
    let shape = json!({"memory_mib": 512, "vcpus": 1, "disk_mib": 1024});
    let template = json!({"kind": "template", "template": {"name": "base", "version": 1}});

    // Each hostile request is answered with a refusal naming why.
    let hostile = [
        ("a ../ id", json!({"op": "destroy", "sandbox": "../../etc"})),
        ("an id not in canonical form", json!({"op": "pause", "sandbox": "SBX_0123456789ABCDEF0123"})),
        ("a path where an id goes", json!({"op": "state", "sandbox": "/var/lib/space/sandboxes/x"})),
        (
            "another data dir's template",
            json!({"op": "start", "sandbox": "sbx_00000000000000000001", "engine": "gvisor",
            "from": {"kind": "template", "template": {"name": "../../other/templates/base", "version": 1}}, "shape": shape}),
        ),
        (
            "a huge memory size",
            json!({"op": "start", "sandbox": "sbx_00000000000000000002", "engine": "gvisor",
            "from": template, "shape": {"memory_mib": 4_000_000_000u64, "vcpus": 1, "disk_mib": 1024}}),
        ),
        ("an unknown field", json!({"op": "pause", "sandbox": victim, "and_also": "/"})),
        (
            "a start over another sandbox's root",
            json!({"op": "start", "sandbox": victim, "engine": "gvisor",
            "from": {"kind": "template", "template": {"name": "base", "version": 1}}, "shape": shape}),
        ),
        (
            "another sandbox's image over its root",
            json!({"op": "start", "sandbox": victim, "engine": "gvisor",
            "from": {"kind": "image", "source": "sbx_00000000000000000003",
                "image": {"kind": "fork", "operation": "op_00000000000000000001"}}, "shape": shape}),
        ),
        ("a layer chain by a path", json!({"op": "delete_layer", "chain": "../../templates/base"})),
        (
            "a layer without the log and blob it must carry",
            json!({"op": "apply_layer", "parent": "0".repeat(64),
            "layer": {"kind": "blob", "digest": format!("sha256:{}", "1".repeat(64)), "diff_id": null},
            "disk_mib": 64}),
        ),
        (
            "a template of a chain, without its log",
            json!({"op": "build_template", "template": {"name": "hostile", "version": 1},
            "source": {"kind": "layers", "top": "2".repeat(64)}, "disk_mib": 64}),
        ),
    ];
    for (what, body) in hostile {
        let said = ask_helper_as(&split.socket, me, &[hello.clone(), request(body)]);
        assert!(said.len() == 2 && said[0].contains("hello"), "{what}: {said:?}");
        let reply: Value = serde_json::from_str(&said[1]).unwrap_or_else(|_| json!({"raw": said[1]}));
        assert!(reply["refusal"].is_string() || said[1] == "closed", "{what} is refused: {said:?}");
    }
    // Build sandboxes: a layer is kept only of a stopped sandbox the
    // helper itself started on that chain, and only chains it has start.
    let layer_abuse = [
        (
            "a layer of a running sandbox",
            json!({"op": "save_layer", "sandbox": victim, "parent": "3".repeat(64), "key": "4".repeat(64)}),
            "is running",
        ),
        (
            "a layer of a sandbox never started from a chain",
            json!({"op": "save_layer", "sandbox": "sbx_00000000000000000004", "parent": "3".repeat(64),
            "key": "4".repeat(64)}),
            "was not started from a layer chain",
        ),
        (
            "a build sandbox on a chain that is not in the cache",
            json!({"op": "start", "sandbox": "sbx_00000000000000000005", "engine": "gvisor",
            "from": {"kind": "layer", "chain": "3".repeat(64)}, "shape": shape}),
            "is not in the cache",
        ),
    ];
    for (what, body, why) in layer_abuse {
        let said = ask_helper_as(&split.socket, me, &[hello.clone(), request(body)]);
        let reply: Value = serde_json::from_str(said.get(1).map_or("", String::as_str)).unwrap_or_default();
        assert!(reply["message"].as_str().is_some_and(|message| message.contains(why)), "{what}: {said:?}");
    }
    let chains = std::fs::read_dir(data.root().join("cache/layers")).map_or(0, |entries| entries.count());
    assert_eq!(chains, 0, "a refused save keeps no chain");
    assert!(!data.root().join("sandboxes/sbx_00000000000000000005").exists(), "a refused start leaves nothing");
    // A frame claiming 4 GiB is refused from its header, before any of it
    // is read; one not in JSON closes the connection.
    let said = ask_helper_as(&split.socket, me, &[hello.clone(), u32::MAX.to_be_bytes().to_vec()]);
    assert!(said.len() == 2 && (said[1].contains("refus") || said[1] == "closed"), "{said:?}");
    let said = ask_helper_as(&split.socket, me, &[hello.clone(), frame(b"{not json")]);
    assert!(said.len() == 2 && (said[1].contains("refus") || said[1] == "closed"), "{said:?}");

    // Nobody but the server's user gets as far as a hello: not root, not
    // another user.
    // Root passes the socket's mode and is turned away by its credentials;
    // anyone else cannot open the socket.
    let said = ask_helper_as(&split.socket, None, std::slice::from_ref(&hello));
    assert_eq!(said, ["closed"], "root is refused");
    let said = ask_helper_as(&split.socket, Some((65534, 65534)), std::slice::from_ref(&hello));
    assert_eq!(said, ["cannot connect: Permission denied"], "nobody is refused");

    // The victim still runs, its root untouched, and the helper still
    // serves the server.
    let root = data.root().join("sandboxes").join(&victim).join("rootfs");
    assert!(root.join("etc").join("os-release").exists(), "the victim's root is whole");
    assert_eq!(split.exec(&victim, &["true"])["result"]["exit_code"], 0);
    let sandbox = split.client.get(&format!("/v1/sandboxes/{victim}")).unwrap();
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    split.assert_confined("the hostile requests");
}

/// Template work crosses the helper too: a confined server makes snapshot
/// templates of a sandbox and of a checkpoint (the helper makes, fills and
/// publishes the build dir), imports an OCI archive (the helper reads the
/// descriptor the server opened), builds a Debian template, starts
/// sandboxes from them, reclaims an old version and deletes templates,
/// none of which it could do itself (`templates/` is read-only to it).
#[test]
fn a_confined_server_makes_and_deletes_templates_through_the_helper() {
    let data = TestDataDir::new();
    let registry = space_testkit::registry::Registry::start(None);
    space_testkit::images::push_app_image(&registry, "team/app", "1", None);
    let split = Split::start(&data, &["--insecure-registry", &registry.host]);
    let templates = data.root().join("templates");
    let owner = |path: &Path| std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(path).unwrap());
    let source = split.lifecycle("/v1/sandboxes", json!({"template": "base"})).sandbox_id.expect("its id");
    split.exec(&source, &["sh", "-c", "echo first > /root/kept"]);

    // A snapshot template of the running sandbox, and a sandbox of it.
    split.lifecycle("/v1/templates", json!({"name": "snap", "from": {"sandbox": source}}));
    split.assert_confined("a snapshot template of a sandbox");
    assert_eq!(owner(&templates.join("snap/1/template.json")), 0, "the helper wrote the record");
    assert!(!templates.join("snap/.1.partial").exists());
    let of_snap = split.lifecycle("/v1/sandboxes", json!({"template": "snap"})).sandbox_id.expect("its id");
    assert_eq!(split.exec(&of_snap, &["cat", "/root/kept"])["stdout"], "first\n");
    split.assert_confined("a sandbox of a snapshot template");

    // One of a checkpoint: the helper copies the checkpoint's image.
    split.lifecycle(&format!("/v1/sandboxes/{source}/checkpoints"), json!({"name": "c1"}));
    split.exec(&source, &["sh", "-c", "echo second > /root/kept"]);
    let checkpoint = json!({"name": "snapc", "from": {"checkpoint": {"sandbox": source, "name": "c1"}}});
    split.lifecycle("/v1/templates", checkpoint);
    split.assert_confined("a snapshot template of a checkpoint");
    let of_checkpoint = split.lifecycle("/v1/sandboxes", json!({"template": "snapc"})).sandbox_id.expect("its id");
    assert_eq!(split.exec(&of_checkpoint, &["cat", "/root/kept"])["stdout"], "first\n");

    // A second version of snap; the first is reclaimed (through the helper)
    // once its last sandbox is gone.
    split.lifecycle("/v1/templates", json!({"name": "snap", "from": {"sandbox": source}}));
    assert!(templates.join("snap/2/template.json").exists());
    assert!(templates.join("snap/1").exists(), "a sandbox still uses version 1");
    for sandbox in [&of_snap, &of_checkpoint, &source] {
        let answer = split.client.delete(&format!("/v1/sandboxes/{sandbox}")).unwrap();
        split.operation(&serde_json::from_value(answer["operation"].clone()).unwrap());
    }
    wait_until("snap's old version reclaimed", PATIENCE, || !templates.join("snap/1").exists());
    split.assert_confined("reclaiming an old version");

    // An OCI archive: the server opens the upload and the build's log and
    // hands both to the helper, which reads and writes only those.
    let archive = std::fs::read(common::busybox_image(data.root())).unwrap();
    let import = |name: &str, archive: &[u8]| {
        let path = format!("/v1/templates?name={name}");
        let (status, body) = split.client.post_bytes(&path, &[("content-type", "application/x-tar")], archive).unwrap();
        assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
        let accepted: Value = serde_json::from_slice(&body).unwrap();
        let id = accepted["operation"]["id"].as_str().unwrap().to_string();
        (split.client.wait_for_operation_within(&id, Duration::from_secs(60)).unwrap(), id)
    };
    let (imported, operation) = import("img", &archive);
    assert_eq!(imported.state, OperationState::Succeeded, "{imported:?}");
    split.assert_confined("an OCI import");
    assert_eq!(owner(&templates.join("img/1/rootfs")), 0);
    assert_eq!(owner(&data.root().join("logs").join(format!("{operation}.log"))), split.uid, "the server's log");
    let of_image = split.lifecycle("/v1/sandboxes", json!({"template": "img"})).sandbox_id.expect("its id");
    assert_eq!(split.exec(&of_image, &["sh", "-c", "pwd; cat hello.txt"])["stdout"], "/srv\nfrom the image\n");
    let answer = split.client.delete(&format!("/v1/sandboxes/{of_image}")).unwrap();
    split.operation(&serde_json::from_value(answer["operation"].clone()).unwrap());
    let (broken, operation) = import("broken", &[7u8; 4096]);
    assert_eq!(broken.state, OperationState::Failed, "{broken:?}");
    let told = broken.error.expect("why").message;
    assert!(told.contains("not a tar archive"), "the input's fault is told: {told}");
    let log = std::fs::read_to_string(data.root().join("logs").join(format!("{operation}.log"))).unwrap();
    assert!(log.contains("import failed: the upload is not a tar archive"), "{log}");
    assert!(!templates.join("broken").exists(), "a failed import leaves nothing");
    split.assert_confined("a failed OCI import");

    // A registry image: the confined server downloads and checks each
    // layer, the helper applies it onto a layer chain through the importer
    // child and makes the template a snapshot of the top chain.
    let pull = json!({"name": "pulled", "from": {"image": format!("{}/team/app:1", registry.host)}});
    let answer = split.client.post("/v1/templates", &pull).unwrap();
    let operation = answer["operation"]["id"].as_str().unwrap().to_string();
    let pulled = split.client.wait_for_operation_within(&operation, Duration::from_secs(120)).unwrap();
    assert_eq!(pulled.state, OperationState::Succeeded, "{pulled:?}");
    split.assert_confined("a registry pull");
    let chains = data.root().join("cache/layers");
    assert_eq!(owner(&chains), 0, "the layer cache is the helper's");
    assert_eq!(std::fs::read_dir(&chains).unwrap().count(), 2, "one chain per layer");
    assert_eq!(owner(&data.root().join("logs").join(format!("{operation}.log"))), split.uid, "the server's log");
    let of_pull = split.lifecycle("/v1/sandboxes", json!({"template": "pulled"})).sandbox_id.expect("its id");
    let ran = split.exec(&of_pull, &["/bin/sh", "-c", "cat /etc/greeting; echo; pwd"]);
    assert_eq!(ran["stdout"], format!("{}\n/app\n", space_testkit::images::GREETING), "{ran}");
    let answer = split.client.delete(&format!("/v1/sandboxes/{of_pull}")).unwrap();
    split.operation(&serde_json::from_value(answer["operation"].clone()).unwrap());

    // A Debian build: mmdebstrap runs in the helper, its output goes to the
    // log the server opened, its progress comes back as it goes.
    let answer = split
        .client
        .post("/v1/templates", &json!({"name": "jqbox", "from": {"debian": {"packages": ["jq"]}}}))
        .unwrap();
    let operation = answer["operation"]["id"].as_str().unwrap().to_string();
    let mut packages_seen = Vec::new();
    let built = space_testkit::wait_for("the Debian build", Duration::from_secs(900), || {
        let seen = split.client.get(&format!("/v1/operations/{operation}")).unwrap();
        let amount = &seen["progress"]["amount"];
        if amount["unit"] == "packages" {
            packages_seen.push((amount["done"].as_u64().unwrap(), amount["total"].as_u64().unwrap()));
        }
        matches!(seen["state"].as_str(), Some("succeeded" | "failed")).then_some(seen)
    });
    assert_eq!(built["state"], "succeeded", "{built}");
    assert!(!packages_seen.is_empty() && packages_seen.iter().all(|(done, total)| done <= total), "{packages_seen:?}");
    let log_path = data.root().join("logs").join(format!("{operation}.log"));
    assert_eq!(owner(&log_path), split.uid, "the server's log");
    assert!(std::fs::read_to_string(&log_path).unwrap().contains("jq"), "the log has mmdebstrap's output");
    split.assert_confined("a Debian build");
    let of_debian = split.lifecycle("/v1/sandboxes", json!({"template": "jqbox"})).sandbox_id.expect("its id");
    let ran = split.exec(&of_debian, &["sh", "-c", "echo '{\"a\": [1, 2]}' | jq -c '.a | length'"]);
    assert_eq!(ran["stdout"], "2\n", "{ran}");
    let answer = split.client.delete(&format!("/v1/sandboxes/{of_debian}")).unwrap();
    split.operation(&serde_json::from_value(answer["operation"].clone()).unwrap());

    for name in ["snap", "snapc", "img", "pulled", "jqbox"] {
        split.client.delete_empty(&format!("/v1/templates/{name}")).unwrap();
        assert!(!templates.join(name).exists(), "{name} is gone");
    }
    split.assert_confined("deleting templates");

    // A compromised server cannot have the helper write over a template:
    // no image into a version that exists, no build of an old version, no
    // record naming another template than the build's.
    let me = Some((split.uid, split.gid));
    let hello = request(json!({"op": "hello", "version": space_privsep::proto::PROTOCOL_VERSION, "engine": "gvisor"}));
    // The base version the data dir holds (a changed package list or account makes a new one).
    let version: u32 = std::fs::read_dir(templates.join("base"))
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .max()
        .expect("a published base");
    let base = json!({"name": "base", "version": version});
    let evil = json!({"name": "evil", "version": 1});
    let record = json!({"name": "base", "version": version, "created_at": "", "source": {},
        "defaults": {"vcpus": 1, "memory_mib": 512, "disk_mib": 1024, "env": {}, "workdir": "/", "user": "root"}});
    let said = ask_helper_as(
        &split.socket,
        me,
        &[
            hello,
            request(json!({"op": "save_image", "sandbox": source, "image": {"kind": "template", "template": base}})),
            request(json!({"op": "begin_template", "template": base})),
            request(json!({"op": "begin_template", "template": evil})),
            request(json!({"op": "publish_template", "template": evil, "meta": record.to_string(), "ext4": null})),
            request(json!({"op": "delete_template", "name": "evil", "version": null})),
        ],
    );
    assert_eq!(said.len(), 6, "{said:?}");
    let replies: Vec<Value> = said[1..].iter().map(|line| serde_json::from_str(line).unwrap()).collect();
    assert_eq!(replies[0]["refusal"], "conflict", "no image over a published template: {said:?}");
    assert!(replies[1]["refusal"].is_string(), "no build of a version there is: {said:?}");
    assert_eq!(replies[2]["reply"], "done", "{said:?}");
    assert!(replies[3]["message"].as_str().unwrap().contains("names base"), "{said:?}");
    assert_eq!(replies[4]["reply"], "done", "{said:?}");
    assert!(!templates.join("evil").exists() && templates.join(format!("base/{version}/template.json")).exists());
    assert!(!templates.join(format!("base/.{version}.partial")).exists(), "nothing was made beside base's version");
}

/// Beside a helper given a firecracker binary, the confined server's
/// Firecracker engine is the helper's: what `GET /v1/health` says of it is
/// the helper's own finding (here, where the guest cannot boot, its
/// reasons; on a host with vmx/svm and a guest, available), never that the
/// helper did not answer or runs no microVMs. Without a binary the helper
/// runs none, and says how to give it one.
#[test]
fn a_confined_server_asks_the_helper_for_its_microvms() {
    let Some(binary) = std::env::var_os("FIRECRACKER_BIN") else {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED a_confined_server_asks_the_helper_for_its_microvms: FIRECRACKER_BIN is not set"
        );
        return;
    };
    let data = TestDataDir::new();
    let split = Split::start(&data, &[]);
    let health: Value = split.client.get("/v1/health").unwrap();
    let firecracker = health["engines"].as_array().unwrap().iter().find(|e| e["name"] == "firecracker").cloned();
    let firecracker = firecracker.expect("the health names the firecracker engine");
    let detail = firecracker["detail"].as_str().unwrap();
    assert!(!detail.contains("root helper"), "the helper's own finding: {detail}");
    let local = space_engine::firecracker::availability(
        Some(std::path::Path::new(&binary)),
        space_host::guest::existing(&data.data).as_ref().map(|g| (g.kernel.as_path(), g.initramfs.as_path())),
    );
    assert_eq!((firecracker["available"].as_bool(), detail), (Some(local.available), local.detail.as_str()));
    drop(split);

    // A helper without the binary runs no microVMs and says so.
    let mut helper = Command::new(common::SPACE);
    helper.env_remove("FIRECRACKER_BIN");
    // Served to root here, so this test can ask it directly.
    let socket = data.root().join("run").join("helper-without.sock");
    let without = common::spawn_helper_with(helper, &data, &socket, 0);
    let host =
        space_engine::helper::HelperHost::for_engine(&socket, 0, space_engine::privsep::proto::Engine::Firecracker);
    let (available, detail) = {
        use space_engine::host::EngineHost as _;
        host.availability()
    };
    drop(without);
    assert!(!available && detail.contains("runs no firecracker") && detail.contains("--firecracker-bin"), "{detail}");
}
