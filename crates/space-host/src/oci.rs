//! OCI image archives → template roots.
//!
//! Both `docker save` output (`manifest.json`) and an OCI image layout
//! (`index.json` and `blobs/`) in a tar are read in place from the uploaded
//! file: the outer tar is indexed once (member → offset, size) and each
//! layer is streamed from there through the digest check, gzip and the tar
//! reader straight into the root. Nothing is held in memory beyond one
//! entry's buffer, and every path an archive names is checked before it is
//! touched: absolute paths, `..`, links leading out of the root and layers
//! that do not match their digests fail the build with a precise reason.

use std::collections::HashMap;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Component, Path, PathBuf};

use oci_spec::image::{ImageIndex, ImageManifest, MediaType};
use sha2::{Digest, Sha256};

pub use crate::layer::apply_tar;
use crate::layer::clean_relative;
use crate::template::{install_agent, BuildProgress, DefaultsOverride};
use crate::{btrfs, HostError};

/// The largest JSON document (manifest, index, config) read from an archive.
const MAX_JSON: u64 = 8 << 20;
fn bad(reason: impl Into<String>) -> HostError {
    HostError::Invalid(reason.into())
}

/// What an imported image says of itself: the template's source and the
/// defaults its config sets (a request's own win over them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Imported {
    pub source: serde_json::Value,
    pub defaults: DefaultsOverride,
}

/// Reads an image archive: its layers applied to `rootfs`, a
/// gzip-compressed archive decompressed into `work` first (and removed
/// again); the build log goes to `log`. It writes nowhere else, needs no
/// capability but those of changing files' owners and modes, and runs no
/// program: only the confined importer child calls it (decision 027),
/// never a root process with its capabilities.
pub fn extract_oci(
    rootfs: &Path,
    work: &Path,
    archive: &fs::File,
    log: &fs::File,
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Imported, HostError> {
    let mut log = log;
    let result = extract_oci_logged(rootfs, work, archive, &mut log, max_bytes, progress);
    if let Err(err) = &result {
        let _ = writeln!(log, "import failed: {err}");
    }
    result
}

/// What a root needs after [`extract_oci`] (and its child ended): the
/// agent put into it, and it sealed read-only.
pub fn finish_oci(rootfs: &Path, agent_bin: &Path, progress: &mut dyn FnMut(BuildProgress)) -> Result<(), HostError> {
    progress(BuildProgress::step("installing the agent", 3));
    install_agent(rootfs, agent_bin)?;
    btrfs::set_read_only(rootfs)
}

fn extract_oci_logged(
    rootfs: &Path,
    work: &Path,
    archive: &fs::File,
    log: &mut &fs::File,
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Imported, HostError> {
    let step = |step: &str, done| BuildProgress::step(step, done);
    progress(step("reading the archive", 0));
    let archive = OuterArchive::open(archive, work, max_bytes)?;
    let image = archive.image()?;
    let _ = writeln!(log, "image: {} ({} layers)", image.format, image.layers.len());
    let total: u64 = image.layers.iter().map(|l| l.size).sum();
    let mut done = 0;
    for (n, layer) in image.layers.iter().enumerate() {
        let what = format!("applying layer {} of {}", n + 1, image.layers.len());
        let _ = writeln!(log, "{what}: {} ({} bytes)", layer.member, layer.size);
        let mut report = |bytes: u64| progress(BuildProgress::bytes(&what, 2, done + bytes, total));
        apply_layer(&archive, layer, n + 1, rootfs, log, &mut report)?;
        done += layer.size;
    }
    archive.discard();
    let source = serde_json::json!({"oci": {
        "format": image.format,
        "digest": image.digest,
        "layers": image.layers.len(),
        "bytes": total,
    }});
    Ok(Imported { source, defaults: image.defaults })
}

/// A member's bytes: a window of the archive read at positions of its
/// own, so readers of one descriptor never move each other's offset.
struct MemberReader<'a> {
    file: &'a fs::File,
    at: u64,
    end: u64,
}

impl Read for MemberReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let left = self.end.saturating_sub(self.at);
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let read = self.file.read_at(&mut buf[..want], self.at)?;
        self.at += read as u64;
        Ok(read)
    }
}

/// A member of the outer archive: its data in the file, or a link to another member.
#[derive(Debug, Clone)]
enum Member {
    Data { offset: u64, size: u64 },
    Link(String),
}

/// The uploaded archive, indexed.
struct OuterArchive<'a> {
    /// The upload, or its decompressed copy.
    file: Archived<'a>,
    /// Where the decompressed copy is, to remove it.
    decompressed: Option<PathBuf>,
    members: HashMap<String, Member>,
}

/// What the image says, ready to apply.
struct Image {
    format: &'static str,
    digest: String,
    layers: Vec<Layer>,
    defaults: DefaultsOverride,
}

struct Layer {
    member: String,
    size: u64,
    /// Digest of the blob as stored (compressed), when the format names it.
    blob_digest: Option<String>,
    /// Digest of the uncompressed tar (`rootfs.diff_ids`).
    diff_id: String,
}

/// The archive's bytes: the descriptor given, or a copy of our own.
enum Archived<'a> {
    Given(&'a fs::File),
    Copy(fs::File),
}

impl Archived<'_> {
    fn file(&self) -> &fs::File {
        match self {
            Archived::Given(file) => file,
            Archived::Copy(file) => file,
        }
    }

    fn whole(&self) -> MemberReader<'_> {
        MemberReader { file: self.file(), at: 0, end: u64::MAX }
    }
}

impl<'a> OuterArchive<'a> {
    /// Opens the upload; a gzip-compressed one is decompressed into `work`
    /// first, at most `max_bytes` of it (a small archive may expand a
    /// thousandfold).
    fn open(upload: &'a fs::File, work: &Path, max_bytes: Option<u64>) -> Result<OuterArchive<'a>, HostError> {
        let mut magic = [0u8; 2];
        let whole = || MemberReader { file: upload, at: 0, end: u64::MAX };
        let gzip = whole().read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
        let (file, decompressed) = if gzip {
            let plain = work.join("image.tar");
            let mut out = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&plain)
                .map_err(HostError::io("decompressing the archive"))?;
            let reader = flate2::read::MultiGzDecoder::new(BufReader::new(whole()));
            let cap = max_bytes.unwrap_or(u64::MAX);
            let copied = io::copy(&mut BufReader::new(reader).take(cap.saturating_add(1)), &mut out)
                .map_err(|e| bad(format!("the archive is gzip-compressed but does not decompress: {e}")))?;
            if copied > cap {
                drop(out);
                let _ = fs::remove_file(&plain);
                return Err(bad(format!(
                    "the archive decompresses to more than {cap} bytes, the disk this import may use \
                     (the tenant's quota left, or the host's free space above its reserve)"
                )));
            }
            (Archived::Copy(out), Some(plain))
        } else {
            (Archived::Given(upload), None)
        };
        let members = index_members(file.whole())?;
        Ok(OuterArchive { file, decompressed, members })
    }

    fn discard(&self) {
        if let Some(copy) = &self.decompressed {
            let _ = fs::remove_file(copy);
        }
    }

    /// A member's bytes, following member links.
    fn open_member(&self, name: &str) -> Result<(MemberReader<'_>, u64), HostError> {
        let mut name = name.to_string();
        for _ in 0..8 {
            match self.members.get(&name) {
                Some(Member::Data { offset, size }) => {
                    let reader =
                        MemberReader { file: self.file.file(), at: *offset, end: offset.saturating_add(*size) };
                    return Ok((reader, *size));
                }
                Some(Member::Link(target)) => name = target.clone(),
                None => return Err(bad(format!("the archive has no {name:?}, which the image refers to"))),
            }
        }
        Err(bad(format!("the archive's links around {name:?} go in circles")))
    }

    fn read_json(&self, name: &str, digest: Option<&str>) -> Result<Vec<u8>, HostError> {
        let (reader, size) = self.open_member(name)?;
        if size > MAX_JSON {
            return Err(bad(format!("{name} is {size} bytes, more than a manifest or config may be")));
        }
        let mut bytes = Vec::with_capacity(size as usize);
        let mut reader = reader;
        reader.read_to_end(&mut bytes).map_err(HostError::io(format!("reading {name}")))?;
        if let Some(expected) = digest {
            let actual = format!("sha256:{}", hex(&Sha256::digest(&bytes)));
            if actual != expected {
                return Err(bad(format!("{name} does not match its digest {expected} (it is {actual})")));
            }
        }
        Ok(bytes)
    }

    fn image(&self) -> Result<Image, HostError> {
        if self.members.contains_key("manifest.json") {
            self.docker_image()
        } else if self.members.contains_key("index.json") {
            self.oci_image()
        } else {
            Err(bad("the archive has neither manifest.json (docker save) nor index.json (OCI image layout)"))
        }
    }

    /// `docker save`: `manifest.json` names the config and layer files.
    fn docker_image(&self) -> Result<Image, HostError> {
        #[derive(serde::Deserialize)]
        struct Entry {
            #[serde(rename = "Config")]
            config: String,
            #[serde(rename = "Layers")]
            layers: Vec<String>,
        }
        let bytes = self.read_json("manifest.json", None)?;
        let entries: Vec<Entry> =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("manifest.json is not a docker manifest: {e}")))?;
        let [entry] = entries.as_slice() else {
            return Err(bad(format!("manifest.json lists {} images; import one at a time", entries.len())));
        };
        let config_digest = digest_of_member_name(&entry.config);
        let config = self.read_json(&clean_name(&entry.config)?, config_digest.as_deref())?;
        let digest = config_digest.unwrap_or_else(|| format!("sha256:{}", hex(&Sha256::digest(&config))));
        let config = parse_config(&config)?;
        let diff_ids = &config.rootfs.diff_ids;
        if diff_ids.len() != entry.layers.len() {
            return Err(bad(format!(
                "the config lists {} layers but manifest.json {}",
                diff_ids.len(),
                entry.layers.len()
            )));
        }
        let mut layers = Vec::new();
        for (member, diff_id) in entry.layers.iter().zip(diff_ids) {
            let member = clean_name(member)?;
            let (_, size) = self.open_member(&member)?;
            layers.push(Layer { blob_digest: digest_of_member_name(&member), member, size, diff_id: diff_id.clone() });
        }
        Ok(Image { format: "docker-save", digest, layers, defaults: image_defaults(&config) })
    }

    /// OCI image layout: `index.json` → (index →) manifest → config, layers.
    fn oci_image(&self) -> Result<Image, HostError> {
        let bytes = self.read_json("index.json", None)?;
        let mut index =
            ImageIndex::from_reader(&bytes[..]).map_err(|e| bad(format!("index.json is not an OCI index: {e}")))?;
        for _ in 0..4 {
            let manifests = index.manifests();
            let chosen = manifests
                .iter()
                .find(|d| {
                    d.platform()
                        .as_ref()
                        .is_some_and(|p| p.os().to_string() == "linux" && p.architecture().to_string() == "amd64")
                })
                .or_else(|| manifests.first())
                .ok_or_else(|| bad("the OCI index lists no manifest"))?;
            let digest = chosen.digest().to_string();
            let blob = self.read_json(&blob_member(&digest)?, Some(&digest))?;
            if *chosen.media_type() == MediaType::ImageIndex {
                index =
                    ImageIndex::from_reader(&blob[..]).map_err(|e| bad(format!("{digest}: not an OCI index: {e}")))?;
                continue;
            }
            let manifest = ImageManifest::from_reader(&blob[..])
                .map_err(|e| bad(format!("{digest}: not an OCI image manifest: {e}")))?;
            let config_digest = manifest.config().digest().to_string();
            let config = parse_config(&self.read_json(&blob_member(&config_digest)?, Some(&config_digest))?)?;
            let diff_ids = &config.rootfs.diff_ids;
            if diff_ids.len() != manifest.layers().len() {
                return Err(bad(format!(
                    "the config lists {} layers but the manifest {}",
                    diff_ids.len(),
                    manifest.layers().len()
                )));
            }
            let mut layers = Vec::new();
            for (descriptor, diff_id) in manifest.layers().iter().zip(diff_ids) {
                let layer_digest = descriptor.digest().to_string();
                // A foreign layer is fetched from URLs its image names: an
                // import reads nothing but the archive it was given.
                if descriptor.urls().as_ref().is_some_and(|urls| !urls.is_empty())
                    || descriptor.media_type().to_string().contains("foreign")
                    || descriptor.media_type().to_string().contains("nondistributable")
                {
                    return Err(bad(format!(
                        "layer {layer_digest} is a foreign layer (its image says to fetch it from elsewhere): \
                         only layers inside the archive are imported"
                    )));
                }
                let member = blob_member(&layer_digest)?;
                let (_, size) = self.open_member(&member)?;
                if size != descriptor.size() {
                    return Err(bad(format!(
                        "layer {layer_digest} is {size} bytes but the manifest says {}",
                        descriptor.size()
                    )));
                }
                layers.push(Layer { member, size, blob_digest: Some(layer_digest), diff_id: diff_id.clone() });
            }
            return Ok(Image { format: "oci-layout", digest, layers, defaults: image_defaults(&config) });
        }
        Err(bad("the OCI index nests too deeply"))
    }
}

/// The parts of an image config an import uses. (Parsed leniently: the
/// spec makes `history` and most of `config` optional.)
#[derive(serde::Deserialize)]
struct ImageConfig {
    #[serde(default)]
    config: Option<RuntimeConfig>,
    rootfs: RootFs,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct RuntimeConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
}

#[derive(serde::Deserialize)]
struct RootFs {
    diff_ids: Vec<String>,
}

fn parse_config(bytes: &[u8]) -> Result<ImageConfig, HostError> {
    serde_json::from_slice(bytes).map_err(|e| bad(format!("the image config is not valid: {e}")))
}

/// The image config's `Env`, `WorkingDir` and `User` as template defaults.
fn image_defaults(config: &ImageConfig) -> DefaultsOverride {
    let mut defaults = DefaultsOverride { workdir: Some("/".into()), user: Some("root".into()), ..Default::default() };
    let Some(runtime) = &config.config else { return defaults };
    for pair in runtime.env.iter().flatten() {
        if let Some((key, value)) = pair.split_once('=') {
            defaults.env.insert(key.to_string(), value.to_string());
        }
    }
    if let Some(dir) = runtime.working_dir.as_deref().filter(|d| d.starts_with('/')) {
        defaults.workdir = Some(dir.to_string());
    }
    if let Some(user) = runtime.user.as_deref().filter(|u| !u.is_empty()) {
        defaults.user = Some(user.to_string());
    }
    let command: Vec<String> =
        runtime.entrypoint.iter().flatten().chain(runtime.cmd.iter().flatten()).cloned().collect();
    defaults.command = (!command.is_empty()).then_some(command);
    defaults
}

/// `blobs/<algorithm>/<hex>` for a digest we can check.
fn blob_member(digest: &str) -> Result<String, HostError> {
    match digest.split_once(':') {
        Some(("sha256", hex)) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(format!("blobs/sha256/{hex}"))
        }
        _ => Err(bad(format!("unsupported digest {digest:?} (only sha256 is supported)"))),
    }
}

/// The digest a member's name promises: `blobs/sha256/<hex>` or `<hex>.json`.
fn digest_of_member_name(name: &str) -> Option<String> {
    let name = name.trim_start_matches("./");
    let hex = name.strip_prefix("blobs/sha256/").or_else(|| name.strip_suffix(".json"))?;
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| format!("sha256:{hex}"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A relative member name with only normal components, joined by `/`.
fn clean_name(name: &str) -> Result<String, HostError> {
    let path = clean_relative(Path::new(name)).map_err(|why| bad(format!("archive member {name:?}: {why}")))?;
    Ok(path.to_string_lossy().into_owned())
}

/// Indexes the outer tar: each regular member's data offset and size, and links.
fn index_members(file: MemberReader<'_>) -> Result<HashMap<String, Member>, HostError> {
    let mut archive = tar::Archive::new(BufReader::new(file));
    let not_tar = |e: io::Error| bad(format!("the upload is not a tar archive: {e}"));
    let mut members = HashMap::new();
    for entry in archive.entries().map_err(not_tar)? {
        let entry = entry.map_err(not_tar)?;
        let raw = entry.path().map_err(not_tar)?.to_string_lossy().into_owned();
        let name = clean_name(&raw)?;
        let kind = entry.header().entry_type();
        let member = if kind.is_file() {
            Member::Data { offset: entry.raw_file_position(), size: entry.size() }
        } else if kind.is_symlink() || kind.is_hard_link() {
            let target = entry.link_name().map_err(not_tar)?.ok_or_else(|| bad(format!("{raw:?}: empty link")))?;
            let target = if kind.is_symlink() {
                Path::new(&name).parent().unwrap_or(Path::new("")).join(target)
            } else {
                target.into_owned()
            };
            Member::Link(clean_name(
                &normalize_lexically(&target)
                    .ok_or_else(|| bad(format!("archive member {raw:?} links outside the archive")))?,
            )?)
        } else {
            continue;
        };
        members.insert(name, member);
    }
    if members.is_empty() {
        return Err(bad("the upload is not a tar archive (no members found)"));
    }
    Ok(members)
}

/// Resolves `.` and `..` without touching the disk; `None` if it climbs out.
fn normalize_lexically(path: &Path) -> Option<String> {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.iter().map(|p| p.to_string_lossy()).collect::<Vec<_>>().join("/"))
}

/// Counts and hashes what passes through.
struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    count: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count.set(self.count.get() + n as u64);
        Ok(n)
    }
}

/// How a layer's blob is compressed, told by its first bytes (a media
/// type can lie; the bytes are what is decoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    Gzip,
    Zstd,
    None,
}

/// The largest zstd window a layer may use, as a power of two: 128 MiB.
const ZSTD_WINDOW_LOG_MAX: u32 = 27;

/// A zstd decoder of `raw` that gives a frame at most a window of
/// [`ZSTD_WINDOW_LOG_MAX`]: a frame may ask for up to 2 GiB of memory (a
/// bomb in a few bytes), which is then refused, not allocated.
fn zstd_decoder<R: io::BufRead>(raw: R) -> io::Result<zstd::stream::read::Decoder<'static, R>> {
    let mut decoder = zstd::stream::read::Decoder::with_buffer(raw)?;
    decoder.window_log_max(ZSTD_WINDOW_LOG_MAX)?;
    Ok(decoder)
}

fn apply_layer(
    archive: &OuterArchive,
    layer: &Layer,
    number: usize,
    root: &Path,
    log: &mut dyn Write,
    report: &mut dyn FnMut(u64),
) -> Result<(), HostError> {
    let (blob, _) = archive.open_member(&layer.member)?;
    let expected = LayerDigests { blob: layer.blob_digest.as_deref(), diff_id: Some(&layer.diff_id) };
    apply_blob(blob, expected, root, log, report)
        .map_err(|err| match err {
            HostError::Invalid(why) => bad(format!("layer {number} ({}): {why}", layer.member)),
            other => other,
        })
        .map(drop)?;
    report(layer.size);
    Ok(())
}

/// What a layer's bytes must hash to, where that is known.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerDigests<'a> {
    /// The blob as stored (compressed or not), `sha256:…`.
    pub blob: Option<&'a str>,
    /// The uncompressed tar (the image config's `rootfs.diff_ids`).
    pub diff_id: Option<&'a str>,
}

/// What [`apply_blob`] applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedLayer {
    pub blob_digest: String,
    pub diff_id: String,
    /// Bytes of the blob read.
    pub blob_bytes: u64,
}

/// Applies one layer blob — gzip, zstd or a plain tar, told by its bytes —
/// to `root` (whiteouts and opaque directories as OCI says, every path
/// kept inside `root`), checking it against `expected` once it has all
/// been read: a mismatch is the input's fault (`HostError::Invalid`), and
/// what was written stays for the caller to throw away with the root.
/// `report` is told how many blob bytes were read, every few MiB.
pub fn apply_blob(
    blob: impl Read,
    expected: LayerDigests<'_>,
    root: &Path,
    log: &mut dyn Write,
    report: &mut dyn FnMut(u64),
) -> Result<AppliedLayer, HostError> {
    let read_so_far = std::rc::Rc::new(std::cell::Cell::new(0));
    let mut raw =
        BufReader::with_capacity(1 << 20, Hashing { inner: blob, hasher: Sha256::new(), count: read_so_far.clone() });
    let head = raw.fill_buf().map_err(|e| bad(format!("reading: {e}")))?;
    let compression = match head {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Compression::Zstd,
        _ => Compression::None,
    };
    let diff_id = {
        let decoded: Box<dyn Read + '_> = match compression {
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(&mut raw)),
            Compression::Zstd => Box::new(zstd_decoder(&mut raw).map_err(|e| bad(format!("zstd: {e}")))?),
            Compression::None => Box::new(&mut raw),
        };
        let uncompressed = Hashing { inner: decoded, hasher: Sha256::new(), count: Default::default() };
        let mut last_report = 0;
        let mut progress = || {
            if read_so_far.get() - last_report > (4 << 20) {
                last_report = read_so_far.get();
                report(last_report);
            }
        };
        let mut uncompressed = apply_tar(root, uncompressed, log, &mut progress)?;
        io::copy(&mut uncompressed, &mut io::sink()).map_err(|e| bad(format!("reading the end: {e}")))?;
        format!("sha256:{}", hex(&uncompressed.hasher.finalize()))
    };
    io::copy(&mut raw, &mut io::sink()).map_err(|e| bad(format!("reading the end: {e}")))?;
    let blob_digest = format!("sha256:{}", hex(&raw.into_inner().hasher.finalize()));
    if let Some(expected) = expected.blob {
        if expected != blob_digest {
            return Err(bad(format!("the content does not match its digest {expected} (it is {blob_digest})")));
        }
    }
    if let Some(expected) = expected.diff_id {
        if expected != diff_id {
            return Err(bad(format!("the content does not match diff_id {expected} (it is {diff_id})")));
        }
    }
    Ok(AppliedLayer { blob_digest, diff_id, blob_bytes: read_so_far.get() })
}

/// The two archive shapes [`write_archive`] makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchiveFormat {
    /// `docker save` (legacy layout): `manifest.json`, `<id>/layer.tar`, `<hex>.json`.
    DockerSave,
    /// An OCI image layout with gzip-compressed layers.
    OciLayout,
    /// An OCI image layout with zstd-compressed layers.
    OciLayoutZstd,
}

/// The runtime part of an image config.
#[derive(Debug, Clone, Default)]
pub struct ImageSettings {
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
}

/// Writes an image archive at `out` from uncompressed layer tars (lowest
/// first), streaming them from disk. The benchmark and the tests make their
/// images with it; it writes what `docker save` and OCI tools write.
pub fn write_archive(
    out: &Path,
    format: ArchiveFormat,
    layers: &[PathBuf],
    settings: &ImageSettings,
) -> Result<(), HostError> {
    let err = |what: &str| HostError::io(format!("writing the image archive: {what}"));
    let file = fs::File::create(out).map_err(err("creating it"))?;
    let mut tar = tar::Builder::new(io::BufWriter::with_capacity(1 << 20, file));
    let mut diff_ids = Vec::new();
    let mut members = Vec::new();
    let mut blobs = Vec::new();
    for (n, layer) in layers.iter().enumerate() {
        let diff_id = format!("sha256:{}", hex(&file_sha256(layer)?));
        match format {
            ArchiveFormat::DockerSave => {
                let member = format!("{:064x}/layer.tar", n + 1);
                append_file(&mut tar, &member, layer)?;
                members.push(member);
            }
            ArchiveFormat::OciLayout | ArchiveFormat::OciLayoutZstd => {
                let zstd = format == ArchiveFormat::OciLayoutZstd;
                let packed = layer.with_extension(if zstd { "tar.zst" } else { "tar.gz" });
                let mut input = fs::File::open(layer).map_err(err("a layer"))?;
                let output = fs::File::create(&packed).map_err(err("compressing a layer"))?;
                if zstd {
                    zstd::stream::copy_encode(&mut input, output, 3).map_err(err("zstd"))?;
                } else {
                    let mut encoder = flate2::write::GzEncoder::new(output, Default::default());
                    io::copy(&mut input, &mut encoder).map_err(err("gzip"))?;
                    encoder.finish().map_err(err("gzip"))?;
                }
                let digest = format!("sha256:{}", hex(&file_sha256(&packed)?));
                let size = fs::metadata(&packed).map_err(err("compressing a layer"))?.len();
                append_file(&mut tar, &blob_member(&digest)?, &packed)?;
                fs::remove_file(&packed).map_err(err("compressing a layer"))?;
                let media_type = if zstd {
                    "application/vnd.oci.image.layer.v1.tar+zstd"
                } else {
                    "application/vnd.oci.image.layer.v1.tar+gzip"
                };
                blobs.push(serde_json::json!({"mediaType": media_type, "digest": digest, "size": size}));
            }
        }
        diff_ids.push(diff_id);
    }
    let mut runtime = serde_json::json!({"Env": settings.env});
    if let Some(dir) = &settings.working_dir {
        runtime["WorkingDir"] = dir.clone().into();
    }
    if let Some(user) = &settings.user {
        runtime["User"] = user.clone().into();
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .map_err(|e| bad(e.to_string()))?;
    let config_digest = format!("sha256:{}", hex(&Sha256::digest(&config)));
    let json = |value: serde_json::Value| serde_json::to_vec(&value).map_err(|e| bad(e.to_string()));
    match format {
        ArchiveFormat::DockerSave => {
            let config_member = format!("{}.json", &config_digest[7..]);
            append_bytes(&mut tar, &config_member, &config)?;
            let manifest = json(serde_json::json!([{"Config": config_member, "RepoTags": [], "Layers": members}]))?;
            append_bytes(&mut tar, "manifest.json", &manifest)?;
        }
        ArchiveFormat::OciLayout | ArchiveFormat::OciLayoutZstd => {
            append_bytes(&mut tar, &blob_member(&config_digest)?, &config)?;
            let manifest = json(serde_json::json!({
                "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": config_digest, "size": config.len()},
                "layers": blobs,
            }))?;
            let manifest_digest = format!("sha256:{}", hex(&Sha256::digest(&manifest)));
            append_bytes(&mut tar, &blob_member(&manifest_digest)?, &manifest)?;
            let index = json(serde_json::json!({
                "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                               "digest": manifest_digest, "size": manifest.len()}],
            }))?;
            append_bytes(&mut tar, "index.json", &index)?;
            append_bytes(&mut tar, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        }
    }
    tar.into_inner().and_then(|mut w| w.flush()).map_err(err("finishing it"))
}

fn file_sha256(path: &Path) -> Result<sha2::digest::Output<Sha256>, HostError> {
    let mut hasher = Sha256::new();
    let mut file = fs::File::open(path).map_err(HostError::io(format!("reading {}", path.display())))?;
    io::copy(&mut file, &mut hasher).map_err(HostError::io(format!("reading {}", path.display())))?;
    Ok(hasher.finalize())
}

fn append_file<W: Write>(tar: &mut tar::Builder<W>, name: &str, path: &Path) -> Result<(), HostError> {
    let mut file = fs::File::open(path).map_err(HostError::io(format!("reading {}", path.display())))?;
    tar.append_file(name, &mut file).map_err(HostError::io("writing the image archive"))
}

fn append_bytes<W: Write>(tar: &mut tar::Builder<W>, name: &str, bytes: &[u8]) -> Result<(), HostError> {
    let mut header = tar::Header::new_gnu();
    header.set_size(bytes.len() as u64);
    header.set_mode(0o644);
    tar.append_data(&mut header, name, bytes).map_err(HostError::io("writing the image archive"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `data` zstd-compressed with a window of 2^`window_log` bytes, which
    /// the frame's header asks of a decoder.
    fn zstd_frame(data: &[u8], window_log: u32) -> Vec<u8> {
        let mut encoder = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        encoder.set_parameter(zstd::stream::raw::CParameter::WindowLog(window_log)).unwrap();
        encoder.include_contentsize(false).unwrap();
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    #[test]
    fn a_zstd_frame_gets_no_window_over_the_limit() {
        let data = vec![b'x'; 1 << 20];
        let mut decoded = Vec::new();
        let frame = zstd_frame(&data, ZSTD_WINDOW_LOG_MAX);
        zstd_decoder(&frame[..]).unwrap().read_to_end(&mut decoded).unwrap();
        assert_eq!(decoded, data, "a frame within the limit decodes");
        // A 1 GiB window: refused before anything that large is allocated.
        let bomb = zstd_frame(&data, 30);
        let err = zstd_decoder(&bomb[..]).unwrap().read_to_end(&mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("memory"), "{err}");
    }

    #[test]
    fn member_names_are_checked() {
        assert_eq!(clean_name("./blobs/sha256/ab").unwrap(), "blobs/sha256/ab");
        assert!(clean_name("/etc/passwd").is_err());
        assert!(clean_name("a/../../b").is_err());
        assert_eq!(normalize_lexically(Path::new("x/../y/./z")).as_deref(), Some("y/z"));
        assert_eq!(normalize_lexically(Path::new("../y")), None);
    }

    #[test]
    fn digests_come_from_names_and_descriptors() {
        let hex = "a".repeat(64);
        assert_eq!(digest_of_member_name(&format!("blobs/sha256/{hex}")), Some(format!("sha256:{hex}")));
        assert_eq!(digest_of_member_name(&format!("{hex}.json")), Some(format!("sha256:{hex}")));
        assert_eq!(digest_of_member_name("abc/layer.tar"), None);
        assert_eq!(blob_member(&format!("sha256:{hex}")).unwrap(), format!("blobs/sha256/{hex}"));
        assert!(blob_member("sha512:00").is_err());
        assert!(blob_member("sha256:../../x").is_err());
    }
}
