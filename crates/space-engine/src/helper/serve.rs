//! The helper's side: one task per connection, one request at a time on
//! each, every request run on a blocking thread against the host.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use space_privsep::peer::{Connection, HelperListener, Incoming, PeerError};
use space_privsep::proto::{
    Amount, AmountUnit, BuildSource, Engine, EngineState, ImageRef, Refusal, Reply, Request, SnapshotUsage,
    TemplateMetaJson, VolumeEntry, MAX_LISTED, MAX_MESSAGE,
};

use crate::host::{EngineHost, Launched};
use crate::templates::{BuildInput, BuildProgress, TemplateHost};
use crate::volumes::VolumeHost;
use crate::EngineError;

/// Serves `listener` with `host` until accepting fails: each accepted
/// connection (of the allowed uid alone; others are refused and logged)
/// gets its own task. A request that fails is answered with a refusal and
/// its connection goes on; one that does not parse closes its connection.
/// Template requests are refused (see [`serve_with_templates`]).
pub async fn serve(listener: HelperListener, host: Arc<dyn EngineHost>) -> Result<(), PeerError> {
    serve_with_templates(listener, host, None).await
}

/// [`serve`], template requests answered by `templates` when given.
pub async fn serve_with_templates(
    listener: HelperListener,
    host: Arc<dyn EngineHost>,
    templates: Option<Arc<dyn TemplateHost>>,
) -> Result<(), PeerError> {
    serve_engines(listener, Engines { gvisor: Some(host), firecracker: None }, templates).await
}

/// [`serve`] for each engine's host there is: a connection's requests go
/// to the host of the engine its hello names (refused when there is none).
pub async fn serve_engines(
    listener: HelperListener,
    engines: Engines,
    templates: Option<Arc<dyn TemplateHost>>,
) -> Result<(), PeerError> {
    serve_all(listener, engines, templates, None).await
}

/// [`serve_engines`], volume requests answered by `volumes` when given
/// (refused otherwise).
pub async fn serve_all(
    listener: HelperListener,
    engines: Engines,
    templates: Option<Arc<dyn TemplateHost>>,
    volumes: Option<Arc<dyn VolumeHost>>,
) -> Result<(), PeerError> {
    let hosts = Hosts { engines, templates, volumes };
    loop {
        match listener.accept().await {
            Ok(connection) => {
                tokio::spawn(serve_connection(connection, hosts.clone()));
            }
            Err(err @ (PeerError::UnexpectedPeer { .. } | PeerError::Io { context: "reading SO_PEERCRED", .. })) => {
                tracing::warn!("{err}");
            }
            Err(err) => return Err(err),
        }
    }
}

/// What a request is answered with: a reply, the descriptor it carries
/// (an agent's listener, a volume files child's socket), and for a start
/// the wait for its engine command, whose outcome is the second reply.
struct Answer {
    reply: Reply,
    fd: Option<OwnedFd>,
    finished: Option<Box<dyn FnOnce() -> Result<(), EngineError> + Send>>,
}

impl From<Reply> for Answer {
    fn from(reply: Reply) -> Answer {
        Answer { reply, fd: None, finished: None }
    }
}

/// The host of each engine a helper serves.
#[derive(Clone, Default)]
pub struct Engines {
    pub gvisor: Option<Arc<dyn EngineHost>>,
    pub firecracker: Option<Arc<dyn EngineHost>>,
}

impl Engines {
    fn of(&self, engine: Engine) -> Option<Arc<dyn EngineHost>> {
        match engine {
            Engine::Gvisor => self.gvisor.clone(),
            Engine::Firecracker => self.firecracker.clone(),
        }
    }
}

/// What the helper serves requests with.
#[derive(Clone)]
struct Hosts {
    engines: Engines,
    templates: Option<Arc<dyn TemplateHost>>,
    volumes: Option<Arc<dyn VolumeHost>>,
}

/// What one connection's requests are answered with: the host of the
/// engine its hello named, if this helper runs that engine.
#[derive(Clone)]
struct ConnectionHosts {
    engine: Engine,
    host: Option<Arc<dyn EngineHost>>,
    templates: Option<Arc<dyn TemplateHost>>,
    volumes: Option<Arc<dyn VolumeHost>>,
}

async fn serve_connection(connection: Connection, hosts: Hosts) {
    let peer = connection.peer();
    let engine = match connection.hello().await {
        Ok(engine) => engine,
        Err(err) => {
            tracing::debug!(pid = peer.pid, "a helper connection ended before its hello: {err}");
            return;
        }
    };
    let hosts =
        ConnectionHosts { engine, host: hosts.engines.of(engine), templates: hosts.templates, volumes: hosts.volumes };
    loop {
        let incoming = match connection.recv().await {
            Ok(Some(incoming)) => incoming,
            Ok(None) => return,
            Err(err) => {
                // Out of step with the peer: say why, then hang up.
                tracing::warn!(pid = peer.pid, "closing a helper connection: {err}");
                let _ = connection.refuse(&err).await;
                return;
            }
        };
        if let Request::BuildTemplate { .. } | Request::ApplyLayer { .. } = incoming.request {
            if let Err(err) = serve_build(&connection, hosts.templates.clone(), incoming).await {
                tracing::warn!(pid = peer.pid, "answering a build: {err}");
                return;
            }
            continue;
        }
        if let Request::ExportTemplate { template } = incoming.request {
            // The frame's check made sure of its one descriptor: the file to write.
            let (templates, out) = (hosts.templates.clone(), incoming.fds.into_iter().next().map(std::fs::File::from));
            let exported = tokio::task::spawn_blocking(move || match (templates, out) {
                (Some(templates), Some(out)) => done(templates.export_template(&template, out)).reply,
                _ => Reply::refused(Refusal::BadRequest, "this helper does not serve templates"),
            })
            .await
            .unwrap_or_else(|err| Reply::refused(Refusal::Failed, format!("the export failed: {err}")));
            if let Err(err) = connection.send(&exported, &[]).await {
                tracing::warn!(pid = peer.pid, "answering an export: {err}");
                return;
            }
            continue;
        }
        let hosts = hosts.clone();
        let answer = tokio::task::spawn_blocking(move || answer(&hosts, incoming.request))
            .await
            .unwrap_or_else(|err| Reply::refused(Refusal::Failed, format!("the request failed: {err}")).into());
        let sent = match &answer.fd {
            Some(fd) => connection.send(&answer.reply, &[fd.as_fd()]).await,
            None => connection.send(&answer.reply, &[]).await,
        };
        // The peer holds its own copy of the descriptor now.
        drop(answer.fd);
        if let Some(finished) = answer.finished {
            let outcome = tokio::task::spawn_blocking(finished).await;
            let reply = match outcome {
                Ok(Ok(())) => Reply::Done {},
                Ok(Err(err)) => failed(err),
                Err(err) => Reply::refused(Refusal::Failed, format!("waiting for the engine: {err}")),
            };
            if sent.is_ok() {
                if let Err(err) = connection.send(&reply, &[]).await {
                    tracing::warn!(pid = peer.pid, "answering a start's end: {err}");
                    return;
                }
            }
        }
        if let Err(err) = sent {
            tracing::warn!(pid = peer.pid, "answering a helper request: {err}");
            return;
        }
    }
}

/// A request's work that reports its progress, then answers.
type StreamedWork = Box<dyn FnOnce(&mut dyn FnMut(BuildProgress)) -> Reply + Send>;

/// Runs a `BuildTemplate` or an `ApplyLayer` on a blocking thread and
/// answers each of its progress steps as it comes, then its end. A peer
/// that went away stops the answers, not the work (its build dir is
/// removed by the next build of that version or chain, or a deletion).
async fn serve_build(
    connection: &Connection,
    templates: Option<Arc<dyn TemplateHost>>,
    incoming: Incoming,
) -> Result<(), PeerError> {
    let Some(templates) = templates else {
        return connection
            .send(&Reply::refused(Refusal::BadRequest, "this helper does not build templates"), &[])
            .await;
    };
    // The frame's check made sure of their number: the log, then the
    // archive or the layer.
    let mut fds = incoming.fds.into_iter().map(std::fs::File::from);
    let (log, archive) = (fds.next(), fds.next());
    let Some(log) = log else {
        return connection.send(&Reply::refused(Refusal::BadRequest, "a build without its log"), &[]).await;
    };
    let work: StreamedWork = match (incoming.request, archive) {
        (Request::ApplyLayer { parent, layer, disk_mib }, Some(blob)) => Box::new(move |progress| {
            match templates.apply_layer(parent.as_ref(), &layer, disk_mib, blob, log, progress) {
                Ok(ready) => Reply::LayerReady { chain: ready.chain, bytes: ready.bytes, cached: ready.cached },
                Err(err) => failed(err),
            }
        }),
        (Request::BuildTemplate { template, source, disk_mib }, archive) => {
            let input = match (source, archive) {
                (BuildSource::OciArchive {}, Some(archive)) => BuildInput::OciArchive(archive),
                (BuildSource::RootTar {}, Some(archive)) => BuildInput::RootTar(archive),
                (BuildSource::Debian { suite, packages }, None) => BuildInput::Debian { suite, packages },
                (BuildSource::Layers { top }, None) => BuildInput::Layers { top },
                _ => {
                    let refusal = Reply::refused(
                        Refusal::BadRequest,
                        "an archive's build carries its archive, a Debian or layers' build none",
                    );
                    return connection.send(&refusal, &[]).await;
                }
            };
            Box::new(move |progress| match templates.build_template(&template, input, disk_mib, log, progress) {
                Ok(imported) => match serde_json::to_string(&imported).map(|json| TemplateMetaJson::parse(&json)) {
                    Ok(Ok(image)) => Reply::Built { image },
                    Ok(Err(err)) => Reply::refused(Refusal::Failed, format!("the image's record: {err}")),
                    Err(err) => Reply::refused(Refusal::Failed, format!("the image's record: {err}")),
                },
                Err(err) => failed(err),
            })
        }
        _ => return connection.send(&Reply::refused(Refusal::BadRequest, "a layer without its blob"), &[]).await,
    };
    let (steps, mut stepped) = tokio::sync::mpsc::unbounded_channel();
    let build = tokio::task::spawn_blocking(move || {
        work(&mut |progress| {
            let _ = steps.send(progress);
        })
    });
    while let Some(progress) = stepped.recv().await {
        connection.send(&progress_reply(progress), &[]).await?;
    }
    let reply = build.await.unwrap_or_else(|err| Reply::refused(Refusal::Failed, format!("the build failed: {err}")));
    connection.send(&reply, &[]).await
}

fn progress_reply(progress: BuildProgress) -> Reply {
    let amount = progress.amount.map(|amount| Amount {
        unit: if amount.unit == "packages" { AmountUnit::Packages } else { AmountUnit::Bytes },
        done: amount.done,
        total: amount.total,
    });
    Reply::Progress { step: tail(progress.step), done: progress.done, total: progress.total, amount }
}

/// The refusal an engine error becomes: its text, without the prefix the
/// client's error adds again.
fn failed(err: EngineError) -> Reply {
    let message = match err {
        EngineError::Runtime(message) => message,
        other => other.to_string(),
    };
    Reply::refused(Refusal::Failed, message)
}

fn done(result: Result<(), EngineError>) -> Answer {
    result.map_or_else(failed, |()| Reply::Done {}).into()
}

/// Runs `request` on the host method of the same name: the template
/// host's, or the connection's engine's.
fn answer(hosts: &ConnectionHosts, request: Request) -> Answer {
    match (request, hosts.host.as_deref()) {
        (Request::Hello { version, .. }, _) => Reply::Hello { version }.into(),
        (
            request @ (Request::BeginTemplate { .. }
            | Request::CopyCheckpoint { .. }
            | Request::PublishTemplate { .. }
            | Request::DeleteTemplate { .. }
            | Request::ClearStaleQuotas {}
            | Request::HasLayer { .. }
            | Request::ListLayers {}
            | Request::DeleteLayer { .. }),
            _,
        ) => match hosts.templates.as_deref() {
            Some(templates) => answer_template(templates, request),
            None => Reply::refused(Refusal::BadRequest, "this helper does not serve templates").into(),
        },
        (
            request @ (Request::CreateVolume { .. }
            | Request::DeleteVolume { .. }
            | Request::SnapshotVolume { .. }
            | Request::DeleteVolumeSnapshot { .. }
            | Request::RestoreVolume { .. }
            | Request::VolumeUsage { .. }
            | Request::ListVolumes {}
            | Request::VolumeFiles { .. }
            | Request::VolumeStore {}
            | Request::AttachVolume { .. }
            | Request::DetachVolume { .. }),
            _,
        ) => match hosts.volumes.as_deref() {
            Some(volumes) => answer_volume(volumes, request),
            None => Reply::refused(Refusal::BadRequest, "this helper does not serve volumes").into(),
        },
        (request, Some(host)) => answer_engine(hosts, host, request),
        (_, None) => {
            let engine = format!("{:?}", hosts.engine).to_lowercase();
            let refusal = match hosts.engine {
                Engine::Firecracker => format!(
                    "this helper runs no {engine} sandboxes (start it with --firecracker-bin or FIRECRACKER_BIN)"
                ),
                Engine::Gvisor => format!("this helper runs no {engine} sandboxes"),
            };
            Reply::refused(Refusal::BadRequest, refusal).into()
        }
    }
}

/// Runs an engine's `request` on its host's method of the same name.
fn answer_engine(hosts: &ConnectionHosts, host: &dyn EngineHost, request: Request) -> Answer {
    let templates = hosts.templates.as_deref();
    match request {
        Request::Start { engine, .. } if engine != hosts.engine => {
            Reply::refused(Refusal::BadRequest, "a start names the engine its connection's hello named").into()
        }
        Request::Start { sandbox, from, shape, mounts, .. } => match host.start(&sandbox, &from, shape, &mounts) {
            Ok(Launched { listener, pid, finished, steps }) => Answer {
                reply: Reply::Started { pid, steps: super::steps_to_wire(&steps) },
                fd: Some(listener.into()),
                finished: Some(finished),
            },
            Err(err) => failed(err).into(),
        },
        Request::Pause { sandbox } => done(host.pause(&sandbox)),
        Request::Resume { sandbox } => done(host.resume(&sandbox)),
        Request::Freeze { sandbox, frozen } => done(host.freeze(&sandbox, frozen)),
        Request::SetTimerSlack { sandbox, slack_ns } => match host.set_timer_slack(&sandbox, slack_ns) {
            Ok(tasks) => Reply::SlackSet { tasks: tasks.try_into().unwrap_or(u32::MAX) }.into(),
            Err(err) => failed(err).into(),
        },
        Request::Suspend { sandbox } => done(host.suspend(&sandbox)),
        // A template's image goes only into a build BeginTemplate made and
        // nothing filled yet, never over a published version or a build
        // half filled.
        Request::SaveImage { image: ImageRef::Template { ref template }, .. }
            if !templates.is_some_and(|templates| templates.empty_build(template)) =>
        {
            Reply::refused(
                Refusal::Conflict,
                format!("template {} has no new, empty build of version {}", template.name, template.version.get()),
            )
            .into()
        }
        Request::SaveImage { sandbox, image } => match host.save_image(&sandbox, &image) {
            Ok(frozen) => Reply::ImageSaved { frozen_us: frozen.as_micros() as u64 }.into(),
            Err(err) => failed(err).into(),
        },
        Request::DropImage { image: ImageRef::Template { .. }, .. } => {
            Reply::refused(Refusal::BadRequest, "a template's image is dropped with its template").into()
        }
        Request::DropImage { sandbox, image } => done(host.drop_image(&sandbox, &image)),
        Request::DropSnapshot { sandbox } => done(host.drop_snapshot(&sandbox)),
        Request::Stop { sandbox } => done(host.stop(&sandbox)),
        Request::StopStrays { sandbox } => {
            host.stop_strays(&sandbox);
            Reply::Done {}.into()
        }
        Request::SettleOrphans { sandboxes, patience_ms } => {
            host.settle_orphans(&sandboxes, patience_ms);
            Reply::Done {}.into()
        }
        Request::Destroy { sandbox } => done(host.destroy(&sandbox)),
        Request::State { sandbox } => Reply::State { state: host.state(&sandbox) }.into(),
        Request::States { sandboxes } => {
            let mut states = host.states(&sandboxes);
            states.truncate(MAX_LISTED);
            Reply::States { states }.into()
        }
        Request::ListenAgent { sandbox } => match host.listen_agent(&sandbox) {
            Ok(listener) => Answer { reply: Reply::Listening {}, fd: Some(listener.into()), finished: None },
            Err(err) => failed(err).into(),
        },
        Request::CloseAgent { sandbox } => {
            host.close_agent(&sandbox);
            Reply::Done {}.into()
        }
        Request::Availability {} => {
            let (available, detail) = host.availability();
            Reply::Availability { available, detail: tail(detail) }.into()
        }
        Request::EngineLog { sandbox } => Reply::Log { text: tail(host.engine_log(&sandbox)) }.into(),
        Request::HasCloneBase { template, shape } => match host.has_clone_base(&template, shape) {
            Ok(has) => Reply::Has { has }.into(),
            Err(err) => failed(err).into(),
        },
        Request::SaveCloneBase { sandbox, template } => done(host.save_clone_base(&sandbox, &template)),
        Request::SaveLayer { sandbox, parent, key } => {
            let Some(templates) = templates else {
                return Reply::refused(Refusal::BadRequest, "this helper does not serve templates").into();
            };
            // The root is kept as it is at rest, never while the step's
            // processes may still write to it.
            match host.state(&sandbox) {
                EngineState::Stopped | EngineState::Missing => {}
                running @ (EngineState::Running | EngineState::Paused) => {
                    let state = format!("{running:?}").to_lowercase();
                    return Reply::refused(
                        Refusal::Conflict,
                        format!("sandbox {sandbox} is {state}: a layer is saved of a stopped sandbox"),
                    )
                    .into();
                }
            }
            match templates.save_layer(&sandbox, &parent, &key) {
                Ok(ready) => Reply::LayerReady { chain: ready.chain, bytes: ready.bytes, cached: ready.cached }.into(),
                Err(err) => failed(err).into(),
            }
        }
        Request::Hello { .. }
        | Request::BeginTemplate { .. }
        | Request::CopyCheckpoint { .. }
        | Request::PublishTemplate { .. }
        | Request::DeleteTemplate { .. }
        | Request::ClearStaleQuotas {}
        | Request::Kill { .. }
        | Request::List {}
        | Request::ConnectVmm { .. }
        | Request::BuildTemplate { .. }
        | Request::ExportTemplate { .. }
        | Request::HasLayer { .. }
        | Request::ListLayers {}
        | Request::ApplyLayer { .. }
        | Request::DeleteLayer { .. }
        | Request::CreateVolume { .. }
        | Request::DeleteVolume { .. }
        | Request::SnapshotVolume { .. }
        | Request::DeleteVolumeSnapshot { .. }
        | Request::RestoreVolume { .. }
        | Request::VolumeUsage { .. }
        | Request::ListVolumes {}
        | Request::VolumeFiles { .. }
        | Request::VolumeStore {}
        | Request::AttachVolume { .. }
        | Request::DetachVolume { .. } => {
            Reply::refused(Refusal::BadRequest, "this helper does not serve that request yet").into()
        }
    }
}

/// Runs a template request on the [`TemplateHost`] method of its name.
fn answer_template(templates: &dyn TemplateHost, request: Request) -> Answer {
    match request {
        Request::BeginTemplate { template } => done(templates.begin_template(&template)),
        Request::CopyCheckpoint { template, sandbox, checkpoint } => {
            done(templates.copy_checkpoint(&template, &sandbox, &checkpoint))
        }
        Request::PublishTemplate { template, meta, ext4 } => done(templates.publish_template(&template, &meta, ext4)),
        Request::DeleteTemplate { name, version } => done(templates.delete_template(&name, version)),
        Request::ClearStaleQuotas {} => {
            templates.clear_stale_quotas();
            Reply::Done {}.into()
        }
        Request::HasLayer { chain } => match templates.has_layer(&chain) {
            Ok(has) => Reply::Has { has }.into(),
            Err(err) => failed(err).into(),
        },
        Request::DeleteLayer { chain } => done(templates.delete_layer(&chain)),
        Request::ListLayers {} => match templates.list_layers() {
            Ok(layers) => Reply::Layers { layers }.into(),
            Err(err) => failed(err).into(),
        },
        _ => Reply::refused(Refusal::BadRequest, "not a template request").into(),
    }
}

/// Runs a volume request on the [`VolumeHost`] method of its name.
fn answer_volume(volumes: &dyn VolumeHost, request: Request) -> Answer {
    match request {
        Request::CreateVolume { volume, size, from: None, image: true } => {
            done(volumes.create_image_volume(&volume, size))
        }
        Request::CreateVolume { volume, size, from, image: _ } => {
            done(volumes.create_volume(&volume, size, from.as_ref().map(|(source, snapshot)| (source, snapshot))))
        }
        Request::DeleteVolume { volume } => done(volumes.delete_volume(&volume)),
        Request::SnapshotVolume { volume, snapshot } => done(volumes.snapshot_volume(&volume, &snapshot)),
        Request::DeleteVolumeSnapshot { volume, snapshot } => done(volumes.delete_volume_snapshot(&volume, &snapshot)),
        Request::RestoreVolume { volume, snapshot } => done(volumes.restore_volume(&volume, &snapshot)),
        Request::VolumeUsage { volume } => match volumes.volume_usage(&volume) {
            Ok(usage) => Reply::VolumeUsage {
                used_bytes: usage.used_bytes,
                snapshots: usage
                    .snapshots
                    .into_iter()
                    .take(space_privsep::proto::MAX_VOLUME_SNAPSHOTS)
                    .map(|(snapshot, bytes)| SnapshotUsage { snapshot, bytes })
                    .collect(),
            }
            .into(),
            Err(err) => failed(err).into(),
        },
        Request::ListVolumes {} => match volumes.list_volumes() {
            Ok(found) => Reply::Volumes {
                volumes: found
                    .into_iter()
                    .take(MAX_LISTED)
                    .map(|mut entry| {
                        entry.snapshots.truncate(space_privsep::proto::MAX_VOLUME_SNAPSHOTS);
                        VolumeEntry { volume: entry.volume, snapshots: entry.snapshots }
                    })
                    .collect(),
            }
            .into(),
            Err(err) => failed(err).into(),
        },
        Request::VolumeStore {} => match volumes.shared_store() {
            Ok(store) => Reply::VolumeStore { store }.into(),
            Err(err) => failed(err).into(),
        },
        Request::AttachVolume { volume } => done(volumes.attach_volume(&volume)),
        Request::DetachVolume { volume } => done(volumes.detach_volume(&volume)),
        Request::VolumeFiles { volume, write } => match volumes.volume_files(&volume, write) {
            Ok(socket) => Answer { reply: Reply::VolumeFiles {}, fd: Some(socket.into()), finished: None },
            Err(err) => failed(err).into(),
        },
        _ => Reply::refused(Refusal::BadRequest, "not a volume request").into(),
    }
}

/// The end of `text`, within a reply's bound.
fn tail(text: String) -> String {
    if text.len() <= MAX_MESSAGE {
        return text;
    }
    let mut start = text.len() - MAX_MESSAGE;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}
