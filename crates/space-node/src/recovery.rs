//! What a server does when it starts over a data dir another server used:
//! settle what was in flight, and re-adopt the sandboxes that still run.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use space_api::{ErrorCode, Operation, OperationKind, OperationState, SandboxState};
use space_engine::LiveStatus;

use crate::domain::{self, Event};
use crate::error::NodeError;
use crate::failures::AdoptError;
use crate::ids;
use crate::job::Job;
use crate::platform::Platform;
use crate::store::SandboxRecord;

impl Platform {
    /// Settles what a previous server process left in flight, so that every
    /// request it accepted is carried out rather than dropped. A sandbox
    /// caught between two states is put in the one its engine shows:
    /// suspending → `suspended` if the snapshot is whole and nothing runs,
    /// back to `running` if it still runs (the suspend is then carried out
    /// again); resuming → `running` if it runs, back to `suspended` if only
    /// its snapshot is there (the resume is carried out again). Only a
    /// sandbox whose engine shows neither is `failed`, with the reason.
    /// Creating and deleting sandboxes, and live ones, are taken up by
    /// [`Platform::recover`]. Commands whose end was not seen in a sandbox
    /// that no longer runs get a result saying so; template builds that
    /// were cut short fail.
    pub fn reconcile(&self) -> Result<(), NodeError> {
        let pending = self.store.node().operations(None)?;
        // A roll back to a checkpoint the restart cut short is carried out
        // again from wherever it stopped.
        let rewinding = |id: &str| {
            pending.iter().any(|op| {
                op.kind == OperationKind::RestoreCheckpoint
                    && !op.state.is_terminal()
                    && op.sandbox_id.as_deref() == Some(id)
            })
        };
        for record in self.store.node().live_sandboxes()? {
            let id = record.sandbox.id.clone();
            let state = record.sandbox.state;
            let spec = self.engine_spec(&record);
            let settled = match state {
                SandboxState::Deleted
                | SandboxState::Failed
                | SandboxState::Running
                | SandboxState::Paused
                | SandboxState::Creating
                | SandboxState::Deleting => state,
                SandboxState::Suspended if self.engine.has_snapshot(&spec) => state,
                SandboxState::Suspended => self.fail(&id, "its snapshot is missing")?,
                SandboxState::Suspending | SandboxState::Resuming => {
                    let live = self.engine.status(&spec) != LiveStatus::Gone;
                    let snapshot = self.engine.has_snapshot(&spec);
                    let event = match (state, live, snapshot) {
                        (SandboxState::Suspending, true, _) => Some(Event::RolledBack),
                        (SandboxState::Suspending, false, true) => Some(Event::Checkpointed),
                        (SandboxState::Resuming, true, _) => Some(Event::Restored),
                        (SandboxState::Resuming, false, true) => Some(Event::RolledBack),
                        (SandboxState::Resuming, false, false) if rewinding(&id) => Some(Event::RolledBack),
                        _ => None,
                    };
                    if event == Some(Event::Checkpointed) {
                        // The snapshot is whole; what runsc kept of the
                        // stopped container would stand in a restore's way.
                        let _ = self.engine.stop(&spec);
                    }
                    match event {
                        Some(event) => {
                            tracing::info!(sandbox = %id, ?event, "settled a transition the restart interrupted");
                            self.apply(&id, event, None)?.state
                        }
                        None => {
                            let _ = self.engine.stop(&spec);
                            self.fail(&id, &format!("it was {} and neither runs nor has a snapshot", state.as_str()))?
                        }
                    }
                }
            };
            if !matches!(settled, SandboxState::Running | SandboxState::Paused) {
                self.end_lost_commands(&id, "the server restarted")?;
            }
        }
        let now = ids::now();
        for mut operation in self.store.node().operations(None)? {
            if !operation.state.is_terminal() && operation.kind == OperationKind::BuildTemplate {
                operation.state = OperationState::Failed;
                operation.error = Some(
                    NodeError::new(
                        ErrorCode::Interrupted,
                        "the server restarted during the build; build the template again",
                    )
                    .detail(),
                );
                operation.finished_at = Some(now);
                self.store.node().put_operation(&operation, "", None)?;
            }
        }
        Ok(())
    }

    /// The sandboxes a previous process left between two states, or with
    /// an operation under way: where its engine commands may still run.
    pub(crate) fn unsettled(&self) -> Result<Vec<String>, NodeError> {
        let settled = [
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Suspended,
            SandboxState::Deleted,
            SandboxState::Failed,
        ];
        let records = self.store.node().live_sandboxes()?;
        let moving = records.iter().filter(|r| !settled.contains(&r.sandbox.state));
        let operations = self.store.node().operations(None)?;
        let working = operations.iter().filter(|op| !op.state.is_terminal());
        let mut ids: Vec<String> = moving.map(|r| r.sandbox.id.clone()).collect();
        ids.extend(working.flat_map(|op| op.sandbox_id.iter().chain(&op.forks).cloned()));
        Ok(ids)
    }

    /// Records `id` as failed because of a restart, with `why`.
    fn fail(&self, id: &str, why: &str) -> Result<SandboxState, NodeError> {
        let reason = format!("the server restarted and {why}; delete it to free its disk");
        Ok(self.apply(id, Event::Failure, Some(reason))?.state)
    }

    /// Stops what still works on the sandboxes a previous server left
    /// `creating`, and fails those without their create or fork among the
    /// operations it accepted (`pending`): the restart fell between the two
    /// writes, so no client was told it was accepted. Before any operation
    /// is carried out again.
    async fn settle_creating(&self, pending: &[Operation], creating: Vec<SandboxRecord>) -> Result<(), NodeError> {
        for record in creating {
            let Ok(record) = self.sandbox(&record.sandbox.id) else { continue };
            let creating = record.sandbox.state == SandboxState::Creating;
            let id = &record.sandbox.id;
            let made_by = |op: &&Operation| match op.kind {
                OperationKind::Create => op.sandbox_id.as_ref() == Some(id),
                OperationKind::Fork => op.forks.contains(id),
                _ => false,
            };
            if creating {
                // A create or fork the killed process had begun may still
                // be under way in a `runsc` of its own.
                self.stop_strays(&self.engine_spec(&record)).await;
            }
            if creating && !pending.iter().any(|op| made_by(&op)) {
                self.engine.destroy(&self.engine_spec(&record)).await.ok();
                self.fail(id, "its create was never accepted")?;
            }
        }
        Ok(())
    }

    /// Carries out the operations a previous server accepted but did not
    /// finish, in the order they were accepted: each goes to its sandbox's
    /// actor as if just accepted. One the sandbox's state already shows
    /// (its work was done, its end not recorded) succeeds at once; a create
    /// starts over from a clean slate.
    ///
    /// `pending` is what the store held when this process started: the
    /// server already serves meanwhile, and what it accepted itself is its
    /// own actors' work, not to be carried out twice.
    async fn resume_operations(self: &Arc<Self>, mut pending: Vec<Operation>) -> Result<(), NodeError> {
        pending.sort_by_key(|x| x.created_at);
        for operation in pending {
            let Some(id) = operation.sandbox_id.clone() else { continue };
            let record = match self.sandbox(&id) {
                Ok(record) => record,
                Err(err) => {
                    self.finish_operation(&operation.id, Some(err));
                    continue;
                }
            };
            if domain::settles(operation.kind, record.sandbox.state) {
                self.finish_operation(&operation.id, None);
                continue;
            }
            if operation.kind == OperationKind::Create {
                // Whatever the interrupted start left goes; it starts again.
                if let Err(err) = self.engine.destroy(&self.engine_spec(&record)).await {
                    tracing::warn!(sandbox = %id, "clearing an interrupted create: {err}");
                }
            }
            tracing::info!(sandbox = %id, operation = %operation.id, kind = ?operation.kind, "carrying out an operation accepted before the restart");
            self.queue_job(&id, Job::new(&operation));
        }
        self.changed();
        Ok(())
    }

    /// What sandboxes the database does not know (or knows as deleted)
    /// left in the data dir, listed before this process makes any sandbox
    /// (a warm member made later is unknown to the database too).
    fn leftovers(&self) -> Vec<(String, std::path::PathBuf)> {
        let state = self.data.state_dir().join("sandboxes");
        let mut names: Vec<String> = [self.data.sandboxes_dir(), state]
            .iter()
            .filter_map(|dir| std::fs::read_dir(dir).ok())
            .flat_map(|entries| entries.flatten().filter_map(|entry| entry.file_name().into_string().ok()))
            .filter(|name| {
                !self
                    .store
                    .node()
                    .sandbox(name)
                    .ok()
                    .flatten()
                    .is_some_and(|r| r.sandbox.state != SandboxState::Deleted)
            })
            .collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|name| (name.clone(), self.data.sandbox_dir(&name))).collect()
    }

    /// Removes `leftovers`: their engine processes, subvolumes and files,
    /// and what the server kept of them, all at once.
    async fn sweep(&self, leftovers: Vec<(String, std::path::PathBuf)>) {
        let sweeps = leftovers.into_iter().map(|(name, dir)| {
            let (engine, state) = (self.engine.clone(), self.data.sandbox_state_dir(&name));
            sweep_one(engine, name, dir, state)
        });
        futures_util::future::join_all(sweeps).await;
    }

    /// Takes up the platform's duties in this process, at once: the live
    /// sandboxes are marked as being reconciled (requests for one wait
    /// until it is, [`Platform::until_reconciled`]) and re-adopted in the
    /// background, in parallel (see [`Platform::recover`]), while the
    /// leftovers of unknown sandboxes are swept (all at once; no new
    /// sandbox starts before they are gone, [`Platform::until_swept`]);
    /// then the operations a previous process accepted are carried out,
    /// lifecycle policies enforced and the pools filled. Call once, inside
    /// the runtime, before serving. All of it runs among the platform's
    /// tasks: [`Platform::shutdown`] stops it wherever it is.
    pub async fn start(self: &Arc<Self>) -> Result<(), NodeError> {
        self.store_egress_events();
        // Before any request: a volume made now must not look like a leftover.
        self.sweep_volumes().await;
        let leftovers = self.leftovers();
        if !leftovers.is_empty() {
            self.sweeping.store(true, std::sync::atomic::Ordering::SeqCst);
            let platform = self.clone();
            // Not cut short by a shutdown: what it removes is bounded, and
            // new sandboxes wait for it (`until_swept`).
            self.tasks.spawn(async move {
                let started = Instant::now();
                let count = leftovers.len();
                platform.sweep(leftovers).await;
                tracing::info!(count, ms = started.elapsed().as_millis() as u64, "swept leftovers");
                platform.sweeping.store(false, std::sync::atomic::Ordering::SeqCst);
                platform.changed();
            });
        }
        let live = self.live_records()?;
        // What a previous process accepted and left under way, taken now:
        // what this one accepts from here on is its own actors' work.
        let operations: Vec<Operation> =
            self.store.node().operations(None)?.into_iter().filter(|op| !op.state.is_terminal()).collect();
        let creating: Vec<SandboxRecord> = self
            .store
            .node()
            .live_sandboxes()?
            .into_iter()
            .filter(|r| r.sandbox.state == SandboxState::Creating)
            .collect();
        // Sandboxes with such an operation wait for it to be taken up again
        // (requests queue behind it, as before).
        let pending: Vec<String> = operations.iter().filter_map(|op| op.sandbox_id.clone()).collect();
        let ids = live.iter().map(|r| r.sandbox.id.clone()).chain(pending.iter().cloned());
        self.reconciling.lock().unwrap_or_else(|e| e.into_inner()).extend(ids);
        // A killed server may have left them told they are idle.
        let unknown = live.iter().map(|r| (r.sandbox.id.clone(), crate::platform::Doze::Unknown));
        self.dozing.lock().unwrap_or_else(|e| e.into_inner()).extend(unknown);
        // A sandbox's operations wait for its own re-adoption and for
        // nothing else: one whose agent is slow to come back holds up no
        // other sandbox's. Those of sandboxes not re-adopted start at once.
        let adopted: HashSet<&str> = live.iter().map(|r| r.sandbox.id.as_str()).collect();
        let mut waiting: HashMap<String, Vec<Operation>> = HashMap::new();
        let mut at_once = Vec::new();
        for operation in operations {
            match operation.sandbox_id.clone().filter(|id| adopted.contains(id.as_str())) {
                Some(id) => waiting.entry(id).or_default().push(operation),
                None => at_once.push(operation),
            }
        }
        let platform = self.clone();
        // Cut short by a shutdown as a kill would cut it (the adoptions
        // under way are aborted with it): the next server adopts again.
        self.tasks.spawn_cancellable(async move {
            let started = Instant::now();
            let count = live.len();
            let all: Vec<Operation> = waiting.values().flatten().chain(&at_once).cloned().collect();
            if let Err(err) = platform.settle_creating(&all, creating).await {
                tracing::error!("settling sandboxes a restart left being created: {}", err.message);
            }
            // Beside the adoptions, and aborted with them.
            let mut others = tokio::task::JoinSet::new();
            {
                let platform = platform.clone();
                let ids: Vec<String> = at_once.iter().filter_map(|op| op.sandbox_id.clone()).collect();
                others.spawn(async move {
                    if let Err(err) = platform.resume_operations(at_once).await {
                        tracing::error!("carrying out operations accepted before the restart: {}", err.message);
                    }
                    ids.iter().for_each(|id| platform.reconciled(id));
                });
            }
            // Policies and pools start once every sandbox is re-adopted or
            // left for its next job (an agent is waited for two minutes at
            // most): a job a policy files must find the sandbox's actor,
            // not start a second one beside its re-adoption.
            platform.adopt_all(live, waiting).await;
            let ms = started.elapsed().as_millis() as u64;
            tracing::info!(sandboxes = count, ms, "re-adopted after a restart");
            while others.join_next().await.is_some() {}
            platform.tasks.spawn(platform.clone().enforce_policies());
            platform.tasks.spawn(platform.clone().sample_usage());
            platform.fill_warm_pools();
        });
        Ok(())
    }

    /// Whether a restarted server is still re-adopting sandbox `id`.
    pub fn reconciling(&self, id: &str) -> bool {
        self.reconciling.lock().unwrap_or_else(|e| e.into_inner()).contains(id)
    }

    /// Waits (up to `patience`) until a restarted server has re-adopted
    /// sandbox `id`; false if it has not by then.
    pub async fn until_reconciled(&self, id: &str, patience: Duration) -> bool {
        let reconciling = || self.reconciling(id);
        if !reconciling() {
            return true;
        }
        let deadline = Instant::now() + patience;
        matches!(self.wait_for(Some(deadline), || Ok(reconciling()), |still| !still).await, Ok(false))
    }

    /// [`space_engine::Engine::stop_strays`], off the async threads.
    async fn stop_strays(&self, spec: &space_engine::SandboxSpec) {
        let (engine, spec) = (self.engine.clone(), spec.clone());
        let _ = tokio::task::spawn_blocking(move || engine.stop_strays(&spec)).await;
    }

    fn reconciled(&self, id: &str) {
        self.reconciling.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        self.changed();
    }
}

/// Stops what an unknown sandbox left and removes its directories: the
/// engine's (through the engine, which may be another process's work) and
/// the server's own.
async fn sweep_one(
    engine: Arc<dyn space_engine::Engine>,
    name: String,
    dir: std::path::PathBuf,
    state: std::path::PathBuf,
) {
    tracing::info!(sandbox = %name, "sweeping leftovers of an unknown sandbox");
    let spec = space_engine::SandboxSpec {
        id: name,
        dir,
        template_rootfs: Default::default(),
        hostname: String::new(),
        vcpus: 0,
        memory_mib: 0,
        disk_mib: 0,
        env: Default::default(),
        workdir: None,
        user: None,
        engine: None,
        trust_pem: None,
        volumes: Vec::new(),
    };
    if spec.dir.exists() {
        let (strays, stray_spec) = (engine.clone(), spec.clone());
        let _ = tokio::task::spawn_blocking(move || strays.stop_strays(&stray_spec)).await;
        if let Err(err) = engine.destroy(&spec).await {
            tracing::warn!("sweeping {}: {err}", spec.dir.display());
        }
    }
    if let Err(err) = tokio::fs::remove_dir_all(&state).await {
        if err.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("sweeping {}: {err}", state.display());
        }
    }
}

impl Platform {
    /// Re-adopts every sandbox recorded as running or paused whose engine
    /// processes still live: its agent redials, the handshake reuses its
    /// session so the agent keeps its command streams, and the commands'
    /// output keeps flowing into their transcripts. What cannot be re-adopted
    /// is stopped and recorded as failed.
    pub async fn recover(self: &Arc<Self>) -> Result<(), NodeError> {
        let live = self.live_records()?;
        self.adopt_all(live, HashMap::new()).await;
        Ok(())
    }

    fn live_records(&self) -> Result<Vec<SandboxRecord>, NodeError> {
        let records = self.store.node().live_sandboxes()?;
        Ok(records
            .into_iter()
            .filter(|r| matches!(r.sandbox.state, SandboxState::Running | SandboxState::Paused))
            .collect())
    }

    /// Re-adopts `live`, each on its own, and carries out each one's
    /// `operations` (accepted before the restart) once it is re-adopted.
    async fn adopt_all(self: &Arc<Self>, live: Vec<SandboxRecord>, mut operations: HashMap<String, Vec<Operation>>) {
        // What the engine shows of each, asked of all at once.
        let specs: Vec<_> = live.iter().map(|record| self.engine_spec(record)).collect();
        let engine = self.engine.clone();
        let statuses = tokio::task::spawn_blocking(move || engine.statuses(&specs)).await.unwrap_or_default();
        // Each on a task of its own (one that panics stops no other), all
        // aborted if this is dropped (at a shutdown).
        let mut adoptions = tokio::task::JoinSet::new();
        for (record, status) in live.into_iter().zip(statuses.into_iter().map(Some).chain(std::iter::repeat(None))) {
            let waiting = operations.remove(&record.sandbox.id).unwrap_or_default();
            adoptions.spawn(self.clone().adopt(record, status, waiting));
        }
        while adoptions.join_next().await.is_some() {}
    }

    async fn adopt(self: Arc<Self>, record: SandboxRecord, status: Option<LiveStatus>, operations: Vec<Operation>) {
        let id = record.sandbox.id.clone();
        // Settled either way (also if this panics): requests waiting for it
        // go on, behind the operations it had (queued first).
        let _reconciled = Reconciled(&self, &id);
        let deleting = operations.iter().any(|op| op.kind == OperationKind::Delete);
        match self.try_adopt(&record, status, deleting).await {
            Ok(Adopted::Taken) => tracing::info!(sandbox = %id, "re-adopted after a restart"),
            Ok(Adopted::Frozen) => {
                tracing::info!(sandbox = %id, "found frozen after a restart; taken back when next used")
            }
            Ok(Adopted::Deleting) => {
                tracing::info!(sandbox = %id, "not taken back after a restart: it is to be deleted")
            }
            Ok(Adopted::Slow(why)) => tracing::warn!(
                sandbox = %id,
                "its agent has not come back after a restart ({why}); its engine still runs it, so it is left as it is and taken back when next used"
            ),
            Err(why) => self.abandon(&id, &why).await,
        }
        if !operations.is_empty() {
            if let Err(err) = self.resume_operations(operations).await {
                tracing::error!(sandbox = %id, "carrying out operations accepted before the restart: {}", err.message);
            }
        }
    }

    /// `status`: what the engine showed of it (asked here if None). True
    /// when its agent was taken back; false when it was left frozen to be
    /// taken back when next used: thawing every paused sandbox at a
    /// restart would take seconds each on a loaded host, for sandboxes
    /// nobody may use again.
    ///
    /// A sandbox to be deleted is not waited for. One whose agent does not
    /// come back while its engine still runs it is not failed: it is left
    /// for its next operation to take back. Only a sandbox whose engine
    /// processes are gone is an error (it is then failed, with the reason).
    async fn try_adopt(
        self: &Arc<Self>,
        record: &SandboxRecord,
        status: Option<LiveStatus>,
        deleting: bool,
    ) -> Result<Adopted, AdoptError> {
        record.agent_session.ok_or(AdoptError::NoSession)?;
        let id = &record.sandbox.id;
        let status = match status {
            Some(status) => status,
            None => {
                let (engine, spec) = (self.engine.clone(), self.engine_spec(record));
                tokio::task::spawn_blocking(move || engine.status(&spec)).await.map_err(AdoptError::StatusCheck)?
            }
        };
        // A pause or resume the engine carried out before the restart but
        // the record did not yet show: the record follows the engine.
        let shown = match (record.sandbox.state, status) {
            (_, LiveStatus::Gone) => return Err(AdoptError::EngineGone),
            (SandboxState::Running, LiveStatus::Paused) => Some(Event::Froze),
            (SandboxState::Paused, LiveStatus::Running) => Some(Event::Thawed),
            _ => None,
        };
        let leave = |adopted: Adopted| {
            if let Some(event) = shown {
                self.apply(id, event, None)?;
            }
            self.spawn_unadopted_actor(id);
            Ok(adopted)
        };
        if deleting {
            return leave(Adopted::Deleting);
        }
        if status == LiveStatus::Paused {
            return leave(Adopted::Frozen);
        }
        let agent = match self.take_back(record, crate::adoption::Thaw::No).await {
            Ok(agent) => agent,
            Err(why) if self.still_runs(&self.engine_spec(record)).await => return leave(Adopted::Slow(why)),
            Err(why) => return Err(why),
        };
        if let Some(event) = shown {
            self.apply(id, event, None)?;
        }
        self.spawn_actor(id, None, Some(agent));
        Ok(Adopted::Taken)
    }
}

/// How a live sandbox came out of its re-adoption.
enum Adopted {
    /// Its agent was taken back.
    Taken,
    /// Found frozen: its agent is taken back when it is next used.
    Frozen,
    /// An accepted delete is next: its agent is not waited for.
    Deleting,
    /// Its agent did not come back (why) while its engine still runs it:
    /// taken back when it is next used.
    Slow(AdoptError),
}

/// Marks its sandbox reconciled when dropped (also if adopting it panicked).
struct Reconciled<'a>(&'a Platform, &'a str);

impl Drop for Reconciled<'_> {
    fn drop(&mut self) {
        self.0.reconciled(self.1);
    }
}
