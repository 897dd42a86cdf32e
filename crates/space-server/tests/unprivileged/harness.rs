//! A platform on a plain temporary directory over the fake engine, served
//! by the real router on a loopback socket. A `Node` is one server
//! process: stopping it shuts its runtime down (every task and socket of
//! it goes, as when it is killed) while the fake sandboxes live on in the
//! engine, for the next `Node` over the same `World` to find.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use space_api::SandboxState;
use space_engine::fake::FakeEngine;
use space_server::{AppState, Platform, PlatformConfig};

/// How long any wait of a test may take before it fails.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The template every world has: 1 vCPU, 256 MiB, 1 GiB of disk.
pub const TEMPLATE: &str = "base";
pub const MEMORY_MIB: u64 = 256;

/// A data dir and the fake engine whose sandboxes outlive servers.
pub struct World {
    pub root: PathBuf,
    pub engine: FakeEngine,
}

impl World {
    pub fn new() -> World {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let base = std::env::var_os("SPACE_UNPRIVILEGED_TMP").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        let root = base.join(format!("space-u-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("a temporary data dir");
        let world = World { root, engine: FakeEngine::new() };
        world.template(TEMPLATE, 1, json!({}));
        world
    }

    /// Writes version `version` of template `name`; `extra` goes into its
    /// `template.json` (pool sizes, an owner).
    pub fn template(&self, name: &str, version: u32, extra: Value) {
        let dir = self.root.join("templates").join(name).join(version.to_string());
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        let mut meta = json!({
            "name": name,
            "version": version,
            "created_at": "2026-01-01T00:00:00.000Z",
            "source": {},
            "defaults": {"vcpus": 1, "memory_mib": MEMORY_MIB, "disk_mib": 1024, "env": {}, "workdir": "/root", "user": "root"},
        });
        for (key, value) in extra.as_object().unwrap() {
            meta[key] = value.clone();
        }
        std::fs::write(dir.join("template.json"), meta.to_string()).unwrap();
    }

    pub fn config(&self) -> PlatformConfig {
        PlatformConfig {
            data_dir: self.root.clone(),
            runsc: PathBuf::from("/nonexistent/runsc"),
            agent_bin: PathBuf::from("/nonexistent/space-agent"),
            importer_bin: PathBuf::from("/nonexistent/space"),
            warm_pool: 0,
            hot_pool: 0,
            capacity_mib: Some(16 * 1024),
            ext4_images: Some(false),
            engine: space_server::EngineChoice::Gvisor,
            firecracker_bin: None,
            // Tests of idleness turn it on; elsewhere it must not move
            // sandboxes under a test.
            auto_pause_s: 0,
            max_output_mib: 16,
            max_sandbox_output_mib: 64,
            disk_reserve_mib: 0,
            egress: Default::default(),
            database: None,
            registry: Default::default(),
            layer_cache_mib: space_server::DEFAULT_LAYER_CACHE_MIB,
            shared_volumes: None,
        }
    }

    pub fn start(&self) -> Node {
        self.start_with(|_| {})
    }

    pub fn start_with(&self, tweak: impl FnOnce(&mut PlatformConfig)) -> Node {
        let mut config = self.config();
        tweak(&mut config);
        let engine: Arc<dyn space_engine::Engine> = Arc::new(self.engine.clone());
        let platform = space_server::start_platform_with(&config, engine).expect("starting the platform");
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(platform.start()).expect("taking up what a previous server left");
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let key = "unprivileged-test-key".to_string();
        let state = AppState::new(platform.clone(), key.clone());
        let (stop_serving, stop) = tokio::sync::oneshot::channel::<()>();
        let serving = runtime.spawn(space_server::serve(listener, state, async move {
            let _ = stop.await;
        }));
        let client = space_client::Client::with_deadline(&url, &key, PATIENCE * 2);
        Node { platform, key, client, runtime: Some(runtime), serving: Some((stop_serving, serving)) }
    }

    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.root.join("sandboxes").join(id)
    }

    /// What the server keeps of a sandbox (transcripts, checkpoints' records).
    pub fn sandbox_state_dir(&self, id: &str) -> PathBuf {
        self.root.join("state").join("sandboxes").join(id)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// One server process over a world.
pub struct Node {
    pub platform: Arc<Platform>,
    pub key: String,
    /// The API's own client, with the node's key; every call of it is
    /// over within twice the patience.
    client: space_client::Client,
    runtime: Option<tokio::runtime::Runtime>,
    /// What stops the API's serving, and its task.
    serving: Option<(tokio::sync::oneshot::Sender<()>, Serving)>,
}

type Serving = tokio::task::JoinHandle<Result<(), space_server::ServerError>>;

impl Node {
    /// Stops the server as a kill would: every task and connection of it
    /// goes; what it wrote stays.
    pub fn kill(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(5));
        }
    }

    /// Stops the server as `space serve` does on SIGTERM: the API stops
    /// serving, then the platform shuts down. The runtime stays (until
    /// `kill`), so what would still run on it can be seen.
    pub fn shut_down(&mut self) {
        if let Some((stop, serving)) = self.serving.take() {
            let _ = stop.send(());
            let served = self.block_on(async { tokio::time::timeout(PATIENCE, serving).await });
            served.expect("the API stops serving in time").unwrap().unwrap();
        }
        let platform = self.platform.clone();
        let shutdown = self.block_on(async { tokio::time::timeout(PATIENCE * 2, platform.shutdown()).await });
        shutdown.expect("the platform shuts down in time");
    }

    pub fn block_on<T>(&self, future: impl std::future::Future<Output = T>) -> T {
        self.runtime.as_ref().expect("a running node").block_on(future)
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call_as(&self.key, method, path, body)
    }

    pub fn call_as(&self, key: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let client = self.client.with_key(key);
        client.call(method, path, body.as_ref()).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// A call that must succeed; its answer.
    pub fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, value) = self.call(method, path, body);
        assert!((200..300).contains(&status), "{method} {path} -> {status}: {value}");
        value
    }

    /// A call that must fail with `status` and `code`; its error.
    pub fn refused(&self, method: &str, path: &str, body: Option<Value>, status: u16, code: &str) -> Value {
        let (got, value) = self.call(method, path, body);
        assert_eq!(got, status, "{method} {path}: {value}");
        assert_eq!(value["error"]["code"], code, "{method} {path}: {value}");
        value
    }

    /// Asks for a sandbox; its id and the create's operation id.
    pub fn create_started(&self, body: Value) -> (String, String) {
        let answer = self.ok("POST", "/v1/sandboxes", Some(body));
        (answer["sandbox"]["id"].as_str().unwrap().into(), answer["operation"]["id"].as_str().unwrap().into())
    }

    /// A running sandbox of the base template.
    pub fn create(&self) -> String {
        self.create_with(json!({}))
    }

    /// A running sandbox of the base template with `extra` in its request.
    pub fn create_with(&self, extra: Value) -> String {
        let mut body = json!({"template": TEMPLATE});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        let (id, operation) = self.create_started(body);
        let done = self.wait_op(&operation);
        assert_eq!(done["state"], "succeeded", "{done}");
        id
    }

    /// Files a lifecycle request (`pause`, `resume`, `suspend`); its
    /// operation id.
    pub fn request(&self, id: &str, action: &str) -> String {
        let answer = self.ok("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
        answer["operation"]["id"].as_str().unwrap().into()
    }

    /// Carries out a lifecycle request to its end; the operation.
    pub fn act(&self, id: &str, action: &str) -> Value {
        let operation = self.request(id, action);
        self.wait_op(&operation)
    }

    pub fn delete(&self, id: &str) -> Value {
        let answer = self.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
        self.wait_op(answer["operation"]["id"].as_str().unwrap())
    }

    /// The operation once it ended (a failure if it does not in time).
    pub fn wait_op(&self, id: &str) -> Value {
        self.wait_op_as(&self.key.clone(), id)
    }

    /// [`Node::wait_op`] for the tenant whose key is `key`.
    pub fn wait_op_as(&self, key: &str, id: &str) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let (status, operation) = self.call_as(key, "GET", &format!("/v1/operations/{id}?wait=10"), None);
            assert_eq!(status, 200, "{operation}");
            if matches!(operation["state"].as_str(), Some("succeeded" | "failed" | "cancelled")) {
                return operation;
            }
            assert!(Instant::now() < deadline, "operation {id} did not end: {operation}");
        }
    }

    pub fn sandbox(&self, id: &str) -> Value {
        self.ok("GET", &format!("/v1/sandboxes/{id}"), None)
    }

    pub fn state(&self, id: &str) -> String {
        self.sandbox(id)["state"].as_str().unwrap().to_string()
    }

    /// Waits until the sandbox's record is in `state`; the sandbox.
    pub fn wait_state(&self, id: &str, state: SandboxState) -> Value {
        let platform = self.platform.clone();
        let deadline = Some(tokio::time::Instant::now().into_std() + PATIENCE);
        let found = self.block_on(platform.wait_for(deadline, || load(&platform, id), |r| r.sandbox.state == state));
        let found = found.expect("the sandbox's record");
        assert_eq!(found.sandbox.state, state, "sandbox {id}: {:?}", found.sandbox);
        self.sandbox(id)
    }

    /// Runs `argv` in the sandbox to its end; the exec's answer.
    pub fn exec(&self, id: &str, argv: &[&str]) -> Value {
        self.ok("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": argv})))
    }

    /// Starts `argv` in the sandbox; the command's id.
    pub fn start_command(&self, id: &str, argv: &[&str]) -> String {
        let created = self.ok("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"argv": argv})));
        created["command"]["id"].as_str().unwrap().to_string()
    }

    /// The command once it exited.
    pub fn wait_command(&self, id: &str, command: &str) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let found = self.ok("GET", &format!("/v1/sandboxes/{id}/commands/{command}?wait=10"), None);
            if found["state"] == "exited" {
                return found;
            }
            assert!(Instant::now() < deadline, "command {command} did not end: {found}");
        }
    }

    /// A key of a new tenant with `quotas` (`null`: none).
    pub fn tenant(&self, name: &str, quotas: Value) -> String {
        let quotas: Option<space_server::store::Quotas> = serde_json::from_value(quotas).unwrap();
        let (_, key) = space_server::tenants::create_key(self.platform.store(), name, quotas.as_ref()).unwrap();
        key
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A sandbox's record as the store holds it (white-box: whoever owns it).
fn load(
    platform: &space_server::Platform,
    id: &str,
) -> Result<space_server::store::SandboxRecord, space_node::NodeError> {
    let record = platform.store().node().sandbox(id)?;
    record.ok_or_else(|| space_node::NodeError::not_found("sandbox", id))
}
