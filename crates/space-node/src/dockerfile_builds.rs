//! Templates from a Dockerfile (issue 36, decision 030): the request is
//! planned before its build context is read (an instruction SPACE does not
//! build is a 422 naming it and its line), then the build runs as a build
//! operation, stage by stage, each step a layer chain of the cache keyed by
//! its inputs (`space_dockerfile::cache_key`), so a rebuild reuses every
//! step before the first one that changed.
//!
//! Where each step's work is done: a COPY from the context is a layer tar
//! this (unprivileged) server writes from the uploaded context and the root
//! side applies through the confined importer; a RUN runs in a build
//! sandbox — a gVisor sandbox of its own started on the parent chain, with
//! the build's network (none unless asked, within the tenant's ceiling) —
//! whose root is kept as the next chain once it stopped (`SaveLayer`); a
//! `COPY --from` reads the other stage's files through the agent of a
//! build sandbox of that stage. No chain's bytes are ever read here.
//!
//! A build sandbox is not a record of the store: it lives in the sandboxes
//! dir under its own id only while its step runs, and is destroyed when
//! the step ends, on success or failure. A server killed mid-step leaves
//! a directory no record names, which the next start sweeps like any
//! leftover (`recovery.rs`), and its operation fails as every build cut
//! short does.

use std::collections::BTreeMap;
use std::io::{BufWriter, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use space_api::{DockerfileBuildRequest, Egress, ErrorCode, Network, Operation, Template};
use space_dockerfile::{Base, BuildPlan, CopyFrom, CopyStep, Ignore, ImageConfig, PlanError, Step, StepKind};
use space_engine::privsep::layout::Layout;
use space_engine::privsep::proto::{ChainId, DiskMib, LayerKey, StepKey};
use space_engine::templates::{BuildInput, BuildProgress};
use space_engine::{AgentConn, SandboxSpec};
use space_host::template::{DefaultsOverride, TemplateInfo, TemplateMeta};
use space_host::HostError;

use crate::error::NodeError;
use crate::images::{image_error, layer_keys, ChainsInUse, Pull, RESOLVE_PATIENCE};
use crate::platform::Platform;
use crate::templates::{
    build_disk_mib, checked_engine, checked_overrides, host_failed, open_log, quota_unknown, wire, BuildSlot, Upload,
};
use crate::tenants::Caller;

/// The longest Dockerfile taken.
pub const MAX_DOCKERFILE_BYTES: usize = 1 << 20;

/// A build sandbox's shape: enough for a package manager.
const BUILD_VCPUS: u32 = 2;
const BUILD_MEMORY_MIB: u32 = 1024;

/// How long a build sandbox may take to start, and a read of its files.
const START_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// A Dockerfile build accepted and planned, its name reserved; its context
/// is read next.
pub struct PlannedBuild {
    slot: BuildSlot,
    request: DockerfileBuildRequest,
    plan: BuildPlan,
    network: Network,
    given: DefaultsOverride,
    engine: Option<String>,
    /// The registry credential, opened for this build only.
    credential: Option<space_image::Credential>,
}

/// A plan error as the API tells it.
fn plan_error(err: &PlanError) -> NodeError {
    NodeError::new(ErrorCode::InvalidValue, err.to_string()).with_details(serde_json::json!({
        "field": "dockerfile", "instruction": err.instruction, "line": err.line,
    }))
}

fn at_line(line: usize, message: String, instruction: &str) -> NodeError {
    plan_error(&PlanError { instruction: instruction.into(), line, message })
}

impl Platform {
    /// Checks and plans a Dockerfile build and reserves its name: every
    /// error the request itself holds is answered here, before its build
    /// context is read.
    pub fn plan_dockerfile_build(
        self: &Arc<Self>,
        request: DockerfileBuildRequest,
        caller: &Caller,
    ) -> Result<PlannedBuild, NodeError> {
        if !space_host::template::valid_name(&request.name) {
            return Err(NodeError::bad_request(format!(
                "template names are 1-63 lowercase letters, digits, '-' or '_', got {:?}",
                request.name
            )));
        }
        if request.dockerfile.len() > MAX_DOCKERFILE_BYTES {
            return Err(NodeError::unprocessable(format!("the Dockerfile exceeds {MAX_DOCKERFILE_BYTES} bytes"))
                .with_details(serde_json::json!({"field": "dockerfile"})));
        }
        let given = checked_overrides(request.defaults.clone())?;
        let engine = checked_engine(request.engine.clone(), self.data.ext4_images())?;
        let network = crate::domain::checked_network(request.network.clone().unwrap_or_default())
            .map_err(|err| err.with_details(serde_json::json!({"field": "network"})))?;
        if !network.secrets.is_empty() {
            return Err(NodeError::unprocessable("a build's network binds no secrets")
                .with_details(serde_json::json!({"field": "network"})));
        }
        self.check_egress_ceiling(&caller.tenant, &network)?;
        let plan = space_dockerfile::plan(&request.dockerfile, &request.build_args, request.target.as_deref())
            .map_err(|err| plan_error(&err))?;
        for stage in &plan.stages {
            if let Base::Template(name) = &stage.base {
                let template = self.usable_template(name, caller).map_err(|_| {
                    at_line(stage.line, format!("there is no template {name:?} this key may use"), "FROM")
                })?;
                if template.meta.image.is_some() {
                    return Err(at_line(
                        stage.line,
                        format!("{name:?} is a snapshot template: build on a template without a memory image"),
                        "FROM",
                    ));
                }
            }
            for step in &stage.steps {
                if let StepKind::Copy(CopyStep { from: CopyFrom::Image(image), .. }) = &step.kind {
                    return Err(at_line(
                        step.line,
                        format!("COPY --from={image}: copy from a stage instead (FROM {image} AS name)"),
                        "COPY",
                    ));
                }
            }
        }
        let source = serde_json::json!({"dockerfile": {
            "stages": plan.stages.len(),
            "steps": plan.stages.iter().map(|s| s.steps.len()).sum::<usize>(),
            "target": request.target,
        }});
        let credential =
            request.registry_auth.as_ref().map(|auth| self.registry_credential(&caller.tenant, auth)).transpose()?;
        let slot = self.reserve_build(&request.name, source, caller)?;
        Ok(PlannedBuild { slot, request, plan, network, given, engine, credential })
    }

    /// Runs a planned build with its context (`None`: nothing is copied
    /// from one) in the background.
    pub fn start_dockerfile_build(
        self: &Arc<Self>,
        planned: PlannedBuild,
        context: Option<Upload>,
    ) -> Result<(Template, Operation), NodeError> {
        let PlannedBuild { slot, request, plan, network, given, engine, credential } = planned;
        let (name, owner, tenant) = (slot.name.clone(), slot.owner.clone(), slot.tenant.clone());
        let platform = self.clone();
        let runtime = tokio::runtime::Handle::current();
        self.start_build(
            slot,
            Box::new(move |_, operation_id, progress| {
                let grant = platform.grant_build_allowance(&tenant).map_err(quota_unknown)?;
                let disk_mib = build_disk_mib(grant.bytes)?;
                let log = open_log(&platform.data.log_path(operation_id))?;
                let mut build = Build {
                    platform: platform.clone(),
                    runtime,
                    tenant,
                    operation_id: operation_id.to_string(),
                    log: log.try_clone().map_err(HostError::io("the build log"))?,
                    disk_mib,
                    context: context.as_ref().map(|upload| upload.path.clone()),
                    ignore: Ignore::default(),
                    network,
                    credential,
                    held: Vec::new(),
                    number: 0,
                    total: 0,
                };
                let built = build.run(&request, plan, progress).and_then(|(top, config)| {
                    let ext4 = platform.data.ext4_images();
                    platform.publish_version(&name, ext4, |template, _| {
                        let log = log.try_clone().map_err(HostError::io("the build log"))?;
                        platform
                            .template_host()
                            .build_template(template, BuildInput::Layers { top }, disk_mib, log, progress)
                            .map_err(host_failed)?;
                        let defaults = given.apply(config_defaults(&config));
                        let source = serde_json::json!({"dockerfile": {"target": request.target}});
                        Ok(TemplateMeta::unpublished(&name, source, defaults, owner, engine))
                    })
                });
                if let Err(err) = &built {
                    let _ = writeln!(&log, "the build failed: {err}");
                }
                drop(build);
                drop(grant);
                drop(context);
                platform.evict_layers();
                built
            }),
        )
    }
}

/// A build under way, on its blocking thread.
struct Build {
    platform: Arc<Platform>,
    runtime: tokio::runtime::Handle,
    tenant: String,
    operation_id: String,
    log: std::fs::File,
    disk_mib: DiskMib,
    context: Option<PathBuf>,
    ignore: Ignore,
    network: Network,
    credential: Option<space_image::Credential>,
    /// The chains this build made or uses, kept from eviction until it ends.
    held: Vec<ChainsInUse>,
    /// The step running (1-based) of `total`.
    number: usize,
    total: usize,
}

impl Build {
    /// Every stage the target needs, in order; the target's top chain and
    /// image config out.
    fn run(
        &mut self,
        request: &DockerfileBuildRequest,
        plan: BuildPlan,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<(ChainId, ImageConfig), HostError> {
        self.ignore = self.read_dockerignore()?;
        // The bases first: their configs (an image's PATH, its WORKDIR)
        // are what the stages' steps run with.
        let mut bases: Vec<(Base, ChainId, ImageConfig)> = Vec::new();
        for stage in &plan.stages {
            if bases.iter().any(|(base, _, _)| *base == stage.base) {
                continue;
            }
            let based = match &stage.base {
                Base::Image(reference) => Some(self.pull_base(reference, progress)?),
                Base::Template(name) => Some(self.template_base(name, progress)?),
                Base::Scratch | Base::Stage(_) => None,
            };
            if let Some((chain, config)) = based {
                self.hold(&chain);
                bases.push((stage.base.clone(), chain, config));
            }
        }
        let config_of =
            |base: &Base| bases.iter().find(|(known, _, _)| known == base).map(|(_, _, config)| config.clone());
        let plan = space_dockerfile::plan_with_bases(
            &request.dockerfile,
            &request.build_args,
            request.target.as_deref(),
            &config_of,
        )
        .map_err(|err| HostError::Invalid(err.to_string()))?;
        self.total = plan.stages.iter().map(|stage| stage.steps.len()).sum();
        let mut tops: Vec<Option<ChainId>> = Vec::new();
        for stage in &plan.stages {
            let mut parent = match &stage.base {
                Base::Scratch => None,
                Base::Stage(index) => tops[*index].clone(),
                base => bases.iter().find(|(known, _, _)| known == base).map(|(_, chain, _)| chain.clone()),
            };
            for step in &stage.steps {
                self.number += 1;
                parent = Some(self.step(parent.as_ref(), step, &tops, progress)?);
            }
            tops.push(parent);
        }
        let target = &plan.stages[plan.target];
        let top = tops[plan.target]
            .clone()
            .ok_or_else(|| HostError::Invalid("the image is empty: FROM scratch with no step".into()))?;
        Ok((top, target.config.clone()))
    }

    /// The context's `.dockerignore`, applied here as well as by the
    /// client that sent it (an API caller may send everything).
    fn read_dockerignore(&self) -> Result<Ignore, HostError> {
        let Some(context) = &self.context else { return Ok(Ignore::default()) };
        let file = std::fs::File::open(context).map_err(HostError::io("opening the build context"))?;
        let mut archive = tar::Archive::new(std::io::BufReader::new(file));
        let entries = archive.entries().map_err(|e| HostError::Invalid(format!("the build context: {e}")))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| HostError::Invalid(format!("the build context: {e}")))?;
            let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            if path.trim_start_matches("./") == ".dockerignore" && entry.header().entry_type().is_file() {
                let mut text = String::new();
                entry
                    .by_ref()
                    .take(1 << 20)
                    .read_to_string(&mut text)
                    .map_err(|e| HostError::Invalid(format!(".dockerignore: {e}")))?;
                return Ignore::parse(&text).map_err(|e| HostError::Invalid(format!(".dockerignore: {e}")));
            }
        }
        Ok(Ignore::default())
    }

    fn hold(&mut self, chain: &ChainId) {
        self.held.push(ChainsInUse::hold_chains(self.platform.clone(), std::slice::from_ref(chain)));
    }

    fn say(&self, line: &str) {
        let _ = writeln!(&self.log, "{line}");
    }

    /// `FROM image`: pulled as `POST /v1/templates {from: {image}}` pulls.
    fn pull_base(
        &self,
        reference: &str,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<(ChainId, ImageConfig), HostError> {
        let invalid = |err: NodeError| HostError::Invalid(format!("FROM {reference}: {}", err.message));
        let config = self.platform.registry_config();
        let parsed = space_image::ImageRef::parse(reference, &config).map_err(|e| invalid(image_error(e)))?;
        let client = space_image::Client::new(&config).map_err(|e| invalid(image_error(e)))?;
        progress(BuildProgress::step(&format!("resolving {reference}"), 1));
        let resolved = self
            .runtime
            .block_on(async {
                // The build's credential, for a registry within its secret's hosts.
                let credential = self
                    .credential
                    .as_ref()
                    .filter(|credential| space_core::secrets::within(parsed.registry_host(), &credential.hosts));
                tokio::time::timeout(RESOLVE_PATIENCE, client.resolve(&parsed, credential)).await
            })
            .map_err(|_| HostError::Invalid(format!("FROM {reference}: the registry did not answer in time")))?
            .map_err(|e| invalid(image_error(e)))?;
        if resolved.layers.is_empty() || resolved.layers.len() > crate::images::MAX_LAYERS {
            return Err(HostError::Invalid(format!("FROM {reference}: an image of {} layers", resolved.layers.len())));
        }
        let keys = layer_keys(&resolved).map_err(|e| HostError::Invalid(format!("FROM {reference}: {e}")))?;
        let config = image_config(&resolved.config);
        let pull = Pull { runtime: self.runtime.clone(), client: Arc::new(client), image: Arc::new(resolved), keys };
        let _in_use = ChainsInUse::hold(self.platform.clone(), &pull.keys);
        let top = self.platform.pull_layers(&pull, &self.operation_id, self.disk_mib, &self.log, progress)?;
        Ok((top, config))
    }

    /// `FROM template:NAME`: the template's root (as exported for another
    /// node) applied as a chain of its own, keyed by the version.
    fn template_base(
        &self,
        name: &str,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<(ChainId, ImageConfig), HostError> {
        let info = self
            .platform
            .data
            .template(name)
            .ok_or_else(|| HostError::Invalid(format!("FROM template:{name}: the template is gone")))?;
        let key = wire(StepKey::parse(&template_key(&info)))?;
        let layer = LayerKey::Step { key };
        let chain = ChainId::next(None, &layer);
        let host = self.platform.template_host();
        if !host.has_layer(&chain).map_err(host_failed)? {
            progress(BuildProgress::step(&format!("taking template {name} version {}", info.meta.version), 1));
            let export = self.platform.export_template(name)?;
            let tar = std::fs::File::open(&export.tar).map_err(HostError::io("opening a template's export"));
            let log = self.log.try_clone().map_err(HostError::io("the build log"))?;
            let applied = tar
                .and_then(|tar| host.apply_layer(None, &layer, self.disk_mib, tar, log, progress).map_err(host_failed));
            // Made again by the next export that needs it.
            let _ = std::fs::remove_file(&export.tar);
            applied?;
        }
        self.say(&format!("FROM template:{name}: version {}", info.meta.version));
        Ok((chain, template_config(&info)))
    }

    /// One step on `parent`; its chain out (cached or made).
    fn step(
        &mut self,
        parent: Option<&ChainId>,
        step: &Step,
        tops: &[Option<ChainId>],
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<ChainId, HostError> {
        let title = format!("step {}/{} (line {}): {}", self.number, self.total, step.line, short(&step.text));
        progress(BuildProgress::step(&title, 1));
        let parent_hex = parent.map_or("", ChainId::as_str);
        let chain = match &step.kind {
            StepKind::Run { argv } => {
                let parent = parent
                    .ok_or_else(|| self.failed(step, "RUN needs a root to run in: FROM scratch has none yet".into()))?;
                let key = self.key(parent_hex, step, None)?;
                match self.cached(parent, &key, &title)? {
                    Some(chain) => chain,
                    None => {
                        self.say(&title);
                        self.run_step(parent, &key, step, argv)?
                    }
                }
            }
            StepKind::Workdir { path } => {
                let key = self.key(parent_hex, step, None)?;
                match parent.map(|parent| self.cached(parent, &key, &title)).transpose()?.flatten() {
                    Some(chain) => chain,
                    None => {
                        self.say(&title);
                        let tar = self.layer_file("workdir")?;
                        let written = workdir_layer(&tar.path, path).map_err(HostError::io("writing a WORKDIR layer"));
                        written.and_then(|()| self.apply(parent, &key, &tar.path))?
                    }
                }
            }
            StepKind::Copy(copy) => {
                let resolved = self.numeric_owner(parent, step, copy)?;
                let copy = &resolved;
                match &copy.from {
                    CopyFrom::Context => {
                        let tar = self.layer_file("copy")?;
                        let inputs = self.copy_from_context(step, copy, &tar.path)?;
                        let key = self.key(parent_hex, step, Some(&inputs))?;
                        match parent.map(|parent| self.cached(parent, &key, &title)).transpose()?.flatten() {
                            Some(chain) => chain,
                            None => {
                                self.say(&title);
                                self.apply(parent, &key, &tar.path)?
                            }
                        }
                    }
                    CopyFrom::Stage(index) => {
                        let source = tops[*index]
                            .clone()
                            .ok_or_else(|| self.failed(step, "COPY --from names a stage with nothing in it".into()))?;
                        // The source stage's top chain names its content whole.
                        let key = self.key(parent_hex, step, Some(source.as_str()))?;
                        match parent.map(|parent| self.cached(parent, &key, &title)).transpose()?.flatten() {
                            Some(chain) => chain,
                            None => {
                                self.say(&title);
                                let tar = self.layer_file("copy")?;
                                self.copy_from_stage(step, copy, &source, &tar.path)?;
                                self.apply(parent, &key, &tar.path)?
                            }
                        }
                    }
                    CopyFrom::Image(image) => {
                        return Err(self.failed(step, format!("COPY --from={image} is not supported")));
                    }
                }
            }
        };
        self.hold(&chain);
        Ok(chain)
    }

    /// The COPY with its `--chown` names turned into ids, looked up in the
    /// `/etc/passwd` and `/etc/group` of the image it copies into (read
    /// through the agent of a build sandbox on `parent`, so a link there
    /// resolves inside the image); a user without a group gets its uid as
    /// its gid, as Docker does.
    fn numeric_owner(&self, parent: Option<&ChainId>, step: &Step, copy: &CopyStep) -> Result<CopyStep, HostError> {
        let Some(chown) = &copy.chown else { return Ok(copy.clone()) };
        let (user, group) = chown.split_once(':').map_or((chown.as_str(), None), |(u, g)| (u, Some(g)));
        let numeric = |text: &str| text.parse::<u32>().ok();
        if numeric(user).is_some() && group.is_none_or(|g| numeric(g).is_some()) {
            return Ok(copy.clone());
        }
        let parent = parent.ok_or_else(|| {
            self.failed(step, format!("--chown={chown}: names are looked up in the image, and FROM scratch has none"))
        })?;
        let sandbox = self.start_sandbox(parent, false)?;
        let read = self.runtime.block_on(async {
            tokio::time::timeout(START_PATIENCE, async {
                (read_small(&sandbox.agent, "/etc/passwd").await, read_small(&sandbox.agent, "/etc/group").await)
            })
            .await
        });
        drop(sandbox);
        let Ok((passwd, groups)) = read else {
            return Err(self.failed(step, "reading the image's /etc/passwd took too long".into()));
        };
        let id_of = |table: &str, name: &str| {
            table.lines().find_map(|line| {
                let fields: Vec<&str> = line.split(':').collect();
                (fields.len() >= 3 && fields[0] == name).then(|| numeric(fields[2])).flatten()
            })
        };
        let uid = numeric(user).or_else(|| id_of(&passwd, user)).ok_or_else(|| {
            self.failed(step, format!("--chown={chown}: the image's /etc/passwd has no user {user:?}"))
        })?;
        let gid = match group {
            None => uid,
            Some(group) => numeric(group).or_else(|| id_of(&groups, group)).ok_or_else(|| {
                self.failed(step, format!("--chown={chown}: the image's /etc/group has no group {group:?}"))
            })?,
        };
        Ok(CopyStep { chown: Some(format!("{uid}:{gid}")), ..copy.clone() })
    }

    fn failed(&self, step: &Step, why: String) -> HostError {
        let (number, line) = (self.number, step.line);
        HostError::Invalid(format!("step {number} (line {line}): {why}"))
    }

    fn key(&self, parent: &str, step: &Step, inputs: Option<&str>) -> Result<StepKey, HostError> {
        wire(StepKey::parse(&space_dockerfile::cache_key(&self.tenant, parent, step, inputs)))
    }

    /// The step's chain when the cache has it.
    fn cached(&self, parent: &ChainId, key: &StepKey, title: &str) -> Result<Option<ChainId>, HostError> {
        let chain = ChainId::next(Some(parent), &LayerKey::Step { key: key.clone() });
        if self.platform.template_host().has_layer(&chain).map_err(host_failed)? {
            self.say(&format!("{title}: cached"));
            return Ok(Some(chain));
        }
        Ok(None)
    }

    /// A layer tar of this server's, in its uploads dir, removed when dropped.
    fn layer_file(&self, what: &str) -> Result<Upload, HostError> {
        let dir = self.platform.uploads_dir();
        std::fs::create_dir_all(&dir).map_err(HostError::io("creating the uploads dir"))?;
        let name = format!(".{what}-{}-{}.tar", self.operation_id, self.number);
        Ok(Upload { path: dir.join(name) })
    }

    fn apply(&self, parent: Option<&ChainId>, key: &StepKey, tar: &Path) -> Result<ChainId, HostError> {
        let file = std::fs::File::open(tar).map_err(HostError::io("opening a step's layer"))?;
        let log = self.log.try_clone().map_err(HostError::io("the build log"))?;
        let layer = LayerKey::Step { key: key.clone() };
        let ready = self
            .platform
            .template_host()
            .apply_layer(parent, &layer, self.disk_mib, file, log, &mut |_| {})
            .map_err(host_failed)?;
        Ok(ready.chain)
    }

    /// Writes the COPY's layer from the context to `tar`; its inputs'
    /// digest out.
    fn copy_from_context(&self, step: &Step, copy: &CopyStep, tar: &Path) -> Result<String, HostError> {
        let out = std::fs::File::create(tar).map_err(HostError::io("creating a COPY layer"))?;
        let stats = match &self.context {
            Some(context) => {
                let file = std::fs::File::open(context).map_err(HostError::io("opening the build context"))?;
                space_dockerfile::copy_layer(std::io::BufReader::new(file), &self.ignore, copy, BufWriter::new(out))
            }
            None => space_dockerfile::copy_layer(&[0u8; 1024][..], &self.ignore, copy, BufWriter::new(out)),
        };
        let stats = stats.map_err(|err| self.failed(step, err.to_string()))?;
        Ok(stats.digest_of_inputs)
    }

    /// Writes the layer of `COPY --from=stage` to `tar`: the sources read
    /// through the agent of a build sandbox on the stage's top chain, as a
    /// context of their own, then copied as from any context.
    fn copy_from_stage(&self, step: &Step, copy: &CopyStep, source: &ChainId, tar: &Path) -> Result<(), HostError> {
        if let Some(glob) = copy.sources.iter().find(|s| s.contains(['*', '?', '['])) {
            return Err(self.failed(step, format!("COPY --from takes paths, not patterns: {glob:?}")));
        }
        let context = self.layer_file("from")?;
        let sandbox = self.start_sandbox(source, false)?;
        let read = self.runtime.block_on(async {
            tokio::time::timeout(START_PATIENCE * 5, read_sources(&sandbox.agent, &copy.sources, &context.path)).await
        });
        drop(sandbox);
        match read {
            Err(_) => return Err(self.failed(step, "reading the files of the other stage took too long".into())),
            Ok(Err(why)) => return Err(self.failed(step, why)),
            Ok(Ok(())) => {}
        }
        let file = std::fs::File::open(&context.path).map_err(HostError::io("opening a stage's files"))?;
        let out = std::fs::File::create(tar).map_err(HostError::io("creating a COPY layer"))?;
        let as_context = CopyStep { from: CopyFrom::Context, ..copy.clone() };
        space_dockerfile::copy_layer(
            std::io::BufReader::new(file),
            &Ignore::default(),
            &as_context,
            BufWriter::new(out),
        )
        .map_err(|err| self.failed(step, err.to_string()))?;
        Ok(())
    }

    /// Runs a RUN step in a build sandbox on `parent` and keeps what it
    /// wrote as the step's chain.
    fn run_step(&self, parent: &ChainId, key: &StepKey, step: &Step, argv: &[String]) -> Result<ChainId, HostError> {
        let sandbox = self.start_sandbox(parent, true)?;
        let request = space_proto::ExecRequest {
            argv: argv.to_vec(),
            env: step.env.iter().cloned().collect(),
            cwd: Some(step.workdir.clone()),
            user: step.user.clone(),
            stdin: false,
            tty: false,
        };
        let prefix = format!("[step {}/{} line {}] ", self.number, self.total, step.line);
        let exited = self.runtime.block_on(run_logged(&sandbox.agent, &request, &prefix, &self.log));
        let exited = match exited {
            Ok(exited) => exited,
            Err(why) => return Err(self.failed(step, format!("RUN could not run: {why}"))),
        };
        match (exited.exit_code, exited.signal) {
            (Some(0), _) => {}
            (Some(code), _) => return Err(self.failed(step, format!("RUN exited with {code}"))),
            (None, Some(signal)) => return Err(self.failed(step, format!("RUN was killed by signal {signal}"))),
            (None, None) => return Err(self.failed(step, "RUN ended without an exit status".into())),
        }
        self.platform.engine.stop(&sandbox.spec).map_err(host_failed)?;
        let id = wire(space_engine::privsep::proto::SandboxId::parse(&sandbox.spec.id))?;
        let ready = self.platform.template_host().save_layer(&id, parent, key).map_err(host_failed)?;
        drop(sandbox);
        self.say(&format!("step {}/{}: saved", self.number, self.total));
        Ok(ready.chain)
    }

    /// A build sandbox on `chain`, with the build's network when `network`.
    fn start_sandbox(&self, chain: &ChainId, network: bool) -> Result<BuildSandbox, HostError> {
        let platform = &self.platform;
        platform.admit(BUILD_MEMORY_MIB).map_err(|err| HostError::Invalid(err.message))?;
        let id = crate::ids::new_id("sbx");
        let spec = SandboxSpec {
            dir: platform.data.sandbox_dir(&id),
            template_rootfs: Layout::new(platform.data.root()).layer_root(chain),
            hostname: crate::ids::hostname_for(&id),
            vcpus: BUILD_VCPUS,
            memory_mib: BUILD_MEMORY_MIB,
            disk_mib: u32::from(self.disk_mib),
            // gVisor alone starts on a chain: a microVM's root is an image.
            engine: Some("gvisor".into()),
            id,
            ..Default::default()
        };
        let engine = platform.engine.clone();
        let started = self
            .runtime
            .block_on(async { tokio::time::timeout(START_PATIENCE, async { engine.create(&spec).await }).await });
        let agent = match started {
            Ok(Ok(started)) => started.agent,
            Ok(Err(err)) => {
                self.runtime.block_on(destroy(platform, &spec));
                return Err(host_failed(err));
            }
            Err(_) => {
                self.runtime.block_on(destroy(platform, &spec));
                return Err(HostError::Invalid("a build sandbox did not start in time".into()));
            }
        };
        if network && self.network.egress != Egress::None {
            let policy = crate::egress::policy_of(&self.network).map_err(|e| HostError::Invalid(e.to_string()))?;
            let hub = &platform.egress;
            let config = hub.config.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let egress = space_egress::gateway::SandboxEgress::new(spec.id.clone(), policy, hub.events.clone(), config);
            agent.on_egress(Arc::new(move |stream: space_engine::EgressStream| {
                let egress = egress.clone();
                let io = stream.into_io();
                tokio::spawn(async move { egress.handle(io).await });
            }));
        }
        Ok(BuildSandbox { platform: platform.clone(), runtime: self.runtime.clone(), spec, agent })
    }
}

/// A build sandbox: destroyed when dropped, however its step ended.
struct BuildSandbox {
    platform: Arc<Platform>,
    runtime: tokio::runtime::Handle,
    spec: SandboxSpec,
    agent: AgentConn,
}

impl Drop for BuildSandbox {
    fn drop(&mut self) {
        self.runtime.block_on(destroy(&self.platform, &self.spec));
    }
}

async fn destroy(platform: &Platform, spec: &SandboxSpec) {
    if let Err(err) = platform.engine.destroy(spec).await {
        tracing::warn!(sandbox = %spec.id, "destroying a build sandbox: {err}");
    }
}

/// Runs `request`, its output into `log` line by line after `prefix`.
async fn run_logged(
    agent: &AgentConn,
    request: &space_proto::ExecRequest,
    prefix: &str,
    log: &std::fs::File,
) -> Result<space_proto::Exited, String> {
    let mut stream = agent.exec(request).await.map_err(|e| e.to_string())?;
    let mut lines = [Vec::new(), Vec::new()];
    let mut put = |which: usize, bytes: &[u8]| {
        let pending = &mut lines[which];
        pending.extend_from_slice(bytes);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let _ = write!(&*log, "{prefix}{}", String::from_utf8_lossy(&line));
        }
        // A line without an end is written once it is long.
        if pending.len() > 8192 {
            let _ = writeln!(&*log, "{prefix}{}", String::from_utf8_lossy(pending));
            pending.clear();
        }
    };
    while let Some(event) = stream.next().await {
        match event {
            space_engine::agent::ExecEvent::Stdout(bytes) => put(0, &bytes),
            space_engine::agent::ExecEvent::Stderr(bytes) => put(1, &bytes),
            space_engine::agent::ExecEvent::Exit(exited) => {
                for pending in lines.iter().filter(|p| !p.is_empty()) {
                    let _ = writeln!(&*log, "{prefix}{}", String::from_utf8_lossy(pending));
                }
                return Ok(exited);
            }
        }
    }
    Err("the sandbox's agent went away".into())
}

/// The text of a small file of a build sandbox (at most 1 MiB of it; an
/// absent or unreadable one is empty: a lookup in it finds nothing).
async fn read_small(agent: &AgentConn, path: &str) -> String {
    use space_engine::agent::FileRead;
    const MAX: usize = 1 << 20;
    let Ok(FileRead::File { mut data, .. }) = agent.read_file(path, false).await else { return String::new() };
    let mut bytes = Vec::new();
    while let Ok(Some(chunk)) = data.next_chunk().await {
        bytes.extend_from_slice(&chunk);
        if bytes.len() > MAX {
            bytes.truncate(MAX);
            break;
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Reads `sources` (absolute paths of a build sandbox) into a tar at
/// `out`, each under its own path.
async fn read_sources(agent: &AgentConn, sources: &[String], out: &Path) -> Result<(), String> {
    use space_engine::agent::FileRead;
    let file = std::fs::File::create(out).map_err(|e| e.to_string())?;
    let mut builder = tar::Builder::new(BufWriter::new(file));
    for source in sources {
        let absolute = if source.starts_with('/') { source.clone() } else { format!("/{source}") };
        let name = absolute.trim_matches('/').to_string();
        let read = agent.read_file(&absolute, false).await.map_err(|e| format!("{source}: {e}"))?;
        match read {
            FileRead::File { info, mut data } => {
                let mut bytes = Vec::new();
                while let Some(chunk) = data.next_chunk().await.map_err(|e| format!("{source}: {e}"))? {
                    bytes.extend_from_slice(&chunk);
                }
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(info.mode);
                header.set_size(bytes.len() as u64);
                builder.append_data(&mut header, &name, bytes.as_slice()).map_err(|e| e.to_string())?;
            }
            FileRead::Dir(_) => {
                let FileRead::File { mut data, .. } =
                    agent.read_file(&absolute, true).await.map_err(|e| format!("{source}: {e}"))?
                else {
                    return Err(format!("{source}: not read as an archive"));
                };
                let mut bytes = Vec::new();
                while let Some(chunk) = data.next_chunk().await.map_err(|e| format!("{source}: {e}"))? {
                    bytes.extend_from_slice(&chunk);
                }
                let mut archive = tar::Archive::new(bytes.as_slice());
                for entry in archive.entries().map_err(|e| e.to_string())? {
                    let mut entry = entry.map_err(|e| e.to_string())?;
                    let inner = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
                    let inner = inner.trim_start_matches("./").trim_end_matches('/');
                    let path = match inner {
                        "" | "." => name.clone(),
                        inner => format!("{name}/{inner}"),
                    };
                    let mut header = entry.header().clone();
                    if header.entry_type().is_symlink() || header.entry_type().is_hard_link() {
                        let target = entry.link_name().map_err(|e| e.to_string())?.unwrap_or_default();
                        builder.append_link(&mut header, &path, target).map_err(|e| e.to_string())?;
                    } else {
                        builder.append_data(&mut header, &path, &mut entry).map_err(|e| e.to_string())?;
                    }
                }
            }
        }
    }
    builder.into_inner().and_then(|mut w| w.flush()).map_err(|e| e.to_string())
}

/// A layer holding one directory (WORKDIR's), root's and 0755 like
/// Docker's. Its parents are made by the applier.
fn workdir_layer(tar: &Path, path: &str) -> std::io::Result<()> {
    let mut builder = tar::Builder::new(BufWriter::new(std::fs::File::create(tar)?));
    let name = path.trim_matches('/');
    if !name.is_empty() {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        builder.append_data(&mut header, format!("{name}/"), std::io::empty())?;
    }
    builder.into_inner()?.flush()
}

/// What a template's root chain is keyed by: its name and its version as
/// made (a template deleted and made again starts at version 1 anew).
fn template_key(info: &TemplateInfo) -> String {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    for field in ["space template chain v1", &info.meta.name, &info.meta.version.to_string(), &info.meta.created_at] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field.as_bytes());
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// An image's config as a stage's base config.
fn image_config(config: &space_image::ImageDefaults) -> ImageConfig {
    ImageConfig {
        env: config.env.iter().filter_map(|pair| pair.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect(),
        workdir: config.working_dir.clone().filter(|d| d.starts_with('/')).unwrap_or_else(|| "/".into()),
        user: config.user.clone().filter(|u| !u.is_empty()),
        cmd: (!config.cmd.is_empty()).then(|| config.cmd.clone()),
        entrypoint: (!config.entrypoint.is_empty()).then(|| config.entrypoint.clone()),
        labels: config.labels.clone(),
        exposed_ports: config.exposed_ports.iter().cloned().collect(),
        ..ImageConfig::default()
    }
}

/// A template's defaults as a stage's base config.
fn template_config(info: &TemplateInfo) -> ImageConfig {
    let defaults = &info.meta.defaults;
    ImageConfig {
        env: defaults.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        workdir: defaults.workdir.clone(),
        user: Some(defaults.user.clone()).filter(|u| !u.is_empty() && u != "root"),
        cmd: defaults.command.clone(),
        ..ImageConfig::default()
    }
}

/// The final stage's config as a template's defaults (the request's win).
fn config_defaults(config: &ImageConfig) -> DefaultsOverride {
    let command: Vec<String> = config.entrypoint.iter().flatten().chain(config.cmd.iter().flatten()).cloned().collect();
    DefaultsOverride {
        env: config.env.iter().cloned().collect::<BTreeMap<_, _>>(),
        workdir: Some(config.workdir.clone()),
        user: Some(config.user.clone().unwrap_or_else(|| "root".into())),
        command: (!command.is_empty()).then_some(command),
        ..Default::default()
    }
}

/// An instruction short enough for a progress step.
fn short(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_string(),
    }
}
