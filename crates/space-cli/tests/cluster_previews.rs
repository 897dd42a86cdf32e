//! Previews in a cluster (issue 38) with real processes on loopback: a
//! throwaway PostgreSQL, a control plane (`space serve --cluster
//! --preview-domain`) and two nodes with the same domain. A request for
//! `{port}-{id}.preview.space.test` sent to the control plane reaches the
//! sandbox's node and the app in it, private until the preview token, a
//! signed link's cookie or its owner opens it; a WebSocket goes through; a
//! sandbox placed nowhere answers as a private port does.

use std::time::Duration;

use serde_json::{json, Value};
use space_process::ReapedChild;
use space_testkit::{wait_for, wait_until, TestDataDir, PATIENCE};
use tungstenite::client::IntoClientRequest;
use tungstenite::Message;

mod common;
use common::cluster::{control_plane, node};

const DOMAIN: &str = "preview.space.test";
/// The web app of the server's preview tests (an echoing WebSocket, what
/// a request looked like).
const WEBAPP: &str = include_str!("../../space-server/tests/common/webapp.py");

/// A client of the control plane that resolves every name to it (wildcard
/// DNS) and follows no redirect.
fn agent(cp_url: &str) -> ureq::Agent {
    let addr: std::net::SocketAddr = cp_url.trim_start_matches("http://").parse().unwrap();
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .redirects(0)
        .resolver(move |_: &str| Ok(vec![addr]))
        .build()
}

fn send(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, ureq::Response) {
    let mut request = agent.request(method, url);
    for (name, value) in headers {
        request = request.set(name, value);
    }
    let result = match body {
        Some(body) => request.send_json(body),
        None => request.call(),
    };
    match result {
        Ok(response) => (response.status(), response),
        Err(ureq::Error::Status(status, response)) => (status, response),
        Err(err) => panic!("{method} {url}: {err}"),
    }
}

fn json_of(response: ureq::Response) -> Value {
    let text = response.into_string().unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn previews_through_the_control_plane_reach_the_sandboxs_node() {
    let cp = control_plane(&["--preview-domain", DOMAIN]);
    let (cp_url, operator_key) = (cp.url.clone(), &cp.operator_key);
    let datas = [TestDataDir::new(), TestDataDir::new()];
    let _nodes: Vec<ReapedChild> = ["node-a", "node-b"]
        .iter()
        .zip(&datas)
        .map(|(id, data)| {
            let mut args = vec!["--preview-domain".to_string(), DOMAIN.to_string()];
            args.extend(common::split_args(data));
            node(data, id, &cp, &args)
        })
        .collect();
    let key = std::fs::read_to_string(operator_key).unwrap();
    let auth = format!("Bearer {key}");
    let web = agent(&cp_url);
    let api = |method: &str, path: &str, body: Option<Value>| {
        send(&web, method, &format!("{cp_url}{path}"), &[("Authorization", &auth)], body)
    };
    wait_for("two live nodes", Duration::from_secs(60), || {
        let nodes = json_of(api("GET", "/v1/health", None).1)["nodes"].as_array().cloned().unwrap_or_default();
        (nodes.iter().filter(|n| n["alive"] == true).count() == 2).then_some(())
    });
    let listener = cp_url.rsplit(':').next().unwrap().to_string();
    let preview =
        |id: &str, port: u16, path: &str| format!("http://{port}-{}.{DOMAIN}:{listener}{path}", id.replace('_', "-"));

    // Two sandboxes, each with a server; wherever each is placed, its
    // preview through the control plane reaches it.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (status, accepted) = api("POST", "/v1/sandboxes", Some(json!({"template": "base"})));
        let accepted = json_of(accepted);
        assert_eq!(status, 202, "{accepted}");
        let id = accepted["sandbox"]["id"].as_str().unwrap().to_string();
        let op = accepted["operation"]["id"].as_str().unwrap().to_string();
        wait_until("the sandbox to run", Duration::from_secs(120), || {
            json_of(api("GET", &format!("/v1/operations/{op}"), None).1)["state"] == "succeeded"
        });
        let written = web
            .put(&format!("{cp_url}/v1/sandboxes/{id}/files?path=/root/webapp.py"))
            .set("Authorization", &auth)
            .send_string(WEBAPP)
            .expect("writing the app");
        assert!((200..300).contains(&written.status()));
        let cmd = "nohup python3 /root/webapp.py 8000 >/dev/null 2>&1 &";
        let (status, ran) = api("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": cmd})));
        assert_eq!(status, 200, "{}", json_of(ran));
        ids.push(id);
    }
    for (n, id) in ids.iter().enumerate() {
        let ports = json_of(api("GET", &format!("/v1/sandboxes/{id}/ports"), None).1);
        assert_eq!(ports["preview_domain"], DOMAIN, "{ports}");
        let token = ports["preview_token"].as_str().unwrap().to_string();
        let page = preview(id, 8000, "/seen");
        wait_until("the server in the sandbox", PATIENCE, || {
            send(&web, "GET", &page, &[("X-Space-Preview-Token", &token)], None).0 == 200
        });
        let (status, seen) =
            send(&web, "GET", &page, &[("X-Space-Preview-Token", &token), ("Authorization", &auth)], None);
        assert_eq!(status, 200);
        let seen = json_of(seen);
        let headers = seen["headers"].as_object().unwrap();
        assert!(headers["x-forwarded-host"].as_str().unwrap().contains(&id.replace('_', "-")), "{n}: {seen}");
        for credential in ["authorization", "x-space-preview-token", "x-space-preview-host"] {
            assert!(!headers.contains_key(credential), "{credential} reached the app: {seen}");
        }
        assert!(!seen.to_string().contains(&key), "{seen}");
        // Private without a proof; another sandbox's token opens nothing.
        assert_eq!(send(&web, "GET", &page, &[("Authorization", &auth)], None).0, 403);
        let other = &ids[1 - n];
        let other_token = json_of(api("GET", &format!("/v1/sandboxes/{other}/ports"), None).1)["preview_token"].clone();
        assert_eq!(send(&web, "GET", &page, &[("X-Space-Preview-Token", other_token.as_str().unwrap())], None).0, 403);

        // A signed link asked of the control plane names its host and port.
        let link = json_of(api("GET", &format!("/v1/sandboxes/{id}/ports/8000/link"), None).1);
        let url = link["url"].as_str().unwrap();
        assert!(url.starts_with(&preview(id, 8000, "/")), "{url} is not on {page}");
        let (status, opened) = send(&web, "GET", url, &[], None);
        assert_eq!(status, 303);
        let cookie = opened.header("set-cookie").unwrap().split(';').next().unwrap().to_string();
        assert_eq!(send(&web, "GET", &page, &[("Cookie", &cookie)], None).0, 200);

        // Public, through the control plane.
        let (status, made) = api("PUT", &format!("/v1/sandboxes/{id}/ports/8000"), Some(json!({"public": true})));
        assert_eq!(status, 200, "{}", json_of(made));
        assert_eq!(send(&web, "GET", &page, &[], None).0, 200);
    }

    // A WebSocket through the control plane and the node.
    let ws_url = preview(&ids[0], 8000, "/ws").replace("http://", "ws://");
    let request = ws_url.into_client_request().unwrap();
    let tcp = std::net::TcpStream::connect(cp_url.trim_start_matches("http://")).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let (mut socket, response) = tungstenite::client(request, tcp).expect("the WebSocket upgrade");
    assert_eq!(response.status(), 101);
    socket.send(Message::Text("across the cluster".into())).unwrap();
    match socket.read().unwrap() {
        Message::Text(text) => assert_eq!(text.as_str(), "echo: across the cluster"),
        other => panic!("{other:?}"),
    }
    drop(socket);

    // Placed nowhere: as a private port; a name in the domain naming no
    // port: 404, never the control plane's API.
    assert_eq!(send(&web, "GET", &preview("sbx_00000000000000000000", 8000, "/"), &[], None).0, 403);
    let (status, _) =
        send(&web, "GET", &format!("http://{DOMAIN}:{listener}/v1/health"), &[("Authorization", &auth)], None);
    assert_eq!(status, 404);
    let (status, seen) = send(&web, "GET", &preview(&ids[0], 8000, "/v1/health"), &[], None);
    assert_eq!(status, 200);
    assert_eq!(json_of(seen)["path"], "/v1/health", "the app's path, not the control plane's health");

    for id in &ids {
        let (status, _) = api("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(status, 202);
    }
}
