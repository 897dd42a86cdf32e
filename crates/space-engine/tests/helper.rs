//! The helper's serve loop and its client over a real Unix socket, with a
//! host that records each call: every request reaches the host method of
//! its name and its answer comes back (descriptors, a start's second
//! reply), a failing method is a refusal on a connection that goes on, a
//! malformed frame closes its own connection only, and a client of another
//! uid is refused. No runsc; the other-uid child needs root.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_engine::helper::{serve, HelperHost};
use space_engine::host::{EngineHost, Launched};
use space_engine::EngineError;
use space_privsep::client::BlockingClient;
use space_privsep::peer::{HelperListener, PeerError};
use space_privsep::proto::{
    CheckpointName, DiskMib, Engine, EngineState, ImageRef, MemoryMib, Mount, PatienceMs, Refusal, Reply, Request,
    SandboxId, Shape, SlackNs, StartFrom, Vcpus, PROTOCOL_VERSION,
};

/// Every wait in these tests ends by then.
const DEADLINE: Duration = Duration::from_secs(20);
const SBX: &str = "sbx_0123456789abcdef0123";
/// The sandbox whose every request fails in the recording host.
const FAILING: &str = "sbx_ffffffffffffffffffff";
const NOBODY: u32 = 65534;
/// Set in a child process: the helper socket it connects to.
const CHILD_ENV: &str = "SPACE_HELPER_TEST_CHILD";

fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

fn id(text: &str) -> SandboxId {
    SandboxId::parse(text).unwrap()
}

fn shape() -> Shape {
    Shape {
        memory_mib: MemoryMib::new(512).unwrap(),
        vcpus: Vcpus::new(2).unwrap(),
        disk_mib: DiskMib::new(1024).unwrap(),
    }
}

/// A host that notes each call as `method sandbox [detail]` and answers
/// with values the test can recognise; every call on [`FAILING`] fails.
struct Recording {
    calls: Mutex<Vec<String>>,
    scratch: PathBuf,
}

impl Recording {
    fn note(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }

    fn outcome(&self, sandbox: &SandboxId, call: String) -> Result<(), EngineError> {
        self.note(call);
        match sandbox.as_str() {
            FAILING => Err(EngineError::Runtime(format!("{sandbox} is broken"))),
            _ => Ok(()),
        }
    }

    fn listener(&self, name: &str) -> UnixListener {
        let path = self.scratch.join(format!("{name}.sock"));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        listener
    }
}

impl EngineHost for Recording {
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        _mounts: &[Mount],
    ) -> Result<Launched, EngineError> {
        let from = match from {
            StartFrom::Template { template } => format!("template {}/{}", template.name, template.version.get()),
            StartFrom::Suspended {} => "suspended".into(),
            other => format!("{other:?}"),
        };
        self.note(format!("start {sandbox} {from} {}", shape.memory_mib.get()));
        let failing = sandbox.as_str() == FAILING;
        Ok(Launched {
            listener: self.listener(&format!("start-{sandbox}")),
            pid: 4321,
            // A failing sandbox's engine command fails once it returns.
            finished: Box::new(move || match failing {
                true => Err(EngineError::Runtime("runsc run failed: no such template".into())),
                false => Ok(()),
            }),
            steps: vec![
                ("root snapshot (btrfs)", Duration::from_millis(7)),
                ("bundle and agent socket", Duration::from_micros(900)),
            ],
        })
    }

    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("pause {sandbox}"))
    }

    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("resume {sandbox}"))
    }

    fn freeze(&self, sandbox: &SandboxId, frozen: bool) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("freeze {sandbox} {frozen}"))
    }

    fn set_timer_slack(&self, sandbox: &SandboxId, slack: Option<SlackNs>) -> Result<usize, EngineError> {
        self.outcome(sandbox, format!("set_timer_slack {sandbox} {:?}", slack.map(SlackNs::get))).map(|()| 7)
    }

    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("suspend {sandbox}"))
    }

    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError> {
        let ImageRef::Checkpoint { name } = image else { panic!("{image:?}") };
        self.outcome(sandbox, format!("save_image {sandbox} {name}")).map(|()| Duration::from_millis(25))
    }

    fn drop_snapshot(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("drop_snapshot {sandbox}"))
    }

    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("stop {sandbox}"))
    }

    fn stop_strays(&self, sandbox: &SandboxId) {
        self.note(format!("stop_strays {sandbox}"));
    }

    fn settle_orphans(&self, sandboxes: &[SandboxId], patience: PatienceMs) {
        self.note(format!("settle_orphans {} {}", sandboxes.len(), patience.get()));
    }

    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.outcome(sandbox, format!("destroy {sandbox}"))
    }

    fn state(&self, sandbox: &SandboxId) -> EngineState {
        self.note(format!("state {sandbox}"));
        EngineState::Paused
    }

    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState> {
        self.note(format!("states {}", sandboxes.len()));
        sandboxes.iter().map(|s| if s.as_str() == SBX { EngineState::Running } else { EngineState::Stopped }).collect()
    }

    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        self.outcome(sandbox, format!("listen_agent {sandbox}"))?;
        Ok(self.listener(&format!("redial-{sandbox}")))
    }

    fn close_agent(&self, sandbox: &SandboxId) {
        self.note(format!("close_agent {sandbox}"));
    }

    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError> {
        self.note(format!("drop_image {sandbox} {image:?}"));
        Ok(())
    }

    fn availability(&self) -> (bool, String) {
        self.note("availability".to_string());
        (true, "runsc version recorded".into())
    }

    fn engine_log(&self, sandbox: &SandboxId) -> String {
        self.note(format!("engine_log {sandbox}"));
        "runsc: the sandbox said goodbye".into()
    }
}

/// A serve loop on a socket in a scratch dir, for `allowed_uid`.
struct Helper {
    runtime: Option<tokio::runtime::Runtime>,
    host: Arc<Recording>,
    dir: PathBuf,
}

impl Helper {
    fn start(name: &str, allowed_uid: u32) -> Helper {
        let dir = std::env::temp_dir().join(format!("space-helper-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let host = Arc::new(Recording { calls: Mutex::new(Vec::new()), scratch: dir.clone() });
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let socket = dir.join("helper.sock");
        let listener = runtime.block_on(async { HelperListener::bind(&socket, allowed_uid) }).unwrap();
        runtime.spawn(serve(listener, host.clone()));
        Helper { runtime: Some(runtime), host, dir }
    }

    /// Stops serving, as a helper that exits: its connections close.
    fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(DEADLINE);
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("helper.sock")
    }

    fn client(&self) -> HelperHost {
        HelperHost::with_patience(self.socket(), me(), DEADLINE)
    }

    fn connect(&self) -> BlockingClient {
        BlockingClient::connect(&self.socket(), me(), DEADLINE).unwrap()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn accepts(listener: &UnixListener, path: &Path) {
    let _dialer = UnixStream::connect(path).unwrap();
    listener.set_nonblocking(false).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let listener = listener.try_clone().unwrap();
    std::thread::spawn(move || tx.send(listener.accept().map(drop)).unwrap());
    rx.recv_timeout(DEADLINE).expect("the listener accepts in time").expect("accepted");
}

#[test]
fn every_request_reaches_the_host_method_of_its_name_and_its_answer_comes_back() {
    let helper = Helper::start("dispatch", me());
    let host = helper.client();
    let sandbox = id(SBX);
    let checkpoint = ImageRef::Checkpoint { name: CheckpointName::parse("before").unwrap() };
    let template = space_privsep::proto::TemplateRef {
        name: space_privsep::proto::TemplateName::parse("base").unwrap(),
        version: space_privsep::proto::TemplateVersion::new(3).unwrap(),
    };

    let launched = host.start(&sandbox, &StartFrom::Template { template }, shape(), &[]).unwrap();
    assert_eq!(launched.pid, 4321);
    assert_eq!(
        launched.steps,
        vec![
            ("root snapshot (btrfs)", Duration::from_millis(7)),
            ("bundle and agent socket", Duration::from_micros(900))
        ]
    );
    // The descriptor that came back is the host's listener itself.
    accepts(&launched.listener, &helper.dir.join(format!("start-{SBX}.sock")));
    (launched.finished)().expect("runsc's end, the start's second answer");

    host.pause(&sandbox).unwrap();
    host.freeze(&sandbox, true).unwrap();
    host.freeze(&sandbox, false).unwrap();
    host.resume(&sandbox).unwrap();
    assert_eq!(host.set_timer_slack(&sandbox, Some(SlackNs::new(50_000_000).unwrap())).unwrap(), 7);
    assert_eq!(host.set_timer_slack(&sandbox, None).unwrap(), 7);
    assert_eq!(host.save_image(&sandbox, &checkpoint).unwrap(), Duration::from_millis(25));
    host.suspend(&sandbox).unwrap();
    let restored = host.start(&sandbox, &StartFrom::Suspended {}, shape(), &[]).unwrap();
    (restored.finished)().unwrap();
    host.drop_snapshot(&sandbox).unwrap();
    let redial = host.listen_agent(&sandbox).unwrap();
    accepts(&redial, &helper.dir.join(format!("redial-{SBX}.sock")));
    host.close_agent(&sandbox);
    assert_eq!(host.state(&sandbox), EngineState::Paused);
    assert_eq!(host.states(&[sandbox.clone(), id(FAILING)]), vec![EngineState::Running, EngineState::Stopped]);
    assert_eq!(host.engine_log(&sandbox), "runsc: the sandbox said goodbye");
    host.stop(&sandbox).unwrap();
    host.stop_strays(&sandbox);
    host.settle_orphans(&[sandbox.clone(), id(FAILING)], PatienceMs::new(1500).unwrap());
    host.destroy(&sandbox).unwrap();

    assert_eq!(
        helper.host.take(),
        [
            format!("start {SBX} template base/3 512"),
            format!("pause {SBX}"),
            format!("freeze {SBX} true"),
            format!("freeze {SBX} false"),
            format!("resume {SBX}"),
            format!("set_timer_slack {SBX} Some(50000000)"),
            format!("set_timer_slack {SBX} None"),
            format!("save_image {SBX} before"),
            format!("suspend {SBX}"),
            format!("start {SBX} suspended 512"),
            format!("drop_snapshot {SBX}"),
            format!("listen_agent {SBX}"),
            format!("close_agent {SBX}"),
            format!("state {SBX}"),
            "states 2".to_string(),
            format!("engine_log {SBX}"),
            format!("stop {SBX}"),
            format!("stop_strays {SBX}"),
            "settle_orphans 2 1500".to_string(),
            format!("destroy {SBX}"),
        ]
    );
}

#[test]
fn a_failing_request_is_refused_and_its_connection_goes_on() {
    let helper = Helper::start("failing", me());
    let client = helper.connect();
    let (reply, _) = client.call(&Request::Pause { sandbox: id(FAILING) }, &[], DEADLINE).unwrap();
    assert_eq!(reply, Reply::Refused { refusal: Refusal::Failed, message: format!("{FAILING} is broken") });
    let (reply, _) = client.call(&Request::State { sandbox: id(SBX) }, &[], DEADLINE).unwrap();
    assert_eq!(reply, Reply::State { state: EngineState::Paused }, "the same connection still serves");
    let (reply, _) = client.call(&Request::List {}, &[], DEADLINE).unwrap();
    assert!(matches!(reply, Reply::Refused { refusal: Refusal::BadRequest, .. }), "{reply:?}");
    let (reply, _) = client.call(&Request::Resume { sandbox: id(SBX) }, &[], DEADLINE).unwrap();
    assert_eq!(reply, Reply::Done {});

    // Through the client: the host's error is the caller's.
    let host = helper.client();
    let err = host.destroy(&id(FAILING)).unwrap_err();
    assert_eq!(err.to_string(), format!("the engine failed: {FAILING} is broken"));
    host.destroy(&id(SBX)).unwrap();
    // A start whose engine command fails says so once it returns.
    let launched = host.start(&id(FAILING), &StartFrom::Suspended {}, shape(), &[]).unwrap();
    let err = (launched.finished)().unwrap_err();
    assert!(err.to_string().contains("runsc run failed: no such template"), "{err}");
    host.pause(&id(SBX)).unwrap();
}

#[test]
fn a_malformed_frame_closes_its_own_connection_only() {
    let helper = Helper::start("malformed", me());
    let other = helper.connect();
    let stream = UnixStream::connect(helper.socket()).unwrap();
    let client = BlockingClient::over(stream.try_clone().unwrap());
    let hello = Request::Hello { version: PROTOCOL_VERSION, engine: Engine::Gvisor };
    let (reply, _) = client.call(&hello, &[], DEADLINE).unwrap();
    assert!(matches!(reply, Reply::Hello { .. }));
    let body = br#"{"op":"pause","sandbox":"sbx_../../etc"}"#;
    (&stream).write_all(&(body.len() as u32).to_be_bytes()).unwrap();
    (&stream).write_all(body).unwrap();
    let (reply, _) = client.recv(DEADLINE).unwrap();
    assert!(
        matches!(&reply, Reply::Refused { refusal: Refusal::BadRequest, message } if message.contains("not a sandbox id")),
        "{reply:?}"
    );
    let err = client.recv(DEADLINE).unwrap_err();
    assert!(matches!(err, PeerError::Closed), "the helper hung up: {err}");
    let (reply, _) = other.call(&Request::Pause { sandbox: id(SBX) }, &[], DEADLINE).unwrap();
    assert_eq!(reply, Reply::Done {}, "another connection is served as before");
    assert_eq!(helper.host.take(), [format!("pause {SBX}")], "the malformed request reached no method");
}

/// A connection's requests go to the engine its hello named: this helper
/// runs gVisor only, so a Firecracker connection is refused every engine
/// request (its templates' requests are not the engine's), and a start
/// naming another engine than its connection's is refused too.
#[test]
fn a_connection_is_served_by_the_engine_its_hello_names_and_no_other() {
    let helper = Helper::start("engines", me());
    let firecracker = BlockingClient::connect_for(&helper.socket(), me(), Engine::Firecracker, DEADLINE).unwrap();
    for request in [
        Request::Pause { sandbox: id(SBX) },
        Request::Start {
            sandbox: id(SBX),
            engine: Engine::Firecracker,
            from: StartFrom::Suspended {},
            shape: shape(),
            mounts: vec![],
        },
        Request::Availability {},
        Request::Destroy { sandbox: id(SBX) },
    ] {
        let (reply, _) = firecracker.call(&request, &[], DEADLINE).unwrap();
        assert!(
            matches!(&reply, Reply::Refused { refusal: Refusal::BadRequest, message } if message.contains("runs no firecracker")),
            "{request:?}: {reply:?}"
        );
    }
    let gvisor = helper.connect();
    let start = Request::Start {
        sandbox: id(SBX),
        engine: Engine::Firecracker,
        from: StartFrom::Suspended {},
        shape: shape(),
        mounts: vec![],
    };
    let (reply, _) = gvisor.call(&start, &[], DEADLINE).unwrap();
    assert!(matches!(&reply, Reply::Refused { refusal: Refusal::BadRequest, .. }), "{reply:?}");
    assert_eq!(helper.host.take(), Vec::<String>::new(), "no refused request reached the gVisor host");
    let (reply, _) = gvisor.call(&Request::Pause { sandbox: id(SBX) }, &[], DEADLINE).unwrap();
    assert_eq!(reply, Reply::Done {});
    assert_eq!(helper.host.take(), [format!("pause {SBX}")]);
}

#[test]
fn a_client_after_the_helper_restarted_is_served_by_the_new_one() {
    let mut first = Helper::start("restart", me());
    let host = first.client();
    host.pause(&id(SBX)).unwrap();
    let dir = first.dir.clone();
    first.stop();
    let second = Helper::start("restart", me());
    assert_eq!(second.dir, dir);
    host.resume(&id(SBX)).expect("the client connects again");
    assert_eq!(second.host.take(), [format!("resume {SBX}")]);
}

/// In a child process only: connects to the helper as its uid and says
/// what happened.
#[test]
fn child_connects_to_the_helper() {
    let Ok(socket) = std::env::var(CHILD_ENV) else { return };
    match BlockingClient::connect(Path::new(&socket), 0, DEADLINE)
        .and_then(|c| c.call(&Request::Pause { sandbox: id(SBX) }, &[], DEADLINE))
    {
        Ok((reply, _)) => println!("CHILD uid {} got {reply:?}", me()),
        Err(err) => println!("CHILD uid {} failed: {err}", me()),
    }
}

#[test]
fn a_client_of_another_uid_is_refused_and_the_helper_serves_on() {
    // As any user: a helper for another uid refuses this one.
    let elsewhere = Helper::start("other-uid", me().wrapping_add(1));
    let err = BlockingClient::connect(&elsewhere.socket(), me(), DEADLINE).unwrap_err();
    assert!(matches!(err, PeerError::Closed | PeerError::Io { .. }), "{err}");
    assert!(elsewhere.host.take().is_empty());

    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping the other-uid child: it needs root");
        return;
    }
    // As root: a process of uid nobody is refused by a helper for root,
    // which goes on serving root.
    let helper = Helper::start("nobody", me());
    // The file's mode would refuse nobody first; opened up so that this is
    // the SO_PEERCRED check alone.
    std::fs::set_permissions(helper.socket(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&helper.dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    std::os::unix::process::CommandExt::uid(&mut child, NOBODY);
    std::os::unix::process::CommandExt::gid(&mut child, NOBODY);
    child
        .args(["--exact", "child_connects_to_the_helper", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, helper.socket())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let child = child.spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()).unwrap());
    let out = rx.recv_timeout(DEADLINE).expect("the child ends in time").unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&format!("CHILD uid {NOBODY} failed")), "{said}");
    assert!(helper.host.take().is_empty(), "nobody's request reached no method");
    helper.connect().call(&Request::Pause { sandbox: id(SBX) }, &[], DEADLINE).unwrap();
    assert_eq!(helper.host.take(), [format!("pause {SBX}")]);
}
