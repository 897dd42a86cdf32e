//! The registry client: requests with the auth flow, bounded bodies,
//! manifest resolution and verified blob downloads.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use reqwest::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::{Response, StatusCode, Url};
use sha2::{Digest, Sha256};
use space_core::secrets::within;
use tokio::io::AsyncWriteExt;
use zeroize::Zeroizing;

use crate::auth::{self, Challenge};
use crate::manifest::{self, Document, LayerDesc, ResolvedImage, MANIFEST_ACCEPT};
use crate::net::{check_url, http_client, transport_error, Insecure};
use crate::reference::{canonical_host, parse_digest};
use crate::{Credential, ImageError, ImageRef, RegistryConfig};

/// Largest manifest, index or config kept in memory (as the archive
/// importer's bound on JSON).
const MAX_JSON: u64 = 8 << 20;
/// Largest token service answer.
const MAX_TOKEN: u64 = 64 << 10;
/// Largest error body read (for its message).
const MAX_ERROR_BODY: u64 = 16 << 10;
/// Longest a request for a small body (manifest, config, token) may take
/// as a whole: a registry dripping bytes must not hold a build forever.
const SMALL_BODY_TIME: Duration = Duration::from_secs(120);
/// Longest an error body is read for.
const ERROR_BODY_TIME: Duration = Duration::from_secs(10);
/// Longest text taken from a registry's error message.
const MAX_DETAIL: usize = 300;
/// Buffer between the network and the blob file.
const WRITE_BUFFER: usize = 1 << 20;

/// Where an image's manifest and blobs are asked for: the registry, or
/// the operator's mirror of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Source {
    /// `scheme://host[:port]/`
    base: Url,
    /// `host[:port]` as addressed (the auth cache's key).
    registry: String,
    /// For a mirror: the registry it mirrors (sent as `?ns=`).
    mirror_of: Option<String>,
}

impl Source {
    fn url(&self, path: &str) -> Result<Url, ImageError> {
        let mut url =
            self.base.join(path).map_err(|e| ImageError::InvalidReference(format!("{}{path}: {e}", self.base)))?;
        if let Some(upstream) = &self.mirror_of {
            url.query_pairs_mut().append_pair("ns", upstream);
        }
        Ok(url)
    }
}

/// One request's destination and what may answer its challenge.
struct Target<'a> {
    source: &'a Source,
    repository: &'a str,
    credential: Option<&'a Credential>,
}

/// A registry client for one build: it keeps the credentials it was given
/// and the tokens it got, per registry and repository, for its own life.
pub struct Client {
    http: reqwest::Client,
    insecure: Insecure,
    mirror: Option<String>,
    default_registry: Option<String>,
    /// `Authorization` values that worked, by (source registry, repository).
    authorizations: Mutex<HashMap<(String, String), Zeroizing<String>>>,
    /// Credentials given to [`Client::resolve`], by (registry, repository),
    /// for the downloads after it (a token can expire during a long pull).
    credentials: Mutex<HashMap<(String, String), Credential>>,
}

impl Client {
    pub fn new(config: &RegistryConfig) -> Result<Client, ImageError> {
        let insecure = Insecure::parse(&config.insecure)?;
        let host = |what: &str, text: &Option<String>| {
            text.as_deref()
                .map(|text| canonical_host(text).map_err(|why| ImageError::Config(format!("{what}: {why}"))))
                .transpose()
        };
        let mirror = host("the registry mirror", &config.mirror)?;
        let default_registry = host("the default registry", &config.default_registry)?;
        if mirror.is_some() && default_registry.is_none() {
            return Err(ImageError::Config("a registry mirror mirrors the default registry: set one".into()));
        }
        Ok(Client {
            http: http_client(config, &insecure)?,
            insecure,
            mirror,
            default_registry,
            authorizations: Mutex::default(),
            credentials: Mutex::default(),
        })
    }

    /// Resolves `reference` to its linux/amd64 image: the manifest (by tag,
    /// or by a pinned digest checked against its bytes), through an index
    /// if it is one, and the image config, checked against the manifest.
    /// `credential` must cover the registry's host.
    pub async fn resolve(
        &self,
        reference: &ImageRef,
        credential: Option<&Credential>,
    ) -> Result<ResolvedImage, ImageError> {
        if let Some(credential) = credential {
            check_credential_host(credential, reference.registry_host(), "the registry")?;
            let key = (reference.registry.clone(), reference.repository.clone());
            self.credentials.lock().unwrap_or_else(|e| e.into_inner()).insert(key, credential.clone());
        }
        let mut mirror_failure = None;
        for source in self.sources(reference, credential.is_some()) {
            let credential = if source.mirror_of.is_some() { None } else { credential };
            let target = Target { source: &source, repository: &reference.repository, credential };
            match self.resolve_from(&target, reference).await {
                Ok(image) => return Ok(image),
                Err(err) if source.mirror_of.is_some() => {
                    tracing::warn!(mirror = %source.registry, image = %reference, error = %err,
                        "the registry mirror failed; asking the registry");
                    mirror_failure = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(mirror_failure.unwrap_or_else(|| ImageError::Protocol("no registry to ask".into())))
    }

    /// Downloads `layer` of `image` to `dest`: into `dest` + `.partial`,
    /// hashed as it is written, cut off past the descriptor's size, synced,
    /// and renamed to `dest` only when its sha256 is the layer's digest.
    /// On any error (and if the future is dropped) the partial file is
    /// removed. `progress` gets the bytes received so far.
    pub async fn download_blob(
        &self,
        image: &ResolvedImage,
        layer: &LayerDesc,
        dest: &Path,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(), ImageError> {
        parse_digest(&layer.digest).map_err(ImageError::Unsupported)?;
        let reference = &image.reference;
        let credential = {
            let credentials = self.credentials.lock().unwrap_or_else(|e| e.into_inner());
            credentials.get(&(reference.registry.clone(), reference.repository.clone())).cloned()
        };
        let mut sources = vec![image.source.clone()];
        if image.source.mirror_of.is_some() {
            sources.push(self.registry_source(&reference.registry));
        }
        let mut mirror_failure = None;
        for source in sources {
            let credential = if source.mirror_of.is_some() { None } else { credential.as_ref() };
            let target = Target { source: &source, repository: &reference.repository, credential };
            match self.download_from(&target, layer, dest, progress).await {
                Ok(()) => return Ok(()),
                Err(err) if source.mirror_of.is_some() => {
                    tracing::warn!(mirror = %source.registry, blob = %layer.digest, error = %err,
                        "the registry mirror failed; asking the registry");
                    mirror_failure = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(mirror_failure.unwrap_or_else(|| ImageError::Protocol("no registry to ask".into())))
    }

    /// The mirror first for an anonymous pull from the default registry,
    /// then the registry.
    fn sources(&self, reference: &ImageRef, with_credential: bool) -> Vec<Source> {
        let mut sources = Vec::new();
        if let (Some(mirror), false) = (&self.mirror, with_credential) {
            if self.default_registry.as_deref() == Some(reference.registry.as_str()) {
                let mut source = self.registry_source(mirror);
                source.mirror_of = Some(reference.registry.clone());
                sources.push(source);
            }
        }
        sources.push(self.registry_source(&reference.registry));
        sources
    }

    fn registry_source(&self, registry: &str) -> Source {
        let scheme = if self.insecure.lists_registry(registry) { "http" } else { "https" };
        let base = Url::parse(&format!("{scheme}://{registry}/")).expect("a checked host[:port] makes a URL");
        Source { base, registry: registry.to_string(), mirror_of: None }
    }

    async fn resolve_from(&self, target: &Target<'_>, reference: &ImageRef) -> Result<ResolvedImage, ImageError> {
        let what = reference.to_string();
        let (body, content_type, digest) =
            self.fetch_manifest(target, reference.manifest_reference(), &format!("the manifest of {what}")).await?;
        if let Some(pin) = &reference.digest {
            if digest != *pin {
                return Err(ImageError::DigestMismatch {
                    what: format!("the manifest of {what}"),
                    expected: pin.clone(),
                    actual: digest,
                });
            }
        }
        let (manifest, manifest_digest, index_digest) =
            match manifest::parse_document(&body, content_type.as_deref(), &what)? {
                Document::Manifest(manifest) => (manifest, digest, None),
                Document::Index(entries) => {
                    let entry = manifest::pick_amd64(&entries, &what)?;
                    let (child, _) = manifest::checked(entry, &format!("{what}: the linux/amd64 entry"))?;
                    let child_what = format!("the linux/amd64 manifest of {what}");
                    let (body, content_type, child_digest) = self.fetch_manifest(target, &child, &child_what).await?;
                    if child_digest != child {
                        return Err(ImageError::DigestMismatch {
                            what: child_what,
                            expected: child,
                            actual: child_digest,
                        });
                    }
                    match manifest::parse_document(&body, content_type.as_deref(), &child_what)? {
                        Document::Manifest(manifest) => (manifest, child, Some(digest)),
                        Document::Index(_) => {
                            return Err(ImageError::Unsupported(format!("{child_what} is an index in an index")))
                        }
                    }
                }
            };
        let layers = manifest::layers(&manifest, &what)?;
        let config_what = format!("the config of {what}");
        let (config_digest, config_size) = manifest::checked(&manifest.config, &config_what)?;
        if config_size > MAX_JSON {
            return Err(ImageError::TooLarge { what: config_what, limit: MAX_JSON });
        }
        let config = self.fetch_small_blob(target, &config_digest, config_size, &config_what).await?;
        let (defaults, diff_ids) = manifest::read_config(&config, layers.len(), &what)?;
        let total_bytes = layers.iter().map(|l| l.size).sum();
        Ok(ResolvedImage {
            reference: reference.clone(),
            manifest_digest,
            index_digest,
            layers,
            config: defaults,
            diff_ids,
            total_bytes,
            source: target.source.clone(),
        })
    }

    /// A manifest's bytes, content type and sha256.
    async fn fetch_manifest(
        &self,
        target: &Target<'_>,
        reference: &str,
        what: &str,
    ) -> Result<(Vec<u8>, Option<String>, String), ImageError> {
        let url = target.source.url(&format!("v2/{}/manifests/{reference}", target.repository))?;
        let mut response = self.send(target, url, Some(MANIFEST_ACCEPT), true, what).await?;
        self.check_status(&mut response, target, what).await?;
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let (content_type, announced) = (header(CONTENT_TYPE.as_str()), header("docker-content-digest"));
        let body = read_bounded(&mut response, MAX_JSON, what).await?;
        let digest = sha256_digest(&body);
        if let Some(announced) = announced.filter(|d| d.starts_with("sha256:")) {
            if announced != digest {
                return Err(ImageError::DigestMismatch { what: what.to_string(), expected: announced, actual: digest });
            }
        }
        Ok((body, content_type, digest))
    }

    /// A blob kept in memory (the config), checked against its digest.
    async fn fetch_small_blob(
        &self,
        target: &Target<'_>,
        digest: &str,
        size: u64,
        what: &str,
    ) -> Result<Vec<u8>, ImageError> {
        let url = target.source.url(&format!("v2/{}/blobs/{digest}", target.repository))?;
        let mut response = self.send(target, url, None, true, what).await?;
        self.check_status(&mut response, target, what).await?;
        let body = read_bounded(&mut response, size, what).await?;
        let actual = sha256_digest(&body);
        if actual != digest {
            return Err(ImageError::DigestMismatch { what: what.to_string(), expected: digest.to_string(), actual });
        }
        Ok(body)
    }

    async fn download_from(
        &self,
        target: &Target<'_>,
        layer: &LayerDesc,
        dest: &Path,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(), ImageError> {
        let what = format!("blob {}", layer.digest);
        let partial = RemovedOnDrop::new(partial_path(dest));
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| ImageError::Io { path, source }
        };
        let url = target.source.url(&format!("v2/{}/blobs/{}", target.repository, layer.digest))?;
        let mut response = self.send(target, url, None, false, &what).await?;
        self.check_status(&mut response, target, &what).await?;
        if response.content_length().is_some_and(|length| length > layer.size) {
            return Err(ImageError::TooLarge { what, limit: layer.size });
        }
        let file = tokio::fs::File::create(&partial.path).await.map_err(io(&partial.path))?;
        let mut out = tokio::io::BufWriter::with_capacity(WRITE_BUFFER, file);
        let mut hasher = Sha256::new();
        let mut received: u64 = 0;
        while let Some(chunk) = response.chunk().await.map_err(|e| transport_error(e, &what))? {
            received += chunk.len() as u64;
            if received > layer.size {
                return Err(ImageError::TooLarge { what, limit: layer.size });
            }
            hasher.update(&chunk);
            out.write_all(&chunk).await.map_err(io(&partial.path))?;
            progress(received);
        }
        let actual = format!("sha256:{}", hex(&hasher.finalize()));
        if actual != layer.digest {
            return Err(ImageError::DigestMismatch { what, expected: layer.digest.clone(), actual });
        }
        if received != layer.size {
            return Err(ImageError::Protocol(format!(
                "{what} has {received} bytes, its descriptor says {}",
                layer.size
            )));
        }
        out.flush().await.map_err(io(&partial.path))?;
        out.into_inner().sync_all().await.map_err(io(&partial.path))?;
        tokio::fs::rename(&partial.path, dest).await.map_err(io(dest))?;
        partial.keep();
        // The rename is durable once the directory is.
        if let Some(parent) = dest.parent() {
            let dir = tokio::fs::File::open(parent).await.map_err(io(parent))?;
            dir.sync_all().await.map_err(io(parent))?;
        }
        Ok(())
    }

    /// Sends a GET to `url` with what authorized this repository before;
    /// on a 401 answers the challenge once and sends it again.
    async fn send(
        &self,
        target: &Target<'_>,
        url: Url,
        accept: Option<&str>,
        small_body: bool,
        what: &str,
    ) -> Result<Response, ImageError> {
        check_url(&url, &self.insecure).map_err(|refused| ImageError::Refused(format!("{what}: {refused}")))?;
        let key = (target.source.registry.clone(), target.repository.to_string());
        let mut authorization = self.authorizations.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
        let mut answered = false;
        loop {
            let mut request = self.http.get(url.clone());
            if let Some(accept) = accept {
                request = request.header(ACCEPT, accept);
            }
            if let Some(authorization) = &authorization {
                request = request.header(AUTHORIZATION, sensitive(authorization)?);
            }
            if small_body {
                request = request.timeout(SMALL_BODY_TIME);
            }
            let response = request.send().await.map_err(|e| transport_error(e, what))?;
            if response.status() != StatusCode::UNAUTHORIZED {
                return Ok(response);
            }
            let registry = &target.source.registry;
            if answered {
                return Err(ImageError::AuthFailed(match target.credential {
                    Some(_) => format!("{registry} refused the credential for {}", target.repository),
                    None => format!("{registry} asks for a credential for {}: none was given", target.repository),
                }));
            }
            let values = response.headers().get_all(WWW_AUTHENTICATE);
            let Some(challenge) = auth::challenge(values.iter().filter_map(|v| v.to_str().ok())) else {
                return Err(ImageError::AuthFailed(format!(
                    "{registry} answered 401 without a challenge this client can answer (Basic or Bearer)"
                )));
            };
            let answer = self.answer(target, &challenge, what).await?;
            self.authorizations.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone(), answer.clone());
            authorization = Some(answer);
            answered = true;
        }
    }

    /// The `Authorization` value answering `challenge`.
    async fn answer(
        &self,
        target: &Target<'_>,
        challenge: &Challenge,
        what: &str,
    ) -> Result<Zeroizing<String>, ImageError> {
        let registry = &target.source.registry;
        let registry_host = crate::reference::host_without_port(registry);
        match (challenge, target.credential) {
            (Challenge::Basic, None) => Err(ImageError::AuthFailed(format!(
                "{registry} asks for a username and password for {}: no credential was given",
                target.repository
            ))),
            (Challenge::Basic, Some(credential)) => {
                check_credential_host(credential, registry_host, "the registry")?;
                match &credential.username {
                    Some(username) => Ok(auth::basic(username, credential)),
                    None => Err(ImageError::AuthFailed(format!(
                        "{registry} asks for a username and password; the credential is a token without a username"
                    ))),
                }
            }
            (Challenge::Bearer { .. }, Some(credential)) if credential.username.is_none() => {
                check_credential_host(credential, registry_host, "the registry")?;
                Ok(auth::bearer(&credential.value))
            }
            (Challenge::Bearer { realm, service, scope }, credential) => {
                let mut url = Url::parse(realm).map_err(|e| {
                    ImageError::Protocol(format!("{registry}'s token service {realm:?} is not a URL: {e}"))
                })?;
                check_url(&url, &self.insecure)
                    .map_err(|refused| ImageError::Refused(format!("{registry}'s token service: {refused}")))?;
                let realm_host = url.host_str().unwrap_or_default().to_string();
                if let Some(credential) = credential {
                    check_credential_host(credential, &realm_host, &format!("{registry}'s token service"))?;
                }
                let default_scope = format!("repository:{}:pull", target.repository);
                {
                    let mut query = url.query_pairs_mut();
                    if let Some(service) = service {
                        query.append_pair("service", service);
                    }
                    query.append_pair("scope", scope.as_deref().unwrap_or(&default_scope));
                }
                let mut request = self.http.get(url).timeout(SMALL_BODY_TIME);
                if let Some(credential) = credential {
                    let username = credential.username.as_deref().unwrap_or_default();
                    request = request.header(AUTHORIZATION, sensitive(&auth::basic(username, credential))?);
                }
                let token_what = format!("the token from {realm_host} for {what}");
                let mut response = request.send().await.map_err(|e| transport_error(e, &token_what))?;
                if matches!(response.status(), StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
                    return Err(ImageError::AuthFailed(match credential {
                        Some(_) => format!("the token service {realm_host} refused the credential"),
                        None => format!("the token service {realm_host} refused an anonymous token"),
                    }));
                }
                self.check_status(&mut response, target, &token_what).await?;
                let body = read_bounded(&mut response, MAX_TOKEN, &token_what).await?;
                let body = Zeroizing::new(body);
                let token = auth::token_from(&body)
                    .ok_or_else(|| ImageError::Protocol(format!("{token_what}: the answer holds no token")))?;
                Ok(auth::bearer(&token))
            }
        }
    }

    /// Turns an unsuccessful answer into its error, with the registry's own
    /// message (bounded, scrubbed of the credential).
    async fn check_status(&self, response: &mut Response, target: &Target<'_>, what: &str) -> Result<(), ImageError> {
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = tokio::time::timeout(ERROR_BODY_TIME, read_bounded(response, MAX_ERROR_BODY, what))
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let (code, detail) = error_detail(&body);
        let mut detail = format!("{} answered {status}{detail}", target.source.registry);
        if let Some(credential) = target.credential {
            if !credential.value.is_empty() {
                detail = detail.replace(credential.value.as_str(), "<redacted>");
            }
        }
        let message = format!("{what}: {detail}");
        Err(match (status, code.as_deref()) {
            (StatusCode::NOT_FOUND, _) | (_, Some("NAME_UNKNOWN" | "MANIFEST_UNKNOWN" | "BLOB_UNKNOWN")) => {
                ImageError::NotFound(message)
            }
            (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) | (_, Some("DENIED" | "UNAUTHORIZED")) => {
                ImageError::AuthFailed(message)
            }
            (StatusCode::TOO_MANY_REQUESTS, _) => ImageError::Network(message),
            (status, _) if status.is_server_error() => ImageError::Network(message),
            _ => ImageError::Protocol(message),
        })
    }
}

/// Reads a body of at most `limit` bytes, refusing it as soon as it is
/// known to be longer: from its announced length, else as it arrives.
async fn read_bounded(response: &mut Response, limit: u64, what: &str) -> Result<Vec<u8>, ImageError> {
    let too_large = || ImageError::TooLarge { what: what.to_string(), limit };
    if response.content_length().is_some_and(|length| length > limit) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| transport_error(e, what))? {
        if (body.len() + chunk.len()) as u64 > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The first error of a distribution error body (`{"errors":[{"code",
/// "message"}]}`): its code, and a short printable detail.
fn error_detail(body: &[u8]) -> (Option<String>, String) {
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        code: Option<String>,
        message: Option<String>,
    }
    let Ok(Errors { errors }) = serde_json::from_slice::<Errors>(body) else { return (None, String::new()) };
    let Some(first) = errors.into_iter().next() else { return (None, String::new()) };
    let text = match (&first.code, &first.message) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(text), None) | (None, Some(text)) => text.clone(),
        (None, None) => return (None, String::new()),
    };
    let printable: String =
        text.chars().map(|c| if c.is_control() { ' ' } else { c }).take(MAX_DETAIL).collect::<String>();
    (first.code, format!(" ({printable})"))
}

fn check_credential_host(credential: &Credential, host: &str, whose: &str) -> Result<(), ImageError> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if within(bare, &credential.hosts) {
        return Ok(());
    }
    Err(ImageError::Refused(format!(
        "{whose} {host} is not among the credential's hosts ({}): the credential is not sent there",
        credential.hosts.join(", ")
    )))
}

fn sensitive(value: &str) -> Result<HeaderValue, ImageError> {
    let mut header = HeaderValue::from_str(value)
        .map_err(|_| ImageError::AuthFailed("the credential holds characters a header cannot carry".into()))?;
    header.set_sensitive(true);
    Ok(header)
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

/// A file removed when dropped unless kept: a download that fails, or
/// whose future is dropped, leaves nothing behind.
struct RemovedOnDrop {
    path: PathBuf,
    keep: bool,
}

impl RemovedOnDrop {
    fn new(path: PathBuf) -> RemovedOnDrop {
        RemovedOnDrop { path, keep: false }
    }

    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_details_are_short_and_printable() {
        let body = br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest\nunknown","detail":{}}]}"#;
        assert_eq!(
            error_detail(body),
            (Some("MANIFEST_UNKNOWN".into()), " (MANIFEST_UNKNOWN: manifest unknown)".into())
        );
        let long = format!(r#"{{"errors":[{{"message":"{}"}}]}}"#, "x".repeat(5000));
        assert!(error_detail(long.as_bytes()).1.len() < MAX_DETAIL + 10);
        assert_eq!(error_detail(b"<html>"), (None, String::new()));
    }

    #[test]
    fn credentials_go_only_within_their_hosts() {
        let credential = Credential {
            username: None,
            value: Zeroizing::new("v".into()),
            hosts: vec!["registry.test".into(), "*.auth.test".into()],
        };
        assert!(check_credential_host(&credential, "registry.test", "r").is_ok());
        assert!(check_credential_host(&credential, "a.auth.test", "r").is_ok());
        let err = check_credential_host(&credential, "elsewhere.test", "r").unwrap_err();
        assert!(matches!(err, ImageError::Refused(_)) && err.to_string().contains("elsewhere.test"), "{err}");
        assert!(!format!("{credential:?}").contains("\"v\""));
    }

    /// The server spawns these on its runtime: they must be `Send`.
    #[allow(dead_code)]
    fn futures_are_send(client: &Client, image: &ResolvedImage, reference: &ImageRef, layer: &LayerDesc) {
        fn send<T: Send>(_: T) {}
        send(client.resolve(reference, None));
        send(client.download_blob(image, layer, Path::new("/x"), &mut |_| {}));
    }

    #[test]
    fn partial_files_sit_beside_their_destination() {
        assert_eq!(partial_path(Path::new("/d/.blob-abc")), Path::new("/d/.blob-abc.partial"));
    }
}
