//! Edges where a request was half honoured: a placeholder that stayed after
//! its binding changed, answers that told which sandboxes exist, a route
//! that read its body before its token, network rules dropped on the floor,
//! and an upload refused half way.

use std::time::Duration;

use serde_json::{json, Value};
use space_testkit::TestDataDir;

use super::common::{tar_entry, TestServer};
use super::{sh, Suite};

const DEFENCES: &[(&str, &str)] = &[
    (
        "bind a new secret and keep using the old placeholder",
        "after PUT .../network every command started later gets the network's placeholders as they are now: a new \
         binding's, none of a variable no longer bound (crates/space-server/src/egress.rs give_current_env)",
    ),
    (
        "probe which sandbox ids exist without a key",
        "envd checks the sandbox's access token (derived from the id alone) before it looks the sandbox up: an \
         unknown and an existing id get the same 401",
    ),
    (
        "make an internal route parse a body without its token",
        "every /internal/v1 handler takes the node token as its first extractor: without it, 404 on a single host \
         and 401 on a node, before the path, query or body is read",
    ),
    (
        "ask E2B for a locked-down sandbox and get an open one",
        "E2B's network rules become the sandbox's egress policy (deny-all gives none or an allowlist, never \
         public); rules SPACE would enforce otherwise, every other field it does not honour and unknown fields \
         get an E2B-shaped 400 and make no sandbox",
    ),
    (
        "leave part of a refused tar upload behind",
        "the agent unpacks into a staging directory inside the target and moves the entries into place only once \
         the whole archive is good; a refused upload leaves nothing, not the target directory it made either",
    ),
];

/// A request with a 10 s deadline; (status, body), whatever the status.
/// Framed here, not by the API's client, because what goes through it is
/// what that client must not send: no key or a wrong one, E2B's envd
/// headers, malformed bodies to another server's internal routes.
fn request(url: &str, method: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> (u16, String) {
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(10)).build();
    let mut request = agent.request(method, url);
    for (name, value) in headers {
        request = request.set(name, value);
    }
    let answer = match body {
        Some(body) => request.send_bytes(body),
        None => request.call(),
    };
    match answer {
        Ok(response) | Err(ureq::Error::Status(_, response)) => {
            (response.status(), response.into_string().unwrap_or_default())
        }
        Err(err) => (0, err.to_string()),
    }
}

#[test]
fn edges_attempts_all_fail() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let mut suite = Suite::new(DEFENCES);

    placeholders(&server, &mut suite);
    existence(&server, &mut suite);
    internal_routes(&server, &mut suite);
    e2b_network(&server, &mut suite);
    tar_upload(&server, &mut suite);

    suite.tally();
    suite.assert_all_held();
}

fn placeholders(server: &TestServer, suite: &mut Suite) {
    for (name, host) in [("edge-old", "old.edge.test"), ("edge-new", "new.edge.test")] {
        server.ok("PUT", &format!("/v1/secrets/{name}"), Some(json!({"value": format!("{name}-v"), "hosts": [host]})));
    }
    let id = server.create_sandbox(json!({"template": "base", "network": {
        "egress": "allowlist", "secrets": {"OLD_KEY": {"secret": "edge-old"}}}}));
    let put = server.ok(
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "allowlist", "secrets": {"NEW_KEY": {"secret": "edge-new"}}})),
    );
    let new = put["network"]["secrets"]["NEW_KEY"]["placeholder"].as_str().unwrap_or_default().to_string();
    let (out, _, _) = sh(server, &id, "echo \"${NEW_KEY-unset}|${OLD_KEY-unset}\"");
    suite.check(
        "bind a new secret and keep using the old placeholder",
        new.starts_with("space_ph_") && out.trim() == format!("{new}|unset"),
        format!("the PUT answered NEW_KEY={new:?}; a new command has NEW_KEY|OLD_KEY = {:?}", out.trim()),
    );
    server.delete_sandbox(&id);
}

fn existence(server: &TestServer, suite: &mut Suite) {
    let id = server.create_sandbox(json!({"template": "base"}));
    let last = if id.ends_with('0') { "1" } else { "0" };
    let unknown = format!("{}{last}", &id[..id.len() - 1]);
    let envd = |sandbox: &str, (method, path, body): (&str, &str, Option<&str>), token: Option<&str>| {
        let mut headers = vec![("E2b-Sandbox-Id", sandbox), ("Content-Type", "application/json")];
        if let Some(token) = token {
            headers.push(("X-Access-Token", token));
        }
        request(&format!("{}/e2b/envd{path}", server.url), method, &headers, body.map(str::as_bytes))
    };
    let routes = [
        ("GET", "/health", None),
        ("GET", "/files?path=/etc/hostname", None),
        ("POST", "/filesystem.Filesystem/Stat", Some("{\"path\": \"/etc\"}")),
    ];
    let mut answers = Vec::new();
    for route in routes {
        for token in [None, Some("not-the-token")] {
            let (existing, unknown) = (envd(&id, route, token), envd(&unknown, route, token));
            answers.push((route.1, token.is_some(), existing, unknown));
        }
    }
    let same = answers.iter().all(|(_, _, existing, unknown)| existing.0 == 401 && existing == unknown);
    // The positive control: with its token, the sandbox answers.
    let token = space_server::e2b::envd_token(&server.platform, &id).unwrap();
    let with_token = envd(&id, routes[0], Some(&token)).0;
    let told: Vec<String> = answers
        .iter()
        .map(|(path, bad_token, e, u)| format!("{path} (wrong token: {bad_token}): existing {} / unknown {}", e.0, u.0))
        .collect();
    suite.check(
        "probe which sandbox ids exist without a key",
        same && with_token == 204,
        format!("{}; with the token: {with_token}", told.join("; ")),
    );
    server.delete_sandbox(&id);
}

fn internal_routes(server: &TestServer, suite: &mut Suite) {
    // A node's API on the same platform, with a node token.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let token = "edge-node-token";
    let state = space_server::AppState::node(server.platform.clone(), token.to_string(), Default::default());
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let node = format!("http://{}", listener.local_addr().unwrap());
    runtime.spawn(space_server::serve(listener, state, std::future::pending()));

    let malformed = [
        ("POST", "/internal/v1/secrets", Some("{not json")),
        ("POST", "/internal/v1/secrets", Some("{\"epoch\": \"x\"}")),
        ("POST", "/internal/v1/templates/pull", Some("{not json")),
        ("GET", "/internal/v1/events?after=not-a-number", None),
        ("GET", "/internal/v1/events?unknown=1", None),
    ];
    let mut wrong = Vec::new();
    for (method, path, body) in malformed {
        let json = [("Content-Type", "application/json")];
        let body = body.map(str::as_bytes);
        let single = request(&format!("{}{path}", server.url), method, &json, body).0;
        let bearer = [("Content-Type", "application/json"), ("Authorization", "Bearer not-the-token")];
        let node_without = request(&format!("{node}{path}"), method, &bearer, body).0;
        let with = format!("Bearer {token}");
        let bearer = [("Content-Type", "application/json"), ("Authorization", with.as_str())];
        // The positive control: with the token, the malformed request is refused as such.
        let node_with = request(&format!("{node}{path}"), method, &bearer, body).0;
        if (single, node_without, node_with) != (404, 401, 400) {
            wrong.push(format!(
                "{method} {path}: single host {single}, node without token {node_without}, with {node_with}"
            ));
        }
    }
    suite.check(
        "make an internal route parse a body without its token",
        wrong.is_empty(),
        format!("expected 404 / 401 / 400: {}", wrong.join("; ")),
    );
    runtime.shutdown_timeout(Duration::from_secs(2));
}

fn e2b_network(server: &TestServer, suite: &mut Suite) {
    let count = || server.ok("GET", "/v1/sandboxes", None)["sandboxes"].as_array().map_or(0, Vec::len);
    let mut evidence = Vec::new();
    let mut held = true;
    // Rules SPACE enforces become the sandbox's egress policy (decision
    // 033): never an open one. What it would enforce otherwise, or does
    // not know, is refused and makes nothing.
    let locked = [
        json!({"templateID": "base", "allow_internet_access": true, "network": {"denyOut": ["0.0.0.0/0"]}}),
        json!({"templateID": "base", "network": {"allowOut": ["10.0.0.1"], "denyOut": ["0.0.0.0/0"]}}),
    ];
    let refused = [
        json!({"templateID": "base", "network": {"allowOut": ["10.0.0.1"], "denyOut": ["10.0.0.0/8"]}}),
        json!({"templateID": "base", "network": {"allowOut": ["a.example"]}}),
        json!({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/data", "readOnly": true}]}),
        json!({"templateID": "base", "autoPauseMemory": false}),
        json!({"templateID": "base", "someFutureRule": {"deny": "everything"}}),
    ];
    let client = server.client();
    let headers = [("X-API-KEY", server.key.as_str()), ("Content-Type", "application/json")];
    for ask in locked {
        let (status, body) = client.post_bytes("/e2b/v2/sandboxes", &headers, ask.to_string().as_bytes()).unwrap();
        let answer: Value = serde_json::from_slice(&body).unwrap_or_default();
        let Some(id) = answer["sandboxID"].as_str() else {
            held = false;
            evidence.push(format!("{ask} answered {status} without a sandbox"));
            continue;
        };
        let egress = server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["network"]["egress"].clone();
        if !(egress == "none" || egress == "allowlist") {
            held = false;
            evidence.push(format!("{ask} answered {status} with egress {egress}"));
        }
        server.delete_sandbox(id);
    }
    let before_refused = count();
    for ask in refused {
        let (status, body) = client.post_bytes("/e2b/v2/sandboxes", &headers, ask.to_string().as_bytes()).unwrap();
        let answer: Value = serde_json::from_slice(&body).unwrap_or_default();
        if !(status == 400 && answer["code"] == 400 && answer["message"].is_string()) {
            held = false;
            evidence.push(format!("{ask} answered {status}"));
            if let Some(id) = answer["sandboxID"].as_str() {
                server.delete_sandbox(id);
            }
        }
    }
    let made = count() - before_refused;
    suite.check(
        "ask E2B for a locked-down sandbox and get an open one",
        held && made == 0,
        format!("{}; sandboxes made by refused asks: {made}", evidence.join("; ")),
    );
}

fn tar_upload(server: &TestServer, suite: &mut Suite) {
    let id = server.create_sandbox(json!({"template": "base"}));
    let client = server.client();
    let put = |dir: &str, archive: &[u8]| {
        let path = format!("/v1/sandboxes/{id}/files?path={dir}&format=tar");
        client.call_bytes("PUT", &path, &[], Some(archive)).unwrap_or_else(|e| panic!("PUT {path}: {e}")).status
    };
    // Into a new directory: good entries, then one that climbs out.
    let mut climbing = tar::Builder::new(Vec::new());
    tar_entry(&mut climbing, "first.txt", tar::EntryType::Regular, b"one", None);
    tar_entry(&mut climbing, "sub/", tar::EntryType::Directory, b"", None);
    tar_entry(&mut climbing, "sub/second.txt", tar::EntryType::Regular, b"two", None);
    tar_entry(&mut climbing, "../climbed.txt", tar::EntryType::Regular, b"out", None);
    let climbing = climbing.into_inner().unwrap();
    let status_new = put("/root/edge-new", &climbing);
    // Into a directory with a file: its new content, then a link out and an entry through it.
    sh(server, &id, "mkdir /root/edge-kept && echo old > /root/edge-kept/kept.txt");
    let mut through = tar::Builder::new(Vec::new());
    tar_entry(&mut through, "kept.txt", tar::EntryType::Regular, b"new\n", None);
    tar_entry(&mut through, "fresh.txt", tar::EntryType::Regular, b"fresh", None);
    tar_entry(&mut through, "out", tar::EntryType::Symlink, b"", Some("/etc"));
    tar_entry(&mut through, "out/planted", tar::EntryType::Regular, b"x", None);
    let through = through.into_inner().unwrap();
    let status_kept = put("/root/edge-kept", &through);
    let (left, _, _) = sh(
        server,
        &id,
        "ls -A /root/edge-new 2>&1; ls -A /root/edge-kept; cat /root/edge-kept/kept.txt; ls /etc/planted /root/climbed.txt 2>&1 | grep -vc 'No such'",
    );
    let expected = "ls: cannot access '/root/edge-new': No such file or directory\nkept.txt\nold\n0\n";
    suite.check(
        "leave part of a refused tar upload behind",
        status_new == 400 && status_kept == 400 && left == expected,
        format!("answers {status_new} and {status_kept}; left behind: {left:?}"),
    );
    server.delete_sandbox(&id);
}
