//! The sandbox actor: one task per sandbox that alone changes its state.
//! It takes jobs (create, pause, resume, suspend, delete) one at a time,
//! drives the engine and the agent, and persists every transition through
//! the exhaustive state machine before the operation reports it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_api::{ErrorCode, OperationKind, SandboxState};
use space_engine::{AgentConn, EngineError, SandboxSpec};
use tokio::sync::mpsc;

use crate::checkpoints::{self, RunningCommand};
use crate::domain::{self, Event};
use crate::error::NodeError;
use crate::failures::{AdoptError, SaveError, TemplateSaveError, WakeError};
use crate::job::{Job, Work};
use crate::platform::{LiveSandbox, Platform};
use crate::store::SandboxRecord;

/// How long an agent may take to let go of its channel or to come back.
const QUIESCE_PATIENCE: Duration = Duration::from_secs(20);

impl Platform {
    /// Starts sandbox `spec` and returns its healthy agent: booted from its
    /// template version's root, or, from a snapshot template, woken from
    /// its image as this sandbox with fresh entropy. On error nothing of it
    /// is left running.
    /// Starts a sandbox (booted, or woken from its snapshot template's
    /// image) until its agent is healthy; how long each step took.
    pub(crate) async fn boot(&self, spec: &SandboxSpec) -> Result<(AgentConn, space_engine::Steps), EngineError> {
        self.until_swept().await;
        let version = spec.template_rootfs.parent().unwrap_or(&spec.template_rootfs).to_path_buf();
        let image = space_host::template::TemplateInfo::load(&version).ok().and_then(|t| t.meta.image);
        let Some(image) = image else {
            let started = self.engine.create(spec).await?;
            tracing::info!(sandbox = %spec.id, boot_ms = started.boot.as_millis() as u64, "sandbox running");
            return Ok((started.agent, started.steps));
        };
        let woken = async {
            let mut steps = space_engine::Steps::new();
            let mut lap = std::time::Instant::now();
            let mut step = |name: &'static str| {
                steps.push((name, lap.elapsed()));
                lap = std::time::Instant::now();
            };
            let socket = self.engine.start_from_image(spec, &version).await?;
            step("restore from the template's image");
            let mut welcome = space_engine::welcome_for(spec);
            welcome.session = image.agent_session;
            welcome.channel_key = Some(image.channel_key.clone());
            let agent = AgentConn::handshake(socket, welcome, QUIESCE_PATIENCE).await?;
            step("agent handshake");
            let identity = space_engine::fresh_identity(&spec.env, spec.trust_pem.as_deref())?;
            agent.set_identity(&identity, QUIESCE_PATIENCE).await?;
            step("identity");
            Ok((agent, steps))
        }
        .await;
        if woken.is_err() {
            let _ = self.engine.destroy(spec).await;
        }
        woken
    }

    /// Starts the actor of sandbox `id` with its first job, or (re-adopted
    /// after a restart) with its agent.
    pub(crate) fn spawn_actor(self: &Arc<Self>, id: &str, first: Option<Job>, agent: Option<AgentConn>) {
        self.spawn_actor_with(id, first, agent, false);
    }

    /// Starts the actor of a frozen sandbox a restarted server found, whose
    /// agent it takes back before the first job that needs it.
    pub(crate) fn spawn_unadopted_actor(self: &Arc<Self>, id: &str) {
        self.spawn_actor_with(id, None, None, true);
    }

    fn spawn_actor_with(self: &Arc<Self>, id: &str, first: Option<Job>, agent: Option<AgentConn>, unadopted: bool) {
        let (jobs, queue) = mpsc::unbounded_channel();
        if let Some(first) = first {
            let _ = jobs.send(first);
        }
        if let Some(agent) = &agent {
            // Re-adopted after a restart: its egress is served again.
            self.start_egress(id, agent);
        }
        let unadopted = std::sync::atomic::AtomicBool::new(unadopted);
        let live = Arc::new(LiveSandbox { agent: Mutex::new(agent), jobs, work: Arc::default(), unadopted });
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), live.clone());
        let actor = Actor { platform: self.clone(), id: id.to_string(), live };
        // Dropped where it waits at a shutdown, as a kill drops it: the
        // next server carries out the job it had (it stays accepted).
        self.tasks.spawn_cancellable(actor.run(queue));
    }
}

/// An engine failure as the client sees it.
fn engine_failed(message: impl Into<String>) -> NodeError {
    NodeError::new(ErrorCode::EngineFailed, message)
}

/// What a client may learn of an engine failure: no host paths, no internals.
fn engine_failure(err: &EngineError) -> NodeError {
    let message = match err {
        EngineError::Host(_) | EngineError::Io { .. } => "preparing the sandbox's root filesystem failed",
        EngineError::Runtime(_) => "the isolation engine failed to start the sandbox",
        EngineError::Agent(_) => "the sandbox started but its agent did not become healthy",
    };
    engine_failed(message)
}

pub(crate) struct Actor {
    pub(crate) platform: Arc<Platform>,
    pub(crate) id: String,
    pub(crate) live: Arc<LiveSandbox>,
}

impl Actor {
    pub(crate) async fn run(self, mut queue: mpsc::UnboundedReceiver<Job>) {
        loop {
            let agent = self.live.agent.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let job = tokio::select! {
                job = queue.recv() => job,
                () = async {
                    match &agent {
                        Some(agent) => agent.closed().await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.agent_lost();
                    continue;
                }
            };
            let Some(job) = job else { break };
            let engine = self.platform.engine.clone();
            let id = job.operation_id.as_str();
            // What saves or copies it wants its timers as usual.
            let mut thawed = false;
            if !matches!(job.work, Work::Create { .. } | Work::Pause { .. } | Work::Delete) {
                self.platform.wake_up(&self.id);
                let Some(taken_thawed) = self.take_back_agent(id, matches!(job.work, Work::Resume)).await else {
                    continue;
                };
                thawed = taken_thawed;
            }
            let finished = match job.work {
                Work::Create { warm } => {
                    self.create(id, warm.map(|member| *member)).await;
                    false
                }
                Work::Delete => self.delete(id).await,
                Work::Pause { idle: true } => {
                    self.auto_pause(id).await;
                    false
                }
                Work::Pause { idle: false } => {
                    let freeze = |spec| async move { engine.pause(&spec).await };
                    self.change(id, OperationKind::Pause, Event::Froze, "freezing", freeze).await;
                    false
                }
                Work::Resume => {
                    let suspended =
                        self.platform.sandbox(&self.id).is_ok_and(|r| r.sandbox.state == SandboxState::Suspended);
                    if suspended {
                        self.restore(id).await;
                    } else if thawed {
                        // Taken back after a restart, thawed for it already.
                        let nothing = |_| async { Ok(()) };
                        self.change(id, OperationKind::Resume, Event::Thawed, "thawing", nothing).await;
                    } else {
                        let thaw = |spec| async move { engine.resume(&spec).await };
                        self.change(id, OperationKind::Resume, Event::Thawed, "thawing", thaw).await;
                    }
                    false
                }
                Work::Suspend => {
                    self.suspend(id).await;
                    false
                }
                Work::Fork => {
                    self.fork(id).await;
                    false
                }
                Work::Checkpoint => {
                    self.checkpoint(id).await;
                    false
                }
                Work::RestoreCheckpoint => {
                    self.rewind(id).await;
                    false
                }
                Work::SaveImage { dir, reply } => {
                    let _ = reply.send(self.save_for_template(id, &dir).await);
                    false
                }
                Work::Nothing => false,
            };
            if finished {
                break;
            }
        }
        self.platform.stop_egress(&self.id);
        self.platform.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }

    /// Takes back the agent of a sandbox left frozen by a restart, if it
    /// was (see `adoption.rs`), leaving it thawed if `resuming`. Whether it
    /// was thawed for good; None when it could not be taken back (the
    /// sandbox is then failed, and so is operation `operation_id`).
    async fn take_back_agent(&self, operation_id: &str, resuming: bool) -> Option<bool> {
        if !self.live.unadopted.load(std::sync::atomic::Ordering::SeqCst) {
            return Some(false);
        }
        let platform = &self.platform;
        platform.progress(operation_id, "reconnecting the agent", 0);
        let taken = platform.adopt_frozen(&self.id, resuming).await;
        match taken {
            Ok(agent) => {
                self.live.unadopted.store(false, std::sync::atomic::Ordering::SeqCst);
                self.set_agent(Some(agent));
                Some(resuming)
            }
            Err(why) => {
                // Failed only if its engine is gone; else the next job tries again.
                let record = platform.sandbox(&self.id).ok();
                let runs = match &record {
                    Some(record) => platform.still_runs(&platform.engine_spec(record)).await,
                    None => false,
                };
                if runs {
                    tracing::warn!(sandbox = %self.id, "its agent has not come back after a restart: {why}");
                    let failure = engine_failed(format!(
                        "the sandbox's agent has not come back after a restart ({why}); its engine still runs it: try again"
                    ));
                    platform.finish_operation(operation_id, Some(failure));
                    return None;
                }
                self.live.unadopted.store(false, std::sync::atomic::Ordering::SeqCst);
                platform.abandon(&self.id, &why).await;
                let failure = engine_failed(format!("the sandbox could not be taken back after a restart: {why}"));
                platform.finish_operation(operation_id, Some(failure));
                None
            }
        }
    }

    fn set_agent(&self, agent: Option<AgentConn>) {
        if let Some(agent) = &agent {
            self.platform.start_egress(&self.id, agent);
        }
        *self.live.agent.lock().unwrap_or_else(|e| e.into_inner()) = agent;
    }

    async fn create(&self, operation_id: &str, warm: Option<crate::warm::WarmMember>) {
        let platform = &self.platform;
        let record = match platform.sandbox(&self.id) {
            Ok(record) => record,
            Err(err) => return platform.finish_operation(operation_id, Some(err)),
        };
        let spec = platform.engine_spec(&record);
        if let Some(member) = warm {
            let step = if member.is_hot() { "handing out a hot sandbox" } else { "waking a warm sandbox" };
            platform.progress(operation_id, step, 1);
            let trust_pem = record.egress_ca.as_ref().map(|ca| ca.cert_pem.as_str());
            match member.hand_out(platform.engine.as_ref(), &record.env, trust_pem).await {
                Ok(()) => {
                    let welcome = member.agent.welcome().clone();
                    self.set_agent(Some(member.agent));
                    let applied = platform.apply_with(&self.id, Event::Started, None, |r| r.remember_agent(&welcome));
                    return platform.finish_operation(operation_id, applied.err());
                }
                Err(err) => {
                    // Fall back to a cold start under the same id.
                    tracing::warn!(sandbox = %self.id, "handing out a warm sandbox failed: {err}");
                    let _ = platform.engine.destroy(&member.spec).await;
                }
            }
        }
        platform.progress(operation_id, "starting the sandbox", 1);
        match platform.boot(&spec).await {
            Ok((agent, steps)) => {
                platform.progress_after(operation_id, &steps, "agent healthy", 2);
                let welcome = agent.welcome().clone();
                self.set_agent(Some(agent));
                match platform.apply_with(&self.id, Event::Started, None, |r| r.remember_agent(&welcome)) {
                    Ok(_) => platform.finish_operation(operation_id, None),
                    Err(err) => platform.finish_operation(operation_id, Some(err)),
                }
            }
            Err(err) => {
                tracing::warn!(sandbox = %self.id, "create failed: {err}");
                let failure = engine_failure(&err);
                let _ = platform.apply(&self.id, Event::Failure, Some(failure.message.clone()));
                platform.finish_operation(operation_id, Some(failure));
            }
        }
    }

    /// Carries out one engine call that moves the sandbox by `event`, for an
    /// operation of `kind`.
    async fn change<F, Fut>(&self, operation_id: &str, kind: OperationKind, event: Event, step: &str, call: F)
    where
        F: FnOnce(SandboxSpec) -> Fut,
        Fut: std::future::Future<Output = Result<(), EngineError>>,
    {
        let platform = &self.platform;
        let record = match platform.sandbox(&self.id) {
            Ok(record) => record,
            Err(err) => return platform.finish_operation(operation_id, Some(err)),
        };
        // The state may have moved since the request was accepted: to
        // where this request leads (two resumes of an idle sandbox queued
        // at once), which is success, or elsewhere, which is not.
        if let Err(err) = domain::transition(record.sandbox.state, event) {
            let already = domain::settles(kind, record.sandbox.state);
            return platform.finish_operation(operation_id, (!already).then_some(err));
        }
        platform.progress(operation_id, step, 0);
        match call(platform.engine_spec(&record)).await {
            Ok(()) => {
                let result = platform.apply(&self.id, event, None);
                platform.finish_operation(operation_id, result.err());
            }
            Err(err) => {
                tracing::error!(sandbox = %self.id, "{step} failed: {err}");
                let failure = engine_failed(format!("the engine could not {}", domain::action_name(event)));
                platform.finish_operation(operation_id, Some(failure));
            }
        }
    }

    /// Pauses the sandbox for idleness (see `idle.rs`): with its work gate
    /// held exclusively, so no request uses it meanwhile, and only if it is
    /// still idle then. Otherwise the operation is cancelled.
    async fn auto_pause(&self, operation_id: &str) {
        let platform = &self.platform;
        let Ok(_gate) = self.live.work.clone().try_write_owned() else {
            return platform.cancel_operation(operation_id, "the sandbox is in use");
        };
        let record = match platform.sandbox(&self.id) {
            Ok(record) => record,
            Err(err) => return platform.finish_operation(operation_id, Some(err)),
        };
        if !platform.idle_now(&record) {
            return platform.cancel_operation(operation_id, "the sandbox is no longer idle");
        }
        platform.progress(operation_id, "pausing the idle sandbox", 0);
        match platform.engine.pause(&platform.engine_spec(&record)).await {
            Ok(()) => {
                let result = platform.apply_with(&self.id, Event::Froze, None, |r| r.sandbox.auto_paused = true);
                platform.finish_operation(operation_id, result.err());
            }
            Err(err) => {
                tracing::error!(sandbox = %self.id, "pausing an idle sandbox failed: {err}");
                platform.finish_operation(operation_id, Some(engine_failed("the engine could not pause")));
            }
        }
    }

    /// After a failure that leaves the sandbox unusable: stop what runs of
    /// it, record it as failed with the reason, and fail the operation.
    async fn give_up(&self, spec: &SandboxSpec, operation_id: &str, failure: NodeError) {
        self.set_agent(None);
        self.platform.stop_engine(spec).await;
        let _ = self.platform.apply(&self.id, Event::Failure, Some(failure.message.clone()));
        self.platform.finish_operation(operation_id, Some(failure));
    }

    /// Suspend: thaw if paused, quiesce the agent, checkpoint, stop.
    async fn suspend(&self, operation_id: &str) {
        let platform = &self.platform;
        let record = match platform.sandbox(&self.id) {
            Ok(record) => record,
            Err(err) => return platform.finish_operation(operation_id, Some(err)),
        };
        let was_paused = record.sandbox.state == SandboxState::Paused;
        if let Err(err) = platform.apply(&self.id, Event::SuspendRequested, None) {
            return platform.finish_operation(operation_id, Some(err));
        }
        let spec = platform.engine_spec(&record);
        let agent = self.live.agent.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let result = async {
            if was_paused {
                // A frozen agent cannot let go of its channel.
                platform.progress(operation_id, "thawing", 0);
                platform.engine.resume(&spec).await.map_err(SaveError::Thaw)?;
            }
            platform.progress(operation_id, "quiescing the agent", 1);
            let agent = agent.ok_or(SaveError::NotConnected)?;
            agent.quiesce(QUIESCE_PATIENCE).await.map_err(SaveError::Quiesce)?;
            platform.progress(operation_id, "writing the snapshot", 2);
            platform.engine.suspend(&spec).await.map_err(SaveError::Snapshot)
        }
        .await;
        match result {
            Ok(()) => {
                let applied = platform.apply(&self.id, Event::Checkpointed, None);
                platform.finish_operation(operation_id, applied.err());
            }
            Err(err) => {
                tracing::error!(sandbox = %self.id, "suspend failed: {err}");
                let failure = engine_failed(format!("suspending failed while {}", err.step()));
                self.give_up(&spec, operation_id, failure).await;
            }
        }
    }

    /// The operation and the sandbox as they are now; `None` once the
    /// operation is finished with the error if either is not there.
    fn operation_and_record(&self, operation_id: &str) -> Option<(space_api::Operation, SandboxRecord)> {
        match (self.platform.operation(operation_id), self.platform.sandbox(&self.id)) {
            (Ok(operation), Ok(record)) => Some((operation, record)),
            (Err(err), _) | (_, Err(err)) => {
                self.platform.finish_operation(operation_id, Some(err));
                None
            }
        }
    }

    /// A fork: saves the sandbox's memory and disk at one instant (frozen
    /// only for that), then starts every fork from that image at once.
    /// Forks a restart left half made start over; made ones stay.
    async fn fork(&self, operation_id: &str) {
        let platform = &self.platform;
        let Some((operation, record)) = self.operation_and_record(operation_id) else { return };
        let mut forks = Vec::new();
        for id in &operation.forks {
            if let Some(fork) = platform.sandbox(id).ok().filter(|f| f.sandbox.state == SandboxState::Creating) {
                // Whatever an interrupted start left goes first.
                let _ = platform.engine.destroy(&platform.engine_spec(&fork)).await;
                forks.push(fork);
            }
        }
        if forks.is_empty() {
            return platform.finish_operation(operation_id, None);
        }
        let fail = |fork: &SandboxRecord, why: &str| {
            let _ = platform.apply(&fork.sandbox.id, Event::Failure, Some(why.to_string()));
        };
        let state = record.sandbox.state;
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            forks.iter().for_each(|fork| fail(fork, "its source was no longer running"));
            let refused = NodeError::invalid_state("sandbox", state.as_str(), "fork it");
            return platform.finish_operation(operation_id, Some(refused));
        }
        let spec = platform.engine_spec(&record);
        let image = spec.dir.join("images").join(operation_id);
        // Each fork takes over those its agent still serves when it wakes.
        let running = self.running_commands();
        let contexts = platform.saved_contexts(&self.id);
        match self.save_image(operation_id, &spec, state == SandboxState::Paused, &image).await {
            Ok(frozen) => platform.record_frozen(operation_id, frozen),
            Err(err) => {
                tracing::error!(sandbox = %self.id, "fork failed: {err}");
                remove_image(platform, &spec, image).await;
                let why = format!("forking failed while {}", err.step());
                forks.iter().for_each(|fork| fail(fork, &why));
                return platform.finish_operation(operation_id, Some(engine_failed(why)));
            }
        }
        platform.progress(operation_id, "starting the forks", 3);
        let started = futures_util::future::join_all(
            forks.iter().map(|fork| self.start_fork(fork, &record, &image, &running, &contexts)),
        )
        .await;
        remove_image(platform, &spec, image).await;
        let mut failed = 0;
        for (fork, started) in forks.iter().zip(started) {
            if let Err(err) = started {
                tracing::error!(sandbox = %fork.sandbox.id, "a fork did not start: {err}");
                platform.stop_engine(&platform.engine_spec(fork)).await;
                fail(fork, "the fork did not start from its source's image");
                failed += 1;
            }
        }
        let error = (failed > 0).then(|| engine_failed(format!("{failed} of {} forks did not start", forks.len())));
        platform.finish_operation(operation_id, error);
    }

    /// Saves the sandbox as an image at one instant: its agent lets go of
    /// its channel (no request uses the sandbox meanwhile), the engine
    /// saves memory and disk, and the agent dials back in. A paused
    /// sandbox is thawed for it and paused again. Returns how long the
    /// engine froze it.
    async fn save_image(
        &self,
        operation_id: &str,
        spec: &SandboxSpec,
        was_paused: bool,
        image: &std::path::Path,
    ) -> Result<Duration, SaveError> {
        let platform = &self.platform;
        let _gate = self.live.work.clone().write_owned().await;
        let agent = self.live.agent.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let agent = agent.ok_or(SaveError::NotConnected)?;
        if was_paused {
            platform.engine.resume(spec).await.map_err(SaveError::Thaw)?;
        }
        platform.progress(operation_id, "quiescing the agent", 0);
        let quiesced = agent.quiesce(QUIESCE_PATIENCE).await.map_err(SaveError::Quiesce);
        let saved = match quiesced {
            Ok(()) => {
                platform.progress(operation_id, "saving memory and disk", 1);
                let saved = platform.engine.save_image(spec, image).await;
                platform.progress(operation_id, "reconnecting the agent", 2);
                let back = platform
                    .take_agent(spec, None, |socket| {
                        let agent = agent.clone();
                        async move { agent.reattach(socket, QUIESCE_PATIENCE).await }
                    })
                    .await;
                match (saved, back) {
                    (Ok(frozen), Ok(())) => Ok(frozen),
                    (Err(err), _) => Err(SaveError::Save(err)),
                    (_, Err(err)) => Err(SaveError::Reconnect(err)),
                }
            }
            Err(err) => Err(err),
        };
        if was_paused {
            if let Err(err) = platform.engine.pause(spec).await {
                tracing::warn!(sandbox = %self.id, "pausing again after a fork: {err}");
            }
        }
        saved
    }

    /// Starts one fork from the image: its agent wakes as the source's,
    /// is welcomed as the fork (id, hostname), takes fresh entropy, and
    /// the commands it still serves go on with transcripts of their own.
    async fn start_fork(
        &self,
        fork: &SandboxRecord,
        source: &SandboxRecord,
        image: &std::path::Path,
        running: &[RunningCommand],
        contexts: &[crate::contexts::SavedContext],
    ) -> Result<(), WakeError> {
        let platform = &self.platform;
        let id = &fork.sandbox.id;
        let spec = platform.engine_spec(fork);
        let socket = platform.engine.start_from_image(&spec, image).await.map_err(WakeError::Start)?;
        let session = source.agent_session.ok_or(WakeError::NoSession("source's"))?;
        let adopt = streams_to_take(running, contexts);
        let (agent, streams) =
            self.wake_from_image(&spec, fork, socket, session, source.channel_key.clone(), &adopt).await?;
        let welcome = agent.welcome().clone();
        platform.apply_with(id, Event::Started, None, |r| r.remember_agent(&welcome)).map_err(WakeError::Record)?;
        // The source's code contexts go on in the fork as contexts of its own.
        let mut streams: std::collections::HashMap<u32, _> = streams.into_iter().map(|s| (s.stream, s)).collect();
        platform.adopt_contexts(id, &agent, contexts.to_vec(), &mut streams, true);
        platform.spawn_actor(id, None, Some(agent));
        self.follow_copies(id, streams.into_values().collect(), running).map_err(WakeError::Record)
    }

    /// Greets the agent of a sandbox started from an image as sandbox
    /// `spec` (whichever it was), taking over the streams of the `running`
    /// commands it still serves, and gives it fresh entropy.
    async fn wake_from_image(
        &self,
        spec: &SandboxSpec,
        record: &SandboxRecord,
        socket: tokio::net::UnixStream,
        session: u64,
        channel_key: Option<String>,
        adopt: &[(u32, u32)],
    ) -> Result<(AgentConn, Vec<space_engine::ExecStream>), WakeError> {
        let mut welcome = space_engine::welcome_for(spec);
        welcome.session = session;
        welcome.channel_key = channel_key;
        let (agent, streams) = self
            .platform
            .take_agent(spec, Some(socket), |socket| {
                AgentConn::handshake_adopting(socket, welcome.clone(), QUIESCE_PATIENCE, adopt)
            })
            .await?;
        let identity =
            space_engine::fresh_identity(&record.env, spec.trust_pem.as_deref()).map_err(WakeError::Identity)?;
        agent.set_identity(&identity, QUIESCE_PATIENCE).await.map_err(WakeError::SetIdentity)?;
        Ok((agent, streams))
    }

    /// Follows, as new commands of sandbox `id`, the `running` commands
    /// whose streams were taken over.
    fn follow_copies(
        &self,
        id: &str,
        streams: Vec<space_engine::ExecStream>,
        running: &[RunningCommand],
    ) -> Result<(), NodeError> {
        let mut streams: std::collections::HashMap<u32, _> = streams.into_iter().map(|s| (s.stream, s)).collect();
        for run in running {
            let Some(stream) = streams.remove(&run.stream) else { continue };
            self.platform.follow_copy(&run.command, id, stream, run.timeout_s)?;
        }
        self.platform.changed();
        Ok(())
    }

    /// The sandbox's commands running now, with their streams.
    fn running_commands(&self) -> Vec<RunningCommand> {
        let store = &self.platform.store;
        store
            .node()
            .commands(&self.id)
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.result.is_none())
            .filter_map(|command| {
                let (stream, timeout_s) = store.node().command_stream(&command.id).ok()??;
                Some(RunningCommand { command, stream, timeout_s })
            })
            .collect()
    }

    /// Saves the running (or paused) sandbox's image for a snapshot
    /// template being built (operation `operation_id`).
    async fn save_for_template(&self, operation_id: &str, dir: &std::path::Path) -> Result<(), TemplateSaveError> {
        let record = self.platform.sandbox(&self.id).map_err(TemplateSaveError::Record)?;
        let state = record.sandbox.state;
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Err(TemplateSaveError::NotRunning(state));
        }
        let spec = self.platform.engine_spec(&record);
        self.save_image(operation_id, &spec, state == SandboxState::Paused, dir)
            .await
            .map(drop)
            .map_err(TemplateSaveError::Save)
    }

    /// Saves checkpoint `operation.checkpoint` of the running sandbox: its
    /// image, then its record (the commands running, the agent's session).
    /// One a restart left half written starts over; a whole one stays.
    async fn checkpoint(&self, operation_id: &str) {
        let platform = &self.platform;
        let Some((operation, record)) = self.operation_and_record(operation_id) else { return };
        let name = operation.checkpoint.unwrap_or_default();
        let spec = platform.engine_spec(&record);
        let at = checkpoints::CheckpointAt::new(&platform.data, &self.id, &name);
        if at.is_whole() {
            return platform.finish_operation(operation_id, None);
        }
        let dir = at.image.clone();
        remove_image(platform, &spec, dir.clone()).await;
        let state = record.sandbox.state;
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            let refused = NodeError::invalid_state("sandbox", state.as_str(), "save a checkpoint");
            return platform.finish_operation(operation_id, Some(refused));
        }
        let running = self.running_commands();
        let saved = match self.save_image(operation_id, &spec, state == SandboxState::Paused, &dir).await {
            Ok(frozen) => {
                platform.record_frozen(operation_id, frozen);
                let meta = checkpoints::CheckpointMeta {
                    name,
                    created_at: crate::ids::now(),
                    agent_session: record.agent_session,
                    running,
                };
                at.write_meta(&meta).map_err(SaveError::Record)
            }
            Err(err) => Err(err),
        };
        if let Err(err) = saved {
            tracing::error!(sandbox = %self.id, "a checkpoint failed: {err}");
            remove_image(platform, &spec, dir).await;
            let failure = engine_failed(format!("the checkpoint failed while {}", err.step()));
            return platform.finish_operation(operation_id, Some(failure));
        }
        platform.finish_operation(operation_id, None);
    }

    /// Rolls the sandbox back to checkpoint `operation.checkpoint`: stops
    /// it, gives it a copy of the checkpoint's disk and starts it from the
    /// checkpoint's memory. It keeps its id; the commands running at the
    /// checkpoint run again as new commands, those running until now end.
    async fn rewind(&self, operation_id: &str) {
        let platform = &self.platform;
        let Some((operation, record)) = self.operation_and_record(operation_id) else { return };
        let name = operation.checkpoint.unwrap_or_default();
        let spec = platform.engine_spec(&record);
        let at = checkpoints::CheckpointAt::new(&platform.data, &self.id, &name);
        let image = at.image.clone();
        let Some(meta) = at.meta() else {
            let missing = NodeError::invalid_state("checkpoint", "missing", "restore it");
            return platform.finish_operation(operation_id, Some(missing));
        };
        if record.sandbox.state != SandboxState::Resuming {
            if let Err(err) = platform.apply(&self.id, Event::RewindRequested, None) {
                return platform.finish_operation(operation_id, Some(err));
            }
        }
        platform.progress(operation_id, "stopping the sandbox", 0);
        platform.stop_egress(&self.id);
        *self.live.agent.lock().unwrap_or_else(|e| e.into_inner()) = None;
        platform.stop_engine(&spec).await;
        platform.progress(operation_id, "starting from the checkpoint", 1);
        let woken = async {
            let socket = platform.engine.start_from_image(&spec, &image).await.map_err(WakeError::Start)?;
            platform.progress(operation_id, "reconnecting the agent", 2);
            let session = meta.agent_session.ok_or(WakeError::NoSession("checkpoint's"))?;
            self.wake_from_image(
                &spec,
                &record,
                socket,
                session,
                record.channel_key.clone(),
                &streams_to_take(&meta.running, &[]),
            )
            .await
        }
        .await;
        match woken {
            Ok((agent, streams)) => {
                let welcome = agent.welcome().clone();
                let applied = platform.apply_with(&self.id, Event::Restored, None, |r| r.remember_agent(&welcome));
                self.set_agent(Some(agent));
                let followed = applied.and_then(|_| self.follow_copies(&self.id, streams, &meta.running));
                platform.finish_operation(operation_id, followed.err());
            }
            Err(err) => {
                tracing::error!(sandbox = %self.id, "restoring checkpoint {name:?} failed: {err}");
                let failure = engine_failed(format!("restoring checkpoint {name:?} failed"));
                self.give_up(&spec, operation_id, failure).await;
            }
        }
    }

    /// Resume from a snapshot: restore, then re-attach the agent (or greet
    /// it afresh if this server never knew it).
    async fn restore(&self, operation_id: &str) {
        let platform = &self.platform;
        let record = match platform.sandbox(&self.id) {
            Ok(record) => record,
            Err(err) => return platform.finish_operation(operation_id, Some(err)),
        };
        if let Err(err) = platform.apply(&self.id, Event::RestoreRequested, None) {
            return platform.finish_operation(operation_id, Some(err));
        }
        platform.progress(operation_id, "restoring the snapshot", 0);
        let spec = platform.engine_spec(&record);
        let known = self.live.agent.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let result = async {
            let socket = platform.engine.restore(&spec).await.map_err(AdoptError::engine("restore the snapshot"))?;
            platform.progress(operation_id, "reconnecting the agent", 1);
            let mut welcome = space_engine::welcome_for(&spec);
            welcome.channel_key = record.channel_key.clone();
            platform
                .take_agent(&spec, Some(socket), |socket| {
                    let (known, welcome) = (known.clone(), welcome.clone());
                    async move {
                        match known {
                            Some(agent) => agent.reattach(socket, QUIESCE_PATIENCE).await.map(|()| agent),
                            None => AgentConn::handshake(socket, welcome, QUIESCE_PATIENCE).await,
                        }
                    }
                })
                .await
        }
        .await;
        match result {
            Ok(agent) => {
                let welcome = agent.welcome().clone();
                self.set_agent(Some(agent));
                let applied = platform.apply_with(&self.id, Event::Restored, None, |r| r.remember_agent(&welcome));
                platform.finish_operation(operation_id, applied.err());
            }
            Err(err) => {
                tracing::error!(sandbox = %self.id, "resume from snapshot failed: {err}");
                self.give_up(&spec, operation_id, engine_failed("resuming from the snapshot failed")).await;
            }
        }
    }

    /// Returns true once the sandbox is deleted and the actor may end.
    async fn delete(&self, operation_id: &str) -> bool {
        let platform = &self.platform;
        if let Err(err) = platform.apply(&self.id, Event::DeleteRequested, None) {
            platform.finish_operation(operation_id, Some(err));
            return false;
        }
        platform.progress(operation_id, "stopping the sandbox and freeing its disk", 1);
        let record = match platform.sandbox(&self.id) {
            Ok(record) => record,
            Err(err) => {
                platform.finish_operation(operation_id, Some(err));
                return false;
            }
        };
        self.set_agent(None);
        if self.live.unadopted.swap(false, std::sync::atomic::Ordering::SeqCst) {
            // Nothing follows the commands a frozen, never taken back sandbox ran.
            let _ = platform.end_lost_commands(&self.id, "the sandbox was deleted before the command ended");
        }
        match platform.engine.destroy(&platform.engine_spec(&record)).await {
            Ok(()) => {
                platform.forget_sandbox_state(&self.id).await;
                let result = platform.apply(&self.id, Event::Destroyed, None);
                platform.finish_operation(operation_id, result.err());
                true
            }
            Err(err) => {
                tracing::error!(sandbox = %self.id, "delete failed: {err}");
                let failure = engine_failed("freeing the sandbox failed; retry the delete");
                let _ = platform.apply(&self.id, Event::Failure, Some(failure.message.clone()));
                platform.finish_operation(operation_id, Some(failure));
                false
            }
        }
    }

    fn agent_lost(&self) {
        self.set_agent(None);
        let state = self.platform.sandbox(&self.id).map(|r| r.sandbox.state);
        if state.is_ok_and(domain::accepts_commands) {
            let reason = self
                .platform
                .sandbox(&self.id)
                .ok()
                .and_then(|record| self.platform.engine.stop_reason(&self.platform.engine_spec(&record)))
                .unwrap_or("the sandbox stopped unexpectedly (its agent disconnected)");
            tracing::warn!(sandbox = %self.id, "{reason}");
            let _ = self.platform.apply(&self.id, Event::Failure, Some(reason.into()));
        }
    }
}

/// Removes an image of the sandbox's, through its engine: a fork's (its
/// forks have their own copies) or a checkpoint's that failed midway.
async fn remove_image(platform: &Platform, spec: &space_engine::SandboxSpec, image: std::path::PathBuf) {
    if let Err(err) = platform.engine.drop_image(spec, &image).await {
        tracing::warn!(sandbox = %spec.id, "removing the image {}: {err}", image.display());
    }
}

/// The streams (and their processes) an agent waking from an image is
/// asked to hand over: running commands' and code contexts' drivers.
fn streams_to_take(running: &[RunningCommand], contexts: &[crate::contexts::SavedContext]) -> Vec<(u32, u32)> {
    running.iter().map(|r| (r.stream, r.command.pid)).chain(contexts.iter().map(|c| (c.stream, c.pid))).collect()
}
