//! The egress gateway, from inside a sandbox that holds a secret's
//! placeholder: getting the value echoed back in a form the gateway wrote,
//! requests the gateway and the host behind it could read two ways (two
//! Hosts, an absolute URI with another Host, two body lengths), and a
//! secret sent on to a host its owner has since taken off its hosts. The
//! "internet" is two servers of this test on loopback: an HTTPS one for
//! `api.space.test` (the secret's host) and `open.space.test`, echoing
//! every request header, and a plain HTTP one for `allowed.space.test`
//! and `other.space.test`, answering with the head it read.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use serde_json::json;
use space_testkit::TestDataDir;
use tokio_rustls::rustls;

use super::common::{platform_config, TestServer};
use super::{py, Suite};

const DEFENCES: &[(&str, &str)] = &[
    (
        "echo a secret back through Basic auth",
        "every form of a value the gateway wrote goes back to the sandbox as the placeholder form it sent, in \
         headers, bodies (cut anywhere) and trailers: the value, the Basic credentials it encoded again, and the \
         value's base64 at each offset, which catches credentials a host echoes in a later answer \
         (crates/space-egress/src/inspect.rs redactions)",
    ),
    (
        "send two Host headers in a tunnel",
        "each request head in a terminated tunnel is held back and judged before the HTTP server or any secret \
         sees it: more than one Host, none (HTTP/1.1), or another host's answers 400 (crates/space-egress/src/\
         framing.rs)",
    ),
    (
        "front a request with an absolute URI and another Host",
        "plain absolute-form requests go with the Host of their target, whatever the sandbox wrote (RFC 9112 \
         §3.2.2); in a tunnel an absolute target or Host other than the tunnel's answers 400",
    ),
    (
        "smuggle a body with Content-Length and Transfer-Encoding",
        "Content-Length beside Transfer-Encoding, Content-Length twice, or a coding other than chunked answers 400 \
         (RFC 9112 §6.3); a forwarded body is measured and nothing the sandbox sends after it goes on",
    ),
    (
        "narrow a secret's hosts and still send it to the old ones",
        "at each request the gateway reads the secret's hosts as they are now with its value, and adds it only \
         where both the binding (the hosts copied at the bind) and the secret allow; a host taken off is refused \
         like one never bound (403 secret_not_for_host), and the value never leaves (crates/space-egress/src/\
         inspect.rs value_for)",
    ),
];

/// What an upstream read: one entry per request (HTTPS) or connection
/// (plain HTTP).
type Seen = Arc<Mutex<Vec<String>>>;

/// Reads a request head, line by line; `None` at the end.
fn read_head<R: BufRead>(reader: &mut R) -> Option<String> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        head += &line;
        if line == "\r\n" {
            return Some(head);
        }
    }
}

fn content_length(head: &str) -> usize {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The HTTPS upstream (keep-alive): `/last` answers with the authorization
/// of the request before it; anything else with every request header as
/// a response header `x-echo-NAME` and in a JSON body.
fn https_upstream(ca: &space_testkit::TestCa) -> (u16, Seen) {
    let config = ca.server(&["api.space.test".to_string(), "open.space.test".to_string()]);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let (log, last) = (seen.clone(), Arc::new(Mutex::new(String::new())));
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (config, log, last) = (config.clone(), log.clone(), last.clone());
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(60)));
                let Ok(connection) = rustls::ServerConnection::new(config) else { return };
                let mut reader = BufReader::new(rustls::StreamOwned::new(connection, tcp));
                while let Some(head) = read_head(&mut reader) {
                    let mut body = vec![0u8; content_length(&head)];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    log.lock().unwrap().push(head.clone());
                    let headers: Vec<(String, String)> = head
                        .lines()
                        .skip(1)
                        .filter_map(|l| l.split_once(':'))
                        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
                        .collect();
                    let auth: Vec<&str> =
                        headers.iter().filter(|(n, _)| n == "authorization").map(|(_, v)| v.as_str()).collect();
                    let previous = std::mem::replace(&mut *last.lock().unwrap(), auth.join(", "));
                    let mut answer = "HTTP/1.1 200 OK\r\n".to_string();
                    let body = if head.starts_with("GET /last ") {
                        format!("the last request sent {previous}")
                    } else {
                        for (name, value) in &headers {
                            answer += &format!("x-echo-{name}: {value}\r\n");
                        }
                        json!({"headers": headers.iter().map(|(n, v)| json!([n, v])).collect::<Vec<_>>()}).to_string()
                    };
                    answer +=
                        &format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                    let stream = reader.get_mut();
                    if stream.write_all(answer.as_bytes()).and_then(|()| stream.flush()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, seen)
}

/// The plain upstream: reads a head and its Content-Length body, keeps
/// whatever else arrives within a moment (what a gateway let ride behind
/// it), answers with the head and closes.
fn plain_upstream() -> (u16, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let log = log.clone();
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(20)));
                let mut reader = BufReader::new(tcp.try_clone().unwrap());
                let Some(head) = read_head(&mut reader) else { return };
                let mut body = vec![0u8; content_length(&head)];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                // Absence can only be waited for: a moment, bounded.
                let _ = tcp.set_read_timeout(Some(Duration::from_millis(500)));
                let mut rest = reader.buffer().to_vec();
                let mut more = [0u8; 4096];
                while let Ok(n @ 1..) = reader.get_mut().read(&mut more) {
                    rest.extend_from_slice(&more[..n]);
                }
                let got = format!("{head}{}{}", String::from_utf8_lossy(&body), String::from_utf8_lossy(&rest));
                log.lock().unwrap().push(got);
                let answer =
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{head}", head.len());
                let mut tcp = tcp;
                let _ = tcp.write_all(answer.as_bytes());
            });
        }
    });
    (port, seen)
}

/// A Python program for the sandbox: sends `request` (Python bytes
/// expression, `KEY` in scope) raw, in a tunnel to `host` or, without one,
/// as plain HTTP to the proxy, and prints what came back.
fn raw(tunnel: Option<&str>, request: &str) -> String {
    let open = match tunnel {
        Some(host) => format!(
            "s.sendall(b'CONNECT {host}:443 HTTP/1.1\\r\\n\\r\\n')\nhead = b''\nwhile not head.endswith(b'\\r\\n\\r\\n'):\n    b = s.recv(1)\n    if not b:\n        break\n    head += b\nif not head.startswith(b'HTTP/1.1 200'):\n    print('CONNECT refused', head)\n    sys.exit()\ns = ssl.create_default_context().wrap_socket(s, server_hostname='{host}')\n"
        ),
        None => String::new(),
    };
    format!(
        "import base64, os, socket, ssl, sys\nKEY = os.environ['KEY']\ns = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n{open}s.sendall({request})\nout = b''\nwhile True:\n    try:\n        b = s.recv(65536)\n    except Exception:\n        break\n    if not b:\n        break\n    out += b\nsys.stdout.write(out.decode('latin-1'))"
    )
}

/// Whether `text` holds `value`: plain, or inside anything base64.
fn leaks(text: &str, value: &str) -> bool {
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let is_b64 = |c: char| c.is_ascii_alphanumeric() || c == '+' || c == '/' || c == '=';
    text.contains(value)
        || text.split(|c| !is_b64(c)).any(|run| {
            let run = run.trim_end_matches('=');
            // A run may end inside a group: try each cut.
            (0..4).any(|cut| {
                let run = &run[..run.len().saturating_sub(cut)];
                engine.decode(run).is_ok_and(|bytes| String::from_utf8_lossy(&bytes).contains(value))
            })
        })
}

#[test]
fn gateway_attempts_all_fail() {
    let data = TestDataDir::new();
    let ca = space_testkit::TestCa::new(data.root(), "abuse-upstream-ca");
    let (tls_port, tls_seen) = https_upstream(&ca);
    let (plain_port, plain_seen) = plain_upstream();
    let mut config = platform_config(&data);
    let hosts = [
        format!("api.space.test=127.0.0.1:{tls_port}"),
        format!("open.space.test=127.0.0.1:{tls_port}"),
        format!("allowed.space.test=127.0.0.1:{plain_port}"),
        format!("other.space.test=127.0.0.1:{plain_port}"),
    ];
    config.egress = space_server::egress::EgressSettings::parse(&hosts, &["127.0.0.1/32".into()]).unwrap();
    config.egress.trust = vec![ca.file.clone()];
    let server = TestServer::start_with(config);
    let mut suite = Suite::new(DEFENCES);

    // Made of parts, so no command line of this test holds it whole.
    let value = format!("sk-abuse-{}-gateway-value", std::process::id());
    server.ok("PUT", "/v1/secrets/abuse-gateway", Some(json!({"value": value, "hosts": ["api.space.test"]})));
    let both = json!(["api.space.test", "open.space.test"]);
    server.ok("PUT", "/v1/secrets/abuse-narrow", Some(json!({"value": "sk-abuse-wide", "hosts": both})));
    let id = server.create_sandbox(json!({"template": "base", "network": {
        "egress": "allowlist",
        "allow": ["open.space.test", "allowed.space.test"],
        "secrets": {"KEY": {"secret": "abuse-gateway"}, "NARROW": {"secret": "abuse-narrow"}},
    }}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    let placeholder = sandbox["network"]["secrets"]["KEY"]["placeholder"].as_str().unwrap().to_string();
    let b64 = base64::engine::general_purpose::STANDARD;
    let requests_with = |seen: &Seen, needle: &str| seen.lock().unwrap().iter().filter(|h| h.contains(needle)).count();

    // --- The gateway's own Basic encoding, echoed ---
    let echo = "b'GET /echo HTTP/1.1\\r\\nHost: api.space.test\\r\\nAuthorization: Basic ' \
                + base64.b64encode(b'x:' + KEY.encode()) + b'\\r\\nConnection: close\\r\\n\\r\\n'";
    let echoed = py(&server, &id, &raw(Some("api.space.test"), echo));
    let last = "b'GET /last HTTP/1.1\\r\\nHost: api.space.test\\r\\nConnection: close\\r\\n\\r\\n'";
    let later = py(&server, &id, &raw(Some("api.space.test"), last));
    let injected = requests_with(&tls_seen, &b64.encode(format!("x:{value}")));
    let sent_back = echoed.contains(&b64.encode(format!("x:{placeholder}")));
    suite.check(
        "echo a secret back through Basic auth",
        injected == 1
            && echoed.starts_with("HTTP/1.1 200")
            && sent_back
            && !leaks(&echoed, &value)
            && !leaks(&later, &value),
        format!("the host got the value {injected} time(s); the echo: {echoed}; a later answer: {later}"),
    );

    // --- Two Hosts in a tunnel, before any secret is added ---
    let before = tls_seen.lock().unwrap().len();
    let two = "b'GET /echo HTTP/1.1\\r\\nHost: api.space.test\\r\\nHost: open.space.test\\r\\nAuthorization: \
               Bearer ' + KEY.encode() + b'\\r\\nConnection: close\\r\\n\\r\\n'";
    let out = py(&server, &id, &raw(Some("api.space.test"), two));
    let reached = tls_seen.lock().unwrap().len() - before;
    suite.check(
        "send two Host headers in a tunnel",
        out.starts_with("HTTP/1.1 400") && reached == 0 && !leaks(&out, &value),
        format!("{reached} request(s) reached the host; the answer: {out}"),
    );

    // --- An absolute URI with another Host: plain HTTP, and in a tunnel ---
    let fronted = "b'GET http://allowed.space.test/front HTTP/1.1\\r\\nHost: other.space.test\\r\\n\\r\\n'";
    let plain = py(&server, &id, &raw(None, fronted));
    let got = plain_seen.lock().unwrap().iter().find(|h| h.contains("/front")).cloned().unwrap_or_default();
    let hosts: Vec<&str> = got.lines().filter(|l| l.to_ascii_lowercase().starts_with("host:")).collect();
    let before = tls_seen.lock().unwrap().len();
    let absolute = "b'GET https://api.space.test/echo HTTP/1.1\\r\\nHost: open.space.test\\r\\nAuthorization: \
                    Bearer ' + KEY.encode() + b'\\r\\nConnection: close\\r\\n\\r\\n'";
    let tunnelled = py(&server, &id, &raw(Some("api.space.test"), absolute));
    let reached = tls_seen.lock().unwrap().len() - before;
    suite.check(
        "front a request with an absolute URI and another Host",
        plain.starts_with("HTTP/1.1 200")
            && hosts == ["Host: allowed.space.test"]
            && tunnelled.starts_with("HTTP/1.1 400")
            && reached == 0,
        format!("plain: the host read {hosts:?} ({plain}); in a tunnel: {reached} reached it ({tunnelled})"),
    );

    // --- A body with two lengths, and a request riding behind it ---
    let smuggle = "b'POST http://allowed.space.test/smuggle HTTP/1.1\\r\\nHost: allowed.space.test\\r\\n\
                   Content-Length: 55\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n\
                   GET /smuggled HTTP/1.1\\r\\nHost: other.space.test\\r\\n\\r\\n'";
    let plain = py(&server, &id, &raw(None, smuggle));
    let before = tls_seen.lock().unwrap().len();
    let tunnelled_smuggle = "b'POST /echo HTTP/1.1\\r\\nHost: api.space.test\\r\\nContent-Length: 5\\r\\n\
                             Transfer-Encoding: chunked\\r\\nAuthorization: Bearer ' + KEY.encode() + \
                             b'\\r\\n\\r\\n0\\r\\n\\r\\n'";
    let tunnelled = py(&server, &id, &raw(Some("api.space.test"), tunnelled_smuggle));
    let reached = tls_seen.lock().unwrap().len() - before;
    let riding = "b'POST http://allowed.space.test/ride HTTP/1.1\\r\\nContent-Length: 5\\r\\n\\r\\nhello\
                  GET /smuggled HTTP/1.1\\r\\nHost: other.space.test\\r\\n\\r\\n'";
    let rode = py(&server, &id, &raw(None, riding));
    suite.check(
        "smuggle a body with Content-Length and Transfer-Encoding",
        plain.starts_with("HTTP/1.1 400")
            && tunnelled.starts_with("HTTP/1.1 400")
            && reached == 0
            && rode.starts_with("HTTP/1.1 200")
            && requests_with(&plain_seen, "/ride") == 1
            && requests_with(&plain_seen, "/smuggle") == 0,
        format!(
            "plain: {plain}; in a tunnel ({reached} reached the host): {tunnelled}; the upstream read: {:?}",
            plain_seen.lock().unwrap()
        ),
    );

    // --- A secret narrowed after the bind, sent on to the host taken off ---
    let narrowed = format!("sk-abuse-{}-narrowed", std::process::id());
    server.ok("PUT", "/v1/secrets/abuse-narrow", Some(json!({"value": narrowed, "hosts": ["api.space.test"]})));
    let to = |host: &str| {
        format!(
            "b'GET /echo HTTP/1.1\\r\\nHost: {host}\\r\\nAuthorization: Bearer ' + os.environ['NARROW'].encode() \
             + b'\\r\\nConnection: close\\r\\n\\r\\n'"
        )
    };
    let removed = py(&server, &id, &raw(Some("open.space.test"), &to("open.space.test")));
    let kept = py(&server, &id, &raw(Some("api.space.test"), &to("api.space.test")));
    let reached = |host: &str| {
        let host = format!("host: {host}");
        let seen = tls_seen.lock().unwrap();
        seen.iter().filter(|h| h.to_ascii_lowercase().contains(&host) && h.contains(&narrowed)).count()
    };
    let (to_removed, to_kept) = (reached("open.space.test"), reached("api.space.test"));
    suite.check(
        "narrow a secret's hosts and still send it to the old ones",
        sandbox["network"]["secrets"]["NARROW"]["hosts"] == both
            && removed.starts_with("HTTP/1.1 403")
            && removed.contains("secret_not_for_host")
            && to_removed == 0
            && kept.starts_with("HTTP/1.1 200")
            && to_kept == 1,
        format!(
            "bound to {}; the host taken off got the value {to_removed} time(s) ({}); the one kept {to_kept} time(s)",
            sandbox["network"]["secrets"]["NARROW"]["hosts"],
            removed.lines().next().unwrap_or("")
        ),
    );

    suite.tally();
    suite.assert_all_held();
}
