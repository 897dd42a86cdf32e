//! The port proxy as a way to the caller's credentials: a server in the
//! sandbox (code the caller does not trust) records everything a request
//! through `/v1/sandboxes/{id}/ports/{port}/...` brings it.

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use serde_json::json;
use space_testkit::TestDataDir;

use super::common::TestServer;
use super::{sh, Suite};

const DEFENCES: &[(&str, &str)] = &[
    (
        "learn the API key from a WebSocket's subprotocol through the port proxy",
        "the port proxy drops every bearer.* subprotocol (the others go through, in order; none offered when it was \
         the only one) and any header holding the key plain or base64-encoded (api/ports.rs inward_headers)",
    ),
    (
        "learn the caller's cookies and X-API-KEY through the port proxy",
        "the port proxy drops Authorization, Proxy-Authorization, X-API-KEY in any case, X-Access-Token, E2B-* and \
         X-Space-* headers, and every cookie that holds a credential the request presents; SPACE sets no cookie, so \
         the rest are the apps' own and go through",
    ),
    (
        "smuggle through the port proxy with Content-Length and Transfer-Encoding",
        "a request with both is refused (or, as hyper parses it, framed by Transfer-Encoding alone and its connection \
         closed); the app gets one framing and one Host, and what follows the chunked body is no request",
    ),
];

/// The recording server of the port proxy's tests, run with its port.
const RECORDER: &str = include_str!("../common/recorder.py");

/// What the recorder got since the last call (the log is emptied).
fn seen(server: &TestServer, id: &str) -> String {
    sh(server, id, "cat /tmp/seen.log 2>/dev/null; : > /tmp/seen.log").0
}

/// The forms of `key` a caller writes, found in `text`.
fn key_forms_in(key: &str, text: &str) -> Vec<String> {
    let forms = [key.to_string(), URL_SAFE_NO_PAD.encode(key), STANDARD_NO_PAD.encode(key)];
    forms.into_iter().filter(|form| text.contains(form)).collect()
}

#[test]
fn ports_attempts_all_fail() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let mut suite = Suite::new(DEFENCES);
    let id = server.create_sandbox(json!({"template": "base"}));
    let key = server.key.clone();
    let auth = format!("Bearer {key}");
    let (status, app) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["python3", "-c", RECORDER, "8002"]})),
    );
    assert_eq!(status, 201, "{app}");
    let base = format!("/v1/sandboxes/{id}/ports/8002");
    space_testkit::wait_until("the recorder to listen", space_testkit::PATIENCE, || {
        let answer = server.client().call_bytes("GET", &format!("{base}/up"), &[], None);
        answer.unwrap_or_else(|e| panic!("GET {base}/up: {e}")).status == 200
    });
    seen(&server, &id);

    // The attempts below are framed by hand: each is a request the API's
    // client never sends.

    // A browser's WebSocket: the key is only in the subprotocol (a
    // client sends it in Authorization, and does not upgrade).
    let bearer = format!("bearer.{}", URL_SAFE_NO_PAD.encode(&key));
    let answer = server.by_hand(format!(
        "GET {base}/ws HTTP/1.1\r\nHost: api.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
             Sec-WebSocket-Protocol: chat, {bearer}\r\n\r\n"
    ));
    let got = seen(&server, &id);
    suite.check(
        "learn the API key from a WebSocket's subprotocol through the port proxy",
        answer.starts_with("HTTP/1.1 101")
            && got.contains("/ws HTTP")
            && key_forms_in(&key, &got).is_empty()
            && !got.to_lowercase().contains("bearer."),
        format!("{answer}\nthe app got:\n{got}"),
    );

    // The key in X-API-KEY (two spellings), Basic and a cookie: a client
    // sends one header of a name, and no cookie.
    let basic = STANDARD.encode(format!("u:{key}"));
    let answer = server.by_hand(format!(
        "GET {base}/page HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\nX-API-KEY: {key}\r\n\
             x-api-key: {key}\r\nProxy-Authorization: Basic {basic}\r\nCookie: app=1; space_key={key}\r\n\
             Connection: close\r\n\r\n"
    ));
    let got = seen(&server, &id);
    let lower = got.to_lowercase();
    suite.check(
        "learn the caller's cookies and X-API-KEY through the port proxy",
        answer.starts_with("HTTP/1.1 200")
            && key_forms_in(&key, &got).is_empty()
            && !got.contains(&basic)
            && !lower.contains("x-api-key")
            && !lower.contains("authorization")
            && lower.contains("cookie: app=1\n"),
        format!("{answer}\nthe app got:\n{got}"),
    );

    // Both lengths, and a request after the chunked body's end: framing
    // no client writes.
    let answer = server.by_hand(format!(
        "POST {base}/front HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\nContent-Length: 40\r\n\
             Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n\
             GET {base}/smuggled HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\n\r\n"
    ));
    let got = seen(&server, &id).to_lowercase();
    let one_framing = got.split("\n----\n").all(|record| {
        record.matches("\ncontent-length:").count() + record.matches("\ntransfer-encoding:").count() <= 1
            && record.matches("\nhost:").count() <= 1
    });
    suite.check(
        "smuggle through the port proxy with Content-Length and Transfer-Encoding",
        (answer.starts_with("HTTP/1.1 400") || answer.contains("got hello"))
            && one_framing
            && !got.contains("/smuggled"),
        format!("{answer}\nthe app got:\n{got}"),
    );

    server.delete_sandbox(&id);
    suite.tally();
    suite.assert_all_held();
}
