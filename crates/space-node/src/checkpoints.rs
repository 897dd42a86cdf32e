//! Checkpoints: a sandbox's memory, processes and disk saved at one
//! instant without stopping it (the engine's image, as for a fork), kept in
//! `sandboxes/<id>/checkpoints/<name>/` (the engine's) until deleted with
//! their sandbox; restoring one rolls the sandbox back. Saving and restoring
//! are operations its actor carries out (`actor.rs`); a checkpoint is listed
//! once its record, `state/sandboxes/<id>/checkpoints/<name>.json` (the
//! server's), is written, after its image is whole.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use space_api::{Checkpoint, Command, ErrorCode, Operation, OperationKind, Sandbox, SandboxState, MAX_CHECKPOINTS};

use space_host::datadir::DataDir;

use crate::domain::{self, Event};
use crate::error::NodeError;
use crate::job::Job;
use crate::platform::{new_operation, Platform};

/// What a checkpoint keeps besides its image.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct CheckpointMeta {
    pub name: String,
    pub created_at: space_api::Timestamp,
    /// The host session its agent knew (it carries on with it).
    pub agent_session: Option<u64>,
    /// The commands running when it was saved: their streams, to take
    /// over after a restore.
    pub running: Vec<RunningCommand>,
}

/// A command running at an instant, with what following it again needs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RunningCommand {
    pub command: Command,
    pub stream: u32,
    pub timeout_s: u64,
}

/// Where checkpoint `name` of a sandbox lives: its image (the engine's)
/// and its record (the server's, written once the image is whole).
#[derive(Debug, Clone)]
pub struct CheckpointAt {
    pub image: PathBuf,
    record: PathBuf,
}

impl CheckpointAt {
    /// Checkpoint `name` of sandbox `id`; `name` must be a valid one
    /// (one path segment).
    pub fn new(data: &DataDir, id: &str, name: &str) -> CheckpointAt {
        CheckpointAt {
            image: data.sandbox_dir(id).join("checkpoints").join(name),
            record: records_dir(data, id).join(format!("{name}.json")),
        }
    }

    /// The checkpoint's record, if it is whole.
    pub(crate) fn meta(&self) -> Option<CheckpointMeta> {
        read_meta(&self.record)
    }

    /// Whether the checkpoint is whole.
    pub fn is_whole(&self) -> bool {
        self.meta().is_some()
    }

    /// Records a whole checkpoint (written last, atomically).
    pub(crate) fn write_meta(&self, meta: &CheckpointMeta) -> std::io::Result<()> {
        let dir = self.record.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let partial = self.record.with_extension("json.new");
        std::fs::write(&partial, serde_json::to_vec_pretty(meta).map_err(std::io::Error::other)?)?;
        std::fs::rename(partial, &self.record)
    }

    /// Forgets the record: the checkpoint is no longer whole.
    pub(crate) fn forget(&self) -> std::io::Result<()> {
        match std::fs::remove_file(&self.record) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        }
    }
}

/// Where a sandbox's checkpoints' records are.
fn records_dir(data: &DataDir, id: &str) -> PathBuf {
    data.sandbox_state_dir(id).join("checkpoints")
}

fn read_meta(record: &Path) -> Option<CheckpointMeta> {
    let text = std::fs::read_to_string(record).ok()?;
    serde_json::from_str(&text).ok()
}

/// Bytes an image holds on the host: its memory files and what of its disk
/// no one else shares.
pub(crate) fn image_bytes(dir: &Path) -> u64 {
    let disk = space_host::btrfs::exclusive_bytes(&dir.join("rootfs")).unwrap_or(0);
    let memory = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name() != "rootfs")
        .map(|e| crate::state::disk::tree_bytes(&e.path()))
        .sum::<u64>();
    disk + memory
}

/// 404 for a checkpoint that is not there (or not whole).
pub fn checkpoint_not_found(id: &str, name: &str) -> NodeError {
    NodeError::new(ErrorCode::CheckpointNotFound, format!("sandbox {id} has no checkpoint {name:?}"))
        .with_details(serde_json::json!({"kind": "checkpoint", "id": name}))
}

impl Platform {
    /// A sandbox's whole checkpoints, oldest first.
    pub fn checkpoints(&self, sandbox: &crate::access::OwnedSandbox) -> Result<Vec<Checkpoint>, NodeError> {
        self.held_checkpoints(sandbox.id())
    }

    fn held_checkpoints(&self, id: &str) -> Result<Vec<Checkpoint>, NodeError> {
        self.sandbox(id)?;
        let mut found: Vec<Checkpoint> = std::fs::read_dir(records_dir(&self.data, id))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let name = name.strip_suffix(".json").filter(|name| space_host::template::valid_name(name))?;
                let meta = read_meta(&entry.path())?;
                Some(Checkpoint {
                    sandbox_id: id.to_string(),
                    size_bytes: image_bytes(&CheckpointAt::new(&self.data, id, name).image),
                    commands: meta.running.iter().map(|r| r.command.id.clone()).collect(),
                    created_at: meta.created_at,
                    name: meta.name,
                })
            })
            .collect();
        found.sort_by_key(|x| x.created_at);
        Ok(found)
    }

    /// A checkpoint save or restore of `name` not yet finished.
    fn checkpoint_busy(&self, id: &str, name: &str) -> Result<bool, NodeError> {
        Ok(self.store.node().operations(Some(id))?.iter().any(|op| {
            matches!(op.kind, OperationKind::Checkpoint | OperationKind::RestoreCheckpoint)
                && op.checkpoint.as_deref() == Some(name)
                && !op.state.is_terminal()
        }))
    }

    /// Accepts saving checkpoint `name` of a running (or paused) sandbox.
    pub fn checkpoint_sandbox(
        self: &Arc<Self>,
        sandbox: &crate::access::OwnedSandbox,
        name: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(Sandbox, Operation), NodeError> {
        let id = sandbox.id();
        if !space_host::template::valid_name(name) {
            return Err(NodeError::unprocessable("a checkpoint name is 1-63 of a-z, 0-9, '-' and '_'")
                .with_details(serde_json::json!({"field": "name"})));
        }
        let record = self.sandbox(id)?;
        let state = record.sandbox.state;
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Err(NodeError::invalid_state("sandbox", state.as_str(), "save a checkpoint"));
        }
        self.can_save_images(&record)?;
        let held = self.held_checkpoints(id)?;
        if held.iter().any(|c| c.name == name) || self.checkpoint_busy(id, name)? {
            return Err(NodeError::new(
                ErrorCode::CheckpointExists,
                format!("sandbox {id} already has a checkpoint {name:?}; delete it first"),
            ));
        }
        if held.len() >= MAX_CHECKPOINTS {
            return Err(NodeError::unprocessable(format!(
                "a sandbox keeps at most {MAX_CHECKPOINTS} checkpoints; delete one first"
            )));
        }
        let image = (u64::from(record.sandbox.memory_mib) << 20) + crate::state::disk::SNAPSHOT_OVERHEAD_BYTES;
        self.check_reserve("save a checkpoint", image)?;
        self.check_disk_quota(&record.tenant, image, "save a checkpoint (it holds the sandbox's memory)")?;
        let mut operation = new_operation(OperationKind::Checkpoint, id, "queued", 3);
        operation.checkpoint = Some(name.to_string());
        self.store.node().put_operation(&operation, &record.tenant, idempotency_key)?;
        self.changed();
        self.queue_job(id, Job::new(&operation));
        Ok((record.sandbox, operation))
    }

    /// Accepts rolling a sandbox (running, paused or suspended) back to
    /// checkpoint `name`: it keeps its id and runs from the checkpoint.
    pub fn restore_checkpoint(
        self: &Arc<Self>,
        sandbox: &crate::access::OwnedSandbox,
        name: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(Sandbox, Operation), NodeError> {
        let id = sandbox.id();
        let record = self.sandbox(id)?;
        // A name is one path segment of ours: `..` or `/` in it would read
        // another directory of the host as a checkpoint.
        if !space_host::template::valid_name(name) || !CheckpointAt::new(&self.data, id, name).is_whole() {
            return Err(checkpoint_not_found(id, name));
        }
        domain::transition(record.sandbox.state, Event::RewindRequested)?;
        if record.sandbox.state == SandboxState::Suspended {
            self.admit(record.sandbox.memory_mib)?;
        }
        let mut operation = new_operation(OperationKind::RestoreCheckpoint, id, "queued", 3);
        operation.checkpoint = Some(name.to_string());
        self.store.node().put_operation(&operation, &record.tenant, idempotency_key)?;
        self.changed();
        self.queue_job(id, Job::new(&operation));
        Ok((record.sandbox, operation))
    }

    /// Deletes checkpoint `name` (409 while it is being saved or restored).
    pub async fn delete_checkpoint(&self, sandbox: &crate::access::OwnedSandbox, name: &str) -> Result<(), NodeError> {
        let id = sandbox.id();
        let record = self.sandbox(id)?;
        if !space_host::template::valid_name(name) || !CheckpointAt::new(&self.data, id, name).is_whole() {
            return Err(checkpoint_not_found(id, name));
        }
        let at = CheckpointAt::new(&self.data, id, name);
        if self.checkpoint_busy(id, name)? {
            return Err(NodeError::new(
                ErrorCode::CheckpointInUse,
                format!("checkpoint {name:?} is being saved or restored"),
            ));
        }
        // Not whole from here on: a crash midway leaves an image the
        // sandbox's delete removes, never a checkpoint without one.
        at.forget().map_err(|e| NodeError::internal("deleting a checkpoint", e))?;
        self.engine
            .drop_image(&self.engine_spec(&record), &at.image)
            .await
            .map_err(|e| NodeError::internal("deleting a checkpoint", e))?;
        self.changed();
        Ok(())
    }
}
