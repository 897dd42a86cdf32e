//! A real server on a real socket over a real data dir, and a client that
//! checks every JSON answer against the server's own OpenAPI document.
//! Requests go through `space-client`, the API's own client, so these tests
//! exercise it too; only `raw`, `early_answer` and `by_hand` frame requests
//! themselves.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use space_api::{CommandRequest, CreateSandboxRequest, SandboxState};
use space_server::{AppState, Platform, PlatformConfig};
use space_testkit::{agent_bin, TestDataDir};

/// The preview domain every test server serves (`--preview-domain`).
pub const PREVIEW_DOMAIN: &str = "preview.space.test";

pub struct TestServer {
    pub url: String,
    pub key: String,
    pub platform: Arc<Platform>,
    runtime: Option<tokio::runtime::Runtime>,
    /// The root helper doing the engine's and templates' root work, over
    /// its socket, as beside `space serve --helper-socket` (dropped last).
    helper: Option<tokio::runtime::Runtime>,
    contract: Value,
}

pub fn platform_config(data: &TestDataDir) -> PlatformConfig {
    PlatformConfig {
        data_dir: data.root().to_path_buf(),
        runsc: PathBuf::from("runsc"),
        agent_bin: agent_bin(),
        importer_bin: space_testkit::space_bin(),
        warm_pool: 0,
        hot_pool: 0,
        capacity_mib: None,
        ext4_images: None,
        engine: space_server::EngineChoice::Gvisor,
        firecracker_bin: None,
        auto_pause_s: space_server::DEFAULT_AUTO_PAUSE_S,
        max_output_mib: space_server::platform::DEFAULT_MAX_OUTPUT_BYTES >> 20,
        max_sandbox_output_mib: space_server::disk::DEFAULT_MAX_SANDBOX_OUTPUT_BYTES >> 20,
        disk_reserve_mib: space_server::disk::DEFAULT_DISK_RESERVE_MIB,
        egress: Default::default(),
        database: None,
        registry: Default::default(),
        layer_cache_mib: space_server::DEFAULT_LAYER_CACHE_MIB,
        shared_volumes: None,
    }
}

/// A helper serving `config`'s data dir to this process's uid; its runtime
/// and socket.
fn start_helper(config: &PlatformConfig) -> (tokio::runtime::Runtime, PathBuf) {
    let helper = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let socket = config.data_dir.join("run").join("helper.sock");
    let _ = std::fs::remove_file(&socket);
    let gvisor = space_engine::gvisor::GvisorConfig {
        runsc: config.runsc.clone(),
        agent_bin: config.agent_bin.clone(),
        state_dir: config.data_dir.join("run").join("runsc"),
    };
    // The microVMs too, when the test gives a firecracker binary.
    let firecracker = config.firecracker_bin.clone().map(|binary| {
        let data = space_host::datadir::DataDir::open(&config.data_dir).expect("the test's data dir");
        space_server::firecracker_config(&data, binary)
    });
    let (at, uid, importer) = (socket.clone(), nix::unistd::geteuid().as_raw(), config.importer_bin.clone());
    helper.spawn(async move {
        if let Err(err) = space_engine::helper::serve_helper(gvisor, firecracker, None, &importer, &at, uid).await {
            eprintln!("the test's helper stopped serving: {err}");
        }
    });
    space_testkit::wait_until("the helper's socket", space_testkit::PATIENCE, || socket.exists());
    (helper, socket)
}

impl TestServer {
    pub fn start(data: &TestDataDir) -> TestServer {
        Self::start_with(platform_config(data))
    }

    /// The platform over `config` as it runs in production: every engine
    /// and template call crosses the helper's socket to a helper (on a
    /// runtime of its own, as its own process would be). The server itself
    /// stays this test's root process (the confined process is tested from
    /// the `space` binary's tests); `SPACE_TEST_ONE_PROCESS=1` runs the
    /// engine's root work in the platform instead.
    pub fn start_with(config: PlatformConfig) -> TestServer {
        let (platform, helper) = if std::env::var_os("SPACE_TEST_ONE_PROCESS").is_some() {
            (space_server::start_platform(&config).expect("starting the platform"), None)
        } else {
            let (helper, socket) = start_helper(&config);
            let platform =
                space_server::start_platform_with_helper(&config, Some(&socket)).expect("starting the platform");
            (platform, Some(helper))
        };
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let key = format!("test-key-{}", std::process::id());
        runtime.block_on(platform.start()).expect("recovering what a previous server left");
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let preview = space_server::preview::PreviewDomain::new(PREVIEW_DOMAIN).unwrap();
        let state = AppState::new(platform.clone(), key.clone()).with_preview(preview);
        runtime.spawn(space_server::serve(listener, state, std::future::pending()));
        let mut server = TestServer { url, key, platform, runtime: Some(runtime), helper, contract: Value::Null };
        let (status, doc) = server.call("GET", "/v1/openapi.json", None);
        assert_eq!(status, 200);
        server.contract = doc;
        server
    }

    /// Stops serving and drops every in-memory handle, as a killed server would.
    pub fn stop(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// Every call's deadline: a server that stops answering fails the test.
    fn agent(&self) -> ureq::Agent {
        ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build()
    }

    /// The API's own client, with the server's key.
    pub fn client(&self) -> space_client::Client {
        self.client_as(&self.key)
    }

    /// The API's own client, with another key (a tenant's).
    pub fn client_as(&self, key: &str) -> space_client::Client {
        space_client::Client::with_agent(&self.url, key, self.agent())
    }

    // `raw`, `early_answer` and `by_hand` frame requests themselves: tests
    // send through them what a typed client must not be able to send (no
    // key, a bad one, odd headers or bodies, requests written byte by byte).

    /// A raw request; returns status and body text, checking nothing.
    pub fn raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&str>) -> (u16, String) {
        let mut request = self.agent().request(method, &format!("{}{path}", self.url));
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
            Err(err) => panic!("{method} {path}: {err}"),
        };
        (response.status(), response.into_string().unwrap_or_default())
    }

    /// A request written on a raw socket, for cases where the server may
    /// answer (and close) before reading the body: the body is written
    /// best-effort and the answer read regardless. Returns the whole answer
    /// (what came within a minute).
    pub fn early_answer(&self, head: &str, body: &[u8]) -> String {
        let mut socket = std::net::TcpStream::connect(self.url.trim_start_matches("http://")).unwrap();
        socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        socket.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
        let head = format!("{head}\r\nHost: test\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        std::io::Write::write_all(&mut socket, head.as_bytes()).unwrap();
        let _ = std::io::Write::write_all(&mut socket, body);
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(&mut socket, &mut answer);
        answer
    }

    /// Writes `request` as given on a connection of its own and reads the
    /// answer: to its end, or for an upgrade only its head. Nothing waits
    /// past a minute.
    pub fn by_hand(&self, request: impl AsRef<[u8]>) -> String {
        use std::io::{Read, Write};
        let mut socket = std::net::TcpStream::connect(self.url.trim_start_matches("http://")).unwrap();
        socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        socket.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
        socket.write_all(request.as_ref()).unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = socket.read(&mut buf) {
            answer.extend_from_slice(&buf[..n]);
            if answer.starts_with(b"HTTP/1.1 101") && answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// An authenticated JSON call whose answer is checked against the contract.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call_as(&self.key.clone(), method, path, body)
    }

    /// [`Self::call`] with another API key (a tenant's).
    pub fn call_as(&self, key: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (status, value) =
            self.client_as(key).call(method, path, body.as_ref()).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        if !self.contract.is_null() {
            self.check(method, path, status, "application/json", &value);
        }
        (status, value)
    }

    /// POSTs a file as the body (streamed), checked against the contract.
    pub fn upload(&self, path: &str, content_type: &str, file: &std::path::Path) -> (u16, Value) {
        let file = std::fs::File::open(file).expect("opening the upload");
        let answer = self
            .client()
            .send_with("POST", path, &[("Content-Type", content_type)], file)
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        self.check("POST", path, answer.status, "application/json", &answer.body);
        (answer.status, answer.body)
    }

    pub fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, value) = self.call(method, path, body);
        assert!((200..300).contains(&status), "{method} {path} -> {status}: {value}");
        value
    }

    /// Asserts the error shape, the status and the code, as the client
    /// reads them.
    pub fn error(&self, method: &str, path: &str, body: Option<Value>, status: u16, code: &str) -> Value {
        let (got, value) = self.call(method, path, body);
        assert_eq!(got, status, "{method} {path}: {value}");
        assert_eq!(value["error"]["code"], code, "{value}");
        let read = space_client::ClientError::from_answer(got, &value);
        assert_eq!(read.code().map(space_api::ErrorCode::as_str), Some(code), "a code the client knows: {value}");
        assert!(value["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{value}");
        assert!(value["error"]["details"].is_object(), "{value}");
        value
    }

    /// Validates `value` against the contract's schema for this response.
    pub fn check(&self, method: &str, path: &str, status: u16, content_type: &str, value: &Value) {
        let concrete = path.split('?').next().unwrap();
        let paths = self.contract["paths"].as_object().expect("paths");
        let (template, item) = paths
            .iter()
            .find(|(template, _)| matches_template(template, concrete))
            .unwrap_or_else(|| panic!("{concrete} is not in the OpenAPI document"));
        let operation = &item[method.to_lowercase()];
        assert!(operation.is_object(), "{method} {template} is not in the OpenAPI document");
        let response = &operation["responses"][status.to_string()];
        assert!(response.is_object(), "{method} {template} answered {status}, which the document does not list");
        let schema = &response["content"][content_type]["schema"];
        if schema.is_null() {
            return;
        }
        let mut root = schema.clone();
        root.as_object_mut().unwrap().insert("components".into(), self.contract["components"].clone());
        let validator = jsonschema::validator_for(&root).expect("a valid schema");
        let errors: Vec<String> = validator.iter_errors(value).map(|e| format!("{e} at {}", e.instance_path)).collect();
        assert!(errors.is_empty(), "{method} {path} {status} does not match the contract: {errors:?}\n{value}");
    }

    // The typed calls: the client reads each answer as the API's own type,
    // which is what the contract's schemas are made from, so they are not
    // checked against the contract again.

    /// Creates a sandbox and waits for its create operation to succeed.
    pub fn create_sandbox(&self, body: Value) -> String {
        let request: CreateSandboxRequest =
            serde_json::from_value(body.clone()).unwrap_or_else(|e| panic!("not a create request ({e}): {body}"));
        let accepted = self.client().create_sandbox(&request).unwrap_or_else(|e| panic!("creating {body}: {e}"));
        assert_eq!(accepted.sandbox.state, SandboxState::Creating, "{accepted:?}");
        let operation = self.wait_operation(&accepted.operation.id);
        assert_eq!(operation["state"], "succeeded", "{operation}");
        accepted.sandbox.id
    }

    /// An operation once it has ended (within five minutes).
    pub fn wait_operation(&self, id: &str) -> Value {
        let patience = Duration::from_secs(300);
        let operation = self
            .client()
            .wait_for_operation_within(id, patience)
            .unwrap_or_else(|e| panic!("waiting for operation {id}: {e}"));
        assert!(operation.state.is_terminal(), "operation {id} did not end within {patience:?}: {operation:?}");
        serde_json::to_value(operation).unwrap()
    }

    /// Runs a command to its end; its answer.
    pub fn exec(&self, sandbox: &str, body: Value) -> Value {
        let request: CommandRequest =
            serde_json::from_value(body.clone()).unwrap_or_else(|e| panic!("not a command ({e}): {body}"));
        let ran = self.client().exec(sandbox, &request).unwrap_or_else(|e| panic!("exec {body} in {sandbox}: {e}"));
        serde_json::to_value(ran).unwrap()
    }

    /// Reads an NDJSON output stream, checking each frame against the contract.
    pub fn output(&self, sandbox: &str, command: &str, query: &str) -> Vec<Value> {
        let path = format!("/v1/sandboxes/{sandbox}/commands/{command}/output{query}");
        let body = self.client().get_text(&path).unwrap_or_else(|e| panic!("GET {path}: {e}"));
        body.lines()
            .map(|line| {
                let frame: Value = serde_json::from_str(line).unwrap();
                self.check("GET", &path, 200, "application/x-ndjson", &frame);
                frame
            })
            .collect()
    }

    /// Deletes a sandbox; the delete's operation once it has ended.
    pub fn delete_sandbox(&self, id: &str) -> Value {
        let accepted = self.client().delete_sandbox(id).unwrap_or_else(|e| panic!("deleting {id}: {e}"));
        self.wait_operation(&accepted.operation.id)
    }
}

impl Drop for TestServer {
    /// Deletes whatever sandboxes a test left, so no runsc process outlives it.
    fn drop(&mut self) {
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        let platform = self.platform.clone();
        runtime.block_on(async move {
            platform.warm().drain().await;
            for record in platform.store().node().sandboxes().unwrap_or_default() {
                if record.sandbox.state == space_api::SandboxState::Deleted {
                    continue;
                }
                // Loaded as its own tenant: the runtime acts on a sandbox only for its owner.
                let caller = space_server::tenants::Caller::tenant(record.tenant.clone());
                let Some(id) = space_server::ids::SandboxId::parse(&record.sandbox.id) else { continue };
                let Ok(sandbox) = platform.sandbox_for(&caller, &id) else { continue };
                if let Ok((_, operation)) = platform.request(&sandbox, space_api::OperationKind::Delete, None) {
                    let deadline = Some(std::time::Instant::now() + Duration::from_secs(30));
                    let _ = platform
                        .wait_for(deadline, || platform.operation(&operation.id), |op| op.state.is_terminal())
                        .await;
                }
            }
        });
        runtime.shutdown_timeout(Duration::from_secs(2));
    }
}

fn matches_template(template: &str, concrete: &str) -> bool {
    let t: Vec<&str> = template.split('/').collect();
    let c: Vec<&str> = concrete.split('/').collect();
    t.len() == c.len() && t.iter().zip(&c).all(|(t, c)| (t.starts_with('{') && t.ends_with('}')) || t == c)
}

/// Concatenates the text of output frames of one kind.
pub fn text_of(frames: &[Value], kind: &str) -> String {
    frames.iter().filter(|f| f["type"] == kind).map(|f| f["data"].as_str().unwrap_or("")).collect()
}

/// A tar entry written by hand, so that names tar's builder refuses (`..`)
/// can be in it.
pub fn tar_entry(
    archive: &mut tar::Builder<Vec<u8>>,
    name: &str,
    kind: tar::EntryType,
    data: &[u8],
    link: Option<&str>,
) {
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(if kind == tar::EntryType::Directory { 0o755 } else { 0o644 });
    header.set_entry_type(kind);
    header.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
    if let Some(link) = link {
        header.set_link_name(link).unwrap();
    }
    header.set_cksum();
    archive.append(&header, data).unwrap();
}
