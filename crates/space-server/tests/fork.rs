//! Forks of running sandboxes on real runsc: memory, processes, running
//! commands and disk copied at one instant, each fork its own sandbox.

mod common;

use common::TestServer;
use serde_json::{json, Value};
use space_server::store::Quotas;
use space_server::tenants::create_key;
use space_testkit::{wait_until, TestDataDir, PATIENCE};

/// A background process holding a random token and a counter in memory:
/// each time `/root/bump` appears it removes it, counts one more and
/// writes `token counter` to `/root/counter`.
const COUNTER: &str = "nohup python3 -c '
import os, time
token = os.urandom(8).hex()
n = 0
def show():
    with open(\"/root/counter.new\", \"w\") as f:
        f.write(f\"{token} {n}\")
    os.replace(\"/root/counter.new\", \"/root/counter\")
show()
while True:
    if os.path.exists(\"/root/bump\"):
        os.remove(\"/root/bump\")
        n += 1
        show()
    time.sleep(0.02)
' >/dev/null 2>&1 &";

/// Bumps the counter once and returns `(token, counter)` once it counted.
fn bump(server: &TestServer, id: &str) -> (String, u64) {
    let before = counter(server, id).1;
    server.exec(id, json!({"cmd": "touch /root/bump"}));
    wait_until("the counter to count", PATIENCE, || counter(server, id).1 == before + 1);
    counter(server, id)
}

fn counter(server: &TestServer, id: &str) -> (String, u64) {
    let read = server.exec(
        id,
        json!({"cmd": "for i in $(seq 50); do [ -s /root/counter ] && break; sleep 0.1; done; cat /root/counter"}),
    );
    let text = read["stdout"].as_str().unwrap().to_string();
    let (token, n) = text.split_once(' ').unwrap_or_else(|| panic!("no counter: {read}"));
    (token.to_string(), n.trim().parse().unwrap())
}

fn fork(server: &TestServer, id: &str, body: Value) -> (Vec<String>, Value) {
    let (status, accepted) = server.call("POST", &format!("/v1/sandboxes/{id}/fork"), Some(body));
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(accepted["operation"]["kind"], "fork");
    let forks: Vec<String> =
        accepted["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_string()).collect();
    for sandbox in accepted["sandboxes"].as_array().unwrap() {
        assert_eq!(sandbox["state"], "creating");
        assert_eq!(sandbox["forked_from"], id);
    }
    assert_eq!(accepted["operation"]["forks"], json!(forks));
    let operation = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    (forks, operation)
}

fn stdout(server: &TestServer, id: &str, cmd: &str) -> String {
    let ran = server.exec(id, json!({"cmd": cmd}));
    assert_eq!(ran["result"]["exit_code"], 0, "{cmd}: {ran}");
    ran["stdout"].as_str().unwrap().to_string()
}

#[test]
fn forks_copy_memory_processes_commands_and_disk_and_go_their_own_ways() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let source = server.create_sandbox(json!({"template": "base", "labels": {"role": "source", "team": "a"}}));
    server.exec(&source, json!({"cmd": COUNTER}));
    bump(&server, &source);
    let (token, at_fork) = bump(&server, &source);
    assert_eq!(at_fork, 2);
    server.exec(&source, json!({"cmd": "echo before > /root/shared.txt"}));
    // A command that runs across the fork, started through the API.
    let ticking = server.ok(
        "POST",
        &format!("/v1/sandboxes/{source}/commands"),
        Some(json!({"cmd": "for i in $(seq 1 40); do echo tick$i; sleep 0.1; done", "tag": "ticker"})),
    );
    let ticker = ticking["command"]["id"].as_str().unwrap().to_string();
    wait_until("the ticker to tick", PATIENCE, || {
        common::text_of(&server.output(&source, &ticker, ""), "stdout").contains("tick3")
    });

    let (forks, operation) = fork(&server, &source, json!({"count": 3, "labels": {"role": "fork"}}));
    assert_eq!(operation["state"], "succeeded", "{operation}");
    assert_eq!(forks.len(), 3);
    let frozen = operation["frozen_ms"].as_u64().expect("the operation says how long the source was frozen");
    assert!(frozen < 10_000, "{operation}");

    for (n, fork) in forks.iter().enumerate() {
        let shown = server.ok("GET", &format!("/v1/sandboxes/{fork}"), None);
        assert_eq!(shown["state"], "running", "{shown}");
        assert_eq!(shown["labels"], json!({"role": "fork", "team": "a"}));
        assert_eq!(shown["forked_from"], source.as_str());
        // The same process, with the memory it had at the fork.
        assert_eq!(counter(&server, fork), (token.clone(), 2), "fork {n}");
        for _ in 0..=n {
            bump(&server, fork);
        }
        assert_eq!(stdout(&server, fork, "cat /root/shared.txt"), "before\n");
        server.exec(fork, json!({"cmd": format!("echo fork{n} > /root/own.txt")}));
    }
    // Each counted on its own; the source did not count theirs.
    for (n, fork) in forks.iter().enumerate() {
        assert_eq!(counter(&server, fork), (token.clone(), 3 + n as u64), "fork {n}");
        assert_eq!(stdout(&server, fork, "cat /root/own.txt"), format!("fork{n}\n"));
    }
    assert_eq!(counter(&server, &source), (token.clone(), 2));
    let missing = server.exec(&source, json!({"argv": ["cat", "/root/own.txt"]}));
    assert_ne!(missing["result"]["exit_code"], 0, "a fork's file is not the source's: {missing}");

    // Own identities: id, hostname, and randomness that is not shared.
    let mut seen = std::collections::HashSet::new();
    for id in forks.iter().chain([&source]) {
        let who = stdout(&server, id, "hostname; echo $HOSTNAME; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'");
        let lines: Vec<&str> = who.lines().collect();
        assert_eq!(lines[0], lines[1], "{who}");
        assert!(seen.insert(lines[0].to_string()), "hostnames differ: {who}");
        assert!(seen.insert(lines[2].to_string()), "entropy differs: {who}");
    }

    // The running command goes on in the source and, as a command of its
    // own with a transcript from the fork on, in every fork.
    let frames = server.output(&source, &ticker, "?follow=true");
    assert!(common::text_of(&frames, "stdout").ends_with("tick40\n"));
    assert_eq!(frames.last().unwrap()["result"]["exit_code"], 0, "{frames:?}");
    for fork in &forks {
        let commands = server.ok("GET", &format!("/v1/sandboxes/{fork}/commands"), None);
        let copies: Vec<&Value> =
            commands["commands"].as_array().unwrap().iter().filter(|c| c["tag"] == "ticker").collect();
        assert_eq!(copies.len(), 1, "{commands}");
        let copy = copies[0]["id"].as_str().unwrap();
        assert_ne!(copy, ticker);
        let frames = server.output(fork, copy, "?follow=true");
        let text = common::text_of(&frames, "stdout");
        assert!(text.ends_with("tick40\n"), "{text}");
        assert!(!text.starts_with("tick1\n"), "only what came after the fork: {text}");
        assert_eq!(frames.last().unwrap()["result"]["exit_code"], 0, "{frames:?}");
    }

    // Forks are sandboxes like any other: pause, suspend, resume, delete;
    // deleting the source breaks none of them.
    assert_eq!(server.delete_sandbox(&source)["state"], "succeeded");
    let lifecycle = |id: &str, action: &str| {
        let (status, accepted) = server.call("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
        assert_eq!(status, 202, "{action}: {accepted}");
        server.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"].clone()
    };
    assert_eq!(lifecycle(&forks[0], "pause"), "succeeded");
    assert_eq!(lifecycle(&forks[0], "resume"), "succeeded");
    assert_eq!(lifecycle(&forks[1], "suspend"), "succeeded");
    assert_eq!(lifecycle(&forks[1], "resume"), "succeeded");
    assert_eq!(counter(&server, &forks[0]), (token.clone(), 3));
    assert_eq!(counter(&server, &forks[1]), (token.clone(), 4));
    assert_eq!(bump(&server, &forks[1]), (token.clone(), 5));

    // A fork of a fork.
    let (grandchildren, operation) = fork(&server, &forks[2], json!({}));
    assert_eq!(operation["state"], "succeeded", "{operation}");
    assert_eq!(counter(&server, &grandchildren[0]), (token.clone(), 5));

    // A restarted server re-adopts forks like any sandbox.
    server.stop();
    let server = TestServer::start(&data);
    assert_eq!(counter(&server, &forks[2]), (token.clone(), 5));
    assert_eq!(bump(&server, &grandchildren[0]), (token.clone(), 6));
    for id in forks.iter().chain(&grandchildren) {
        assert_eq!(server.delete_sandbox(id)["state"], "succeeded");
        assert!(!data.data.sandbox_dir(id).exists());
    }
}

#[test]
fn bad_forks_are_refused_and_change_nothing() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let path = format!("/v1/sandboxes/{id}/fork");
    server.error("POST", &path, Some(json!({"count": 0})), 422, "invalid_value");
    server.error("POST", &path, Some(json!({"count": 17})), 422, "invalid_value");
    server.error("POST", &path, Some(json!({"count": 1, "colour": "red"})), 400, "invalid_request");
    server.error("POST", &path, Some(json!({"labels": {"a=b": "c"}})), 422, "invalid_value");
    server.error("POST", "/v1/sandboxes/sbx_00000000000000000000/fork", Some(json!({})), 404, "not_found");
    let (status, _) = server.call("POST", &format!("/v1/sandboxes/{id}/suspend"), None);
    assert_eq!(status, 202);
    wait_until("the sandbox to be suspended", PATIENCE, || {
        server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"] == "suspended"
    });
    server.error("POST", &path, Some(json!({})), 409, "invalid_state");
    let listed = server.ok("GET", "/v1/sandboxes", None);
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 1, "nothing was made: {listed}");

    // The same Idempotency-Key gives the same forks.
    let (status, _) = server.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(status, 202);
    wait_until("the sandbox to run", PATIENCE, || {
        server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"] == "running"
    });
    let auth = format!("Bearer {}", server.key);
    let headers =
        [("Authorization", auth.as_str()), ("Idempotency-Key", "fork-once"), ("Content-Type", "application/json")];
    let first = server.raw("POST", &path, &headers, Some(r#"{"count": 2}"#));
    let second = server.raw("POST", &path, &headers, Some(r#"{"count": 2}"#));
    assert_eq!((first.0, second.0), (202, 202), "{second:?}");
    let (first, second): (Value, Value) =
        (serde_json::from_str(&first.1).unwrap(), serde_json::from_str(&second.1).unwrap());
    assert_eq!(first["operation"]["id"], second["operation"]["id"]);
    assert_eq!(first["operation"]["forks"], second["operation"]["forks"]);
    let operation = server.wait_operation(first["operation"]["id"].as_str().unwrap());
    assert_eq!(operation["state"], "succeeded", "{operation}");
    let listed = server.ok("GET", "/v1/sandboxes", None);
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 3, "{listed}");

    // Quotas count every fork: a tenant that may hold 3 sandboxes and 1536
    // MiB, holding one of 512 MiB, may fork it twice but not three times.
    let quotas = Quotas { max_sandboxes: Some(3), max_memory_mib: Some(1536), ..Quotas::default() };
    let (_, key) = create_key(server.platform.store(), "forker", Some(&quotas)).unwrap();
    let (status, mine) =
        server.call_as(&key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 512})));
    assert_eq!(status, 202, "{mine}");
    let wait_as = |operation: &Value| {
        let path = format!("/v1/operations/{}?wait=60", operation["id"].as_str().unwrap());
        server.call_as(&key, "GET", &path, None).1["state"].clone()
    };
    assert_eq!(wait_as(&mine["operation"]), "succeeded");
    let mine = mine["sandbox"]["id"].as_str().unwrap();
    let path = format!("/v1/sandboxes/{mine}/fork");
    let (status, refused) = server.call_as(&key, "POST", &path, Some(json!({"count": 3})));
    assert_eq!((status, refused["error"]["code"].as_str()), (429, Some("quota_exceeded")), "{refused}");
    let (status, accepted) = server.call_as(&key, "POST", &path, Some(json!({"count": 2})));
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(wait_as(&accepted["operation"]), "succeeded");
    let (status, refused) = server.call_as(&key, "POST", &path, Some(json!({})));
    assert_eq!((status, refused["error"]["code"].as_str()), (429, Some("quota_exceeded")), "{refused}");
    // Another tenant's sandbox cannot be forked (nor seen).
    let (status, hidden) = server.call_as(&key, "POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({})));
    assert_eq!((status, hidden["error"]["code"].as_str()), (404, Some("not_found")), "{hidden}");
}

fn operation_of(server: &TestServer, method: &str, path: &str, body: Option<Value>) -> Value {
    let (status, accepted) = server.call(method, path, body);
    assert_eq!(status, 202, "{path}: {accepted}");
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap())
}

#[test]
fn a_checkpoint_brings_back_memory_files_and_running_commands() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let base = format!("/v1/sandboxes/{id}/checkpoints");
    server.exec(&id, json!({"cmd": COUNTER}));
    let (token, _) = bump(&server, &id);
    server.exec(&id, json!({"cmd": "echo kept > /root/keep.txt"}));
    let ticking = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "for i in $(seq 1 30); do echo tick$i; sleep 0.1; done", "tag": "ticker"})),
    );
    let ticker = ticking["command"]["id"].as_str().unwrap().to_string();

    let saved = operation_of(&server, "POST", &base, Some(json!({"name": "one"})));
    assert_eq!(saved["state"], "succeeded", "{saved}");
    assert_eq!(saved["kind"], "checkpoint");
    assert_eq!(saved["checkpoint"], "one");
    assert!(saved["frozen_ms"].is_u64(), "{saved}");
    let listed = server.ok("GET", &base, None);
    let checkpoints = listed["checkpoints"].as_array().unwrap();
    assert_eq!(checkpoints.len(), 1, "{listed}");
    assert_eq!(checkpoints[0]["name"], "one");
    assert_eq!(checkpoints[0]["commands"], json!([ticker]), "{listed}");
    assert!(checkpoints[0]["size_bytes"].as_u64().unwrap() > 1 << 20, "it holds the memory: {listed}");
    let usage = server.ok("GET", "/v1/usage", None);
    assert!(usage["disk"]["snapshots_bytes"].as_u64().unwrap() > 1 << 20, "it counts as disk: {usage}");

    // Bad requests change nothing.
    server.error("POST", &base, Some(json!({"name": "one"})), 409, "checkpoint_exists");
    server.error("POST", &base, Some(json!({"name": "Not A Name"})), 422, "invalid_value");
    server.error("POST", &base, Some(json!({"name": "x", "extra": 1})), 400, "invalid_request");
    server.error("POST", &format!("{base}/nope/restore"), None, 404, "checkpoint_not_found");
    server.error("DELETE", &format!("{base}/nope"), None, 404, "checkpoint_not_found");

    // The sandbox goes on: more counts, a file deleted, another written.
    bump(&server, &id);
    assert_eq!(bump(&server, &id), (token.clone(), 3));
    server.exec(&id, json!({"cmd": "rm /root/keep.txt; echo later > /root/later.txt"}));

    let restored = operation_of(&server, "POST", &format!("{base}/one/restore"), None);
    assert_eq!(restored["state"], "succeeded", "{restored}");
    assert_eq!(restored["kind"], "restore_checkpoint");
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    assert_eq!(counter(&server, &id), (token.clone(), 1), "the memory of the checkpoint");
    assert_eq!(stdout(&server, &id, "cat /root/keep.txt"), "kept\n", "the deleted file is back");
    let later = server.exec(&id, json!({"argv": ["cat", "/root/later.txt"]}));
    assert_ne!(later["result"]["exit_code"], 0, "what came after is gone: {later}");
    assert_eq!(bump(&server, &id), (token.clone(), 2), "and it counts on from there");

    // The command running at the checkpoint runs again as a new command;
    // the original ended when the sandbox was rolled back.
    let commands = server.ok("GET", &format!("/v1/sandboxes/{id}/commands"), None);
    let tickers: Vec<&Value> =
        commands["commands"].as_array().unwrap().iter().filter(|c| c["tag"] == "ticker").collect();
    assert_eq!(tickers.len(), 2, "{commands}");
    let again = tickers.iter().find(|c| c["id"] != ticker.as_str()).unwrap()["id"].as_str().unwrap().to_string();
    let frames = server.output(&id, &again, "?follow=true");
    assert!(common::text_of(&frames, "stdout").ends_with("tick30\n"), "{frames:?}");
    assert_eq!(frames.last().unwrap()["result"]["exit_code"], 0, "{frames:?}");
    let first = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{ticker}?wait=30"), None);
    assert!(first["result"].is_object(), "{first}");

    // From suspended, and after a restart, too.
    assert_eq!(operation_of(&server, "POST", &format!("/v1/sandboxes/{id}/suspend"), None)["state"], "succeeded");
    server.stop();
    let server = TestServer::start(&data);
    let listed = server.ok("GET", &base, None);
    assert_eq!(listed["checkpoints"].as_array().unwrap().len(), 1, "{listed}");
    let restored = operation_of(&server, "POST", &format!("{base}/one/restore"), None);
    assert_eq!(restored["state"], "succeeded", "{restored}");
    assert_eq!(counter(&server, &id), (token.clone(), 1));

    let auth = format!("Bearer {}", server.key);
    let (status, _) = server.raw("DELETE", &format!("{base}/one"), &[("Authorization", &auth)], None);
    assert_eq!(status, 204);
    assert_eq!(server.ok("GET", &base, None)["checkpoints"], json!([]));
    assert_eq!(operation_of(&server, "POST", &base, Some(json!({"name": "two"})))["state"], "succeeded");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
    assert!(!data.data.sandbox_dir(&id).exists(), "checkpoints go with their sandbox");
}

/// A server in the sandbox that imported modules once: it answers a
/// module's name with its random token and whether the module is loaded.
const IMPORTER: &str = "nohup python3 -c '
import os, socket, sys
import decimal, sqlite3, xml.dom.minidom, email.mime.multipart
token = os.urandom(8).hex()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((\"127.0.0.1\", 7000))
s.listen()
while True:
    c, _ = s.accept()
    name = c.recv(100).decode().strip()
    c.sendall(f\"{token} {name in sys.modules}\\n\".encode())
    c.close()
' >/dev/null 2>&1 &";

/// Asks the importer whether `module` is loaded: `(token, loaded)`.
fn loaded(server: &TestServer, id: &str, module: &str) -> (String, bool) {
    let ask = format!(
        "import socket, time\nfor i in range(100):\n    try:\n        c = socket.create_connection(('127.0.0.1', 7000))\n        break\n    except OSError:\n        time.sleep(0.1)\nc.sendall(b'{module}')\nprint(c.recv(100).decode().strip())"
    );
    let answer = server.exec(id, json!({"argv": ["python3", "-c", ask]}));
    let text = answer["stdout"].as_str().unwrap_or_default().to_string();
    let (token, loaded) = text.split_once(' ').unwrap_or_else(|| panic!("no answer: {answer}"));
    (token.to_string(), loaded.trim() == "True")
}

fn template_from(server: &TestServer, name: &str, from: Value) -> Value {
    let (status, accepted) = server.call("POST", "/v1/templates", Some(json!({"name": name, "from": from})));
    assert_eq!(status, 202, "{accepted}");
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap())
}

#[test]
fn a_snapshot_template_starts_sandboxes_from_a_running_state() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let source = server.create_sandbox(json!({"template": "base", "memory_mib": 512, "env": {"WHO": "source"}}));
    server.exec(&source, json!({"cmd": IMPORTER}));
    let (token, decimal) = loaded(&server, &source, "decimal");
    assert!(decimal);
    assert!(!loaded(&server, &source, "tkinter").1, "the check can tell");
    server.exec(&source, json!({"cmd": "echo prepared > /root/prepared.txt"}));

    // Bad requests change nothing.
    let bad = |body: Value, status: u16, code: &str| server.error("POST", "/v1/templates", Some(body), status, code);
    bad(json!({"name": "x", "from": {"sandbox": source, "debian": {"packages": ["jq"]}}}), 422, "invalid_value");
    bad(json!({"name": "x", "from": {}}), 422, "invalid_value");
    bad(json!({"name": "x", "from": {"sandbox": source}, "defaults": {"memory_mib": 1024}}), 422, "invalid_value");
    bad(json!({"name": "x", "from": {"sandbox": "sbx_00000000000000000000"}}), 404, "not_found");
    bad(json!({"name": "x", "from": {"checkpoint": {"sandbox": source, "name": "nope"}}}), 404, "checkpoint_not_found");

    let built = template_from(&server, "warmed", json!({"sandbox": source}));
    assert_eq!(built["state"], "succeeded", "{built}");
    let template = server.ok("GET", "/v1/templates/warmed", None);
    assert_eq!(template["source"], json!({"sandbox": source}), "{template}");
    assert_eq!(template["defaults"]["memory_mib"], 512, "{template}");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{source}"), None)["state"], "running");
    assert_eq!(loaded(&server, &source, "decimal"), (token.clone(), true), "the source runs on");

    // Sandboxes of it wake with the module already imported, each itself.
    let first = server.create_sandbox(json!({"template": "warmed", "env": {"WHO": "first"}}));
    let second = server.create_sandbox(json!({"template": "warmed"}));
    for id in [&first, &second] {
        assert_eq!(loaded(&server, id, "decimal"), (token.clone(), true), "{id}");
        assert_eq!(loaded(&server, id, "sqlite3"), (token.clone(), true), "{id}");
        assert_eq!(stdout(&server, id, "cat /root/prepared.txt"), "prepared\n");
        assert_eq!(stdout(&server, id, "hostname"), format!("sbx-{}\n", &id[4..]));
    }
    assert_eq!(stdout(&server, &first, "echo $WHO"), "first\n");
    server.exec(&first, json!({"cmd": "echo mine > /root/mine.txt"}));
    assert_ne!(server.exec(&second, json!({"argv": ["cat", "/root/mine.txt"]}))["result"]["exit_code"], 0);
    let entropy = |server: &TestServer, id: &str| stdout(server, id, "head -c 16 /dev/urandom | od -An -tx1");
    assert_ne!(entropy(&server, &first), entropy(&server, &second));
    server.error(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "warmed", "memory_mib": 1024})),
        422,
        "invalid_value",
    );

    // From a checkpoint, too; and through the warm pool.
    let (status, accepted) =
        server.call("POST", &format!("/v1/sandboxes/{source}/checkpoints"), Some(json!({"name": "ready"})));
    assert_eq!(status, 202, "{accepted}");
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    let built = template_from(&server, "fromcheckpoint", json!({"checkpoint": {"sandbox": source, "name": "ready"}}));
    assert_eq!(built["state"], "succeeded", "{built}");
    let third = server.create_sandbox(json!({"template": "fromcheckpoint"}));
    assert_eq!(loaded(&server, &third, "xml.dom.minidom"), (token.clone(), true));
    server.stop();
    let mut config = common::platform_config(&data);
    config.warm_pool = 1;
    config.hot_pool = 1;
    let server = TestServer::start_with(config);
    // Each template's pools (a hot and a warm member): base, warmed and fromcheckpoint.
    wait_until("the pools to fill", PATIENCE, || server.platform.warm().count() == 6);
    assert_eq!(server.platform.warm().hot_count(), 3);
    let hits = server.platform.metrics().warm_hits.get();
    let warm = server.create_sandbox(json!({"template": "warmed"}));
    assert_eq!(server.platform.metrics().warm_hits.get(), hits + 1, "served from the pool");
    assert_eq!(loaded(&server, &warm, "email.mime.multipart"), (token.clone(), true));
    assert_eq!(stdout(&server, &warm, "hostname"), format!("sbx-{}\n", &warm[4..]));
    assert_ne!(entropy(&server, &warm), entropy(&server, &first));
    for id in [&warm, &first, &second, &third, &source] {
        assert_eq!(server.delete_sandbox(id)["state"], "succeeded");
    }
}
