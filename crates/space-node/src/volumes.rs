//! Volumes (issue 37, decision 031): a tenant's storage that outlives its
//! sandboxes. A volume is a btrfs subvolume under a size limit that the
//! volume host (this process as root, or the root helper) makes, snapshots
//! and removes; its record is the node's (`store::VolumeRecord`). Sandboxes
//! mount volumes at create: any number read-only, one read-write at a time
//! (checked under the admission lock, with the record written in the same
//! hold). The files routes reach a volume through a confined child that
//! serves the agent's file protocol with the volume as its root.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_api::cluster::{HandedSnapshot, HandedVolume};
use space_api::{
    CreateVolumeRequest, ErrorCode, SandboxState, SnapshotRef, Volume, VolumeHolder, VolumeMount, VolumeSnapshot,
};
use space_engine::volumes::{DiskMib, SnapshotName, VolumeHost, VolumeId};
use space_engine::AgentConn;

use crate::error::NodeError;
use crate::ids;
use crate::platform::Platform;
use crate::store::{SandboxRecord, SnapshotRecord, VolumeRecord};

/// A volume's size when the request names none.
pub const DEFAULT_VOLUME_MIB: u32 = 1024;
/// The smallest and largest size a volume may have.
pub const MIN_VOLUME_MIB: u32 = 16;
pub const MAX_VOLUME_MIB: u32 = 1 << 20;
/// Volumes one tenant may keep on a node, and snapshots one volume.
pub const MAX_VOLUMES: usize = 256;
pub const MAX_SNAPSHOTS: usize = 64;
/// How long the files child may take to say hello.
const FILES_PATIENCE: Duration = Duration::from_secs(10);

/// Volumes busy with work that excludes a writer (a restore, a write
/// through the files routes), with how many hold each.
#[derive(Debug, Default)]
pub(crate) struct BusyVolumes(Mutex<std::collections::HashMap<String, (usize, &'static str)>>);

/// Marks a volume busy while it lives.
pub(crate) struct BusyGuard {
    platform: Arc<Platform>,
    volume: String,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        let mut busy = self.platform.busy_volumes.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((count, _)) = busy.get_mut(&self.volume) {
            *count -= 1;
            if *count == 0 {
                busy.remove(&self.volume);
            }
        }
    }
}

/// A connection to a volume's files child: the agent's file protocol, with
/// the volume as the root. Dropping it ends the child.
pub struct VolumeFiles {
    agent: AgentConn,
    socket: std::os::unix::net::UnixStream,
    _busy: Option<BusyGuard>,
}

impl VolumeFiles {
    pub fn agent(&self) -> &AgentConn {
        &self.agent
    }
}

impl Drop for VolumeFiles {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// 422 unless `name` is a volume's or a snapshot's name.
fn checked_name(name: &str, what: &str, field: &str) -> Result<(), NodeError> {
    if space_host::template::valid_name(name) {
        return Ok(());
    }
    Err(NodeError::unprocessable(format!(
        "{what} {name:?}: 1-63 of a-z, 0-9, '-' and '_', starting with a letter or digit"
    ))
    .with_details(serde_json::json!({"field": field})))
}

fn volume_not_found(name: &str) -> NodeError {
    NodeError::new(ErrorCode::VolumeNotFound, format!("no volume named {name:?}"))
        .with_details(serde_json::json!({"kind": "volume", "id": name}))
}

fn snapshot_not_found(volume: &str, snapshot: &str) -> NodeError {
    NodeError::new(ErrorCode::SnapshotNotFound, format!("volume {volume:?} has no snapshot named {snapshot:?}"))
        .with_details(serde_json::json!({"kind": "volume_snapshot", "id": snapshot}))
}

fn in_use(volume: &str, holder: &SandboxRecord, why: &str) -> NodeError {
    NodeError::new(
        ErrorCode::VolumeInUse,
        format!(
            "volume {volume:?} is mounted by sandbox {} ({}): {why}",
            holder.sandbox.id,
            holder.sandbox.state.as_str()
        ),
    )
    .with_details(serde_json::json!({"volume": volume, "sandbox_id": holder.sandbox.id}))
}

/// A recorded volume's id as the volume host takes it (ours, so a bad one
/// is a fault of the server's).
fn volume_id(id: &str) -> Result<VolumeId, NodeError> {
    VolumeId::parse(id).map_err(|e| NodeError::internal("a volume's record", e))
}

fn host_failed(what: &str) -> impl FnOnce(space_engine::EngineError) -> NodeError + '_ {
    move |err| NodeError::internal(what, err)
}

/// Whether a sandbox in this state holds its mounts: everything but the
/// ends (a failed sandbox's root may still be there, but it runs nothing).
fn holds_mounts(state: SandboxState) -> bool {
    !matches!(state, SandboxState::Deleted | SandboxState::Failed)
}

/// The mount rule in one place for the API's answer: an absolute, normal
/// path, not `/` and not where the platform mounts its own.
pub fn check_mount_path(path: &str) -> Result<(), String> {
    match space_engine::privsep::proto::MountPath::parse(path) {
        Ok(_) => Ok(()),
        Err(space_engine::privsep::proto::ProtoError::Invalid(why)) => Err(why),
        Err(other) => Err(other.to_string()),
    }
}

impl Platform {
    /// Who does volumes' root work: this process, or the root helper (set
    /// at start).
    pub(crate) fn volume_host(&self) -> Result<Arc<dyn VolumeHost>, NodeError> {
        self.volume_host.get().cloned().ok_or_else(|| NodeError::unavailable("this server keeps no volumes"))
    }

    /// Runs a blocking request of the volume host off the async workers.
    async fn on_volume_host<T: Send + 'static>(
        &self,
        what: &'static str,
        work: impl FnOnce(&dyn VolumeHost) -> Result<T, space_engine::EngineError> + Send + 'static,
    ) -> Result<T, NodeError> {
        let host = self.volume_host()?;
        tokio::task::spawn_blocking(move || work(host.as_ref()))
            .await
            .map_err(|e| NodeError::internal(what, e))?
            .map_err(host_failed(what))
    }

    /// The caller's volume of that name (404 `volume_not_found` otherwise,
    /// another tenant's included).
    pub fn volume_record(&self, tenant: &str, name: &str) -> Result<VolumeRecord, NodeError> {
        if !space_host::template::valid_name(name) {
            return Err(volume_not_found(name));
        }
        self.store.node().volume_named(tenant, name)?.ok_or_else(|| volume_not_found(name))
    }

    /// The live sandboxes that mount volume `id`, with each mount.
    fn holders(&self, id: &str) -> Result<Vec<(SandboxRecord, VolumeMount)>, NodeError> {
        let mut holders = Vec::new();
        for record in self.store.node().live_sandboxes()? {
            if !holds_mounts(record.sandbox.state) {
                continue;
            }
            let mounts: Vec<VolumeMount> = record
                .volume_ids
                .iter()
                .zip(&record.sandbox.volumes)
                .filter(|(volume, _)| volume.as_str() == id)
                .map(|(_, mount)| mount.clone())
                .collect();
            for mount in mounts {
                holders.push((record.clone(), mount));
            }
        }
        Ok(holders)
    }

    /// A volume as the API shows it: usage from its host, holders from the
    /// sandboxes' records.
    async fn volume_object(&self, record: VolumeRecord) -> Result<Volume, NodeError> {
        let id = volume_id(&record.id)?;
        let usage = self.on_volume_host("reading a volume's usage", move |host| host.volume_usage(&id)).await?;
        let mounted_by = self
            .holders(&record.id)?
            .into_iter()
            .map(|(holder, mount)| VolumeHolder {
                sandbox_id: holder.sandbox.id,
                path: mount.path,
                read_only: mount.read_only,
            })
            .collect();
        let sizes: std::collections::HashMap<String, u64> =
            usage.snapshots.into_iter().map(|(name, bytes)| (name.to_string(), bytes)).collect();
        let snapshots = self
            .store
            .node()
            .volume_snapshots(&record.id)?
            .into_iter()
            .map(|s| VolumeSnapshot {
                size_bytes: sizes.get(&s.name).copied().unwrap_or(0),
                name: s.name,
                volume: record.name.clone(),
                created_at: s.created_at,
            })
            .collect();
        Ok(Volume {
            name: record.name,
            size_mib: record.size_mib,
            used_bytes: usage.used_bytes,
            created_at: record.created_at,
            mounted_by,
            snapshots,
            from_snapshot: record.from_snapshot,
            node: self.node_id.get().cloned(),
        })
    }

    /// `POST /v1/volumes`: a new empty volume, or a copy-on-write copy of
    /// one of the tenant's snapshots.
    pub async fn create_volume(&self, tenant: &str, request: CreateVolumeRequest) -> Result<Volume, NodeError> {
        checked_name(&request.name, "volume name", "name")?;
        let size_mib = request.size_mib.unwrap_or(DEFAULT_VOLUME_MIB);
        if !(MIN_VOLUME_MIB..=MAX_VOLUME_MIB).contains(&size_mib) {
            return Err(NodeError::unprocessable(format!(
                "size_mib must be {MIN_VOLUME_MIB} to {MAX_VOLUME_MIB}, not {size_mib}"
            ))
            .with_details(serde_json::json!({"field": "size_mib"})));
        }
        let from = match &request.from_snapshot {
            None => None,
            Some(SnapshotRef { volume, snapshot }) => {
                let source = self.volume_record(tenant, volume)?;
                checked_name(snapshot, "snapshot name", "from_snapshot.snapshot")?;
                let known = self.store.node().volume_snapshots(&source.id)?.iter().any(|s| &s.name == snapshot);
                if !known {
                    return Err(snapshot_not_found(volume, snapshot));
                }
                Some((source.id, snapshot.clone()))
            }
        };
        if self.store.node().volume_named(tenant, &request.name)?.is_some() {
            return Err(NodeError::new(ErrorCode::NameTaken, format!("a volume named {:?} exists", request.name))
                .with_details(serde_json::json!({"field": "name"})));
        }
        if self.store.node().tenant_volumes(tenant)?.len() >= MAX_VOLUMES {
            return Err(NodeError::new(
                ErrorCode::QuotaExceeded,
                format!("a tenant may keep at most {MAX_VOLUMES} volumes on a node"),
            )
            .with_details(serde_json::json!({"resource": "volumes", "limit": MAX_VOLUMES})));
        }
        let bytes = u64::from(size_mib) << 20;
        self.check_disk_quota(tenant, bytes, &format!("create a volume of {size_mib} MiB"))?;
        self.check_reserve("create a volume", 0)?;
        let record = VolumeRecord {
            id: ids::new_id("vol"),
            tenant: tenant.to_string(),
            name: request.name.clone(),
            size_mib,
            created_at: ids::now(),
            from_snapshot: request.from_snapshot.clone(),
        };
        let id = volume_id(&record.id)?;
        let size = DiskMib::new(size_mib).map_err(|e| NodeError::unprocessable(e.to_string()))?;
        let source = match from {
            Some((volume, snapshot)) => Some((
                volume_id(&volume)?,
                SnapshotName::parse(&snapshot).map_err(|e| NodeError::unprocessable(e.to_string()))?,
            )),
            None => None,
        };
        let made = id.clone();
        // A Firecracker node's volumes are ext4 images its microVMs mount
        // as drives; a copy of a snapshot is of its source's kind.
        let image = source.is_none() && self.engine.name() == "firecracker";
        self.on_volume_host("making a volume", move |host| match image {
            true => host.create_image_volume(&made, size),
            false => host.create_volume(&made, size, source.as_ref().map(|(v, s)| (v, s))),
        })
        .await?;
        // Written once the subvolume is there: a crash before leaves one
        // the sweep at start removes.
        if !self.store.node().insert_volume(&record)? {
            let _ = self.on_volume_host("removing a volume", move |host| host.delete_volume(&id)).await;
            return Err(NodeError::new(ErrorCode::NameTaken, format!("a volume named {:?} exists", request.name))
                .with_details(serde_json::json!({"field": "name"})));
        }
        tracing::info!(volume = %record.id, tenant, name = %record.name, size_mib, "volume created");
        self.volume_object(record).await
    }

    /// `GET /v1/volumes`.
    pub async fn volumes(&self, tenant: &str) -> Result<Vec<Volume>, NodeError> {
        let mut volumes = Vec::new();
        for record in self.store.node().tenant_volumes(tenant)? {
            volumes.push(self.volume_object(record).await?);
        }
        Ok(volumes)
    }

    /// `GET /v1/volumes/{name}`.
    pub async fn volume(&self, tenant: &str, name: &str) -> Result<Volume, NodeError> {
        let record = self.volume_record(tenant, name)?;
        self.volume_object(record).await
    }

    /// The first holder that refuses `why` (any holder, or only read-write
    /// ones), and the busy mark, checked under the admission lock.
    fn refuse_if_held(&self, record: &VolumeRecord, writers_only: bool, why: &str) -> Result<(), NodeError> {
        if let Some((holder, _)) =
            self.holders(&record.id)?.into_iter().find(|(_, mount)| !writers_only || !mount.read_only)
        {
            return Err(in_use(&record.name, &holder, why));
        }
        let busy = self.busy_volumes.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, doing)) = busy.get(&record.id) {
            return Err(NodeError::new(
                ErrorCode::VolumeInUse,
                format!("volume {:?} is busy ({doing}): {why}", record.name),
            )
            .with_details(serde_json::json!({"volume": record.name}))
            .retry_after(1));
        }
        Ok(())
    }

    fn mark_busy(self: &Arc<Self>, record: &VolumeRecord, doing: &'static str) -> BusyGuard {
        let mut busy = self.busy_volumes.0.lock().unwrap_or_else(|e| e.into_inner());
        busy.entry(record.id.clone()).or_insert((0, doing)).0 += 1;
        BusyGuard { platform: self.clone(), volume: record.id.clone() }
    }

    /// `DELETE /v1/volumes/{name}`: refused while anything mounts it.
    pub async fn delete_volume(&self, tenant: &str, name: &str) -> Result<(), NodeError> {
        let record = self.volume_record(tenant, name)?;
        {
            let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
            self.refuse_if_held(&record, false, "unmount it (delete the sandbox) first")?;
            // Forgotten first: nothing can mount it from here on, and a
            // crash leaves a subvolume the sweep removes.
            self.store.node().delete_volume(&record.id)?;
        }
        let id = volume_id(&record.id)?;
        self.on_volume_host("removing a volume", move |host| host.delete_volume(&id)).await?;
        tracing::info!(volume = %record.id, tenant, name, "volume deleted");
        Ok(())
    }

    /// `POST /v1/volumes/{name}/snapshots`: its files at this instant.
    pub async fn snapshot_volume(&self, tenant: &str, name: &str, snapshot: &str) -> Result<VolumeSnapshot, NodeError> {
        let record = self.volume_record(tenant, name)?;
        checked_name(snapshot, "snapshot name", "name")?;
        let existing = self.store.node().volume_snapshots(&record.id)?;
        if existing.iter().any(|s| s.name == snapshot) {
            return Err(NodeError::new(
                ErrorCode::AlreadyExists,
                format!("volume {name:?} has a snapshot named {snapshot:?}"),
            )
            .with_details(serde_json::json!({"field": "name"})));
        }
        if existing.len() >= MAX_SNAPSHOTS {
            return Err(NodeError::new(
                ErrorCode::QuotaExceeded,
                format!("a volume may keep at most {MAX_SNAPSHOTS} snapshots"),
            )
            .with_details(serde_json::json!({"resource": "volume_snapshots", "limit": MAX_SNAPSHOTS})));
        }
        self.check_disk_quota(tenant, 0, "snapshot a volume")?;
        self.check_reserve("snapshot a volume", 0)?;
        let id = volume_id(&record.id)?;
        let snap = SnapshotName::parse(snapshot).map_err(|e| NodeError::unprocessable(e.to_string()))?;
        self.on_volume_host("snapshotting a volume", move |host| host.snapshot_volume(&id, &snap)).await?;
        let kept = SnapshotRecord { volume_id: record.id.clone(), name: snapshot.to_string(), created_at: ids::now() };
        if !self.store.node().insert_volume_snapshot(&kept)? {
            return Err(NodeError::new(
                ErrorCode::AlreadyExists,
                format!("volume {name:?} has a snapshot named {snapshot:?}"),
            ));
        }
        Ok(VolumeSnapshot { name: kept.name, volume: record.name, created_at: kept.created_at, size_bytes: 0 })
    }

    /// `GET /v1/volumes/{name}/snapshots`.
    pub async fn volume_snapshots(&self, tenant: &str, name: &str) -> Result<Vec<VolumeSnapshot>, NodeError> {
        Ok(self.volume(tenant, name).await?.snapshots)
    }

    /// `DELETE /v1/volumes/{name}/snapshots/{snapshot}`.
    pub async fn delete_volume_snapshot(&self, tenant: &str, name: &str, snapshot: &str) -> Result<(), NodeError> {
        let record = self.volume_record(tenant, name)?;
        if !self.store.node().volume_snapshots(&record.id)?.iter().any(|s| s.name == snapshot) {
            return Err(snapshot_not_found(name, snapshot));
        }
        self.store.node().delete_volume_snapshot(&record.id, snapshot)?;
        let id = volume_id(&record.id)?;
        let snap = SnapshotName::parse(snapshot).map_err(|e| NodeError::internal("a snapshot's record", e))?;
        self.on_volume_host("removing a volume snapshot", move |host| host.delete_volume_snapshot(&id, &snap)).await
    }

    /// `POST /v1/volumes/{name}/snapshots/{snapshot}/restore`: the volume's
    /// files become the snapshot's; refused while anything mounts it.
    pub async fn restore_volume(
        self: &Arc<Self>,
        tenant: &str,
        name: &str,
        snapshot: &str,
    ) -> Result<Volume, NodeError> {
        let record = self.volume_record(tenant, name)?;
        if !self.store.node().volume_snapshots(&record.id)?.iter().any(|s| s.name == snapshot) {
            return Err(snapshot_not_found(name, snapshot));
        }
        let _busy = {
            let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
            self.refuse_if_held(&record, false, "unmount it (delete the sandbox) before a restore")?;
            self.mark_busy(&record, "being restored")
        };
        let id = volume_id(&record.id)?;
        let snap = SnapshotName::parse(snapshot).map_err(|e| NodeError::internal("a snapshot's record", e))?;
        self.on_volume_host("restoring a volume", move |host| host.restore_volume(&id, &snap)).await?;
        tracing::info!(volume = %record.id, tenant, name, snapshot, "volume restored");
        self.volume_object(record).await
    }

    /// A connection to the volume's files (a new confined child). A writer
    /// is refused while a sandbox mounts the volume read-write, and marks
    /// it busy meanwhile, so no sandbox mounts it read-write until done.
    pub async fn volume_files(
        self: &Arc<Self>,
        tenant: &str,
        name: &str,
        write: bool,
    ) -> Result<VolumeFiles, NodeError> {
        let record = self.volume_record(tenant, name)?;
        let busy = match write {
            false => None,
            true => {
                let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
                self.refuse_if_held(&record, true, "a sandbox writes it; write through that sandbox")?;
                Some(self.mark_busy(&record, "being written through the files routes"))
            }
        };
        let id = volume_id(&record.id)?;
        let socket = self.on_volume_host("opening a volume's files", move |host| host.volume_files(&id, write)).await?;
        let kept = socket.try_clone().map_err(|e| NodeError::internal("a volume's files socket", e))?;
        socket.set_nonblocking(true).map_err(|e| NodeError::internal("a volume's files socket", e))?;
        let stream =
            tokio::net::UnixStream::from_std(socket).map_err(|e| NodeError::internal("a volume's files socket", e))?;
        let welcome = space_proto::Welcome::plain(record.id.clone(), record.name.clone(), 0);
        let agent = AgentConn::handshake(stream, welcome, FILES_PATIENCE)
            .await
            .map_err(|e| NodeError::internal("starting a volume's files", e))?;
        Ok(VolumeFiles { agent, socket: kept, _busy: busy })
    }

    /// The ids of the volumes `mounts` name, in order, if this sandbox may
    /// mount them: each the tenant's, at a checked path, no two at one
    /// path, and no read-write mount of a volume another live sandbox
    /// mounts read-write (409 naming it). Called under the admission lock,
    /// which the caller holds until the sandbox's record is written.
    pub(crate) fn resolve_mounts(&self, tenant: &str, mounts: &[VolumeMount]) -> Result<Vec<String>, NodeError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let field = |i: usize, what: &str| serde_json::json!({"field": format!("volumes[{i}].{what}")});
        if mounts.len() > space_api::MAX_MOUNTS {
            return Err(NodeError::unprocessable(format!("at most {} volumes per sandbox", space_api::MAX_MOUNTS))
                .with_details(serde_json::json!({"field": "volumes"})));
        }
        let mut paths = HashSet::new();
        let mut seen = HashSet::new();
        let mut ids = Vec::new();
        for (i, mount) in mounts.iter().enumerate() {
            check_mount_path(&mount.path).map_err(|why| {
                NodeError::unprocessable(format!("volumes[{i}].path: {why}")).with_details(field(i, "path"))
            })?;
            if !paths.insert(mount.path.clone()) {
                return Err(NodeError::unprocessable(format!("two volumes are mounted at {:?}", mount.path))
                    .with_details(field(i, "path")));
            }
            let record = self.volume_record(tenant, &mount.name)?;
            if !seen.insert(record.id.clone()) {
                return Err(NodeError::unprocessable(format!("volume {:?} is named twice", mount.name))
                    .with_details(field(i, "name")));
            }
            if !mount.read_only {
                self.refuse_if_held(&record, true, "a volume has one read-write mount at a time; mount it read_only")?;
            }
            ids.push(record.id);
        }
        // One under another would hide the outer volume's files there.
        let sorted: Vec<&str> = mounts.iter().map(|m| m.path.as_str()).collect();
        for a in &sorted {
            for b in &sorted {
                if a != b && b.starts_with(&format!("{a}/")) {
                    return Err(NodeError::unprocessable(format!("volume paths {a:?} and {b:?} nest"))
                        .with_details(serde_json::json!({"field": "volumes"})));
                }
            }
        }
        Ok(ids)
    }

    /// 409 unless a copy of `record`'s sandbox may be made (a fork): a
    /// read-write mount would get a second writer.
    pub(crate) fn refuse_copy_with_writer(&self, record: &SandboxRecord) -> Result<(), NodeError> {
        match record.sandbox.volumes.iter().find(|m| !m.read_only) {
            None => Ok(()),
            Some(mount) => Err(NodeError::new(
                ErrorCode::VolumeInUse,
                format!(
                    "sandbox {} mounts volume {:?} read-write: a fork would be a second writer",
                    record.sandbox.id, mount.name
                ),
            )
            .with_details(serde_json::json!({"volume": mount.name, "sandbox_id": record.sandbox.id}))),
        }
    }

    /// The shared store this node keeps volumes in (decision 032), if any.
    pub fn volume_store(&self) -> Option<String> {
        self.volume_store.get().cloned().flatten()
    }

    fn shared_store(&self) -> Result<String, NodeError> {
        self.volume_store().ok_or_else(|| {
            NodeError::new(ErrorCode::InvalidState, "this node keeps volumes on its own disk: they move by a copy")
                .with_details(serde_json::json!({"state": "local_volumes"}))
        })
    }

    /// Cluster (decision 032): lets go of a volume of the shared store for
    /// another node to take, refused while anything mounts it or works on
    /// it. Its records go first (nothing here can mount it from then on),
    /// then its image is unmounted; one that cannot be keeps its records.
    pub async fn release_volume(&self, tenant: &str, name: &str) -> Result<HandedVolume, NodeError> {
        let store = self.shared_store()?;
        let record = self.volume_record(tenant, name)?;
        let snapshots = self.store.node().volume_snapshots(&record.id)?;
        {
            let _admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
            self.refuse_if_held(&record, false, "a volume changes node while nothing mounts it")?;
            self.store.node().delete_volume(&record.id)?;
        }
        let id = volume_id(&record.id)?;
        let host = self.volume_host()?;
        let detached = tokio::task::spawn_blocking(move || host.detach_volume(&id))
            .await
            .map_err(|e| NodeError::internal("detaching a volume", e))?;
        if let Err(err) = detached {
            self.store.node().adopt_volume(&record, &snapshots)?;
            return Err(NodeError::new(
                ErrorCode::VolumeInUse,
                format!("volume {name:?} cannot be unmounted from this node: {err}"),
            )
            .with_details(serde_json::json!({"volume": name})));
        }
        tracing::info!(volume = %record.id, tenant, name, "volume released to another node");
        Ok(HandedVolume {
            store,
            tenant: record.tenant,
            id: record.id,
            name: record.name,
            size_mib: record.size_mib,
            created_at: record.created_at,
            from_snapshot: record.from_snapshot,
            snapshots: snapshots
                .into_iter()
                .map(|s| HandedSnapshot { name: s.name, created_at: s.created_at })
                .collect(),
        })
    }

    /// Cluster (decision 032): takes a volume of the shared store another
    /// node let go of (taken already is no error).
    pub async fn adopt_volume(&self, handed: HandedVolume) -> Result<Volume, NodeError> {
        let store = self.shared_store()?;
        if handed.store != store {
            return Err(NodeError::unprocessable(format!(
                "volume {:?} is in shared store {}; this node's is {store}",
                handed.name, handed.store
            ))
            .with_details(serde_json::json!({"field": "store"})));
        }
        checked_name(&handed.name, "volume name", "name")?;
        for snapshot in &handed.snapshots {
            checked_name(&snapshot.name, "snapshot name", "snapshots")?;
        }
        if !(MIN_VOLUME_MIB..=MAX_VOLUME_MIB).contains(&handed.size_mib) || handed.snapshots.len() > MAX_SNAPSHOTS {
            return Err(NodeError::unprocessable("a handed volume's size or snapshots are out of bounds"));
        }
        let id = volume_id(&handed.id)?;
        let attached = id.clone();
        let host = self.volume_host()?;
        let mounted = tokio::task::spawn_blocking(move || host.attach_volume(&attached))
            .await
            .map_err(|e| NodeError::internal("attaching a volume", e))?;
        // Held by another node (its lock in the store), or not mountable.
        if let Err(err) = mounted {
            return Err(NodeError::new(
                ErrorCode::VolumeInUse,
                format!("volume {:?} cannot be mounted on this node: {err}", handed.name),
            )
            .with_details(serde_json::json!({"volume": handed.name})));
        }
        let record = VolumeRecord {
            id: handed.id.clone(),
            tenant: handed.tenant,
            name: handed.name,
            size_mib: handed.size_mib,
            created_at: handed.created_at,
            from_snapshot: handed.from_snapshot,
        };
        let snapshots: Vec<SnapshotRecord> = handed
            .snapshots
            .into_iter()
            .map(|s| SnapshotRecord { volume_id: handed.id.clone(), name: s.name, created_at: s.created_at })
            .collect();
        if !self.store.node().adopt_volume(&record, &snapshots)? {
            let _ = self.on_volume_host("detaching a volume", move |host| host.detach_volume(&id)).await;
            return Err(NodeError::new(ErrorCode::NameTaken, format!("a volume named {:?} exists", record.name))
                .with_details(serde_json::json!({"field": "name"})));
        }
        tracing::info!(volume = %record.id, tenant = %record.tenant, name = %record.name, "volume taken from another node");
        self.volume_object(record).await
    }

    /// At start: removes what a crash left of volumes and snapshots no
    /// record names (made before their record, or deleted after it). With
    /// a shared store, every recorded volume is mounted again, and one no
    /// record names is only unmounted: its image may be another node's now.
    pub(crate) async fn sweep_volumes(&self) {
        let result = async {
            let records = self.store.node().all_volumes()?;
            let shared = self.volume_store().is_some();
            if shared {
                for record in &records {
                    let id = volume_id(&record.id)?;
                    let attached = self.on_volume_host("attaching a volume", move |host| host.attach_volume(&id));
                    if let Err(err) = attached.await {
                        tracing::error!(volume = %record.id, "mounting a volume of the shared store: {}", err.message);
                    }
                }
            }
            let on_disk = self.on_volume_host("listing volumes", |host| host.list_volumes()).await?;
            let known: HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
            for found in on_disk {
                let id = found.volume.clone();
                if !known.contains(id.as_str()) && shared {
                    tracing::info!(volume = %id, "unmounting a volume of the shared store no record here names");
                    self.on_volume_host("detaching a volume", move |host| host.detach_volume(&id)).await?;
                    continue;
                }
                if !known.contains(id.as_str()) {
                    tracing::info!(volume = %id, "removing a volume no record names");
                    self.on_volume_host("removing a volume", move |host| host.delete_volume(&id)).await?;
                    continue;
                }
                let kept: HashSet<String> =
                    self.store.node().volume_snapshots(id.as_str())?.into_iter().map(|s| s.name).collect();
                for snapshot in found.snapshots {
                    if !kept.contains(snapshot.as_str()) {
                        tracing::info!(volume = %id, snapshot = %snapshot, "removing a snapshot no record names");
                        let volume = id.clone();
                        self.on_volume_host("removing a volume snapshot", move |host| {
                            host.delete_volume_snapshot(&volume, &snapshot)
                        })
                        .await?;
                    }
                }
            }
            Ok::<_, NodeError>(())
        }
        .await;
        if let Err(err) = result {
            tracing::warn!("sweeping volumes: {}", err.message);
        }
    }
}
