//! The helper's request set and its wire format.
//!
//! One message is one frame: a 4-byte big-endian length, then that many
//! bytes of JSON. A frame is at most [`MAX_FRAME`] bytes; a file
//! descriptor a message carries (an agent listener, an archive to import)
//! travels beside its frame as `SCM_RIGHTS`, and each message says how many
//! it carries ([`Request::fds`], [`Reply::fds`]).
//!
//! Nothing in a request is a path. A request names sandboxes, templates,
//! operations and checkpoints by their canonical ids, whose spelling cannot
//! hold `/` or `..`; the helper derives every path from them inside its own
//! data dir (`layout::Layout`), so another data dir, or a file outside the one it
//! serves, cannot even be written down. Every size has a floor and a
//! ceiling. Wire types refuse unknown fields and convert into these
//! validated types while they are parsed, so a handler never sees an
//! unchecked value.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The version both sides must speak (`Hello`).
pub const PROTOCOL_VERSION: u32 = 4;
/// Bytes of a frame's length prefix.
pub const HEADER_LEN: usize = 4;
/// The largest frame body either side sends or accepts.
pub const MAX_FRAME: usize = 256 * 1024;
/// The most file descriptors one message carries (a build's log and its
/// archive).
pub const MAX_FDS: usize = 2;
/// Room for the most descriptors one `recvmsg` can bring (the kernel's
/// `SCM_MAX_FD`), so a message with more than [`MAX_FDS`] is never cut
/// short: a cut one cannot be read safely, and the descriptors the kernel
/// did install would stay open unseen. All that come are owned, counted
/// and closed.
pub const RECV_FDS: usize = 253;
/// The most packages one Debian template build names.
pub const MAX_PACKAGES: usize = 512;
/// The most sandboxes one `List` answer names (a host runs far fewer).
pub const MAX_LISTED: usize = 4096;
/// The longest message a refusal carries.
pub const MAX_MESSAGE: usize = 4096;
/// The longest `template.json` a published template is given.
pub const MAX_TEMPLATE_META: usize = 64 * 1024;
/// The most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 16;
/// The longest path a volume is mounted at (Linux's `PATH_MAX`).
pub const MAX_MOUNT_PATH: usize = 4096;
/// The most snapshots one `Volumes` or `VolumeUsage` answer names of a
/// volume.
pub const MAX_VOLUME_SNAPSHOTS: usize = 1024;

/// Why a frame or a message was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("a frame of {0} bytes is over the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("an empty frame")]
    Empty,
    #[error("a malformed message: {0}")]
    Malformed(#[source] serde_json::Error),
    #[error("an invalid request: {0}")]
    Invalid(String),
    #[error("the message carries {expected} file descriptor(s) but {received} came with it")]
    Descriptors { expected: usize, received: usize },
}

// ---------------------------------------------------------------------------
// Names and ids: each parses from its one canonical spelling or not at all.

/// Whether `id` is `prefix`, `_`, then 20 lowercase hex digits: the one
/// spelling `space_core::ids::new_id` writes.
fn canonical_id(id: &str, prefix: &str) -> bool {
    id.len() == prefix.len() + 21
        && id.starts_with(prefix)
        && id.as_bytes()[prefix.len()] == b'_'
        && id[prefix.len() + 1..].bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Template and checkpoint names: short, lowercase, one path component
/// (the rule of `space_host::template_meta::valid_name`).
fn component_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

/// A Debian package name (Policy §5.6.1), bounded.
fn package_name(name: &str) -> bool {
    (2..=128).contains(&name.len())
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b))
}

/// A Debian suite or codename (`bookworm`, `bookworm-backports`).
fn suite_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name.as_bytes()[0].is_ascii_lowercase()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

macro_rules! checked_name {
    ($(#[$doc:meta])* $name:ident, $check:expr, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn parse(text: &str) -> Result<Self, ProtoError> {
                if $check(text) {
                    Ok(Self(text.to_string()))
                } else {
                    Err(ProtoError::Invalid(format!("not a {}: {:?}", $what, Shown(text))))
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = ProtoError;
            fn try_from(text: String) -> Result<Self, ProtoError> {
                Self::parse(&text)
            }
        }

        impl From<$name> for String {
            fn from(name: $name) -> String {
                name.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

checked_name!(
    /// A sandbox's id, `sbx_` and 20 lowercase hex digits.
    SandboxId,
    |t| canonical_id(t, "sbx"),
    "sandbox id"
);
checked_name!(
    /// An operation's id, `op_` and 20 lowercase hex digits (names a fork's image).
    OperationId,
    |t| canonical_id(t, "op"),
    "operation id"
);
checked_name!(
    /// A template's name.
    TemplateName,
    component_name,
    "template name"
);
checked_name!(
    /// A checkpoint's name (the same rule as a template's).
    CheckpointName,
    component_name,
    "checkpoint name"
);
checked_name!(
    /// A volume's id, `vol_` and 20 lowercase hex digits (issue 37).
    VolumeId,
    |t| canonical_id(t, "vol"),
    "volume id"
);
checked_name!(
    /// A volume snapshot's name (the same rule as a template's).
    SnapshotName,
    component_name,
    "volume snapshot name"
);
checked_name!(
    /// A Debian package to install into a template.
    PackageName,
    package_name,
    "Debian package name"
);
checked_name!(
    /// A Debian suite a template is built from.
    Suite,
    suite_name,
    "Debian suite"
);

/// Whether `text` is 64 lowercase hex digits (a sha256, as its digests
/// and chain ids are spelled).
fn sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

checked_name!(
    /// A layer chain: the read-only root a list of layers makes, applied
    /// in order from nothing (`ChainId::next`). Its id is 64 hex digits.
    ChainId,
    sha256_hex,
    "layer chain id"
);
checked_name!(
    /// A blob's digest, `sha256:` and 64 lowercase hex digits.
    BlobDigest,
    |t: &str| t.strip_prefix("sha256:").is_some_and(sha256_hex),
    "sha256 digest"
);
checked_name!(
    /// What a build step's layer was made from, hashed by the unprivileged
    /// side (its tenant, its parent, its instruction and inputs): 64 hex.
    StepKey,
    sha256_hex,
    "build step key"
);

/// What one layer of a chain is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerKey {
    /// An image layer as a registry serves it: the chain is keyed by the
    /// compressed blob's digest, which the unprivileged side checked while
    /// it downloaded (and the importer checks again), so a chain is reached
    /// only by images that hold that very blob. `diff_id`, when the image's
    /// config names it, is checked too.
    Blob { digest: BlobDigest, diff_id: Option<BlobDigest> },
    /// A build step's layer (a tar the unprivileged side made, or what a
    /// build sandbox wrote).
    Step { key: StepKey },
}

impl LayerKey {
    /// The one spelling a chain id is hashed from.
    fn canonical(&self) -> String {
        match self {
            LayerKey::Blob { digest, .. } => format!("blob {digest}"),
            LayerKey::Step { key } => format!("step {key}"),
        }
    }
}

impl ChainId {
    /// The chain `key` makes on `parent` (`None`: on nothing):
    /// sha256 of the parent's id and the key's canonical spelling. Both
    /// sides compute it; the helper never takes a chain id for a layer it
    /// applies from a request.
    pub fn next(parent: Option<&ChainId>, key: &LayerKey) -> ChainId {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        hasher.update(parent.map_or("", ChainId::as_str).as_bytes());
        hasher.update(b"\n");
        hasher.update(key.canonical().as_bytes());
        let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        ChainId(hex)
    }
}

/// A template's `template.json` as the unprivileged side wrote it: one
/// JSON object of at most [`MAX_TEMPLATE_META`] bytes. The helper reads
/// it again as a template's record and checks the name and version in it
/// against the request's before it writes a byte of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TemplateMetaJson(String);

impl TemplateMetaJson {
    pub fn parse(text: &str) -> Result<Self, ProtoError> {
        if text.len() > MAX_TEMPLATE_META {
            return Err(ProtoError::Invalid(format!(
                "a template record of {} bytes, over {MAX_TEMPLATE_META}",
                text.len()
            )));
        }
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Object(_)) => Ok(Self(text.to_string())),
            _ => Err(ProtoError::Invalid(format!("not a template record: {:?}", Shown(text)))),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for TemplateMetaJson {
    type Error = ProtoError;
    fn try_from(text: String) -> Result<Self, ProtoError> {
        Self::parse(&text)
    }
}

impl From<TemplateMetaJson> for String {
    fn from(meta: TemplateMetaJson) -> String {
        meta.0
    }
}

/// Where a volume is mounted inside a sandbox: an absolute path of plain
/// names (no `.`, `..`, empty component or `//`), at most
/// [`MAX_MOUNT_PATH`] bytes, no NUL, not `/`, and neither one of the
/// places the platform or the kernel owns in a sandbox nor anything under
/// them ([`MountPath::RESERVED`]). The platform checks a request's path
/// with [`MountPath::parse`] (its message is fit to show the user), and
/// the helper checks it again as it parses a `Start`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MountPath(String);

impl MountPath {
    /// Places no volume may be mounted at or under: the kernel's
    /// (`/proc`, `/sys`, `/dev`), the sandbox's own `/tmp` (a bind of its
    /// root), and `/.space`, where the agent and its host socket are.
    pub const RESERVED: [&'static str; 5] = ["/proc", "/sys", "/dev", "/tmp", "/.space"];

    pub fn parse(text: &str) -> Result<MountPath, ProtoError> {
        let refuse = |why: &str| Err(ProtoError::Invalid(format!("mount path {:?} {why}", Shown(text))));
        if text.len() > MAX_MOUNT_PATH {
            return refuse(&format!("is longer than {MAX_MOUNT_PATH} bytes"));
        }
        if text.contains('\0') {
            return refuse("holds a NUL byte");
        }
        let Some(rest) = text.strip_prefix('/') else {
            return refuse("is not absolute (it must start with /)");
        };
        if rest.is_empty() {
            return refuse("is the sandbox's root: a volume is mounted at a directory below /");
        }
        for component in rest.split('/') {
            match component {
                "" => return refuse("has an empty component (// or a trailing /)"),
                "." | ".." => return refuse("has a . or .. component"),
                name if name.len() > 255 => return refuse("has a component longer than 255 bytes"),
                _ => {}
            }
        }
        if let Some(reserved) = Self::RESERVED.iter().find(|r| Self::is_at_or_under(text, r)) {
            return refuse(&format!("is {reserved} or under it, which the sandbox's system owns"));
        }
        Ok(MountPath(text.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `self` is `other` or a path below it (by whole components).
    pub fn is_at_or_under_path(&self, other: &MountPath) -> bool {
        Self::is_at_or_under(&self.0, &other.0)
    }

    fn is_at_or_under(path: &str, top: &str) -> bool {
        path == top || path.strip_prefix(top).is_some_and(|rest| rest.starts_with('/'))
    }
}

impl TryFrom<String> for MountPath {
    type Error = ProtoError;
    fn try_from(text: String) -> Result<Self, ProtoError> {
        Self::parse(&text)
    }
}

impl From<MountPath> for String {
    fn from(path: MountPath) -> String {
        path.0
    }
}

impl fmt::Display for MountPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One volume bound into a sandbox: its `volumes/<volume>/data` at `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    pub volume: VolumeId,
    pub path: MountPath,
    pub read_only: bool,
}

/// The checks a sandbox's mounts make together: at most [`MAX_MOUNTS`],
/// no two at one path, none under another's path.
pub fn check_mounts(mounts: &[Mount]) -> Result<(), ProtoError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(ProtoError::Invalid(format!("{} volumes mounted, over {MAX_MOUNTS}", mounts.len())));
    }
    for (i, mount) in mounts.iter().enumerate() {
        for other in &mounts[i + 1..] {
            if mount.path == other.path {
                return Err(ProtoError::Invalid(format!("two volumes are mounted at {}", mount.path)));
            }
            let (outer, inner) =
                match (mount.path.is_at_or_under_path(&other.path), other.path.is_at_or_under_path(&mount.path)) {
                    (true, _) => (&other.path, &mount.path),
                    (_, true) => (&mount.path, &other.path),
                    _ => continue,
                };
            return Err(ProtoError::Invalid(format!("a volume at {inner} would be under the one at {outer}")));
        }
    }
    Ok(())
}

/// At most 64 characters of a refused text, so a refusal never echoes a
/// frame's worth of it.
struct Shown<'a>(&'a str);

impl fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cut: String = self.0.chars().take(64).collect();
        if cut.len() < self.0.len() {
            write!(f, "{cut:?}… ({} bytes)", self.0.len())
        } else {
            write!(f, "{cut:?}")
        }
    }
}

macro_rules! bounded {
    ($(#[$doc:meta])* $name:ident($int:ty, $int_name:literal), $min:expr, $max:expr, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = $int_name, into = $int_name)]
        pub struct $name($int);

        impl $name {
            pub const MIN: $int = $min;
            pub const MAX: $int = $max;

            pub fn new(value: $int) -> Result<Self, ProtoError> {
                if (Self::MIN..=Self::MAX).contains(&value) {
                    Ok(Self(value))
                } else {
                    Err(ProtoError::Invalid(format!(
                        "{} {value} is outside {}..={}",
                        $what,
                        Self::MIN,
                        Self::MAX
                    )))
                }
            }

            pub fn get(self) -> $int {
                self.0
            }
        }

        impl TryFrom<$int> for $name {
            type Error = ProtoError;
            fn try_from(value: $int) -> Result<Self, ProtoError> {
                Self::new(value)
            }
        }

        impl From<$name> for $int {
            fn from(value: $name) -> $int {
                value.0
            }
        }
    };
}

bounded!(
    /// A sandbox's memory (the engine's overhead is the helper's to add).
    MemoryMib(u32, "u32"),
    64,
    1 << 20,
    "memory_mib"
);
bounded!(
    /// A sandbox's vCPUs (its CPU quota).
    Vcpus(u32, "u32"),
    1,
    256,
    "vcpus"
);
bounded!(
    /// A btrfs quota on a root's own writes.
    DiskMib(u32, "u32"),
    1,
    16 << 20,
    "disk_mib"
);
bounded!(
    /// A template's version number.
    TemplateVersion(u32, "u32"),
    1,
    1_000_000,
    "template version"
);
bounded!(
    /// How long engine commands a killed server left are waited for.
    PatienceMs(u32, "u32"),
    1,
    600_000,
    "patience (ms)"
);
bounded!(
    /// A timer slack for a dozing sandbox's tasks.
    SlackNs(u64, "u64"),
    1,
    1_000_000_000,
    "timer slack (ns)"
);

// ---------------------------------------------------------------------------
// Requests and replies.

/// Which engine runs a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    Gvisor,
    Firecracker,
}

/// The sizes a sandbox's cgroup, bundle and root quota are made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shape {
    pub memory_mib: MemoryMib,
    pub vcpus: Vcpus,
    pub disk_mib: DiskMib,
}

/// One version of a template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRef {
    pub name: TemplateName,
    pub version: TemplateVersion,
}

/// A sandbox's saved memory and disk, under the sandbox that saved it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ImageRef {
    /// A fork's image, `images/<operation>`, removed once the forks started.
    Fork { operation: OperationId },
    /// A kept checkpoint, `checkpoints/<name>`.
    Checkpoint { name: CheckpointName },
    /// A snapshot template's image while it is built, the template's
    /// `.<version>.partial` (saved only: a start from a published one is
    /// [`StartFrom::TemplateImage`]).
    Template { template: TemplateRef },
}

/// What a new engine process starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum StartFrom {
    /// A cold boot on a snapshot of the template's root.
    Template { template: TemplateRef },
    /// The sandbox's own suspend snapshot.
    Suspended {},
    /// Another (or the same) sandbox's image: a fork or a checkpoint restore.
    Image { source: SandboxId, image: ImageRef },
    /// A snapshot template's saved image.
    TemplateImage { template: TemplateRef },
    /// A clone of the template's microVM, booted once and saved for the
    /// start's shape (Firecracker; `HasCloneBase` tells whether it is
    /// there, `SaveCloneBase` makes it).
    Clone { template: TemplateRef },
    /// A build sandbox (gVisor only): a cold boot on a writable snapshot of
    /// a layer chain of the cache, the agent put in, the chain recorded
    /// beside the sandbox's root for `SaveLayer`.
    Layer { chain: ChainId },
}

/// What a template's root is built from. An archive is the request's one
/// file descriptor, opened by the unprivileged side, so the helper never
/// opens a path it was handed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BuildSource {
    Debian {
        suite: Suite,
        packages: Vec<PackageName>,
    },
    /// A `docker save` tar or an OCI layout tar.
    OciArchive {},
    /// A plain tar of a root directory.
    RootTar {},
    /// A writable snapshot of a layer chain (`ApplyLayer` made it).
    Layers {
        top: ChainId,
    },
}

/// The signals a sandbox's engine process may be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    Term,
    Kill,
}

/// Everything the unprivileged side may ask of the helper.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first message on a connection: the engine whose sandboxes its
    /// requests are about (template requests go on either).
    Hello {
        version: u32,
        engine: Engine,
    },
    /// Root snapshot (a fresh id only), disk quota, cgroup, bundle written
    /// by the helper from `shape`, the agent's listener, then the engine.
    /// Answered twice: `Started` with the listener's descriptor as soon as
    /// the engine process runs (the agent may dial before that process
    /// returns), then `Done` or a refusal once it returned (`runsc run
    /// --detach`: the sandbox runs, or why not).
    ///
    /// `mounts`: the volumes bound into it, checked together
    /// ([`check_mounts`]); the helper refuses a start whose volume is not
    /// there.
    Start {
        sandbox: SandboxId,
        engine: Engine,
        from: StartFrom,
        shape: Shape,
        #[serde(default)]
        mounts: Vec<Mount>,
    },
    Pause {
        sandbox: SandboxId,
    },
    Resume {
        sandbox: SandboxId,
    },
    /// The cgroup freezer, around a pause.
    Freeze {
        sandbox: SandboxId,
        frozen: bool,
    },
    /// Timer slack of every task of the sandbox's cgroup; `None` is the
    /// helper's own.
    SetTimerSlack {
        sandbox: SandboxId,
        slack_ns: Option<SlackNs>,
    },
    /// Checkpoint into the sandbox's own snapshot, then stop it.
    Suspend {
        sandbox: SandboxId,
    },
    /// Pause, snapshot the root, checkpoint leaving it running, resume.
    SaveImage {
        sandbox: SandboxId,
        image: ImageRef,
    },
    DropImage {
        sandbox: SandboxId,
        image: ImageRef,
    },
    /// Removes the suspend snapshot a restore started from, once its agent
    /// is in (a restore whose agent never dialed keeps it).
    DropSnapshot {
        sandbox: SandboxId,
    },
    Kill {
        sandbox: SandboxId,
        signal: Signal,
    },
    /// Stops the engine's processes and removes their cgroups, keeping the
    /// root and any snapshot (a rewind, a sweep, a re-adoption that failed).
    Stop {
        sandbox: SandboxId,
    },
    /// Kills engine processes that still work on the sandbox without an
    /// owner (a killed server's `runsc run`).
    StopStrays {
        sandbox: SandboxId,
    },
    /// Waits up to `patience_ms` (a pause or resume longer) for the engine
    /// commands a killed server left on these sandboxes, then kills them.
    SettleOrphans {
        sandboxes: Vec<SandboxId>,
        patience_ms: PatienceMs,
    },
    /// Engine state, cgroups, root subvolume and the helper's files of it.
    Destroy {
        sandbox: SandboxId,
    },
    /// Asks the engine itself (`runsc state`).
    State {
        sandbox: SandboxId,
    },
    /// The state of each, in order, from the engine's state files with its
    /// process checked alive (one engine process each costs seconds for a
    /// hundred); answered `States`.
    States {
        sandboxes: Vec<SandboxId>,
    },
    /// The last lines of the engine's log of the sandbox, for an error
    /// message; answered `Log`.
    EngineLog {
        sandbox: SandboxId,
    },
    /// Sandboxes whose engine processes run (for re-adoption).
    List {},
    /// Whether the helper's engine can start sandboxes here, and its
    /// version or why not; answered `Availability`.
    Availability {},
    /// A fresh agent listener for a redial; answered `Listening` + fd.
    ListenAgent {
        sandbox: SandboxId,
    },
    /// Removes the agent's socket once the agent is in.
    CloseAgent {
        sandbox: SandboxId,
    },
    /// A connection to a jailed VMM's API socket; answered `Vmm` + fd.
    ConnectVmm {
        sandbox: SandboxId,
    },
    /// Whether the template's microVM is saved for clones of `shape`;
    /// answered `Has`.
    HasCloneBase {
        template: TemplateRef,
        shape: Shape,
    },
    /// Saves `sandbox` — the template's microVM, booted from the template
    /// and its agent quiesced by the unprivileged side — as the clone base
    /// of its template for its shape, then stops it.
    SaveCloneBase {
        sandbox: SandboxId,
        template: TemplateRef,
    },
    /// Builds `template`'s root (never an existing version) under a quota
    /// into a new build dir, as `BeginTemplate` makes it. Its descriptors:
    /// the build log (opened for writing by the unprivileged side, which
    /// owns the log dir), then for an archive the archive (opened for
    /// reading). Answered with `Progress` replies while it runs, then
    /// `Built` or a refusal; `PublishTemplate` publishes it.
    BuildTemplate {
        template: TemplateRef,
        source: BuildSource,
        disk_mib: DiskMib,
    },
    /// Makes the empty build dir of a snapshot template's new version,
    /// `.<version>.partial` (a stale one of a killed build goes first),
    /// when `version` is newer than every version of the template; a
    /// `SaveImage` or `CopyCheckpoint` then fills it.
    BeginTemplate {
        template: TemplateRef,
    },
    /// Copies a checkpoint of `sandbox` into the build dir `BeginTemplate`
    /// made (its root a snapshot, the rest shared blocks).
    CopyCheckpoint {
        template: TemplateRef,
        sandbox: SandboxId,
        checkpoint: CheckpointName,
    },
    /// Makes the build's root read-only, writes `meta` (whose name and
    /// version must be the request's) as its `template.json`, and renames
    /// the build dir to the version's; with `ext4`, a microVM's root drive
    /// of the root is made first, with that much room for its writes.
    PublishTemplate {
        template: TemplateRef,
        meta: TemplateMetaJson,
        ext4: Option<DiskMib>,
    },
    /// Removes one version of a template (published or still a build dir),
    /// or with no version the template's every version and build.
    DeleteTemplate {
        name: TemplateName,
        version: Option<TemplateVersion>,
    },
    /// Removes the quota groups of subvolumes btrfs has let go.
    ClearStaleQuotas {},
    /// Writes a published (not a snapshot) template version's root as a
    /// tar into the request's one descriptor, a file the unprivileged side
    /// opened for writing (another node of a cluster pulls it).
    ExportTemplate {
        template: TemplateRef,
    },
    /// Whether a layer chain is in the cache (and, if so, that it was
    /// used now, for the cache's eviction); answered `Has`.
    HasLayer {
        chain: ChainId,
    },
    /// The chains in the cache, with their own bytes and when each was
    /// last used; answered `Layers` (at most [`MAX_LISTED`]).
    ListLayers {},
    /// Applies one layer onto a writable snapshot of `parent` (or onto
    /// nothing), capped at `disk_mib` of its own writes, and keeps the
    /// result read-only as the chain `ChainId::next(parent, layer)`. Its
    /// descriptors: the build's log, then the layer (a blob, gzip, zstd or
    /// a plain tar), read only by the confined importer. A chain that is
    /// there already is answered at once, its descriptor unread. Answered
    /// with `Progress` replies, then `LayerReady` or a refusal.
    ApplyLayer {
        parent: Option<ChainId>,
        layer: LayerKey,
        disk_mib: DiskMib,
    },
    /// Removes a chain from the cache (templates made from it keep their
    /// roots: each is a snapshot of its own).
    DeleteLayer {
        chain: ChainId,
    },
    /// Keeps what a build sandbox's root became as the chain
    /// `ChainId::next(parent, Step { key })`: refused unless the sandbox
    /// was started from `parent` (`StartFrom::Layer`) and its engine is
    /// stopped. A read-only snapshot of its root without what the platform
    /// put there (the agent, mount points, hostname, egress CA). Answered
    /// `LayerReady` (`cached` when the chain was there already).
    SaveLayer {
        sandbox: SandboxId,
        parent: ChainId,
        key: StepKey,
    },
    /// Makes `volumes/<volume>/data` (refused if the volume is there): an
    /// empty subvolume, or a writable snapshot of `from`'s snapshot, under
    /// a quota group limit of `size` on its own writes (issue 37). An
    /// `image` volume (a Firecracker node's, decision 031) holds an ext4
    /// image of `size` in its subvolume; a volume from a snapshot is of its
    /// source's kind, so it takes no `image`.
    CreateVolume {
        volume: VolumeId,
        size: DiskMib,
        from: Option<(VolumeId, SnapshotName)>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        image: bool,
    },
    /// Removes a volume with its snapshots (none there is no error).
    DeleteVolume {
        volume: VolumeId,
    },
    /// A read-only snapshot of the volume's `data` (refused if one of that
    /// name is there).
    SnapshotVolume {
        volume: VolumeId,
        snapshot: SnapshotName,
    },
    /// Removes a snapshot of a volume (none there is no error).
    DeleteVolumeSnapshot {
        volume: VolumeId,
        snapshot: SnapshotName,
    },
    /// The volume's `data` becomes a writable snapshot of `snapshot`, made
    /// as `data.new` and swapped in by renames.
    RestoreVolume {
        volume: VolumeId,
        snapshot: SnapshotName,
    },
    /// What a volume and its snapshots hold; answered `VolumeUsage`.
    VolumeUsage {
        volume: VolumeId,
    },
    /// Every volume on disk with its snapshots; answered `Volumes`.
    ListVolumes {},
    /// A socket whose other end a confined child serves the agent's file
    /// protocol on, the volume's `data` its root; answered `VolumeFiles` +
    /// the socket. On an image volume (decision 031) the child serves the
    /// image mounted through a loop device: the image itself when `write`
    /// (the platform lets no sandbox write it meanwhile), else a copy of
    /// it, mounted read-only.
    VolumeFiles {
        volume: VolumeId,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        write: bool,
    },
    /// The shared store volumes are kept in; answered `VolumeStore`.
    VolumeStore {},
    /// Mounts a volume's image from the shared store at `volumes/<volume>`
    /// once its lock is taken (decision 032).
    AttachVolume {
        volume: VolumeId,
    },
    /// Unmounts a volume's image and lets go of its lock, leaving the image.
    DetachVolume {
        volume: VolumeId,
    },
}

impl Request {
    /// How many descriptors travel with this request.
    pub fn fds(&self) -> usize {
        match self {
            Request::BuildTemplate { source: BuildSource::OciArchive {} | BuildSource::RootTar {}, .. }
            | Request::ApplyLayer { .. } => 2,
            Request::BuildTemplate { source: BuildSource::Debian { .. } | BuildSource::Layers { .. }, .. }
            | Request::ExportTemplate { .. } => 1,
            _ => 0,
        }
    }

    /// The checks one field's type cannot make alone.
    pub fn check(&self) -> Result<(), ProtoError> {
        match self {
            Request::Hello { version, .. } if *version != PROTOCOL_VERSION => {
                Err(ProtoError::Invalid(format!("protocol version {version}; this helper speaks {PROTOCOL_VERSION}")))
            }
            Request::States { sandboxes } | Request::SettleOrphans { sandboxes, .. }
                if sandboxes.len() > MAX_LISTED =>
            {
                Err(ProtoError::Invalid(format!("{} sandboxes named, over {MAX_LISTED}", sandboxes.len())))
            }
            Request::Start { from: StartFrom::Image { image: ImageRef::Template { .. }, .. }, .. } => {
                Err(ProtoError::Invalid("a start from a template's image names the template".into()))
            }
            Request::Start { mounts, .. } => check_mounts(mounts),
            Request::CreateVolume { volume, from: Some((source, _)), .. } if source == volume => {
                Err(ProtoError::Invalid(format!("volume {volume} cannot be made from its own snapshot")))
            }
            Request::CreateVolume { from: Some(_), image: true, .. } => {
                Err(ProtoError::Invalid("a volume made from a snapshot is of its source's kind: no image".into()))
            }
            Request::BuildTemplate { source: BuildSource::Debian { packages, .. }, .. } => {
                if packages.is_empty() || packages.len() > MAX_PACKAGES {
                    return Err(ProtoError::Invalid(format!("1..={MAX_PACKAGES} packages, not {}", packages.len())));
                }
                let mut sorted: Vec<&PackageName> = packages.iter().collect();
                sorted.sort();
                sorted.dedup();
                if sorted.len() != packages.len() {
                    return Err(ProtoError::Invalid("a package is named twice".into()));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A chain of the layer cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerEntry {
    pub chain: ChainId,
    /// What its root holds on its own (its quota group's exclusive bytes;
    /// 0 when quotas are off).
    pub bytes: u64,
    /// When it was last applied, found or built from (seconds since the epoch).
    pub used_s: u64,
}

/// What the helper says of an engine's sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    Running,
    Paused,
    Stopped,
    Missing,
}

/// A step of a start done by the helper, before the engine ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartStep {
    RootSnapshot,
    DiskLimit,
    BundleAndSocket,
}

/// How long one [`StartStep`] took, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepTook {
    pub step: StartStep,
    pub micros: u64,
}

/// What a build's progress counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmountUnit {
    Bytes,
    Packages,
}

/// How much of a build step's work is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Amount {
    pub unit: AmountUnit,
    pub done: u64,
    pub total: u64,
}

/// The most steps a `Started` reply names.
pub const MAX_STEPS: usize = 16;

/// Why the helper refused or failed a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// The request did not parse or was out of bounds.
    BadRequest,
    /// Valid, but not in the sandbox's present state (a `Start` into an
    /// existing id, an image of a sandbox that has none).
    Conflict,
    NotFound,
    /// The engine or the host failed; the helper's log has the detail.
    Failed,
}

/// The helper's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Hello {
        version: u32,
    },
    Done {},
    /// The engine runs (`pid`: the command that started it); the agent's
    /// listener comes with it, and `Done` or a refusal follows when that
    /// command returned.
    Started {
        pid: u32,
        steps: Vec<StepTook>,
    },
    /// How many tasks' timer slack was set.
    SlackSet {
        tasks: u32,
    },
    /// The image is saved; the sandbox was frozen this long.
    ImageSaved {
        frozen_us: u64,
    },
    /// A fresh agent listener comes with it.
    Listening {},
    /// A connection to the VMM's API comes with it.
    Vmm {},
    /// Whether what was asked for is there.
    Has {
        has: bool,
    },
    State {
        state: EngineState,
    },
    /// One state per sandbox `States` named, in its order.
    States {
        states: Vec<EngineState>,
    },
    /// At most [`MAX_MESSAGE`] bytes of the engine's log.
    Log {
        text: String,
    },
    Sandboxes {
        sandboxes: Vec<SandboxId>,
    },
    /// A build's step (at most [`MAX_MESSAGE`] bytes of it) and how much
    /// of its work is done; more replies follow.
    Progress {
        step: String,
        done: u64,
        total: u64,
        amount: Option<Amount>,
    },
    /// A build's root is made; `image` is what the image says of itself
    /// (its source and defaults), for the record `PublishTemplate` writes.
    Built {
        image: TemplateMetaJson,
    },
    /// The layer cache's chains, least recently used first.
    Layers {
        layers: Vec<LayerEntry>,
    },
    /// A layer chain is in the cache: `bytes` of layer were applied to
    /// make it, none when it was there already (`cached`).
    LayerReady {
        chain: ChainId,
        bytes: u64,
        cached: bool,
    },
    /// At most [`MAX_MESSAGE`] bytes of `detail`.
    Availability {
        available: bool,
        detail: String,
    },
    Refused {
        refusal: Refusal,
        message: String,
    },
    /// What a volume holds: its `data`'s referenced bytes, and what only
    /// each snapshot holds (at most [`MAX_VOLUME_SNAPSHOTS`]).
    VolumeUsage {
        used_bytes: u64,
        snapshots: Vec<SnapshotUsage>,
    },
    /// Every volume on disk (at most [`MAX_LISTED`]).
    Volumes {
        volumes: Vec<VolumeEntry>,
    },
    /// The socket to a volume's files child comes with it.
    VolumeFiles {},
    /// The name of the shared store volumes are kept in (32 hex digits),
    /// or none when they are on the helper's own disk.
    VolumeStore {
        store: Option<String>,
    },
}

/// A snapshot of a volume and the bytes only it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotUsage {
    pub snapshot: SnapshotName,
    pub bytes: u64,
}

/// A volume found on disk, with its snapshots (at most
/// [`MAX_VOLUME_SNAPSHOTS`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeEntry {
    pub volume: VolumeId,
    pub snapshots: Vec<SnapshotName>,
}

impl Reply {
    pub fn fds(&self) -> usize {
        match self {
            Reply::Started { .. } | Reply::Listening {} | Reply::Vmm {} | Reply::VolumeFiles {} => 1,
            _ => 0,
        }
    }

    /// A refusal, its message cut to [`MAX_MESSAGE`] bytes.
    pub fn refused(refusal: Refusal, message: impl Into<String>) -> Reply {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
        }
        Reply::Refused { refusal, message }
    }

    pub fn check(&self) -> Result<(), ProtoError> {
        match self {
            Reply::Started { steps, .. } if steps.len() > MAX_STEPS => {
                Err(ProtoError::Invalid(format!("{} steps, over {MAX_STEPS}", steps.len())))
            }
            Reply::States { states } if states.len() > MAX_LISTED => {
                Err(ProtoError::Invalid(format!("{} states, over {MAX_LISTED}", states.len())))
            }
            Reply::Progress { step, .. } if step.len() > MAX_MESSAGE => {
                Err(ProtoError::Invalid(format!("a build step of {} bytes", step.len())))
            }
            Reply::Log { text } if text.len() > MAX_MESSAGE => {
                Err(ProtoError::Invalid(format!("a log of {} bytes", text.len())))
            }
            Reply::Layers { layers } if layers.len() > MAX_LISTED => {
                Err(ProtoError::Invalid(format!("{} layers listed, over {MAX_LISTED}", layers.len())))
            }
            Reply::Sandboxes { sandboxes } if sandboxes.len() > MAX_LISTED => {
                Err(ProtoError::Invalid(format!("{} sandboxes listed, over {MAX_LISTED}", sandboxes.len())))
            }
            Reply::Refused { message, .. } if message.len() > MAX_MESSAGE => {
                Err(ProtoError::Invalid(format!("a refusal of {} bytes", message.len())))
            }
            Reply::VolumeUsage { snapshots, .. } if snapshots.len() > MAX_VOLUME_SNAPSHOTS => {
                Err(ProtoError::Invalid(format!("{} snapshots, over {MAX_VOLUME_SNAPSHOTS}", snapshots.len())))
            }
            Reply::Volumes { volumes } if volumes.len() > MAX_LISTED => {
                Err(ProtoError::Invalid(format!("{} volumes listed, over {MAX_LISTED}", volumes.len())))
            }
            Reply::Volumes { volumes } if volumes.iter().any(|v| v.snapshots.len() > MAX_VOLUME_SNAPSHOTS) => {
                Err(ProtoError::Invalid(format!("a volume listed with over {MAX_VOLUME_SNAPSHOTS} snapshots")))
            }
            Reply::VolumeStore { store: Some(store) }
                if store.len() != 32 || !store.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                Err(ProtoError::Invalid("a volume store's name is not 32 hex digits".into()))
            }
            _ => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------
// Frames.

/// The body length a frame header announces, refused past [`MAX_FRAME`]
/// before a byte of the body is read or allocated.
pub fn body_len(header: [u8; HEADER_LEN]) -> Result<usize, ProtoError> {
    let len = u32::from_be_bytes(header) as usize;
    match len {
        0 => Err(ProtoError::Empty),
        len if len > MAX_FRAME => Err(ProtoError::TooLarge(len)),
        len => Ok(len),
    }
}

/// `message` as one frame: its length, then its JSON.
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, ProtoError> {
    let body = serde_json::to_vec(message).map_err(ProtoError::Malformed)?;
    if body.len() > MAX_FRAME {
        return Err(ProtoError::TooLarge(body.len()));
    }
    let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// A request from a frame's body, parsed into validated types and checked.
pub fn decode_request(body: &[u8]) -> Result<Request, ProtoError> {
    if body.len() > MAX_FRAME {
        return Err(ProtoError::TooLarge(body.len()));
    }
    let request: Request = serde_json::from_slice(body).map_err(ProtoError::Malformed)?;
    request.check()?;
    Ok(request)
}

/// A reply from a frame's body.
pub fn decode_reply(body: &[u8]) -> Result<Reply, ProtoError> {
    if body.len() > MAX_FRAME {
        return Err(ProtoError::TooLarge(body.len()));
    }
    let reply: Reply = serde_json::from_slice(body).map_err(ProtoError::Malformed)?;
    reply.check()?;
    Ok(reply)
}

#[cfg(test)]
pub(crate) mod tests;
