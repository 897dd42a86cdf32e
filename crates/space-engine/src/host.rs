//! The seam between an engine's logic and the privileged work it needs.
//!
//! [`EngineHost`] is everything an engine asks of the host that needs
//! root: each method is one request of `space_privsep::proto`
//! ([`Request`](space_privsep::proto::Request)), taking its checked types —
//! canonical ids, bounded sizes — and never a path: whoever serves it
//! derives paths from the ids inside its own data dir ([`Layout`]). Each
//! engine has one that does the work in process and as root (gVisor's
//! [`crate::gvisor::LocalHost`], Firecracker's
//! [`crate::firecracker::FirecrackerHost`]); [`crate::helper::HelperHost`]
//! sends the same requests to the root helper over its socket, so the
//! engine's own logic (the agent handshake, cgroup reads, what a status
//! means) runs unprivileged.
//!
//! The [`Engine`](crate::Engine) trait still speaks in
//! [`SandboxSpec`]s and paths; [`Placed`] turns them into the ids a request
//! names and refuses any path that is not where [`Layout`] puts it, and
//! `Hosted` is what both engines do alike with their host.

use std::os::unix::net::UnixListener;
use std::path::{Component, Path};
use std::sync::Arc;
use std::time::Duration;

use space_privsep::layout::Layout;
use space_privsep::proto::{
    ChainId, CheckpointName, DiskMib, EngineState, ImageRef, MemoryMib, Mount, MountPath, OperationId, PatienceMs,
    SandboxId, Shape, SlackNs, StartFrom, TemplateName, TemplateRef, TemplateVersion, Vcpus, VolumeId,
};

use crate::{EngineError, LiveStatus, SandboxSpec, Steps};

/// A sandbox's engine process, started, whose agent has yet to dial.
pub struct Launched {
    /// Where the agent dials (bound before the engine started).
    pub listener: UnixListener,
    /// The command that started the engine.
    pub pid: u32,
    /// Waits for the command that started the engine (`runsc run
    /// --detach` returns once the sandbox runs); its error says why it
    /// failed. Blocking.
    pub finished: Box<dyn FnOnce() -> Result<(), EngineError> + Send>,
    /// How long each step before the engine's start took.
    pub steps: Steps,
}

/// The privileged half of an engine: one method per request of
/// `space_privsep`'s set the engine needs. Every method blocks; the
/// engine calls them off its async threads.
pub trait EngineHost: Send + Sync {
    /// `Start`: the sandbox's root (a snapshot of `from`'s, under its
    /// disk quota) and bundle when it needs new ones, its agent's listener,
    /// then the engine. `mounts` are the volumes bound into it (checked
    /// together, `space_privsep::proto::check_mounts`); a start whose
    /// volume is not there is refused.
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<Launched, EngineError>;

    /// `Pause`: the engine stops the guest's tasks.
    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError>;

    /// `Resume`.
    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError>;

    /// `Freeze`: the cgroup freezer on every task of the sandbox, waited
    /// for until the kernel says it is done.
    fn freeze(&self, sandbox: &SandboxId, frozen: bool) -> Result<(), EngineError>;

    /// `SetTimerSlack` of every task of the sandbox's cgroup (`None`: the
    /// usual one); how many tasks it set.
    fn set_timer_slack(&self, sandbox: &SandboxId, slack: Option<SlackNs>) -> Result<usize, EngineError>;

    /// `Suspend`: checkpoint into the sandbox's own snapshot, then free the
    /// engine's state of it.
    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError>;

    /// `SaveImage`: memory and disk of one instant, the sandbox left as it
    /// was; how long it was frozen.
    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError>;

    /// `DropImage`: an image [`EngineHost::save_image`] saved under the
    /// sandbox, whole or half written; one not there is no error.
    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError>;

    /// `DropSnapshot`: the suspend snapshot a restore started from.
    fn drop_snapshot(&self, sandbox: &SandboxId) -> Result<(), EngineError>;

    /// `Stop`: the engine's processes and cgroups, not the disk.
    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError>;

    /// `StopStrays`: engine processes still working on the sandbox without
    /// an owner, killed and waited for.
    fn stop_strays(&self, sandbox: &SandboxId);

    /// `SettleOrphans`: waits for (then kills) the engine commands a killed
    /// server left running on `sandboxes`.
    fn settle_orphans(&self, sandboxes: &[SandboxId], patience: PatienceMs);

    /// `Destroy`: processes, cgroups, root, images and directory.
    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError>;

    /// `State`, asked of the engine itself.
    fn state(&self, sandbox: &SandboxId) -> EngineState;

    /// `States`: each from the engine's state files (its process checked
    /// alive), in order; asked of the engine for one whose file does not read.
    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState>;

    /// `ListenAgent`: a fresh listener where the agent redials (whatever
    /// stood at its socket's path goes first).
    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError>;

    /// `CloseAgent`: the agent is in; nobody else may connect.
    fn close_agent(&self, sandbox: &SandboxId);

    /// `Availability`: whether the engine can start sandboxes here, and its
    /// version or why not.
    fn availability(&self) -> (bool, String);

    /// `EngineLog`: the last lines of the engine's output of the sandbox.
    fn engine_log(&self, sandbox: &SandboxId) -> String;

    /// `HasCloneBase`: whether the template's microVM is saved for clones
    /// of `shape` (an engine without clones has none).
    fn has_clone_base(&self, _template: &TemplateRef, _shape: Shape) -> Result<bool, EngineError> {
        Ok(false)
    }

    /// `SaveCloneBase`: saves the sandbox — the template's microVM, its
    /// agent quiesced — as its template's clone base, then stops it.
    fn save_clone_base(&self, sandbox: &SandboxId, template: &TemplateRef) -> Result<(), EngineError> {
        Err(EngineError::Runtime(format!("{sandbox}: this engine makes no clone base (of template {})", template.name)))
    }
}

/// What every engine does the same way with its host: requests run off
/// the async threads, specs turned into the ids they name (refused when the
/// layout does not place them), states, redials and images.
pub(crate) struct Hosted {
    pub(crate) placed: Placed,
    pub(crate) host: Arc<dyn EngineHost>,
}

impl Hosted {
    pub(crate) fn new(layout: Layout, host: Arc<dyn EngineHost>) -> Hosted {
        Hosted { placed: Placed::new(layout), host }
    }

    /// Runs `work` with the host off the async threads.
    pub(crate) async fn on_host<T: Send + 'static>(
        &self,
        work: impl FnOnce(&dyn EngineHost) -> T + Send + 'static,
    ) -> Result<T, EngineError> {
        let host = self.host.clone();
        tokio::task::spawn_blocking(move || work(host.as_ref())).await.map_err(|e| EngineError::Runtime(e.to_string()))
    }

    /// Runs one request on the sandbox's host off the async threads.
    pub(crate) async fn ask<T: Send + 'static>(
        &self,
        spec: &SandboxSpec,
        work: impl FnOnce(&dyn EngineHost, &SandboxId) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, EngineError> {
        let sandbox = self.placed.sandbox(spec)?;
        self.on_host(move |host| work(host, &sandbox)).await?
    }

    /// The sandbox's id for a blocking call, logged and None when its spec
    /// is not one the layout places.
    pub(crate) fn sandbox_of(&self, spec: &SandboxSpec) -> Option<SandboxId> {
        self.placed.sandbox(spec).map_err(|err| tracing::warn!(sandbox = %spec.id, "{err}")).ok()
    }

    pub(crate) fn status(&self, spec: &SandboxSpec) -> LiveStatus {
        match self.sandbox_of(spec) {
            Some(sandbox) => live_status(self.host.state(&sandbox)),
            None => LiveStatus::Gone,
        }
    }

    /// Every spec's status in one `States` request (a spec the layout does
    /// not place is gone).
    pub(crate) fn statuses(&self, specs: &[SandboxSpec]) -> Vec<LiveStatus> {
        let ids: Vec<Option<SandboxId>> = specs.iter().map(|spec| self.sandbox_of(spec)).collect();
        let placed: Vec<SandboxId> = ids.iter().flatten().cloned().collect();
        let mut states = self.host.states(&placed).into_iter();
        ids.iter().map(|id| id.as_ref().and_then(|_| states.next()).map_or(LiveStatus::Gone, live_status)).collect()
    }

    /// A fresh listener where the agent redials, whose socket goes once
    /// the listener does.
    pub(crate) async fn redial(&self, spec: &SandboxSpec) -> Result<crate::AgentListener, EngineError> {
        let sandbox = self.placed.sandbox(spec)?;
        let id = sandbox.clone();
        let listener = self.on_host(move |host| host.listen_agent(&id)).await??;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(EngineError::io("socket"))?;
        let host = self.host.clone();
        Ok(crate::AgentListener::closing(listener, move || host.close_agent(&sandbox)))
    }

    pub(crate) async fn save_image(&self, spec: &SandboxSpec, image: &Path) -> Result<Duration, EngineError> {
        let (_, image) = self.placed.image(image)?;
        self.ask(spec, move |host, id| host.save_image(id, &image)).await
    }

    /// Drops an image the sandbox itself saved (never another's).
    pub(crate) async fn drop_image(&self, spec: &SandboxSpec, image: &Path) -> Result<(), EngineError> {
        let (owner, image) = self.placed.image(image)?;
        if owner.as_str() != spec.id {
            return Err(EngineError::Runtime(format!("the image is {owner}'s, not {}'s", spec.id)));
        }
        self.ask(spec, move |host, id| host.drop_image(id, &image)).await
    }

    pub(crate) fn stop(&self, spec: &SandboxSpec) -> Result<(), EngineError> {
        self.host.stop(&self.placed.sandbox(spec)?)
    }
}

/// What [`EngineState`] means to the rest of the platform.
pub fn live_status(state: EngineState) -> LiveStatus {
    match state {
        EngineState::Running => LiveStatus::Running,
        EngineState::Paused => LiveStatus::Paused,
        EngineState::Stopped | EngineState::Missing => LiveStatus::Gone,
    }
}

/// The ids a request names for a [`SandboxSpec`] and the image paths the
/// [`Engine`](crate::Engine) trait hands in, checked against [`Layout`]: a
/// spec whose directory or template root is not where the layout puts
/// them, or an image anywhere else, is refused rather than followed.
#[derive(Debug, Clone)]
pub struct Placed {
    layout: Layout,
}

impl Placed {
    pub fn new(layout: Layout) -> Placed {
        Placed { layout }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The sandbox's id, when its spec's directory is the layout's.
    pub fn sandbox(&self, spec: &SandboxSpec) -> Result<SandboxId, EngineError> {
        let id = SandboxId::parse(&spec.id).map_err(refused)?;
        if spec.dir != self.layout.sandbox_dir(&id) {
            return Err(EngineError::Runtime(format!(
                "sandbox {id}'s directory {} is not the data dir's {}",
                spec.dir.display(),
                self.layout.sandbox_dir(&id).display()
            )));
        }
        Ok(id)
    }

    /// The template version whose root the spec starts from.
    pub fn template(&self, spec: &SandboxSpec) -> Result<TemplateRef, EngineError> {
        let template = self
            .under("templates", &spec.template_rootfs)
            .and_then(|parts| match parts.as_slice() {
                [name, version, root] if root == "rootfs" => template_ref(name, version),
                _ => None,
            })
            .filter(|template| self.layout.template_root(template) == spec.template_rootfs);
        template.ok_or_else(|| {
            EngineError::Runtime(format!("{} is no template root of the data dir", spec.template_rootfs.display()))
        })
    }

    /// Where a cold boot of the spec starts: its template root, or for a
    /// build sandbox a layer chain of the cache (its `template_rootfs` the
    /// chain's root, `Layout::layer_root`).
    pub fn start_from(&self, spec: &SandboxSpec) -> Result<StartFrom, EngineError> {
        if let Some(chain) = self.chain(&spec.template_rootfs) {
            return Ok(StartFrom::Layer { chain });
        }
        Ok(StartFrom::Template { template: self.template(spec)? })
    }

    /// The layer chain whose root `path` is, if it is one.
    pub fn chain(&self, path: &Path) -> Option<ChainId> {
        let parts = self.under("cache", path)?;
        let [layers, chain, root] = parts.as_slice() else { return None };
        let chain = ChainId::parse(chain).ok().filter(|_| layers == "layers" && root == "rootfs")?;
        (self.layout.layer_root(&chain) == path).then_some(chain)
    }

    /// The volumes bound into the sandbox, as a `Start` names them: each
    /// id and path checked, and all of them together.
    pub fn mounts(spec: &SandboxSpec) -> Result<Vec<Mount>, EngineError> {
        let mounts = spec
            .volumes
            .iter()
            .map(|mount| {
                Ok(Mount {
                    volume: VolumeId::parse(&mount.volume).map_err(refused)?,
                    path: MountPath::parse(&mount.path).map_err(refused)?,
                    read_only: mount.read_only,
                })
            })
            .collect::<Result<Vec<Mount>, EngineError>>()?;
        space_privsep::proto::check_mounts(&mounts).map_err(refused)?;
        Ok(mounts)
    }

    /// The sizes of the sandbox, in the request set's bounds.
    pub fn shape(spec: &SandboxSpec) -> Result<Shape, EngineError> {
        Ok(Shape {
            memory_mib: MemoryMib::new(spec.memory_mib).map_err(refused)?,
            vcpus: Vcpus::new(spec.vcpus.max(1)).map_err(refused)?,
            disk_mib: DiskMib::new(spec.disk_mib).map_err(refused)?,
        })
    }

    /// Which image `path` is: one saved under a sandbox (a fork's, a
    /// checkpoint) or a snapshot template's build dir.
    pub fn image(&self, path: &Path) -> Result<(SandboxId, ImageRef), EngineError> {
        self.saved_image(path).ok_or_else(|| EngineError::Runtime(format!("{} is no image dir", path.display())))
    }

    fn saved_image(&self, path: &Path) -> Option<(SandboxId, ImageRef)> {
        if let Some(parts) = self.under("sandboxes", path) {
            let [sandbox, kind, name] = parts.as_slice() else { return None };
            let sandbox = SandboxId::parse(sandbox).ok()?;
            let image = match kind.as_str() {
                "images" => ImageRef::Fork { operation: OperationId::parse(name).ok()? },
                "checkpoints" => ImageRef::Checkpoint { name: CheckpointName::parse(name).ok()? },
                _ => return None,
            };
            return (self.layout.image_dir(&sandbox, &image) == path).then_some((sandbox, image));
        }
        let parts = self.under("templates", path)?;
        let [name, partial] = parts.as_slice() else { return None };
        let version = partial.strip_prefix('.')?.strip_suffix(".partial")?;
        let template = template_ref(name, version)?;
        let image = ImageRef::Template { template };
        // Whichever sandbox saves a template's image, the place is the same.
        let anyone = SandboxId::parse("sbx_00000000000000000000").ok()?;
        (self.layout.image_dir(&anyone, &image) == path).then_some((anyone, image))
    }

    /// Where a sandbox starts from when it starts from the image at `path`:
    /// a saved image of a sandbox, or a published snapshot template.
    pub fn start_from_image(&self, path: &Path) -> Result<StartFrom, EngineError> {
        if let Some((source, image @ (ImageRef::Fork { .. } | ImageRef::Checkpoint { .. }))) = self.saved_image(path) {
            return Ok(StartFrom::Image { source, image });
        }
        let template = self
            .under("templates", path)
            .and_then(|parts| match parts.as_slice() {
                [name, version] => template_ref(name, version),
                _ => None,
            })
            .filter(|template| self.layout.template_dir(template) == path);
        match template {
            Some(template) => Ok(StartFrom::TemplateImage { template }),
            None => Err(EngineError::Runtime(format!("{} is no image a sandbox starts from", path.display()))),
        }
    }

    /// `path`'s components below `data_dir/top`, when all are plain names.
    fn under(&self, top: &str, path: &Path) -> Option<Vec<String>> {
        let rest = path.strip_prefix(self.layout.data_dir().join(top)).ok()?;
        rest.components()
            .map(|c| match c {
                Component::Normal(name) => name.to_str().map(str::to_string),
                _ => None,
            })
            .collect()
    }
}

fn template_ref(name: &str, version: &str) -> Option<TemplateRef> {
    // The version's spelling must be the one the layout writes ("3", not "03").
    let number: u32 = version.parse().ok()?;
    let template = TemplateRef { name: TemplateName::parse(name).ok()?, version: TemplateVersion::new(number).ok()? };
    (template.version.get().to_string() == version).then_some(template)
}

fn refused(err: space_privsep::proto::ProtoError) -> EngineError {
    EngineError::Runtime(err.to_string())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use space_host::datadir::DataDir;

    use super::*;

    const SBX: &str = "sbx_0123456789abcdef0123";

    fn data_dir() -> (PathBuf, DataDir) {
        let root =
            std::env::temp_dir().join(format!("space-placed-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let data = DataDir::open_on_any_filesystem(&root).unwrap();
        (root, data)
    }

    /// The helper derives every path from ids with `Layout`; the platform
    /// writes them with `DataDir` (and the formulas of the node's
    /// checkpoints and forks). They must name the same places.
    #[test]
    fn the_layout_and_the_data_dir_name_the_same_places() {
        let (root, data) = data_dir();
        let layout = Layout::new(data.root());
        let sandbox = SandboxId::parse(SBX).unwrap();
        let template =
            TemplateRef { name: TemplateName::parse("base").unwrap(), version: TemplateVersion::new(3).unwrap() };
        assert_eq!(layout.sandbox_dir(&sandbox), data.sandbox_dir(SBX));
        assert_eq!(layout.sandbox_root(&sandbox), data.sandbox_dir(SBX).join("rootfs"));
        assert_eq!(layout.runsc_state(), data.run_dir().join("runsc"));
        assert_eq!(layout.template_dir(&template), data.templates_dir().join("base").join("3"));
        assert_eq!(layout.template_root(&template), data.templates_dir().join("base/3/rootfs"));
        // A snapshot template's build dir (`BeginTemplate`).
        assert_eq!(layout.template_partial(&template), data.templates_dir().join("base").join(".3.partial"));
        // space-node: a fork's image (actor.rs) and a checkpoint (checkpoints.rs).
        let fork = ImageRef::Fork { operation: OperationId::parse("op_00112233445566778899").unwrap() };
        assert_eq!(
            layout.image_dir(&sandbox, &fork),
            data.sandbox_dir(SBX).join("images").join("op_00112233445566778899")
        );
        let checkpoint = ImageRef::Checkpoint { name: CheckpointName::parse("before").unwrap() };
        assert_eq!(layout.image_dir(&sandbox, &checkpoint), data.sandbox_dir(SBX).join("checkpoints").join("before"));
        std::fs::remove_dir_all(root).unwrap();
    }

    fn spec(data: &DataDir) -> SandboxSpec {
        SandboxSpec {
            id: SBX.into(),
            dir: data.sandbox_dir(SBX),
            template_rootfs: data.templates_dir().join("base/3/rootfs"),
            vcpus: 2,
            memory_mib: 512,
            disk_mib: 1024,
            ..Default::default()
        }
    }

    #[test]
    fn a_spec_and_the_paths_it_is_handed_become_the_ids_a_request_names() {
        let (root, data) = data_dir();
        let placed = Placed::new(Layout::new(data.root()));
        let spec = spec(&data);
        assert_eq!(placed.sandbox(&spec).unwrap().as_str(), SBX);
        let template = placed.template(&spec).unwrap();
        assert_eq!((template.name.as_str(), template.version.get()), ("base", 3));
        let shape = Placed::shape(&spec).unwrap();
        assert_eq!((shape.memory_mib.get(), shape.vcpus.get(), shape.disk_mib.get()), (512, 2, 1024));

        let fork = data.sandbox_dir(SBX).join("images/op_00112233445566778899");
        let (source, image) = placed.image(&fork).unwrap();
        assert_eq!(source.as_str(), SBX);
        assert!(matches!(image, ImageRef::Fork { ref operation } if operation.as_str() == "op_00112233445566778899"));
        assert!(matches!(
            placed.start_from_image(&fork).unwrap(),
            StartFrom::Image { image: ImageRef::Fork { .. }, .. }
        ));
        let checkpoint = data.sandbox_dir(SBX).join("checkpoints/before");
        assert!(
            matches!(placed.image(&checkpoint).unwrap().1, ImageRef::Checkpoint { ref name } if name.as_str() == "before")
        );
        let building = data.templates_dir().join("snap/.7.partial");
        assert!(
            matches!(placed.image(&building).unwrap().1, ImageRef::Template { ref template } if template.version.get() == 7)
        );
        assert!(placed.start_from_image(&building).is_err(), "a template is started from once published");
        // A build sandbox's spec names a layer chain's root.
        assert!(matches!(placed.start_from(&spec).unwrap(), StartFrom::Template { .. }));
        let chain = "ab".repeat(32);
        let mut build = spec.clone();
        build.template_rootfs = data.root().join("cache/layers").join(&chain).join("rootfs");
        assert!(matches!(placed.start_from(&build).unwrap(), StartFrom::Layer { chain: ref c } if c.as_str() == chain));
        for elsewhere in [
            format!("cache/layers/{chain}"),
            format!("cache/layers/.{chain}.partial/rootfs"),
            format!("cache/apt/{chain}/rootfs"),
            format!("cache/layers/{}/rootfs", "AB".repeat(32)),
        ] {
            build.template_rootfs = data.root().join(elsewhere);
            assert!(placed.start_from(&build).is_err(), "{}", build.template_rootfs.display());
        }
        let published = data.templates_dir().join("snap/7");
        assert!(
            matches!(placed.start_from_image(&published).unwrap(), StartFrom::TemplateImage { ref template } if template.name.as_str() == "snap")
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_path_the_layout_does_not_make_is_refused() {
        let (root, data) = data_dir();
        let placed = Placed::new(Layout::new(data.root()));
        let mut elsewhere = spec(&data);
        elsewhere.dir = PathBuf::from("/var/lib/other-space/sandboxes").join(SBX);
        assert!(placed.sandbox(&elsewhere).is_err());
        let mut not_canonical = spec(&data);
        not_canonical.id = "sbx_../../etc".into();
        assert!(placed.sandbox(&not_canonical).is_err());
        let mut other_root = spec(&data);
        other_root.template_rootfs = PathBuf::from("/");
        assert!(placed.template(&other_root).is_err());
        other_root.template_rootfs = data.templates_dir().join("base/03/rootfs");
        assert!(placed.template(&other_root).is_err(), "a version in another spelling");
        let mut huge = spec(&data);
        huge.memory_mib = u32::MAX;
        assert!(Placed::shape(&huge).is_err());
        for image in [
            data.sandbox_dir(SBX).join("images/op_00112233445566778899/.."),
            data.sandbox_dir(SBX).join("images/../checkpoints/before"),
            data.sandbox_dir(SBX).join("rootfs"),
            data.sandbox_dir(SBX).join("snapshot"),
            data.run_dir().join("runsc"),
            data.templates_dir().join("snap/.7.partial/rootfs"),
            PathBuf::from("/var/lib/other-space/sandboxes").join(SBX).join("images/op_00112233445566778899"),
            PathBuf::from("/"),
        ] {
            assert!(placed.image(&image).is_err(), "{image:?}");
            assert!(placed.start_from_image(&image).is_err(), "{image:?}");
        }
        std::fs::remove_dir_all(root).unwrap();
    }
}
