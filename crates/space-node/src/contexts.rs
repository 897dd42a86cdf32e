//! Code contexts: an interpreter kept alive in a sandbox, so state carries
//! from run to run and a run needs no process of its own. A context is a
//! driver the agent runs like any command (`contexts/python_driver.py`:
//! IPython's shell in its own process; `bash_driver.py`: one bash kept by a
//! small Python loop; `js_driver.js`: a V8 context in Node.js), speaking JSON lines
//! on its stdin and stdout; this module keeps it, sends it runs one at a
//! time and hands each run's events (output, rich results, the error, the
//! end) to whoever asked. The driver runs through pause, suspend and resume
//! like any command. Each context is recorded (`contexts` table: its
//! stream and the driver's pid), so a restarted server picks its driver up
//! again with the sandbox's commands, and a fork gets copies of them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use space_api::{CodeContext, CreateContextRequest, ErrorCode, RunCodeRequest};
use space_engine::{AgentConn, ExecEvent, ExecStream};
use space_proto::ExecRequest;
use tokio::sync::{mpsc, oneshot};

use crate::error::NodeError;
use crate::ids;
use crate::platform::Platform;
use crate::session::Session;
pub(crate) use crate::state::contexts::SavedContext;
use crate::state::contexts::{CurrentRun, LiveContext, NotReady};

/// The Python driver (IPython's shell in the driver's process, after what reads charts), run as `python3 -c`.
const PYTHON_DRIVER: &str =
    concat!(include_str!("contexts/python_charts.py"), include_str!("contexts/python_driver.py"));
/// The bash driver (a Python script keeping one bash), run as `python3 -c`.
const BASH_DRIVER: &str = include_str!("contexts/bash_driver.py");
/// The JavaScript driver, run as `node -e`.
const JS_DRIVER: &str = include_str!("contexts/js_driver.js");
/// How long an interpreter may take to answer first (imports on gVisor).
const READY_PATIENCE: Duration = Duration::from_secs(120);
/// What of the driver's stderr is kept to say why it did not start.
const STDERR_KEPT: usize = 4096;

/// The languages a context speaks (TypeScript: the JavaScript driver,
/// each cell transpiled first).
pub const LANGUAGES: &[&str] = &["python", "javascript", "typescript", "bash"];

fn is_javascript(language: &str) -> bool {
    language == "javascript" || language == "typescript"
}

/// Whether bash can take `name` as a variable's name.
fn is_shell_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub fn context_not_found(id: &str) -> NodeError {
    NodeError::not_found("context", id)
}

/// A run's events and what keeps the context its own while they last.
pub struct Run {
    pub events: mpsc::UnboundedReceiver<Value>,
    pub held: tokio::sync::OwnedMutexGuard<()>,
}

impl Platform {
    /// Starts a context in a running sandbox and returns once its
    /// interpreter answers.
    pub async fn create_context(
        self: &Arc<Self>,
        session: &Session,
        request: CreateContextRequest,
    ) -> Result<CodeContext, NodeError> {
        let sandbox_id = session.id();
        let language = request.language.unwrap_or_else(|| "python".into());
        if !LANGUAGES.contains(&language.as_str()) {
            return Err(NodeError::unprocessable(format!(
                "language must be python, javascript, typescript or bash, got {language:?}"
            )));
        }
        crate::domain::validate_env(&request.env)?;
        if request.cwd.as_deref().is_some_and(|cwd| !cwd.starts_with('/') || cwd.contains('\0')) {
            return Err(NodeError::bad_request(format!("cwd must be an absolute path, got {:?}", request.cwd)));
        }
        let agent = session.agent("start a code context")?.clone();
        let id = ids::new_id("ctx");
        let info = CodeContext {
            id: id.clone(),
            sandbox_id: sandbox_id.to_string(),
            language,
            cwd: request.cwd.clone(),
            state: "starting".into(),
            created_at: ids::now(),
        };
        let live = self.start_driver(info, &agent, &request.env).await?;
        self.keep_context(live.clone());
        Ok(live.info())
    }

    /// Runs the driver for `info` and waits until its interpreter answers.
    async fn start_driver(
        self: &Arc<Self>,
        info: CodeContext,
        agent: &AgentConn,
        env: &std::collections::BTreeMap<String, String>,
    ) -> Result<Arc<LiveContext>, NodeError> {
        let argv: Vec<String> = match info.language.as_str() {
            // Node's own REPL rewrite of top-level `await` is internal.
            "javascript" | "typescript" => {
                vec!["node".into(), "--expose-internals".into(), "-e".into(), JS_DRIVER.into(), info.language.clone()]
            }
            "bash" => vec!["python3".into(), "-c".into(), BASH_DRIVER.into()],
            _ => vec!["python3".into(), "-c".into(), PYTHON_DRIVER.into()],
        };
        let exec = ExecRequest { argv, env: env.clone(), cwd: info.cwd.clone(), user: None, stdin: true, tty: false };
        // A driver is a command like any other: it gets the placeholders of
        // the sandbox's network as it is now, not as it was at create.
        self.give_current_env(&info.sandbox_id, agent).await?;
        let stream = agent.exec(&exec).await.map_err(crate::error::exec_failure)?;
        let (ready, started) = oneshot::channel();
        let live = Arc::new(LiveContext {
            info: Mutex::new(info),
            agent: agent.clone(),
            stream: stream.stream,
            pid: stream.pid,
            env: env.clone(),
            exited: Default::default(),
            run: Mutex::default(),
            running: Arc::default(),
            ready: Mutex::new(Some(ready)),
            default: Default::default(),
        });
        tokio::spawn(pump(self.clone(), live.clone(), stream));
        match tokio::time::timeout(READY_PATIENCE, started).await {
            Ok(Ok(Ok(()))) => Ok(live),
            Ok(Ok(Err(why))) => Err(NodeError::unprocessable(format!("the interpreter did not start: {why}"))),
            _ => {
                let _ = live.signal(nix::sys::signal::Signal::SIGKILL).await;
                Err(NodeError::unavailable(format!("the interpreter did not answer within {READY_PATIENCE:?}")))
            }
        }
    }

    /// Starts a context in `cwd` when that directory exists, else in the
    /// template's (E2B's contexts start in its user's home, which a
    /// template may lack).
    pub async fn create_context_preferring(
        self: &Arc<Self>,
        session: &Session,
        mut request: CreateContextRequest,
        cwd: &str,
    ) -> Result<CodeContext, NodeError> {
        if request.cwd.is_some() {
            return self.create_context(session, request).await;
        }
        request.cwd = Some(cwd.to_string());
        match self.create_context(session, request.clone()).await {
            Err(err) if err.code == ErrorCode::InvalidCwd => {
                request.cwd = None;
                self.create_context(session, request).await
            }
            other => other,
        }
    }

    /// The context runs that name none go to, for `language` (E2B's code
    /// interpreter): the sandbox's default context of that language,
    /// started on first use (in `cwd` when that exists).
    pub async fn default_context(
        self: &Arc<Self>,
        session: &Session,
        language: &str,
        cwd: &str,
    ) -> Result<CodeContext, NodeError> {
        let sandbox_id = session.id();
        // One default is started at a time, so two first runs make one.
        static STARTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _one = STARTING.lock().await;
        let found = {
            let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
            contexts
                .values()
                .filter(|c| c.default.load(std::sync::atomic::Ordering::SeqCst))
                .map(|c| c.info())
                .filter(|c| c.sandbox_id == sandbox_id && c.language == language)
                .min_by(|a, b| a.created_at.cmp(&b.created_at))
        };
        if let Some(found) = found {
            return Ok(found);
        }
        let request = CreateContextRequest { language: Some(language.into()), cwd: None, env: Default::default() };
        let created = self.create_context_preferring(session, request, cwd).await?;
        let live = self.contexts.lock().unwrap_or_else(|e| e.into_inner()).get(&created.id).cloned();
        if let Some(live) = live {
            live.default.store(true, std::sync::atomic::Ordering::SeqCst);
            self.keep_context(live);
        }
        Ok(created)
    }

    /// Keeps a context, in memory and in its record.
    fn keep_context(&self, live: Arc<LiveContext>) {
        let saved = live.saved();
        if let Err(err) = serde_json::to_value(&saved)
            .map_err(crate::store::StoreError::from)
            .and_then(|body| self.store.node().put_context(&saved.info.id, &saved.info.sandbox_id, &body))
        {
            tracing::warn!(context = %saved.info.id, "could not record the code context: {err}");
        }
        self.contexts.lock().unwrap_or_else(|e| e.into_inner()).insert(saved.info.id, live);
    }

    fn forget_context(&self, id: &str) {
        self.contexts.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        let _ = self.store.node().delete_context(id);
    }

    /// The recorded contexts of a sandbox (their drivers may still run).
    pub(crate) fn saved_contexts(&self, sandbox_id: &str) -> Vec<SavedContext> {
        let bodies = self.store.node().contexts(sandbox_id).unwrap_or_default();
        bodies.into_iter().filter_map(|body| serde_json::from_value(body).ok()).collect()
    }

    /// Picks contexts up again on `agent`, each from its stream in
    /// `streams` (taken out): after a restart, as themselves; in a fork
    /// (`copies`), as new contexts of `sandbox_id`. One whose stream is not
    /// served any more is shown `dead` (a restart runs its driver anew).
    pub(crate) fn adopt_contexts(
        self: &Arc<Self>,
        sandbox_id: &str,
        agent: &AgentConn,
        saved: Vec<SavedContext>,
        streams: &mut std::collections::HashMap<u32, ExecStream>,
        copies: bool,
    ) {
        for saved in saved {
            let mut info = saved.info;
            if copies {
                info.id = ids::new_id("ctx");
                info.sandbox_id = sandbox_id.to_string();
                info.created_at = ids::now();
            }
            let stream = streams.remove(&saved.stream);
            info.state = if stream.is_some() { "ready" } else { "dead" }.into();
            let live = Arc::new(LiveContext {
                info: Mutex::new(info),
                agent: agent.clone(),
                stream: saved.stream,
                pid: saved.pid,
                env: saved.env,
                exited: std::sync::atomic::AtomicBool::new(stream.is_none()),
                run: Mutex::default(),
                running: Arc::default(),
                ready: Mutex::default(),
                default: std::sync::atomic::AtomicBool::new(saved.default),
            });
            if let Some(stream) = stream {
                tokio::spawn(pump(self.clone(), live.clone(), stream));
            }
            self.keep_context(live);
        }
    }

    fn context(&self, sandbox_id: &str, id: &str) -> Result<Arc<LiveContext>, NodeError> {
        self.sandbox(sandbox_id)?;
        let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        contexts.get(id).filter(|c| c.info().sandbox_id == sandbox_id).cloned().ok_or_else(|| context_not_found(id))
    }

    /// A sandbox's contexts, oldest first.
    pub fn contexts(&self, sandbox: &crate::access::OwnedSandbox) -> Result<Vec<CodeContext>, NodeError> {
        let sandbox_id = sandbox.id();
        self.sandbox(sandbox_id)?;
        let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let mut found: Vec<CodeContext> =
            contexts.values().map(|c| c.info()).filter(|c| c.sandbox_id == sandbox_id).collect();
        found.sort_by_key(|x| x.created_at);
        Ok(found)
    }

    /// A sandbox's contexts, its default ones (E2B's) first, then oldest
    /// first.
    pub fn contexts_defaults_first(
        &self,
        sandbox: &crate::access::OwnedSandbox,
    ) -> Result<Vec<CodeContext>, NodeError> {
        let sandbox_id = sandbox.id();
        self.sandbox(sandbox_id)?;
        let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let mut found: Vec<(bool, CodeContext)> = contexts
            .values()
            .map(|c| (!c.default.load(std::sync::atomic::Ordering::SeqCst), c.info()))
            .filter(|(_, c)| c.sandbox_id == sandbox_id)
            .collect();
        found.sort_by_key(|(later, c)| (*later, c.created_at));
        Ok(found.into_iter().map(|(_, c)| c).collect())
    }

    /// Whether a run goes on in one of the sandbox's contexts (it is not
    /// idle then).
    pub(crate) fn has_busy_context(&self, sandbox_id: &str) -> bool {
        let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        contexts.values().map(|c| c.info()).any(|c| c.sandbox_id == sandbox_id && c.state == "busy")
    }

    pub fn get_context(&self, sandbox: &crate::access::OwnedSandbox, id: &str) -> Result<CodeContext, NodeError> {
        Ok(self.context(sandbox.id(), id)?.info())
    }

    /// Starts a run: 409 `context_busy` while another runs, 409
    /// `context_dead` once the interpreter exited (restart it).
    pub async fn run_code(&self, session: &Session, id: &str, request: RunCodeRequest) -> Result<Run, NodeError> {
        let sandbox_id = session.id();
        let live = self.context(sandbox_id, id)?;
        crate::domain::validate_env(&request.env)?;
        if live.info().language == "bash" {
            if let Some(bad) = request.env.keys().find(|name| !is_shell_name(name)) {
                return Err(NodeError::unprocessable(format!(
                    "environment variable {bad:?}: a bash context takes names of letters, digits and '_', not starting with a digit"
                ))
                .with_details(json!({"field": "env"})));
            }
        }
        let held = live.running.clone().try_lock_owned().map_err(|_| {
            NodeError::new(ErrorCode::ContextBusy, "a run is going on in this context; wait for its end")
        })?;
        if live.info().state == "dead" {
            return Err(NodeError::new(
                ErrorCode::ContextDead,
                "the interpreter of this context exited; restart the context",
            ));
        }
        let (events, receiver) = mpsc::unbounded_channel();
        let run_id = ids::new_id("run");
        let started = !is_javascript(&live.info().language);
        *live.run.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(CurrentRun { id: run_id.clone(), events, started, interrupted: false });
        live.set_state("busy");
        let request = json!({"op": "run", "id": run_id, "code": request.code,
            "timeout_s": request.timeout_s, "env": request.env});
        if let Err(err) = live.send(request).await {
            live.run.lock().unwrap_or_else(|e| e.into_inner()).take();
            return Err(err);
        }
        self.store.node().touch_sandbox(sandbox_id, ids::now())?;
        Ok(Run { events: receiver, held })
    }

    /// Interrupts the run going on, whenever it comes: before its code
    /// starts, while it starts or while it runs (Python: a
    /// `KeyboardInterrupt`; all: the run ends `interrupted`).
    pub async fn interrupt_context(&self, session: &Session, id: &str) -> Result<CodeContext, NodeError> {
        let sandbox_id = session.id();
        let live = self.context(sandbox_id, id)?;
        let asked = {
            let mut run = live.run.lock().unwrap_or_else(|e| e.into_inner());
            run.as_mut().map(|run| {
                run.interrupted = true;
                (run.id.clone(), run.started)
            })
        };
        match (is_javascript(&live.info().language), asked) {
            (_, None) => {}
            // A JavaScript run blocks its driver's thread: only a signal
            // reaches it, and only once it has started (see `pump`).
            (true, Some((_, true))) => live.signal(nix::sys::signal::Signal::SIGINT).await?,
            (true, Some((_, false))) => {}
            (false, Some((run, _))) => live.send(json!({"op": "interrupt", "run": run})).await?,
        }
        Ok(live.info())
    }

    /// Starts the interpreter afresh (its state is gone), also after it died.
    pub async fn restart_context(self: &Arc<Self>, session: &Session, id: &str) -> Result<CodeContext, NodeError> {
        let sandbox_id = session.id();
        let live = self.context(sandbox_id, id)?;
        if live.exited.load(std::sync::atomic::Ordering::SeqCst) {
            // The driver itself is gone (`process.exit`): run it anew.
            let mut info = live.info();
            info.state = "starting".into();
            let again = self.start_driver(info, &live.agent, &live.env).await?;
            again
                .default
                .store(live.default.load(std::sync::atomic::Ordering::SeqCst), std::sync::atomic::Ordering::SeqCst);
            self.keep_context(again.clone());
            return Ok(again.info());
        }
        let (ready, restarted) = oneshot::channel();
        *live.ready.lock().unwrap_or_else(|e| e.into_inner()) = Some(ready);
        live.set_state("starting");
        live.send(json!({"op": "restart"})).await?;
        match tokio::time::timeout(READY_PATIENCE, restarted).await {
            Ok(Ok(Ok(()))) => Ok(live.info()),
            Ok(Ok(Err(why))) => Err(NodeError::unprocessable(format!("the interpreter did not restart: {why}"))),
            _ => Err(NodeError::unavailable("the interpreter did not answer after its restart")),
        }
    }

    /// Stops a context's interpreter and forgets it.
    pub async fn delete_context(&self, session: &Session, id: &str) -> Result<(), NodeError> {
        let sandbox_id = session.id();
        let live = self.context(sandbox_id, id)?;
        self.forget_context(id);
        let _ = live.signal(nix::sys::signal::Signal::SIGKILL).await;
        Ok(())
    }
}

/// Reads the driver's events until it exits: readiness, each run's events
/// (to whoever asked for the run), the interpreter's death.
async fn pump(platform: Arc<Platform>, live: Arc<LiveContext>, mut stream: ExecStream) {
    let mut line = Vec::new();
    let mut stderr: VecDeque<u8> = VecDeque::new();
    let ready = |result: Result<(), NotReady>| {
        if let Some(ready) = live.ready.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = ready.send(result);
        }
    };
    while let Some(event) = stream.next().await {
        match event {
            ExecEvent::Stdout(bytes) => {
                for byte in bytes {
                    if byte != b'\n' {
                        line.push(byte);
                        continue;
                    }
                    let Ok(mut event) = serde_json::from_slice::<Value>(&std::mem::take(&mut line)) else { continue };
                    let kind = event["type"].as_str().unwrap_or_default().to_string();
                    match kind.as_str() {
                        "ready" => {
                            if let Some(cwd) = event["cwd"].as_str() {
                                let mut info = live.info.lock().unwrap_or_else(|e| e.into_inner());
                                info.cwd.get_or_insert_with(|| cwd.to_string());
                            }
                            live.set_state("ready");
                            ready(Ok(()));
                        }
                        "died" => {
                            live.set_state("dead");
                            let why = event["why"].as_str().unwrap_or("the interpreter exited");
                            ready(Err(NotReady::Died(why.to_string())));
                        }
                        kind if event.get("run").is_some() => {
                            let run_id = event["run"].as_str().unwrap_or_default().to_string();
                            if !live.is_current(&run_id) {
                                continue;
                            }
                            if let Some(fields) = event.as_object_mut() {
                                fields.remove("run");
                            }
                            match kind {
                                "end" => {
                                    if live.info().state == "busy" {
                                        live.set_state("ready");
                                    }
                                    live.end_run(event);
                                }
                                "started" => {
                                    let interrupt = {
                                        let mut run = live.run.lock().unwrap_or_else(|e| e.into_inner());
                                        run.as_mut().is_some_and(|run| {
                                            run.started = true;
                                            run.interrupted
                                        })
                                    };
                                    if interrupt {
                                        let _ = live.signal(nix::sys::signal::Signal::SIGINT).await;
                                    }
                                }
                                _ => {
                                    if let Some(run) = live.run.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                                        let _ = run.events.send(event);
                                    }
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            ExecEvent::Stderr(bytes) => {
                stderr.extend(bytes);
                while stderr.len() > STDERR_KEPT {
                    stderr.pop_front();
                }
            }
            ExecEvent::Exit(_) => break,
        }
    }
    // The driver is gone (it exited, or the sandbox stopped).
    live.exited.store(true, std::sync::atomic::Ordering::SeqCst);
    live.set_state("dead");
    let why = String::from_utf8_lossy(&stderr.make_contiguous()[..]).trim().to_string();
    let last = why.lines().last().unwrap_or("it exited").to_string();
    ready(Err(NotReady::DriverExited(last.clone())));
    live.end_run(json!({"type": "end", "status": "died", "execution_count": null, "error": last}));
    let id = live.info().id;
    // Forgotten only with its sandbox: a server shutting down loses its
    // streams too, and its successor picks the context up again.
    let gone = match platform.sandbox(&live.info().sandbox_id) {
        Ok(r) => matches!(
            r.sandbox.state,
            space_api::SandboxState::Deleting | space_api::SandboxState::Deleted | space_api::SandboxState::Failed
        ),
        Err(err) => err.code == ErrorCode::NotFound,
    };
    if gone {
        platform.forget_context(&id);
    }
}
