//! An engine that isolates nothing, for tests of the control logic that
//! run as any user: no root, no btrfs, no runsc (feature `testing`).
//!
//! Each "sandbox" is a task speaking the real agent protocol
//! (`space-proto`) over a Unix socket pair, as `space-agent` does: it says
//! hello, takes its welcome and channel key, answers pings, lets go of its
//! channel on a quiesce and dials back when the host listens again
//! ([`Engine::redial`]), keeps the streams of its commands across
//! connections, and takes a warm member's identity. A frozen sandbox's
//! agent neither reads, writes nor dials until it is thawed.
//!
//! The agents run on a runtime of the engine's own, so they outlive the
//! runtime of a server that is "killed" (its runtime shut down): a second
//! `Platform` given the same engine finds them as a restarted server finds
//! live sandboxes.
//!
//! Failures are scripted: an engine call fails, hangs (before or after its
//! work) or kills the sandbox ([`Fault`]), and an agent refuses its
//! handshake, answers slowly or holds back its redials ([`AgentScript`]).
//! Every engine call is logged ([`FakeEngine::calls`]) and what each agent
//! saw can be read ([`FakeEngine::agent`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use space_proto::{
    decode_header, ExecFailed, ExecFailure, ExecRequest, Exited, FileError, FileFailure, FileInfo, FileRequest, Frame,
    FrameKind, Hello, Identity, SignalRequest, Started as ProcStarted, Welcome, CONTROL_STREAM, HEADER_LEN,
    PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, watch, Notify};

use crate::{AgentConn, AgentListener, Availability, Engine, EngineError, LiveStatus, SandboxSpec, Started};

/// How long the host waits for a fake agent's handshake at a create.
const HANDSHAKE_PATIENCE: Duration = Duration::from_secs(10);

/// The name of the socket an agent dials back on, in the sandbox's dir.
const SOCKET_NAME: &str = "agent.sock";

/// An engine call, as logged and as faults name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    Create,
    Pause,
    Resume,
    Suspend,
    Restore,
    SaveImage,
    StartFromImage,
    Redial,
    Stop,
    Destroy,
}

/// What a scripted engine call does instead of its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails at once; nothing changes.
    Fail,
    /// The sandbox dies (its agent and processes are gone, no snapshot is
    /// written) and the call fails: a crash in the middle of it.
    Die,
    /// Never returns, having done nothing: a server killed meanwhile
    /// leaves the call's work undone.
    Hang,
    /// Does its work, then never returns: a server killed meanwhile never
    /// learns that it was done.
    HangAfter,
    /// Waits for [`FakeEngine::release`], then does its work: requests
    /// pile up behind it meanwhile.
    Held,
}

/// How the agents of sandboxes started from now on behave.
#[derive(Debug, Clone, Default)]
pub struct AgentScript {
    /// Says hello in a protocol version the host does not speak.
    pub refuse_handshake: bool,
    /// Waits this long before each answer (hello, pong, quiesce ack,
    /// identity ack).
    pub delay: Duration,
    /// Does not dial back until [`FakeEngine::release_redials`].
    pub hold_redials: bool,
}

/// What one agent saw, for tests to check.
#[derive(Debug, Clone, Default)]
pub struct AgentView {
    /// The last welcome it took.
    pub welcome: Option<Welcome>,
    /// The environment its commands start with (the welcome's, then a
    /// warm member's identity's).
    pub env: BTreeMap<String, String>,
    /// Handshakes it completed, and how many of them were redials.
    pub handshakes: u32,
    pub redials: u32,
    /// Identities it took (a warm member handed out).
    pub identities: u32,
    /// Commands it started, and how many of them arrived while its engine
    /// was told the sandbox is idle (none should).
    pub execs: u32,
    pub execs_while_idle: u32,
    /// Command streams it serves: the process runs, or its exit is unsent.
    pub served: BTreeSet<u32>,
    pub last_stream: u32,
    /// Files written into it.
    pub files: BTreeMap<String, Vec<u8>>,
    key: Option<String>,
    session: Option<u64>,
    idle: bool,
}

/// One sandbox as the engine holds it.
struct FakeSandbox {
    dir: PathBuf,
    status: LiveStatus,
    snapshot: bool,
    idle: bool,
    agent: Option<AgentControl>,
}

/// The engine's hold on an agent task.
struct AgentControl {
    frozen: watch::Sender<bool>,
    sockets: mpsc::UnboundedSender<UnixStream>,
    dial: Arc<Notify>,
    held: watch::Sender<bool>,
    view: Arc<Mutex<AgentView>>,
    task: tokio::task::AbortHandle,
}

impl AgentControl {
    fn kill(&self) {
        self.task.abort();
    }
}

#[derive(Default)]
struct State {
    sandboxes: HashMap<String, FakeSandbox>,
    faults: Vec<(Call, Option<String>, Fault)>,
    script: AgentScript,
    calls: Vec<(Call, String)>,
    /// Where held calls wait, by call and sandbox.
    gates: HashMap<(Call, String), Arc<Notify>>,
    /// What `save_image` kept of each agent, by image directory.
    images: HashMap<PathBuf, AgentView>,
    /// Views of agents whose sandbox is gone, kept for tests to read.
    views: HashMap<String, Arc<Mutex<AgentView>>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    runtime: tokio::runtime::Handle,
    /// Dropped with the engine: ends the agents' runtime thread.
    _stop: std::sync::mpsc::Sender<()>,
}

/// The fake engine; clones share one set of sandboxes.
#[derive(Clone)]
pub struct FakeEngine {
    shared: Arc<Shared>,
}

impl Default for FakeEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeEngine {
    pub fn new() -> FakeEngine {
        let (handles, handle) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("fake-sandboxes".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .expect("a runtime for the fake agents");
                let _ = handles.send(runtime.handle().clone());
                // Until the engine is dropped.
                let _ = stopped.recv();
                runtime.shutdown_background();
            })
            .expect("a thread for the fake agents");
        let runtime = handle.recv().expect("the fake agents' runtime");
        FakeEngine {
            shared: Arc::new(Shared { state: Mutex::default(), changed: Condvar::new(), runtime, _stop: stop }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn changed(&self) {
        self.shared.changed.notify_all();
    }

    /// The next call of kind `call` (on sandbox `id`, or any) does `fault`.
    pub fn fault(&self, call: Call, id: Option<&str>, fault: Fault) {
        self.state().faults.push((call, id.map(str::to_string), fault));
    }

    /// Lets the held call of kind `call` on sandbox `id` go on (also one
    /// that is yet to come).
    pub fn release(&self, call: Call, id: &str) {
        self.gate(call, id).notify_one();
    }

    fn gate(&self, call: Call, id: &str) -> Arc<Notify> {
        self.state().gates.entry((call, id.to_string())).or_default().clone()
    }

    /// Agents started from now on behave as `script` says.
    pub fn script_agents(&self, script: AgentScript) {
        self.state().script = script;
    }

    /// Lets the agent of `id` dial back (see [`AgentScript::hold_redials`]).
    pub fn release_redials(&self, id: &str) {
        if let Some(agent) = self.state().sandboxes.get(id).and_then(|s| s.agent.as_ref()) {
            let _ = agent.held.send(false);
        }
    }

    /// Every engine call so far, in order, with the sandbox it was for.
    pub fn calls(&self) -> Vec<(Call, String)> {
        self.state().calls.clone()
    }

    /// How many calls of kind `call` were made for sandbox `id`.
    pub fn count(&self, call: Call, id: &str) -> usize {
        self.state().calls.iter().filter(|(c, i)| *c == call && i == id).count()
    }

    /// What the engine shows of sandbox `id`.
    pub fn status_of(&self, id: &str) -> LiveStatus {
        self.state().sandboxes.get(id).map(|s| s.status).unwrap_or(LiveStatus::Gone)
    }

    /// Whether the engine holds a whole snapshot of `id`.
    pub fn snapshot_of(&self, id: &str) -> bool {
        self.state().sandboxes.get(id).is_some_and(|s| s.snapshot)
    }

    /// Whether the engine was last told `id` is idle.
    pub fn idle(&self, id: &str) -> bool {
        self.state().sandboxes.get(id).is_some_and(|s| s.idle)
    }

    /// The sandboxes the engine holds (running, paused or as a snapshot).
    pub fn sandboxes(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.state().sandboxes.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// What the agent of `id` saw (also after its sandbox is gone).
    pub fn agent(&self, id: &str) -> Option<AgentView> {
        let view = self.state().views.get(id).cloned()?;
        let view = view.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Some(view)
    }

    /// The sandbox dies: its agent and processes are gone, as after a
    /// crash of its engine process.
    pub fn kill(&self, id: &str) {
        let mut state = self.state();
        if let Some(sandbox) = state.sandboxes.get_mut(id) {
            sandbox.status = LiveStatus::Gone;
            if let Some(agent) = sandbox.agent.take() {
                agent.kill();
            }
        }
        drop(state);
        self.changed();
    }

    /// Freezes (`true`) or thaws the sandbox behind the server's back, as
    /// an engine command a killed server had begun would have.
    pub fn set_frozen(&self, id: &str, frozen: bool) {
        let mut state = self.state();
        if let Some(sandbox) = state.sandboxes.get_mut(id).filter(|s| s.status != LiveStatus::Gone) {
            sandbox.status = if frozen { LiveStatus::Paused } else { LiveStatus::Running };
            if let Some(agent) = &sandbox.agent {
                let _ = agent.frozen.send(frozen);
            }
        }
        drop(state);
        self.changed();
    }

    /// Waits (up to `patience`) until `check` holds of the engine; whether
    /// it did.
    pub fn wait_until(&self, patience: Duration, check: impl Fn(&FakeEngine) -> bool) -> bool {
        let deadline = Instant::now() + patience;
        let mut state = self.state();
        loop {
            drop(state);
            if check(self) {
                return true;
            }
            state = self.state();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Agents change their views without the engine's lock: look
            // again at least every 50 ms.
            let wait = left.min(Duration::from_millis(50));
            state = self.shared.changed.wait_timeout(state, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Logs the call and takes the fault scripted for it, if any.
    fn begin(&self, call: Call, id: &str) -> Option<Fault> {
        let mut state = self.state();
        state.calls.push((call, id.to_string()));
        let at = state.faults.iter().position(|(c, i, _)| *c == call && i.as_deref().is_none_or(|i| i == id));
        let fault = at.map(|at| state.faults.remove(at).2);
        drop(state);
        self.changed();
        fault
    }

    /// Carries out `work` under the fault scripted for `call`, if any.
    async fn run<T>(
        &self,
        call: Call,
        spec: &SandboxSpec,
        work: impl FnOnce(&FakeEngine) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        match self.begin(call, &spec.id) {
            None => {
                let done = work(self);
                self.changed();
                done
            }
            Some(Fault::Fail) => Err(EngineError::Runtime(format!("scripted failure of {call:?}"))),
            Some(Fault::Die) => {
                self.kill(&spec.id);
                Err(EngineError::Runtime(format!("the sandbox died during {call:?}")))
            }
            Some(Fault::Hang) => std::future::pending().await,
            Some(Fault::Held) => {
                self.gate(call, &spec.id).notified().await;
                let done = work(self);
                self.changed();
                done
            }
            Some(Fault::HangAfter) => {
                let _ = work(self);
                self.changed();
                std::future::pending().await
            }
        }
    }

    /// Starts an agent task for sandbox `id` (in `dir`), knowing `view`.
    fn spawn_agent(&self, id: &str, dir: &Path, view: AgentView, frozen: bool) -> AgentControl {
        let script = self.state().script.clone();
        let (frozen_tx, frozen_rx) = watch::channel(frozen);
        let (held_tx, held_rx) = watch::channel(script.hold_redials);
        let (sockets, sockets_rx) = mpsc::unbounded_channel();
        let dial = Arc::new(Notify::new());
        let view = Arc::new(Mutex::new(view));
        let agent = FakeAgent {
            socket_path: dir.join(SOCKET_NAME),
            script,
            view: view.clone(),
            frozen: frozen_rx,
            held: held_rx,
            sockets: sockets_rx,
            dial: dial.clone(),
            engine: Arc::downgrade(&self.shared),
        };
        let task = self.shared.runtime.spawn(agent.run()).abort_handle();
        self.state().views.insert(id.to_string(), view.clone());
        AgentControl { frozen: frozen_tx, sockets, dial, held: held_tx, view, task }
    }

    /// Hands the agent of `id` one end of a new socket pair; the other end.
    fn connect_agent(&self, id: &str) -> Result<UnixStream, EngineError> {
        let (host, guest) = UnixStream::pair().map_err(EngineError::io("a socket pair"))?;
        let state = self.state();
        let agent = state.sandboxes.get(id).and_then(|s| s.agent.as_ref());
        let agent = agent.ok_or_else(|| EngineError::Runtime("the sandbox has no agent".into()))?;
        agent.sockets.send(guest).map_err(|_| EngineError::Runtime("the agent is gone".into()))?;
        Ok(host)
    }

    /// A sandbox with a live agent, as a create or a start from an image
    /// makes it.
    fn start_sandbox(&self, spec: &SandboxSpec, view: AgentView) -> Result<(), EngineError> {
        std::fs::create_dir_all(&spec.dir).map_err(EngineError::io("creating the sandbox dir"))?;
        let agent = self.spawn_agent(&spec.id, &spec.dir, view, false);
        let sandbox = FakeSandbox {
            dir: spec.dir.clone(),
            status: LiveStatus::Running,
            snapshot: false,
            idle: false,
            agent: None,
        };
        let mut state = self.state();
        if let Some(old) = state.sandboxes.insert(spec.id.clone(), FakeSandbox { agent: Some(agent), ..sandbox }) {
            old.agent.iter().for_each(AgentControl::kill);
        }
        Ok(())
    }

    fn with_sandbox<T>(
        &self,
        id: &str,
        change: impl FnOnce(&mut FakeSandbox) -> Result<T, String>,
    ) -> Result<T, EngineError> {
        let mut state = self.state();
        let sandbox = state.sandboxes.get_mut(id).ok_or_else(|| EngineError::Runtime(format!("no sandbox {id}")))?;
        change(sandbox).map_err(EngineError::Runtime)
    }

    fn forget(&self, id: &str) {
        let removed = self.state().sandboxes.remove(id);
        if let Some(sandbox) = removed {
            sandbox.agent.iter().for_each(AgentControl::kill);
            let _ = std::fs::remove_dir_all(&sandbox.dir);
        }
        self.changed();
    }
}

fn set_frozen(sandbox: &mut FakeSandbox, frozen: bool) {
    sandbox.status = if frozen { LiveStatus::Paused } else { LiveStatus::Running };
    if let Some(agent) = &sandbox.agent {
        let _ = agent.frozen.send(frozen);
    }
}

#[async_trait::async_trait]
impl Engine for FakeEngine {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn availability(&self) -> Availability {
        Availability { name: "fake", available: true, detail: "an in-memory engine for tests".into() }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Started, EngineError> {
        let began = Instant::now();
        let socket = self
            .run(Call::Create, spec, |engine| {
                engine.start_sandbox(spec, AgentView::default())?;
                engine.connect_agent(&spec.id)
            })
            .await?;
        match AgentConn::handshake(socket, crate::welcome_for(spec), HANDSHAKE_PATIENCE).await {
            Ok(agent) => Ok(Started { agent, boot: began.elapsed(), steps: Vec::new() }),
            Err(err) => {
                // As a real engine's create: nothing of it is left.
                self.forget(&spec.id);
                Err(err.into())
            }
        }
    }

    async fn pause(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.run(Call::Pause, spec, |engine| {
            engine.with_sandbox(&spec.id, |sandbox| match sandbox.status {
                LiveStatus::Running => {
                    set_frozen(sandbox, true);
                    Ok(())
                }
                other => Err(format!("cannot pause a sandbox that is {other:?}")),
            })
        })
        .await
    }

    async fn resume(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.run(Call::Resume, spec, |engine| {
            engine.with_sandbox(&spec.id, |sandbox| match sandbox.status {
                LiveStatus::Paused => {
                    set_frozen(sandbox, false);
                    Ok(())
                }
                other => Err(format!("cannot resume a sandbox that is {other:?}")),
            })
        })
        .await
    }

    async fn suspend(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.run(Call::Suspend, spec, |engine| {
            engine.with_sandbox(&spec.id, |sandbox| {
                if sandbox.status != LiveStatus::Running {
                    return Err(format!("cannot suspend a sandbox that is {:?}", sandbox.status));
                }
                // Its agent's memory is the snapshot: kept, frozen.
                set_frozen(sandbox, true);
                sandbox.status = LiveStatus::Gone;
                sandbox.snapshot = true;
                Ok(())
            })
        })
        .await
    }

    async fn restore(&self, spec: &SandboxSpec) -> Result<UnixStream, EngineError> {
        self.run(Call::Restore, spec, |engine| {
            engine.with_sandbox(&spec.id, |sandbox| {
                if !sandbox.snapshot || sandbox.agent.is_none() {
                    return Err("the sandbox has no complete snapshot".into());
                }
                sandbox.snapshot = false;
                set_frozen(sandbox, false);
                Ok(())
            })?;
            engine.connect_agent(&spec.id)
        })
        .await
    }

    fn has_snapshot(&self, spec: &SandboxSpec) -> bool {
        self.snapshot_of(&spec.id)
    }

    fn saves_images(&self, _spec: &SandboxSpec) -> bool {
        true
    }

    async fn save_image(&self, spec: &SandboxSpec, image: &Path) -> Result<Duration, EngineError> {
        self.run(Call::SaveImage, spec, |engine| {
            std::fs::create_dir_all(image).map_err(EngineError::io("creating the image dir"))?;
            let view = engine.with_sandbox(&spec.id, |sandbox| match &sandbox.agent {
                Some(agent) if sandbox.status == LiveStatus::Running => {
                    Ok(agent.view.lock().unwrap_or_else(|e| e.into_inner()).clone())
                }
                _ => Err("the sandbox does not run".to_string()),
            })?;
            engine.state().images.insert(image.to_path_buf(), view);
            Ok(Duration::from_millis(1))
        })
        .await
    }

    async fn start_from_image(&self, spec: &SandboxSpec, image: &Path) -> Result<UnixStream, EngineError> {
        self.run(Call::StartFromImage, spec, |engine| {
            let saved = engine.state().images.get(image).cloned();
            let saved = saved.ok_or_else(|| EngineError::Runtime(format!("no image at {}", image.display())))?;
            // The copy wakes as its source's agent, mid-redial.
            let view = AgentView { handshakes: 0, redials: 0, identities: 0, execs: 0, execs_while_idle: 0, ..saved };
            engine.start_sandbox(spec, view)?;
            engine.connect_agent(&spec.id)
        })
        .await
    }

    fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        self.status_of(&spec.id)
    }

    async fn redial(&self, spec: &SandboxSpec) -> Result<AgentListener, EngineError> {
        self.run(Call::Redial, spec, |engine| {
            let path = spec.dir.join(SOCKET_NAME);
            let _ = std::fs::remove_file(&path);
            let listener =
                tokio::net::UnixListener::bind(&path).map_err(EngineError::io("binding the agent socket"))?;
            if let Some(agent) = engine.state().sandboxes.get(&spec.id).and_then(|s| s.agent.as_ref()) {
                agent.dial.notify_one();
            }
            Ok(AgentListener::new(listener, path))
        })
        .await
    }

    fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.begin(Call::Stop, &spec.id);
        let mut state = self.state();
        if let Some(sandbox) = state.sandboxes.get_mut(&spec.id) {
            sandbox.status = LiveStatus::Gone;
            if !sandbox.snapshot {
                sandbox.agent.take().iter().for_each(AgentControl::kill);
            }
        }
        drop(state);
        self.changed();
        Ok(())
    }

    fn set_idle(&self, spec: &SandboxSpec, idle: bool) {
        let mut state = self.state();
        if let Some(sandbox) = state.sandboxes.get_mut(&spec.id) {
            sandbox.idle = idle;
            if let Some(agent) = &sandbox.agent {
                agent.view.lock().unwrap_or_else(|e| e.into_inner()).idle = idle;
            }
        }
        drop(state);
        self.changed();
    }

    async fn destroy(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.run(Call::Destroy, spec, |engine| {
            engine.forget(&spec.id);
            let _ = std::fs::remove_dir_all(&spec.dir);
            Ok(())
        })
        .await
    }
}

/// The agent inside a fake sandbox.
struct FakeAgent {
    socket_path: PathBuf,
    script: AgentScript,
    view: Arc<Mutex<AgentView>>,
    frozen: watch::Receiver<bool>,
    held: watch::Receiver<bool>,
    sockets: mpsc::UnboundedReceiver<UnixStream>,
    dial: Arc<Notify>,
    /// Told of every change; weak, so that the engine (whose runtime runs
    /// this agent) goes when the tests let go of it.
    engine: std::sync::Weak<Shared>,
}

/// How a connection ended.
enum Ended {
    /// Quiesced, or the host went away: dial again.
    Dropped,
    /// The host turned the handshake away.
    Refused,
}

/// A command the agent runs.
struct Command {
    /// What it writes, then how long it runs before it exits with `code`.
    output: Vec<u8>,
    runs: Duration,
    code: i32,
}

impl FakeAgent {
    fn view(&self) -> MutexGuard<'_, AgentView> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn changed(&self) {
        if let Some(shared) = self.engine.upgrade() {
            shared.changed.notify_all();
        }
    }

    async fn thawed(&mut self) {
        let _ = self.frozen.wait_for(|frozen| !frozen).await;
    }

    async fn run(mut self) {
        // Frames of commands, sent on whichever connection is up.
        let (outbox, mut queued) = mpsc::unbounded_channel::<Frame>();
        let mut killers: HashMap<u32, tokio::sync::oneshot::Sender<i32>> = HashMap::new();
        let mut unsent: Option<Frame> = None;
        loop {
            let socket = tokio::select! {
                Some(socket) = self.sockets.recv() => socket,
                () = async {
                    let _ = self.held.wait_for(|held| !held).await;
                    self.dial.notified().await;
                } => match UnixStream::connect(&self.socket_path).await {
                    Ok(socket) => socket,
                    Err(_) => continue,
                },
            };
            self.thawed().await;
            // However it ended (dropped, refused, broken), a real agent
            // dials again; here the next socket or dial notice does.
            let _ = self.serve(socket, &outbox, &mut queued, &mut killers, &mut unsent).await;
            self.changed();
        }
    }

    async fn answer(&self, writer: &mut tokio::net::unix::OwnedWriteHalf, frame: Frame) -> std::io::Result<()> {
        if !self.script.delay.is_zero() {
            tokio::time::sleep(self.script.delay).await;
        }
        write_frame(writer, &frame).await
    }

    async fn serve(
        &mut self,
        socket: UnixStream,
        outbox: &mpsc::UnboundedSender<Frame>,
        queued: &mut mpsc::UnboundedReceiver<Frame>,
        killers: &mut HashMap<u32, tokio::sync::oneshot::Sender<i32>>,
        unsent: &mut Option<Frame>,
    ) -> std::io::Result<Ended> {
        let (mut reader, mut writer) = socket.into_split();
        let hello = {
            let view = self.view();
            let redial = view.session.is_some();
            Hello {
                protocol_version: if self.script.refuse_handshake { PROTOCOL_VERSION + 1 } else { PROTOCOL_VERSION },
                agent_version: "fake".into(),
                pid: 1,
                reconnect: redial,
                channel_key: view.key.clone(),
                streams: redial.then(|| view.served.iter().copied().collect()),
                last_stream: redial.then_some(view.last_stream),
            }
        };
        self.answer(&mut writer, Frame::message(CONTROL_STREAM, FrameKind::Hello, &hello)).await?;
        let first = read_frame(&mut reader).await?;
        let Ok(welcome) = first.expect::<Welcome>(FrameKind::Welcome) else { return Ok(Ended::Refused) };
        {
            let mut view = self.view();
            if view.session.is_some_and(|s| s != welcome.session) {
                // A new host session knows nothing of the old streams.
                view.served.clear();
            }
            if view.session.is_some() {
                view.redials += 1;
            }
            view.session = Some(welcome.session);
            if let Some(key) = &welcome.channel_key {
                view.key = Some(key.clone());
            }
            if view.welcome.as_ref().is_none_or(|w| w.sandbox_id != welcome.sandbox_id) {
                view.env = welcome.env.clone();
            }
            view.welcome = Some(welcome);
            view.handshakes += 1;
        }
        self.changed();
        if let Some(frame) = unsent.take() {
            self.write_out(&mut writer, frame, unsent).await?;
        }
        let mut uploads: HashMap<u32, (String, Vec<u8>)> = HashMap::new();
        // Read into a buffer (a `read` is safe to cancel in a select; a
        // `read_exact` is not), in this task: a killed agent's socket
        // must close with it.
        let mut buffer = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            while let Some((frame, used)) = space_proto::decode(&buffer).map_err(std::io::Error::other)? {
                buffer.drain(..used);
                self.thawed().await;
                if self.take(frame, &mut writer, outbox, killers, &mut uploads).await? {
                    return Ok(Ended::Dropped);
                }
            }
            tokio::select! {
                read = reader.read(&mut chunk) => match read {
                    Ok(0) | Err(_) => return Ok(Ended::Dropped),
                    Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                },
                Some(frame) = queued.recv() => {
                    self.thawed().await;
                    self.write_out(&mut writer, frame, unsent).await?;
                }
            }
        }
    }

    /// Takes one frame from the host; true when the agent lets go of the
    /// connection (a quiesce).
    async fn take(
        &self,
        frame: Frame,
        writer: &mut tokio::net::unix::OwnedWriteHalf,
        outbox: &mpsc::UnboundedSender<Frame>,
        killers: &mut HashMap<u32, tokio::sync::oneshot::Sender<i32>>,
        uploads: &mut HashMap<u32, (String, Vec<u8>)>,
    ) -> std::io::Result<bool> {
        let stream = frame.stream;
        match frame.kind {
            FrameKind::Ping => self.answer(writer, Frame::new(stream, FrameKind::Pong, frame.payload)).await?,
            FrameKind::Quiesce => {
                self.answer(writer, Frame::new(CONTROL_STREAM, FrameKind::QuiesceAck, Vec::new())).await?;
                return Ok(true);
            }
            FrameKind::Identity => {
                let Ok(identity) = frame.parse::<Identity>() else { return Ok(false) };
                {
                    let mut view = self.view();
                    view.env = identity.env;
                    view.identities += 1;
                }
                self.answer(writer, Frame::new(stream, FrameKind::IdentityAck, Vec::new())).await?;
            }
            FrameKind::Exec => {
                if let Ok(request) = frame.parse::<ExecRequest>() {
                    self.exec(stream, request, outbox, killers);
                }
            }
            FrameKind::Signal => {
                if let (Ok(signal), Some(kill)) = (frame.parse::<SignalRequest>(), killers.remove(&stream)) {
                    let _ = kill.send(signal.signal);
                }
            }
            FrameKind::FileWrite => {
                if let Ok(request) = frame.parse::<FileRequest>() {
                    uploads.insert(stream, (request.path, Vec::new()));
                }
            }
            FrameKind::FileData => {
                if let Some((_, bytes)) = uploads.get_mut(&stream) {
                    bytes.extend_from_slice(&frame.payload);
                }
            }
            FrameKind::FileEnd => {
                if let Some((path, bytes)) = uploads.remove(&stream) {
                    self.view().files.insert(path, bytes);
                    write_frame(writer, &Frame::new(stream, FrameKind::FileDone, Vec::new())).await?;
                }
            }
            FrameKind::FileRead => {
                let Ok(request) = frame.parse::<FileRequest>() else { return Ok(false) };
                let found = self.view().files.get(&request.path).cloned();
                let frames = match found {
                    Some(bytes) => vec![
                        Frame::message(
                            stream,
                            FrameKind::FileInfo,
                            &FileInfo { size: bytes.len() as u64, mode: 0o644 },
                        ),
                        Frame::new(stream, FrameKind::FileData, bytes),
                        Frame::new(stream, FrameKind::FileEnd, Vec::new()),
                    ],
                    None => {
                        let message = format!("{} does not exist", request.path);
                        let error = FileError { reason: FileFailure::NotFound, message };
                        vec![Frame::message(stream, FrameKind::FileFailed, &error)]
                    }
                };
                for frame in frames {
                    write_frame(writer, &frame).await?;
                }
            }
            _ => {}
        }
        Ok(false)
    }

    /// Writes a command's frame; one that could not be written goes out
    /// on the next connection. An exit written ends the stream's service.
    async fn write_out(
        &self,
        writer: &mut tokio::net::unix::OwnedWriteHalf,
        frame: Frame,
        unsent: &mut Option<Frame>,
    ) -> std::io::Result<()> {
        let bytes = frame.encode().map_err(std::io::Error::other)?;
        if let Err(err) = writer.write_all(&bytes).await {
            *unsent = Some(frame);
            return Err(err);
        }
        if frame.kind == FrameKind::Exit {
            self.view().served.remove(&frame.stream);
            self.changed();
        }
        Ok(())
    }

    /// Starts a command: `echo ARGS`, `env NAME`, `hostname`, `true`,
    /// `false`, `sleep SECONDS` (ended early by a signal); anything else
    /// is not found.
    fn exec(
        &self,
        stream: u32,
        request: ExecRequest,
        outbox: &mpsc::UnboundedSender<Frame>,
        killers: &mut HashMap<u32, tokio::sync::oneshot::Sender<i32>>,
    ) {
        let mut view = self.view();
        view.execs += 1;
        if view.idle {
            view.execs_while_idle += 1;
        }
        view.last_stream = view.last_stream.max(stream);
        let args: Vec<&str> = request.argv.iter().map(String::as_str).collect();
        let line = |text: String| format!("{text}\n").into_bytes();
        let command = match args.as_slice() {
            ["echo", rest @ ..] => Some(Command { output: line(rest.join(" ")), runs: Duration::ZERO, code: 0 }),
            ["env", name] => {
                let value = request.env.get(*name).or_else(|| view.env.get(*name)).cloned().unwrap_or_default();
                Some(Command { output: line(value), runs: Duration::ZERO, code: 0 })
            }
            ["hostname"] => {
                let name = view.welcome.as_ref().map(|w| w.hostname.clone()).unwrap_or_default();
                Some(Command { output: line(name), runs: Duration::ZERO, code: 0 })
            }
            ["true"] => Some(Command { output: Vec::new(), runs: Duration::ZERO, code: 0 }),
            ["false"] => Some(Command { output: Vec::new(), runs: Duration::ZERO, code: 1 }),
            ["sleep", seconds] => seconds.parse::<f64>().ok().map(|s| Command {
                output: Vec::new(),
                runs: Duration::from_secs_f64(s),
                code: 0,
            }),
            _ => None,
        };
        let Some(command) = command else {
            let failed =
                ExecFailed { reason: ExecFailure::NotFound, message: format!("{:?}: not found", args.first()) };
            let _ = outbox.send(Frame::message(stream, FrameKind::ExecFailed, &failed));
            return;
        };
        view.served.insert(stream);
        drop(view);
        let (kill, killed) = tokio::sync::oneshot::channel();
        killers.insert(stream, kill);
        let _ = outbox.send(Frame::message(stream, FrameKind::Started, &ProcStarted { pid: 1000 + stream }));
        if !command.output.is_empty() {
            let _ = outbox.send(Frame::new(stream, FrameKind::Stdout, command.output));
        }
        let outbox = outbox.clone();
        tokio::spawn(async move {
            let exited = tokio::select! {
                () = tokio::time::sleep(command.runs) => Exited { exit_code: Some(command.code), signal: None, oom_killed: false },
                Ok(signal) = killed => Exited { exit_code: None, signal: Some(signal), oom_killed: false },
            };
            let _ = outbox.send(Frame::message(stream, FrameKind::Exit, &exited));
        });
    }
}

async fn write_frame(writer: &mut tokio::net::unix::OwnedWriteHalf, frame: &Frame) -> std::io::Result<()> {
    writer.write_all(&frame.encode().map_err(std::io::Error::other)?).await
}

async fn read_frame(reader: &mut tokio::net::unix::OwnedReadHalf) -> std::io::Result<Frame> {
    let mut header = [0u8; HEADER_LEN];
    reader.read_exact(&mut header).await?;
    let header = decode_header(&header).map_err(std::io::Error::other)?;
    let mut payload = vec![0u8; header.len];
    reader.read_exact(&mut payload).await?;
    Ok(Frame { stream: header.stream, kind: header.kind, payload })
}
