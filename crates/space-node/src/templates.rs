//! Templates as the API sees them: built from Debian packages as an
//! operation (with progress and a log), listed, inspected and deleted.
//! Versions live on disk (`space-host`); builds in progress live here.

use std::sync::Arc;

use space_api::{
    CreateTemplateRequest, ErrorCode, Operation, OperationKind, Template, TemplateDefaults, TemplateDefaultsRequest,
    TemplateState,
};
use space_engine::privsep::layout::Layout;
use space_engine::privsep::proto::{
    DiskMib, PackageName, ProtoError, Suite, TemplateMetaJson, TemplateName, TemplateRef, TemplateVersion,
};
use space_engine::templates::{BuildInput, LocalTemplates, TemplateHost};
use space_host::template::{valid_name, BuildProgress, DefaultsOverride, TemplateInfo, TemplateMeta, BUILD_STEPS};
use space_host::HostError;

use crate::tenants::Caller;

use crate::domain::{MAX_DISK_MIB, MAX_MEMORY_MIB, MAX_VCPUS, MIN_DISK_MIB, MIN_MEMORY_MIB};
use crate::error::NodeError;
use crate::platform::{new_operation, Platform};
pub(crate) use crate::state::builds::Building;
pub use space_core::error::template_not_found;

/// A template name reserved for one build, from before its upload until
/// the build ends; dropping it frees the name.
pub struct BuildSlot {
    platform: Arc<Platform>,
    pub(crate) name: String,
    pub(crate) owner: Option<String>,
    pub(crate) tenant: String,
}

impl Drop for BuildSlot {
    fn drop(&mut self) {
        self.platform.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.name);
    }
}

/// An uploaded image archive on disk, removed when dropped.
pub struct Upload {
    pub path: std::path::PathBuf,
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A name or size out of the helper's bounds fails the build as the input's fault.
pub(crate) fn wire<T>(checked: Result<T, ProtoError>) -> Result<T, HostError> {
    checked.map_err(|err| HostError::Invalid(err.to_string()))
}

/// The root work of a build failed: the input's own fault is told, the
/// rest stays in the logs.
pub(crate) fn host_failed(err: space_engine::EngineError) -> HostError {
    match space_engine::templates::invalid_input(&err) {
        Some(why) => HostError::Invalid(why.to_string()),
        None => HostError::CommandFailed {
            command: "template host".into(),
            status: "failed".into(),
            stderr: err.to_string(),
        },
    }
}

/// A build's disk allowance as the quota the helper sets, in whole MiB.
pub(crate) fn build_disk_mib(bytes: u64) -> Result<DiskMib, HostError> {
    let mib = (bytes >> 20).clamp(DiskMib::MIN.into(), DiskMib::MAX.into());
    wire(DiskMib::new(u32::try_from(mib).unwrap_or(DiskMib::MAX)))
}

/// A template version written out for another node of the cluster: a
/// tar of its root, and its `template.json`.
pub struct Export {
    pub meta: TemplateMeta,
    pub tar: std::path::PathBuf,
    /// SHA-256 of the tar, hex: its address, which the puller checks.
    pub sha256: String,
}

/// A build's log, in the log dir this server owns.
pub(crate) fn open_log(path: &std::path::Path) -> Result<std::fs::File, HostError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(HostError::io("creating the log dir"))?;
    }
    std::fs::File::create(path).map_err(HostError::io("creating the build log"))
}

/// A build whose disk allowance could not be worked out does not start.
pub(crate) fn quota_unknown(err: NodeError) -> HostError {
    HostError::Invalid(format!("the build's disk allowance is unknown: {}", err.message))
}

fn valid_package(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && name.len() <= 128
        && bytes[0].is_ascii_alphanumeric()
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.:".contains(b))
}

/// Checks a request's defaults and keeps only what it set.
pub fn checked_overrides(given: TemplateDefaultsRequest) -> Result<DefaultsOverride, NodeError> {
    let in_range = |v: Option<u32>, min: u32, max: u32| v.is_none_or(|v| (min..=max).contains(&v));
    if !in_range(given.vcpus, 1, MAX_VCPUS)
        || !in_range(given.memory_mib, MIN_MEMORY_MIB, MAX_MEMORY_MIB)
        || !in_range(given.disk_mib, MIN_DISK_MIB, MAX_DISK_MIB)
        || given.workdir.as_deref().is_some_and(|w| !w.starts_with('/'))
    {
        return Err(NodeError::unprocessable(
            "defaults out of range (vcpus, memory_mib, disk_mib) or a relative workdir",
        ));
    }
    crate::domain::validate_env(&given.env)?;
    if let Some(user) = &given.user {
        if user.is_empty() || user.len() > 64 || user.contains(['\0', '\n']) {
            return Err(NodeError::unprocessable(format!("not a user: {user:?}")));
        }
    }
    let network = match given.network {
        Some(network) if !network.secrets.is_empty() => {
            return Err(NodeError::unprocessable(
                "a template's network cannot bind secrets (they belong to a tenant: bind them at create)",
            )
            .with_details(serde_json::json!({"field": "defaults.network"})));
        }
        Some(network) => Some(serde_json::to_value(crate::domain::checked_network(network)?).unwrap_or_default()),
        None => None,
    };
    if let Some(command) = &given.command {
        let total: usize = command.iter().map(String::len).sum();
        if command.is_empty() || command.len() > 256 || total > 64 << 10 || command.iter().any(|a| a.contains('\0')) {
            return Err(NodeError::unprocessable(
                "defaults.command is 1 to 256 arguments, 64 KiB in all, without NUL bytes",
            )
            .with_details(serde_json::json!({"field": "defaults.command"})));
        }
    }
    Ok(DefaultsOverride {
        network,
        vcpus: given.vcpus,
        memory_mib: given.memory_mib,
        disk_mib: given.disk_mib,
        env: given.env,
        workdir: given.workdir,
        user: given.user,
        command: given.command,
    })
}

/// A template's engine setting: `gvisor`, `firecracker`, or none.
/// The engine a build asks for, if this host can build a template for it:
/// a firecracker template needs the ext4 image a host makes only with
/// `--ext4-images` (on by default where there is vmx/svm); without it every
/// create from the template would fail.
pub fn checked_engine(engine: Option<String>, makes_ext4_images: bool) -> Result<Option<String>, NodeError> {
    match engine.as_deref() {
        None | Some("gvisor") => Ok(engine),
        Some("firecracker") if makes_ext4_images => Ok(engine),
        Some("firecracker") => Err(NodeError::unprocessable(
            "this host makes no ext4 images (--ext4-images): a firecracker template cannot be built here",
        )
        .with_details(serde_json::json!({"field": "engine"}))),
        Some(other) => Err(NodeError::unprocessable(format!("engine must be gvisor or firecracker, got {other:?}"))),
    }
}

fn api_template(info: &TemplateInfo, building: Option<String>) -> Template {
    let d = &info.meta.defaults;
    Template {
        name: info.meta.name.clone(),
        state: TemplateState::Ready,
        version: Some(info.meta.version),
        source: info.meta.source.clone(),
        defaults: Some(TemplateDefaults {
            vcpus: d.vcpus,
            memory_mib: d.memory_mib,
            disk_mib: d.disk_mib,
            env: d.env.clone(),
            workdir: d.workdir.clone(),
            user: d.user.clone(),
            network: d.network.clone().and_then(|n| serde_json::from_value(n).ok()),
            command: d.command.clone(),
        }),
        created_at: space_api::Timestamp::parse(&info.meta.created_at),
        building_operation: building,
        engine: info.meta.engine.clone(),
    }
}

/// What runs a build, on a blocking thread: the platform, the operation's
/// id and a progress sink in, the published template out.
type BuildJob =
    Box<dyn FnOnce(&Platform, &str, &mut dyn FnMut(BuildProgress)) -> Result<TemplateInfo, HostError> + Send>;

impl Platform {
    /// Reserves `name` for a build by `caller`: 400 for a bad name, 409
    /// while another build of it runs or when the name is someone else's
    /// (a tenant's builds are its own; the operator's are shared).
    pub fn reserve_build(
        self: &Arc<Self>,
        name: &str,
        source: serde_json::Value,
        caller: &Caller,
    ) -> Result<BuildSlot, NodeError> {
        if !valid_name(name) {
            return Err(NodeError::bad_request(format!(
                "template names are 1-63 lowercase letters, digits, '-' or '_', got {name:?}"
            )));
        }
        let owner = (!caller.is_operator()).then(|| caller.tenant.clone());
        self.check_reserve("build a template", 0)?;
        self.check_disk_quota(&caller.tenant, 0, "build a template")?;
        let mut builds = self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner());
        if builds.contains_key(name) && caller.sees_template(builds[name].owner.as_deref()) {
            return Err(NodeError::new(
                ErrorCode::BuildInProgress,
                format!("template {name:?} is being built already"),
            ));
        }
        let current =
            builds.get(name).map(|b| b.owner.clone()).or_else(|| self.data.template(name).map(|t| t.meta.owner));
        if current.is_some_and(|current| current != owner) {
            return Err(NodeError::new(
                ErrorCode::NameTaken,
                format!("the template name {name:?} is taken; choose another"),
            ));
        }
        builds.insert(name.to_string(), Building { operation: None, source, owner: owner.clone() });
        Ok(BuildSlot { platform: self.clone(), name: name.to_string(), owner, tenant: caller.tenant.clone() })
    }

    /// Accepts a template build (from Debian packages, or a snapshot
    /// template from a sandbox or a checkpoint) and runs it in the
    /// background.
    pub fn build_template(
        self: &Arc<Self>,
        request: CreateTemplateRequest,
        caller: &Caller,
    ) -> Result<(Template, Operation), NodeError> {
        let from = &request.from;
        let debian = match (&from.debian, &from.sandbox, &from.checkpoint) {
            (Some(debian), None, None) => debian,
            (None, Some(sandbox), None) => return self.snapshot_template(&request, caller, sandbox, None),
            (None, None, Some(checkpoint)) => {
                return self.snapshot_template(&request, caller, &checkpoint.sandbox, Some(&checkpoint.name))
            }
            _ => {
                return Err(NodeError::unprocessable("`from` names exactly one of debian, sandbox or checkpoint")
                    .with_details(serde_json::json!({"field": "from"})))
            }
        };
        if debian.packages.is_empty() || debian.packages.len() > 500 {
            return Err(NodeError::unprocessable("give between 1 and 500 packages"));
        }
        if let Some(bad) = debian.packages.iter().find(|p| !valid_package(p)) {
            return Err(NodeError::unprocessable(format!("not a Debian package name: {bad:?}")));
        }
        if debian.suite.is_empty() || !debian.suite.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(NodeError::unprocessable(format!("not a Debian suite: {:?}", debian.suite)));
        }
        let defaults = checked_overrides(request.defaults.clone())?.apply(Default::default());
        let engine = checked_engine(request.engine.clone(), self.data.ext4_images())?;
        let source = serde_json::json!({"debian": {"suite": debian.suite, "packages": debian.packages}});
        let slot = self.reserve_build(&request.name, source, caller)?;
        let (name, suite, packages) = (request.name.clone(), debian.suite.clone(), debian.packages.clone());
        let (owner, tenant) = (slot.owner.clone(), slot.tenant.clone());
        self.start_build(
            slot,
            Box::new(move |platform, operation_id, progress| {
                let grant = platform.grant_build_allowance(&tenant).map_err(quota_unknown)?;
                let suite = wire(Suite::parse(&suite))?;
                // A package named twice is installed once.
                let mut seen = std::collections::HashSet::new();
                let packages: Vec<PackageName> = packages
                    .iter()
                    .filter(|name| seen.insert(name.as_str()))
                    .map(|name| wire(PackageName::parse(name)))
                    .collect::<Result<_, _>>()?;
                let log = open_log(&platform.data.log_path(operation_id))?;
                let disk_mib = build_disk_mib(grant.bytes)?;
                let ext4 = platform.data.ext4_images();
                let built = platform.publish_version(&name, ext4, |template, _| {
                    let input = BuildInput::Debian { suite, packages };
                    let built = platform
                        .template_host()
                        .build_template(template, input, disk_mib, log, progress)
                        .map_err(host_failed)?;
                    Ok(TemplateMeta::unpublished(&name, built.source, defaults, owner, engine))
                });
                drop(grant);
                built
            }),
        )
    }

    /// Accepts a snapshot template of a running (or paused) sandbox or of
    /// one of its checkpoints: its sandboxes start from that memory and
    /// disk, with the source's vCPUs and memory (other defaults may be
    /// given). From a sandbox, its actor saves the image (the sandbox runs
    /// on, frozen only for that); from a checkpoint, the image is copied.
    fn snapshot_template(
        self: &Arc<Self>,
        request: &CreateTemplateRequest,
        caller: &Caller,
        sandbox_id: &str,
        checkpoint: Option<&str>,
    ) -> Result<(Template, Operation), NodeError> {
        let id = crate::ids::SandboxId::parse(sandbox_id).ok_or_else(|| NodeError::not_found("sandbox", sandbox_id))?;
        // The operator may make a shared template of any tenant's sandbox.
        let record = match caller.is_operator() {
            true => self.sandbox(id.as_str())?,
            false => self.sandbox_for(caller, &id)?.into_record(),
        };
        // A checkpoint's name is one path segment of ours (`..` or `/` in it
        // would read another directory of the host as a checkpoint).
        if let Some(name) = checkpoint.filter(|name| !space_host::template::valid_name(name)) {
            return Err(crate::checkpoints::checkpoint_not_found(sandbox_id, name));
        }
        self.can_save_images(&record)?;
        if let Some(mount) = record.sandbox.volumes.first() {
            return Err(NodeError::new(
                space_api::ErrorCode::NotSupported,
                format!(
                    "sandbox {} mounts volume {:?}: a template carries no volume; make it from a sandbox without volumes",
                    record.sandbox.id, mount.name
                ),
            ));
        }
        let given = checked_overrides(request.defaults.clone())?;
        if given.vcpus.is_some() || given.memory_mib.is_some() {
            return Err(NodeError::unprocessable("a snapshot template keeps its sandbox's vcpus and memory_mib"));
        }
        if request.engine.as_ref().is_some_and(|engine| *engine != record.sandbox.engine) {
            return Err(NodeError::unprocessable(format!("a snapshot template runs on {}", record.sandbox.engine)));
        }
        let at = checkpoint.map(|name| crate::checkpoints::CheckpointAt::new(&self.data, sandbox_id, name));
        let session = match (&at, checkpoint) {
            (Some(at), Some(name)) => {
                let meta = at.meta().ok_or_else(|| crate::checkpoints::checkpoint_not_found(sandbox_id, name))?;
                meta.agent_session
            }
            _ => {
                let state = record.sandbox.state;
                if !matches!(state, space_api::SandboxState::Running | space_api::SandboxState::Paused) {
                    return Err(NodeError::invalid_state("sandbox", state.as_str(), "make a template of it"));
                }
                record.agent_session
            }
        };
        let (Some(agent_session), Some(channel_key)) = (session, record.channel_key.clone()) else {
            return Err(NodeError::invalid_state("sandbox", record.sandbox.state.as_str(), "make a template of it"));
        };
        let version =
            self.data.templates_dir().join(&record.sandbox.template).join(record.template_version.to_string());
        let base = TemplateInfo::load(&version).map(|t| t.meta.defaults).unwrap_or_default();
        // The request's defaults over the source's (its sizes, its
        // template's env, workdir, user and network).
        let defaults = given.apply(DefaultsOverride {
            vcpus: Some(record.sandbox.vcpus),
            memory_mib: Some(record.sandbox.memory_mib),
            disk_mib: Some(record.sandbox.disk_mib),
            env: base.env,
            workdir: Some(base.workdir),
            user: Some(base.user),
            network: base.network,
            command: base.command,
        });
        let source = match checkpoint {
            Some(name) => serde_json::json!({"checkpoint": {"sandbox": sandbox_id, "name": name}}),
            None => serde_json::json!({"sandbox": sandbox_id}),
        };
        let image = (u64::from(record.sandbox.memory_mib) << 20) + crate::state::disk::SNAPSHOT_OVERHEAD_BYTES;
        self.check_disk_quota(&caller.tenant, image, "make a snapshot template (it holds the sandbox's memory)")?;
        let slot = self.reserve_build(&request.name, source.clone(), caller)?;
        let meta = space_host::template::TemplateMeta {
            image: Some(space_host::template::TemplateImage { agent_session, channel_key }),
            ..TemplateMeta::unpublished(
                &request.name,
                source,
                defaults,
                slot.owner.clone(),
                Some(record.sandbox.engine.clone()),
            )
        };
        let (platform, sandbox_id) = (self.clone(), sandbox_id.to_string());
        let checkpoint = checkpoint.map(str::to_string);
        let runtime = tokio::runtime::Handle::current();
        self.start_build(
            slot,
            Box::new(move |_, operation_id, progress| {
                progress(BuildProgress::step("saving the sandbox's memory and disk", 1));
                platform.publish_version(&meta.name.clone(), false, |template, partial| {
                    let host = platform.template_host();
                    host.begin_template(template).map_err(host_failed)?;
                    match &checkpoint {
                        Some(name) => {
                            let sandbox = wire(space_engine::privsep::proto::SandboxId::parse(&sandbox_id))?;
                            let name = wire(space_engine::privsep::proto::CheckpointName::parse(name))?;
                            host.copy_checkpoint(template, &sandbox, &name).map_err(host_failed)?
                        }
                        None => runtime
                            .block_on(platform.save_image_of(&sandbox_id, operation_id, partial))
                            .map_err(|err| HostError::Invalid(err.to_string()))?,
                    }
                    Ok(meta)
                })
            }),
        )
    }

    /// Who does templates' root work: this process, or the root helper.
    pub(crate) fn template_host(&self) -> Arc<dyn TemplateHost> {
        self.template_host
            .get_or_init(|| Arc::new(LocalTemplates::new(Layout::new(self.data.root()), self.agent_bin.clone())))
            .clone()
    }

    /// Publishes the next version of template `name`: `build` makes its
    /// build dir (for the version in the [`TemplateRef`] it is given, at the
    /// path beside it) and fills it, and returns the record to publish,
    /// whose version and time are set here; with `ext4`, a microVM's root
    /// drive is made of the root (with the record's `disk_mib` of room). On failure nothing of it is left.
    pub(crate) fn publish_version(
        &self,
        name: &str,
        ext4: bool,
        build: impl FnOnce(&TemplateRef, &std::path::Path) -> Result<TemplateMeta, HostError>,
    ) -> Result<TemplateInfo, HostError> {
        let version = self.data.template(name).map(|t| t.meta.version + 1).unwrap_or(1);
        let template =
            TemplateRef { name: wire(TemplateName::parse(name))?, version: wire(TemplateVersion::new(version))? };
        let layout = Layout::new(self.data.root());
        let host = self.template_host();
        let published = build(&template, &layout.template_partial(&template))
            .and_then(|mut meta| {
                meta.name = name.to_string();
                meta.version = version;
                meta.created_at = space_host::now_rfc3339();
                let record = serde_json::to_string(&meta).map_err(|err| HostError::Invalid(err.to_string()))?;
                let room = match ext4 {
                    true => Some(wire(DiskMib::new(meta.defaults.disk_mib))?),
                    false => None,
                };
                Ok((wire(TemplateMetaJson::parse(&record))?, room))
            })
            .and_then(|(record, room)| host.publish_template(&template, &record, room).map_err(host_failed))
            .and_then(|()| TemplateInfo::load(&layout.template_dir(&template)));
        if published.is_err() {
            if let Err(err) = host.delete_template(&template.name, Some(template.version)) {
                tracing::warn!(template = %template.name, "removing a failed build: {err}");
            }
        }
        published
    }

    /// The newest version of template `name` as a tar of its root, for
    /// another node of the cluster: written once per version by whoever
    /// does templates' root work (the helper reads every file of the root;
    /// this server cannot) into a file of the uploads dir this server
    /// opened, then reused.
    pub fn export_template(&self, name: &str) -> Result<Export, HostError> {
        use sha2::Digest as _;
        let template = self.data.template(name).ok_or_else(|| HostError::Invalid(format!("no template {name:?}")))?;
        if template.meta.image.is_some() {
            return Err(HostError::Invalid(format!(
                "{name:?} is a snapshot template: it stays on the host it was made on"
            )));
        }
        let dir = self.uploads_dir();
        std::fs::create_dir_all(&dir).map_err(HostError::io("creating the uploads dir"))?;
        // Named as no tenant's upload is (those start with the tenant's
        // name), and by when the version was made: a template deleted and
        // made again starts at version 1, and must not get the old one's tar.
        let made: String = template.meta.created_at.chars().filter(char::is_ascii_digit).collect();
        let stem = format!(".export-{name}-{}-{made}", template.meta.version);
        // One export at a time: several nodes pulling at once wait for the
        // first, then share its file.
        static EXPORTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = EXPORTING.lock().unwrap_or_else(|e| e.into_inner());
        let (tar, sum) = (dir.join(format!("{stem}.tar")), dir.join(format!("{stem}.sha256")));
        if let (true, Ok(sha256)) = (tar.exists(), std::fs::read_to_string(&sum)) {
            return Ok(Export { meta: template.meta, tar, sha256 });
        }
        let partial = dir.join(format!("{stem}.partial"));
        let file = std::fs::File::create(&partial).map_err(HostError::io("creating an export"))?;
        let reference = TemplateRef {
            name: wire(TemplateName::parse(name))?,
            version: wire(TemplateVersion::new(template.meta.version))?,
        };
        let written = self.template_host().export_template(&reference, file).map_err(host_failed);
        let hashed = written.and_then(|()| {
            let mut hasher = sha2::Sha256::new();
            let mut file = std::fs::File::open(&partial).map_err(HostError::io("reading an export"))?;
            std::io::copy(&mut file, &mut hasher).map_err(HostError::io("hashing an export"))?;
            Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>())
        });
        let sha256 = match hashed {
            Ok(sha256) => sha256,
            Err(err) => {
                let _ = std::fs::remove_file(&partial);
                return Err(err);
            }
        };
        std::fs::write(&sum, &sha256).map_err(HostError::io("writing an export's sum"))?;
        std::fs::rename(&partial, &tar).map_err(HostError::io("publishing an export"))?;
        Ok(Export { meta: template.meta, tar, sha256 })
    }

    /// Makes the next version of `meta.name` here from another node's
    /// export of it (`tar`, already checked against its SHA-256 by the
    /// caller): its root applied by the confined importer child of
    /// whoever does templates' root work, its settings, owner and engine
    /// from `meta`.
    pub fn import_pulled(&self, meta: &TemplateMeta, tar: std::fs::File) -> Result<TemplateInfo, HostError> {
        let size = tar.metadata().map_err(HostError::io("the pulled template"))?.len();
        // Room for the root the tar holds (its headers make it no smaller)
        // and for this host's agent.
        let disk_mib = build_disk_mib(size.saturating_add(256 << 20))?;
        let log = open_log(&self.data.logs_dir().join(format!("pull-{}.log", meta.name)))?;
        let ext4 = self.data.ext4_images();
        self.publish_version(&meta.name, ext4, |template, _| {
            let input = BuildInput::RootTar(tar);
            self.template_host().build_template(template, input, disk_mib, log, &mut |_| {}).map_err(host_failed)?;
            Ok(TemplateMeta::unpublished(
                &meta.name,
                meta.source.clone(),
                meta.defaults.clone(),
                meta.owner.clone(),
                meta.engine.clone(),
            ))
        })
    }

    /// Accepts an uploaded OCI image archive and imports it in the background.
    pub fn import_image(
        self: &Arc<Self>,
        slot: BuildSlot,
        upload: Upload,
        overrides: DefaultsOverride,
        engine: Option<String>,
    ) -> Result<(Template, Operation), NodeError> {
        let (name, owner, tenant) = (slot.name.clone(), slot.owner.clone(), slot.tenant.clone());
        self.start_build(
            slot,
            Box::new(move |platform, operation_id, progress| {
                let grant = platform.grant_build_allowance(&tenant).map_err(quota_unknown)?;
                // The server opens both, so whoever imports reads and
                // writes these descriptors and opens no path of ours.
                let log = open_log(&platform.data.log_path(operation_id))?;
                let archive =
                    std::fs::File::open(&upload.path).map_err(HostError::io("opening the uploaded archive"))?;
                let disk_mib = build_disk_mib(grant.bytes)?;
                let ext4 = platform.data.ext4_images();
                let built = platform.publish_version(&name, ext4, |template, _| {
                    let input = BuildInput::OciArchive(archive);
                    let imported = platform
                        .template_host()
                        .build_template(template, input, disk_mib, log, progress)
                        .map_err(host_failed)?;
                    let defaults = overrides.apply(imported.defaults);
                    Ok(TemplateMeta::unpublished(&name, imported.source, defaults, owner, engine))
                });
                drop(grant);
                drop(upload);
                built
            }),
        )
    }

    /// Creates the build operation for a reserved name and runs `job`.
    pub(crate) fn start_build(
        self: &Arc<Self>,
        slot: BuildSlot,
        job: BuildJob,
    ) -> Result<(Template, Operation), NodeError> {
        let name = slot.name.clone();
        let mut operation = new_operation(OperationKind::BuildTemplate, "", "queued", BUILD_STEPS);
        operation.sandbox_id = None;
        operation.template = Some(name.clone());
        let source = {
            let mut builds = self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner());
            let entry = builds.get_mut(&name).ok_or_else(|| NodeError::internal("a build slot", "vanished"))?;
            entry.operation = Some(operation.id.clone());
            entry.source.clone()
        };
        self.store.node().put_operation(&operation, &slot.tenant, None)?;
        self.changed();

        let platform = self.clone();
        let operation_id = operation.id.clone();
        let template_name = name.clone();
        tokio::spawn(async move {
            let name = template_name;
            let worker = platform.clone();
            let id = operation_id.clone();
            let built = tokio::task::spawn_blocking(move || {
                job(&worker, &id, &mut |p: BuildProgress| worker.build_progress(&id, &p))
            })
            .await;
            let error = match built {
                Ok(Ok(template)) => {
                    crate::warm::refill(&platform, template);
                    None
                }
                Ok(Err(err)) => {
                    tracing::warn!(template = %name, "build failed: {err}");
                    // The input's own faults are told; host errors (paths,
                    // commands) stay in the server's and the build's logs.
                    let mut message = match &err {
                        HostError::Invalid(why) => format!("the template build failed: {why}"),
                        _ => "the template build failed; see the operation's log".to_string(),
                    };
                    if let Some((cut, _)) = message.char_indices().nth(2000) {
                        message.truncate(cut);
                    }
                    Some(NodeError::new(ErrorCode::BuildFailed, message))
                }
                Err(err) => Some(NodeError::internal("building a template", err)),
            };
            drop(slot);
            platform.finish_operation(&operation_id, error);
        });
        let template = Template {
            name,
            state: TemplateState::Building,
            version: None,
            source,
            defaults: None,
            created_at: None,
            building_operation: Some(operation.id.clone()),
            engine: None,
        };
        Ok((template, operation))
    }

    /// Every template `caller` can see (shared ones and its own): ready
    /// ones (newest version) and first builds.
    pub fn templates(&self, caller: &Caller) -> Vec<Template> {
        let building = self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut list: Vec<Template> = self
            .data
            .templates()
            .iter()
            .filter(|info| caller.sees_template(info.meta.owner.as_deref()))
            .map(|info| api_template(info, building.get(&info.meta.name).and_then(|b| b.operation.clone())))
            .collect();
        for (name, building) in building {
            if caller.sees_template(building.owner.as_deref()) && !list.iter().any(|t| t.name == name) {
                list.push(Template {
                    name,
                    state: TemplateState::Building,
                    version: None,
                    source: building.source,
                    defaults: None,
                    created_at: None,
                    building_operation: building.operation,
                    engine: None,
                });
            }
        }
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    pub fn template(&self, name: &str, caller: &Caller) -> Result<Template, NodeError> {
        self.templates(caller).into_iter().find(|t| t.name == name).ok_or_else(|| template_not_found(name))
    }

    /// A ready template `caller` may start sandboxes from.
    pub fn usable_template(&self, name: &str, caller: &Caller) -> Result<TemplateInfo, NodeError> {
        self.data
            .template(name)
            .filter(|t| caller.sees_template(t.meta.owner.as_deref()))
            .ok_or_else(|| template_not_found(name))
    }

    /// Removes template versions that are neither the newest nor used by a
    /// sandbox that still exists (rebuilds leave the old one behind until
    /// its last sandbox is gone), with their warm members.
    pub(crate) async fn reclaim_old_versions(&self) {
        let Ok(records) = self.store.node().live_sandboxes() else { return };
        let in_use: std::collections::HashSet<(String, u32)> =
            records.iter().map(|r| (r.sandbox.template.clone(), r.template_version)).collect();
        for template in self.data.templates() {
            let name = template.meta.name.clone();
            let newest = template.meta.version;
            let Ok(entries) = std::fs::read_dir(self.data.templates_dir().join(&name)) else { continue };
            for entry in entries.flatten() {
                let Some(version) = entry.file_name().to_str().and_then(|v| v.parse::<u32>().ok()) else { continue };
                if version >= newest || in_use.contains(&(name.clone(), version)) {
                    continue;
                }
                let (Ok(checked), Ok(checked_version)) = (TemplateName::parse(&name), TemplateVersion::new(version))
                else {
                    continue;
                };
                self.warm.drain_version(&name, version).await;
                tracing::info!(template = %name, version, "reclaiming an unused old version");
                let host = self.template_host();
                let removed =
                    tokio::task::spawn_blocking(move || host.delete_template(&checked, Some(checked_version))).await;
                if let Ok(Err(err)) = removed {
                    tracing::warn!(template = %name, version, "reclaiming: {err}");
                }
            }
        }
    }

    /// 403 unless `caller` may change or delete template `name`: shared
    /// templates are the operator's.
    pub fn may_manage_template(&self, name: &str, caller: &Caller) -> Result<(), NodeError> {
        if self.template_owner(name).is_some_and(|owner| owner.is_none()) && !caller.is_operator() {
            return Err(NodeError::new(ErrorCode::Forbidden, "shared templates are managed with the server's own key"));
        }
        Ok(())
    }

    /// Deletes every version of a template no sandbox uses.
    pub async fn delete_template(&self, name: &str, caller: &Caller) -> Result<(), NodeError> {
        self.template(name, caller)?;
        // Before anything else: whether sandboxes use it is not a tenant's
        // business for a template it may not manage.
        self.may_manage_template(name, caller)?;
        if self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).contains_key(name) {
            return Err(NodeError::new(ErrorCode::BuildInProgress, format!("template {name:?} is being built")));
        }
        let users: Vec<_> =
            self.store.node().live_sandboxes()?.into_iter().filter(|r| r.sandbox.template == name).collect();
        if !users.is_empty() {
            // Only the caller's own sandboxes are named.
            let own: Vec<&str> =
                users.iter().filter(|r| r.tenant == caller.tenant).map(|r| r.sandbox.id.as_str()).collect();
            return Err(NodeError::new(
                ErrorCode::TemplateInUse,
                format!("template {name:?} is used by {} sandbox(es); delete them first", users.len()),
            )
            .with_details(serde_json::json!({"sandboxes": own})));
        }
        let checked = TemplateName::parse(name).map_err(|e| NodeError::bad_request(e.to_string()))?;
        self.warm.drain_template(name).await;
        let host = self.template_host();
        tokio::task::spawn_blocking(move || host.delete_template(&checked, None))
            .await
            .map_err(|e| NodeError::internal("deleting a template", e))?
            .map_err(|e| NodeError::internal("deleting a template", e))
    }
}
