//! Egress through the host's gateway, end to end on real sandboxes: the
//! "internet" is an HTTP server of this test on 127.0.0.1, reached through
//! fixed names (`*.space.test`) and an operator exception for loopback.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use common::{platform_config, TestServer};
use serde_json::{json, Value};
use space_testkit::TestDataDir;

const BIG: u64 = 64 << 20;

/// Answers every request with `upstream saw <request line>`; keeps the
/// request lines it saw.
fn upstream() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let log = log.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                }
                let line = line.trim_end().to_string();
                log.lock().unwrap().push(line.clone());
                let mut stream = stream;
                if line.contains("/hold") {
                    // Holds the connection until the test ends.
                    std::thread::sleep(std::time::Duration::from_secs(120));
                    return;
                }
                if line.contains("/big") {
                    // 64 MiB, streamed: through the relay's flow control.
                    let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", BIG);
                    let chunk = vec![b'z'; 1 << 20];
                    for _ in 0..BIG >> 20 {
                        if stream.write_all(&chunk).is_err() {
                            return;
                        }
                    }
                    return;
                }
                let body = format!("upstream saw {line}");
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    (port, seen)
}

fn py(server: &TestServer, id: &str, code: &str) -> String {
    let ran = server.exec(id, json!({"argv": ["python3", "-c", code], "timeout_s": 60}));
    format!("{}{}", ran["stdout"].as_str().unwrap_or(""), ran["stderr"].as_str().unwrap_or(""))
}

/// A GET through the proxy variables (urllib sends absolute-form requests).
fn get(url: &str) -> String {
    format!(
        "import urllib.request, urllib.error\ntry:\n    print(urllib.request.urlopen('{url}', timeout=20).read().decode())\nexcept urllib.error.HTTPError as e:\n    print('HTTP', e.code, e.read().decode())\nexcept Exception as e:\n    print('FAILED', e)"
    )
}

/// A request inside a CONNECT tunnel through the proxy.
fn tunnel(host: &str, port: u16) -> String {
    format!(
        "import http.client\nc = http.client.HTTPConnection('127.0.0.1', 3128, timeout=20)\nc.set_tunnel('{host}', {port})\ntry:\n    c.request('GET', '/through-the-tunnel')\n    print(c.getresponse().read().decode())\nexcept Exception as e:\n    print('FAILED', e)"
    )
}

fn events(server: &TestServer, id: &str) -> Vec<Value> {
    server.ok("GET", &format!("/v1/sandboxes/{id}/egress"), None)["events"].as_array().unwrap().clone()
}

#[test]
fn allowed_hosts_are_reached_through_the_gateway_and_everything_else_is_refused_with_the_reason() {
    let (port, seen) = upstream();
    let data = TestDataDir::new();
    let mut config = platform_config(&data);
    config.egress = space_server::egress::EgressSettings::parse(
        &["allowed.space.test=127.0.0.1".into(), "denied.space.test=127.0.0.1".into()],
        &["127.0.0.1/32".into()],
    )
    .unwrap();
    let server = TestServer::start_with(config);

    let allow = format!("allowed.space.test:{port}");
    let id = server.create_sandbox(json!({"template": "base", "network": {"egress": "allowlist", "allow": [allow]}}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["network"]["egress"], "allowlist", "{sandbox}");

    // Unchanged tools: urllib reads the proxy variables every command has.
    let out = py(&server, &id, &get(&format!("http://allowed.space.test:{port}/hello?x=1")));
    assert_eq!(out.trim(), "upstream saw GET /hello?x=1 HTTP/1.1", "{out}");
    let out = py(&server, &id, &tunnel("allowed.space.test", port));
    assert_eq!(out.trim(), "upstream saw GET /through-the-tunnel HTTP/1.1", "{out}");

    // A large download streams through whole.
    let code = format!(
        "import urllib.request\nr = urllib.request.urlopen('http://allowed.space.test:{port}/big', timeout=120)\nn = 0\nwhile True:\n    b = r.read(1 << 16)\n    if not b:\n        break\n    n += len(b)\nprint(n)"
    );
    assert_eq!(py(&server, &id, &code).trim(), BIG.to_string());

    // Not allowed: a clear 403 at once, and the name is never looked up.
    let out = py(&server, &id, &get(&format!("http://denied.space.test:{port}/secret")));
    assert!(out.starts_with("HTTP 403") && out.contains("not_allowed"), "{out}");
    assert_eq!(server.platform.egress_lookups("denied.space.test"), Some(0));
    let out = py(&server, &id, &get("http://allowed.space.test:1/"));
    assert!(out.contains("port_not_allowed"), "{out}");
    let out = py(&server, &id, &tunnel("127.0.0.1", port));
    assert!(out.contains("FAILED") && out.contains("403"), "an IP literal without a rule: {out}");
    assert!(!seen.lock().unwrap().iter().any(|l| l.contains("secret")), "nothing denied reached the upstream");

    // Around the proxy: no route out at all.
    let out = py(
        &server,
        &id,
        &format!("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n    print('CONNECTED')\nexcept Exception as e:\n    print('refused', e)"),
    );
    assert!(out.starts_with("refused"), "{out}");

    // Every connection is in the sandbox's egress log, with its decision.
    let log = events(&server, &id);
    let allowed: Vec<&Value> = log.iter().filter(|e| e["decision"] == "allowed").collect();
    let denied: Vec<&Value> = log.iter().filter(|e| e["decision"] == "denied").collect();
    assert_eq!(allowed.len(), 3, "{log:?}");
    assert!(allowed.iter().all(|e| e["host"] == "allowed.space.test" && e["bytes_down"].as_u64() > Some(0)), "{log:?}");
    assert!(allowed.iter().any(|e| e["via"] == "connect") && allowed.iter().any(|e| e["via"] == "http"));
    assert!(denied.iter().any(|e| e["host"] == "denied.space.test" && e["reason"] == "not_allowed"), "{log:?}");

    // A policy change applies at once: a tunnel it no longer allows is cut,
    // a host it now allows works.
    let hold = format!(
        "import http.client, time\nc = http.client.HTTPConnection('127.0.0.1', 3128, timeout=100)\nc.set_tunnel('allowed.space.test', {port})\nc.request('GET', '/hold')\nt = time.time()\ntry:\n    c.getresponse()\n    print('ANSWERED')\nexcept Exception as e:\n    print('CUT', type(e).__name__)"
    );
    let (status, holding) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["python3", "-c", hold], "timeout_s": 100})),
    );
    assert_eq!(status, 201, "{holding}");
    let holding = holding["command"]["id"].as_str().unwrap().to_string();
    space_testkit::wait_until("the tunnel to be open", space_testkit::PATIENCE, || {
        seen.lock().unwrap().iter().any(|l| l.contains("/hold"))
    });
    let changed = server.ok(
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "allowlist", "allow": [format!("denied.space.test:{port}")]})),
    );
    assert_eq!(changed["network"]["allow"][0], format!("denied.space.test:{port}"), "{changed}");
    let ended = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{holding}?wait=60"), None);
    let out = common::text_of(&server.output(&id, &holding, ""), "stdout");
    assert!(out.starts_with("CUT"), "the open tunnel is cut: {out} {ended}");
    let out = py(&server, &id, &get(&format!("http://denied.space.test:{port}/now-allowed")));
    assert_eq!(out.trim(), "upstream saw GET /now-allowed HTTP/1.1", "{out}");
    let out = py(&server, &id, &get(&format!("http://allowed.space.test:{port}/no-longer")));
    assert!(out.contains("not_allowed"), "{out}");
    assert!(events(&server, &id).iter().any(|e| e["reason"] == "policy_changed"));
    let bad = json!({"egress": "allowlist", "allow": ["bad..name"]});
    server.error("PUT", &format!("/v1/sandboxes/{id}/network"), Some(bad), 422, "invalid_value");
    server.ok(
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "allowlist", "allow": [format!("allowed.space.test:{port}")]})),
    );

    // Egress goes on after a suspend and resume, even with a connection
    // held open through the relay when the snapshot is taken; there is no
    // host socket a program could hold instead.
    let listing = py(&server, &id, "import os\nprint(sorted(os.listdir('/.space/host')))");
    assert_eq!(listing.trim(), "[]", "nothing in the host's directory to connect to");
    let (status, held) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["python3", "-c", "import socket, time\ns = socket.create_connection(('127.0.0.1', 3128))\ns.sendall(b'CONNECT allowed.space.test:1 HTTP/1.1')\ntime.sleep(600)"]})),
    );
    assert_eq!(status, 201, "{held}");
    let (_, suspending) = server.call("POST", &format!("/v1/sandboxes/{id}/suspend"), None);
    assert_eq!(server.wait_operation(suspending["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let (_, resuming) = server.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(server.wait_operation(resuming["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let out = py(&server, &id, &get(&format!("http://allowed.space.test:{port}/after-resume")));
    assert_eq!(out.trim(), "upstream saw GET /after-resume HTTP/1.1", "{out}");

    // A sandbox without egress is told so; a bad rule is refused at create.
    let closed = server.create_sandbox(json!({"template": "base"}));
    let out = py(&server, &closed, &get(&format!("http://allowed.space.test:{port}/")));
    assert!(out.starts_with("HTTP 403") && out.contains("egress_disabled"), "{out}");
    let bad = json!({"template": "base", "network": {"egress": "allowlist", "allow": ["*."]}});
    let refused = server.error("POST", "/v1/sandboxes", Some(bad), 422, "invalid_value");
    assert!(refused["error"]["message"].as_str().unwrap().contains("*."), "{refused}");
    let bad = json!({"template": "base", "network": {"egress": "public", "allow": ["a.space.test"]}});
    server.error("POST", "/v1/sandboxes", Some(bad), 422, "invalid_value");
}
