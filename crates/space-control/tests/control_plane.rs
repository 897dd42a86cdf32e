//! The control plane against fake nodes (small HTTP servers on loopback)
//! over an in-memory store: no root, no PostgreSQL, no sandbox. What a
//! real cluster does end to end is `space-cli/tests/cluster.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use space_api::cluster::{NodeReport, EVENTS_PATH, HEARTBEAT, LEASE};
use space_control::{Config, ControlPlane, Links};
use space_store::Store;

const API_KEY: &str = "cluster-key";

fn control_plane() -> Arc<ControlPlane> {
    Arc::new(ControlPlane::new(Config {
        store: Store::open(std::path::Path::new(":memory:")).expect("an in-memory store"),
        api_key: API_KEY.into(),
        node_token: "node-token".into(),
        keyring: None,
        links: Links::default(),
        openapi: "{}".into(),
    }))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("a clock after 1970").as_millis() as i64
}

/// Records a heartbeat of node `id` at `url` (its lease renewed).
fn report(cp: &ControlPlane, id: &str, url: &str) {
    let report = NodeReport {
        id: id.into(),
        url: url.into(),
        engine: "gvisor".into(),
        capacity_mib: 4096,
        promised_mib: 0,
        templates: vec!["base".into()],
        sandboxes: vec![],
        secrets_epoch: 0,
        engines: vec!["gvisor".into()],
        pinned: Default::default(),
        local: vec![],
        sizes: Default::default(),
        volume_store: None,
    };
    let json = serde_json::to_string(&report).expect("a report as JSON");
    cp.store.cluster().heartbeat_node(id, url, &json, now_ms() + LEASE.as_millis() as i64).expect("a heartbeat");
}

/// Serves `router` on a loopback port; its URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serving a fake node") });
    url
}

/// Waits until `done` holds, re-reporting the nodes so that their leases
/// hold however long that takes; panics after `patience`.
async fn wait_until(what: &str, patience: Duration, mut keep_alive: impl FnMut(), done: impl Fn() -> bool) {
    let deadline = Instant::now() + patience;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {patience:?}");
        keep_alive();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fake node's feed: how many times it was asked, and how many answers
/// are still being sent.
#[derive(Default)]
struct Feed {
    asked: AtomicUsize,
    open: AtomicUsize,
}

/// Counts an answer that is still being sent; uncounted when the answer
/// is dropped (its connection closed).
struct Open(Arc<Feed>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A feed that never ends: an empty line every 50 ms (which a follower
/// passes over), until the one following it goes away.
async fn endless_feed(State(feed): State<Arc<Feed>>) -> Response {
    feed.asked.fetch_add(1, Ordering::SeqCst);
    feed.open.fetch_add(1, Ordering::SeqCst);
    let open = Open(feed);
    let lines = futures_util::stream::unfold(open, |open| async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Some((Ok::<_, std::convert::Infallible>(axum::body::Bytes::from_static(b"\n")), open))
    });
    Body::from_stream(lines).into_response()
}

/// A feed that ends at once: its follower ends, and the replica's loop
/// follows it again at its next round.
async fn ending_feed(State(feed): State<Arc<Feed>>) -> Response {
    feed.asked.fetch_add(1, Ordering::SeqCst);
    StatusCode::OK.into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_shutdown_no_loop_of_the_control_plane_reaches_a_node_again() {
    let (held, ending) = (Arc::new(Feed::default()), Arc::new(Feed::default()));
    let held_url = serve(Router::new().route(EVENTS_PATH, get(endless_feed)).with_state(held.clone())).await;
    let ending_url = serve(Router::new().route(EVENTS_PATH, get(ending_feed)).with_state(ending.clone())).await;
    let cp = control_plane();
    let keep_alive = || {
        report(&cp, "held", &held_url);
        report(&cp, "ending", &ending_url);
    };
    keep_alive();
    cp.start();

    // Both feeds followed, and the ended one followed again: the loops run.
    let patience = HEARTBEAT * 5;
    wait_until("both feeds followed, one of them twice", patience, keep_alive, || {
        held.open.load(Ordering::SeqCst) == 1 && ending.asked.load(Ordering::SeqCst) >= 2
    })
    .await;

    let began = Instant::now();
    tokio::time::timeout(Duration::from_secs(15), cp.shutdown()).await.expect("shutdown returned within its deadline");
    assert!(began.elapsed() < Duration::from_secs(5), "the loops took {:?} to stop", began.elapsed());
    assert_eq!(cp.background_tasks(), 0, "a task outlived the shutdown");

    // The endless feed's follower let go of it...
    wait_until("the held feed let go", Duration::from_secs(5), || {}, || held.open.load(Ordering::SeqCst) == 0).await;
    // ...and no round of the loop asks again. What this waits for cannot
    // be seen happen: two rounds' time, in which a running loop asks once
    // at least.
    let asked = (held.asked.load(Ordering::SeqCst), ending.asked.load(Ordering::SeqCst));
    tokio::time::sleep(HEARTBEAT * 2 + Duration::from_millis(500)).await;
    assert_eq!(
        (held.asked.load(Ordering::SeqCst), ending.asked.load(Ordering::SeqCst)),
        asked,
        "a node was asked for its events after the shutdown"
    );
    // And nothing starts once it is shut down.
    cp.start();
    assert_eq!(cp.background_tasks(), 0, "a loop started after the shutdown");
}

/// A fake node that answers every create with `answer` (202).
async fn accepting_node(answer: Arc<Mutex<String>>) -> String {
    async fn create(State(answer): State<Arc<Mutex<String>>>) -> Response {
        let body = answer.lock().expect("the answer").clone();
        (StatusCode::ACCEPTED, [(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
    serve(Router::new().route("/v1/sandboxes", post(create)).with_state(answer)).await
}

/// A request to the control plane at `url` with the cluster's key: its
/// status, its body as JSON and as text.
async fn call(
    links: &Links,
    url: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (StatusCode, serde_json::Value, String) {
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(header::AUTHORIZATION, format!("Bearer {API_KEY}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("a request");
    let response = tokio::time::timeout(Duration::from_secs(10), links.send(url, request, None))
        .await
        .expect("an answer within 10 s")
        .expect("the control plane answered");
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("the body");
    let text = String::from_utf8(bytes.to_vec()).expect("UTF-8");
    (status, serde_json::from_str(&text).expect("JSON"), text)
}

async fn create_through(links: &Links, url: &str) -> (StatusCode, serde_json::Value, String) {
    call(links, url, "POST", "/v1/sandboxes", r#"{"template": "base"}"#).await
}

const SANDBOX: &str = r#"{"id": "sbx-1", "template": "base", "state": "creating", "vcpus": 1, "memory_mib": 512,
    "disk_mib": 1024, "labels": {}, "engine": "gvisor", "created_at": "2026-01-01T00:00:00Z",
    "updated_at": "2026-01-01T00:00:00Z", "lifecycle": {}, "network": {"egress": "none"},
    "last_activity_at": "2026-01-01T00:00:00Z", "node": "n1"}"#;
const OPERATION: &str = r#"{"id": "op-1", "kind": "create", "sandbox_id": "sbx-1", "state": "pending",
    "progress": {"step": "queued", "done": 0, "total": 1}, "created_at": "2026-01-01T00:00:00Z"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_is_recorded_from_the_nodes_typed_answer_and_one_of_another_shape_is_an_error() {
    let answer = Arc::new(Mutex::new(format!(r#"{{"sandbox": {SANDBOX}, "operation": {OPERATION}}}"#)));
    let node_url = accepting_node(answer.clone()).await;
    let cp = control_plane();
    report(&cp, "n1", &node_url);
    let cp_url = serve(space_control::router(cp.clone())).await;
    let links = Links::default();

    let (status, body, text) = create_through(&links, &cp_url).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    assert_eq!(text, *answer.lock().expect("the answer"), "the node's answer is passed on as it sent it");
    assert_eq!(body["sandbox"]["id"], "sbx-1");
    let placement = cp.store.cluster().placement("sbx-1").expect("the store").expect("sbx-1 placed");
    assert_eq!(placement.node_id, "n1");
    let kept: space_api::Sandbox = serde_json::from_str(&placement.sandbox).expect("kept as a Sandbox");
    assert_eq!((kept.vcpus, kept.memory_mib), (1, 512));
    assert_eq!(
        cp.store.cluster().operation_node("op-1").expect("the store").map(|(node, _)| node).as_deref(),
        Some("n1")
    );

    // A 202 the control plane cannot read as its handler's answer (here a
    // sandbox without its fields) places nothing and says why.
    *answer.lock().expect("the answer") = r#"{"sandbox": {"id": "sbx-2"}, "operation": {"id": "op-2"}}"#.into();
    let (status, body, text) = create_through(&links, &cp_url).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{text}");
    assert_eq!(body["error"]["code"], "node_unreachable", "{text}");
    let message = body["error"]["message"].as_str().expect("a message");
    assert!(message.contains("node n1") && message.contains("not a SandboxOperation"), "{message}");
    assert!(cp.store.cluster().placement("sbx-2").expect("the store").is_none(), "an unreadable answer placed sbx-2");
    assert!(cp.store.cluster().operation_node("op-2").expect("the store").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_answer_of_another_shape_is_an_error_and_its_refusal_is_passed_on() {
    async fn usage() -> Response {
        // A usage answer short of its fields.
        axum::Json(serde_json::json!({"tenant": "t", "sandboxes": 1})).into_response()
    }
    async fn sandboxes() -> Response {
        let refusal = serde_json::json!({"error": {"code": "invalid_request", "message": "unknown state \"bogus\"",
            "details": {"reason": "schema"}}});
        (StatusCode::BAD_REQUEST, axum::Json(refusal)).into_response()
    }
    let node_url = serve(Router::new().route("/v1/usage", get(usage)).route("/v1/sandboxes", get(sandboxes))).await;
    let cp = control_plane();
    report(&cp, "n1", &node_url);
    let cp_url = serve(space_control::router(cp.clone())).await;
    let links = Links::default();

    let (status, body, text) = call(&links, &cp_url, "GET", "/v1/usage", "").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "a usage that is not one counted as nothing: {text}");
    let message = body["error"]["message"].as_str().expect("a message");
    assert!(message.contains("node n1") && message.contains("not a Usage"), "{message}");

    let (status, body, text) = call(&links, &cp_url, "GET", "/v1/sandboxes?state=bogus", "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert_eq!(body["error"]["code"], "invalid_request", "{text}");
    assert_eq!(body["error"]["message"], "unknown state \"bogus\"", "the node's own words: {text}");
    assert_eq!(body["error"]["details"]["reason"], "schema", "{text}");
}
