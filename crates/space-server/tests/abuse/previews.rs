//! Preview hosts (`{port}-{id}.preview.space.test`) as a way to the API,
//! to another sandbox, or to the caller's credentials: a recording server
//! in the sandbox (code the caller does not trust) writes down everything a
//! request through its preview host brings it.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde_json::json;
use space_testkit::TestDataDir;

use super::common::{TestServer, PREVIEW_DOMAIN};
use super::{sh, Suite};

const DEFENCES: &[(&str, &str)] = &[
    (
        "reach the API or the console on a preview host",
        "every host in the preview domain is routed before the API's router (preview.rs route_preview): a port's \
         host goes to the sandbox whatever the path, any other name in the domain is 404",
    ),
    (
        "reach the API on a preview name written in upper case or with a trailing dot",
        "the domain is matched case-insensitively and without final dots; inside it, only the exact lower-case \
         spelling names a port (404 otherwise)",
    ),
    (
        "confuse host routing with two Host headers or an absolute-form target",
        "one Host, and a target's authority must agree with it (400)",
    ),
    (
        "learn whether a sandbox exists from its preview host",
        "proofs are derived from the id and checked before any lookup: an unknown sandbox and a private port answer \
         the same 403",
    ),
    (
        "open a private port with a forged cookie or a link signed for another port",
        "links and cookies are HMACs of the keyring over purpose, port, expiry and id",
    ),
    ("open one sandbox's port with another sandbox's preview token", "the token is derived from the sandbox id"),
    (
        "learn the preview token, cookie or API key from a server behind a preview",
        "the proxy drops Authorization, X-API-KEY, X-Space-*, E2B-* headers, the space_preview cookie, bearer.* \
         subprotocols and any header holding a presented credential",
    ),
    (
        "hold a connection open with nothing, or half of HTTP/2's preface",
        "the protocol is decided before a builder sees the connection, within the 10 s head timeout",
    ),
    (
        "smuggle through a preview with Content-Length and Transfer-Encoding",
        "refused (400) or framed by one of them: the app gets one framing and one Host",
    ),
];

/// The recording server of the port proxy's tests, run with its port.
const RECORDER: &str = include_str!("../common/recorder.py");

fn seen(server: &TestServer, id: &str) -> String {
    sh(server, id, "cat /tmp/seen.log 2>/dev/null; : > /tmp/seen.log").0
}

fn host(id: &str, port: u16) -> String {
    format!("{port}-{}.{PREVIEW_DOMAIN}", id.replace('_', "-"))
}

#[test]
fn previews_attempts_all_fail() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let mut suite = Suite::new(DEFENCES);
    let id = server.create_sandbox(json!({"template": "base"}));
    let other = server.create_sandbox(json!({"template": "base"}));
    let key = server.key.clone();
    let (status, app) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"argv": ["python3", "-c", RECORDER, "8002"]})),
    );
    assert_eq!(status, 201, "{app}");
    let token =
        server.ok("GET", &format!("/v1/sandboxes/{id}/ports"), None)["preview_token"].as_str().unwrap().to_string();
    let other_token =
        server.ok("GET", &format!("/v1/sandboxes/{other}/ports"), None)["preview_token"].as_str().unwrap().to_string();
    let app_host = host(&id, 8002);
    space_testkit::wait_until("the recorder to listen", space_testkit::PATIENCE, || {
        let answer = server.by_hand(format!(
            "GET /up HTTP/1.1\r\nHost: {app_host}\r\nX-Space-Preview-Token: {token}\r\nConnection: close\r\n\r\n"
        ));
        answer.starts_with("HTTP/1.1 200")
    });
    seen(&server, &id);

    // The API's paths, with the API key, on the port's host: the app's.
    let answer = server.by_hand(format!(
        "GET /v1/sandboxes HTTP/1.1\r\nHost: {app_host}\r\nAuthorization: Bearer {key}\r\n\
         X-Space-Preview-Token: {token}\r\nConnection: close\r\n\r\n"
    ));
    let got = seen(&server, &id);
    let private_api = server.by_hand(format!(
        "GET /v1/openapi.json HTTP/1.1\r\nHost: {app_host}\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
    ));
    let console = server.by_hand(format!("GET / HTTP/1.1\r\nHost: api.{PREVIEW_DOMAIN}\r\nConnection: close\r\n\r\n"));
    let bare = server.by_hand(format!(
        "GET /v1/health HTTP/1.1\r\nHost: {PREVIEW_DOMAIN}:80\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
    ));
    suite.check(
        "reach the API or the console on a preview host",
        answer.starts_with("HTTP/1.1 200")
            && got.contains("GET /v1/sandboxes HTTP")
            && !answer.contains("\"sandboxes\"")
            && private_api.starts_with("HTTP/1.1 403")
            && !private_api.contains("openapi")
            && console.starts_with("HTTP/1.1 404")
            && bare.starts_with("HTTP/1.1 404")
            && !bare.contains("\"ok\""),
        format!("{answer}\n{private_api}\n{console}\n{bare}\nthe app got:\n{got}"),
    );

    let shouted = server.by_hand(format!(
        "GET /v1/sandboxes HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n",
        app_host.to_uppercase()
    ));
    let dotted = server.by_hand(format!(
        "GET /v1/sandboxes HTTP/1.1\r\nHost: api.{PREVIEW_DOMAIN}..\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
    ));
    suite.check(
        "reach the API on a preview name written in upper case or with a trailing dot",
        shouted.starts_with("HTTP/1.1 404") && dotted.starts_with("HTTP/1.1 404") && !shouted.contains("\"sandboxes\""),
        format!("{shouted}\n{dotted}"),
    );

    let two_hosts = server.by_hand(format!(
        "GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: {app_host}\r\nAuthorization: Bearer {key}\r\n\
         Connection: close\r\n\r\n"
    ));
    let absolute = server.by_hand(format!(
        "GET http://127.0.0.1/v1/sandboxes HTTP/1.1\r\nHost: {app_host}\r\nAuthorization: Bearer {key}\r\n\
         Connection: close\r\n\r\n"
    ));
    let absolute_preview = server.by_hand(format!(
        "GET http://{app_host}/v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\
         Connection: close\r\n\r\n"
    ));
    suite.check(
        "confuse host routing with two Host headers or an absolute-form target",
        [&two_hosts, &absolute, &absolute_preview].iter().all(|a| a.starts_with("HTTP/1.1 400")),
        format!("{two_hosts}\n{absolute}\n{absolute_preview}"),
    );

    let private = server.by_hand(format!("GET / HTTP/1.1\r\nHost: {app_host}\r\nConnection: close\r\n\r\n"));
    let nobody = server.by_hand(format!(
        "GET / HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        host("sbx_00000000000000000000", 8002)
    ));
    let body = |answer: &str| answer.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    suite.check(
        "learn whether a sandbox exists from its preview host",
        private.starts_with("HTTP/1.1 403") && nobody.starts_with("HTTP/1.1 403") && body(&private) == body(&nobody),
        format!("{private}\n{nobody}"),
    );

    let link = server.ok("GET", &format!("/v1/sandboxes/{id}/ports/8003/link"), None);
    let query = link["url"].as_str().unwrap().split_once('?').unwrap().1.to_string();
    let moved = server.by_hand(format!(
        "GET /__space/preview-link?{query} HTTP/1.1\r\nHost: {app_host}\r\nConnection: close\r\n\r\n"
    ));
    let forged = server.by_hand(format!(
        "GET / HTTP/1.1\r\nHost: {app_host}\r\nCookie: space_preview=9999999999.{}\r\nConnection: close\r\n\r\n",
        "0".repeat(48)
    ));
    suite.check(
        "open a private port with a forged cookie or a link signed for another port",
        moved.starts_with("HTTP/1.1 403") && !moved.contains("set-cookie") && forged.starts_with("HTTP/1.1 403"),
        format!("{moved}\n{forged}"),
    );

    let crossed = server.by_hand(format!(
        "GET / HTTP/1.1\r\nHost: {app_host}\r\nX-Space-Preview-Token: {other_token}\r\n\
         E2B-Traffic-Access-Token: {other_token}\r\nConnection: close\r\n\r\n"
    ));
    suite.check(
        "open one sandbox's port with another sandbox's preview token",
        crossed.starts_with("HTTP/1.1 403"),
        &crossed,
    );

    // Every credential at once, on a WebSocket and on a plain request.
    let opened = server.by_hand(format!(
        "GET /__space/preview-link?{} HTTP/1.1\r\nHost: {app_host}\r\nConnection: close\r\n\r\n",
        server.ok("GET", &format!("/v1/sandboxes/{id}/ports/8002/link"), None)["url"]
            .as_str()
            .unwrap()
            .split_once('?')
            .unwrap()
            .1
    ));
    let cookie = opened
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .and_then(|c| c.split(';').next())
        .unwrap_or("space_preview=missing")
        .to_string();
    let bearer = format!("bearer.{}", URL_SAFE_NO_PAD.encode(&key));
    let ws = server.by_hand(format!(
        "GET /ws HTTP/1.1\r\nHost: {app_host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: chat, {bearer}\r\nCookie: {cookie}; app=1\r\nX-Space-Preview-Token: {token}\r\n\r\n"
    ));
    let plain = server.by_hand(format!(
        "GET /page HTTP/1.1\r\nHost: {app_host}\r\nAuthorization: Bearer {key}\r\nX-API-KEY: {key}\r\n\
         X-Space-Preview-Token: {token}\r\nE2B-Traffic-Access-Token: {token}\r\nX-Note: {token}\r\n\
         Cookie: {cookie}; app=2\r\nConnection: close\r\n\r\n"
    ));
    let got = seen(&server, &id);
    let cookie_value = cookie.split_once('=').map(|(_, v)| v).unwrap_or("missing");
    let lower = got.to_lowercase();
    suite.check(
        "learn the preview token, cookie or API key from a server behind a preview",
        ws.starts_with("HTTP/1.1 101")
            && plain.starts_with("HTTP/1.1 200")
            && cookie != "space_preview=missing"
            && !got.contains(&key)
            && !got.contains(&token)
            && !got.contains(cookie_value)
            && !lower.contains("space_preview")
            && !lower.contains("bearer.")
            && lower.contains("cookie: app=1")
            && lower.contains("cookie: app=2"),
        format!("{opened}\n{ws}\n{plain}\nthe app got:\n{got}"),
    );

    let answer = server.by_hand(format!(
        "POST /front HTTP/1.1\r\nHost: {app_host}\r\nX-Space-Preview-Token: {token}\r\nContent-Length: 40\r\n\
         Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n\
         GET /smuggled HTTP/1.1\r\nHost: {app_host}\r\nX-Space-Preview-Token: {token}\r\n\r\n"
    ));
    let got = seen(&server, &id).to_lowercase();
    let one_framing = got.split("\n----\n").all(|record| {
        record.matches("\ncontent-length:").count() + record.matches("\ntransfer-encoding:").count() <= 1
            && record.matches("\nhost:").count() <= 1
    });
    suite.check(
        "smuggle through a preview with Content-Length and Transfer-Encoding",
        (answer.starts_with("HTTP/1.1 400") || answer.contains("got hello"))
            && one_framing
            && !got.contains("/smuggled"),
        format!("{answer}\nthe app got:\n{got}"),
    );

    // HTTP/2 is served beside 1.1 now: a connection that sends nothing, or
    // stops inside the preface, is cut off as a slow head is.
    let held = |opening: &[u8]| {
        use std::io::{Read, Write};
        let started = std::time::Instant::now();
        let mut socket = std::net::TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
        socket.write_all(opening).unwrap();
        socket.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        let mut rest = Vec::new();
        let _ = socket.read_to_end(&mut rest);
        started.elapsed()
    };
    let (silent, half) = (held(b""), held(b"PRI * HTTP/2.0\r\n"));
    suite.check(
        "hold a connection open with nothing, or half of HTTP/2's preface",
        silent < std::time::Duration::from_secs(25) && half < std::time::Duration::from_secs(25),
        format!("{silent:?} {half:?}"),
    );

    server.delete_sandbox(&id);
    server.delete_sandbox(&other);
    suite.tally();
    suite.assert_all_held();
}
