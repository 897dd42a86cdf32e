//! OCI image layouts a test writes from layers it builds (files, dirs,
//! symlinks, whiteouts and opaque dirs; gzip, zstd or plain), as one image
//! or an index of several platforms, and pushed to a registry with Debian's
//! `skopeo` as they are (digests preserved) or converted to Docker schema 2.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Where Debian's `skopeo` package puts it.
pub const SKOPEO_BIN: &str = "/usr/bin/skopeo";

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// How long a push may take (the bench pushes hundreds of MiB).
const PUSH_PATIENCE: Duration = Duration::from_secs(600);

/// A member of a layer's tar.
#[derive(Debug, Clone)]
pub enum Member {
    File {
        path: String,
        contents: Vec<u8>,
        mode: u32,
    },
    Dir {
        path: String,
    },
    Symlink {
        path: String,
        target: String,
    },
    /// `dir/.wh.name`: `path` was deleted by this layer.
    Whiteout {
        path: String,
    },
    /// `dir/.wh..wh..opq`: what lower layers had in `dir` is hidden.
    Opaque {
        dir: String,
    },
}

impl Member {
    /// A regular file, mode 0644.
    pub fn file(path: &str, contents: impl Into<Vec<u8>>) -> Member {
        Member::File { path: path.to_string(), contents: contents.into(), mode: 0o644 }
    }

    pub fn dir(path: &str) -> Member {
        Member::Dir { path: path.to_string() }
    }
}

/// How a layer is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Zstd,
    None,
}

impl Compression {
    fn media_type(self) -> &'static str {
        match self {
            Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
            Compression::None => "application/vnd.oci.image.layer.v1.tar",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Layer {
    pub members: Vec<Member>,
    pub compression: Compression,
}

impl Layer {
    pub fn new(compression: Compression, members: Vec<Member>) -> Layer {
        Layer { members, compression }
    }
}

/// One image (one platform).
#[derive(Debug, Clone)]
pub struct Image {
    /// `amd64`, `arm64`, …; the OS is linux.
    pub architecture: String,
    /// Lowest first.
    pub layers: Vec<Layer>,
    /// The config's `config` object (`Env`, `Cmd`, `WorkingDir`, …).
    pub run_config: Value,
}

impl Image {
    pub fn amd64(layers: Vec<Layer>) -> Image {
        Image { architecture: "amd64".into(), layers, run_config: json!({}) }
    }
}

/// What [`write`] wrote, by digest.
#[derive(Debug, Clone)]
pub struct Written {
    /// The layout's directory.
    pub dir: PathBuf,
    pub images: Vec<WrittenImage>,
    /// The index blob's digest, when several images were written.
    pub index_digest: Option<String>,
}

#[derive(Debug, Clone)]
pub struct WrittenImage {
    pub architecture: String,
    pub manifest_digest: String,
    pub config_digest: String,
    /// Each layer's blob digest and size, lowest first.
    pub layers: Vec<(String, u64)>,
    pub diff_ids: Vec<String>,
}

/// Writes an OCI image layout in `dir` (made if missing) whose `index.json`
/// names `images` by `tag`: the image itself when there is one, else an
/// index blob listing each with its platform.
pub fn write(dir: &Path, tag: &str, images: &[Image]) -> Written {
    assert!(!images.is_empty(), "an image layout needs an image");
    std::fs::create_dir_all(dir.join("blobs/sha256")).expect("creating the layout");
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).expect("writing oci-layout");
    let mut written = Vec::new();
    let mut descriptors = Vec::new();
    for image in images {
        let (descriptor, image) = write_image(dir, image);
        descriptors.push(descriptor);
        written.push(image);
    }
    let ref_name = json!({ "org.opencontainers.image.ref.name": tag });
    let (entry, index_digest) = if images.len() == 1 {
        let mut entry = descriptors.remove(0);
        entry.as_object_mut().expect("a descriptor").remove("platform");
        entry["annotations"] = ref_name;
        (entry, None)
    } else {
        let index = json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descriptors });
        let (digest, size) = write_blob(dir, &serde_json::to_vec(&index).expect("json"));
        (json!({ "mediaType": OCI_INDEX, "digest": digest, "size": size, "annotations": ref_name }), Some(digest))
    };
    let top = json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry] });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&top).expect("json")).expect("writing index.json");
    Written { dir: dir.to_path_buf(), images: written, index_digest }
}

fn write_image(dir: &Path, image: &Image) -> (Value, WrittenImage) {
    let mut layer_descriptors = Vec::new();
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    for layer in &image.layers {
        let tar = layer_tar(&layer.members);
        diff_ids.push(digest_of(&tar));
        let blob = compress(&tar, layer.compression);
        let (digest, size) = write_blob(dir, &blob);
        layer_descriptors.push(json!({ "mediaType": layer.compression.media_type(), "digest": digest, "size": size }));
        layers.push((digest, size));
    }
    let config = json!({
        "architecture": image.architecture,
        "os": "linux",
        "config": image.run_config,
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    });
    let (config_digest, config_size) = write_blob(dir, &serde_json::to_vec(&config).expect("json"));
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": { "mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size },
        "layers": layer_descriptors,
    });
    let (manifest_digest, manifest_size) = write_blob(dir, &serde_json::to_vec(&manifest).expect("json"));
    let descriptor = json!({
        "mediaType": OCI_MANIFEST,
        "digest": manifest_digest,
        "size": manifest_size,
        "platform": { "architecture": image.architecture, "os": "linux" },
    });
    let written =
        WrittenImage { architecture: image.architecture.clone(), manifest_digest, config_digest, layers, diff_ids };
    (descriptor, written)
}

/// An uncompressed layer tar of `members`, owned by root, dated 2026.
pub fn layer_tar(members: &[Member]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let header = |kind: tar::EntryType, mode: u32, size: u64| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_767_225_600);
        header
    };
    let empty: &[u8] = &[];
    for member in members {
        let appended = match member {
            Member::File { path, contents, mode } => {
                let mut h = header(tar::EntryType::Regular, *mode, contents.len() as u64);
                builder.append_data(&mut h, path, contents.as_slice())
            }
            Member::Dir { path } => builder.append_data(&mut header(tar::EntryType::Directory, 0o755, 0), path, empty),
            Member::Symlink { path, target } => {
                builder.append_link(&mut header(tar::EntryType::Symlink, 0o777, 0), path, target)
            }
            Member::Whiteout { path } => {
                let (parent, name) = path.rsplit_once('/').map(|(p, n)| (format!("{p}/"), n)).unwrap_or_default();
                let name = if name.is_empty() { path.as_str() } else { name };
                let whiteout = format!("{parent}.wh.{name}");
                builder.append_data(&mut header(tar::EntryType::Regular, 0o644, 0), whiteout, empty)
            }
            Member::Opaque { dir } => {
                let marker = format!("{}/.wh..wh..opq", dir.trim_end_matches('/'));
                builder.append_data(&mut header(tar::EntryType::Regular, 0o644, 0), marker, empty)
            }
        };
        appended.unwrap_or_else(|e| panic!("adding {member:?} to a layer: {e}"));
    }
    builder.into_inner().expect("finishing a layer tar")
}

fn compress(tar: &[u8], compression: Compression) -> Vec<u8> {
    use std::io::Write;
    match compression {
        Compression::None => tar.to_vec(),
        Compression::Gzip => {
            let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(tar).expect("gzip");
            encoder.finish().expect("gzip")
        }
        Compression::Zstd => {
            let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 3).expect("zstd");
            encoder.write_all(tar).expect("zstd");
            encoder.finish().expect("zstd")
        }
    }
}

fn digest_of(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    format!("sha256:{}", hash.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

fn write_blob(dir: &Path, bytes: &[u8]) -> (String, u64) {
    let digest = digest_of(bytes);
    let path = dir.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    (digest, bytes.len() as u64)
}

/// How [`push`] stores the image in the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushFormat {
    /// As written: OCI manifests and index, every blob and digest as is.
    Oci,
    /// Converted to Docker schema 2 (gzip layers only; the manifest's
    /// digest changes, the blobs' do not).
    DockerV2s2,
}

/// Pushes tag `tag` of the layout in `layout_dir` to `registry`
/// (`127.0.0.1:PORT`, plain HTTP) as `repo:tag`, with `creds` (user,
/// password) when given. Skopeo runs with a HOME of its own, so no user's
/// auth file or policy is read.
pub fn push(layout_dir: &Path, tag: &str, registry: &str, repo: &str, creds: Option<(&str, &str)>, format: PushFormat) {
    assert!(
        Path::new(SKOPEO_BIN).is_file(),
        "{SKOPEO_BIN} is missing: install Debian's skopeo package (scripts/test.sh does)"
    );
    let home = crate::registry::scratch_dir("skopeo-home");
    let mut command = Command::new(SKOPEO_BIN);
    command.env("HOME", &home).env_remove("REGISTRY_AUTH_FILE").env_remove("DOCKER_CONFIG");
    command.args(["--insecure-policy", "copy", "--all", "--dest-tls-verify=false", "--quiet"]);
    match format {
        PushFormat::Oci => command.arg("--preserve-digests"),
        PushFormat::DockerV2s2 => command.args(["--format", "v2s2"]),
    };
    if let Some((user, password)) = creds {
        command.arg("--dest-creds").arg(format!("{user}:{password}"));
    }
    command.arg(format!("oci:{}:{tag}", layout_dir.display())).arg(format!("docker://{registry}/{repo}:{tag}"));
    let pushed = crate::run_within(&mut command, PUSH_PATIENCE);
    let _ = std::fs::remove_dir_all(&home);
    if let Err(e) = pushed {
        panic!("pushing {repo}:{tag} to {registry}: {e}");
    }
}

/// The raw manifest (or index) the registry serves for `repo:reference`,
/// as skopeo reads it: for checking what a push stored.
pub fn inspect_raw(registry: &str, repo: &str, reference: &str, creds: Option<(&str, &str)>) -> Value {
    let home = crate::registry::scratch_dir("skopeo-home");
    let mut command = Command::new(SKOPEO_BIN);
    command.env("HOME", &home).args(["inspect", "--raw", "--tls-verify=false"]);
    if let Some((user, password)) = creds {
        command.arg("--creds").arg(format!("{user}:{password}"));
    }
    let separator = if reference.starts_with("sha256:") { "@" } else { ":" };
    command.arg(format!("docker://{registry}/{repo}{separator}{reference}"));
    let out = crate::run_within(&mut command, crate::PATIENCE);
    let _ = std::fs::remove_dir_all(&home);
    serde_json::from_slice(&out.unwrap_or_else(|e| panic!("inspecting {repo}:{reference}: {e}"))).expect("json")
}
