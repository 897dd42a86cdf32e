//! The unprivileged side's [`EngineHost`]: each method one request to the
//! helper, on a connection of its own while it runs (so calls from several
//! threads go on at once, as they do with the in-process host).

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use space_privsep::client::BlockingClient;
use space_privsep::peer::PeerError;
use space_privsep::proto::{
    AmountUnit, BuildSource, ChainId, CheckpointName, DiskMib, Engine, EngineState, ImageRef, LayerEntry, LayerKey,
    Mount, PatienceMs, Reply, Request, SandboxId, Shape, SlackNs, SnapshotName, StartFrom, StepKey, TemplateMetaJson,
    TemplateName, TemplateRef, TemplateVersion, VolumeId,
};

use crate::host::{EngineHost, Launched};
use crate::templates::{BuildInput, BuildProgress, Imported, LayerReady, TemplateHost};
use crate::volumes::{VolumeHost, VolumeOnDisk, VolumeUsage};
use crate::EngineError;

/// How long the helper may take to answer a request: its longest (a root
/// snapshot, a checkpoint, a destroy of a large root) on a loaded host.
const REPLY_PATIENCE: Duration = Duration::from_secs(600);
/// How long a template build may take in all (a large image or a long
/// package list on a loaded host).
const BUILD_PATIENCE: Duration = Duration::from_secs(3 * 3600);
/// How long connecting to the helper and its hello may take.
const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// [`EngineHost`] over the helper's socket.
pub struct HelperHost {
    socket: PathBuf,
    helper_uid: u32,
    /// Whose sandboxes this host's requests are about (each connection's hello says).
    engine: Engine,
    patience: Duration,
    /// Connections between requests, reused.
    idle: Mutex<Vec<BlockingClient>>,
}

impl HelperHost {
    /// A host that asks the helper at `socket`, which must be served by
    /// `helper_uid` (root: 0). Connects when first asked.
    pub fn new(socket: impl Into<PathBuf>, helper_uid: u32) -> HelperHost {
        HelperHost::with_patience(socket, helper_uid, REPLY_PATIENCE)
    }

    /// [`HelperHost::new`] whose requests wait at most `patience` for
    /// their answers (tests; the default suits a loaded host).
    pub fn with_patience(socket: impl Into<PathBuf>, helper_uid: u32, patience: Duration) -> HelperHost {
        HelperHost { socket: socket.into(), helper_uid, engine: Engine::Gvisor, patience, idle: Mutex::new(Vec::new()) }
    }

    /// [`HelperHost::new`] for `engine`'s sandboxes.
    pub fn for_engine(socket: impl Into<PathBuf>, helper_uid: u32, engine: Engine) -> HelperHost {
        HelperHost { engine, ..HelperHost::new(socket, helper_uid) }
    }

    fn connect(&self) -> Result<BlockingClient, EngineError> {
        let patience = CONNECT_PATIENCE.min(self.patience);
        BlockingClient::connect_for(&self.socket, self.helper_uid, self.engine, patience).map_err(|err| {
            EngineError::Runtime(format!("the helper at {} is not reachable: {err}", self.socket.display()))
        })
    }

    /// Sends `request` on an idle connection or a new one and returns the
    /// connection with the reply, for the caller to give back. A helper
    /// that restarted closed every idle connection: those are dropped,
    /// and a request that could not even be written to one goes once more
    /// on a new connection (nothing of it reached the helper).
    fn send(&self, request: &Request) -> Result<BlockingClient, EngineError> {
        let pooled = loop {
            let next = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match next {
                Some(client) if client.closed() => continue,
                other => break other,
            }
        };
        if let Some(client) = pooled {
            match client.send(request, &[]) {
                Ok(()) => return Ok(client),
                Err(err) => tracing::info!("the helper closed a connection ({err}): connecting again"),
            }
        }
        let client = self.connect()?;
        client.send(request, &[]).map_err(|err| transport(request, err))?;
        Ok(client)
    }

    fn give_back(&self, client: BlockingClient) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(client);
    }

    /// One request and its reply; a refusal is the error it carries.
    fn call(&self, request: Request, patience: Duration) -> Result<(Reply, Option<OwnedFd>), EngineError> {
        let client = self.send(&request)?;
        // A connection whose reply did not come whole is out of step: dropped.
        let (reply, mut fds) = client.recv(patience).map_err(|err| transport(&request, err))?;
        self.give_back(client);
        match reply {
            Reply::Refused { message, .. } => Err(EngineError::Runtime(message)),
            // The frame's check made sure of the descriptor a reply carries.
            reply => Ok((reply, fds.pop())),
        }
    }

    /// Sends a request that streams `Progress` replies (a build, a layer)
    /// on a connection of its own, passes them to `progress` and answers
    /// its last reply; a refusal is an error.
    fn streamed(
        &self,
        request: &Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<Reply, EngineError> {
        // A connection of its own: it is the request's until it ends.
        let client = self.connect()?;
        client.send(request, fds).map_err(|err| transport(request, err))?;
        let deadline = Instant::now() + BUILD_PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(EngineError::Runtime(format!("the build did not end within {BUILD_PATIENCE:?}")));
            }
            // Not each reply's usual patience: a step may go quiet for long
            // (a large package downloading, a layer of gigabytes).
            let (reply, _) = client.recv(left).map_err(|err| transport(request, err))?;
            match reply {
                Reply::Progress { step, done, total, amount } => progress(BuildProgress {
                    step,
                    done,
                    total,
                    amount: amount.map(|amount| space_host::template::Amount {
                        unit: match amount.unit {
                            AmountUnit::Bytes => "bytes",
                            AmountUnit::Packages => "packages",
                        },
                        done: amount.done,
                        total: amount.total,
                    }),
                }),
                Reply::Refused { message, .. } => {
                    self.give_back(client);
                    return Err(EngineError::Runtime(message));
                }
                last => {
                    self.give_back(client);
                    return Ok(last);
                }
            }
        }
    }

    fn done(&self, request: Request) -> Result<(), EngineError> {
        match self.call(request.clone(), self.patience)? {
            (Reply::Done {}, _) => Ok(()),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    /// A request whose method has no error to return: its failure is
    /// logged where it happened.
    fn done_or_log(&self, request: Request, patience: Duration) {
        if let Err(err) = self.call(request.clone(), patience) {
            tracing::warn!(request = op(&request), "{err}");
        }
    }

    fn listening(&self, request: Request) -> Result<UnixListener, EngineError> {
        match self.call(request.clone(), self.patience)? {
            (Reply::Listening {}, fd) => listener_from(fd, &request),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }
}

/// A request's name as its wire format spells it.
fn op(request: &Request) -> String {
    serde_json::to_value(request).ok().and_then(|v| v["op"].as_str().map(str::to_string)).unwrap_or_default()
}

fn transport(request: &Request, err: PeerError) -> EngineError {
    EngineError::Runtime(format!("asking the helper to {}: {err}", op(request)))
}

fn unexpected(request: &Request, reply: &Reply) -> EngineError {
    EngineError::Runtime(format!("the helper answered {} with {reply:?}", op(request)))
}

impl EngineHost for HelperHost {
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<Launched, EngineError> {
        let request = Request::Start {
            sandbox: sandbox.clone(),
            engine: self.engine,
            from: from.clone(),
            shape,
            mounts: mounts.to_vec(),
        };
        let client = self.send(&request)?;
        let (reply, mut fds) = client.recv(self.patience).map_err(|err| transport(&request, err))?;
        let (pid, steps) = match reply {
            Reply::Started { pid, steps } => (pid, steps),
            Reply::Refused { message, .. } => {
                self.give_back(client);
                return Err(EngineError::Runtime(message));
            }
            other => return Err(unexpected(&request, &other)),
        };
        // The frame's check made sure the listener came with it.
        let listener = listener_from(fds.pop(), &request)?;
        // The connection is the start's until its second answer: runsc's end.
        let patience = self.patience;
        let finished = Box::new(move || match client.recv(patience) {
            Ok((Reply::Done {}, _)) => Ok(()),
            Ok((Reply::Refused { message, .. }, _)) => Err(EngineError::Runtime(message)),
            Ok((other, _)) => Err(unexpected(&request, &other)),
            Err(err) => Err(transport(&request, err)),
        });
        Ok(Launched { listener, pid, finished, steps: super::steps_from_wire(&steps) })
    }

    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.done(Request::Pause { sandbox: sandbox.clone() })
    }

    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.done(Request::Resume { sandbox: sandbox.clone() })
    }

    fn freeze(&self, sandbox: &SandboxId, frozen: bool) -> Result<(), EngineError> {
        self.done(Request::Freeze { sandbox: sandbox.clone(), frozen })
    }

    fn set_timer_slack(&self, sandbox: &SandboxId, slack: Option<SlackNs>) -> Result<usize, EngineError> {
        let request = Request::SetTimerSlack { sandbox: sandbox.clone(), slack_ns: slack };
        match self.call(request.clone(), self.patience)? {
            (Reply::SlackSet { tasks }, _) => Ok(tasks as usize),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.done(Request::Suspend { sandbox: sandbox.clone() })
    }

    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError> {
        let request = Request::SaveImage { sandbox: sandbox.clone(), image: image.clone() };
        match self.call(request.clone(), self.patience)? {
            (Reply::ImageSaved { frozen_us }, _) => Ok(Duration::from_micros(frozen_us)),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError> {
        self.done(Request::DropImage { sandbox: sandbox.clone(), image: image.clone() })
    }

    fn drop_snapshot(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.done(Request::DropSnapshot { sandbox: sandbox.clone() })
    }

    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.done(Request::Stop { sandbox: sandbox.clone() })
    }

    fn stop_strays(&self, sandbox: &SandboxId) {
        self.done_or_log(Request::StopStrays { sandbox: sandbox.clone() }, self.patience)
    }

    fn settle_orphans(&self, sandboxes: &[SandboxId], patience: PatienceMs) {
        // The helper waits `patience` (a pause or resume longer) itself.
        let waited = Duration::from_millis(patience.get().into()) + self.patience;
        for chunk in sandboxes.chunks(space_privsep::proto::MAX_LISTED) {
            self.done_or_log(Request::SettleOrphans { sandboxes: chunk.to_vec(), patience_ms: patience }, waited)
        }
    }

    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.done(Request::Destroy { sandbox: sandbox.clone() })
    }

    /// A helper that does not answer leaves the state unknown; the trait
    /// has no error for it, so it reads as Missing, as a failed `runsc
    /// state` does in the helper (logged).
    fn state(&self, sandbox: &SandboxId) -> EngineState {
        let request = Request::State { sandbox: sandbox.clone() };
        match self.call(request.clone(), self.patience) {
            Ok((Reply::State { state }, _)) => state,
            Ok((other, _)) => {
                tracing::warn!("{}", unexpected(&request, &other));
                EngineState::Missing
            }
            Err(err) => {
                tracing::warn!(sandbox = %sandbox, "{err}");
                EngineState::Missing
            }
        }
    }

    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState> {
        let mut states = Vec::with_capacity(sandboxes.len());
        for chunk in sandboxes.chunks(space_privsep::proto::MAX_LISTED) {
            let request = Request::States { sandboxes: chunk.to_vec() };
            match self.call(request.clone(), self.patience) {
                Ok((Reply::States { states: answered }, _)) if answered.len() == chunk.len() => states.extend(answered),
                Ok((other, _)) => {
                    tracing::warn!("{}", unexpected(&request, &other));
                    states.extend(chunk.iter().map(|_| EngineState::Missing));
                }
                Err(err) => {
                    tracing::warn!("{err}");
                    states.extend(chunk.iter().map(|_| EngineState::Missing));
                }
            }
        }
        states
    }

    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        self.listening(Request::ListenAgent { sandbox: sandbox.clone() })
    }

    fn close_agent(&self, sandbox: &SandboxId) {
        self.done_or_log(Request::CloseAgent { sandbox: sandbox.clone() }, self.patience)
    }

    fn availability(&self) -> (bool, String) {
        let request = Request::Availability {};
        let client = match self.send(&request) {
            Ok(client) => client,
            Err(err) => return (false, format!("the root helper does not answer: {err}")),
        };
        let answered = client.recv(self.patience);
        if answered.is_ok() {
            self.give_back(client);
        }
        match answered {
            Ok((Reply::Availability { available, detail }, _)) => (available, detail),
            // The helper runs no such engine: the server cannot either.
            Ok((Reply::Refused { message, .. }, _)) => (false, format!("the root helper: {message}")),
            Ok((other, _)) => (false, unexpected(&request, &other).to_string()),
            Err(err) => (false, format!("the root helper does not answer: {err}")),
        }
    }

    fn engine_log(&self, sandbox: &SandboxId) -> String {
        let request = Request::EngineLog { sandbox: sandbox.clone() };
        match self.call(request.clone(), self.patience) {
            Ok((Reply::Log { text }, _)) => text,
            Ok((other, _)) => unexpected(&request, &other).to_string(),
            Err(err) => err.to_string(),
        }
    }

    fn has_clone_base(&self, template: &TemplateRef, shape: Shape) -> Result<bool, EngineError> {
        let request = Request::HasCloneBase { template: template.clone(), shape };
        match self.call(request.clone(), self.patience)? {
            (Reply::Has { has }, _) => Ok(has),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn save_clone_base(&self, sandbox: &SandboxId, template: &TemplateRef) -> Result<(), EngineError> {
        self.done(Request::SaveCloneBase { sandbox: sandbox.clone(), template: template.clone() })
    }
}

/// The template work of a confined server: each method one request.
impl TemplateHost for HelperHost {
    fn begin_template(&self, template: &TemplateRef) -> Result<(), EngineError> {
        self.done(Request::BeginTemplate { template: template.clone() })
    }

    fn copy_checkpoint(
        &self,
        template: &TemplateRef,
        sandbox: &SandboxId,
        checkpoint: &CheckpointName,
    ) -> Result<(), EngineError> {
        self.done(Request::CopyCheckpoint {
            template: template.clone(),
            sandbox: sandbox.clone(),
            checkpoint: checkpoint.clone(),
        })
    }

    fn build_template(
        &self,
        template: &TemplateRef,
        input: BuildInput,
        disk_mib: DiskMib,
        log: std::fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<Imported, EngineError> {
        let (source, archive) = match input {
            BuildInput::OciArchive(archive) => (BuildSource::OciArchive {}, Some(archive)),
            BuildInput::RootTar(archive) => (BuildSource::RootTar {}, Some(archive)),
            BuildInput::Debian { suite, packages } => (BuildSource::Debian { suite, packages }, None),
            BuildInput::Layers { top } => (BuildSource::Layers { top }, None),
        };
        let request = Request::BuildTemplate { template: template.clone(), source, disk_mib };
        // The log first, then the archive (the order the helper reads them).
        let fds: Vec<_> = std::iter::once(log.as_fd()).chain(archive.as_ref().map(AsFd::as_fd)).collect();
        match self.streamed(&request, &fds, progress)? {
            Reply::Built { image } => serde_json::from_str(image.as_str())
                .map_err(|err| EngineError::Runtime(format!("the helper's record of the image: {err}"))),
            other => Err(unexpected(&request, &other)),
        }
    }

    fn publish_template(
        &self,
        template: &TemplateRef,
        meta: &TemplateMetaJson,
        ext4: Option<DiskMib>,
    ) -> Result<(), EngineError> {
        self.done(Request::PublishTemplate { template: template.clone(), meta: meta.clone(), ext4 })
    }

    fn delete_template(&self, name: &TemplateName, version: Option<TemplateVersion>) -> Result<(), EngineError> {
        self.done(Request::DeleteTemplate { name: name.clone(), version })
    }

    fn clear_stale_quotas(&self) {
        self.done_or_log(Request::ClearStaleQuotas {}, self.patience)
    }

    /// The helper checks this itself when an image is saved; asked here,
    /// it is not known.
    fn empty_build(&self, _template: &TemplateRef) -> bool {
        false
    }

    fn has_layer(&self, chain: &ChainId) -> Result<bool, EngineError> {
        let request = Request::HasLayer { chain: chain.clone() };
        match self.call(request.clone(), self.patience)? {
            (Reply::Has { has }, _) => Ok(has),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn apply_layer(
        &self,
        parent: Option<&ChainId>,
        layer: &LayerKey,
        disk_mib: DiskMib,
        blob: std::fs::File,
        log: std::fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<LayerReady, EngineError> {
        let request = Request::ApplyLayer { parent: parent.cloned(), layer: layer.clone(), disk_mib };
        match self.streamed(&request, &[log.as_fd(), blob.as_fd()], progress)? {
            Reply::LayerReady { chain, bytes, cached } => {
                // The helper derives the chain itself; it must be the one
                // this side computes, or the two disagree on what is cached.
                if chain != ChainId::next(parent, layer) {
                    return Err(EngineError::Runtime(format!("the helper made chain {chain}, not the one asked for")));
                }
                Ok(LayerReady { chain, bytes, cached })
            }
            other => Err(unexpected(&request, &other)),
        }
    }

    fn delete_layer(&self, chain: &ChainId) -> Result<(), EngineError> {
        self.done(Request::DeleteLayer { chain: chain.clone() })
    }

    fn list_layers(&self) -> Result<Vec<LayerEntry>, EngineError> {
        let request = Request::ListLayers {};
        match self.call(request.clone(), self.patience)? {
            (Reply::Layers { layers }, _) => Ok(layers),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn save_layer(&self, sandbox: &SandboxId, parent: &ChainId, key: &StepKey) -> Result<LayerReady, EngineError> {
        let request = Request::SaveLayer { sandbox: sandbox.clone(), parent: parent.clone(), key: key.clone() };
        match self.call(request.clone(), self.patience)? {
            (Reply::LayerReady { chain, bytes, cached }, _) => {
                if chain != ChainId::next(Some(parent), &LayerKey::Step { key: key.clone() }) {
                    return Err(EngineError::Runtime(format!("the helper saved chain {chain}, not the one asked for")));
                }
                Ok(LayerReady { chain, bytes, cached })
            }
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn export_template(&self, template: &TemplateRef, out: std::fs::File) -> Result<(), EngineError> {
        let request = Request::ExportTemplate { template: template.clone() };
        // A connection of its own for the request that carries a descriptor.
        let client = self.connect()?;
        client.send(&request, &[out.as_fd()]).map_err(|err| transport(&request, err))?;
        drop(out);
        let (reply, _) = client.recv(self.patience).map_err(|err| transport(&request, err))?;
        self.give_back(client);
        match reply {
            Reply::Done {} => Ok(()),
            Reply::Refused { message, .. } => Err(EngineError::Runtime(message)),
            other => Err(unexpected(&request, &other)),
        }
    }
}

/// The volume work of a confined server: each method one request.
impl VolumeHost for HelperHost {
    fn create_volume(
        &self,
        volume: &VolumeId,
        size: DiskMib,
        from: Option<(&VolumeId, &SnapshotName)>,
    ) -> Result<(), EngineError> {
        let from = from.map(|(source, snapshot)| (source.clone(), snapshot.clone()));
        self.done(Request::CreateVolume { volume: volume.clone(), size, from, image: false })
    }

    fn create_image_volume(&self, volume: &VolumeId, size: DiskMib) -> Result<(), EngineError> {
        self.done(Request::CreateVolume { volume: volume.clone(), size, from: None, image: true })
    }

    fn delete_volume(&self, volume: &VolumeId) -> Result<(), EngineError> {
        self.done(Request::DeleteVolume { volume: volume.clone() })
    }

    fn snapshot_volume(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError> {
        self.done(Request::SnapshotVolume { volume: volume.clone(), snapshot: snapshot.clone() })
    }

    fn delete_volume_snapshot(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError> {
        self.done(Request::DeleteVolumeSnapshot { volume: volume.clone(), snapshot: snapshot.clone() })
    }

    fn restore_volume(&self, volume: &VolumeId, snapshot: &SnapshotName) -> Result<(), EngineError> {
        self.done(Request::RestoreVolume { volume: volume.clone(), snapshot: snapshot.clone() })
    }

    fn volume_usage(&self, volume: &VolumeId) -> Result<VolumeUsage, EngineError> {
        let request = Request::VolumeUsage { volume: volume.clone() };
        match self.call(request.clone(), self.patience)? {
            (Reply::VolumeUsage { used_bytes, snapshots }, _) => Ok(VolumeUsage {
                used_bytes,
                snapshots: snapshots.into_iter().map(|usage| (usage.snapshot, usage.bytes)).collect(),
            }),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn list_volumes(&self) -> Result<Vec<VolumeOnDisk>, EngineError> {
        let request = Request::ListVolumes {};
        match self.call(request.clone(), self.patience)? {
            (Reply::Volumes { volumes }, _) => Ok(volumes
                .into_iter()
                .map(|entry| VolumeOnDisk { volume: entry.volume, snapshots: entry.snapshots })
                .collect()),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn shared_store(&self) -> Result<Option<String>, EngineError> {
        let request = Request::VolumeStore {};
        match self.call(request.clone(), self.patience)? {
            (Reply::VolumeStore { store }, _) => Ok(store),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }

    fn attach_volume(&self, volume: &VolumeId) -> Result<(), EngineError> {
        self.done(Request::AttachVolume { volume: volume.clone() })
    }

    fn detach_volume(&self, volume: &VolumeId) -> Result<(), EngineError> {
        self.done(Request::DetachVolume { volume: volume.clone() })
    }

    fn volume_files(&self, volume: &VolumeId, write: bool) -> Result<std::os::unix::net::UnixStream, EngineError> {
        let request = Request::VolumeFiles { volume: volume.clone(), write };
        match self.call(request.clone(), self.patience)? {
            (Reply::VolumeFiles {}, Some(socket)) => Ok(std::os::unix::net::UnixStream::from(socket)),
            (other, _) => Err(unexpected(&request, &other)),
        }
    }
}

/// The agent's listener a reply carried, made non-blocking for the engine's
/// async accept.
fn listener_from(fd: Option<OwnedFd>, request: &Request) -> Result<UnixListener, EngineError> {
    let listener = UnixListener::from(
        fd.ok_or_else(|| EngineError::Runtime(format!("the helper answered {} without a listener", op(request))))?,
    );
    listener.set_nonblocking(true).map_err(EngineError::io("socket mode"))?;
    Ok(listener)
}
