//! Previews end to end on runsc: a web app in a sandbox reached on its own
//! host name `{port}-{id}.preview.space.test` (every name resolved to the
//! test server, as wildcard DNS would): private by default (the preview
//! token, or a signed link's cookie), public as its owner says, never the
//! API, never a credential of the caller forwarded; and a sandbox used only
//! through a preview is not idle-paused.

mod common;

use std::time::Duration;

use common::{TestServer, PREVIEW_DOMAIN};
use serde_json::{json, Value};
use space_testkit::{wait_until, TestDataDir, PATIENCE};
use tungstenite::client::IntoClientRequest;
use tungstenite::Message;

const WEBAPP: &str = include_str!("common/webapp.py");

/// A client that resolves every name to the test server (wildcard DNS),
/// and follows no redirect.
fn browser(server: &TestServer) -> ureq::Agent {
    let addr: std::net::SocketAddr = server.url.trim_start_matches("http://").parse().unwrap();
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .redirects(0)
        .resolver(move |_: &str| Ok(vec![addr]))
        .build()
}

struct Answer {
    status: u16,
    set_cookie: Option<String>,
    location: Option<String>,
    body: String,
}

fn send(agent: &ureq::Agent, method: &str, url: &str, headers: &[(&str, &str)], body: Option<&str>) -> Answer {
    let mut request = agent.request(method, url);
    for (name, value) in headers {
        request = request.set(name, value);
    }
    let result = match body {
        Some(body) => request.send_string(body),
        None => request.call(),
    };
    let response = match result {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(err) => panic!("{method} {url}: {err}"),
    };
    Answer {
        status: response.status(),
        set_cookie: response.header("set-cookie").map(str::to_string),
        location: response.header("location").map(str::to_string),
        body: response.into_string().unwrap_or_default(),
    }
}

/// The app's port on its preview host, with the test server's port.
fn preview_url(server: &TestServer, id: &str, port: u16, path: &str) -> String {
    let listener = server.url.rsplit(':').next().unwrap();
    format!("http://{port}-{}.{PREVIEW_DOMAIN}:{listener}{path}", id.replace('_', "-"))
}

/// Starts the web app on `port` in the sandbox and waits until it answers.
pub fn start_webapp(server: &TestServer, id: &str, port: u16) {
    let auth = format!("Bearer {}", server.key);
    let (status, _) = server.raw(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/root/webapp.py"),
        &[("Authorization", &auth)],
        Some(WEBAPP),
    );
    assert!((200..300).contains(&status), "writing the app: {status}");
    // Detached: no command of the sandbox runs (which would keep it from
    // being idle by itself).
    server.exec(id, json!({"cmd": format!("nohup python3 /root/webapp.py {port} >/tmp/webapp.log 2>&1 &")}));
    wait_until("the app to listen", PATIENCE, || {
        server.raw("GET", &format!("/v1/sandboxes/{id}/ports/{port}/up"), &[("Authorization", &auth)], None).0 == 200
    });
}

fn seen(answer: &Answer) -> Value {
    assert_eq!(answer.status, 200, "{}", answer.body);
    serde_json::from_str(&answer.body).unwrap_or_else(|e| panic!("{e}: {}", answer.body))
}

#[test]
fn a_port_on_its_own_host_is_private_until_its_token_link_or_owner_opens_it() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    start_webapp(&server, &id, 8000);
    let web = browser(&server);
    let page = preview_url(&server, &id, 8000, "/");
    let auth = format!("Bearer {}", server.key);

    // Private: nothing, the API key, a wrong token all get the same 403;
    // so does a sandbox that does not exist (nothing says whether it does).
    let refused = send(&web, "GET", &page, &[], None);
    assert_eq!(refused.status, 403, "{}", refused.body);
    let refused: Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(refused["error"]["code"], "forbidden");
    assert_eq!(send(&web, "GET", &page, &[("Authorization", &auth)], None).status, 403);
    assert_eq!(send(&web, "GET", &page, &[("X-Space-Preview-Token", "0123456789abcdef")], None).status, 403);
    let nobody = preview_url(&server, "sbx_00000000000000000000", 8000, "/");
    let unknown = send(&web, "GET", &nobody, &[], None);
    assert_eq!((unknown.status, serde_json::from_str::<Value>(&unknown.body).unwrap()), (403, refused));
    // A name in the domain that names no port: 404, never the API.
    for host_path in [format!("http://{PREVIEW_DOMAIN}"), format!("http://api.{PREVIEW_DOMAIN}")] {
        let listener = server.url.rsplit(':').next().unwrap();
        let answer =
            send(&web, "GET", &format!("{host_path}:{listener}/v1/sandboxes"), &[("Authorization", &auth)], None);
        assert_eq!(answer.status, 404, "{host_path}: {}", answer.body);
    }

    // The preview token opens every port of the sandbox.
    let ports = server.ok("GET", &format!("/v1/sandboxes/{id}/ports"), None);
    assert_eq!(ports["preview_domain"], PREVIEW_DOMAIN);
    assert_eq!(ports["ports"], json!([]));
    let token = ports["preview_token"].as_str().unwrap().to_string();
    let by_token = [("X-Space-Preview-Token", token.as_str()), ("Authorization", auth.as_str())];
    let got = seen(&send(&web, "GET", &preview_url(&server, &id, 8000, "/a/b?c=d"), &by_token, None));
    assert_eq!(got["path"], "/a/b?c=d");
    let headers = got["headers"].as_object().unwrap();
    assert_eq!(headers["host"], "localhost:8000");
    assert_eq!(headers["x-forwarded-proto"], "http");
    assert!(headers["x-forwarded-host"].as_str().unwrap().starts_with("8000-sbx-"), "{got}");
    for credential in ["authorization", "x-space-preview-token"] {
        assert!(!headers.contains_key(credential), "{credential} reached the app: {got}");
    }
    assert!(!got.to_string().contains(&token) && !got.to_string().contains(&server.key), "{got}");
    // An API path on a preview host is the app's.
    let got = seen(&send(&web, "GET", &preview_url(&server, &id, 8000, "/v1/sandboxes"), &by_token, None));
    assert_eq!(got["path"], "/v1/sandboxes");
    // E2B's SDK writes the id as it is, with its `_`.
    let e2b_host = format!("{}/whoami", page.trim_end_matches('/').replace("sbx-", "sbx_"));
    assert_eq!(seen(&send(&web, "GET", &e2b_host, &by_token, None))["path"], "/whoami");

    // A WebSocket through the preview host.
    let ws_url = preview_url(&server, &id, 8000, "/ws").replace("http://", "ws://");
    let mut request = ws_url.into_client_request().unwrap();
    request.headers_mut().insert("X-Space-Preview-Token", token.parse().unwrap());
    let tcp = std::net::TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let (mut socket, response) = tungstenite::client(request, tcp).expect("the WebSocket upgrade");
    assert_eq!(response.status(), 101);
    socket.send(Message::Text("through the preview".into())).unwrap();
    match socket.read().unwrap() {
        Message::Text(text) => assert_eq!(text.as_str(), "echo: through the preview"),
        other => panic!("{other:?}"),
    }
    drop(socket);

    // HTTP/2 (cleartext, prior knowledge) reaches the app as well.
    let listener = server.url.rsplit(':').next().unwrap();
    let h2_host = format!("8000-{}.{PREVIEW_DOMAIN}", id.replace('_', "-"));
    let mut curl = std::process::Command::new("curl");
    curl.args(["-sS", "--http2-prior-knowledge", "--max-time", "60", "-w", "\n%{http_version}"])
        .args(["--resolve", &format!("{h2_host}:{listener}:127.0.0.1")])
        .args(["-H", &format!("X-Space-Preview-Token: {token}")])
        .arg(format!("http://{h2_host}:{listener}/over-h2"));
    // The server's reaper waits for every child of this process.
    let curl = space_process::Reaper::global().output(&mut curl).expect("curl (scripts/lib.sh installs it)");
    let said = String::from_utf8_lossy(&curl.stdout);
    let (body, version) = said.rsplit_once('\n').unwrap_or_default();
    assert_eq!(version, "2", "{said} {}", String::from_utf8_lossy(&curl.stderr));
    let got: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {said}"));
    assert_eq!(got["path"], "/over-h2");
    assert!(!got.to_string().contains(&token), "{got}");

    // Server-sent events stream through.
    let events = send(&web, "GET", &preview_url(&server, &id, 8000, "/events"), &by_token, None);
    assert_eq!(events.body, "data: tick 0\n\ndata: tick 1\n\ndata: tick 2\n\n");

    // A large upload and download stream through (never buffered whole).
    let upload = "x".repeat(24 << 20);
    let got = seen(&send(&web, "POST", &preview_url(&server, &id, 8000, "/upload"), &by_token, Some(&upload)));
    use sha2::Digest as _;
    assert_eq!(got["sha256"], format!("{:x}", sha2::Sha256::digest(upload.as_bytes())));
    let big = web.get(&preview_url(&server, &id, 8000, "/big?mib=64")).set("X-Space-Preview-Token", &token).call();
    let mut reader = big.expect("the download").into_reader();
    let read = std::io::copy(&mut reader, &mut std::io::sink()).unwrap();
    assert_eq!(read, 64 << 20);

    // A signed link: opened, it sets a cookie for that one host and sends
    // the browser to `/`; the cookie then opens the port, and never
    // reaches the app.
    let link = server.ok("GET", &format!("/v1/sandboxes/{id}/ports/8000/link"), None);
    assert_eq!((link["port"].as_u64(), link["public"].as_bool()), (Some(8000), Some(false)));
    let url = link["url"].as_str().unwrap();
    assert!(url.starts_with(&page), "{url} is not on {page}");
    let opened = send(&web, "GET", url, &[], None);
    assert_eq!((opened.status, opened.location.as_deref()), (303, Some("/")), "{}", opened.body);
    let cookie = opened.set_cookie.unwrap();
    for attribute in ["HttpOnly", "SameSite=Lax", "Path=/"] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    assert!(!cookie.contains("Domain") && !cookie.contains("Secure"), "{cookie}");
    let pair = cookie.split(';').next().unwrap().to_string();
    let with_cookie = format!("{pair}; app_session=mine");
    let got = seen(&send(&web, "GET", &preview_url(&server, &id, 8000, "/seen"), &[("Cookie", &with_cookie)], None));
    assert_eq!(got["cookie"], "app_session=mine", "{got}");
    // Another port, or another sandbox, takes neither the cookie nor the link.
    assert_eq!(send(&web, "GET", &preview_url(&server, &id, 8001, "/"), &[("Cookie", &pair)], None).status, 403);
    let elsewhere = url.replace("8000-", "8001-");
    assert_eq!(send(&web, "GET", &elsewhere, &[], None).status, 403);
    // A link tampered with, or past its time, is refused.
    let tampered = format!("{}0", url);
    assert_eq!(send(&web, "GET", &tampered, &[], None).status, 403);
    let expired = url.split("expires=").next().unwrap().to_string() + "expires=1&sig=00";
    assert_eq!(send(&web, "GET", &expired, &[], None).status, 403);
    let https = send(&web, "GET", url, &[("X-Forwarded-Proto", "https")], None);
    assert!(https.set_cookie.unwrap().contains("Secure"), "behind a TLS-terminating proxy the cookie is Secure");

    // Public: anyone with the URL, until its owner says otherwise.
    let made = server.ok("PUT", &format!("/v1/sandboxes/{id}/ports/8000"), Some(json!({"public": true})));
    assert_eq!(made["public"], true);
    assert!(made["url"].as_str().unwrap().starts_with(&page), "{made}");
    assert_eq!(seen(&send(&web, "GET", &preview_url(&server, &id, 8000, "/open"), &[], None))["path"], "/open");
    assert_eq!(send(&web, "GET", &preview_url(&server, &id, 8001, "/"), &[], None).status, 403, "one port only");
    let listed = server.ok("GET", &format!("/v1/sandboxes/{id}/ports"), None);
    assert_eq!(listed["ports"][0]["port"], 8000);
    server.error(
        "PUT",
        &format!("/v1/sandboxes/{id}/ports/8000"),
        Some(json!({"public": "yes"})),
        400,
        "invalid_request",
    );
    server.error("PUT", &format!("/v1/sandboxes/{id}/ports/0"), Some(json!({"public": true})), 400, "invalid_request");

    // Another tenant cannot open or change it.
    let (_, other) = space_server::tenants::create_key(server.platform.store(), "other", None).unwrap();
    let (status, _) =
        server.call_as(&other, "PUT", &format!("/v1/sandboxes/{id}/ports/8000"), Some(json!({"public": false})));
    assert_eq!(status, 404);
    let (status, _) = server.call_as(&other, "GET", &format!("/v1/sandboxes/{id}/ports/8000/link"), None);
    assert_eq!(status, 404);

    // The setting survives a restart of the server.
    server.stop();
    let server = TestServer::start(&data);
    let web = browser(&server);
    wait_until("the app to answer again", PATIENCE, || {
        send(&web, "GET", &preview_url(&server, &id, 8000, "/after"), &[], None).status == 200
    });
    server.ok("PUT", &format!("/v1/sandboxes/{id}/ports/8000"), Some(json!({"public": false})));
    assert_eq!(send(&web, "GET", &preview_url(&server, &id, 8000, "/"), &[], None).status, 403);
    // The token, derived and not stored, still opens it.
    let token_after = server.ok("GET", &format!("/v1/sandboxes/{id}/ports"), None)["preview_token"].clone();
    assert_eq!(token_after, token.as_str());
    server.delete_sandbox(&id);
    // Deleted: the token reaches nothing (as the path form says it).
    let gone = send(&web, "GET", &preview_url(&server, &id, 8000, "/"), &[("X-Space-Preview-Token", &token)], None);
    assert_eq!(gone.status, 409, "{}", gone.body);
    assert!(gone.body.contains("deleted"), "{}", gone.body);
}

#[test]
fn a_sandbox_used_only_through_a_preview_is_not_idle_paused_and_one_asleep_wakes() {
    let data = TestDataDir::new();
    let mut config = common::platform_config(&data);
    config.auto_pause_s = 2;
    let server = TestServer::start_with(config);
    let id = server.create_sandbox(json!({"template": "base"}));
    start_webapp(&server, &id, 8000);
    server.ok("PUT", &format!("/v1/sandboxes/{id}/ports/8000"), Some(json!({"public": true})));
    let web = browser(&server);
    let state = |server: &TestServer| server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"].clone();

    // Asleep, a preview request wakes it.
    wait_until("the idle pause", PATIENCE, || state(&server) == "paused");
    assert_eq!(seen(&send(&web, "GET", &preview_url(&server, &id, 8000, "/wake"), &[], None))["path"], "/wake");
    assert_eq!(state(&server), "running");

    // Used through the preview alone, a request each half second for three
    // times the idle threshold: never paused under its user.
    let until = std::time::Instant::now() + Duration::from_secs(6);
    while std::time::Instant::now() < until {
        assert_eq!(send(&web, "GET", &preview_url(&server, &id, 8000, "/busy"), &[], None).status, 200);
        assert_eq!(state(&server), "running", "paused while used through a preview");
        std::thread::sleep(Duration::from_millis(500));
    }
    let ops = server.ok("GET", &format!("/v1/operations?sandbox_id={id}"), None);
    let idle_pauses = ops["operations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|op| op["kind"] == "pause" && op["origin"] == "idle" && op["state"] == "succeeded")
        .count();
    assert_eq!(idle_pauses, 1, "only the pause before the preview was used: {ops}");
    server.delete_sandbox(&id);
}

#[test]
fn an_e2b_sandbox_answers_its_preview_domain_and_serves_envd_and_public_ports_there() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let web = browser(&server);
    let created = send(
        &web,
        "POST",
        &format!("{}/e2b/sandboxes", server.url),
        &[("X-API-KEY", &server.key), ("Content-Type", "application/json")],
        Some(r#"{"templateID": "base", "timeout": 300}"#),
    );
    assert_eq!(created.status, 201, "{}", created.body);
    let created: Value = serde_json::from_str(&created.body).unwrap();
    assert_eq!(created["domain"], PREVIEW_DOMAIN, "get_host builds {{port}}-{{id}}.{{domain}} from it: {created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let envd_token = created["envdAccessToken"].as_str().unwrap().to_string();
    let detail = send(&web, "GET", &format!("{}/e2b/sandboxes/{id}", server.url), &[("X-API-KEY", &server.key)], None);
    assert_eq!(serde_json::from_str::<Value>(&detail.body).unwrap()["domain"], PREVIEW_DOMAIN);

    // envd on its port's host, as the SDK reaches it without E2B_SANDBOX_URL,
    // with E2B's id spelling; its own token still required.
    let envd = preview_url(&server, &id, 49983, "/health").replace("sbx-", "sbx_");
    assert_eq!(send(&web, "GET", &envd, &[("X-Access-Token", &envd_token)], None).status, 204);
    assert_eq!(send(&web, "GET", &envd, &[], None).status, 401);
    // The host names the sandbox, whatever a header says.
    let other = server.create_sandbox(json!({"template": "base"}));
    let forced = send(&web, "GET", &envd, &[("X-Access-Token", &envd_token), ("E2b-Sandbox-Id", &other)], None);
    assert_eq!(forced.status, 204, "{}", forced.body);

    // E2B's ports are public by default (its allowPublicTraffic).
    start_webapp(&server, &id, 8000);
    let answer = send(&web, "GET", &preview_url(&server, &id, 8000, "/e2b").replace("sbx-", "sbx_"), &[], None);
    assert_eq!(seen(&answer)["path"], "/e2b");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}/ports"), None)["all_public"], true);
    // A SPACE sandbox's are not.
    start_webapp(&server, &other, 8000);
    assert_eq!(send(&web, "GET", &preview_url(&server, &other, 8000, "/"), &[], None).status, 403);
    // E2B's traffic token opens a private port: its own sandbox's only.
    let traffic = created["trafficAccessToken"].as_str().unwrap();
    let other_page = preview_url(&server, &other, 8000, "/seen");
    assert_eq!(send(&web, "GET", &other_page, &[("e2b-traffic-access-token", traffic)], None).status, 403);
    let connected = send(
        &web,
        "POST",
        &format!("{}/e2b/sandboxes/{other}/connect", server.url),
        &[("X-API-KEY", &server.key), ("Content-Type", "application/json")],
        Some(r#"{"timeout": 300}"#),
    );
    let connected: Value = serde_json::from_str(&connected.body).unwrap();
    let own = connected["trafficAccessToken"].as_str().unwrap_or_else(|| panic!("{connected}"));
    let got = seen(&send(&web, "GET", &other_page, &[("e2b-traffic-access-token", own)], None));
    assert!(!got["headers"].as_object().unwrap().contains_key("e2b-traffic-access-token"), "{got}");
    server.delete_sandbox(&id);
    server.delete_sandbox(&other);
}
