//! The seam between the platform's template logic and the root work it
//! needs, as [`EngineHost`](crate::host::EngineHost) is for an engine.
//!
//! Template versions live under `templates/` of the data dir, which only
//! root may write: [`TemplateHost`] is what the platform asks of it —
//! each method one request of `space_privsep::proto`, taking checked names
//! and versions and never a path. [`LocalTemplates`] does it in process
//! (a server that runs as root); [`HelperHost`](crate::helper::HelperHost)
//! asks the root helper, which serves it with a [`LocalTemplates`] of its
//! own data dir.
//!
//! A snapshot template's new version is made in three requests:
//! [`TemplateHost::begin_template`] makes the empty `.<version>.partial`
//! (only for a version newer than every one there), the sandbox's image is
//! saved into it (the engine's `SaveImage` of `ImageRef::Template`) or a
//! checkpoint copied ([`TemplateHost::copy_checkpoint`]), and
//! [`TemplateHost::publish_template`] seals and renames it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use space_host::btrfs;
pub use space_host::oci::Imported;
pub use space_host::template::BuildProgress;
use space_host::template::TemplateMeta;
use space_privsep::layout::Layout;
use space_privsep::proto::{
    ChainId, CheckpointName, DiskMib, ImageRef, LayerEntry, LayerKey, PackageName, SandboxId, StepKey, Suite,
    TemplateMetaJson, TemplateName, TemplateRef, TemplateVersion,
};

use crate::EngineError;

pub mod importer;
mod step_layer;

/// A template's `template.json`: its presence marks a complete version.
pub const TEMPLATE_META: &str = "template.json";

/// What a template's root is built from.
#[derive(Debug)]
pub enum BuildInput {
    /// An OCI image archive (`docker save` or an OCI layout tar), opened
    /// by whoever received the upload.
    OciArchive(fs::File),
    /// A template's root as another node of a cluster exported it (a plain
    /// tar), opened by whoever fetched it.
    RootTar(fs::File),
    /// Debian `suite` with `packages` (mmdebstrap from the host's mirror).
    Debian { suite: Suite, packages: Vec<PackageName> },
    /// A writable snapshot of a layer chain of the cache
    /// ([`TemplateHost::apply_layer`] made it).
    Layers { top: ChainId },
}

/// A layer chain in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerReady {
    pub chain: ChainId,
    /// Bytes of layer applied to make it (0 when `cached`).
    pub bytes: u64,
    /// It was there already; its layer was not read.
    pub cached: bool,
}

/// The root work of templates. Every method blocks.
pub trait TemplateHost: Send + Sync {
    /// `BuildTemplate`: a new build dir of `template` (as
    /// [`TemplateHost::begin_template`]) whose root, capped at `disk_mib`,
    /// is built from `input`; steps go to `progress`, the build's log to
    /// `log`. [`TemplateHost::publish_template`] publishes it.
    fn build_template(
        &self,
        template: &TemplateRef,
        input: BuildInput,
        disk_mib: DiskMib,
        log: fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<Imported, EngineError>;

    /// `BeginTemplate`: the empty build dir of `template`'s version, which
    /// must be newer than every version of the template there is.
    fn begin_template(&self, template: &TemplateRef) -> Result<(), EngineError>;

    /// `CopyCheckpoint`: `sandbox`'s checkpoint into the empty build dir
    /// [`TemplateHost::begin_template`] made.
    fn copy_checkpoint(
        &self,
        template: &TemplateRef,
        sandbox: &SandboxId,
        checkpoint: &CheckpointName,
    ) -> Result<(), EngineError>;

    /// `PublishTemplate`: the build's root sealed read-only, with `ext4` a
    /// microVM's root drive of it made, `meta` written as its record, the
    /// build renamed to its version.
    fn publish_template(
        &self,
        template: &TemplateRef,
        meta: &TemplateMetaJson,
        ext4: Option<DiskMib>,
    ) -> Result<(), EngineError>;

    /// `DeleteTemplate`: one version (published or a build), or every one.
    fn delete_template(&self, name: &TemplateName, version: Option<TemplateVersion>) -> Result<(), EngineError>;

    /// `ClearStaleQuotas`: quota groups of subvolumes btrfs let go.
    fn clear_stale_quotas(&self);

    /// Whether `template`'s build dir is there and holds nothing yet: the
    /// only place an engine may save a template's image into.
    fn empty_build(&self, template: &TemplateRef) -> bool;

    /// `ExportTemplate`: a published version's root (not a snapshot
    /// template's: it stays on its host) as a tar into `out`, for another
    /// node of a cluster.
    fn export_template(&self, template: &TemplateRef, out: fs::File) -> Result<(), EngineError>;

    /// `HasLayer`: whether the chain is in the cache.
    fn has_layer(&self, chain: &ChainId) -> Result<bool, EngineError>;

    /// `ApplyLayer`: the chain `layer` makes on `parent`, applied from
    /// `blob` by the confined importer onto a snapshot of the parent
    /// (capped at `disk_mib` of its own writes) and kept read-only; a chain
    /// that is there already is answered at once, `blob` unread.
    fn apply_layer(
        &self,
        parent: Option<&ChainId>,
        layer: &LayerKey,
        disk_mib: DiskMib,
        blob: fs::File,
        log: fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<LayerReady, EngineError>;

    /// `DeleteLayer`: the chain out of the cache (roots made from it are
    /// snapshots of their own and stay whole).
    fn delete_layer(&self, chain: &ChainId) -> Result<(), EngineError>;

    /// `SaveLayer`: what the root of build sandbox `sandbox` (started on
    /// `parent`, `StartFrom::Layer`) became, without what the platform put
    /// there, kept read-only as the chain of step `key` on `parent`; a
    /// chain that is there already is answered at once. The sandbox's
    /// engine must be stopped: the helper asks the engine and refuses
    /// otherwise; a caller in process stops it first.
    fn save_layer(&self, sandbox: &SandboxId, parent: &ChainId, key: &StepKey) -> Result<LayerReady, EngineError>;

    /// `ListLayers`: the chains in the cache, least recently used first,
    /// for the platform's eviction.
    fn list_layers(&self) -> Result<Vec<LayerEntry>, EngineError>;
}

/// The chains being applied or deleted: one request at a time works on a
/// chain, so two builds of one image never remove each other's partial.
#[derive(Debug, Default)]
struct ChainLocks {
    busy: std::sync::Mutex<std::collections::HashSet<ChainId>>,
    freed: std::sync::Condvar,
}

struct ChainGuard<'a> {
    locks: &'a ChainLocks,
    chain: ChainId,
}

impl ChainLocks {
    fn lock(&self, chain: &ChainId) -> ChainGuard<'_> {
        let mut busy = self.busy.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while busy.contains(chain) {
            busy = self.freed.wait(busy).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        busy.insert(chain.clone());
        ChainGuard { locks: self, chain: chain.clone() }
    }

    /// The chain's lock, unless someone holds it.
    fn try_lock(&self, chain: &ChainId) -> Option<ChainGuard<'_>> {
        let mut busy = self.busy.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        busy.insert(chain.clone()).then(|| ChainGuard { locks: self, chain: chain.clone() })
    }
}

impl Drop for ChainGuard<'_> {
    fn drop(&mut self) {
        let mut busy = self.locks.busy.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        busy.remove(&self.chain);
        self.locks.freed.notify_all();
    }
}

/// [`TemplateHost`] in this process, over the data dir `layout` names.
#[derive(Debug, Clone)]
pub struct LocalTemplates {
    layout: Layout,
    /// The guest agent put into the roots it builds.
    agent_bin: PathBuf,
    /// The `space` binary whose confined child parses image archives
    /// ([`importer`]); without one, imports fail.
    importer_bin: Option<PathBuf>,
    chains: std::sync::Arc<ChainLocks>,
}

impl LocalTemplates {
    pub fn new(layout: Layout, agent_bin: impl Into<PathBuf>) -> LocalTemplates {
        LocalTemplates { layout, agent_bin: agent_bin.into(), importer_bin: None, chains: Default::default() }
    }

    fn importer(&self, what: &str) -> Result<&Path, EngineError> {
        self.importer_bin
            .as_deref()
            .ok_or_else(|| refused(format!("no importer is configured: {what} are parsed only in its confined child")))
    }

    fn has_chain(&self, chain: &ChainId) -> bool {
        fs::symlink_metadata(self.layout.layer_root(chain)).is_ok_and(|m| m.is_dir())
    }

    /// Marks a chain used now (its directory's time: the cache's eviction
    /// goes least recently used first, and the mark survives restarts).
    fn touch_chain(&self, chain: &ChainId) {
        let now = nix::sys::time::TimeSpec::from(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default(),
        );
        let _ = nix::sys::stat::utimensat(
            None,
            &self.layout.layer_dir(chain),
            &now,
            &now,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        );
    }

    /// Image archives are parsed by `space_bin`'s confined child (see
    /// [`importer`]); this process never parses one itself.
    pub fn with_importer(self, space_bin: impl Into<PathBuf>) -> LocalTemplates {
        LocalTemplates { importer_bin: Some(space_bin.into()), ..self }
    }

    /// The newest version of `name` on disk, published or being built;
    /// names in any other spelling than a version's are not versions.
    fn newest_version(&self, name: &TemplateName) -> Option<u32> {
        let entries = fs::read_dir(self.layout.template_name_dir(name)).ok()?;
        entries
            .flatten()
            .filter_map(|entry| {
                let file_name = entry.file_name().into_string().ok()?;
                let number = file_name.strip_prefix('.').and_then(|n| n.strip_suffix(".partial")).unwrap_or(&file_name);
                let version: u32 = number.parse().ok()?;
                (version.to_string() == number).then_some(version)
            })
            .max()
    }
}

fn refused(message: String) -> EngineError {
    EngineError::Runtime(message)
}

/// A build's failure: the input's own fault keeps its text whole, so the
/// platform can tell it to whoever sent the input.
fn build_failed(err: space_host::HostError) -> EngineError {
    match err {
        space_host::HostError::Invalid(why) => EngineError::Runtime(format!("{INVALID_INPUT}{why}")),
        other => EngineError::from(other),
    }
}

/// How a build's failure that is the input's fault begins (see
/// [`invalid_input`]).
const INVALID_INPUT: &str = "invalid input: ";

/// The input's fault a build's error tells, if it is one.
pub fn invalid_input(err: &EngineError) -> Option<&str> {
    match err {
        EngineError::Runtime(message) => message.strip_prefix(INVALID_INPUT),
        _ => None,
    }
}

/// Removes a build dir, the subvolumes in it as subvolumes.
fn remove_build(partial: &Path) -> Result<(), EngineError> {
    btrfs::remove_tree(partial).map_err(EngineError::from)
}

fn is_empty_dir(path: &Path) -> bool {
    // A symlink is no build dir, whatever it points at.
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
        && fs::read_dir(path).is_ok_and(|mut entries| entries.next().is_none())
}

impl TemplateHost for LocalTemplates {
    fn build_template(
        &self,
        template: &TemplateRef,
        input: BuildInput,
        disk_mib: DiskMib,
        log: fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<Imported, EngineError> {
        progress(BuildProgress::step("creating the root subvolume", 0));
        if let BuildInput::Layers { top } = &input {
            if !self.has_chain(top) {
                return Err(refused(format!("layer chain {top} is not in the cache")));
            }
        }
        self.begin_template(template)?;
        let partial = self.layout.template_partial(template);
        let rootfs = partial.join("rootfs");
        let max_bytes = u64::from(disk_mib.get()) << 20;
        match &input {
            // Every extent of the chain shared: the template's own are
            // only what it writes after (the agent).
            BuildInput::Layers { top } => {
                let _busy = self.chains.lock(top);
                btrfs::snapshot(&self.layout.layer_root(top), &rootfs)?
            }
            _ => btrfs::create_subvolume(&rootfs)?,
        }
        btrfs::limit_exclusive_bytes(&rootfs, max_bytes)?;
        match input {
            BuildInput::Layers { .. } => {
                if let Err(err) = space_host::oci::finish_oci(&rootfs, &self.agent_bin, progress) {
                    let _ = writeln!(&log, "the build failed: {err}");
                    return Err(err.into());
                }
                Ok(Imported { source: serde_json::Value::Null, defaults: Default::default() })
            }
            BuildInput::OciArchive(archive) => {
                let importer = self.importer("image archives")?;
                let imported = importer::import(importer, &partial, &archive, &log, Some(max_bytes), progress)
                    .map_err(build_failed)?;
                // Root's own work, on what the child (ended, and with no
                // process left behind) wrote.
                if let Err(err) = space_host::oci::finish_oci(&rootfs, &self.agent_bin, progress) {
                    let _ = writeln!(&log, "import failed: {err}");
                    return Err(err.into());
                }
                Ok(imported)
            }
            BuildInput::RootTar(archive) => {
                let importer = self.importer("pulled roots")?;
                importer::import_root_tar(importer, &partial, &archive, &log, progress).map_err(build_failed)?;
                // This host's agent, whatever the exporting host had.
                if let Err(err) = space_host::oci::finish_oci(&rootfs, &self.agent_bin, progress) {
                    let _ = writeln!(&log, "import failed: {err}");
                    return Err(err.into());
                }
                Ok(Imported { source: serde_json::Value::Null, defaults: Default::default() })
            }
            BuildInput::Debian { suite, packages } => {
                let names: Vec<&str> = packages.iter().map(PackageName::as_str).collect();
                let cache = self.layout.apt_cache();
                space_host::template::fill_debian(
                    &partial,
                    suite.as_str(),
                    &names,
                    &self.agent_bin,
                    &log,
                    Some(&cache),
                    progress,
                )
                .map_err(build_failed)?;
                let source = serde_json::json!({"debian": {"suite": suite.as_str(), "packages": names}});
                Ok(Imported { source, defaults: Default::default() })
            }
        }
    }
    fn begin_template(&self, template: &TemplateRef) -> Result<(), EngineError> {
        let partial = self.layout.template_partial(template);
        // A build of this very version a killed process left is stale:
        // nothing else builds it (the platform builds a name at a time).
        if partial.exists() {
            remove_build(&partial)?;
        }
        if let Some(newest) = self.newest_version(&template.name) {
            if newest >= template.version.get() {
                return Err(refused(format!(
                    "template {} has version {newest} already: a new one is newer than {newest}",
                    template.name
                )));
            }
        }
        fs::create_dir_all(self.layout.template_name_dir(&template.name))
            .map_err(EngineError::io("creating the template dir"))?;
        fs::create_dir(&partial).map_err(EngineError::io("creating the build dir"))
    }

    fn copy_checkpoint(
        &self,
        template: &TemplateRef,
        sandbox: &SandboxId,
        checkpoint: &CheckpointName,
    ) -> Result<(), EngineError> {
        let partial = self.layout.template_partial(template);
        if !is_empty_dir(&partial) {
            return Err(refused(format!(
                "template {} has no new build of version {}",
                template.name,
                template.version.get()
            )));
        }
        let image = self.layout.image_dir(sandbox, &ImageRef::Checkpoint { name: checkpoint.clone() });
        if !fs::symlink_metadata(&image).is_ok_and(|m| m.is_dir()) {
            return Err(refused(format!("sandbox {sandbox} has no checkpoint {checkpoint}")));
        }
        // The root is a subvolume (snapshotted); memory and the rest are
        // copied, sharing blocks where btrfs can.
        for entry in fs::read_dir(&image).map_err(EngineError::io("reading the checkpoint"))?.flatten() {
            let name = entry.file_name();
            if btrfs::is_subvolume(&entry.path()) {
                btrfs::snapshot(&entry.path(), &partial.join(&name))?;
                continue;
            }
            let mut copy = Command::new("cp");
            copy.args(["-a", "--reflink=auto", "--"]).arg(entry.path()).arg(partial.join(&name));
            space_host::run(&mut copy)?;
        }
        Ok(())
    }

    fn publish_template(
        &self,
        template: &TemplateRef,
        meta: &TemplateMetaJson,
        ext4: Option<DiskMib>,
    ) -> Result<(), EngineError> {
        let record: TemplateMeta =
            serde_json::from_str(meta.as_str()).map_err(|err| refused(format!("not a template record: {err}")))?;
        if record.name != template.name.as_str() || record.version != template.version.get() {
            return Err(refused(format!(
                "the record names {} version {}, not {} version {}",
                record.name,
                record.version,
                template.name,
                template.version.get()
            )));
        }
        let partial = self.layout.template_partial(template);
        if !fs::symlink_metadata(&partial).is_ok_and(|m| m.is_dir()) {
            return Err(refused(format!(
                "template {} has no build of version {}",
                template.name,
                template.version.get()
            )));
        }
        let published = self.layout.template_dir(template);
        if fs::symlink_metadata(&published).is_ok() {
            return Err(refused(format!("template {} has version {} already", template.name, template.version.get())));
        }
        let root = partial.join("rootfs");
        // A microVM's image keeps its root as a drive file.
        if fs::symlink_metadata(&root).is_ok_and(|m| m.is_dir()) {
            btrfs::set_read_only(&root)?;
            if let Some(room) = ext4 {
                let image = partial.join(space_host::template::EXT4_IMAGE);
                space_host::template::make_ext4(&root, &image, room.get())?;
            }
        }
        // Written as read, not as sent: what the platform reads back is a
        // record it can parse.
        let json = serde_json::to_vec_pretty(&record).map_err(|err| refused(err.to_string()))?;
        fs::write(partial.join(TEMPLATE_META), json).map_err(EngineError::io("writing template.json"))?;
        fs::rename(&partial, &published).map_err(EngineError::io("publishing the template"))
    }

    fn delete_template(&self, name: &TemplateName, version: Option<TemplateVersion>) -> Result<(), EngineError> {
        let Some(version) = version else {
            return btrfs::remove_tree(&self.layout.template_name_dir(name)).map_err(EngineError::from);
        };
        let template = TemplateRef { name: name.clone(), version };
        remove_build(&self.layout.template_partial(&template))?;
        btrfs::remove_tree(&self.layout.template_dir(&template))?;
        // A template whose one version went leaves no empty directory.
        let _ = fs::remove_dir(self.layout.template_name_dir(name));
        Ok(())
    }

    fn clear_stale_quotas(&self) {
        self.sweep_layer_partials();
        btrfs::clear_stale_qgroups(self.layout.data_dir());
    }

    fn empty_build(&self, template: &TemplateRef) -> bool {
        is_empty_dir(&self.layout.template_partial(template))
    }

    fn export_template(&self, template: &TemplateRef, out: fs::File) -> Result<(), EngineError> {
        let version = self.layout.template_dir(template);
        let info = space_host::template::TemplateInfo::load(&version)
            .map_err(|_| refused(format!("template {} has no version {}", template.name, template.version.get())))?;
        if info.meta.image.is_some() {
            return Err(refused(format!(
                "{} is a snapshot template: it stays on the host it was made on",
                template.name
            )));
        }
        space_host::template::write_root_tar(&self.layout.template_root(template), out).map_err(EngineError::from)
    }

    fn has_layer(&self, chain: &ChainId) -> Result<bool, EngineError> {
        let has = self.has_chain(chain);
        if has {
            self.touch_chain(chain);
        }
        Ok(has)
    }

    fn list_layers(&self) -> Result<Vec<LayerEntry>, EngineError> {
        let Ok(entries) = fs::read_dir(self.layout.layer_cache()) else { return Ok(Vec::new()) };
        let mut layers: Vec<LayerEntry> = entries
            .flatten()
            .filter_map(|entry| {
                let chain = ChainId::parse(entry.file_name().to_str()?).ok()?;
                let meta = fs::symlink_metadata(entry.path()).ok().filter(fs::Metadata::is_dir)?;
                let used_s = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
                let bytes = btrfs::exclusive_bytes(&self.layout.layer_root(&chain)).unwrap_or(0);
                Some(LayerEntry { chain, bytes, used_s })
            })
            .collect();
        layers.sort_by(|a, b| (a.used_s, &a.chain).cmp(&(b.used_s, &b.chain)));
        layers.truncate(space_privsep::proto::MAX_LISTED);
        Ok(layers)
    }

    fn apply_layer(
        &self,
        parent: Option<&ChainId>,
        layer: &LayerKey,
        disk_mib: DiskMib,
        blob: fs::File,
        log: fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<LayerReady, EngineError> {
        let chain = ChainId::next(parent, layer);
        let _busy = self.chains.lock(&chain);
        if self.has_chain(&chain) {
            self.touch_chain(&chain);
            return Ok(LayerReady { chain, bytes: 0, cached: true });
        }
        let importer = self.importer("layers")?;
        self.keep_chain(chain, |partial| {
            self.fill_chain(importer, partial, parent, layer, disk_mib, &blob, &log, progress)
        })
    }

    fn delete_layer(&self, chain: &ChainId) -> Result<(), EngineError> {
        let _busy = self.chains.lock(chain);
        remove_build(&self.layout.layer_partial(chain))?;
        remove_build(&self.layout.layer_dir(chain))
    }

    fn save_layer(&self, sandbox: &SandboxId, parent: &ChainId, key: &StepKey) -> Result<LayerReady, EngineError> {
        // Written by the start, beside the root where the sandbox cannot
        // reach: a root is kept only as a layer on the chain it ran on.
        let recorded = fs::read_to_string(self.layout.sandbox_chain(sandbox))
            .ok()
            .and_then(|text| ChainId::parse(text.trim()).ok())
            .ok_or_else(|| refused(format!("sandbox {sandbox} was not started from a layer chain")))?;
        if &recorded != parent {
            return Err(refused(format!("sandbox {sandbox} was started from layer chain {recorded}, not {parent}")));
        }
        let root = self.layout.sandbox_root(sandbox);
        if !fs::symlink_metadata(&root).is_ok_and(|meta| meta.is_dir()) {
            return Err(refused(format!("sandbox {sandbox} has no root")));
        }
        let chain = ChainId::next(Some(parent), &LayerKey::Step { key: key.clone() });
        // The chain, then its parent: a chain's id is made from its
        // parent's, so no two saves can each hold what the other waits for.
        let _busy = self.chains.lock(&chain);
        if self.has_chain(&chain) {
            return Ok(LayerReady { chain, bytes: 0, cached: true });
        }
        let _parent_busy = self.chains.lock(parent);
        // What the platform wrote over is put back from the parent.
        if !self.has_chain(parent) {
            return Err(refused(format!("layer chain {parent} is not in the cache")));
        }
        self.keep_chain(chain, |partial| {
            let rootfs = partial.join("rootfs");
            btrfs::snapshot(&root, &rootfs).map_err(EngineError::from).and_then(|()| {
                // What the sandbox wrote of its own (its agent's copy too),
                // counted as of the snapshot's commit; 0 without quotas.
                let bytes = btrfs::exclusive_bytes(&root).unwrap_or(0);
                step_layer::strip_runtime(&rootfs, &self.layout.layer_root(parent))?;
                btrfs::set_read_only(&rootfs)?;
                Ok(bytes)
            })
        })
    }
}

impl LocalTemplates {
    /// Makes `chain` in the cache: its build dir `.<chain>.partial` (a
    /// killed request's stale one removed first: the caller holds the
    /// chain's lock), filled by `fill` (its bytes out), renamed into place;
    /// on failure nothing of it is left.
    fn keep_chain(
        &self,
        chain: ChainId,
        fill: impl FnOnce(&Path) -> Result<u64, EngineError>,
    ) -> Result<LayerReady, EngineError> {
        let partial = self.layout.layer_partial(&chain);
        remove_build(&partial)?;
        fs::create_dir_all(self.layout.layer_cache()).map_err(EngineError::io("creating the layer cache"))?;
        fs::create_dir(&partial).map_err(EngineError::io("creating a layer's build dir"))?;
        let bytes = match fill(&partial) {
            Ok(bytes) => bytes,
            Err(err) => {
                let _ = remove_build(&partial);
                return Err(err);
            }
        };
        fs::rename(&partial, self.layout.layer_dir(&chain)).map_err(EngineError::io("keeping a layer chain"))?;
        Ok(LayerReady { chain, bytes, cached: false })
    }

    /// Removes the build dirs of chains a killed apply left (one being
    /// applied now is locked and kept).
    fn sweep_layer_partials(&self) {
        let Ok(entries) = fs::read_dir(self.layout.layer_cache()) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let chain = name.to_str().and_then(|n| n.strip_prefix('.')).and_then(|n| n.strip_suffix(".partial"));
            let Some(Ok(chain)) = chain.map(ChainId::parse) else { continue };
            let Some(_busy) = self.chains.try_lock(&chain) else { continue };
            if let Err(err) = remove_build(&self.layout.layer_partial(&chain)) {
                tracing::warn!("removing a stale layer of chain {chain}: {err}");
            }
        }
    }

    /// The root of a chain's build dir `partial`: a snapshot of `parent`'s
    /// (or a new subvolume), `blob` applied by the importer, sealed.
    #[allow(clippy::too_many_arguments)]
    fn fill_chain(
        &self,
        importer: &Path,
        partial: &Path,
        parent: Option<&ChainId>,
        layer: &LayerKey,
        disk_mib: DiskMib,
        blob: &fs::File,
        log: &fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<u64, EngineError> {
        let rootfs = partial.join("rootfs");
        match parent {
            Some(parent) if !self.has_chain(parent) => {
                return Err(refused(format!("layer chain {parent} is not in the cache")));
            }
            Some(parent) => btrfs::snapshot(&self.layout.layer_root(parent), &rootfs)?,
            None => btrfs::create_subvolume(&rootfs)?,
        }
        btrfs::limit_exclusive_bytes(&rootfs, u64::from(disk_mib.get()) << 20)?;
        let (digest, diff_id) = match layer {
            LayerKey::Blob { digest, diff_id } => (Some(digest), diff_id.as_ref()),
            LayerKey::Step { .. } => (None, None),
        };
        let bytes =
            importer::import_layer(importer, partial, blob, digest, diff_id, log, progress).map_err(build_failed)?;
        btrfs::set_read_only(&rootfs)?;
        Ok(bytes)
    }
}
