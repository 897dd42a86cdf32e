//! The gVisor lifecycle across the helper's socket: a helper serving the
//! engine's root work (its serve loop over the in-process host, counting
//! what reaches each method) and a platform started as `space serve
//! --helper-socket` starts it; create, exec, pause, resume, suspend,
//! resume, fork and delete a real sandbox through the API. A platform that
//! went around the helper, or a request served by another method, fails.

mod common;

use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use space_engine::gvisor::{LocalConfig, LocalHost};
use space_engine::helper::serve;
use space_engine::host::{EngineHost, Launched};
use space_engine::privsep::layout::Layout;
use space_engine::privsep::peer::HelperListener;
use space_engine::privsep::proto::{EngineState, ImageRef, Mount, PatienceMs, SandboxId, Shape, SlackNs, StartFrom};
use space_engine::EngineError;
use space_server::AppState;
use space_testkit::{processes_mentioning, TestDataDir};

/// The longest any one API call or operation may take here.
const PATIENCE: Duration = Duration::from_secs(300);

/// The in-process host, counting the calls that reach each method.
struct Counting {
    inner: LocalHost,
    calls: Mutex<BTreeMap<&'static str, usize>>,
}

impl Counting {
    fn count(&self, method: &'static str) {
        *self.calls.lock().unwrap().entry(method).or_default() += 1;
    }

    fn counted(&self, method: &str) -> usize {
        self.calls.lock().unwrap().get(method).copied().unwrap_or(0)
    }
}

impl EngineHost for Counting {
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<Launched, EngineError> {
        self.count(match from {
            StartFrom::Template { .. } => "start from a template",
            StartFrom::Suspended {} => "start from its snapshot",
            StartFrom::Image { .. } => "start from an image",
            StartFrom::TemplateImage { .. } => "start from a template's image",
            StartFrom::Clone { .. } => "start as a clone",
            StartFrom::Layer { .. } => "start on a layer chain",
        });
        self.inner.start(sandbox, from, shape, mounts)
    }
    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.count("pause");
        self.inner.pause(sandbox)
    }
    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.count("resume");
        self.inner.resume(sandbox)
    }
    fn freeze(&self, sandbox: &SandboxId, frozen: bool) -> Result<(), EngineError> {
        self.count(if frozen { "freeze" } else { "thaw" });
        self.inner.freeze(sandbox, frozen)
    }
    fn set_timer_slack(&self, sandbox: &SandboxId, slack: Option<SlackNs>) -> Result<usize, EngineError> {
        self.count("set_timer_slack");
        self.inner.set_timer_slack(sandbox, slack)
    }
    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.count("suspend");
        self.inner.suspend(sandbox)
    }
    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError> {
        self.count("save_image");
        self.inner.save_image(sandbox, image)
    }
    fn drop_snapshot(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.count("drop_snapshot");
        self.inner.drop_snapshot(sandbox)
    }
    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.count("stop");
        self.inner.stop(sandbox)
    }
    fn stop_strays(&self, sandbox: &SandboxId) {
        self.count("stop_strays");
        self.inner.stop_strays(sandbox)
    }
    fn settle_orphans(&self, sandboxes: &[SandboxId], patience: PatienceMs) {
        self.count("settle_orphans");
        self.inner.settle_orphans(sandboxes, patience)
    }
    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.count("destroy");
        self.inner.destroy(sandbox)
    }
    fn state(&self, sandbox: &SandboxId) -> EngineState {
        self.count("state");
        self.inner.state(sandbox)
    }
    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState> {
        self.count("states");
        self.inner.states(sandboxes)
    }
    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        self.count("listen_agent");
        self.inner.listen_agent(sandbox)
    }
    fn close_agent(&self, sandbox: &SandboxId) {
        self.count("close_agent");
        self.inner.close_agent(sandbox)
    }
    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError> {
        self.count("drop_image");
        self.inner.drop_image(sandbox, image)
    }

    fn availability(&self) -> (bool, String) {
        self.count("availability");
        self.inner.availability()
    }

    fn engine_log(&self, sandbox: &SandboxId) -> String {
        self.count("engine_log");
        self.inner.engine_log(sandbox)
    }
}

struct Served {
    client: space_client::Client,
    runtime: tokio::runtime::Runtime,
}

impl Served {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.client.call(method, path, body.as_ref()).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    fn operation(&self, accepted: &Value) -> Value {
        let id = accepted["operation"]["id"].as_str().unwrap_or_else(|| panic!("no operation: {accepted}"));
        let done = self.client.wait_for_operation_within(id, PATIENCE).unwrap();
        assert!(done.state.is_terminal(), "operation {id} did not end within {PATIENCE:?}");
        serde_json::to_value(done).unwrap()
    }

    fn lifecycle(&self, id: &str, action: &str) {
        let (status, accepted) = self.call("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
        assert_eq!(status, 202, "{action}: {accepted}");
        let done = self.operation(&accepted);
        assert_eq!(done["state"], "succeeded", "{action}: {done}");
    }

    fn sh(&self, id: &str, cmd: &str) -> String {
        let (status, ran) = self.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": cmd})));
        assert_eq!(status, 200, "{cmd}: {ran}");
        assert_eq!(ran["result"]["exit_code"], 0, "{cmd}: {ran}");
        ran["stdout"].as_str().unwrap().to_string()
    }

    fn state(&self, id: &str) -> Value {
        self.call("GET", &format!("/v1/sandboxes/{id}"), None).1["state"].clone()
    }
}

#[test]
fn the_gvisor_lifecycle_crosses_the_helper_socket() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let config = common::platform_config(&data);

    // The helper: its own runtime, as its own process would have.
    let helper = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let socket: PathBuf = data.data.run_dir().join("helper.sock");
    let host = Arc::new(Counting {
        inner: LocalHost::new(LocalConfig {
            runsc: config.runsc.clone(),
            agent_bin: config.agent_bin.clone(),
            state_dir: data.data.run_dir().join("runsc"),
            layout: Layout::new(data.root()),
        }),
        calls: Mutex::new(BTreeMap::new()),
    });
    let listener = helper.block_on(async { HelperListener::bind(&socket, 0) }).unwrap();
    helper.spawn(serve(listener, host.clone()));

    // The server, as `space serve --helper-socket` starts it.
    let platform = space_server::start_platform_with_helper(&config, Some(&socket)).expect("starting the platform");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(platform.start()).expect("recovering what a previous server left");
    let tcp = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", tcp.local_addr().unwrap());
    let key = format!("test-key-{}", std::process::id());
    runtime.spawn(space_server::serve(tcp, AppState::new(platform.clone(), key.clone()), std::future::pending()));
    let served = Served { client: space_client::Client::with_deadline(&url, &key, PATIENCE), runtime };

    let (status, accepted) = served.call("POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(served.operation(&accepted)["state"], "succeeded");
    let id = accepted["sandbox"]["id"].as_str().unwrap().to_string();
    assert_eq!(host.counted("start from a template"), 1, "the sandbox was started by the helper");
    // A process and a file, to find again after each step.
    served.sh(&id, "echo kept > /root/file; nohup sleep 3600 >/dev/null 2>&1 & echo $! > /root/pid");
    let pid = served.sh(&id, "cat /root/pid");

    served.lifecycle(&id, "pause");
    assert_eq!(served.state(&id), "paused");
    assert_eq!((host.counted("pause"), host.counted("freeze")), (1, 1));
    served.lifecycle(&id, "resume");
    assert_eq!((host.counted("thaw"), host.counted("resume")), (1, 1));
    assert_eq!(served.sh(&id, "cat /root/file; kill -0 $(cat /root/pid) && cat /root/pid"), format!("kept\n{pid}"));

    served.lifecycle(&id, "suspend");
    assert_eq!(served.state(&id), "suspended");
    assert_eq!(host.counted("suspend"), 1);
    served.lifecycle(&id, "resume");
    assert_eq!(host.counted("start from its snapshot"), 1, "the resume restored through the helper");
    assert_eq!(host.counted("drop_snapshot"), 1);
    assert_eq!(served.sh(&id, "cat /root/file; kill -0 $(cat /root/pid) && cat /root/pid"), format!("kept\n{pid}"));

    let (status, accepted) = served.call("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({})));
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(served.operation(&accepted)["state"], "succeeded");
    let fork = accepted["sandboxes"][0]["id"].as_str().unwrap().to_string();
    assert_eq!((host.counted("save_image"), host.counted("start from an image")), (1, 1));
    assert!(host.counted("listen_agent") >= 1, "the source's agent redialed through the helper");
    served.sh(&fork, "echo forked > /root/file");
    assert_eq!(served.sh(&fork, "cat /root/file; kill -0 $(cat /root/pid) && echo alive"), "forked\nalive\n");
    assert_eq!(served.sh(&id, "cat /root/file"), "kept\n", "the source goes its own way");

    for sandbox in [&fork, &id] {
        let (status, accepted) = served.call("DELETE", &format!("/v1/sandboxes/{sandbox}"), None);
        assert!(status == 200 || status == 202, "{accepted}");
        assert_eq!(served.operation(&accepted)["state"], "succeeded");
        assert!(!data.data.sandbox_dir(sandbox).exists());
        assert_eq!(processes_mentioning(sandbox), 0, "no process of {sandbox} is left");
    }
    assert!(host.counted("destroy") >= 2, "each deleted sandbox was destroyed by the helper");
    assert!(host.counted("close_agent") >= 3, "each agent that dialed in was shut out");

    // Without the helper no sandbox starts: the platform asks no one else.
    helper.shutdown_timeout(Duration::from_secs(20));
    let (status, accepted) = served.call("POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{accepted}");
    let failed = served.operation(&accepted);
    assert_eq!(failed["state"], "failed", "{failed}");
    served.runtime.block_on(platform.shutdown());
}
