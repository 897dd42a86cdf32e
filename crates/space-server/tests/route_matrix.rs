//! Every route that names a resource, from the served OpenAPI document:
//! tenant B with tenant A's ids — plain, percent-encoded at each position
//! (lower- and upper-case hex), wholly encoded, double-encoded, with dot
//! segments, a trailing slash, in upper case — gets 404, never 2xx, 409 or
//! 5xx; A's shared template is 403 to B's DELETE. With A's key the plain
//! request is not a 404 (the positive control). A route added to the
//! document is covered without touching this test; a new kind of path
//! parameter makes it fail until it says what to put there. A query
//! parameter, a body or an `Idempotency-Key` a route does not take (by the
//! document) is 400.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::TestServer;
use serde_json::{json, Value};
use space_testkit::{busybox_static, TestDataDir};

/// Tenant A's resources, by the path segment before the parameter.
struct Resources {
    by_segment: BTreeMap<&'static str, String>,
}

impl Resources {
    /// What goes in parameter `name` after segment `before`.
    fn value(&self, before: &str, name: &str) -> String {
        let key = match (before, name) {
            ("sandboxes", "id") => "sandboxes",
            ("operations", "id") => "operations",
            ("commands", "cid") => "commands",
            ("contexts", "cid") => "contexts",
            ("checkpoints", "name") => "checkpoints",
            ("templates", "name") => "templates",
            ("secrets", "name") => "secrets",
            ("volumes", "name") => "volumes",
            ("snapshots", "snapshot") => "snapshots",
            ("ports", "port") => "ports",
            (_, "path") => "path",
            _ => panic!("the route matrix does not know what to put in {{{name}}} after /{before}/: add it here"),
        };
        self.by_segment[key].clone()
    }
}

/// A request on its own connection, bytes exactly as given; the status.
/// Framed by hand, not by the API's client: the targets are spellings a
/// client would normalise or refuse (percent-encoded ids, `..` and `.`
/// segments, an encoded `/`), and bodies go where no route takes one (a
/// GET's); one framing for every request keeps the control requests
/// comparable with the probes.
fn status_of(
    server: &TestServer,
    method: &str,
    target: &str,
    key: &str,
    idempotency_key: Option<&str>,
    body: Option<&[u8]>,
) -> u16 {
    let address = server.url.trim_start_matches("http://");
    let mut socket = TcpStream::connect(address).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    socket.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.unwrap_or_default();
    let idempotency = idempotency_key.map(|k| format!("Idempotency-Key: {k}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {target} HTTP/1.1\r\nHost: matrix.test\r\nAuthorization: Bearer {key}\r\n{idempotency}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).unwrap();
    socket.write_all(body).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 8192];
    // The status line is all that is needed; streams may go on.
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(err) => panic!("{method} {target}: {err}"),
        }
    }
    let text = String::from_utf8_lossy(&answer);
    text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{method} {target}: {text:?}"))
}

/// Spellings of one path parameter that a check of the path's text could
/// miss, each a path segment (some several).
fn spellings(value: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, byte) in value.bytes().enumerate() {
        for encoded in [format!("%{byte:02x}"), format!("%{byte:02X}")] {
            let spelled = format!("{}{encoded}{}", &value[..i], &value[i + 1..]);
            if !out.contains(&spelled) {
                out.push(spelled);
            }
        }
    }
    out.push(value.bytes().map(|b| format!("%{b:02X}")).collect());
    out.push(format!("%25{:02x}{}", value.as_bytes()[0], &value[1..]));
    out.push(format!("x/../{value}"));
    out.push(format!("./{value}"));
    out.push(format!("%2e/{value}"));
    out.push(format!("x/%2e%2e/{value}"));
    out.push(format!("{value}%2f"));
    out.push(value.to_uppercase());
    out
}

/// Fills a templated path; `spelled` replaces the parameter at `index`.
fn fill(template: &str, resources: &Resources, spelled: Option<(usize, &str)>) -> String {
    let mut before = "";
    let mut index = 0;
    let mut parts = Vec::new();
    for part in template.split('/') {
        if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            let value = match spelled {
                Some((at, text)) if at == index => text.to_string(),
                _ => resources.value(before, name),
            };
            parts.push(value);
            index += 1;
        } else {
            parts.push(part.to_string());
        }
        before = part;
    }
    parts.join("/")
}

/// The value [`fill`] puts in the parameter at `index`.
fn parameter_value(template: &str, resources: &Resources, index: usize) -> String {
    let mut before = "";
    let mut at = 0;
    for part in template.split('/') {
        if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            if at == index {
                return resources.value(before, name);
            }
            at += 1;
        }
        before = part;
    }
    panic!("{template} has no parameter {index}")
}

fn parameters(template: &str) -> usize {
    template.split('/').filter(|p| p.starts_with('{')).count()
}

/// A one-layer image of busybox: a template of tenant A's in seconds.
fn tiny_image(dir: &std::path::Path) -> std::path::PathBuf {
    let layer = dir.join("layer.tar");
    let mut builder = tar::Builder::new(std::fs::File::create(&layer).unwrap());
    let busybox = std::fs::read(busybox_static()).unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o755);
    header.set_size(busybox.len() as u64);
    header.set_mtime(1_700_000_000);
    builder.append_data(&mut header, "bin/sh", busybox.as_slice()).unwrap();
    builder.into_inner().unwrap();
    let archive = dir.join("image.tar");
    let settings = space_host::oci::ImageSettings { env: vec!["PATH=/bin".into()], working_dir: None, user: None };
    space_host::oci::write_archive(&archive, space_host::oci::ArchiveFormat::DockerSave, &[layer], &settings).unwrap();
    archive
}

fn wait_as(server: &TestServer, key: &str, operation: &str) -> Value {
    space_testkit::wait_for("an operation to end", Duration::from_secs(600), || {
        let (_, op) = server.call_as(key, "GET", &format!("/v1/operations/{operation}?wait=30"), None);
        matches!(op["state"].as_str(), Some("succeeded" | "failed" | "cancelled")).then_some(op)
    })
}

#[test]
fn no_route_gives_one_tenant_another_tenants_resources() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let store = server.platform.store();
    let (_, alice) = space_server::tenants::create_key(store, "alice", None).unwrap();
    let (_, bob) = space_server::tenants::create_key(store, "bob", None).unwrap();

    // Alice's sandbox, a command, a code context, a checkpoint, a template
    // with its build operation, and a secret.
    let (status, created) = server.call_as(&alice, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{created}");
    let sandbox = created["sandbox"]["id"].as_str().unwrap().to_string();
    assert_eq!(wait_as(&server, &alice, created["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let (status, ran) =
        server.call_as(&alice, "POST", &format!("/v1/sandboxes/{sandbox}/exec"), Some(json!({"cmd": "echo hi"})));
    assert_eq!(status, 200, "{ran}");
    let command = ran["command"]["id"].as_str().unwrap().to_string();
    let (status, context) =
        server.call_as(&alice, "POST", &format!("/v1/sandboxes/{sandbox}/contexts"), Some(json!({"language": "bash"})));
    assert_eq!(status, 201, "{context}");
    let context = context["id"].as_str().unwrap().to_string();
    let (status, saving) =
        server.call_as(&alice, "POST", &format!("/v1/sandboxes/{sandbox}/checkpoints"), Some(json!({"name": "first"})));
    assert_eq!(status, 202, "{saving}");
    assert_eq!(wait_as(&server, &alice, saving["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let work = data.root().join("matrix-image");
    std::fs::create_dir_all(&work).unwrap();
    let archive = tiny_image(&work);
    let build = {
        let file = std::fs::File::open(&archive).unwrap();
        let answer = server
            .client_as(&alice)
            .send_with("POST", "/v1/templates?name=alicetpl", &[("Content-Type", "application/x-tar")], file)
            .unwrap_or_else(|e| panic!("importing alice's template: {e}"));
        assert_eq!(answer.status, 202, "importing alice's template: {}", answer.body);
        answer.body["operation"]["id"].as_str().unwrap().to_string()
    };
    assert_eq!(wait_as(&server, &alice, &build)["state"], "succeeded");
    let (status, secret) = server.call_as(
        &alice,
        "PUT",
        "/v1/secrets/alice-token",
        Some(json!({"value": "alice-secret-value", "hosts": ["api.test"]})),
    );
    assert_eq!(status, 200, "{secret}");
    let (status, volume) =
        server.call_as(&alice, "POST", "/v1/volumes", Some(json!({"name": "alicevol", "size_mib": 32})));
    assert_eq!(status, 201, "{volume}");
    let (status, snapshot) =
        server.call_as(&alice, "POST", "/v1/volumes/alicevol/snapshots", Some(json!({"name": "first"})));
    assert_eq!(status, 201, "{snapshot}");

    let resources = Resources {
        by_segment: BTreeMap::from([
            ("sandboxes", sandbox.clone()),
            ("operations", build.clone()),
            ("commands", command),
            ("contexts", context),
            ("checkpoints", "first".to_string()),
            ("templates", "alicetpl".to_string()),
            ("secrets", "alice-token".to_string()),
            ("volumes", "alicevol".to_string()),
            ("snapshots", "first".to_string()),
            ("ports", "8080".to_string()),
            ("path", "x".to_string()),
        ]),
    };

    // Every templated path of the contract, with its methods.
    let (status, document) = server.client().call("GET", "/v1/openapi.json", None).unwrap();
    assert_eq!(status, 200);
    let mut routes: Vec<(String, String)> = Vec::new();
    // What each route takes, as the document says: (query, body,
    // Idempotency-Key).
    let mut takes: BTreeMap<(String, String), (bool, bool, bool)> = BTreeMap::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        if parameters(path) == 0 {
            continue;
        }
        for (method, operation) in item.as_object().unwrap() {
            if ["get", "put", "post", "delete", "patch"].contains(&method.as_str()) {
                routes.push((method.to_uppercase(), path.clone()));
                let parameters = operation["parameters"].as_array().cloned().unwrap_or_default();
                let query = parameters.iter().any(|p| p["in"] == "query");
                let body = !operation["requestBody"].is_null();
                let keyed = parameters.iter().any(|p| p["in"] == "header" && p["name"] == "Idempotency-Key");
                takes.insert((method.to_uppercase(), path.clone()), (query, body, keyed));
            }
        }
    }
    assert!(routes.len() >= 40, "the contract has {} routes with parameters", routes.len());

    // A probe body every JSON route refuses: nothing acts on it. A long
    // Idempotency-Key, where a route takes one: a lifecycle call that got
    // past its owner check refuses it (400) instead of acting, so the
    // positive control changes nothing; a 404 must come before it.
    let probe = br#"{"matrix_probe": true}"#;
    let long_key = "k".repeat(300);
    let keyed = |method: &String, path: &String| takes[&(method.clone(), path.clone())].2.then_some(long_key.as_str());
    let mut requests = 0;
    let mut wrong = Vec::new();
    for (method, path) in &routes {
        // Secrets are named in each tenant's own space: bob's request is
        // about bob's secret of that name, never alice's (checked below).
        let namespaced = path.starts_with("/v1/secrets/");
        for index in 0..parameters(path) {
            let plain = fill(path, &resources, None);
            let own_value = parameter_value(path, &resources, index);
            let mut targets = vec![plain.clone()];
            targets.extend(spellings(&own_value).iter().map(|s| fill(path, &resources, Some((index, s)))));
            targets.push(format!("{plain}/"));
            for target in targets {
                requests += 1;
                let status = status_of(&server, method, &target, &bob, keyed(method, path), Some(probe));
                let allowed = match namespaced {
                    true => [400, 404].contains(&status),
                    false => status == 404,
                };
                if !allowed {
                    wrong.push(format!("bob {method} {target} -> {status}"));
                }
            }
        }
    }
    // Bob's own sandbox with alice's command, context or checkpoint, plain
    // or climbing out of bob's sandbox to alice's (`..%2F`, `%2F`): found
    // only under the sandbox it belongs to, and a name is one segment.
    let (status, own) = server.call_as(&bob, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{own}");
    let bobs = own["sandbox"]["id"].as_str().unwrap().to_string();
    assert_eq!(wait_as(&server, &bob, own["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    // A checkpoint of bob's own, so that his checkpoints directory exists
    // for a `..` to climb out of.
    let (status, saving) =
        server.call_as(&bob, "POST", &format!("/v1/sandboxes/{bobs}/checkpoints"), Some(json!({"name": "bobs"})));
    assert_eq!(status, 202, "{saving}");
    assert_eq!(wait_as(&server, &bob, saving["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    for (method, path) in &routes {
        if !path.starts_with("/v1/sandboxes/{id}/") || path.contains("/ports/") {
            continue;
        }
        for index in 1..parameters(path) {
            let value = parameter_value(path, &resources, index);
            // The collection the parameter is in (`checkpoints`, `commands`…).
            let parts: Vec<&str> = path.split('/').collect();
            let at = parts.iter().enumerate().filter(|(_, p)| p.starts_with('{')).nth(index).unwrap().0;
            let before = parts[at - 1];
            for spelled in [
                value.clone(),
                format!("..%2F{value}"),
                format!("%2F{value}"),
                format!("..%2F..%2F{sandbox}%2F{before}%2F{value}"),
                format!("..%2F..%2F..%2F{sandbox}%2F{before}%2F{value}"),
            ] {
                let target = fill(path, &resources, Some((index, &spelled))).replacen(
                    &format!("/sandboxes/{sandbox}/"),
                    &format!("/sandboxes/{bobs}/"),
                    1,
                );
                requests += 1;
                let status = status_of(&server, method, &target, &bob, keyed(method, path), Some(probe));
                if status != 404 {
                    wrong.push(format!("bob {method} {target} -> {status}"));
                }
            }
        }
    }

    // Shared templates: a tenant's DELETE is refused before anything else.
    for spelled in std::iter::once("base".to_string()).chain(spellings("base")) {
        requests += 1;
        let status = status_of(&server, "DELETE", &format!("/v1/templates/{spelled}"), &bob, None, None);
        // Spellings that do not decode to its name route nowhere or name
        // no template: 404.
        let expected = if !spelled.contains('/') && percent_decode(&spelled) == "base" { 403 } else { 404 };
        if status != expected {
            wrong.push(format!("bob DELETE /v1/templates/{spelled} -> {status} (expected {expected})"));
        }
    }

    // Alice's secret is as she left it; alice's sandbox still runs.
    let (_, listed) = server.call_as(&alice, "GET", "/v1/secrets", None);
    assert!(
        listed["secrets"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "alice-token" && s["hosts"] == json!(["api.test"])),
        "{listed}"
    );
    let (_, after) = server.call_as(&alice, "GET", &format!("/v1/sandboxes/{sandbox}"), None);
    assert_eq!(after["state"], "running", "{after}");

    // What a route does not take is refused, never ignored: a query
    // parameter of a route that takes none, a body on one that takes none,
    // an Idempotency-Key where a repeat would not be made safe (the port
    // proxy passes all on to the server in the sandbox). Alice's own
    // requests, refused before anything acts.
    let mut ignored = Vec::new();
    for (method, path) in &routes {
        let (query, body, keyed_route) = takes[&(method.clone(), path.clone())];
        if path.contains("/ports/") {
            continue;
        }
        let target = fill(path, &resources, None);
        if !query {
            requests += 1;
            let status = status_of(&server, method, &format!("{target}?matrix_probe=1"), &alice, None, None);
            if status != 400 {
                ignored.push(format!("alice {method} {target}?matrix_probe=1 -> {status}"));
            }
        }
        if !body && method != "GET" {
            requests += 1;
            let status = status_of(&server, method, &target, &alice, None, Some(probe));
            if status != 400 {
                ignored.push(format!("alice {method} {target} with a body -> {status}"));
            }
        }
        if !keyed_route && method != "GET" {
            requests += 1;
            let status = status_of(&server, method, &target, &alice, Some("matrix-once"), None);
            if status != 400 {
                ignored.push(format!("alice {method} {target} with an Idempotency-Key -> {status}"));
            }
        }
    }
    assert!(ignored.is_empty(), "accepted and ignored:\n{}", ignored.join("\n"));

    // The positive control: alice's own plain requests find what they name
    // (deletes last, the sandbox's own delete refused by its long key).
    let mut ordered = routes.clone();
    ordered.sort_by_key(|(method, path)| (method == "DELETE", path == "/v1/sandboxes/{id}"));
    let mut missed = Vec::new();
    for (method, path) in &ordered {
        let target = fill(path, &resources, None);
        requests += 1;
        let status = status_of(&server, method, &target, &alice, keyed(method, path), Some(probe));
        if status == 404 {
            missed.push(format!("alice {method} {target} -> 404"));
        }
    }
    println!("route matrix: {} routes, {requests} requests", routes.len());
    eprintln!("route matrix: {} routes, {requests} requests", routes.len());
    assert!(
        wrong.is_empty(),
        "tenant B reached tenant A's resources ({} of {requests}):\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert!(
        missed.is_empty(),
        "tenant A's own requests missed (the matrix would prove nothing):\n{}",
        missed.join("\n")
    );
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
