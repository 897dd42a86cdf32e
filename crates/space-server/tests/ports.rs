//! Ports into a sandbox, end to end on runsc: a server a program started
//! inside the sandbox (which has no network device) answers HTTP and
//! WebSocket requests sent to the API, and a raw TCP tunnel.

mod common;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use common::TestServer;
use serde_json::json;
use space_server::tenants::create_key;
use space_testkit::TestDataDir;
use tungstenite::client::IntoClientRequest;
use tungstenite::Message;

/// A server on 127.0.0.1:8000 inside the sandbox: GET and POST say what
/// they got; `/ws` is a WebSocket that echoes text frames.
const APP: &str = r#"
import base64, hashlib, http.server
class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def reply(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
            self.end_headers()
            self.wfile.flush()
            while True:
                head = self.rfile.read(2)
                if len(head) < 2 or head[0] & 0x0f == 8:
                    return
                mask = self.rfile.read(4)
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(head[1] & 0x7f)))
                reply = b"echo: " + data
                self.wfile.write(bytes([0x81, len(reply)]) + reply)
                self.wfile.flush()
        self.reply(f"GET {self.path} host={self.headers['Host']} auth={self.headers.get('Authorization')}".encode())
    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply(b"POST " + self.path.encode() + b" got " + data)
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), App).serve_forever()
"#;

#[test]
fn http_websocket_and_tcp_reach_a_server_inside_the_sandbox_and_only_its_tenant() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let auth = format!("Bearer {}", server.key);

    // Nothing listens yet: a clear 502.
    let closed = server.error("GET", &format!("/v1/sandboxes/{id}/ports/8000/"), None, 502, "port_closed");
    assert!(closed["error"]["message"].as_str().unwrap().contains("8000"), "{closed}");
    server.error("GET", &format!("/v1/sandboxes/{id}/ports/0/"), None, 400, "invalid_request");

    let (status, app) =
        server.call("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": ["python3", "-c", APP]})));
    assert_eq!(status, 201, "{app}");
    space_testkit::wait_until("the app to listen", space_testkit::PATIENCE, || {
        server.raw("GET", &format!("/v1/sandboxes/{id}/ports/8000/up"), &[("Authorization", &auth)], None).0 == 200
    });

    // HTTP: the path and query arrive as the app's own, without the API key.
    let (status, body) =
        server.raw("GET", &format!("/v1/sandboxes/{id}/ports/8000/a/b?c=d"), &[("Authorization", &auth)], None);
    assert_eq!((status, body.as_str()), (200, "GET /a/b?c=d host=localhost:8000 auth=None"));
    let (status, body) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/ports/8000/submit"),
        &[("Authorization", &auth), ("Content-Type", "text/plain")],
        Some("hello app"),
    );
    assert_eq!((status, body.as_str()), (200, "POST /submit got hello app"));
    let (status, body) =
        server.raw("GET", &format!("/v1/sandboxes/{id}/ports/8000"), &[("Authorization", &auth)], None);
    assert_eq!((status, body.as_str()), (200, "GET / host=localhost:8000 auth=None"));

    // WebSocket to the app.
    let ws = server.url.replace("http://", "ws://");
    let mut request = format!("{ws}/v1/sandboxes/{id}/ports/8000/ws").into_client_request().unwrap();
    request.headers_mut().insert("Authorization", auth.parse().unwrap());
    let (mut socket, response) = tungstenite::connect(request).expect("the WebSocket upgrade");
    assert_eq!(response.status(), 101);
    socket.send(Message::Text("ping through the channel".into())).unwrap();
    match socket.read().unwrap() {
        Message::Text(text) => assert_eq!(text.as_str(), "echo: ping through the channel"),
        other => panic!("{other:?}"),
    }
    drop(socket);

    // A raw TCP tunnel: an HTTP request written by hand.
    let mut request = format!("{ws}/v1/sandboxes/{id}/ports/8000").into_client_request().unwrap();
    request.headers_mut().insert("Authorization", auth.parse().unwrap());
    request.headers_mut().insert("Sec-WebSocket-Protocol", "space-tcp".parse().unwrap());
    let (mut tunnel, response) = tungstenite::connect(request).expect("the tunnel");
    assert_eq!(response.headers()["sec-websocket-protocol"], "space-tcp");
    tunnel.send(Message::Binary(b"GET /raw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec().into())).unwrap();
    let mut got = Vec::new();
    while let Ok(message) = tunnel.read() {
        match message {
            Message::Binary(bytes) => got.extend_from_slice(&bytes),
            Message::Close(_) => break,
            _ => {}
        }
    }
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.") && got.ends_with("GET /raw host=x auth=None"), "{got}");

    // Another tenant's key: the sandbox does not exist for it.
    let (_, other) = create_key(server.platform.store(), "other", None).unwrap();
    let (status, _) = server.raw(
        "GET",
        &format!("/v1/sandboxes/{id}/ports/8000/"),
        &[("Authorization", &format!("Bearer {other}"))],
        None,
    );
    assert_eq!(status, 404);

    // A paused sandbox's ports answer 409; after the resume, again 200.
    let (_, paused) = server.call("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    server.wait_operation(paused["operation"]["id"].as_str().unwrap());
    server.error("GET", &format!("/v1/sandboxes/{id}/ports/8000/"), None, 409, "invalid_state");
    let (_, resumed) = server.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    server.wait_operation(resumed["operation"]["id"].as_str().unwrap());
    let (status, _) =
        server.raw("GET", &format!("/v1/sandboxes/{id}/ports/8000/again"), &[("Authorization", &auth)], None);
    assert_eq!(status, 200);
    server.delete_sandbox(&id);
}

/// A server on 127.0.0.1:8001 inside the sandbox that writes every request
/// it gets (request line, every header as received, the body) to
/// /tmp/seen.log; a WebSocket gets the first subprotocol offered and its
/// The recording server (`common/recorder.py`), run with its port.
const RECORDER: &str = include_str!("common/recorder.py");

#[test]
fn the_port_proxy_forwards_no_credential_of_the_caller() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let key = server.key.clone();
    let auth = format!("Bearer {key}");
    let (status, app) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["python3", "-c", RECORDER, "8001"]})),
    );
    assert_eq!(status, 201, "{app}");
    space_testkit::wait_until("the recorder to listen", space_testkit::PATIENCE, || {
        server.raw("GET", &format!("/v1/sandboxes/{id}/ports/8001/up"), &[("Authorization", &auth)], None).0 == 200
    });
    let base = format!("/v1/sandboxes/{id}/ports/8001");
    let bearer = format!("bearer.{}", URL_SAFE_NO_PAD.encode(&key));
    let basic = STANDARD.encode(format!("u:{key}"));

    // HTTP with every credential header SPACE and E2B know, a cookie that
    // holds the key beside the app's own, and a header Connection names.
    let answer = server.by_hand(
        format!(
            "GET {base}/http/a%20b%2Fc?q=%41 HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\n\
             Proxy-Authorization: Basic {basic}\r\nX-API-KEY: {key}\r\nx-api-key: {key}\r\n\
             X-Access-Token: envd-token-0123456789abcdef\r\nE2B-Traffic-Access-Token: traffic-0123456789abcdef\r\n\
             Cookie: app_session=s1; space_key={key}\r\nCookie: theme=dark\r\n\
             Connection: close, X-Per-Hop\r\nX-Per-Hop: 1\r\nX-App: kept\r\n\r\n"
        )
        .as_bytes(),
    );
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("seen"), "{answer}");

    // A browser's WebSocket: the key only in the subprotocol, between two
    // of the app's; the app's choice comes back.
    let ws = server.url.replace("http://", "ws://");
    let mut request = format!("{ws}{base}/ws").into_client_request().unwrap();
    request.headers_mut().insert("Sec-WebSocket-Protocol", format!("chat, {bearer}, v2.app").parse().unwrap());
    request.headers_mut().insert("Cookie", format!("app_session=s1; k={bearer}").parse().unwrap());
    let (mut socket, response) = tungstenite::connect(request).expect("the WebSocket upgrade");
    assert_eq!(response.headers()["sec-websocket-protocol"], "chat");
    socket.send(Message::Text("over the proxy".into())).unwrap();
    match socket.read().unwrap() {
        Message::Text(text) => assert_eq!(text.as_str(), "echo: over the proxy"),
        other => panic!("{other:?}"),
    }
    drop(socket);
    // The key's subprotocol the only one offered: the app is offered none.
    let answer = server.by_hand(
        format!(
            "GET {base}/ws-bearer-only HTTP/1.1\r\nHost: api.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
             Sec-WebSocket-Protocol: {bearer}\r\n\r\n"
        )
        .as_bytes(),
    );
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
    assert!(!answer.to_lowercase().contains("sec-websocket-protocol"), "{answer}");

    // Framing: two Hosts are refused; Content-Length beside
    // Transfer-Encoding never reaches the app as both, and what follows
    // the chunked body is no request of its own.
    let answer = server.by_hand(
        format!("GET {base}/two-hosts HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("invalid_request"), "{answer}");
    let answer = server.by_hand(
        format!(
            "POST {base}/framed HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\nContent-Length: 40\r\n\
             Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nGET {base}/smuggled HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\n\r\n"
        )
        .as_bytes(),
    );
    assert!(answer.starts_with("HTTP/1.1 400") || answer.contains("got hello"), "{answer}");

    let seen = sh_out(&server, &id, "cat /tmp/seen.log");
    let records: Vec<&str> = seen.split("\n----\n").filter(|r| !r.trim().is_empty()).collect();
    let lower = seen.to_lowercase();
    // The key, in every form the caller wrote it, is nowhere.
    for form in [key.clone(), URL_SAFE_NO_PAD.encode(&key), STANDARD_NO_PAD.encode(&key), basic.clone()] {
        assert!(!seen.contains(&form), "the app got the key ({form}):\n{seen}");
    }
    for credential in ["authorization", "x-api-key", "bearer.", "x-access-token", "e2b-", "x-per-hop", "space_key"] {
        assert!(!lower.contains(credential), "the app got {credential}:\n{seen}");
    }
    let http = records.iter().find(|r| r.contains("/http/")).unwrap_or_else(|| panic!("no HTTP request:\n{seen}"));
    assert!(http.starts_with("GET /http/a%20b%2Fc?q=%41 HTTP/1.1"), "{http}");
    assert!(http.to_lowercase().contains("cookie: app_session=s1; theme=dark"), "{http}");
    assert!(http.to_lowercase().contains("x-app: kept"), "{http}");
    let ws = records.iter().find(|r| r.contains("/ws HTTP")).unwrap_or_else(|| panic!("no WebSocket:\n{seen}"));
    assert!(ws.to_lowercase().contains("sec-websocket-protocol: chat, v2.app"), "{ws}");
    assert!(ws.to_lowercase().contains("cookie: app_session=s1\n"), "{ws}");
    for record in &records {
        let record = record.to_lowercase();
        assert_eq!(record.matches("\nhost:").count(), 1, "one Host:\n{record}");
        let framings = record.matches("\ncontent-length:").count() + record.matches("\ntransfer-encoding:").count();
        assert!(framings <= 1, "one framing:\n{record}");
    }
    assert!(!seen.contains("/two-hosts") && !seen.contains("/smuggled"), "{seen}");
    server.delete_sandbox(&id);
}

fn sh_out(server: &TestServer, id: &str, cmd: &str) -> String {
    let answer = server.exec(id, json!({"cmd": cmd, "timeout_s": 60}));
    answer["stdout"].as_str().unwrap_or_default().to_string()
}
