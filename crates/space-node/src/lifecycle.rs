//! Accepting lifecycle requests: a create, pause, resume, suspend or
//! delete is checked (state, quotas, capacity, disk), recorded with its
//! operation, and handed to the sandbox's actor (`actor.rs`), which alone
//! carries it out. This is the node side of the seam the control plane
//! calls (see `docs/ARCHITECTURE.md`): the `/v1` handlers, idle pauses,
//! lifecycle policies and recovery all come through here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use space_api::{
    ErrorCode, Operation, OperationKind, OperationOrigin, OperationState, Progress, Sandbox, SandboxState,
};
use space_host::template::TemplateInfo;
use tokio::sync::OwnedRwLockReadGuard;

use crate::domain::{self, CreateSpec, Event};
use crate::error::NodeError;
use crate::failures::TemplateSaveError;
use crate::ids;
use crate::job::Job;
use crate::platform::{new_operation, Platform};
use crate::store::{Quotas, SandboxRecord};
use crate::tenants;
use crate::warm::{self, WarmError, WarmHost, WarmPools};

/// Held by a request while it uses a sandbox: no idle pause meanwhile.
pub struct WorkGuard {
    _gate: Option<OwnedRwLockReadGuard<()>>,
    /// The sandbox's state, read under the gate.
    pub state: SandboxState,
}

/// 422 unless `engine` gives a sandbox the disk asked for: a microVM's disk
/// is its template's image, which it can grow but not shrink, and one woken
/// from a snapshot keeps the image's size (gVisor's is a quota: any size).
/// Without this the API, and the tenant's disk quota, would count a size
/// the sandbox does not have.
fn disk_the_engine_gives(engine: &str, snapshot: bool, asked_mib: u32, template_mib: u32) -> Result<(), NodeError> {
    if engine != "firecracker" || asked_mib == template_mib || (!snapshot && asked_mib > template_mib) {
        return Ok(());
    }
    let why = match snapshot {
        true => format!("on firecracker a snapshot template's sandboxes have its disk of {template_mib} MiB"),
        false => format!("on firecracker a sandbox's disk can only grow over its template's {template_mib} MiB"),
    };
    Err(NodeError::unprocessable(why).with_details(serde_json::json!({"field": "disk_mib"})))
}

impl Platform {
    /// Accepts a create: records the sandbox and its operation, then hands
    /// the work to a new actor.
    pub fn create_sandbox(
        self: &Arc<Self>,
        mut spec: CreateSpec,
        template: &space_host::template::TemplateInfo,
        tenant: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(Sandbox, Operation), NodeError> {
        let now = ids::now();
        // The request's network, else the template's, else the tenant's.
        let mut network = match spec.network.take() {
            Some(network) => network,
            None => self.store.tenancy().tenant_quotas(tenant)?.network.unwrap_or_default(),
        };
        // The sandbox holds placeholders; its secrets stay on the host.
        let placeholders = self.bind_secrets(tenant, &mut network, None)?;
        self.check_egress_ceiling(tenant, &network)?;
        spec.env.extend(placeholders);
        let template_version = template.meta.version;
        let engine = self.engine_for(template)?;
        let defaults = &template.meta.defaults;
        if template.meta.image.is_some() && (spec.vcpus, spec.memory_mib) != (defaults.vcpus, defaults.memory_mib) {
            return Err(NodeError::unprocessable(format!(
                "template {:?} is a snapshot: its sandboxes have {} vCPUs and {} MiB of memory",
                template.meta.name, defaults.vcpus, defaults.memory_mib
            )));
        }
        disk_the_engine_gives(&engine, template.meta.image.is_some(), spec.disk_mib, defaults.disk_mib)?;
        let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        // Held until the record is written: no second writer gets in between.
        let volume_ids = self.resolve_mounts(tenant, &spec.volumes)?;
        let quotas = self.store.tenancy().tenant_quotas(tenant)?;
        tenants::check_quotas(&self.store, tenant, &quotas, (spec.vcpus, spec.memory_mib), 1)?;
        // On a node, the control plane may have told a disk quota.
        let told = self.told_disk_quotas.lock().unwrap_or_else(|e| e.into_inner()).contains_key(tenant);
        if quotas != Quotas::default() || told {
            let disk = u64::from(spec.disk_mib) << 20;
            self.check_disk_quota(tenant, disk, &format!("create a sandbox with {} MiB of disk", spec.disk_mib))?;
        }
        self.check_reserve("create a sandbox", 0)?;
        let mut warm = warm::take(self, &spec, template);
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
            created_at: now,
            updated_at: now,
            lifecycle: spec.lifecycle,
            network,
            last_activity_at: now,
            auto_paused: false,
            failure_reason: None,
            forked_from: None,
            node: self.node_id.get().cloned(),
            volumes: spec.volumes,
        };
        let operation = new_operation(OperationKind::Create, &sandbox.id, "queued", 3);
        self.metrics.create_started(&operation.id, warm.as_ref().map(|m| if m.is_hot() { "hot" } else { "warm" }));
        let recorded = (|| {
            let egress_ca = match warm.as_mut().and_then(|m| m.egress_ca.take()) {
                Some(made) => made,
                None => self.new_egress_ca(&sandbox.id)?,
            };
            let record = SandboxRecord {
                sandbox: sandbox.clone(),
                template_version,
                env: spec.env,
                agent_session: None,
                channel_key: None,
                tenant: tenant.to_string(),
                egress_ca: Some(egress_ca),
                volume_ids,
            };
            self.store.node().put_sandbox(&record)?;
            self.store.node().put_operation(&operation, tenant, idempotency_key)?;
            Ok::<_, NodeError>(())
        })();
        if let Err(err) = recorded {
            // Nobody would ever destroy a member taken for nothing.
            if let Some(member) = warm {
                self.warm.discard(member);
            }
            return Err(err);
        }
        self.changed();
        self.spawn_actor(&sandbox.id, Some(Job::create(&operation, warm)), None);
        Ok((sandbox, operation))
    }

    /// Accepts a fork of a running (or paused) sandbox: records `count`
    /// new sandboxes, each with the source's shape, template, env, network
    /// and lifecycle (labels over the source's), and one operation, then
    /// hands the work to the source's actor. Quotas, capacity and disk
    /// apply to every fork; the image the forks start from counts too.
    pub fn fork_sandbox(
        self: &Arc<Self>,
        sandbox: &crate::access::OwnedSandbox,
        count: u32,
        labels: std::collections::BTreeMap<String, String>,
        idempotency_key: Option<&str>,
    ) -> Result<(Vec<Sandbox>, Operation), NodeError> {
        let id = sandbox.id();
        if count == 0 || count > space_api::MAX_FORKS {
            return Err(NodeError::unprocessable(format!("count must be 1 to {}", space_api::MAX_FORKS)));
        }
        let source = self.sandbox(id)?;
        let state = source.sandbox.state;
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Err(NodeError::invalid_state("sandbox", state.as_str(), "fork it (resume it first)"));
        }
        self.can_save_images(&source)?;
        self.refuse_copy_with_writer(&source)?;
        let mut labels_all = source.sandbox.labels.clone();
        labels_all.extend(labels);
        crate::domain::check_labels(&labels_all)?;
        let tenant = source.tenant.clone();
        let (vcpus, memory_mib, disk_mib) = (source.sandbox.vcpus, source.sandbox.memory_mib, source.sandbox.disk_mib);
        let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        let quotas = self.store.tenancy().tenant_quotas(&tenant)?;
        tenants::check_quotas(&self.store, &tenant, &quotas, (vcpus, memory_mib), count)?;
        // Each fork's root, and the image of the source's memory.
        let disk = ((u64::from(count) * u64::from(disk_mib)) << 20)
            + (u64::from(memory_mib) << 20)
            + crate::state::disk::SNAPSHOT_OVERHEAD_BYTES;
        self.check_reserve("fork a sandbox", disk)?;
        self.check_disk_quota(&tenant, disk, &format!("fork a sandbox {count} time(s)"))?;
        self.admit(memory_mib.saturating_mul(count))?;
        let now = ids::now();
        let mut forks = Vec::new();
        for _ in 0..count {
            let fork_id = ids::new_id("sbx");
            let sandbox = Sandbox {
                id: fork_id.clone(),
                state: SandboxState::Creating,
                labels: labels_all.clone(),
                created_at: now,
                updated_at: now,
                last_activity_at: now,
                auto_paused: false,
                failure_reason: None,
                forked_from: Some(id.to_string()),
                ..source.sandbox.clone()
            };
            forks.push(SandboxRecord { sandbox, egress_ca: Some(self.new_egress_ca(&fork_id)?), ..source.clone() });
        }
        let mut operation = new_operation(OperationKind::Fork, id, "queued", 3 + u64::from(count));
        operation.forks = forks.iter().map(|f| f.sandbox.id.clone()).collect();
        for fork in &forks {
            self.store.node().put_sandbox(fork)?;
        }
        self.store.node().put_operation(&operation, &tenant, idempotency_key)?;
        self.changed();
        self.queue_job(id, Job::new(&operation));
        Ok((forks.into_iter().map(|f| f.sandbox).collect(), operation))
    }

    /// Accepts a lifecycle request (pause, resume, delete) after checking it
    /// is valid in the sandbox's current state (409 otherwise), and hands it
    /// to the sandbox's actor. Deleting a deleted sandbox succeeds at once.
    pub fn request(
        self: &Arc<Self>,
        sandbox: &crate::access::OwnedSandbox,
        kind: OperationKind,
        idempotency_key: Option<&str>,
    ) -> Result<(Sandbox, Operation), NodeError> {
        self.request_job(sandbox.id(), kind, idempotency_key, OperationOrigin::Client)
    }

    /// [`Platform::request`] for whoever asks: a client, a lifecycle policy,
    /// or the server pausing an idle sandbox (`OperationOrigin::Idle`).
    pub(crate) fn request_job(
        self: &Arc<Self>,
        id: &str,
        kind: OperationKind,
        idempotency_key: Option<&str>,
        origin: OperationOrigin,
    ) -> Result<(Sandbox, Operation), NodeError> {
        let record = self.sandbox(id)?;
        let (event, total) = match kind {
            OperationKind::Delete => (Event::DeleteRequested, 2),
            OperationKind::Pause => (Event::Froze, 1),
            OperationKind::Resume if record.sandbox.state == SandboxState::Suspended => (Event::RestoreRequested, 2),
            OperationKind::Resume => (Event::Thawed, 1),
            OperationKind::Suspend => (Event::SuspendRequested, 3),
            OperationKind::Create
            | OperationKind::BuildTemplate
            | OperationKind::Fork
            | OperationKind::Checkpoint
            | OperationKind::RestoreCheckpoint => {
                return Err(NodeError::unprocessable(format!("{kind:?} is not a request on an existing sandbox")));
            }
        };
        let mut operation = new_operation(kind, id, "queued", total);
        operation.origin = origin;
        if kind == OperationKind::Delete && record.sandbox.state == SandboxState::Deleted {
            let now = ids::now();
            operation.state = OperationState::Succeeded;
            operation.progress = Progress::new("already deleted", total, total);
            operation.started_at = Some(now);
            operation.finished_at = Some(now);
            self.store.node().put_operation(&operation, &record.tenant, idempotency_key)?;
            self.changed();
            return Ok((record.sandbox, operation));
        }
        domain::transition(record.sandbox.state, event)?;
        if event == Event::SuspendRequested {
            // The snapshot holds the sandbox's memory: room for all of it.
            let snapshot = (u64::from(record.sandbox.memory_mib) << 20) + crate::state::disk::SNAPSHOT_OVERHEAD_BYTES;
            self.check_reserve("suspend a sandbox", snapshot)?;
            self.check_disk_quota(&record.tenant, snapshot, "suspend a sandbox (its snapshot holds its memory)")?;
        }
        if event == Event::RestoreRequested {
            self.admit(record.sandbox.memory_mib)?;
        }
        self.store.node().put_operation(&operation, &record.tenant, idempotency_key)?;
        self.changed();
        self.queue_job(id, Job::new(&operation));
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

    /// For `?auto_resume=true`: resumes a paused or suspended sandbox and
    /// waits until it runs (anything else is left to the usual checks).
    pub async fn resume_for_work(self: &Arc<Self>, sandbox: &crate::access::OwnedSandbox) -> Result<(), NodeError> {
        self.resume_to_work(sandbox.id()).await
    }

    async fn resume_to_work(self: &Arc<Self>, id: &str) -> Result<(), NodeError> {
        let state = self.sandbox(id)?.sandbox.state;
        if !matches!(state, SandboxState::Paused | SandboxState::Suspended) {
            return Ok(());
        }
        let (_, operation) = self.request_job(id, OperationKind::Resume, None, OperationOrigin::Client)?;
        let deadline = Some(Instant::now() + Duration::from_secs(60));
        let operation = self.wait_for(deadline, || self.operation(&operation.id), |op| op.state.is_terminal()).await?;
        match (operation.state, operation.error) {
            (OperationState::Succeeded, _) => Ok(()),
            (_, Some(error)) => {
                Err(NodeError::new(ErrorCode::InvalidState, format!("resuming the sandbox failed: {}", error.message)))
            }
            (_, None) => Err(NodeError::invalid_state("sandbox", state.as_str(), "resume it in time")),
        }
    }

    /// Before a request uses a sandbox (a command, a file): holds its work
    /// gate, and resumes it first if the server paused it for idleness.
    pub(crate) async fn begin_work(self: &Arc<Self>, id: &str) -> Result<WorkGuard, NodeError> {
        for _ in 0..3 {
            let live = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned();
            let guard = match live {
                Some(live) => Some(live.work.clone().read_owned().await),
                None => None,
            };
            // Read under the gate: an idle pause cannot be half done now.
            let record = self.sandbox(id)?;
            if !(record.sandbox.state == SandboxState::Paused && record.sandbox.auto_paused) {
                self.wake_up(id);
                return Ok(WorkGuard { _gate: guard, state: record.sandbox.state });
            }
            drop(guard);
            self.resume_to_work(id).await?;
        }
        let state = self.sandbox(id)?.sandbox.state;
        Err(NodeError::invalid_state("sandbox", state.as_str(), "wake it for this request"))
    }

    /// 409 `not_supported` unless the sandbox's engine saves images.
    pub(crate) fn can_save_images(&self, record: &crate::store::SandboxRecord) -> Result<(), NodeError> {
        if self.engine.saves_images(&self.engine_spec(record)) {
            return Ok(());
        }
        Err(NodeError::new(
            ErrorCode::NotSupported,
            format!("sandboxes on {} cannot be forked or checkpointed yet", record.sandbox.engine),
        ))
    }

    /// Has the sandbox's actor save its image into `dir` for a snapshot
    /// template's build (operation `operation_id`), and waits until it has.
    pub(crate) async fn save_image_of(
        self: &Arc<Self>,
        id: &str,
        operation_id: &str,
        dir: &std::path::Path,
    ) -> Result<(), TemplateSaveError> {
        let operation = self.operation(operation_id).map_err(TemplateSaveError::Record)?;
        let (reply, done) = tokio::sync::oneshot::channel();
        self.queue_job(id, Job::save_image(&operation, dir.to_path_buf(), reply));
        done.await.map_err(|_| TemplateSaveError::Gone)?
    }

    /// Fills every template's warm pool (at start, and as room frees).
    pub(crate) fn fill_warm_pools(self: &Arc<Self>) {
        for template in self.data.templates() {
            warm::refill(self, template);
        }
    }
}

impl WarmHost for Platform {
    async fn boot(
        &self,
        spec: &space_engine::SandboxSpec,
    ) -> Result<space_engine::AgentConn, space_engine::EngineError> {
        Platform::boot(self, spec).await.map(|(agent, _)| agent)
    }

    fn warm(&self) -> &WarmPools {
        &self.warm
    }

    fn sandbox_dir(&self, id: &str) -> std::path::PathBuf {
        self.data.sandbox_dir(id)
    }

    fn new_egress_ca(&self, id: &str) -> Result<crate::store::EgressCa, WarmError> {
        Platform::new_egress_ca(self, id).map_err(WarmError::EgressCa)
    }

    fn runs(&self, template: &TemplateInfo) -> bool {
        self.engine_for(template).is_ok()
    }

    fn no_room_for(&self, template: &TemplateInfo) -> Option<String> {
        if self.free_above_reserve() == 0 {
            return Some("the host is low on disk".into());
        }
        self.admit(template.meta.defaults.memory_mib).err().map(|_| "the host is at its capacity".into())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_microvm_disk_is_never_smaller_than_its_image() {
        use super::disk_the_engine_gives as gives;
        assert!(gives("gvisor", false, 512, 2048).is_ok() && gives("gvisor", true, 512, 2048).is_ok());
        assert!(gives("firecracker", false, 4096, 2048).is_ok() && gives("firecracker", false, 2048, 2048).is_ok());
        assert_eq!(gives("firecracker", false, 1024, 2048).unwrap_err().code.http_status(), 422);
        assert!(gives("firecracker", true, 4096, 2048).unwrap_err().message.contains("snapshot"));
        assert!(gives("firecracker", true, 2048, 2048).is_ok());
    }
}
