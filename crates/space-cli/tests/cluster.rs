//! Cluster mode (decision 009) with real processes: a throwaway PostgreSQL
//! and two control-plane replicas (`space serve --cluster`) in one network
//! namespace, and three nodes (`space node`), each in a network namespace
//! of its own with its own btrfs data dir; every namespace and link is
//! made by the test. A template built through the control plane reaches
//! every node.
//! Sandboxes spread over the nodes; exec, files, output streams, attach and
//! lifecycle work through either replica; tenants stay apart; a node killed
//! with SIGKILL leaves its sandboxes failed ("node lost") within the lease
//! while the other node's keep answering; started again, it takes them back.
//! Events from every node reach a follower of either replica; a secret put
//! through the control plane reaches the node whose gateway needs it.
//! Control plane and nodes speak mutual TLS with the cluster's own CA. The
//! unmodified e2b SDK's suite runs through the control plane.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use space_process::ReapedChild;
use space_testkit::{http, output_within, wait_for, NetNs, PgCluster, TestCa, TestDataDir, PATIENCE};

mod common;
use common::SPACE;

/// A tenant's view of one replica, through the API's own client.
struct Api {
    url: String,
    key: String,
}

impl Api {
    /// Every call's deadline is the agent's: two minutes.
    fn client(&self) -> space_client::Client {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build();
        space_client::Client::with_agent(&self.url, &self.key, agent)
    }

    /// The status, the answer and the node that answered (`x-space-node`).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value, Option<String>) {
        let answer = self
            .client()
            .call_with(method, path, &[], body.as_ref())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let node = answer.header("x-space-node").map(str::to_string);
        (answer.status, answer.body, node)
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, value, _) = self.call(method, path, body);
        assert!((200..300).contains(&status), "{method} {path} -> {status}: {value}");
        value
    }

    /// A GET's body as text (NDJSON).
    fn call_text(&self, path: &str) -> String {
        self.client().get_text(path).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// An operation once it has ended (within two and a half minutes).
    fn wait_operation(&self, id: &str) -> Value {
        let patience = Duration::from_secs(150);
        let op =
            self.client().wait_for_operation_within(id, patience).unwrap_or_else(|e| panic!("operation {id}: {e}"));
        assert!(op.state.is_terminal(), "operation {id} did not end within {patience:?}: {op:?}");
        serde_json::to_value(op).unwrap()
    }
}

/// What a follower of `GET /v1/events?follow=true` has seen so far, and why
/// it stopped if it did.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<(Vec<Value>, Option<String>)>>);

impl Events {
    fn all(&self) -> Vec<Value> {
        let seen = self.0.lock().unwrap();
        assert!(seen.1.is_none(), "the events follower stopped: {}", seen.1.as_deref().unwrap_or_default());
        seen.0.clone()
    }

    fn wait(&self, what: &str, done: impl Fn(&[Value]) -> bool) {
        wait_for(what, Duration::from_secs(60), || done(&self.all()).then_some(()));
    }
}

/// Follows the tenant's events from the first one, so that none is missed
/// however late the stream starts.
fn follow_events(url: &str, key: &str) -> Events {
    let events = Events::default();
    let seen = events.0.clone();
    // The stream may stay quiet for long: no read deadline on it (the
    // client's own connect deadline only); the follower thread is never
    // waited for, and `Events::wait` has a deadline of its own.
    let client = space_client::Client::new(url, key);
    std::thread::spawn(move || {
        let followed = client.events("", Some(0), true, |event| {
            seen.lock().unwrap().0.push(serde_json::to_value(event).unwrap());
            Ok::<_, space_client::ClientError>(())
        });
        let stopped = followed.err().map_or("the stream ended".to_string(), |e| e.to_string());
        seen.lock().unwrap().1 = Some(stopped);
    });
    events
}

fn write_secret(data: &TestDataDir, name: &str) -> std::path::PathBuf {
    // 64 hexadecimal digits: a secrets key as well as a token.
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).unwrap();
    let path = data.root().join(name);
    std::fs::write(&path, bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()).unwrap();
    path
}

/// The made-up host of the upstream API that wants a secret.
const API_HOST: &str = "api.space.test";
/// Where it listens, inside the lan namespace.
const API_ADDRESS: &str = "10.231.200.1";

/// An HTTPS server in `net` at [`API_ADDRESS`] for [`API_HOST`], its
/// certificate signed by a CA written to `dir`: it answers each request
/// with the authorization it was sent, and keeps what it was sent.
fn upstream(net: &NetNs, dir: &Path) -> (u16, PathBuf, Arc<Mutex<Vec<String>>>) {
    use tokio_rustls::rustls;
    let ca = space_testkit::TestCa::new(dir, "upstream-ca");
    let (config, ca_file) = (ca.server(&[API_HOST.to_string()]), ca.file.clone());
    net.add_address(&format!("{API_ADDRESS}/32"));
    let listener = net.bind(&format!("{API_ADDRESS}:0"));
    let port = listener.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (config, log) = (config.clone(), log.clone());
            std::thread::spawn(move || {
                let Ok(connection) = rustls::ServerConnection::new(config) else { return };
                let mut stream = BufReader::new(rustls::StreamOwned::new(connection, tcp));
                let mut auth = String::new();
                loop {
                    let mut line = String::new();
                    if stream.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    if line == "\r\n" {
                        break;
                    }
                    if let Some((name, value)) = line.split_once(':') {
                        if name.eq_ignore_ascii_case("authorization") {
                            auth = value.trim().to_string();
                        }
                    }
                }
                log.lock().unwrap().push(auth.clone());
                let body = format!("you sent: {auth}");
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                let stream = stream.get_mut();
                let _ = stream.write_all(format!("{head}{body}").as_bytes());
                let _ = stream.flush();
                stream.conn.send_close_notify();
                let _ = stream.flush();
            });
        }
    });
    (port, ca_file, seen)
}

/// `--cluster-ca/-cert/-key` for a member of a cluster whose CA is `ca`,
/// reached at `addresses` (its files in `dir`).
fn member(ca: &TestCa, dir: &Path, name: &str, addresses: &[String]) -> Vec<String> {
    let (cert, key) = ca.issue(addresses);
    let (cert_file, key_file) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_string();
    ["--cluster-ca", &path(&ca.file), "--cluster-cert", &path(&cert_file), "--cluster-key", &path(&key_file)]
        .map(str::to_string)
        .to_vec()
}

/// Where replica `i` takes nodes' heartbeats (mutual TLS), in the lan.
fn heartbeat_port(i: usize) -> u16 {
    7443 + i as u16
}

/// Node `k` (1, 2, 3): in its own namespace at 10.231.k.2, serving the
/// cluster's mutual TLS, reporting to both replicas (whichever answers)
/// through its link to the lan; its sandboxes' egress reaches the
/// upstream API in the lan.
fn node(net: &NetNs, k: u8, data: &TestDataDir, id: &str, token: &Path, extra: &[String]) -> ReapedChild {
    let listen = format!("10.231.{k}.2:0");
    let replicas: Vec<String> = (0..2).map(|i| format!("https://10.231.{k}.1:{}", heartbeat_port(i))).collect();
    let replicas = replicas.join(",");
    let args = ["--listen", &listen, "--node-id", id, "--control-plane", &replicas];
    let mut all: Vec<&str> = args.to_vec();
    let token = token.to_str().unwrap();
    all.extend(["--node-token-file", token]);
    all.extend(extra.iter().map(String::as_str));
    // A node runs as the split too: a root helper beside it, itself confined.
    let split = common::split_args(data);
    all.extend(split.iter().map(String::as_str));
    let (child, _, _, lines) = common::spawn_command(net.command(SPACE), data, "node", &all);
    // What goes wrong on a node shows in the test's output.
    let name = id.to_string();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok).filter(|l| l.contains("WARN") || l.contains("ERROR")) {
            eprintln!("[{name}] {line}");
        }
    });
    child
}

const NODES: [(&str, u8); 3] = [("node-a", 1), ("node-b", 2), ("node-c", 3)];

fn tenant_key(pg: &PgCluster, data: &TestDataDir, tenant: &str, quotas: &[&str]) -> String {
    let mut keys = Command::new(SPACE);
    keys.args(["keys", "create", "--tenant", tenant, "--database", &pg.url]).args(quotas);
    keys.env("SPACE_DATA_DIR", data.root());
    let made = output_within(&mut keys, PATIENCE);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    String::from_utf8(made.stdout).unwrap().trim().to_string()
}

#[test]
fn a_cluster_spreads_sandboxes_forwards_everything_and_survives_losing_a_node() {
    // The network, all of it made here: the test's namespace is linked to
    // a "lan" namespace (PostgreSQL and both control-plane replicas), and
    // each node has a namespace of its own, linked to the lan.
    // The one subnet the test's own namespace sees is picked at random, so
    // two runs at once (or the host's own networks) do not collide.
    let mut pick = [0u8; 1];
    getrandom::getrandom(&mut pick).unwrap();
    let outer = format!("10.232.{}", pick[0]);
    let lan = NetNs::new("lan");
    NetNs::link(None, &format!("{outer}.1/24"), &lan, &format!("{outer}.2/24"));
    lan.forward();
    let nets: std::collections::BTreeMap<&str, NetNs> = NODES
        .iter()
        .map(|(name, k)| {
            let net = NetNs::new(&format!("n{k}"));
            NetNs::link(Some(&lan), &format!("10.231.{k}.1/24"), &net, &format!("10.231.{k}.2/24"));
            // Nodes reach each other (templates travel between them) through the lan.
            net.route_via(&format!("10.231.{k}.1"));
            (*name, net)
        })
        .collect();
    let pg = PgCluster::start_in(&lan, &format!("{outer}.2"), &format!("{outer}.0/24"));
    let control = TestDataDir::new();
    let token = write_secret(&control, "node-token");
    let operator_key = write_secret(&control, "api-key");
    let secrets_key = write_secret(&control, "secrets-key");
    let (api_port, api_ca, api_seen) = upstream(&lan, control.root());
    let egress = vec![
        "--egress-host".to_string(),
        format!("{API_HOST}={API_ADDRESS}:{api_port}"),
        "--egress-allow-internal".to_string(),
        format!("{API_ADDRESS}/32"),
        "--egress-trust".to_string(),
        api_ca.to_str().unwrap().to_string(),
    ];
    let cluster_ca = TestCa::new(control.root(), "cluster-ca");
    let lan_side: Vec<String> = NODES.iter().map(|(_, k)| format!("10.231.{k}.1")).collect();
    let cp_tls = member(&cluster_ca, control.root(), "control-plane", &lan_side);
    let cp_args = [
        "--cluster",
        "--database",
        pg.url.as_str(),
        "--node-token-file",
        token.to_str().unwrap(),
        "--secrets-key-file",
        secrets_key.to_str().unwrap(),
        "--api-key-file",
        operator_key.to_str().unwrap(),
        "--listen",
        "0.0.0.0:0",
        "--insecure-http",
    ];
    let replicas: Vec<(ReapedChild, u16)> = (0..2)
        .map(|i| {
            let mut args: Vec<String> = cp_args.iter().map(|a| a.to_string()).collect();
            args.extend(cp_tls.iter().cloned());
            args.extend(["--cluster-listen".into(), format!("0.0.0.0:{}", heartbeat_port(i))]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (child, url, _, lines) = common::spawn_command(lan.command(SPACE), &control, "serve", &args);
            std::thread::spawn(move || lines.for_each(drop));
            (child, url.rsplit(':').next().unwrap().parse().unwrap())
        })
        .collect();
    let ports: Vec<u16> = replicas.iter().map(|(_, port)| *port).collect();
    let (first, second) = (format!("http://{outer}.2:{}", ports[0]), format!("http://{outer}.2:{}", ports[1]));
    let datas: std::collections::BTreeMap<&str, TestDataDir> =
        NODES.iter().map(|(name, _)| (*name, TestDataDir::new())).collect();
    let mut children: std::collections::BTreeMap<&str, ReapedChild> = std::collections::BTreeMap::new();
    let node_args: std::collections::BTreeMap<&str, Vec<String>> = NODES
        .iter()
        .map(|(name, k)| {
            (*name, [egress.clone(), member(&cluster_ca, control.root(), name, &[format!("10.231.{k}.2")])].concat())
        })
        .collect();
    for (name, k) in NODES {
        children.insert(name, node(&nets[name], k, &datas[name], name, &token, &node_args[name]));
    }

    // Every node is known to both replicas (one database).
    // Health asks for no key: the operator's goes along unread.
    let operator = std::fs::read_to_string(&operator_key).unwrap();
    let health = |url: &str| Api { url: url.to_string(), key: operator.clone() }.ok("GET", "/v1/health", None);
    let nodes = wait_for("three live nodes", Duration::from_secs(60), || {
        let nodes = health(&second)["nodes"].as_array().cloned().unwrap_or_default();
        (nodes.iter().filter(|n| n["alive"] == true).count() == 3).then_some(nodes)
    });
    // A node answers only a peer with a certificate of the cluster's CA.
    let url = nodes[0]["url"].as_str().unwrap();
    let (host, port) = url.trim_start_matches("https://").split_once(':').expect("an https:// node");
    let stranger = output_within(
        lan.command("python3").args([
            "-c",
            "import socket, ssl, sys\n\
             c = ssl.create_default_context(cafile=sys.argv[1])\n\
             s = c.wrap_socket(socket.create_connection((sys.argv[2], int(sys.argv[3]))), server_hostname=sys.argv[2])\n\
             s.sendall(b'GET /v1/health HTTP/1.1\\r\\nHost: n\\r\\n\\r\\n')\n\
             print(s.recv(100))",
            control.root().join("cluster-ca.pem").to_str().unwrap(),
            host,
            port,
        ]),
        PATIENCE,
    );
    let refused = String::from_utf8_lossy(&stranger.stderr);
    assert!(!stranger.status.success() && refused.contains("CERTIFICATE_REQUIRED"), "{refused}");

    let key = tenant_key(&pg, &control, "team-c", &[]);
    let other_key = tenant_key(&pg, &control, "team-d", &["--max-sandboxes", "1"]);
    let (a, b) = (Api { url: first.clone(), key: key.clone() }, Api { url: second.clone(), key: key.clone() });
    // A follower of the tenant's events, on the replica that stays.
    let events = follow_events(&second, &key);

    // A template built (an image imported) through the control plane lands
    // on one node and is pulled by the other, checked by its SHA-256.
    let image = common::busybox_image(control.root());
    let built = a
        .client()
        .send_with(
            "POST",
            "/v1/templates?name=tiny",
            &[("Content-Type", "application/x-tar")],
            File::open(&image).unwrap(),
        )
        .unwrap();
    assert_eq!(built.status, 202, "{}", built.body);
    let builder = built.header("x-space-node").expect("the building node").to_string();
    assert_eq!(b.wait_operation(built.body["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    wait_for("every node to have the template", Duration::from_secs(120), || {
        let nodes = health(&second)["nodes"].as_array().cloned().unwrap_or_default();
        let have = nodes.iter().filter(|n| n["templates"].as_array().is_some_and(|t| t.contains(&json!("tiny"))));
        (have.count() == 3).then_some(())
    });
    let others: Vec<&str> = NODES.iter().map(|(n, _)| *n).filter(|n| *n != builder).collect();
    assert_eq!(a.ok("GET", "/v1/templates/tiny", None)["name"], "tiny");
    assert_eq!(a.call("GET", "/v1/templates/none-such", None).0, 404);

    // Four sandboxes through the first replica land on every node (big
    // enough, as limits, that each outweighs what warm members hold).
    let mut sandboxes: Vec<(String, String)> = Vec::new();
    for _ in 0..4 {
        let (status, accepted, node) =
            a.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 2048})));
        assert_eq!(status, 202, "{accepted}");
        let op = b.wait_operation(accepted["operation"]["id"].as_str().unwrap());
        assert_eq!(op["state"], "succeeded", "{op}");
        let node = node.expect("the node is named");
        // The record says so too, as every later read of it does.
        assert_eq!(accepted["sandbox"]["node"], node.as_str(), "{accepted}");
        let id = accepted["sandbox"]["id"].as_str().unwrap().to_string();
        assert_eq!(b.ok("GET", &format!("/v1/sandboxes/{id}"), None)["node"], node.as_str());
        sandboxes.push((id, node));
    }
    let on = |name: &str| sandboxes.iter().filter(|(_, n)| n == name).map(|(id, _)| id.clone()).collect::<Vec<_>>();
    assert!(NODES.iter().all(|(n, _)| !on(n).is_empty()), "not spread: {sandboxes:?} {}", health(&first));

    // Everything works through either replica.
    for (i, (id, _)) in sandboxes.iter().enumerate() {
        let api = if i % 2 == 0 { &a } else { &b };
        let ran = api.ok("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": format!("echo via cp {i}")})));
        assert_eq!(ran["stdout"], format!("via cp {i}\n"), "{ran}");
    }
    let (id, _) = &sandboxes[0];
    a.client().upload_bytes(id, "/root/f.txt", b"through the control plane").unwrap();
    let mut read = Vec::new();
    b.client().download(id, "/root/f.txt", &mut read).unwrap();
    assert_eq!(String::from_utf8_lossy(&read), "through the control plane");
    let started = a.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "for i in 1 2 3; do echo $i; sleep 0.1; done"})),
    );
    let cid = started["command"]["id"].as_str().unwrap();
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let output = format!("/v1/sandboxes/{id}/commands/{cid}/output");
    let result = b.client().stream_output(&output, &mut stdout, &mut stderr).unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&stdout), String::from_utf8_lossy(&stderr));
    assert_eq!((stdout.as_ref(), result.exit_code), ("1\n2\n3\n", Some(0)), "{stderr}");
    // attach's WebSocket through a replica (the CLI's `exec -t`).
    let tty = output_within(
        Command::new(SPACE)
            .args(["exec", "-t", id, "--", "tty"])
            .env("SPACE_URL", &second)
            .env("SPACE_API_KEY", &key)
            .stdin(Stdio::null()),
        PATIENCE,
    );
    assert!(String::from_utf8_lossy(&tty.stdout).starts_with("/dev/pts/"), "{}", String::from_utf8_lossy(&tty.stderr));
    for action in ["pause", "resume"] {
        let accepted = a.ok("POST", &format!("/v1/sandboxes/{id}/{action}"), Some(json!({})));
        assert_eq!(b.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    }
    let listed = b.ok("GET", "/v1/sandboxes", None);
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 4, "{listed}");
    // Operations from every node; the API's own description; the console.
    let operations = a.ok("GET", "/v1/operations", None)["operations"].as_array().unwrap().clone();
    for (id, _) in &sandboxes {
        assert!(operations.iter().any(|o| o["sandbox_id"] == id.as_str() && o["kind"] == "create"), "{id}");
    }
    assert!(a.ok("GET", "/v1/openapi.json", None)["paths"]["/v1/events"].is_object());
    // A web page, not an answer of the API's: the client has no call for it.
    let console = http().get(&format!("{first}/")).call().unwrap();
    assert!(console.content_type().starts_with("text/html"), "{}", console.content_type());
    // The follower saw every node's sandboxes start and commands end, in
    // one order; a replica's log answers by sandbox too.
    events.wait("every sandbox running, every exec exited", |seen| {
        let running = |id: &str| seen.iter().any(|e| e["sandbox_id"] == id && e["sandbox"]["state"] == "running");
        let exited = seen.iter().filter(|e| e["type"] == "command.exited").count();
        sandboxes.iter().all(|(id, _)| running(id)) && exited >= 4
    });
    let ids: Vec<u64> = events.all().iter().map(|e| e["id"].as_u64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids in order: {ids:?}");
    let one = a.call_text(&format!("/v1/events?sandbox_id={id}"));
    let one: Vec<Value> = one.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(one.iter().all(|e| e["sandbox_id"] == id.as_str()), "{one:?}");
    assert!(one.iter().any(|e| e["type"] == "command.exited" && e["command"]["result"]["exit_code"] == 0), "{one:?}");
    assert!(one.iter().any(|e| e["sandbox"]["state"] == "paused"), "{one:?}");
    // Usage adds up what the tenant holds on every node.
    let usage = a.ok("GET", "/v1/usage", None);
    assert_eq!((usage["tenant"].as_str(), usage["sandboxes"].as_u64()), (Some("team-c"), Some(4)), "{usage}");
    assert_eq!(usage["memory_mib"], 4 * 2048, "{usage}");
    assert!(usage["disk"]["roots_reserved_bytes"].as_u64().unwrap_or(0) > 0, "{usage}");

    // Another tenant sees none of it, through either replica.
    let other = Api { url: second.clone(), key: other_key };
    assert!(other.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().is_empty());
    assert_eq!(other.call_text("/v1/events"), "", "another tenant's events");
    assert_eq!(other.call("GET", &format!("/v1/sandboxes/{id}"), None).0, 404);
    assert_eq!(other.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "id"}))).0, 404);
    assert_eq!(Api { url: first.clone(), key: "wrong".into() }.call("GET", "/v1/sandboxes", None).0, 401);
    // A fork through one replica is a sandbox of the cluster's, on its
    // source's node and reachable through the other; a checkpoint, and a
    // snapshot template (made and kept on that node), work through the
    // control plane too.
    let (id, _) = &sandboxes[1];
    a.ok("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo forked > /root/fork.txt"})));
    let forked = a.ok("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({"count": 2})));
    assert_eq!(a.wait_operation(forked["operation"]["id"].as_str().unwrap())["state"], "succeeded", "{forked}");
    let mut extras: Vec<String> =
        forked["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_string()).collect();
    for fork in &extras {
        let ran = b.ok("POST", &format!("/v1/sandboxes/{fork}/exec"), Some(json!({"cmd": "cat /root/fork.txt"})));
        assert_eq!(ran["stdout"], "forked\n", "{ran}");
    }
    let saved = b.ok("POST", &format!("/v1/sandboxes/{id}/checkpoints"), Some(json!({"name": "c1"})));
    assert_eq!(b.wait_operation(saved["operation"]["id"].as_str().unwrap())["state"], "succeeded", "{saved}");
    let listed = a.ok("GET", &format!("/v1/sandboxes/{id}/checkpoints"), None);
    assert_eq!(listed["checkpoints"][0]["name"], "c1", "{listed}");
    let built = a.ok("POST", "/v1/templates", Some(json!({"name": "snap", "from": {"sandbox": id}})));
    assert_eq!(a.wait_operation(built["operation"]["id"].as_str().unwrap())["state"], "succeeded", "{built}");
    // Placed once its node has reported it (every 2 s).
    let made = wait_for("a sandbox of the snapshot template", Duration::from_secs(30), || {
        let (status, made, _) = b.call("POST", "/v1/sandboxes", Some(json!({"template": "snap"})));
        (status == 202).then_some(made)
    });
    assert_eq!(b.wait_operation(made["operation"]["id"].as_str().unwrap())["state"], "succeeded", "{made}");
    extras.push(made["sandbox"]["id"].as_str().unwrap().to_string());
    let ran = a.ok("POST", &format!("/v1/sandboxes/{}/exec", extras[2]), Some(json!({"cmd": "cat /root/fork.txt"})));
    assert_eq!(ran["stdout"], "forked\n", "{ran}");
    for extra in &extras {
        let gone = a.ok("DELETE", &format!("/v1/sandboxes/{extra}"), None);
        assert_eq!(a.wait_operation(gone["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    }
    let (status, deleted, _) = a.call("DELETE", "/v1/templates/snap", None);
    assert_eq!(status, 204, "{deleted}");

    // Quotas hold across nodes and replicas, and a deleted sandbox gives
    // its room back.
    let through_first = Api { url: first.clone(), key: other.key.clone() };
    for round in 0..2 {
        // A deleted sandbox is held until its node's next report (every
        // 2 s) leaves it out: the room comes back within one.
        let mine = wait_for("room for the tenant's one sandbox", Duration::from_secs(30), || {
            let (status, mine, _) =
                other.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256})));
            assert!(status == 202 || (round > 0 && status == 429), "round {round}: {status} {mine}");
            (status == 202).then_some(mine)
        });
        let (status, refused, _) = through_first.call("POST", "/v1/sandboxes", Some(json!({"template": "base"})));
        assert_eq!((status, refused["error"]["code"].as_str()), (429, Some("quota_exceeded")), "{refused}");
        other.wait_operation(mine["operation"]["id"].as_str().unwrap());
        let gone = other.ok("DELETE", &format!("/v1/sandboxes/{}", mine["sandbox"]["id"].as_str().unwrap()), None);
        assert_eq!(other.wait_operation(gone["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    }

    // A disk quota holds across nodes: with 2 GiB held on one node, a
    // create that would pass the quota elsewhere is refused there, and
    // one that fits in what is left is not.
    let disk = Api { url: first.clone(), key: tenant_key(&pg, &control, "team-e", &["--max-disk-mib", "3000"]) };
    let (status, big, big_node) =
        disk.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 6144, "disk_mib": 2048})));
    assert_eq!(status, 202, "{big}");
    assert_eq!(disk.wait_operation(big["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let wanted = json!({"template": "base", "memory_mib": 256, "disk_mib": 2048});
    let (status, refused, refused_on) = disk.call("POST", "/v1/sandboxes", Some(wanted));
    assert_eq!((status, refused["error"]["code"].as_str()), (429, Some("quota_exceeded")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("disk"), "{refused}");
    assert_ne!(refused_on, big_node, "refused by another node, counting what the first holds");
    let (status, small, _) =
        disk.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256, "disk_mib": 512})));
    assert_eq!(status, 202, "{small}");
    assert_eq!(disk.wait_operation(small["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    for made in [&big, &small] {
        let gone = disk.ok("DELETE", &format!("/v1/sandboxes/{}", made["sandbox"]["id"].as_str().unwrap()), None);
        assert_eq!(disk.wait_operation(gone["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    }

    // A replica killed mid-create: the client sends it again, with its
    // Idempotency-Key, through the other replica; one sandbox comes of it.
    let before = b.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().len();
    let replica_key = key.clone();
    let send = move |url: &str| {
        let body = json!({"template": "base", "memory_mib": 256});
        let api = Api { url: url.to_string(), key: replica_key.clone() };
        let answer =
            api.client().call_with("POST", "/v1/sandboxes", &[("Idempotency-Key", "mid-create-1")], Some(&body));
        answer.ok().filter(|answer| (200..300).contains(&answer.status)).map(|answer| answer.body)
    };
    let doomed = first.clone();
    let first_send = send.clone();
    let attempt = std::thread::spawn(move || first_send(&doomed).is_some());
    let mut replicas = replicas;
    let (victim, _) = replicas.remove(0);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let _ = victim.wait_timeout(Duration::from_secs(10));
    let _ = attempt.join();
    let retried = send(&second).expect("the retry through the other replica");
    let op = b.wait_operation(retried["operation"]["id"].as_str().unwrap());
    assert_eq!(op["state"], "succeeded", "{op}");
    let again = send(&second).unwrap();
    assert_eq!(again["operation"]["id"], retried["operation"]["id"], "the key replays");
    let after = b.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().unwrap().len();
    assert_eq!(after, before + 1, "exactly one sandbox for one key");
    let extra = retried["sandbox"]["id"].as_str().unwrap().to_string();
    let a = Api { url: second.clone(), key: key.clone() };

    // A secret put through one replica is listed by the other without its
    // value, and a sandbox on whichever node binds it: the upstream gets
    // the value, the sandbox only a placeholder; a new value is used from
    // the next request; a deleted secret is gone.
    let value = |n: u32| format!("sk-cluster-{}-{n}", std::process::id());
    // Other secrets first, so the set sent to the nodes with the one that
    // matters is larger than a JSON request's bound (1 MiB).
    let fillers: Vec<String> = (0..70).map(|i| format!("zz-fill-{i}")).collect();
    for name in &fillers {
        a.ok("PUT", &format!("/v1/secrets/{name}"), Some(json!({"value": "f".repeat(16 << 10), "hosts": [API_HOST]})));
    }
    let put = a.ok("PUT", "/v1/secrets/llm", Some(json!({"value": value(1), "hosts": [API_HOST]})));
    assert_eq!(put["name"], "llm", "{put}");
    let listed = b.ok("GET", "/v1/secrets", None);
    assert_eq!(listed["secrets"][0]["hosts"], json!([API_HOST]), "{listed}");
    assert!(!listed.to_string().contains(&value(1)), "{listed}");
    let bound = json!({"template": "base", "memory_mib": 256,
        "network": {"egress": "allowlist", "secrets": {"LLM_KEY": {"secret": "llm"}}}});
    let (status, accepted, _) = b.call("POST", "/v1/sandboxes", Some(bound));
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(a.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let keyed = accepted["sandbox"]["id"].as_str().unwrap().to_string();
    let placeholder = b.ok("GET", &format!("/v1/sandboxes/{keyed}"), None)["network"]["secrets"]["LLM_KEY"]
        ["placeholder"]
        .as_str()
        .unwrap()
        .to_string();
    let fetch = format!(
        "import os, urllib.request as u; print(u.urlopen(u.Request('https://{API_HOST}/echo', \
         headers={{'Authorization': 'Bearer ' + os.environ['LLM_KEY']}})).read().decode())"
    );
    for n in [1, 2] {
        if n == 2 {
            b.ok("PUT", "/v1/secrets/llm", Some(json!({"value": value(2), "hosts": [API_HOST]})));
        }
        let ran = a.ok("POST", &format!("/v1/sandboxes/{keyed}/exec"), Some(json!({"argv": ["python3", "-c", fetch]})));
        assert_eq!(ran["stdout"], format!("you sent: Bearer {placeholder}\n"), "{ran}");
        assert_eq!(api_seen.lock().unwrap().last(), Some(&format!("Bearer {}", value(n))));
    }
    let env = a.ok("POST", &format!("/v1/sandboxes/{keyed}/exec"), Some(json!({"cmd": "env"})));
    assert!(!env["stdout"].as_str().unwrap().contains("sk-cluster-"), "a value in the sandbox: {env}");
    for name in &fillers {
        assert_eq!(a.call("DELETE", &format!("/v1/secrets/{name}"), None).0, 204);
    }
    assert_eq!(a.call("DELETE", "/v1/secrets/llm", None).0, 204);
    assert!(b.ok("GET", "/v1/secrets", None)["secrets"].as_array().unwrap().is_empty());
    let gone = a.ok("DELETE", &format!("/v1/sandboxes/{keyed}"), None);
    assert_eq!(b.wait_operation(gone["operation"]["id"].as_str().unwrap())["state"], "succeeded");

    // The unmodified e2b SDK's suite, through the control plane (the
    // replica left standing).
    common::run_e2b_suite_through_a_control_plane(&control, &second, &key, &other.key);

    // Running, or paused by its node for being idle (30 s by default),
    // which the next command resumes.
    let usable = |sandbox: &Value| {
        sandbox["state"] == "running" || (sandbox["state"] == "paused" && sandbox["auto_paused"] == true)
    };

    // The node that built the template dies: its sandboxes are failed
    // within the lease; the other's answer.
    let victim = children.remove(builder.as_str()).unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let _ = victim.wait_timeout(Duration::from_secs(10));
    let lost = on(&builder);
    let deadline = Instant::now() + space_server::cluster::LEASE + Duration::from_secs(20);
    // Until the lease runs out the node is only unreachable (502).
    wait_for("the lost node's sandboxes to be failed", deadline - Instant::now(), || {
        let (status, sandbox, _) = b.call("GET", &format!("/v1/sandboxes/{}", lost[0]), None);
        assert!(status == 200 || status == 502, "{status}: {sandbox}");
        (sandbox["state"] == "failed").then_some(sandbox)
    });
    let failed = b.ok("GET", &format!("/v1/sandboxes/{}", lost[0]), None);
    assert!(failed["failure_reason"].as_str().unwrap_or_default().contains("node lost"), "{failed}");
    for id in others.iter().flat_map(|n| on(n)) {
        let ran = a.ok("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo still here"})));
        assert_eq!(ran["stdout"], "still here\n");
    }
    assert_eq!(a.call("POST", &format!("/v1/sandboxes/{}/exec", lost[0]), Some(json!({"cmd": "true"}))).0, 409);
    // Sandboxes deleted before (other tenants', on whichever nodes) do not
    // come back as lost ones.
    let disk = Api { url: second.clone(), key: disk.key.clone() };
    for tenant in [&other, &disk] {
        let listed = tenant.ok("GET", "/v1/sandboxes", None);
        let states: Vec<&Value> = listed["sandboxes"].as_array().unwrap().iter().map(|s| &s["state"]).collect();
        assert!(states.iter().all(|s| *s == "deleted"), "{listed}");
    }
    // Followers are told (once).
    let failed_event = |e: &Value| {
        e["sandbox_id"] == lost[0].as_str()
            && e["sandbox"]["state"] == "failed"
            && e["sandbox"]["failure_reason"].as_str().unwrap_or_default().contains("node lost")
    };
    events.wait("the lost node's sandboxes failed", |seen| seen.iter().any(failed_event));
    // The template starts sandboxes on the node that pulled it.
    let (status, pulled, placed) =
        a.call("POST", "/v1/sandboxes", Some(json!({"template": "tiny", "memory_mib": 256})));
    assert_eq!(status, 202, "{pulled}");
    assert!(placed.as_deref().is_some_and(|p| others.contains(&p)), "placed on {placed:?}");
    assert_eq!(b.wait_operation(pulled["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let pulled = pulled["sandbox"]["id"].as_str().unwrap().to_string();
    let ran = b.ok("POST", &format!("/v1/sandboxes/{pulled}/exec"), Some(json!({"argv": ["cat", "/srv/hello.txt"]})));
    assert_eq!(ran["stdout"], "from the image\n", "{ran}");
    // Events of sandboxes made after the first replica died still arrive:
    // the feeds it followed were taken over once its claims lapsed.
    events.wait("events from after the replica's death", |seen| {
        [&extra, &pulled].iter().all(|id| seen.iter().any(|e| e["sandbox_id"] == id.as_str() && usable(&e["sandbox"])))
    });

    // The lost node comes back with what still runs, and takes it back.
    let k = NODES.iter().find(|(n, _)| *n == builder).unwrap().1;
    let restarted =
        node(&nets[builder.as_str()], k, &datas[builder.as_str()], &builder, &token, &node_args[builder.as_str()]);
    children.insert(builder.as_str(), restarted);
    // Back as it is there (running, or paused for being idle).
    let back = wait_for("the lost node's sandbox back", Duration::from_secs(60), || {
        let (_, sandbox, _) = a.call("GET", &format!("/v1/sandboxes/{}", lost[0]), None);
        usable(&sandbox).then_some(sandbox)
    });
    assert_eq!(back["id"], lost[0].as_str());
    let ran = b.ok("POST", &format!("/v1/sandboxes/{}/exec", lost[0]), Some(json!({"cmd": "echo back again"})));
    assert_eq!(ran["stdout"], "back again\n");
    events.wait("the lost node's sandbox usable again", |seen| {
        let failed_at = seen.iter().position(failed_event).unwrap();
        seen[failed_at..].iter().any(|e| e["sandbox_id"] == lost[0].as_str() && usable(&e["sandbox"]))
    });
    assert_eq!(events.all().iter().filter(|e| failed_event(e)).count(), 1, "told once");

    for id in sandboxes.iter().map(|(id, _)| id).chain([&extra, &pulled]) {
        let accepted = a.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(b.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    }
    // A template is deleted on every node that has it, and none pulls it back.
    assert_eq!(a.call("DELETE", "/v1/templates/tiny", None).0, 204);
    wait_for("no node to report the template", Duration::from_secs(30), || {
        let nodes = health(&second)["nodes"].as_array().cloned().unwrap_or_default();
        let have = nodes.iter().filter(|n| n["templates"].as_array().is_some_and(|t| t.contains(&json!("tiny"))));
        (have.count() == 0).then_some(())
    });
    assert_eq!(b.call("GET", "/v1/templates/tiny", None).0, 404);
    for child in children.into_values().chain(replicas.into_iter().map(|(c, _)| c)) {
        common::stop(child);
    }
}
