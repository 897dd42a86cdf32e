//! Ports into a sandbox, end to end on runsc: a server a program started
//! inside the sandbox (which has no network device) answers HTTP and
//! WebSocket requests sent to the API, and a raw TCP tunnel.

mod common;

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
    let (_, other) = create_key(&server.platform.store, "other", None).unwrap();
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
