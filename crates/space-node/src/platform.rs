//! The core of a node (or single host): sandbox records, live sandboxes,
//! operations and their waiters.
//!
//! One actor task per sandbox owns its lifecycle (`actor.rs`): it alone
//! moves the sandbox from state to state (through
//! [`crate::domain::transition`]) and persists each move before anyone can
//! observe it. Handlers go through `lifecycle.rs`, which records requests
//! and sends the actor jobs; they never change a sandbox's state
//! themselves. This file calls none of the modules built on it (see
//! `docs/ARCHITECTURE.md`, "Inside a node", and the test at its end).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use space_api::{Operation, OperationKind, OperationOrigin, OperationState, Progress, Sandbox, SandboxState};
use space_engine::{AgentConn, Engine, SandboxSpec};
use space_host::datadir::DataDir;
use tokio::sync::{mpsc, watch};

use crate::domain::{self, Event};
use crate::error::NodeError;
use crate::ids;
use crate::store::{SandboxRecord, Store};

/// What exists of a sandbox in memory while its actor lives.
pub(crate) struct LiveSandbox {
    pub(crate) agent: Mutex<Option<AgentConn>>,
    pub(crate) jobs: mpsc::UnboundedSender<crate::job::Job>,
    /// Requests that use the sandbox (commands, files) hold it shared while
    /// they do; pausing an idle sandbox takes it exclusively, so it never
    /// freezes a sandbox under a request.
    pub(crate) work: Arc<tokio::sync::RwLock<()>>,
    /// Frozen when a restarted server found it: its agent (and the commands
    /// and code contexts it serves) is taken back before the first job that
    /// needs it, not at the restart (see `recovery.rs`).
    pub(crate) unadopted: std::sync::atomic::AtomicBool,
}

/// What exists of a running command in memory.
pub struct LiveCommand {
    pub progress: watch::Receiver<crate::transcript::Progress>,
    pub stream: u32,
    pub agent: AgentConn,
}

/// Seconds of idleness before the server pauses a sandbox, by default.
pub const DEFAULT_AUTO_PAUSE_S: u64 = 30;

pub struct Platform {
    pub(crate) data: DataDir,
    pub(crate) store: Store,
    pub(crate) engine: Arc<dyn Engine>,
    /// Bumped after every persisted change, for long-polling waiters.
    changes: watch::Sender<u64>,
    pub(crate) sandboxes: Mutex<HashMap<String, Arc<LiveSandbox>>>,
    pub(crate) commands: Mutex<HashMap<String, LiveCommand>>,
    /// Code contexts whose drivers run, by id.
    pub(crate) contexts: Mutex<HashMap<String, Arc<crate::state::contexts::LiveContext>>>,
    /// Live sandboxes a restarted server has not re-adopted yet (requests
    /// for them wait, see [`Platform::until_reconciled`]).
    pub(crate) reconciling: Mutex<std::collections::HashSet<String>>,
    /// How long a request for a sandbox a restarted server has not
    /// re-adopted yet waits for it before a 503, in ms.
    pub(crate) reconcile_patience_ms: std::sync::atomic::AtomicU64,
    /// Leftovers of unknown sandboxes are being swept (at start).
    pub(crate) sweeping: std::sync::atomic::AtomicBool,
    pub(crate) warm: crate::warm::WarmPools,
    /// Memory the host can promise to sandboxes, in MiB.
    pub(crate) capacity_mib: u64,
    /// Held from the capacity check until the new record is written, so
    /// concurrent creates cannot both take the last room.
    pub(crate) admission: Mutex<()>,
    pub(crate) builds: crate::state::builds::Builds,
    /// The guest agent put into templates this server builds.
    pub(crate) agent_bin: std::path::PathBuf,
    /// Output kept per command; what comes after is counted, not stored.
    pub(crate) max_output_bytes: std::sync::atomic::AtomicU64,
    /// Every engine's availability on this host, probed at startup.
    pub(crate) engine_report: std::sync::OnceLock<Vec<space_engine::Availability>>,
    /// Who does templates' root work (see `templates.rs`); set at start.
    pub(crate) template_host: std::sync::OnceLock<Arc<dyn space_engine::templates::TemplateHost>>,
    /// Who does volumes' root work (see `volumes.rs`); set at start.
    pub(crate) volume_host: std::sync::OnceLock<Arc<dyn space_engine::volumes::VolumeHost>>,
    /// The shared store its volumes are kept in (decision 032), if any.
    pub(crate) volume_store: std::sync::OnceLock<Option<String>>,
    /// Volumes a restore or a files write works on (no read-write mount meanwhile).
    pub(crate) busy_volumes: crate::volumes::BusyVolumes,
    /// How images are pulled from registries (operator flags); set at start.
    pub(crate) registry: std::sync::OnceLock<space_image::RegistryConfig>,
    /// Bytes the layer cache may keep (see `images.rs`).
    pub(crate) layer_cache_bytes: std::sync::atomic::AtomicU64,
    /// Layer chains pulls under way use, with how many use each: never evicted.
    pub(crate) chains_in_use: Mutex<HashMap<String, usize>>,
    /// This server's id as a cluster's node (`space node --node-id`), which
    /// the sandboxes it creates record; unset on a single server.
    pub(crate) node_id: std::sync::OnceLock<String>,
    /// Seconds a sandbox may be idle before the server pauses it (0: never).
    pub(crate) auto_pause_s: std::sync::atomic::AtomicU64,
    /// Output kept per sandbox (all its transcripts together).
    pub(crate) max_sandbox_output_bytes: std::sync::atomic::AtomicU64,
    /// Free space of the data dir the host keeps (see `disk.rs`).
    pub(crate) disk_reserve_bytes: std::sync::atomic::AtomicU64,
    pub(crate) output_use: crate::state::disk::OutputUse,
    /// Disk granted to running template builds, by tenant.
    pub(crate) build_grants: Mutex<HashMap<String, u64>>,
    pub(crate) egress: crate::state::egress::EgressHub,
    /// Seals tenant secrets and sandbox CA keys (loaded on first use).
    pub(crate) keyring: std::sync::OnceLock<crate::keyring::Keyring>,
    /// A node: the change of its cluster's secrets it holds (0: none yet),
    /// and the lock that takes a set at a time.
    pub(crate) secrets_epoch: std::sync::atomic::AtomicU64,
    pub(crate) secrets_taken: Mutex<()>,
    /// A node: each tenant's disk quota here as its control plane last
    /// told it (`None`: no quota), which wins over the node's own records.
    pub(crate) told_disk_quotas: Mutex<HashMap<String, Option<crate::state::disk::ToldQuota>>>,
    pub(crate) metrics: crate::metrics::Metrics,
    /// Running sandboxes whose engine was told they are idle (see
    /// `idle.rs`), or may have been by a server before a restart.
    pub(crate) dozing: Mutex<HashMap<String, Doze>>,
    /// When the current step of each operation under way began.
    step_clocks: Mutex<HashMap<String, std::time::Instant>>,
    pub(crate) usage: crate::state::usage::UsageHistory,
    /// `GET /metrics` without a key (`space serve --metrics-without-key`).
    pub(crate) metrics_without_key: std::sync::atomic::AtomicBool,
    /// Whether requests are counted and logged and events recorded (off
    /// only for `space bench`'s baseline).
    observing: std::sync::atomic::AtomicBool,
    /// Its loops and the sandboxes' actors, stopped by [`Platform::shutdown`].
    pub(crate) tasks: space_core::tasks::Tasks,
}

/// How long a shutdown waits for the background tasks to end before it
/// aborts them.
const SHUTDOWN_PATIENCE: Duration = Duration::from_secs(20);

/// Output kept per command by default (stdout and stderr together).
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 256 << 20;

/// What the server knows of a sandbox it may have told its engine is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Doze {
    /// Told it is idle.
    Dozing,
    /// Re-adopted after a restart: the server before may have told it.
    Unknown,
}

impl Platform {
    pub fn new(
        data: DataDir,
        store: Store,
        engine: Arc<dyn Engine>,
        pools: crate::warm::PoolSizes,
        capacity_mib: u64,
        agent_bin: std::path::PathBuf,
    ) -> Arc<Platform> {
        Arc::new(Platform {
            data,
            store,
            changes: watch::Sender::new(0),
            sandboxes: Mutex::new(HashMap::new()),
            commands: Mutex::new(HashMap::new()),
            contexts: Mutex::default(),
            reconciling: Mutex::default(),
            sweeping: Default::default(),
            reconcile_patience_ms: 30_000.into(),
            warm: crate::warm::WarmPools::new(engine.clone(), pools),
            capacity_mib,
            admission: Mutex::new(()),
            builds: Default::default(),
            agent_bin,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES.into(),
            engine_report: Default::default(),
            template_host: Default::default(),
            volume_host: Default::default(),
            volume_store: Default::default(),
            busy_volumes: Default::default(),
            registry: Default::default(),
            layer_cache_bytes: (crate::DEFAULT_LAYER_CACHE_MIB << 20).into(),
            chains_in_use: Default::default(),
            node_id: Default::default(),
            auto_pause_s: DEFAULT_AUTO_PAUSE_S.into(),
            max_sandbox_output_bytes: crate::state::disk::DEFAULT_MAX_SANDBOX_OUTPUT_BYTES.into(),
            disk_reserve_bytes: (crate::state::disk::DEFAULT_DISK_RESERVE_MIB << 20).into(),
            output_use: Default::default(),
            build_grants: Default::default(),
            egress: crate::state::egress::EgressHub::new(space_egress::gateway::GatewayConfig::new(Arc::new(
                space_egress::gateway::SystemResolver,
            ))),
            keyring: Default::default(),
            secrets_epoch: Default::default(),
            secrets_taken: Default::default(),
            told_disk_quotas: Default::default(),
            engine,
            metrics: Default::default(),
            dozing: Default::default(),
            step_clocks: Default::default(),
            usage: Default::default(),
            metrics_without_key: Default::default(),
            observing: true.into(),
            tasks: space_core::tasks::Tasks::default(),
        })
    }

    /// Stops this platform's work in the process, as a server does before
    /// it exits: every background task is told to stop and waited for (up
    /// to [`SHUTDOWN_PATIENCE`], then aborted) — the loops end, each
    /// sandbox's actor is dropped where it waits, as a kill would drop it —
    /// and the warm pools are drained (their members belong to no one).
    /// The sandboxes keep running, and what was accepted stays accepted:
    /// the next server on this data dir re-adopts them and carries it out.
    /// Nothing starts in the background after this.
    pub async fn shutdown(&self) {
        self.warm.close();
        self.tasks.stop(SHUTDOWN_PATIENCE).await;
        self.warm.drain().await;
    }

    /// Runs `task` (a node's heartbeats, say) until it ends or the platform
    /// shuts down; then it is dropped at its next await.
    pub fn run_until_shutdown(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.spawn_cancellable(task);
    }

    /// How many background tasks run now, the warm pools' too (0 once
    /// [`Platform::shutdown`] returned).
    pub fn background_tasks(&self) -> usize {
        self.tasks.running() + self.warm.tasks_running()
    }

    /// Turns request metrics, request logs and events on or off.
    pub fn observe(&self, on: bool) {
        self.observing.store(on, std::sync::atomic::Ordering::Relaxed);
        self.store.record_events(on);
    }

    pub fn observing(&self) -> bool {
        self.observing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The store itself, for tests that check what the runtime recorded
    /// (the `testing` feature, which only tests turn on): the edge reads
    /// through the runtime's own methods, which take the caller.
    #[cfg(feature = "testing")]
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The event log, read-only (`GET /v1/events`, a node's feed).
    pub fn events(&self) -> crate::store::EventReader<'_> {
        self.store.events()
    }

    /// The ids of the sandboxes this host holds, but failed ones (what a
    /// node reports to its control plane).
    pub fn held_sandbox_ids(&self) -> Result<Vec<String>, NodeError> {
        let live = self.store.node().live_sandboxes()?;
        Ok(live.into_iter().filter(|r| r.sandbox.state != SandboxState::Failed).map(|r| r.sandbox.id).collect())
    }

    /// The engine new sandboxes run on by default (`gvisor`, `firecracker`).
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Every engine's availability on this host, as probed at startup.
    pub fn engine_report(&self) -> Vec<space_engine::Availability> {
        self.engine_report.get().cloned().unwrap_or_else(|| vec![self.engine.availability()])
    }

    /// The host's directories: templates, sandboxes' files, logs, the
    /// development key. Read-only paths; what changes them is the runtime's.
    pub fn data(&self) -> &DataDir {
        &self.data
    }

    /// The warm and hot pools.
    pub fn warm(&self) -> &crate::warm::WarmPools {
        &self.warm
    }

    /// The counters `GET /metrics` shows.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// Memory this host promises to sandboxes at most, in MiB.
    pub fn capacity_mib(&self) -> u64 {
        self.capacity_mib
    }

    /// This server as a cluster's node: the id it joined as. Set once, at
    /// start, before it serves; a second call changes nothing.
    pub fn join_cluster_as(&self, node_id: &str) {
        let _ = self.node_id.set(node_id.to_string());
    }

    /// The change of the cluster's secrets this node holds (0: none yet).
    pub fn secrets_epoch(&self) -> u64 {
        self.secrets_epoch.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many live sandboxes a restarted server has not re-adopted yet.
    pub fn reconciling_count(&self) -> usize {
        self.reconciling.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// How long a request for a sandbox not re-adopted yet waits for it.
    pub fn reconcile_patience(&self) -> Duration {
        Duration::from_millis(self.reconcile_patience_ms.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Sets [`Platform::reconcile_patience`]; returns the one it replaces.
    pub fn set_reconcile_patience(&self, patience: Duration) -> Duration {
        let before = self.reconcile_patience_ms.swap(patience.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
        Duration::from_millis(before)
    }

    /// Free space of the data dir the host keeps, in bytes.
    pub fn disk_reserve_bytes(&self) -> u64 {
        self.disk_reserve_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets [`Platform::disk_reserve_bytes`] (`space serve --disk-reserve-mib`).
    pub fn set_disk_reserve_bytes(&self, bytes: u64) {
        self.disk_reserve_bytes.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the output kept per command (`space serve --max-output-mib`).
    pub fn set_max_output_bytes(&self, bytes: u64) {
        self.max_output_bytes.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the output kept per sandbox, all its transcripts together
    /// (`space serve --max-sandbox-output-mib`).
    pub fn set_max_sandbox_output_bytes(&self, bytes: u64) {
        self.max_sandbox_output_bytes.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether `GET /metrics` answers without a key.
    pub fn metrics_without_key(&self) -> bool {
        self.metrics_without_key.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets [`Platform::metrics_without_key`] (`space serve --metrics-without-key`).
    pub fn set_metrics_without_key(&self, open: bool) {
        self.metrics_without_key.store(open, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records what a node's control plane last told it of `tenant`'s disk
    /// quota, which wins over the node's own records.
    pub fn told_disk_quota(&self, tenant: &str, told: Option<crate::state::disk::ToldQuota>) {
        self.told_disk_quotas.lock().unwrap_or_else(|e| e.into_inner()).insert(tenant.to_string(), told);
    }

    pub fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Waits until `check` returns `Some` or `deadline` passes; then returns
    /// the last value `load` gave.
    pub async fn wait_for<T>(
        &self,
        deadline: Option<Instant>,
        mut load: impl FnMut() -> Result<T, NodeError>,
        done: impl Fn(&T) -> bool,
    ) -> Result<T, NodeError> {
        let mut changes = self.changes.subscribe();
        loop {
            changes.borrow_and_update();
            let value = load()?;
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if done(&value) || left.is_zero() {
                return Ok(value);
            }
            let _ = tokio::time::timeout(left, changes.changed()).await;
        }
    }

    /// Waits until the leftovers found at start are swept (`recovery.rs`):
    /// their runsc processes never run beside a new sandbox's.
    pub(crate) async fn until_swept(&self) {
        let sweeping = || Ok(self.sweeping.load(std::sync::atomic::Ordering::SeqCst));
        let _ = self.wait_for(None, sweeping, |still| !still).await;
    }

    /// A sandbox's record by id, for the runtime itself: an edge loads a
    /// sandbox for its caller ([`Platform::sandbox_for`]).
    pub(crate) fn sandbox(&self, id: &str) -> Result<SandboxRecord, NodeError> {
        if !ids::plausible(id, "sbx") {
            return Err(NodeError::not_found("sandbox", id));
        }
        self.store.node().sandbox(id)?.ok_or_else(|| NodeError::not_found("sandbox", id))
    }

    /// Who owns template `name` (`Some(None)`: shared), if it exists or is
    /// being built.
    pub fn template_owner(&self, name: &str) -> Option<Option<String>> {
        if let Some(building) = self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            return Some(building.owner.clone());
        }
        self.data.template(name).map(|t| t.meta.owner)
    }

    /// Before a sandbox is used: if its engine was told it is idle (or a
    /// server before a restart may have told it), tells it it is not.
    pub fn wake_up(&self, id: &str) {
        let was = self.dozing.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        if was.is_some() {
            if let Ok(record) = self.sandbox(id) {
                self.engine.set_idle(&self.engine_spec(&record), false);
            }
        }
    }

    /// The agent of a running sandbox.
    /// Whether the server holds a connection to the sandbox's agent (what
    /// is reachable of it goes through a `Session`).
    pub fn holds_agent(&self, id: &str) -> bool {
        self.agent(id).is_some()
    }

    pub(crate) fn agent(&self, id: &str) -> Option<AgentConn> {
        let live = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned()?;
        let agent = live.agent.lock().unwrap_or_else(|e| e.into_inner()).clone();
        agent
    }

    /// Applies `event` to a sandbox and persists it. Only actors (and
    /// startup reconciliation) call this.
    pub(crate) fn apply(&self, id: &str, event: Event, reason: Option<String>) -> Result<Sandbox, NodeError> {
        self.apply_with(id, event, reason, |_| {})
    }

    /// [`Platform::apply`], also changing the record in the same write.
    pub(crate) fn apply_with(
        &self,
        id: &str,
        event: Event,
        reason: Option<String>,
        edit: impl FnOnce(&mut SandboxRecord),
    ) -> Result<Sandbox, NodeError> {
        let mut record = self.sandbox(id)?;
        edit(&mut record);
        record.sandbox.state = domain::transition(record.sandbox.state, event)?;
        if record.sandbox.state != SandboxState::Paused {
            record.sandbox.auto_paused = false;
        }
        record.sandbox.updated_at = ids::now();
        if reason.is_some() {
            record.sandbox.failure_reason = reason;
        }
        self.store.node().put_sandbox(&record)?;
        self.changed();
        Ok(record.sandbox)
    }

    pub fn operation(&self, id: &str) -> Result<Operation, NodeError> {
        if !ids::plausible(id, "op") {
            return Err(NodeError::not_found("operation", id));
        }
        self.store.node().operation(id)?.ok_or_else(|| NodeError::not_found("operation", id))
    }

    /// Changes an operation and stores it; the operation as stored.
    fn update_operation(&self, id: &str, change: impl FnOnce(&mut Operation)) -> Option<Operation> {
        let result = self.operation(id).and_then(|mut operation| {
            change(&mut operation);
            self.store.node().put_operation(&operation, "", None)?;
            Ok(operation)
        });
        self.changed();
        result.map_err(|err| tracing::error!(operation = id, "updating an operation: {}", err.message)).ok()
    }

    /// Records how long a fork froze its source.
    pub(crate) fn record_frozen(&self, id: &str, frozen: Duration) {
        self.update_operation(id, |op| op.frozen_ms = Some(frozen.as_millis() as u64));
    }

    pub(crate) fn progress(&self, id: &str, step: &str, done: u64) {
        self.progress_with(id, step, done, None, &[]);
    }

    /// [`Platform::progress`] after a step the engine timed in `parts`,
    /// which the timings list in place of the whole step.
    pub(crate) fn progress_after(&self, id: &str, parts: &space_engine::Steps, step: &str, done: u64) {
        self.progress_with(id, step, done, None, parts);
    }

    /// A build's progress, with its measured amount when there is one.
    pub(crate) fn build_progress(&self, id: &str, progress: &space_host::template::BuildProgress) {
        let amount = progress.amount.as_ref().map(|a| space_api::ProgressAmount {
            unit: a.unit.into(),
            done: a.done,
            total: a.total,
        });
        self.progress_with(id, &progress.step, progress.done, amount, &[]);
    }

    fn progress_with(
        &self,
        id: &str,
        step: &str,
        done: u64,
        amount: Option<space_api::ProgressAmount>,
        parts: &[(&'static str, Duration)],
    ) {
        self.update_operation(id, |op| {
            if op.state == OperationState::Pending {
                op.state = OperationState::Running;
                op.started_at = Some(ids::now());
            }
            if op.progress.step != step {
                self.lap(op, true, parts);
            }
            op.progress.step = step.to_string();
            op.progress.done = done;
            op.progress.amount = amount;
        });
    }

    /// Ends an operation the server filed itself (an idle pause) that no
    /// longer applies, saying why.
    pub(crate) fn cancel_operation(&self, id: &str, why: &str) {
        self.update_operation(id, |op| {
            self.lap(op, false, &[]);
            op.state = OperationState::Cancelled;
            op.started_at.get_or_insert_with(ids::now);
            op.finished_at = Some(ids::now());
            op.progress.step = why.to_string();
        });
    }

    /// Ends the current step of `op` in its timings — in its `parts` and
    /// what went between them, when it was timed so — and the next one
    /// starts now (`go_on`) or none does (the operation ends).
    fn lap(&self, op: &mut Operation, go_on: bool, parts: &[(&'static str, Duration)]) {
        let now = std::time::Instant::now();
        let mut clocks = self.step_clocks.lock().unwrap_or_else(|e| e.into_inner());
        let began = if go_on { clocks.insert(op.id.clone(), now) } else { clocks.remove(&op.id) };
        let took = match began {
            Some(at) => now - at,
            // The first step (`queued`) began when the operation was made.
            None => op.created_at.age_at(std::time::SystemTime::now()),
        };
        let step = op.progress.step.clone();
        if parts.is_empty() {
            return push_timing(&mut op.progress.timings, &step, took);
        }
        for (part, took) in parts {
            push_timing(&mut op.progress.timings, &format!("{step}: {part}"), *took);
        }
        let rest = took.saturating_sub(parts.iter().map(|(_, took)| *took).sum());
        push_timing(&mut op.progress.timings, &format!("{step}: between the parts"), rest);
    }

    pub(crate) fn finish_operation(&self, id: &str, error: Option<NodeError>) {
        let finished = self.update_operation(id, |op| {
            self.lap(op, false, &[]);
            op.finished_at = Some(ids::now());
            op.started_at.get_or_insert_with(ids::now);
            match error {
                None => {
                    op.state = OperationState::Succeeded;
                    op.progress.done = op.progress.total;
                    op.progress.step = "done".into();
                    op.progress.amount = None;
                }
                Some(error) => {
                    op.state = OperationState::Failed;
                    op.error = Some(error.detail());
                }
            }
        });
        if let Some(operation) = finished {
            let engine = operation.sandbox_id.as_deref().and_then(|s| self.store.node().sandbox(s).ok().flatten());
            let engine = engine.map(|r| r.sandbox.engine).unwrap_or_else(|| self.engine.name().to_string());
            self.metrics.operation_ended(&operation, &engine);
        }
    }

    /// Stops a sandbox's engine processes (keeping its disk), off the async
    /// threads; a sandbox that is already stopped is fine.
    pub(crate) async fn stop_engine(&self, spec: &SandboxSpec) {
        let engine = self.engine.clone();
        let spec = spec.clone();
        let _ = tokio::task::spawn_blocking(move || engine.stop(&spec)).await;
    }

    /// The engine a template's sandboxes run on: its own setting when this
    /// host can run that engine (503 otherwise), else the server's default.
    pub(crate) fn engine_for(&self, template: &space_host::template::TemplateInfo) -> Result<String, NodeError> {
        let Some(wanted) = template.meta.engine.as_deref().filter(|w| *w != self.engine.name()) else {
            return Ok(self.engine.name().to_string());
        };
        let report = self.engine_report.get().cloned().unwrap_or_default();
        match report.iter().find(|a| a.name == wanted) {
            Some(engine) if engine.available => Ok(wanted.to_string()),
            found => Err(NodeError::unavailable(format!(
                "template {:?} runs on {wanted}, which this host cannot run: {}",
                template.meta.name,
                found.map(|a| a.detail.as_str()).unwrap_or("not configured")
            ))),
        }
    }

    pub(crate) fn engine_spec(&self, record: &SandboxRecord) -> SandboxSpec {
        let sandbox = &record.sandbox;
        let version_dir = self.data.templates_dir().join(&sandbox.template).join(record.template_version.to_string());
        // The version a sandbox started from stays on disk while it exists.
        let defaults = space_host::template::TemplateInfo::load(&version_dir).ok().map(|t| t.meta.defaults);
        SandboxSpec {
            id: sandbox.id.clone(),
            dir: self.data.sandbox_dir(&sandbox.id),
            template_rootfs: version_dir.join("rootfs"),
            workdir: defaults.as_ref().map(|d| d.workdir.clone()),
            user: defaults.map(|d| d.user),
            engine: Some(sandbox.engine.clone()),
            trust_pem: record.egress_ca.as_ref().map(|ca| ca.cert_pem.clone()),
            hostname: ids::hostname_for(&sandbox.id),
            vcpus: sandbox.vcpus,
            memory_mib: sandbox.memory_mib,
            disk_mib: sandbox.disk_mib,
            env: record.env.clone(),
            volumes: record
                .volume_ids
                .iter()
                .zip(&record.sandbox.volumes)
                .map(|(volume, mount)| space_engine::VolumeMountSpec {
                    volume: volume.clone(),
                    path: mount.path.clone(),
                    read_only: mount.read_only,
                })
                .collect(),
        }
    }
}

/// Timings kept per operation, at most (a long build's steps).
const MAX_TIMINGS: usize = 64;

fn push_timing(timings: &mut Vec<space_api::StepTiming>, step: &str, took: Duration) {
    if timings.len() < MAX_TIMINGS {
        let ms = (took.as_secs_f64() * 10_000.0).round() / 10.0;
        timings.push(space_api::StepTiming { step: step.to_string(), ms });
    }
}

pub(crate) fn new_operation(kind: OperationKind, sandbox_id: &str, step: &str, total: u64) -> Operation {
    Operation {
        id: ids::new_id("op"),
        kind,
        sandbox_id: Some(sandbox_id.to_string()),
        template: None,
        state: OperationState::Pending,
        progress: Progress::new(step, 0, total),
        error: None,
        forks: Vec::new(),
        checkpoint: None,
        frozen_ms: None,
        origin: OperationOrigin::Client,
        created_at: ids::now(),
        started_at: None,
        finished_at: None,
    }
}

#[cfg(test)]
mod tests {
    /// Every module that adds methods to `Platform`: the features built on
    /// the core (lifecycle, actors, commands, templates, policies, …).
    const FEATURES: &[(&str, &str)] = &[
        ("access.rs", include_str!("access.rs")),
        ("actor.rs", include_str!("actor.rs")),
        ("adoption.rs", include_str!("adoption.rs")),
        ("capacity.rs", include_str!("capacity.rs")),
        ("checkpoints.rs", include_str!("checkpoints.rs")),
        ("commands.rs", include_str!("commands.rs")),
        ("contexts.rs", include_str!("contexts.rs")),
        ("disk.rs", include_str!("disk.rs")),
        ("dockerfile_builds.rs", include_str!("dockerfile_builds.rs")),
        ("egress.rs", include_str!("egress.rs")),
        ("idle.rs", include_str!("idle.rs")),
        ("images.rs", include_str!("images.rs")),
        ("lifecycle.rs", include_str!("lifecycle.rs")),
        ("policies.rs", include_str!("policies.rs")),
        ("recovery.rs", include_str!("recovery.rs")),
        ("scrape.rs", include_str!("scrape.rs")),
        ("sampling.rs", include_str!("sampling.rs")),
        ("secrets.rs", include_str!("secrets.rs")),
        ("session.rs", include_str!("session.rs")),
        ("templates.rs", include_str!("templates.rs")),
        ("volumes.rs", include_str!("volumes.rs")),
    ];

    /// The methods a file's `impl Platform` blocks define.
    fn methods(source: &str) -> Vec<String> {
        let mut inside = false;
        let mut names = Vec::new();
        for line in source.lines() {
            match line {
                "impl Platform {" => inside = true,
                "}" => inside = false,
                _ if inside => {
                    let rest = line.strip_prefix("    ").unwrap_or_default();
                    let rest = rest.strip_prefix("pub(crate) ").or_else(|| rest.strip_prefix("pub ")).unwrap_or(rest);
                    let rest = rest.strip_prefix("async ").unwrap_or(rest);
                    if let Some(rest) = rest.strip_prefix("fn ") {
                        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                        names.push(name);
                    }
                }
                _ => {}
            }
        }
        names
    }

    /// Which files `file`'s code calls into (a method of theirs called on
    /// `self` or on a `platform`).
    fn calls(file: &str, source: &str, files: &[(&str, &str)]) -> Vec<String> {
        let code = source.split("#[cfg(test)]").next().unwrap_or_default();
        let mut called = Vec::new();
        for (other, other_source) in files.iter().filter(|(other, _)| *other != file) {
            let call =
                |name: &String| code.contains(&format!("self.{name}(")) || code.contains(&format!("platform.{name}("));
            if methods(other_source).iter().any(call) {
                called.push(other.to_string());
            }
        }
        called
    }

    /// The core (this file) calls none of the code built on it, the code
    /// built on it calls in one direction only (no circle), and the warm
    /// pools and tenancy do not know `Platform` at all.
    #[test]
    fn the_modules_form_layers_not_a_circle() {
        let mut files = FEATURES.to_vec();
        files.push(("platform.rs", include_str!("platform.rs")));
        for (file, source) in &files {
            assert!(!methods(source).is_empty(), "{file} adds no method to Platform: drop it from FEATURES");
        }
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        for entry in std::fs::read_dir(&src).expect("the sources").flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let source = std::fs::read_to_string(entry.path()).unwrap_or_default();
            if source.contains("\nimpl Platform {") {
                assert!(
                    files.iter().any(|(file, _)| *file == name),
                    "{name} adds methods to Platform: list it in FEATURES"
                );
            }
        }
        let graph: Vec<(String, Vec<String>)> =
            files.iter().map(|(file, source)| (file.to_string(), calls(file, source, &files))).collect();
        let core = &graph.iter().find(|(file, _)| file == "platform.rs").expect("the core").1;
        assert!(core.is_empty(), "platform.rs calls into {core:?}, which are built on it");
        // Peel off files that call nothing left; a circle is what remains.
        let mut left = graph.clone();
        while let Some(at) = left.iter().position(|(_, calls)| calls.iter().all(|c| !left.iter().any(|(f, _)| f == c)))
        {
            left.remove(at);
        }
        assert!(left.is_empty(), "these call each other in a circle: {left:?}");
        let warm = include_str!("warm.rs");
        assert!(!warm.contains("impl Platform") && !warm.contains("platform::"), "warm.rs knows Platform");
    }
}
