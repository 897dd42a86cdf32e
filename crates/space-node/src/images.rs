//! Templates from images in OCI registries (issue 36, decision 030).
//!
//! A `POST /v1/templates` naming `from.image` is resolved before it is
//! accepted — an image or tag that is not there, credentials the registry
//! refuses, no linux/amd64 manifest, a format not supported — so such a
//! request is a 422 at once and nothing is reserved. Then the pull runs as
//! a build operation: each layer whose chain is not cached yet is
//! downloaded by this (unprivileged) server into its uploads dir and
//! checked against its digest before anyone reads it, the root side
//! applies it onto its parent chain through the confined importer
//! (`ApplyLayer`), and the template is a snapshot of the top chain with
//! this host's agent (`BuildTemplate` from `Layers`). Two templates on one
//! base share its chains; a re-pull downloads nothing.
//!
//! A registry credential is a tenant secret, opened for one build into a
//! [`Credential`] (never written to the template, its log, the operation
//! or this server's log).

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use space_api::{CreateTemplateRequest, ErrorCode, ImageSource, Operation, RegistryAuth, Template};
use space_engine::templates::{BuildInput, BuildProgress};
use space_host::template::{DefaultsOverride, TemplateMeta};
use space_host::HostError;
use space_image::{Client, Credential, ImageDefaults, ImageError, ImageRef, RegistryConfig, ResolvedImage};
use space_privsep::proto::{BlobDigest, ChainId, LayerKey};

use crate::error::NodeError;
use crate::platform::Platform;
use crate::secrets::secret_context;
use crate::templates::{build_disk_mib, checked_engine, checked_overrides, host_failed, open_log, quota_unknown};
use crate::tenants::Caller;

/// How long resolving an image may take before the request is answered
/// with why not (a registry that answers slowly is not one to pull from).
pub(crate) const RESOLVE_PATIENCE: Duration = Duration::from_secs(30);

/// The most layers an image may have (Docker's own limit is 127).
pub(crate) const MAX_LAYERS: usize = 256;

/// An image error as the API tells it: the request's fault (a 422 naming
/// `from.image`) or the registry's (a 502).
pub(crate) fn image_error(err: ImageError) -> NodeError {
    let error = match err.is_input_error() {
        true => NodeError::new(ErrorCode::ImageUnavailable, format!("the image cannot be pulled: {err}")),
        false => NodeError::new(ErrorCode::RegistryUnreachable, format!("the registry failed: {err}")),
    };
    error.with_details(serde_json::json!({"field": "from.image"}))
}

impl Platform {
    /// The registry settings (`space serve --insecure-registry` and the rest).
    pub(crate) fn registry_config(&self) -> RegistryConfig {
        self.registry.get().cloned().unwrap_or_default()
    }

    /// Accepts a template of a registry image: resolved here (so a bad one
    /// is a 422 and nothing is reserved), pulled in the background.
    pub async fn image_template(
        self: &Arc<Self>,
        request: CreateTemplateRequest,
        caller: &Caller,
    ) -> Result<(Template, Operation), NodeError> {
        let from = &request.from;
        let (Some(image), None, None, None) = (&from.image, &from.debian, &from.sandbox, &from.checkpoint) else {
            return Err(NodeError::unprocessable("`from` names exactly one of debian, sandbox, checkpoint or image")
                .with_details(serde_json::json!({"field": "from"})));
        };
        if !space_host::template::valid_name(&request.name) {
            return Err(NodeError::bad_request(format!(
                "template names are 1-63 lowercase letters, digits, '-' or '_', got {:?}",
                request.name
            )));
        }
        let given = checked_overrides(request.defaults.clone())?;
        let engine = checked_engine(request.engine.clone(), self.data.ext4_images())?;
        let config = self.registry_config();
        let reference = ImageRef::parse(image.reference(), &config).map_err(image_error)?;
        let credential = image.auth().map(|auth| self.registry_credential(&caller.tenant, auth)).transpose()?;
        let client = Client::new(&config).map_err(image_error)?;
        let resolved = tokio::time::timeout(RESOLVE_PATIENCE, client.resolve(&reference, credential.as_ref()))
            .await
            .map_err(|_| {
                image_error(ImageError::Network(format!(
                    "{} did not answer within {}s",
                    reference.registry,
                    RESOLVE_PATIENCE.as_secs()
                )))
            })?
            .map_err(image_error)?;
        if resolved.layers.is_empty() || resolved.layers.len() > MAX_LAYERS {
            return Err(image_error(ImageError::Unsupported(format!(
                "an image of {} layers (1 to {MAX_LAYERS} are pulled)",
                resolved.layers.len()
            ))));
        }
        if !resolved.diff_ids.is_empty() && resolved.diff_ids.len() != resolved.layers.len() {
            return Err(image_error(ImageError::Protocol(format!(
                "the config names {} layers, the manifest {}",
                resolved.diff_ids.len(),
                resolved.layers.len()
            ))));
        }
        // The layers as they download must fit what the tenant's quota and
        // the host's reserve leave (what they unpack to is capped the same
        // way, layer by layer, while they are applied).
        let allowance = self.build_allowance(&caller.tenant)?;
        if resolved.total_bytes > allowance {
            return Err(crate::disk::quota_exceeded(
                &caller.tenant,
                "disk",
                format!(
                    "the image's layers are {} bytes compressed; the tenant's disk quota (or the host's free space \
                     above its reserve) leaves {allowance}",
                    resolved.total_bytes
                ),
            ));
        }
        // Each is checked as a wire type now, so the job cannot fail on it.
        let keys = layer_keys(&resolved).map_err(|err| image_error(ImageError::Unsupported(err.to_string())))?;
        let source = image_source(image, &resolved);
        let slot = self.reserve_build(&request.name, source.clone(), caller)?;
        let (name, owner, tenant) = (slot.name.clone(), slot.owner.clone(), slot.tenant.clone());
        let runtime = tokio::runtime::Handle::current();
        let pull = Pull { runtime, client: Arc::new(client), image: Arc::new(resolved), keys };
        // Held until the template is published: its chains are not evicted
        // under it.
        let in_use = ChainsInUse::hold(self.clone(), &pull.keys);
        self.start_build(
            slot,
            Box::new(move |platform, operation_id, progress| {
                let grant = platform.grant_build_allowance(&tenant).map_err(quota_unknown)?;
                let disk_mib = build_disk_mib(grant.bytes)?;
                let log = open_log(&platform.data.log_path(operation_id))?;
                let top = platform.pull_layers(&pull, operation_id, disk_mib, &log, progress);
                let built = top.and_then(|top| {
                    let ext4 = platform.data.ext4_images();
                    platform.publish_version(&name, ext4, |template, _| {
                        let input = BuildInput::Layers { top };
                        let log = log.try_clone().map_err(HostError::io("the build log"))?;
                        platform
                            .template_host()
                            .build_template(template, input, disk_mib, log, progress)
                            .map_err(host_failed)?;
                        let defaults = given.apply(image_defaults(&pull.image.config));
                        Ok(TemplateMeta::unpublished(&name, source, defaults, owner, engine))
                    })
                });
                if let Err(err) = &built {
                    let _ = writeln!(&log, "the pull failed: {err}");
                }
                drop(grant);
                drop(in_use);
                platform.evict_layers();
                built
            }),
        )
    }

    /// A tenant's secret as a registry credential for one build: 422 when
    /// there is no such secret.
    pub(crate) fn registry_credential(&self, tenant: &str, auth: &RegistryAuth) -> Result<Credential, NodeError> {
        let fail = |why: String| {
            NodeError::unprocessable(format!("from.image.auth: {why}"))
                .with_details(serde_json::json!({"field": "from.image.auth"}))
        };
        let Some((hosts, sealed)) = self.store.tenancy().secret(tenant, &auth.secret)? else {
            return Err(fail(format!("there is no secret {:?} (PUT /v1/secrets/{{name}})", auth.secret)));
        };
        let plain = self
            .keyring()?
            .open(&secret_context(tenant, &auth.secret), &sealed)
            .ok_or_else(|| NodeError::internal("opening a secret", "its seal does not open"))?;
        let value = String::from_utf8(plain).map_err(|_| fail("the secret's value is not text".into()))?;
        if let Some(user) = &auth.username {
            if user.is_empty() || user.len() > 256 || user.contains(':') || user.chars().any(char::is_control) {
                return Err(fail("username is 1-256 characters, without ':' or control characters".into()));
            }
        }
        Ok(Credential { username: auth.username.clone(), value: value.into(), hosts })
    }

    /// Downloads and applies every layer of `pull` above the highest chain
    /// the cache has, lowest first, the next layers downloading while one
    /// is applied; the top chain out.
    pub(crate) fn pull_layers(
        &self,
        pull: &Pull,
        operation_id: &str,
        disk_mib: space_privsep::proto::DiskMib,
        log: &std::fs::File,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<ChainId, HostError> {
        let image = &pull.image;
        let count = image.layers.len();
        let _ = writeln!(
            &*log,
            "pulling {} ({}): {count} layers, {} bytes",
            image.reference, image.manifest_digest, image.total_bytes
        );
        let host = self.template_host();
        // Every chain's id is known before a byte is read: applying starts
        // above the highest one cached (a parent evicted under it costs
        // nothing).
        let chains = chain_ids(&pull.keys);
        let mut start = 0;
        for index in (0..count).rev() {
            if host.has_layer(&chains[index]).map_err(host_failed)? {
                start = index + 1;
                break;
            }
        }
        for (index, layer) in image.layers.iter().enumerate().take(start) {
            let number = index + 1;
            progress(BuildProgress::step(
                &format!("cached layer {number} of {count} ({})", short_digest(&layer.digest)),
                1,
            ));
            let _ = writeln!(&*log, "layer {number} of {count}: {} cached", layer.digest);
        }
        let uploads = self.uploads_dir();
        std::fs::create_dir_all(&uploads).map_err(HostError::io("creating the uploads dir"))?;
        // Named by the operation too: two builds pulling one blob at once
        // each have their own file.
        let blob_path = |index: usize| {
            let hex = image.layers[index].digest.trim_start_matches("sha256:");
            uploads.join(format!(".blob-{operation_id}-{hex}"))
        };
        let mut ahead: std::collections::VecDeque<Download> = std::collections::VecDeque::new();
        let mut next = start;
        let mut parent = start.checked_sub(1).map(|index| chains[index].clone());
        let mut outcome = Ok(());
        for index in start..count {
            while next < count && ahead.len() < DOWNLOADS_AHEAD {
                ahead.push_back(Download::start(pull, next, blob_path(next)));
                next += 1;
            }
            let Some(mut download) = ahead.pop_front() else { break };
            let (number, layer, key) = (index + 1, &image.layers[index], &pull.keys[index]);
            let step =
                format!("pulling layer {number} of {count} ({}, {})", short_digest(&layer.digest), mib(layer.size));
            let applied = download.finish(pull, &step, progress).and_then(|()| {
                let file = std::fs::File::open(&download.path).map_err(HostError::io("opening a pulled layer"))?;
                let log = log.try_clone().map_err(HostError::io("the build log"))?;
                progress(BuildProgress::bytes(&format!("applying layer {number} of {count}"), 2, 0, layer.size));
                host.apply_layer(parent.as_ref(), key, disk_mib, file, log, progress).map_err(host_failed)
            });
            let _ = std::fs::remove_file(&download.path);
            match applied {
                Ok(ready) => {
                    let _ =
                        writeln!(&*log, "layer {number} of {count}: {} applied ({} bytes)", layer.digest, ready.bytes);
                    parent = Some(ready.chain);
                }
                Err(err) => {
                    outcome = Err(err);
                    break;
                }
            }
        }
        // What still downloads is stopped, and its file goes.
        for download in ahead {
            download.cancel(pull);
        }
        outcome?;
        parent.ok_or_else(|| HostError::Invalid("the image has no layers".into()))
    }
}

impl Platform {
    /// Removes the blobs a killed server was pulling (at start: no pull
    /// of this process has begun yet).
    pub(crate) fn sweep_pulled_blobs(&self) {
        for entry in std::fs::read_dir(self.uploads_dir()).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(".blob-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// How many layers download at once, the one being applied waited for
/// first: on a fast registry applying is the slower half, and each one
/// ahead takes its blob's disk.
const DOWNLOADS_AHEAD: usize = 2;

/// A layer blob downloading on the runtime into `path` (its digest checked
/// before the file gets that name).
struct Download {
    index: usize,
    path: std::path::PathBuf,
    received: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<Result<(), ImageError>>,
}

impl Download {
    fn start(pull: &Pull, index: usize, path: std::path::PathBuf) -> Download {
        let (client, image, dest) = (pull.client.clone(), pull.image.clone(), path.clone());
        let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = received.clone();
        let task = pull.runtime.spawn(async move {
            let layer = &image.layers[index];
            client
                .download_blob(&image, layer, &dest, &mut |bytes| {
                    counter.store(bytes, std::sync::atomic::Ordering::Relaxed);
                })
                .await
        });
        Download { index, path, received, task }
    }

    /// Waits for the download, its bytes told to `progress` as they come.
    fn finish(&mut self, pull: &Pull, step: &str, progress: &mut dyn FnMut(BuildProgress)) -> Result<(), HostError> {
        let total = pull.image.layers[self.index].size;
        while !self.task.is_finished() {
            let bytes = self.received.load(std::sync::atomic::Ordering::Relaxed);
            progress(BuildProgress::bytes(step, 1, bytes, total));
            std::thread::sleep(PROGRESS_EVERY);
        }
        progress(BuildProgress::bytes(step, 1, total, total));
        match pull.runtime.block_on(&mut self.task) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) if err.is_input_error() => Err(HostError::Invalid(err.to_string())),
            Ok(Err(err)) => Err(HostError::Io {
                what: "downloading a layer".into(),
                source: std::io::Error::other(err.to_string()),
            }),
            Err(err) => Err(HostError::Io { what: "downloading a layer".into(), source: std::io::Error::other(err) }),
        }
    }

    /// Stops the download (its partial file goes with it) and removes
    /// what it finished.
    fn cancel(mut self, pull: &Pull) {
        self.task.abort();
        let _ = pull.runtime.block_on(&mut self.task);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How often a download's bytes are told while a pull waits for it.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Each layer's chain, lowest first: what the helper computes from the
/// same keys.
fn chain_ids(keys: &[LayerKey]) -> Vec<ChainId> {
    let mut parent: Option<ChainId> = None;
    keys.iter()
        .map(|key| {
            let chain = ChainId::next(parent.as_ref(), key);
            parent = Some(chain.clone());
            chain
        })
        .collect()
}

/// The chains of an image, held in use (not evicted) while it is pulled.
pub(crate) struct ChainsInUse {
    platform: Arc<Platform>,
    chains: Vec<String>,
}

impl ChainsInUse {
    pub(crate) fn hold(platform: Arc<Platform>, keys: &[LayerKey]) -> ChainsInUse {
        ChainsInUse::hold_chains(platform, &chain_ids(keys))
    }

    /// Holds `chains` (a Dockerfile build's own steps) as in use.
    pub(crate) fn hold_chains(platform: Arc<Platform>, chains: &[ChainId]) -> ChainsInUse {
        let chains: Vec<String> = chains.iter().map(|chain| chain.as_str().to_string()).collect();
        let mut in_use = platform.chains_in_use.lock().unwrap_or_else(|e| e.into_inner());
        for chain in &chains {
            *in_use.entry(chain.clone()).or_default() += 1;
        }
        drop(in_use);
        ChainsInUse { platform, chains }
    }
}

impl Drop for ChainsInUse {
    fn drop(&mut self) {
        let mut in_use = self.platform.chains_in_use.lock().unwrap_or_else(|e| e.into_inner());
        for chain in &self.chains {
            if let Some(count) = in_use.get_mut(chain) {
                *count -= 1;
                if *count == 0 {
                    in_use.remove(chain);
                }
            }
        }
    }
}

impl Platform {
    /// Deletes layer chains, least recently used first, until the cache is
    /// within its size (`--layer-cache-mib`), sparing those a pull under
    /// way uses. A template made of a chain keeps its own snapshot of it;
    /// a later pull of an evicted layer downloads it again. Blocks.
    pub(crate) fn evict_layers(&self) {
        let limit = self.layer_cache_bytes.load(std::sync::atomic::Ordering::Relaxed);
        let host = self.template_host();
        let layers = match host.list_layers() {
            Ok(layers) => layers,
            Err(err) => {
                tracing::warn!("listing the layer cache: {err}");
                return;
            }
        };
        let mut total: u64 = layers.iter().map(|layer| layer.bytes).sum();
        let in_use = self.chains_in_use.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for layer in evictable(&layers, &in_use) {
            if total <= limit {
                break;
            }
            match host.delete_layer(&layer.chain) {
                Ok(()) => {
                    total = total.saturating_sub(layer.bytes);
                    tracing::info!(chain = %layer.chain, bytes = layer.bytes, "evicted a layer chain");
                }
                Err(err) => tracing::warn!(chain = %layer.chain, "evicting a layer chain: {err}"),
            }
        }
    }
}

/// The chains eviction may take, least recently used first: every one no
/// pull under way uses.
fn evictable<'a>(
    layers: &'a [space_privsep::proto::LayerEntry],
    in_use: &'a std::collections::HashMap<String, usize>,
) -> impl Iterator<Item = &'a space_privsep::proto::LayerEntry> {
    layers.iter().filter(|layer| !in_use.contains_key(layer.chain.as_str()))
}

/// What a pull job carries from the request.
pub(crate) struct Pull {
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) client: Arc<Client>,
    pub(crate) image: Arc<ResolvedImage>,
    /// Each layer's chain key, as the helper checks it.
    pub(crate) keys: Vec<LayerKey>,
}

pub(crate) fn layer_keys(image: &ResolvedImage) -> Result<Vec<LayerKey>, space_privsep::proto::ProtoError> {
    image
        .layers
        .iter()
        .enumerate()
        .map(|(index, layer)| {
            let diff_id = image.diff_ids.get(index).map(|d| BlobDigest::parse(d)).transpose()?;
            Ok(LayerKey::Blob { digest: BlobDigest::parse(&layer.digest)?, diff_id })
        })
        .collect()
}

/// The template's `source`: what was asked and what it resolved to (a
/// credential only by its secret's name).
fn image_source(asked: &ImageSource, image: &ResolvedImage) -> serde_json::Value {
    let mut source = serde_json::json!({
        "reference": asked.reference(),
        "resolved": image.reference.to_string(),
        "digest": image.manifest_digest,
        "layers": image.layers.len(),
        "bytes": image.total_bytes,
    });
    if let Some(index) = &image.index_digest {
        source["index_digest"] = index.clone().into();
    }
    if let Some(auth) = asked.auth() {
        source["auth"] = serde_json::json!({"secret": auth.secret});
    }
    if !image.config.exposed_ports.is_empty() {
        source["exposed_ports"] = serde_json::json!(image.config.exposed_ports);
    }
    if !image.config.labels.is_empty() {
        source["labels"] = serde_json::json!(image.config.labels);
    }
    serde_json::json!({"image": source})
}

/// The image config's `Env`, `WorkingDir`, `User` and start command as a
/// template's defaults (a request's own win over them).
pub(crate) fn image_defaults(config: &ImageDefaults) -> DefaultsOverride {
    let mut defaults = DefaultsOverride { workdir: Some("/".into()), user: Some("root".into()), ..Default::default() };
    for pair in &config.env {
        if let Some((key, value)) = pair.split_once('=') {
            defaults.env.insert(key.to_string(), value.to_string());
        }
    }
    if let Some(dir) = config.working_dir.as_deref().filter(|d| d.starts_with('/')) {
        defaults.workdir = Some(dir.to_string());
    }
    if let Some(user) = config.user.as_deref().filter(|u| !u.is_empty()) {
        defaults.user = Some(user.to_string());
    }
    let command: Vec<String> = config.entrypoint.iter().chain(&config.cmd).cloned().collect();
    defaults.command = (!command.is_empty()).then_some(command);
    defaults
}

/// `sha256:0123456789ab`: enough of a digest to tell layers apart in a step.
fn short_digest(digest: &str) -> &str {
    &digest[..digest.len().min("sha256:".len() + 12)]
}

fn mib(bytes: u64) -> String {
    match bytes {
        b if b < 1 << 20 => format!("{} KiB", b.div_ceil(1024)),
        b => format!("{:.1} MiB", b as f64 / f64::from(1 << 20)),
    }
}
