//! Volumes through the control plane against fake nodes (small HTTP
//! servers on loopback that keep volumes in memory) over an in-memory
//! store: where a volume is made, which node each request about it goes
//! to, that another tenant's volume is answered as an unknown one, where a
//! sandbox that mounts volumes is placed, and a move (its files carried,
//! its refusals, a failure midway undone). Real nodes do the same in
//! `space-cli/tests/cluster_volumes.rs`.

// A fake node takes its volume's name from the path as it is: the tenant
// is the control plane's header, and there is no key to authorize.
#![allow(clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use space_api::cluster::{HandedSnapshot, HandedVolume, NodeReport, ReleaseVolume, LEASE, TENANT_HEADER};
use space_api::{CreateVolumeRequest, Volume, VolumeHolder, VolumeSnapshot};
use space_control::{Config, ControlPlane, Links};
use space_store::Store;

/// A volume on a fake node: its object and its files (the tar as sent).
struct Kept {
    volume: Volume,
    files: Vec<u8>,
}

/// What a fake node holds and was asked.
#[derive(Default)]
struct Fake {
    id: String,
    free_bytes: u64,
    /// By tenant and name.
    volumes: BTreeMap<(String, String), Kept>,
    /// Each request, as `METHOD path?query`.
    asked: Vec<String>,
    /// Its next PUT of files fails (a node that breaks mid-move).
    fail_put: bool,
    /// How long its PUT of files takes, in ms.
    put_delay_ms: u64,
    /// A sandbox mounts the volume as its files are read (a create that
    /// raced a move's check).
    mount_on_read: bool,
    /// The sandbox creates it took.
    sandboxes: usize,
    /// Its next adopt of a handed-over volume fails.
    fail_adopt: bool,
}

type Node = Arc<Mutex<Fake>>;

fn tenant(headers: &HeaderMap) -> String {
    headers.get(TENANT_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string()
}

fn refusal(status: StatusCode, code: &str, message: &str) -> Response {
    (status, axum::Json(json!({"error": {"code": code, "message": message, "details": {}}}))).into_response()
}

fn not_found(name: &str) -> Response {
    refusal(StatusCode::NOT_FOUND, "volume_not_found", &format!("no volume named {name:?}"))
}

async fn health(State(node): State<Node>) -> Response {
    let free = node.lock().unwrap().free_bytes;
    axum::Json(json!({"status": "ok", "version": "0", "engine": "gvisor", "engines": [],
        "kvm": {"present": false, "detail": ""},
        "disk": {"filesystem": "btrfs", "free_bytes": free, "total_bytes": free * 2, "reserve_bytes": 0}}))
    .into_response()
}

async fn list(State(node): State<Node>, headers: HeaderMap) -> Response {
    let fake = node.lock().unwrap();
    let tenant = tenant(&headers);
    let volumes: Vec<&Volume> =
        fake.volumes.iter().filter(|((t, _), _)| *t == tenant).map(|(_, k)| &k.volume).collect();
    axum::Json(json!({ "volumes": volumes })).into_response()
}

async fn create(State(node): State<Node>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let create: CreateVolumeRequest = serde_json::from_slice(&body).unwrap();
    let mut fake = node.lock().unwrap();
    let key = (tenant(&headers), create.name.clone());
    if fake.volumes.contains_key(&key) {
        return refusal(StatusCode::CONFLICT, "name_taken", "taken");
    }
    if create.name.starts_with("bad") {
        return refusal(StatusCode::UNPROCESSABLE_ENTITY, "invalid_value", "a bad name");
    }
    let volume = Volume {
        name: create.name.clone(),
        size_mib: create.size_mib.unwrap_or(1024),
        used_bytes: 0,
        created_at: space_api::Timestamp::now(),
        mounted_by: vec![],
        snapshots: vec![],
        from_snapshot: create.from_snapshot,
        node: None,
    };
    fake.volumes.insert(key, Kept { volume: volume.clone(), files: Vec::new() });
    (StatusCode::CREATED, axum::Json(volume)).into_response()
}

async fn one(State(node): State<Node>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    match node.lock().unwrap().volumes.get(&(tenant(&headers), name.clone())) {
        Some(kept) => axum::Json(kept.volume.clone()).into_response(),
        None => not_found(&name),
    }
}

async fn delete(State(node): State<Node>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    let mut fake = node.lock().unwrap();
    let key = (tenant(&headers), name.clone());
    match fake.volumes.get(&key) {
        None => not_found(&name),
        Some(kept) if !kept.volume.mounted_by.is_empty() => refusal(StatusCode::CONFLICT, "volume_in_use", "mounted"),
        Some(_) => {
            fake.volumes.remove(&key);
            StatusCode::NO_CONTENT.into_response()
        }
    }
}

async fn read_files(
    State(node): State<Node>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    assert_eq!(
        (query.get("path").map(String::as_str), query.get("format").map(String::as_str)),
        (Some("/"), Some("tar"))
    );
    let mut fake = node.lock().unwrap();
    let mount = std::mem::take(&mut fake.mount_on_read);
    match fake.volumes.get_mut(&(tenant(&headers), name.clone())) {
        Some(kept) => {
            if mount {
                let holder = VolumeHolder { sandbox_id: "sbx-late".into(), path: "/w".into(), read_only: false };
                kept.volume.mounted_by.push(holder);
            }
            kept.files.clone().into_response()
        }
        None => not_found(&name),
    }
}

async fn write_files(State(node): State<Node>, headers: HeaderMap, Path(name): Path<String>, body: Body) -> Response {
    let bytes = axum::body::to_bytes(body, 1 << 30).await.unwrap();
    let delay = node.lock().unwrap().put_delay_ms;
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mut fake = node.lock().unwrap();
    if std::mem::take(&mut fake.fail_put) {
        return refusal(StatusCode::UNPROCESSABLE_ENTITY, "io_error", "the disk broke");
    }
    match fake.volumes.get_mut(&(tenant(&headers), name.clone())) {
        Some(kept) => {
            kept.files = bytes.to_vec();
            (StatusCode::CREATED, axum::Json(json!({"path": "/", "size": bytes.len()}))).into_response()
        }
        None => not_found(&name),
    }
}

async fn create_sandbox(State(node): State<Node>) -> Response {
    let mut fake = node.lock().unwrap();
    fake.sandboxes += 1;
    let id = format!("sbx-{}-{}", fake.id, fake.sandboxes);
    let sandbox = sandbox_json(&fake.id, &id);
    let operation = json!({"id": format!("op-{id}"), "kind": "create", "sandbox_id": id, "state": "pending",
        "progress": {"step": "queued", "done": 0, "total": 1}, "created_at": "2026-01-01T00:00:00Z"});
    (StatusCode::ACCEPTED, axum::Json(json!({"sandbox": sandbox, "operation": operation}))).into_response()
}

fn sandbox_json(node: &str, id: &str) -> Value {
    json!({"id": id, "template": "base", "state": "running", "vcpus": 1, "memory_mib": 512,
        "disk_mib": 1024, "labels": {}, "engine": "gvisor", "created_at": "2026-01-01T00:00:00Z",
        "updated_at": "2026-01-01T00:00:00Z", "lifecycle": {}, "network": {"egress": "none"},
        "last_activity_at": "2026-01-01T00:00:00Z", "node": node})
}

/// E2B's create, as a node's adapter answers it.
async fn e2b_create(State(node): State<Node>) -> Response {
    let mut fake = node.lock().unwrap();
    fake.sandboxes += 1;
    let id = format!("sbx-{}-{}", fake.id, fake.sandboxes);
    axum::Json(json!({"templateID": "base", "sandboxID": id, "clientID": "c", "alias": "base",
        "envdVersion": "0.2.0", "envdAccessToken": "t", "trafficAccessToken": "t", "domain": null}))
    .into_response()
}

async fn sandbox(State(node): State<Node>, Path(id): Path<String>) -> Response {
    let fake = node.lock().unwrap();
    axum::Json(sandbox_json(&fake.id, &id)).into_response()
}

/// What the tenant holds here: its volumes' sizes, and 1 MiB of snapshots.
async fn usage(State(node): State<Node>, headers: HeaderMap) -> Response {
    let fake = node.lock().unwrap();
    let tenant = tenant(&headers);
    let reserved: u64 =
        fake.volumes.iter().filter(|((t, _), _)| *t == tenant).map(|(_, k)| u64::from(k.volume.size_mib) << 20).sum();
    axum::Json(json!({"tenant": tenant, "quotas": {"max_sandboxes": null, "max_vcpus": null, "max_memory_mib": null,
        "max_disk_mib": null}, "sandboxes": 0, "vcpus": 0, "memory_mib": 0,
        "disk": {"total_bytes": reserved + (1 << 20), "roots_reserved_bytes": 0, "roots_used_bytes": 0,
            "transcripts_bytes": 0, "snapshots_bytes": 0, "templates_bytes": 0, "uploads_bytes": 0,
            "volumes_reserved_bytes": reserved, "volume_snapshots_bytes": 1 << 20}}))
    .into_response()
}

/// Counts every request the node is asked.
async fn count(State(node): State<Node>, request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let asked = format!("{} {}", request.method(), request.uri());
    node.lock().unwrap().asked.push(asked);
    next.run(request).await
}

/// A fake node `id` with `free_bytes` of disk, serving on loopback.
/// `POST /internal/v1/volumes/release`: the volume, as a shared store's
/// node hands it over (its snapshots with it).
async fn release(State(node): State<Node>, axum::Json(wanted): axum::Json<ReleaseVolume>) -> Response {
    let mut fake = node.lock().unwrap();
    let key = (wanted.tenant.clone(), wanted.name.clone());
    match fake.volumes.get(&key) {
        None => not_found(&wanted.name),
        Some(kept) if !kept.volume.mounted_by.is_empty() => refusal(StatusCode::CONFLICT, "volume_in_use", "mounted"),
        Some(_) => {
            let kept = fake.volumes.remove(&key).unwrap();
            let handed = HandedVolume {
                store: STORE.into(),
                tenant: wanted.tenant,
                id: format!("vol_{}", kept.volume.name),
                name: kept.volume.name,
                size_mib: kept.volume.size_mib,
                created_at: kept.volume.created_at,
                from_snapshot: None,
                snapshots: kept
                    .volume
                    .snapshots
                    .iter()
                    .map(|s| HandedSnapshot { name: s.name.clone(), created_at: s.created_at })
                    .collect(),
            };
            axum::Json(handed).into_response()
        }
    }
}

/// `POST /internal/v1/volumes/adopt`.
async fn adopt(State(node): State<Node>, axum::Json(handed): axum::Json<HandedVolume>) -> Response {
    let mut fake = node.lock().unwrap();
    if std::mem::take(&mut fake.fail_adopt) {
        return refusal(StatusCode::CONFLICT, "volume_in_use", "its lock is held elsewhere");
    }
    let volume = Volume {
        name: handed.name.clone(),
        size_mib: handed.size_mib,
        used_bytes: 0,
        created_at: handed.created_at,
        mounted_by: vec![],
        snapshots: handed
            .snapshots
            .iter()
            .map(|s| VolumeSnapshot {
                name: s.name.clone(),
                volume: handed.name.clone(),
                size_bytes: 0,
                created_at: s.created_at,
            })
            .collect(),
        from_snapshot: None,
        node: None,
    };
    fake.volumes.insert((handed.tenant, handed.name), Kept { volume: volume.clone(), files: Vec::new() });
    axum::Json(volume).into_response()
}

/// The shared volume store the fake nodes of [`shared_cluster`] report.
const STORE: &str = "0123456789abcdef0123456789abcdef";

async fn fake_node(id: &str, free_bytes: u64) -> (Node, String) {
    let node: Node = Arc::new(Mutex::new(Fake { id: id.into(), free_bytes, ..Fake::default() }));
    let router = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/usage", get(usage))
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/{name}", get(one).delete(delete))
        .route("/v1/volumes/{name}/files", get(read_files).put(write_files))
        .route("/v1/sandboxes", post(create_sandbox))
        .route("/v1/sandboxes/{id}", get(sandbox))
        .route("/e2b/sandboxes", post(e2b_create))
        .route("/internal/v1/volumes/release", post(release))
        .route("/internal/v1/volumes/adopt", post(adopt))
        .layer(axum::middleware::from_fn_with_state(node.clone(), count))
        .with_state(node.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serving a fake node") });
    (node, url)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("a clock after 1970").as_millis() as i64
}

fn report_with(cp: &ControlPlane, id: &str, url: &str, volume_store: Option<&str>) {
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
        volume_store: volume_store.map(str::to_string),
    };
    let json = serde_json::to_string(&report).expect("a report as JSON");
    cp.store.cluster().heartbeat_node(id, url, &json, now_ms() + LEASE.as_millis() as i64).expect("a heartbeat");
}

/// A control plane with two fake nodes: `a` with more free disk than `b`.
struct Cluster {
    cp: Arc<ControlPlane>,
    url: String,
    a: Node,
    b: Node,
    /// Two tenants' keys.
    team: String,
    other: String,
}

async fn cluster() -> Cluster {
    cluster_with(None).await
}

/// Two fake nodes that keep their volumes in one shared store.
async fn shared_cluster() -> Cluster {
    cluster_with(Some(STORE)).await
}

async fn cluster_with(store: Option<&str>) -> Cluster {
    let cp = Arc::new(ControlPlane::new(Config {
        store: Store::open(std::path::Path::new(":memory:")).expect("an in-memory store"),
        api_key: "cluster-key".into(),
        node_token: "node-token".into(),
        keyring: None,
        links: Links::default(),
        openapi: "{}".into(),
    }));
    let (a, a_url) = fake_node("node-a", 900 << 30).await;
    let (b, b_url) = fake_node("node-b", 100 << 30).await;
    report_with(&cp, "node-a", &a_url, store);
    report_with(&cp, "node-b", &b_url, store);
    let (_, team) = space_core::tenants::create_key(&cp.store, "team", None).expect("a key");
    let (_, other) = space_core::tenants::create_key(&cp.store, "other", None).expect("a key");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    let router = space_control::router(cp.clone());
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serving the control plane") });
    Cluster { cp, url, a, b, team, other }
}

impl Cluster {
    /// A call as the tenant of `key`: its status and body (JSON, or
    /// `Value::Null` for none).
    async fn call(&self, key: &str, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let (status, bytes) = self.send(key, method, path, body.map(|b| b.to_string().into_bytes())).await;
        let value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("JSON") };
        (status, value)
    }

    async fn send(&self, key: &str, method: &str, path: &str, body: Option<Vec<u8>>) -> (StatusCode, Vec<u8>) {
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.unwrap_or_default()))
            .expect("a request");
        let response = tokio::time::timeout(Duration::from_secs(10), Links::default().send(&self.url, request, None))
            .await
            .expect("an answer within 10 s")
            .expect("the control plane answered");
        let status = response.status();
        (status, axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("the body").to_vec())
    }

    fn on(&self, node: &Node, tenant: &str, name: &str) -> bool {
        node.lock().unwrap().volumes.contains_key(&(tenant.to_string(), name.to_string()))
    }

    fn asked(&self, node: &Node) -> Vec<String> {
        node.lock().unwrap().asked.clone()
    }

    fn set_files(&self, node: &Node, tenant: &str, name: &str, files: &[u8]) {
        node.lock().unwrap().volumes.get_mut(&(tenant.into(), name.into())).expect("the volume").files = files.to_vec();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_made_on_the_node_with_most_free_disk_and_found_there_by_its_tenant_only() {
    let c = cluster().await;
    let (status, made) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "ws", "size_mib": 64}))).await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    assert_eq!(made["node"], "node-a", "the node is named when the node did not: {made}");
    assert!(c.on(&c.a, "team", "ws") && !c.on(&c.b, "team", "ws"));
    let kept = c.cp.store.cluster().volume_node("team", "ws").unwrap().expect("recorded");
    assert_eq!(kept.node_id, "node-a");

    // Its name is the tenant's, wherever a second create would land.
    c.a.lock().unwrap().free_bytes = 1;
    let (status, taken) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "ws"}))).await;
    assert_eq!((status, taken["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("name_taken")), "{taken}");
    assert!(!c.asked(&c.b).iter().any(|a| a.starts_with("POST /v1/volumes")), "node-b was asked to make it");
    // Now node-b has the most: the next goes there; another tenant may use the same name.
    let (status, made) = c.call(&c.other, "POST", "/v1/volumes", Some(json!({"name": "ws"}))).await;
    assert_eq!((status, made["node"].as_str()), (StatusCode::CREATED, Some("node-b")), "{made}");
    // A name the node refuses is not kept.
    let (status, refused) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "bad-one"}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
    assert!(c.cp.store.cluster().volume_node("team", "bad-one").unwrap().is_none());

    // Each tenant sees its own, each named with its node.
    let (_, listed) = c.call(&c.team, "GET", "/v1/volumes", None).await;
    assert_eq!(listed["volumes"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!((&listed["volumes"][0]["name"], &listed["volumes"][0]["node"]), (&json!("ws"), &json!("node-a")));
    let (_, listed) = c.call(&c.other, "GET", "/v1/volumes", None).await;
    assert_eq!(listed["volumes"][0]["node"], "node-b", "{listed}");

    // The usage adds up the volumes of both nodes.
    let (status, used) = c.call(&c.team, "GET", "/v1/usage", None).await;
    assert_eq!(status, StatusCode::OK, "{used}");
    assert_eq!(used["disk"]["volumes_reserved_bytes"], 64u64 << 20, "{used}");
    assert_eq!(used["disk"]["volume_snapshots_bytes"], 2u64 << 20, "one MiB from each node: {used}");

    // A request about it goes to its node; another tenant's is unknown,
    // answered exactly so, and no node is asked.
    let (status, got) = c.call(&c.team, "GET", "/v1/volumes/ws", None).await;
    assert_eq!((status, got["node"].as_str()), (StatusCode::OK, Some("node-a")), "{got}");
    let unknown = c.call(&c.other, "GET", "/v1/volumes/nothing", None).await;
    c.call(&c.team, "DELETE", "/v1/volumes/ws", None).await;
    let (status, gone) = c.call(&c.team, "GET", "/v1/volumes/ws", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{gone}");
    assert!(c.cp.store.cluster().volume_node("team", "ws").unwrap().is_none(), "a deleted volume is forgotten");
    let (status, made) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "mine"}))).await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let asked_before = (c.asked(&c.a).len(), c.asked(&c.b).len());
    for (method, path) in [
        ("GET", "/v1/volumes/mine"),
        ("DELETE", "/v1/volumes/mine"),
        ("GET", "/v1/volumes/mine/files?path=/"),
        ("PUT", "/v1/volumes/mine/files?path=/x"),
        ("POST", "/v1/volumes/mine/snapshots"),
        ("POST", "/v1/volumes/mine/move"),
    ] {
        let body = match path {
            // Not a move's body: the volume is refused first, as on a node.
            p if p.ends_with("/move") => Some(json!({"bogus": true})),
            p if p.ends_with("/snapshots") => Some(json!({"name": "s"})),
            _ => None,
        };
        let theirs = c.call(&c.other, method, &path.replace("mine", "ws-none"), body.clone()).await;
        let mine = c.call(&c.other, method, path, body).await;
        assert_eq!(mine.0, StatusCode::NOT_FOUND, "{method} {path}: {}", mine.1);
        let unknown_body = mine.1.to_string().replace("mine", "ws-none");
        assert_eq!(unknown_body, theirs.1.to_string(), "{method} {path}: another tenant's is answered as none");
    }
    assert_eq!(unknown.0, StatusCode::NOT_FOUND);
    assert_eq!((c.asked(&c.a).len(), c.asked(&c.b).len()), asked_before, "a node was asked about another's volume");
    assert!(c.on(&c.b, "other", "ws"));

    // A claim whose node never made the volume (its replica killed in
    // between) is taken back once old enough and its node has none; a
    // fresh one is not.
    assert!(c.cp.store.cluster().claim_volume("team", "ghost", "node-a", now_ms() - 60_000).unwrap());
    assert!(c.cp.store.cluster().claim_volume("team", "young", "node-a", now_ms()).unwrap());
    let (status, made) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "ghost"}))).await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let (status, taken) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "young"}))).await;
    assert_eq!((status, taken["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("name_taken")), "{taken}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_that_mounts_volumes_is_placed_on_their_node_or_refused_clearly() {
    let c = cluster().await;
    for (name, node) in [("ws", &c.b), ("data", &c.b), ("far", &c.a)] {
        // Each made where the test wants it: the other node has no room.
        let (more, less) = if Arc::ptr_eq(node, &c.a) { (&c.a, &c.b) } else { (&c.b, &c.a) };
        more.lock().unwrap().free_bytes = 9 << 30;
        less.lock().unwrap().free_bytes = 1;
        let (status, made) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": name}))).await;
        assert_eq!(status, StatusCode::CREATED, "{made}");
    }
    // Both nodes report the same room: the volumes decide.
    for _ in 0..3 {
        let mounts =
            json!([{"name": "ws", "path": "/workspace"}, {"name": "data", "path": "/data", "read_only": true}]);
        let (status, accepted) =
            c.call(&c.team, "POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": mounts}))).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
        assert_eq!(accepted["sandbox"]["node"], "node-b", "{accepted}");
    }
    assert_eq!((c.a.lock().unwrap().sandboxes, c.b.lock().unwrap().sandboxes), (0, 3));

    // On two nodes: refused, naming both.
    let mounts = json!([{"name": "ws", "path": "/workspace"}, {"name": "far", "path": "/far"}]);
    let (status, refused) =
        c.call(&c.team, "POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": mounts}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
    assert_eq!(refused["error"]["code"], "invalid_value");
    assert_eq!(refused["error"]["details"]["field"], "volumes");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("node-a") && message.contains("node-b"), "{message}");

    // Unknown, or another tenant's: 404 before any node is asked.
    let before = (c.asked(&c.a).len(), c.asked(&c.b).len());
    for key in [&c.team, &c.other] {
        let mounts = json!([{"name": if key == &c.team { "nothing" } else { "ws" }, "path": "/w"}]);
        let (status, refused) =
            c.call(key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": mounts}))).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{refused}");
        assert_eq!(refused["error"]["code"], "volume_not_found", "{refused}");
    }
    assert_eq!((c.asked(&c.a).len(), c.asked(&c.b).len()), before, "a node was asked");
    assert_eq!((c.a.lock().unwrap().sandboxes, c.b.lock().unwrap().sandboxes), (0, 3));

    // E2B's create with volumeMounts is placed the same way.
    let e2b = |mounts: Value| {
        let request = hyper::Request::builder()
            .method("POST")
            .uri("/e2b/sandboxes")
            .header("x-api-key", c.team.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(json!({"templateID": "base", "volumeMounts": mounts}).to_string()))
            .expect("a request");
        let url = c.url.clone();
        async move {
            let response = Links::default().send(&url, request, None).await.expect("an answer");
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("the body");
            (status, serde_json::from_slice::<Value>(&body).expect("JSON"))
        }
    };
    let (status, created) = e2b(json!([{"name": "data", "path": "/data"}])).await;
    assert_eq!(status, StatusCode::OK, "{created}");
    assert_eq!(created["sandboxID"], "sbx-node-b-4", "{created}");
    let placement = c.cp.store.cluster().placement("sbx-node-b-4").unwrap().expect("placed");
    assert_eq!(placement.node_id, "node-b");
    let (status, refused) = e2b(json!([{"name": "nothing", "path": "/data"}])).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{refused}");
    let (status, refused) = e2b(json!([{"name": "ws", "path": "/w"}, {"name": "far", "path": "/f"}])).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");

    // Their node lost (its lease run out): a sandbox that mounts them is
    // not placed elsewhere, and the volume answers that its node is lost.
    let b_url = c.cp.store.cluster().node("node-b").unwrap().expect("node-b").url;
    let report = c.cp.store.cluster().node("node-b").unwrap().expect("node-b").report;
    c.cp.store.cluster().heartbeat_node("node-b", &b_url, &report, now_ms() - 1).unwrap();
    let mounts = json!([{"name": "ws", "path": "/workspace"}]);
    let (status, refused) =
        c.call(&c.team, "POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": mounts}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("node-b"), "{refused}");
    let (status, lost) = c.call(&c.team, "GET", "/v1/volumes/ws", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{lost}");
    let (_, listed) = c.call(&c.team, "GET", "/v1/volumes", None).await;
    let names: Vec<&str> = listed["volumes"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, ["far"], "the live node's: {listed}");
    assert_eq!((c.a.lock().unwrap().sandboxes, c.b.lock().unwrap().sandboxes), (0, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_carries_the_files_and_a_failure_midway_leaves_the_volume_where_it_was() {
    let c = cluster().await;
    let (status, made) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "ws", "size_mib": 77}))).await;
    assert_eq!((status, made["node"].as_str()), (StatusCode::CREATED, Some("node-a")), "{made}");
    let files = b"a tar, as the node wrote it".repeat(1000);
    c.set_files(&c.a, "team", "ws", &files);

    // Mounted: refused, naming the holder; nothing made on the target.
    let holder = VolumeHolder { sandbox_id: "sbx-holder".into(), path: "/w".into(), read_only: true };
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.mounted_by = vec![holder];
    let (status, refused) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{refused}");
    assert_eq!(refused["error"]["code"], "volume_in_use");
    assert_eq!(refused["error"]["details"]["sandbox_id"], "sbx-holder");
    assert!(!c.on(&c.b, "team", "ws"));
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.mounted_by.clear();

    // With snapshots: refused (a move does not carry them).
    let snapshot = VolumeSnapshot {
        name: "s1".into(),
        volume: "ws".into(),
        created_at: space_api::Timestamp::now(),
        size_bytes: 0,
    };
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.snapshots = vec![snapshot];
    let (status, refused) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!((status, refused["error"]["details"]["state"].as_str()), (StatusCode::CONFLICT, Some("has_snapshots")));
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.snapshots.clear();

    // With a query, or to a node that is not there: refused.
    let (status, refused) = c.call(&c.team, "POST", "/v1/volumes/ws/move?x=1", Some(json!({"node": "node-b"}))).await;
    assert_eq!((status, refused["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_request")));
    let (status, refused) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-z"}))).await;
    assert_eq!(
        (status, refused["error"]["details"]["field"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("node"))
    );

    // The target breaks while the files are written: its copy goes, the
    // volume stays on node-a with its files, and can be moved again.
    c.b.lock().unwrap().fail_put = true;
    let (status, failed) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!((status, failed["error"]["code"].as_str()), (StatusCode::UNPROCESSABLE_ENTITY, Some("io_error")));
    assert!(!c.on(&c.b, "team", "ws"), "the failed move's copy was left on node-b");
    assert!(c.on(&c.a, "team", "ws"));
    let kept = c.cp.store.cluster().volume_node("team", "ws").unwrap().unwrap();
    assert_eq!((kept.node_id.as_str(), kept.moving_until_ms), ("node-a", 0), "the record is as it was, unheld");

    // A sandbox that mounted it while its files were copied (its create
    // checked before the move's hold) keeps it where it is: the old copy
    // is not deleted under it, the record goes back, the new copy goes.
    c.a.lock().unwrap().mount_on_read = true;
    let (status, failed) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!((status, failed["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("volume_in_use")), "{failed}");
    assert!(!c.on(&c.b, "team", "ws") && c.on(&c.a, "team", "ws"));
    let kept = c.cp.store.cluster().volume_node("team", "ws").unwrap().unwrap();
    assert_eq!((kept.node_id.as_str(), kept.moving_until_ms), ("node-a", 0));
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.mounted_by.clear();

    // A move that works: same size, same files, on node-b only, found there.
    let (status, moved) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!(status, StatusCode::OK, "{moved}");
    assert_eq!((moved["node"].as_str(), moved["size_mib"].as_u64()), (Some("node-b"), Some(77)), "{moved}");
    assert!(!c.on(&c.a, "team", "ws") && c.on(&c.b, "team", "ws"));
    let (status, read) = c.send(&c.team, "GET", "/v1/volumes/ws/files?path=/&format=tar", None).await;
    assert_eq!((status, read.len()), (StatusCode::OK, files.len()));
    assert_eq!(read, files, "the files moved as they were");
    let (_, got) = c.call(&c.team, "GET", "/v1/volumes/ws", None).await;
    assert_eq!(got["node"], "node-b");
    let (status, again) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!((status, again["node"].as_str()), (StatusCode::OK, Some("node-b")), "a repeated move is done: {again}");

    // A caller that goes away midway does not stop the move: it ends
    // with the volume on one node, unheld.
    c.a.lock().unwrap().put_delay_ms = 500;
    let body = Some(json!({"node": "node-a"}));
    let gone = tokio::time::timeout(Duration::from_millis(100), c.call(&c.team, "POST", "/v1/volumes/ws/move", body));
    assert!(gone.await.is_err(), "the move answered before its caller went away");
    let moved_back = || {
        let kept = c.cp.store.cluster().volume_node("team", "ws").unwrap().unwrap();
        kept.node_id == "node-a" && kept.moving_until_ms == 0
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !moved_back() {
        assert!(std::time::Instant::now() < deadline, "the move did not end without its caller");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.on(&c.a, "team", "ws") && !c.on(&c.b, "team", "ws"), "one copy, on node-a");
    assert_eq!(c.a.lock().unwrap().volumes[&("team".to_string(), "ws".to_string())].files, files);
    c.a.lock().unwrap().put_delay_ms = 0;
    let (status, _) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!(status, StatusCode::OK);

    // While a move holds it, changes and mounts wait; reads go on.
    let now = now_ms();
    assert!(c.cp.store.cluster().hold_volume_move("team", "ws", "node-b", now, now + 60_000, false).unwrap());
    let (status, held) = c.call(&c.team, "DELETE", "/v1/volumes/ws", None).await;
    assert_eq!((status, held["error"]["details"]["state"].as_str()), (StatusCode::CONFLICT, Some("moving")), "{held}");
    let mounts = json!([{"name": "ws", "path": "/w"}]);
    let (status, _) =
        c.call(&c.team, "POST", "/v1/sandboxes", Some(json!({"template": "base", "volumes": mounts}))).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(c.call(&c.team, "GET", "/v1/volumes/ws", None).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn between_nodes_of_a_shared_store_a_volume_is_handed_over_and_follows_its_sandbox() {
    let c = shared_cluster().await;
    let (status, made) = c.call(&c.team, "POST", "/v1/volumes", Some(json!({"name": "ws", "size_mib": 64}))).await;
    assert_eq!((status, made["node"].as_str()), (StatusCode::CREATED, Some("node-a")), "{made}");
    // A snapshot: a copy between nodes' own disks would refuse to move it.
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.snapshots.push(VolumeSnapshot {
        name: "s1".into(),
        volume: "ws".into(),
        size_bytes: 0,
        created_at: space_api::Timestamp::now(),
    });

    // Handed over: released by one, taken by the other, no file copied.
    let (status, moved) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!(status, StatusCode::OK, "{moved}");
    assert_eq!((moved["node"].as_str(), moved["snapshots"][0]["name"].as_str()), (Some("node-b"), Some("s1")));
    assert!(!c.on(&c.a, "team", "ws") && c.on(&c.b, "team", "ws"));
    assert!(c.asked(&c.a).iter().any(|a| a == "POST /internal/v1/volumes/release"), "{:?}", c.asked(&c.a));
    assert!(c.asked(&c.b).iter().any(|a| a == "POST /internal/v1/volumes/adopt"), "{:?}", c.asked(&c.b));
    let copied = |node: &Node| c.asked(node).iter().any(|a| a.contains("/files"));
    assert!(!copied(&c.a) && !copied(&c.b), "no files route is asked");

    // The target cannot take it: it goes back to the source, and stays
    // recorded there.
    c.a.lock().unwrap().fail_adopt = true;
    let (status, refused) = c.call(&c.team, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-a"}))).await;
    assert_eq!((status, refused["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("volume_in_use")), "{refused}");
    assert!(!c.on(&c.a, "team", "ws") && c.on(&c.b, "team", "ws"), "given back to its node");
    let (_, shown) = c.call(&c.team, "GET", "/v1/volumes/ws", None).await;
    assert_eq!(shown["node"], "node-b", "{shown}");

    // A sandbox that mounts it is placed like any other (node-a: listed
    // first, as much room), and the volume follows it there.
    let mounts = json!({"template": "base", "volumes": [{"name": "ws", "path": "/workspace"}]});
    let (status, accepted) = c.call(&c.team, "POST", "/v1/sandboxes", Some(mounts.clone())).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    assert_eq!((c.a.lock().unwrap().sandboxes, c.b.lock().unwrap().sandboxes), (1, 0));
    assert!(c.on(&c.a, "team", "ws") && !c.on(&c.b, "team", "ws"), "the volume followed its sandbox");

    // Mounted where it is: the next sandbox goes there, though node-b has
    // more room now (the first sandbox is counted on node-a).
    c.a.lock().unwrap().volumes.get_mut(&("team".into(), "ws".into())).unwrap().volume.mounted_by.push(VolumeHolder {
        sandbox_id: "sbx_1".into(),
        path: "/workspace".into(),
        read_only: false,
    });
    let (status, accepted) = c.call(&c.team, "POST", "/v1/sandboxes", Some(mounts)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    assert_eq!((c.a.lock().unwrap().sandboxes, c.b.lock().unwrap().sandboxes), (2, 0));
    let releases = c.asked(&c.a).iter().filter(|a| *a == "POST /internal/v1/volumes/release").count();
    assert_eq!(releases, 2, "placed on node-b first, the volume refused to leave: {:?}", c.asked(&c.a));
    // Another tenant still finds nothing.
    let (status, _) = c.call(&c.other, "POST", "/v1/volumes/ws/move", Some(json!({"node": "node-b"}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
