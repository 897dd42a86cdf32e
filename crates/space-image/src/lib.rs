//! Images from OCI Distribution registries: what a reference names, and a
//! bounded client that resolves it to verified layer descriptors and
//! downloads each blob to a file only once its digest matched.
//!
//! The server runs this for tenants who name any registry, so the client
//! treats every registry as hostile:
//! - every body it keeps in memory is bounded while it arrives (manifests,
//!   indexes and configs 8 MiB, tokens 64 KiB, error bodies 16 KiB), and a
//!   blob longer than its descriptor says is cut off while it streams;
//! - it connects only to public addresses: a name resolving to a loopback,
//!   private, link-local or metadata address, or such an address in a URL or
//!   a redirect, is refused unless the operator listed that `host[:port]` as
//!   insecure ([`RegistryConfig::insecure`]); plain HTTP is allowed for those
//!   hosts only (and is what the client speaks to them);
//! - a credential goes only to a registry host, or a token service host,
//!   within its `hosts` ([`space_core::secrets::within`]), never across a
//!   redirect to another host, never to a mirror, and never into an error
//!   message; tokens are cached per [`Client`] (one client per build);
//! - manifests pinned with `@sha256:` are checked against their bytes, an
//!   index's chosen manifest against the index's digest, the config against
//!   the manifest's, and each blob against its descriptor before its file
//!   gets its final name.
//!
//! It owns no storage and unpacks nothing: the caller decides where blobs
//! go, and the confined importer applies them.
//!
//! How the server uses it: parse the tenant's text with
//! [`ImageRef::parse`]; make one [`Client`] per build ([`Client::new`]);
//! [`Client::resolve`] it with the tenant's [`Credential`], if any (an error
//! with [`ImageError::is_input_error`] is the caller's: 422); check
//! [`ResolvedImage::total_bytes`] against what the build may use; then
//! [`Client::download_blob`] each layer with the same client (it keeps the
//! credential and tokens, and renews an expired token once). Downloads of
//! one image may run concurrently, each to a destination of its own. A
//! registry that sends a blob slowly is bounded only by the per-read
//! timeout (60 s of silence): the caller bounds a whole pull.
//!
//! ```no_run
//! # async fn example() -> Result<(), space_image::ImageError> {
//! use space_image::{Client, ImageRef, RegistryConfig};
//! let config = RegistryConfig { insecure: vec!["127.0.0.1:5000".into()], ..RegistryConfig::default() };
//! let client = Client::new(&config)?;
//! let reference = ImageRef::parse("127.0.0.1:5000/team/app:1.2", &config)?;
//! let image = client.resolve(&reference, None).await?;
//! for layer in &image.layers {
//!     let dest = std::path::Path::new("/tmp").join(layer.digest.replace(':', "-"));
//!     client.download_blob(&image, layer, &dest, &mut |_bytes_so_far| {}).await?;
//! }
//! # Ok(()) }
//! ```

mod auth;
mod client;
mod manifest;
mod net;
mod reference;

use std::fmt;

pub use crate::client::Client;
pub use crate::manifest::{Compression, ImageDefaults, LayerDesc, ResolvedImage};
pub use crate::reference::ImageRef;

/// How the operator lets the server reach registries.
#[derive(Debug, Clone, Default)]
pub struct RegistryConfig {
    /// `host[:port]` entries (an entry without a port covers every port of
    /// its host): spoken to over plain HTTP, and allowed to be at loopback
    /// or private addresses. Nothing else is.
    pub insecure: Vec<String>,
    /// `host[:port]` of a pull-through mirror of the default registry:
    /// tried first for anonymous pulls from it (with `?ns=<registry>`),
    /// the registry itself when the mirror fails. A pull with a credential
    /// never goes to the mirror.
    pub mirror: Option<String>,
    /// The registry of references that name no host (`debian:bookworm-slim`).
    /// `None`: such a reference is an input error asking for a host.
    pub default_registry: Option<String>,
    /// A namespace put before one-component repositories of the default
    /// registry (`debian` → `<namespace>/debian`), for registries that keep
    /// their official images under one (as Docker's hub does with
    /// `library`).
    pub default_namespace: Option<String>,
    /// Fixed answers for registry names (`--registry-host NAME=IP`):
    /// these names resolve to these addresses only, the system resolver
    /// unasked (a registry without DNS, a test's). The address policy
    /// applies to them as to any answer.
    pub hosts: Vec<(String, std::net::IpAddr)>,
    /// Extra root certificates (PEM), beside the system bundle.
    pub extra_ca_pem: Vec<Vec<u8>>,
    /// Sent as `User-Agent`.
    pub user_agent: String,
}

/// A registry credential, opened from a tenant secret for one build.
#[derive(Clone)]
pub struct Credential {
    /// `Some`: HTTP Basic with this user and [`Credential::value`] as the
    /// password (sent to the registry, or to its token service).
    /// `None`: the value is a bearer token sent to the registry as is.
    pub username: Option<String>,
    pub value: zeroize::Zeroizing<String>,
    /// Host patterns (as a tenant secret's `hosts`): the credential is sent
    /// only to a registry, or a token service, whose host is within them.
    pub hosts: Vec<String>,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential")
            .field("username", &self.username)
            .field("value", &"<redacted>")
            .field("hosts", &self.hosts)
            .finish()
    }
}

/// Why an image could not be resolved or a blob downloaded. No message
/// carries a credential's value.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The registry has no such repository, tag, manifest or blob.
    #[error("not found: {0}")]
    NotFound(String),
    /// The registry (or its token service) refused the credentials, or
    /// asked for some and none were given.
    #[error("authentication failed: {0}")]
    AuthFailed(String),
    /// The image has no linux/amd64 manifest.
    #[error("no linux/amd64 image: {0}")]
    NoPlatform(String),
    /// Schema 1 manifests, unknown media types, foreign (`urls`,
    /// non-distributable) layers, digests other than sha256.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Bytes whose sha256 is not the one they were asked for.
    #[error("{what}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch { what: String, expected: String, actual: String },
    /// A body past its bound, or a blob past its descriptor's size.
    #[error("{what} is larger than {limit} bytes")]
    TooLarge { what: String, limit: u64 },
    /// An address, a redirect or a credential's destination the policy
    /// does not allow.
    #[error("refused: {0}")]
    Refused(String),
    /// The reference does not parse, or names no host when there is no
    /// default registry.
    #[error("invalid image reference: {0}")]
    InvalidReference(String),
    /// The operator's registry configuration does not parse.
    #[error("registry configuration: {0}")]
    Config(String),
    /// Connecting, reading, a timeout, or the registry unavailable (5xx).
    #[error("network: {0}")]
    Network(String),
    /// The registry answered something the protocol does not allow.
    #[error("registry protocol: {0}")]
    Protocol(String),
    /// Writing the downloaded blob.
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ImageError {
    /// Whether the caller's request is at fault (an API answers 422): the
    /// image, reference, credential or registry it named.
    pub fn is_input_error(&self) -> bool {
        match self {
            ImageError::NotFound(_)
            | ImageError::AuthFailed(_)
            | ImageError::NoPlatform(_)
            | ImageError::Unsupported(_)
            | ImageError::DigestMismatch { .. }
            | ImageError::TooLarge { .. }
            | ImageError::Refused(_)
            | ImageError::InvalidReference(_) => true,
            ImageError::Config(_) | ImageError::Network(_) | ImageError::Protocol(_) | ImageError::Io { .. } => false,
        }
    }
}
