//! Volumes in a cluster (issue 37) with real processes on loopback: a
//! throwaway PostgreSQL, a control plane (`space serve --cluster`) and two
//! nodes (`space node`, each with its own btrfs data dir and root helper).
//! A volume made through the control plane lands on a node and a sandbox
//! that mounts it is placed there; another tenant can neither see, mount,
//! write nor delete it; a move to the other node refuses while the volume
//! is mounted and otherwise carries its files (a link, a mode and 64 MiB
//! streamed between the nodes); one with a snapshot stays, and a volume
//! made from that snapshot is made beside it; a tenant whose disk quota
//! holds a volume once can still move it; a sandbox that mounts volumes
//! of both nodes is refused, naming both.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use space_process::ReapedChild;
use space_testkit::{output_within, wait_for, PgCluster, TestDataDir, PATIENCE};

mod common;
use common::cluster::{control_plane, node, ControlPlane};
use common::SPACE;

/// A tenant's view of the control plane.
struct Api {
    url: String,
    key: String,
}

impl Api {
    fn client(&self) -> space_client::Client {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build();
        space_client::Client::with_agent(&self.url, &self.key, agent)
    }

    /// The status and the answer.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let answer = self
            .client()
            .call_with(method, path, &[], body.as_ref())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        (answer.status, answer.body)
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, value) = self.call(method, path, body);
        assert!((200..300).contains(&status), "{method} {path} -> {status}: {value}");
        value
    }

    /// A request of raw bytes: the status and the body as sent.
    fn bytes(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Vec<u8>) {
        let answer =
            self.client().call_bytes(method, path, &[], body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        (answer.status, answer.body)
    }

    /// A sandbox that mounts `volumes`, running: its id and node.
    fn sandbox_with(&self, volumes: Value) -> (String, String) {
        let (status, accepted) =
            self.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": volumes})));
        assert_eq!(status, 202, "{accepted}");
        let op = accepted["operation"]["id"].as_str().unwrap();
        let done = self.client().wait_for_operation_within(op, Duration::from_secs(120)).unwrap();
        assert_eq!(done.state, space_api::OperationState::Succeeded, "{done:?}");
        let node = accepted["sandbox"]["node"].as_str().expect("the sandbox's node").to_string();
        (accepted["sandbox"]["id"].as_str().unwrap().to_string(), node)
    }

    fn exec(&self, id: &str, cmd: &str) -> String {
        let ran = self.ok("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": cmd})));
        assert_eq!(ran["result"]["exit_code"], 0, "{cmd}: {ran}");
        ran["stdout"].as_str().unwrap().to_string()
    }

    fn delete_sandbox(&self, id: &str) {
        let accepted = self.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
        let op = accepted["operation"]["id"].as_str().unwrap();
        let done = self.client().wait_for_operation_within(op, Duration::from_secs(60)).unwrap();
        assert_eq!(done.state, space_api::OperationState::Succeeded, "{done:?}");
    }
}

fn tenant_key(pg: &PgCluster, data: &TestDataDir, tenant: &str, quotas: &[&str]) -> String {
    let mut keys = Command::new(SPACE);
    keys.args(["keys", "create", "--tenant", tenant, "--database", &pg.url]).args(quotas);
    keys.env("SPACE_DATA_DIR", data.root());
    let made = output_within(&mut keys, PATIENCE);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    String::from_utf8(made.stdout).unwrap().trim().to_string()
}

/// A control plane on PostgreSQL and two live nodes, `node-a` and
/// `node-b`, their volumes in the shared store `store` when one is given.
struct Cluster {
    cp: ControlPlane,
    operator: Api,
    _nodes: Vec<ReapedChild>,
    _helpers: Vec<ReapedChild>,
    _datas: [TestDataDir; 2],
}

fn cluster(store: Option<&Path>) -> Cluster {
    let cp = control_plane(&[]);
    let datas = [TestDataDir::new(), TestDataDir::new()];
    let mut helpers = Vec::new();
    let nodes: Vec<ReapedChild> = ["node-a", "node-b"]
        .iter()
        .zip(&datas)
        .map(|(id, data)| match store {
            None => node(data, id, &cp, &common::split_args(data)),
            // The store on both the helper and the node, as an operator
            // sets it (the node checks that its helper has it too).
            Some(store) => {
                let socket = data.root().join("run").join("shared-helper.sock");
                let mut command = Command::new(SPACE);
                command.env("SPACE_SHARED_VOLUMES", store);
                helpers.push(common::spawn_helper_with(command, data, &socket, common::test_user().0));
                let split = ["--helper-socket", socket.to_str().unwrap(), "--user", common::TEST_USER];
                let mut args: Vec<String> = split.map(str::to_string).to_vec();
                args.extend(["--shared-volumes".to_string(), store.to_str().unwrap().to_string()]);
                node(data, id, &cp, &args)
            }
        })
        .collect();
    let operator = Api { url: cp.url.clone(), key: std::fs::read_to_string(&cp.operator_key).unwrap() };
    wait_for("two live nodes", Duration::from_secs(60), || {
        let nodes = operator.ok("GET", "/v1/health", None)["nodes"].as_array().cloned().unwrap_or_default();
        (nodes.iter().filter(|n| n["alive"] == true).count() == 2).then_some(())
    });
    Cluster { cp, operator, _nodes: nodes, _helpers: helpers, _datas: datas }
}

#[test]
fn volumes_live_on_a_node_place_their_sandboxes_there_and_move_with_their_files() {
    let cluster = cluster(None);
    let (pg, control, cp_url, token, operator) =
        (&cluster.cp.pg, &cluster.cp.data, &cluster.cp.url, &cluster.cp.token, &cluster.operator);
    let team = Api { url: cp_url.clone(), key: tenant_key(pg, control, "team", &[]) };
    let other = Api { url: cp_url.clone(), key: tenant_key(pg, control, "other", &[]) };

    // Made through the control plane: on a node, named, seeded without a sandbox.
    let (status, made) = team.call("POST", "/v1/volumes", Some(json!({"name": "ws", "size_mib": 256})));
    assert_eq!(status, 201, "{made}");
    let home = made["node"].as_str().expect("the volume's node").to_string();
    let away = if home == "node-a" { "node-b" } else { "node-a" };
    let (status, wrote) = team.bytes("PUT", "/v1/volumes/ws/files?path=/hello.txt", Some(b"seeded through the cp"));
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&wrote));
    assert_eq!(team.ok("GET", "/v1/volumes/ws", None)["node"], home.as_str());
    let listed = team.ok("GET", "/v1/volumes", None);
    assert_eq!(listed["volumes"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed["volumes"][0]["node"], home.as_str(), "{listed}");

    // Its sandbox goes to its node, every time, and sees and writes its files.
    let (sandbox, placed) = team.sandbox_with(json!([{"name": "ws", "path": "/workspace"}]));
    assert_eq!(placed, home, "a sandbox that mounts ws goes where ws is");
    assert_eq!(team.exec(&sandbox, "cat /workspace/hello.txt"), "seeded through the cp");
    team.exec(
        &sandbox,
        "echo written inside > /workspace/inside.txt && chmod 600 /workspace/inside.txt \
         && mkdir -p /workspace/d && ln -s ../hello.txt /workspace/d/link",
    );
    // Big enough that a move that read it whole would show.
    let big = team.exec(&sandbox, "head -c 67108864 /dev/urandom > /workspace/big && sha256sum /workspace/big");

    // Another tenant: not seen, not mounted, not written, not deleted, not moved.
    assert_eq!(other.ok("GET", "/v1/volumes", None)["volumes"], json!([]));
    for (method, path, body) in [
        ("GET", "/v1/volumes/ws", None),
        ("DELETE", "/v1/volumes/ws", None),
        ("GET", "/v1/volumes/ws/files?path=/hello.txt", None),
        ("POST", "/v1/volumes/ws/move", Some(json!({"node": away}))),
        ("POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": [{"name": "ws", "path": "/w"}]}))),
    ] {
        let (status, refused) = other.call(method, path, body);
        assert_eq!((status, refused["error"]["code"].as_str()), (404, Some("volume_not_found")), "{method} {path}");
    }
    let (status, _) = other.bytes("PUT", "/v1/volumes/ws/files?path=/x", Some(b"x"));
    assert_eq!(status, 404);

    // Mounted: it does not move.
    let (status, refused) = team.call("POST", "/v1/volumes/ws/move", Some(json!({"node": away})));
    assert_eq!((status, refused["error"]["code"].as_str()), (409, Some("volume_in_use")), "{refused}");
    assert_eq!(refused["error"]["details"]["sandbox_id"], sandbox.as_str());
    team.delete_sandbox(&sandbox);

    // Unmounted: moved with its files, its link and its mode.
    let moved = team.ok("POST", "/v1/volumes/ws/move", Some(json!({"node": away})));
    assert_eq!((moved["node"].as_str(), moved["size_mib"].as_u64()), (Some(away), Some(256)), "{moved}");
    assert_eq!(team.ok("GET", "/v1/volumes/ws", None)["node"], away);
    let (status, read) = team.bytes("GET", "/v1/volumes/ws/files?path=/inside.txt", None);
    assert_eq!((status, String::from_utf8_lossy(&read).as_ref()), (200, "written inside\n"));
    let (sandbox, placed) = team.sandbox_with(json!([{"name": "ws", "path": "/workspace", "read_only": true}]));
    assert_eq!(placed, away, "its sandboxes follow it");
    assert_eq!(team.exec(&sandbox, "cat /workspace/d/link"), "seeded through the cp");
    assert_eq!(team.exec(&sandbox, "stat -c %a /workspace/inside.txt"), "600\n");
    assert_eq!(team.exec(&sandbox, "sha256sum /workspace/big"), big, "64 MiB moved whole");
    let listed = team.ok("GET", "/v1/volumes", None);
    assert_eq!(listed["volumes"].as_array().map(Vec::len), Some(1), "{listed}");
    // Each node asked itself (as the control plane asks it): the old copy is gone.
    let node_token = std::fs::read_to_string(token).unwrap();
    for node in operator.ok("GET", "/v1/health", None)["nodes"].as_array().unwrap() {
        let client = space_client::Client::new(node["url"].as_str().unwrap(), node_token.trim());
        let held = client.call_with("GET", "/v1/volumes", &[("X-Space-Tenant", "team")], None).unwrap();
        let names: Vec<&str> =
            held.body["volumes"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
        let here = node["id"] == away;
        assert_eq!(names, if here { vec!["ws"] } else { vec![] }, "on {}: {}", node["id"], held.body);
    }

    // A snapshot stays with its volume: a volume that has one does not
    // move (once nothing mounts it), and a volume made from it is made
    // beside it.
    team.delete_sandbox(&sandbox);
    team.ok("POST", "/v1/volumes/ws/snapshots", Some(json!({"name": "s1"})));
    let (status, refused) = team.call("POST", "/v1/volumes/ws/move", Some(json!({"node": home})));
    assert_eq!((status, refused["error"]["details"]["state"].as_str()), (409, Some("has_snapshots")), "{refused}");
    let from = json!({"name": "branch", "from_snapshot": {"volume": "ws", "snapshot": "s1"}});
    let (status, branch) = team.call("POST", "/v1/volumes", Some(from));
    assert_eq!((status, branch["node"].as_str()), (201, Some(away)), "{branch}");
    let (status, read) = team.bytes("GET", "/v1/volumes/branch/files?path=/hello.txt", None);
    assert_eq!((status, String::from_utf8_lossy(&read).as_ref()), (200, "seeded through the cp"));

    // Volumes of two nodes in one sandbox: refused, naming both.
    let (status, near) = team.call("POST", "/v1/volumes", Some(json!({"name": "near", "size_mib": 64})));
    assert_eq!(status, 201, "{near}");
    if near["node"] == away {
        let other_node = if away == "node-a" { "node-b" } else { "node-a" };
        team.ok("POST", "/v1/volumes/near/move", Some(json!({"node": other_node})));
    }
    let mounts = json!([{"name": "ws", "path": "/workspace", "read_only": true}, {"name": "near", "path": "/near"}]);
    let (status, refused) = team.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": mounts})));
    assert_eq!((status, refused["error"]["details"]["field"].as_str()), (422, Some("volumes")), "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("node-a") && message.contains("node-b"), "{message}");

    // A tenant whose disk quota holds the volume once (not twice) moves it:
    // the copy being moved away is not counted against the new one.
    let tight = Api { url: cp_url.clone(), key: tenant_key(pg, control, "tight", &["--max-disk-mib", "100"]) };
    let (status, made) = tight.call("POST", "/v1/volumes", Some(json!({"name": "snug", "size_mib": 64})));
    assert_eq!(status, 201, "{made}");
    let (status, refused) = tight.call("POST", "/v1/volumes", Some(json!({"name": "more", "size_mib": 64})));
    assert_eq!((status, refused["error"]["code"].as_str()), (429, Some("quota_exceeded")), "{refused}");
    let there = if made["node"] == "node-a" { "node-b" } else { "node-a" };
    let moved = tight.ok("POST", "/v1/volumes/snug/move", Some(json!({"node": there})));
    assert_eq!(moved["node"], there, "{moved}");

    // Deleted through the control plane: gone from its node and the list.
    for path in ["branch", "ws/snapshots/s1", "ws", "near"] {
        let (status, body) = team.call("DELETE", &format!("/v1/volumes/{path}"), None);
        assert_eq!(status, 204, "{path}: {body}");
    }
    assert_eq!(team.ok("GET", "/v1/volumes", None)["volumes"], json!([]));
    let (status, _) = team.call("GET", "/v1/volumes/ws", None);
    assert_eq!(status, 404);
}

/// The volume images in `store` (decision 032).
fn images(store: &Path) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(store)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().filter(|n| n.ends_with(".img")).map(str::to_string))
        .collect();
    found.sort();
    found
}

#[test]
fn volumes_in_a_shared_store_go_wherever_their_sandbox_is_placed_and_are_never_mounted_twice() {
    // The store an operator would mount from NFS or CephFS on every node:
    // here a directory both nodes' helpers use, root's.
    let shared = TestDataDir::new();
    let store = shared.root().join("store");
    std::fs::create_dir(&store).unwrap();
    let cluster = cluster(Some(&store));
    let team = Api { url: cluster.cp.url.clone(), key: tenant_key(&cluster.cp.pg, &cluster.cp.data, "team", &[]) };
    let other_of = |node: &str| if node == "node-a" { "node-b" } else { "node-a" }.to_string();

    // Made as an image in the store, seeded, and given a snapshot.
    let (status, made) = team.call("POST", "/v1/volumes", Some(json!({"name": "ws", "size_mib": 64})));
    assert_eq!(status, 201, "{made}");
    let home = made["node"].as_str().expect("the volume's node").to_string();
    let image = images(&store);
    assert_eq!(image.len(), 1, "one image in the store: {image:?}");
    let (status, _) = team.bytes("PUT", "/v1/volumes/ws/files?path=/hello.txt", Some(b"in the store"));
    assert_eq!(status, 201);
    team.ok("POST", "/v1/volumes/ws/snapshots", Some(json!({"name": "s1"})));

    // A move hands it over: no copy, its snapshot goes with it (a copy
    // between nodes' own disks refuses a volume that has one).
    let away = other_of(&home);
    let moved = team.ok("POST", "/v1/volumes/ws/move", Some(json!({"node": away})));
    assert_eq!(moved["node"], away.as_str(), "{moved}");
    assert_eq!(moved["snapshots"][0]["name"], "s1", "{moved}");
    assert_eq!(images(&store), image, "the same image, not a copy");
    let (status, read) = team.bytes("GET", "/v1/volumes/ws/files?path=/hello.txt", None);
    assert_eq!((status, String::from_utf8_lossy(&read).as_ref()), (200, "in the store"));

    // Two volumes on two nodes: a sandbox that mounts both is placed
    // anyway, and both go to its node.
    let (status, near) = team.call("POST", "/v1/volumes", Some(json!({"name": "near", "size_mib": 64})));
    assert_eq!(status, 201, "{near}");
    if near["node"] == away.as_str() {
        team.ok("POST", "/v1/volumes/near/move", Some(json!({"node": home})));
    }
    let mounts = json!([{"name": "ws", "path": "/workspace"}, {"name": "near", "path": "/near", "read_only": true}]);
    let (sandbox, placed) = team.sandbox_with(mounts);
    assert_eq!(team.ok("GET", "/v1/volumes/ws", None)["node"], placed.as_str());
    assert_eq!(team.ok("GET", "/v1/volumes/near", None)["node"], placed.as_str());
    assert_eq!(team.exec(&sandbox, "cat /workspace/hello.txt"), "in the store");
    team.exec(&sandbox, "echo from the sandbox > /workspace/out.txt");
    // The size holds inside, in the store too.
    let ran = team.ok(
        "POST",
        &format!("/v1/sandboxes/{sandbox}/exec"),
        Some(json!({"cmd": "head -c 100000000 /dev/zero > /workspace/big; echo $?; sync"})),
    );
    assert_ne!(ran["stdout"], "0\n", "a 95 MiB write into a 64 MiB volume fails: {ran}");
    assert!(ran["stderr"].as_str().unwrap().contains("quota"), "{ran}");
    team.exec(&sandbox, "rm -f /workspace/big");

    // Mounted, it stays: a move is refused, and a second sandbox that
    // mounts it goes where it is.
    let (status, refused) = team.call("POST", "/v1/volumes/ws/move", Some(json!({"node": other_of(&placed)})));
    assert_eq!((status, refused["error"]["code"].as_str()), (409, Some("volume_in_use")), "{refused}");
    let (reader, with) = team.sandbox_with(json!([{"name": "ws", "path": "/ws", "read_only": true}]));
    assert_eq!(with, placed, "a mounted volume keeps its readers beside it");
    assert_eq!(team.exec(&reader, "cat /ws/out.txt"), "from the sandbox\n");

    // The second fence: the node that mounts it holds its lock in the store,
    // and another node asked to take it (as only the control plane may)
    // refuses while it does.
    let node_token = std::fs::read_to_string(&cluster.cp.token).unwrap();
    let nodes = cluster.operator.ok("GET", "/v1/health", None)["nodes"].as_array().cloned().unwrap();
    let url_of = |id: &str| nodes.iter().find(|n| n["id"] == id).unwrap()["url"].as_str().unwrap().to_string();
    let holder = space_client::Client::new(&url_of(&placed), node_token.trim());
    let stranger = space_client::Client::new(&url_of(&other_of(&placed)), node_token.trim());
    let volume_id = image[0].trim_end_matches(".img").to_string();
    let store_id = std::fs::read_to_string(store.join("store-id")).unwrap().trim().to_string();
    let handed = json!({
        "store": store_id, "tenant": "team", "id": volume_id, "name": "ws", "size_mib": 64,
        "created_at": made["created_at"], "snapshots": [],
    });
    let taken = stranger.call_with("POST", "/internal/v1/volumes/adopt", &[], Some(&handed)).unwrap();
    assert!(taken.status >= 400, "a volume mounted elsewhere is not taken: {}", taken.body);
    assert!(taken.body.to_string().contains("another node"), "{}", taken.body);
    // And it is still whole where it is.
    assert_eq!(team.exec(&sandbox, "cat /workspace/out.txt"), "from the sandbox\n");
    // Internal routes want the node token.
    let tenant_key = space_client::Client::new(&url_of(&placed), &team.key);
    let refused = tenant_key
        .call_with("POST", "/internal/v1/volumes/release", &[], Some(&json!({"tenant": "team", "name": "ws"})))
        .unwrap();
    assert_eq!(refused.status, 401, "{}", refused.body);
    let refused = holder
        .call_with("POST", "/internal/v1/volumes/release", &[], Some(&json!({"tenant": "team", "name": "ws"})))
        .unwrap();
    assert_eq!(refused.status, 409, "a mounted volume is not let go of: {}", refused.body);

    // Unmounted, deleted: its image goes from the store.
    team.delete_sandbox(&reader);
    team.delete_sandbox(&sandbox);
    for path in ["ws/snapshots/s1", "ws", "near"] {
        let (status, body) = team.call("DELETE", &format!("/v1/volumes/{path}"), None);
        assert_eq!(status, 204, "{path}: {body}");
    }
    assert_eq!(images(&store), Vec::<String>::new(), "no image is left in the store");
}
