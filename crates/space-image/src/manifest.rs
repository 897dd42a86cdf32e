//! Manifests, indexes and image configs: the OCI image spec's and Docker's
//! schema 2 (the same shapes under other media types), read leniently
//! where the specs allow and refused where a layer could not be applied.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::reference::parse_digest;
use crate::{ImageError, ImageRef};

pub(crate) const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub(crate) const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub(crate) const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub(crate) const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_SCHEMA1: [&str; 2] = [
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
];
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";

/// What the client asks a registry for, best first.
pub(crate) const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json";

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Zstd,
    None,
}

/// A layer to download, from the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerDesc {
    /// `sha256:<hex>` of the blob as stored (compressed).
    pub digest: String,
    pub size: u64,
    pub media_type: String,
    pub compression: Compression,
}

/// The runtime part of an image's config: what a template made from it
/// starts with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageDefaults {
    /// `KEY=value` entries.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `80/tcp`-style keys, sorted.
    pub exposed_ports: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

/// An image resolved to its linux/amd64 manifest, with the config read.
/// Download its layers with the [`crate::Client`] that resolved it (which
/// holds the credential and tokens for its repository).
#[derive(Debug, Clone)]
pub struct ResolvedImage {
    pub reference: ImageRef,
    /// `sha256:` of the image manifest (the linux/amd64 one of an index).
    pub manifest_digest: String,
    /// `sha256:` of the index, when the reference named one.
    pub index_digest: Option<String>,
    /// Lowest first.
    pub layers: Vec<LayerDesc>,
    pub config: ImageDefaults,
    /// `sha256:` of each layer uncompressed, from the config, lowest first.
    pub diff_ids: Vec<String>,
    /// The layers' sizes summed.
    pub total_bytes: u64,
    /// Where the manifest came from (a mirror, or the registry).
    pub(crate) source: crate::client::Source,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    pub media_type: Option<String>,
    pub digest: String,
    pub size: i64,
    #[serde(default)]
    pub urls: Option<Vec<String>>,
    pub platform: Option<Platform>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Platform {
    pub architecture: String,
    pub os: String,
    pub variant: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    schema_version: Option<i64>,
    media_type: Option<String>,
    manifests: Option<serde_json::Value>,
    config: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct IndexBody {
    manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ManifestBody {
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

/// A manifest document, told apart by its media type.
pub(crate) enum Document {
    Index(Vec<Descriptor>),
    Manifest(ManifestBody),
}

/// Reads a manifest or index: by the `mediaType` in it, else by the
/// response's content type, else by its shape (the OCI spec lets the field
/// be absent).
pub(crate) fn parse_document(body: &[u8], content_type: Option<&str>, what: &str) -> Result<Document, ImageError> {
    let bad = |e: serde_json::Error| ImageError::Protocol(format!("{what}: not a manifest: {e}"));
    let envelope: Envelope = serde_json::from_slice(body).map_err(bad)?;
    if envelope.schema_version == Some(1) {
        return Err(ImageError::Unsupported(format!(
            "{what} is a Docker schema 1 manifest (deprecated; push the image again with a current client)"
        )));
    }
    let content_type = content_type.map(|t| t.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
    let media_type = envelope.media_type.clone().or(content_type.filter(|t| t.starts_with("application/vnd.")));
    let is_index = match media_type.as_deref() {
        Some(OCI_INDEX | DOCKER_LIST) => true,
        Some(OCI_MANIFEST | DOCKER_MANIFEST) => false,
        Some(t) if DOCKER_SCHEMA1.contains(&t) => {
            return Err(ImageError::Unsupported(format!("{what} is a Docker schema 1 manifest ({t})")))
        }
        Some(other) => return Err(ImageError::Unsupported(format!("{what} has media type {other:?}"))),
        None if envelope.manifests.is_some() => true,
        None if envelope.config.is_some() => false,
        None => return Err(ImageError::Protocol(format!("{what}: neither an image manifest nor an index"))),
    };
    if is_index {
        let index: IndexBody = serde_json::from_slice(body).map_err(bad)?;
        Ok(Document::Index(index.manifests))
    } else {
        Ok(Document::Manifest(serde_json::from_slice(body).map_err(bad)?))
    }
}

/// The index entry of linux/amd64: one without a variant (or `v1`) first,
/// as the baseline every amd64 machine runs.
pub(crate) fn pick_amd64<'a>(entries: &'a [Descriptor], what: &str) -> Result<&'a Descriptor, ImageError> {
    let amd64 = |d: &&Descriptor| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == "amd64");
    let baseline = entries
        .iter()
        .filter(amd64)
        .find(|d| d.platform.as_ref().and_then(|p| p.variant.as_deref()).is_none_or(|v| v == "v1"));
    if let Some(entry) = baseline.or_else(|| entries.iter().find(amd64)) {
        return Ok(entry);
    }
    let offered: Vec<String> = entries
        .iter()
        .filter_map(|d| d.platform.as_ref())
        .filter(|p| p.os != "unknown")
        .map(|p| match &p.variant {
            Some(variant) => format!("{}/{}/{variant}", p.os, p.architecture),
            None => format!("{}/{}", p.os, p.architecture),
        })
        .collect();
    Err(ImageError::NoPlatform(format!(
        "{what} offers {}",
        if offered.is_empty() { "no platform".to_string() } else { offered.join(", ") }
    )))
}

/// A descriptor's digest and size, checked.
pub(crate) fn checked(descriptor: &Descriptor, what: &str) -> Result<(String, u64), ImageError> {
    let digest = parse_digest(&descriptor.digest).map_err(|why| ImageError::Unsupported(format!("{what}: {why}")))?;
    let size = u64::try_from(descriptor.size)
        .map_err(|_| ImageError::Protocol(format!("{what}: negative size {}", descriptor.size)))?;
    Ok((digest, size))
}

/// The manifest's layers, each one this client can hand to the importer.
pub(crate) fn layers(manifest: &ManifestBody, what: &str) -> Result<Vec<LayerDesc>, ImageError> {
    let config_type = manifest.config.media_type.as_deref().unwrap_or(OCI_CONFIG);
    if config_type != OCI_CONFIG && config_type != DOCKER_CONFIG {
        return Err(ImageError::Unsupported(format!(
            "{what} is not a container image (its config is {config_type:?})"
        )));
    }
    let mut layers = Vec::with_capacity(manifest.layers.len());
    for (n, layer) in manifest.layers.iter().enumerate() {
        let which = format!("{what}: layer {}", n + 1);
        let (digest, size) = checked(layer, &which)?;
        let media_type = layer.media_type.clone().unwrap_or_default();
        if layer.urls.as_ref().is_some_and(|urls| !urls.is_empty()) || media_type.contains("nondistributable") {
            return Err(ImageError::Unsupported(format!(
                "{which} ({digest}) is a foreign layer: it is fetched from elsewhere than the registry"
            )));
        }
        let compression = match media_type.as_str() {
            "application/vnd.oci.image.layer.v1.tar" => Compression::None,
            "application/vnd.oci.image.layer.v1.tar+gzip" | "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
                Compression::Gzip
            }
            "application/vnd.oci.image.layer.v1.tar+zstd" => Compression::Zstd,
            "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => {
                return Err(ImageError::Unsupported(format!("{which} ({digest}) is a foreign layer")))
            }
            other => return Err(ImageError::Unsupported(format!("{which} has media type {other:?}"))),
        };
        layers.push(LayerDesc { digest, size, media_type, compression });
    }
    Ok(layers)
}

#[derive(Debug, Default, Deserialize)]
struct ConfigFile {
    architecture: Option<String>,
    os: Option<String>,
    config: Option<RunConfig>,
    rootfs: Option<RootFs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    env: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// The config's defaults and diff_ids, checked against the layers.
pub(crate) fn read_config(
    body: &[u8],
    layer_count: usize,
    what: &str,
) -> Result<(ImageDefaults, Vec<String>), ImageError> {
    let config: ConfigFile = serde_json::from_slice(body)
        .map_err(|e| ImageError::Protocol(format!("{what}: the image config is not valid: {e}")))?;
    let (os, arch) = (config.os.as_deref().unwrap_or("linux"), config.architecture.as_deref().unwrap_or("amd64"));
    if os != "linux" || arch != "amd64" {
        return Err(ImageError::NoPlatform(format!("{what} is an image for {os}/{arch}")));
    }
    let diff_ids = config.rootfs.unwrap_or_default().diff_ids;
    if diff_ids.len() != layer_count {
        return Err(ImageError::Protocol(format!(
            "{what}: the config lists {} uncompressed layers and the manifest {layer_count}",
            diff_ids.len()
        )));
    }
    for diff_id in &diff_ids {
        parse_digest(diff_id).map_err(|why| ImageError::Unsupported(format!("{what}: a diff_id: {why}")))?;
    }
    let run = config.config.unwrap_or_default();
    let defaults = ImageDefaults {
        env: run.env.unwrap_or_default(),
        working_dir: run.working_dir.filter(|w| !w.is_empty()),
        user: run.user.filter(|u| !u.is_empty()),
        entrypoint: run.entrypoint.unwrap_or_default(),
        cmd: run.cmd.unwrap_or_default(),
        exposed_ports: run.exposed_ports.unwrap_or_default().into_keys().collect(),
        labels: run.labels.unwrap_or_default(),
    };
    Ok((defaults, diff_ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn manifest(layer_type: &str, extra: &str) -> String {
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}",
                "config":{{"mediaType":"{OCI_CONFIG}","digest":"{D}","size":2}},
                "layers":[{{"mediaType":"{layer_type}","digest":"{D}","size":10{extra}}}]}}"#
        )
    }

    fn layers_of(body: &str) -> Result<Vec<LayerDesc>, ImageError> {
        match parse_document(body.as_bytes(), None, "m")? {
            Document::Manifest(m) => layers(&m, "m"),
            Document::Index(_) => panic!("an index"),
        }
    }

    #[test]
    fn layer_media_types() {
        let l = layers_of(&manifest("application/vnd.oci.image.layer.v1.tar+zstd", "")).unwrap();
        assert_eq!(l[0].compression, Compression::Zstd);
        let l = layers_of(&manifest("application/vnd.docker.image.rootfs.diff.tar.gzip", "")).unwrap();
        assert_eq!(l[0].compression, Compression::Gzip);
        let l = layers_of(&manifest("application/vnd.oci.image.layer.v1.tar", "")).unwrap();
        assert_eq!((l[0].compression, l[0].size), (Compression::None, 10));
        for foreign in [
            manifest("application/vnd.oci.image.layer.v1.tar+gzip", r#","urls":["https://elsewhere.test/x"]"#),
            manifest("application/vnd.oci.image.layer.nondistributable.v1.tar+gzip", ""),
            manifest("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip", ""),
        ] {
            let err = layers_of(&foreign).unwrap_err();
            assert!(matches!(err, ImageError::Unsupported(_)) && err.to_string().contains("foreign"), "{err}");
        }
        let err = layers_of(&manifest("application/x-unknown", "")).unwrap_err();
        assert!(matches!(err, ImageError::Unsupported(_)), "{err}");
    }

    #[test]
    fn schema1_and_other_artifacts_are_unsupported() {
        let schema1 = br#"{"schemaVersion":1,"name":"a","tag":"b","fsLayers":[]}"#;
        assert!(matches!(parse_document(schema1, None, "m"), Err(ImageError::Unsupported(_))));
        let artifact = manifest("application/vnd.oci.image.layer.v1.tar", "")
            .replace(OCI_CONFIG, "application/vnd.cncf.helm.config.v1+json");
        assert!(matches!(layers_of(&artifact), Err(ImageError::Unsupported(_))));
        let no_type = br#"{"schemaVersion":2,"manifests":[]}"#;
        assert!(matches!(parse_document(no_type, Some("application/json"), "m"), Ok(Document::Index(_))));
    }

    #[test]
    fn the_amd64_entry_is_picked() {
        let index = format!(
            r#"{{"manifests":[
              {{"digest":"{D}","size":1,"platform":{{"os":"linux","architecture":"arm64","variant":"v8"}}}},
              {{"digest":"{D}","size":2,"platform":{{"os":"linux","architecture":"amd64","variant":"v3"}}}},
              {{"digest":"{D}","size":3,"platform":{{"os":"linux","architecture":"amd64"}}}},
              {{"digest":"{D}","size":4,"platform":{{"os":"unknown","architecture":"unknown"}}}}]}}"#
        );
        let Document::Index(entries) = parse_document(index.as_bytes(), None, "i").unwrap() else { panic!() };
        assert_eq!(pick_amd64(&entries, "i").unwrap().size, 3);
        let err = pick_amd64(&entries[..1], "i").unwrap_err();
        assert!(matches!(err, ImageError::NoPlatform(_)) && err.to_string().contains("linux/arm64/v8"), "{err}");
    }

    #[test]
    fn configs() {
        let body = format!(
            r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["A=1"],"WorkingDir":"/w","User":"",
                "Entrypoint":null,"Cmd":["sh"],"ExposedPorts":{{"80/tcp":{{}}}},"Labels":{{"k":"v"}}}},
                "rootfs":{{"type":"layers","diff_ids":["{D}"]}}}}"#
        );
        let (defaults, diff_ids) = read_config(body.as_bytes(), 1, "c").unwrap();
        assert_eq!(defaults.env, vec!["A=1"]);
        assert_eq!((defaults.working_dir.as_deref(), defaults.user.as_deref()), (Some("/w"), None));
        assert_eq!((defaults.entrypoint.len(), defaults.cmd.clone()), (0, vec!["sh".to_string()]));
        assert_eq!(defaults.exposed_ports, vec!["80/tcp"]);
        assert_eq!(diff_ids, vec![D]);
        assert!(matches!(read_config(body.as_bytes(), 2, "c"), Err(ImageError::Protocol(_))));
        let arm = body.replace("amd64", "arm64");
        assert!(matches!(read_config(arm.as_bytes(), 1, "c"), Err(ImageError::NoPlatform(_))));
    }
}
