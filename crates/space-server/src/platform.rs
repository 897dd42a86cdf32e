//! The control plane's core: sandbox records, their actors, operations.
//!
//! One actor task per sandbox owns its lifecycle: it alone moves the
//! sandbox from state to state (through [`crate::domain::transition`]) and
//! persists each move before anyone can observe it. Handlers create records
//! and send the actor jobs; they never change a sandbox's state themselves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use space_api::{Operation, OperationKind, OperationOrigin, OperationState, Progress, Sandbox, SandboxState};
use space_engine::{AgentConn, Engine, SandboxSpec};
use space_host::datadir::DataDir;
use tokio::sync::{mpsc, watch};

use crate::commands::LiveCommand;
use crate::domain::{self, CreateSpec, Event};
use crate::error::ApiError;
use crate::ids;
use crate::store::{SandboxRecord, Store};

/// A job for a sandbox's actor: carry out this operation.
pub(crate) struct Job {
    pub(crate) kind: OperationKind,
    pub(crate) operation_id: String,
    /// For a create: the warm sandbox to hand out instead of a cold start.
    pub(crate) warm: Option<crate::warm::WarmMember>,
    /// Who asked: an `Idle` pause is the server's (see `idle.rs`).
    pub(crate) origin: OperationOrigin,
}

/// What exists of a sandbox in memory while its actor lives.
pub(crate) struct LiveSandbox {
    pub(crate) agent: Mutex<Option<AgentConn>>,
    jobs: mpsc::UnboundedSender<Job>,
    /// Requests that use the sandbox (commands, files) hold it shared while
    /// they do; pausing an idle sandbox takes it exclusively, so it never
    /// freezes a sandbox under a request.
    pub(crate) work: Arc<tokio::sync::RwLock<()>>,
}

pub struct Platform {
    pub data: DataDir,
    pub store: Store,
    pub engine: Arc<dyn Engine>,
    /// Bumped after every persisted change, for long-polling waiters.
    changes: watch::Sender<u64>,
    pub(crate) sandboxes: Mutex<HashMap<String, Arc<LiveSandbox>>>,
    pub(crate) commands: Mutex<HashMap<String, LiveCommand>>,
    pub(crate) warm: crate::warm::WarmPools,
    /// Warm sandboxes kept per template (0: always cold start).
    pub(crate) warm_size: u32,
    /// Memory the host can promise to sandboxes, in MiB.
    pub(crate) capacity_mib: u64,
    /// Held from the capacity check until the new record is written, so
    /// concurrent creates cannot both take the last room.
    admission: Mutex<()>,
    pub(crate) builds: crate::templates::Builds,
    /// The guest agent put into templates this server builds.
    pub(crate) agent_bin: std::path::PathBuf,
    /// Output kept per command; what comes after is counted, not stored.
    pub max_output_bytes: std::sync::atomic::AtomicU64,
    /// Every engine's availability on this host, probed at startup.
    pub engine_report: std::sync::OnceLock<Vec<space_engine::Availability>>,
    /// Seconds a sandbox may be idle before the server pauses it (0: never).
    pub auto_pause_s: std::sync::atomic::AtomicU64,
    /// Output kept per sandbox (all its transcripts together).
    pub max_sandbox_output_bytes: std::sync::atomic::AtomicU64,
    /// Free space of the data dir the host keeps (see `disk.rs`).
    pub disk_reserve_bytes: std::sync::atomic::AtomicU64,
    pub(crate) output_use: crate::disk::OutputUse,
    /// Disk granted to running template builds, by tenant.
    pub(crate) build_grants: Mutex<HashMap<String, u64>>,
    pub(crate) egress: crate::egress::EgressHub,
    /// Seals tenant secrets and sandbox CA keys (loaded on first use).
    pub(crate) keyring: std::sync::OnceLock<crate::secrets::Keyring>,
    /// A node: the change of its cluster's secrets it holds (0: none yet),
    /// and the lock that takes a set at a time.
    pub(crate) secrets_epoch: std::sync::atomic::AtomicU64,
    pub(crate) secrets_taken: Mutex<()>,
    /// A node: each tenant's disk quota here as its control plane last
    /// told it (`None`: no quota), which wins over the node's own records.
    pub(crate) told_disk_quotas: Mutex<HashMap<String, Option<crate::disk::ToldQuota>>>,
    pub metrics: crate::metrics::Metrics,
    pub(crate) usage: crate::sampling::UsageHistory,
    /// `GET /metrics` without a key (`space serve --metrics-without-key`).
    pub metrics_without_key: std::sync::atomic::AtomicBool,
    /// Whether requests are counted and logged and events recorded (off
    /// only for `space bench`'s baseline).
    observing: std::sync::atomic::AtomicBool,
}

/// Output kept per command by default (stdout and stderr together).
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 256 << 20;

impl Platform {
    pub fn new(
        data: DataDir,
        store: Store,
        engine: Arc<dyn Engine>,
        warm_size: u32,
        capacity_mib: u64,
        agent_bin: std::path::PathBuf,
    ) -> Arc<Platform> {
        Arc::new(Platform {
            data,
            store,
            engine,
            changes: watch::Sender::new(0),
            sandboxes: Mutex::new(HashMap::new()),
            commands: Mutex::new(HashMap::new()),
            warm: Default::default(),
            warm_size,
            capacity_mib,
            admission: Mutex::new(()),
            builds: Default::default(),
            agent_bin,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES.into(),
            engine_report: Default::default(),
            auto_pause_s: crate::idle::DEFAULT_AUTO_PAUSE_S.into(),
            max_sandbox_output_bytes: crate::disk::DEFAULT_MAX_SANDBOX_OUTPUT_BYTES.into(),
            disk_reserve_bytes: (crate::disk::DEFAULT_DISK_RESERVE_MIB << 20).into(),
            output_use: Default::default(),
            build_grants: Default::default(),
            egress: crate::egress::EgressHub::new(space_egress::gateway::GatewayConfig::new(Arc::new(
                space_egress::gateway::SystemResolver,
            ))),
            keyring: Default::default(),
            secrets_epoch: Default::default(),
            secrets_taken: Default::default(),
            told_disk_quotas: Default::default(),
            metrics: Default::default(),
            usage: Default::default(),
            metrics_without_key: Default::default(),
            observing: true.into(),
        })
    }

    /// Turns request metrics, request logs and events on or off.
    pub fn observe(&self, on: bool) {
        self.observing.store(on, std::sync::atomic::Ordering::Relaxed);
        self.store.record_events(on);
    }

    pub(crate) fn observing(&self) -> bool {
        self.observing.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Waits until `check` returns `Some` or `deadline` passes; then returns
    /// the last value `load` gave.
    pub async fn wait_for<T>(
        &self,
        deadline: Option<Instant>,
        mut load: impl FnMut() -> Result<T, ApiError>,
        done: impl Fn(&T) -> bool,
    ) -> Result<T, ApiError> {
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

    pub fn sandbox(&self, id: &str) -> Result<SandboxRecord, ApiError> {
        if !ids::plausible(id, "sbx") {
            return Err(ApiError::not_found("sandbox", id));
        }
        self.store.sandbox(id)?.ok_or_else(|| ApiError::not_found("sandbox", id))
    }

    /// The agent of a running sandbox.
    pub fn agent(&self, id: &str) -> Option<AgentConn> {
        let live = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned()?;
        let agent = live.agent.lock().unwrap_or_else(|e| e.into_inner()).clone();
        agent
    }

    /// Accepts a create: records the sandbox and its operation, then hands
    /// the work to a new actor.
    pub fn create_sandbox(
        self: &Arc<Self>,
        mut spec: CreateSpec,
        template: &space_host::template::TemplateInfo,
        tenant: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(Sandbox, Operation), ApiError> {
        let now = ids::now();
        // The request's network, else the template's, else the tenant's.
        let mut network = match spec.network.take() {
            Some(network) => network,
            None => self.store.tenant_quotas(tenant)?.network.unwrap_or_default(),
        };
        // The sandbox holds placeholders; its secrets stay on the host.
        let placeholders = self.bind_secrets(tenant, &mut network, None)?;
        self.check_egress_ceiling(tenant, &network)?;
        spec.env.extend(placeholders);
        let template_version = template.meta.version;
        let engine = self.engine_for(template)?;
        let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        self.check_quotas(tenant, &spec)?;
        self.check_reserve("create a sandbox", 0)?;
        let warm = self.take_warm(&spec, template);
        if warm.is_none() {
            // A warm member's memory is already counted.
            self.admit(spec.memory_mib)?;
        }
        let sandbox = Sandbox {
            id: warm.as_ref().map(|m| m.spec.id.clone()).unwrap_or_else(|| ids::new_id("sbx")),
            template: spec.template,
            state: SandboxState::Creating,
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            disk_mib: spec.disk_mib,
            labels: spec.labels,
            engine,
            created_at: now.clone(),
            updated_at: now.clone(),
            lifecycle: spec.lifecycle,
            network,
            last_activity_at: now.clone(),
            auto_paused: false,
            failure_reason: None,
        };
        let operation = new_operation(OperationKind::Create, &sandbox.id, "queued", 3);
        self.metrics.create_started(&operation.id, warm.is_some());
        let record = SandboxRecord {
            sandbox: sandbox.clone(),
            template_version,
            env: spec.env,
            agent_session: None,
            channel_key: None,
            tenant: tenant.to_string(),
            egress_ca: Some(self.new_egress_ca(&sandbox.id)?),
        };
        self.store.put_sandbox(&record)?;
        self.store.put_operation(&operation, tenant, idempotency_key)?;
        self.changed();
        self.spawn_actor(
            &sandbox.id,
            Some(Job {
                kind: OperationKind::Create,
                operation_id: operation.id.clone(),
                warm,
                origin: operation.origin,
            }),
            None,
        );
        Ok((sandbox, operation))
    }

    /// Accepts a lifecycle request (pause, resume, delete) after checking it
    /// is valid in the sandbox's current state (409 otherwise), and hands it
    /// to the sandbox's actor. Deleting a deleted sandbox succeeds at once.
    pub fn request(
        self: &Arc<Self>,
        id: &str,
        kind: OperationKind,
        idempotency_key: Option<&str>,
    ) -> Result<(Sandbox, Operation), ApiError> {
        self.request_job(id, kind, idempotency_key, OperationOrigin::Client)
    }

    /// [`Platform::request`] for whoever asks: a client, a lifecycle policy,
    /// or the server pausing an idle sandbox (`OperationOrigin::Idle`).
    pub(crate) fn request_job(
        self: &Arc<Self>,
        id: &str,
        kind: OperationKind,
        idempotency_key: Option<&str>,
        origin: OperationOrigin,
    ) -> Result<(Sandbox, Operation), ApiError> {
        let record = self.sandbox(id)?;
        let (event, total) = match kind {
            OperationKind::Delete => (Event::DeleteRequested, 2),
            OperationKind::Pause => (Event::Froze, 1),
            OperationKind::Resume if record.sandbox.state == SandboxState::Suspended => (Event::RestoreRequested, 2),
            OperationKind::Resume => (Event::Thawed, 1),
            OperationKind::Suspend => (Event::SuspendRequested, 3),
            OperationKind::Create | OperationKind::BuildTemplate => {
                return Err(ApiError::unprocessable(format!("{kind:?} is not a request on an existing sandbox")));
            }
        };
        let mut operation = new_operation(kind, id, "queued", total);
        operation.origin = origin;
        if kind == OperationKind::Delete && record.sandbox.state == SandboxState::Deleted {
            let now = ids::now();
            operation.state = OperationState::Succeeded;
            operation.progress = Progress { step: "already deleted".into(), done: total, total, amount: None };
            operation.started_at = Some(now.clone());
            operation.finished_at = Some(now);
            self.store.put_operation(&operation, &record.tenant, idempotency_key)?;
            self.changed();
            return Ok((record.sandbox, operation));
        }
        domain::transition(record.sandbox.state, event)?;
        if event == Event::SuspendRequested {
            // The snapshot holds the sandbox's memory: room for all of it.
            let snapshot = (u64::from(record.sandbox.memory_mib) << 20) + crate::disk::SNAPSHOT_OVERHEAD_BYTES;
            self.check_reserve("suspend a sandbox", snapshot)?;
            self.check_disk_quota(&record.tenant, snapshot, "suspend a sandbox (its snapshot holds its memory)")?;
        }
        if event == Event::RestoreRequested {
            self.admit(record.sandbox.memory_mib)?;
        }
        self.store.put_operation(&operation, &record.tenant, idempotency_key)?;
        self.changed();
        self.queue_job(id, Job { kind, operation_id: operation.id.clone(), warm: None, origin });
        Ok((record.sandbox, operation))
    }

    /// Hands `job` to the sandbox's actor, starting one if none lives.
    pub(crate) fn queue_job(self: &Arc<Self>, id: &str, job: Job) {
        let live = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned();
        let unsent = match live {
            Some(live) => live.jobs.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            self.spawn_actor(id, Some(job), None);
        }
    }

    pub(crate) fn spawn_actor(self: &Arc<Self>, id: &str, first: Option<Job>, agent: Option<AgentConn>) {
        let (jobs, queue) = mpsc::unbounded_channel();
        if let Some(first) = first {
            let _ = jobs.send(first);
        }
        if let Some(agent) = &agent {
            // Re-adopted after a restart: its egress is served again.
            self.start_egress(id, agent);
        }
        let live = Arc::new(LiveSandbox { agent: Mutex::new(agent), jobs, work: Arc::default() });
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), live.clone());
        let actor = crate::actor::Actor { platform: self.clone(), id: id.to_string(), live };
        tokio::spawn(actor.run(queue));
    }

    /// Applies `event` to a sandbox and persists it. Only actors (and
    /// startup reconciliation) call this.
    pub(crate) fn apply(&self, id: &str, event: Event, reason: Option<String>) -> Result<Sandbox, ApiError> {
        self.apply_with(id, event, reason, |_| {})
    }

    /// [`Platform::apply`], also changing the record in the same write.
    pub(crate) fn apply_with(
        &self,
        id: &str,
        event: Event,
        reason: Option<String>,
        edit: impl FnOnce(&mut SandboxRecord),
    ) -> Result<Sandbox, ApiError> {
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
        self.store.put_sandbox(&record)?;
        self.changed();
        Ok(record.sandbox)
    }

    /// For `?auto_resume=true`: resumes a paused or suspended sandbox and
    /// waits until it runs (anything else is left to the usual checks).
    pub async fn resume_for_work(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let state = self.sandbox(id)?.sandbox.state;
        if !matches!(state, SandboxState::Paused | SandboxState::Suspended) {
            return Ok(());
        }
        let (_, operation) = self.request(id, OperationKind::Resume, None)?;
        let deadline = Some(Instant::now() + Duration::from_secs(60));
        let operation = self.wait_for(deadline, || self.operation(&operation.id), |op| op.state.is_terminal()).await?;
        match (operation.state, operation.error) {
            (OperationState::Succeeded, _) => Ok(()),
            (_, Some(error)) => Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "invalid_state",
                format!("resuming the sandbox failed: {}", error.message),
            )),
            (_, None) => Err(ApiError::invalid_state("sandbox", state.as_str(), "resume it in time")),
        }
    }

    pub fn operation(&self, id: &str) -> Result<Operation, ApiError> {
        if !ids::plausible(id, "op") {
            return Err(ApiError::not_found("operation", id));
        }
        self.store.operation(id)?.ok_or_else(|| ApiError::not_found("operation", id))
    }

    /// Changes an operation and stores it; the operation as stored.
    fn update_operation(&self, id: &str, change: impl FnOnce(&mut Operation)) -> Option<Operation> {
        let result = self.operation(id).and_then(|mut operation| {
            change(&mut operation);
            self.store.put_operation(&operation, "", None)?;
            Ok(operation)
        });
        self.changed();
        result.map_err(|err| tracing::error!(operation = id, "updating an operation: {}", err.message)).ok()
    }

    pub(crate) fn progress(&self, id: &str, step: &str, done: u64) {
        self.progress_with(id, step, done, None);
    }

    /// A build's progress, with its measured amount when there is one.
    pub(crate) fn build_progress(&self, id: &str, progress: &space_host::template::BuildProgress) {
        let amount = progress.amount.as_ref().map(|a| space_api::ProgressAmount {
            unit: a.unit.into(),
            done: a.done,
            total: a.total,
        });
        self.progress_with(id, &progress.step, progress.done, amount);
    }

    fn progress_with(&self, id: &str, step: &str, done: u64, amount: Option<space_api::ProgressAmount>) {
        self.update_operation(id, |op| {
            if op.state == OperationState::Pending {
                op.state = OperationState::Running;
                op.started_at = Some(ids::now());
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
            op.state = OperationState::Cancelled;
            op.started_at.get_or_insert_with(ids::now);
            op.finished_at = Some(ids::now());
            op.progress.step = why.to_string();
        });
    }

    pub(crate) fn finish_operation(&self, id: &str, error: Option<ApiError>) {
        let finished = self.update_operation(id, |op| {
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
            let engine = operation.sandbox_id.as_deref().and_then(|s| self.store.sandbox(s).ok().flatten());
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
    pub(crate) fn engine_for(&self, template: &space_host::template::TemplateInfo) -> Result<String, ApiError> {
        let Some(wanted) = template.meta.engine.as_deref().filter(|w| *w != self.engine.name()) else {
            return Ok(self.engine.name().to_string());
        };
        let report = self.engine_report.get().cloned().unwrap_or_default();
        match report.iter().find(|a| a.name == wanted) {
            Some(engine) if engine.available => Ok(wanted.to_string()),
            found => Err(ApiError::unavailable(format!(
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
        }
    }
}

pub(crate) fn new_operation(kind: OperationKind, sandbox_id: &str, step: &str, total: u64) -> Operation {
    Operation {
        id: ids::new_id("op"),
        kind,
        sandbox_id: Some(sandbox_id.to_string()),
        template: None,
        state: OperationState::Pending,
        progress: Progress { step: step.into(), done: 0, total, amount: None },
        error: None,
        origin: OperationOrigin::Client,
        created_at: ids::now(),
        started_at: None,
        finished_at: None,
    }
}
