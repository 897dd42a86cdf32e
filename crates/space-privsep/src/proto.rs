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
//! data dir ([`Layout`]), so another data dir, or a file outside the one it
//! serves, cannot even be written down. Every size has a floor and a
//! ceiling. Wire types refuse unknown fields and convert into these
//! validated types while they are parsed, so a handler never sees an
//! unchecked value.

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::layout::Layout;

/// The version both sides must speak (`Hello`).
pub const PROTOCOL_VERSION: u32 = 1;
/// Bytes of a frame's length prefix.
pub const HEADER_LEN: usize = 4;
/// The largest frame body either side sends or accepts.
pub const MAX_FRAME: usize = 256 * 1024;
/// The most file descriptors one message carries.
pub const MAX_FDS: usize = 1;
/// The most packages one Debian template build names.
pub const MAX_PACKAGES: usize = 512;
/// The most sandboxes one `List` answer names (a host runs far fewer).
pub const MAX_LISTED: usize = 4096;
/// The longest message a refusal carries.
pub const MAX_MESSAGE: usize = 4096;

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
    /// The first message on a connection.
    Hello {
        version: u32,
    },
    /// Root snapshot (a fresh id only), disk quota, cgroup, bundle written
    /// by the helper from `shape`, the agent's listener, then the engine.
    /// Answered `Started` with the listener's descriptor.
    Start {
        sandbox: SandboxId,
        engine: Engine,
        from: StartFrom,
        shape: Shape,
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
    /// Builds `template`'s root (never an existing version) under a quota.
    BuildTemplate {
        template: TemplateRef,
        source: BuildSource,
        disk_mib: DiskMib,
    },
    /// Makes the root read-only and the version visible.
    PublishTemplate {
        template: TemplateRef,
    },
    DeleteTemplate {
        template: TemplateRef,
    },
    ClearStaleQuotas {},
}

impl Request {
    /// How many descriptors travel with this request.
    pub fn fds(&self) -> usize {
        match self {
            Request::BuildTemplate { source: BuildSource::OciArchive {} | BuildSource::RootTar {}, .. } => 1,
            _ => 0,
        }
    }

    /// The checks one field's type cannot make alone.
    pub fn check(&self) -> Result<(), ProtoError> {
        match self {
            Request::Hello { version } if *version != PROTOCOL_VERSION => {
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

/// What the helper says of an engine's sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    Running,
    Paused,
    Stopped,
    Missing,
}

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
    /// The engine runs; the agent's listener comes with it.
    Started {
        pid: u32,
    },
    /// A fresh agent listener comes with it.
    Listening {},
    /// A connection to the VMM's API comes with it.
    Vmm {},
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
    Refused {
        refusal: Refusal,
        message: String,
    },
}

impl Reply {
    pub fn fds(&self) -> usize {
        match self {
            Reply::Started { .. } | Reply::Listening {} | Reply::Vmm {} => 1,
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
            Reply::States { states } if states.len() > MAX_LISTED => {
                Err(ProtoError::Invalid(format!("{} states, over {MAX_LISTED}", states.len())))
            }
            Reply::Log { text } if text.len() > MAX_MESSAGE => {
                Err(ProtoError::Invalid(format!("a log of {} bytes", text.len())))
            }
            Reply::Sandboxes { sandboxes } if sandboxes.len() > MAX_LISTED => {
                Err(ProtoError::Invalid(format!("{} sandboxes listed, over {MAX_LISTED}", sandboxes.len())))
            }
            Reply::Refused { message, .. } if message.len() > MAX_MESSAGE => {
                Err(ProtoError::Invalid(format!("a refusal of {} bytes", message.len())))
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
mod tests {
    use std::path::Component;

    use super::*;

    const SBX: &str = "sbx_0123456789abcdef0123";

    fn sandbox() -> SandboxId {
        SandboxId::parse(SBX).unwrap()
    }

    fn shape() -> Shape {
        Shape {
            memory_mib: MemoryMib::new(512).unwrap(),
            vcpus: Vcpus::new(1).unwrap(),
            disk_mib: DiskMib::new(1024).unwrap(),
        }
    }

    fn template() -> TemplateRef {
        TemplateRef { name: TemplateName::parse("base").unwrap(), version: TemplateVersion::new(3).unwrap() }
    }

    /// One of every request, for round trips and path checks.
    fn every_request() -> Vec<Request> {
        let image = ImageRef::Checkpoint { name: CheckpointName::parse("before-upgrade").unwrap() };
        let fork = ImageRef::Fork { operation: OperationId::parse("op_00112233445566778899").unwrap() };
        vec![
            Request::Hello { version: PROTOCOL_VERSION },
            Request::Start {
                sandbox: sandbox(),
                engine: Engine::Gvisor,
                from: StartFrom::Template { template: template() },
                shape: shape(),
            },
            Request::Start {
                sandbox: sandbox(),
                engine: Engine::Firecracker,
                from: StartFrom::Suspended {},
                shape: shape(),
            },
            Request::Start {
                sandbox: sandbox(),
                engine: Engine::Gvisor,
                from: StartFrom::Image { source: sandbox(), image: fork.clone() },
                shape: shape(),
            },
            Request::Start {
                sandbox: sandbox(),
                engine: Engine::Gvisor,
                from: StartFrom::TemplateImage { template: template() },
                shape: shape(),
            },
            Request::Pause { sandbox: sandbox() },
            Request::Resume { sandbox: sandbox() },
            Request::Freeze { sandbox: sandbox(), frozen: true },
            Request::SetTimerSlack { sandbox: sandbox(), slack_ns: Some(SlackNs::new(50_000_000).unwrap()) },
            Request::SetTimerSlack { sandbox: sandbox(), slack_ns: None },
            Request::Suspend { sandbox: sandbox() },
            Request::SaveImage { sandbox: sandbox(), image: image.clone() },
            Request::DropImage { sandbox: sandbox(), image: fork },
            Request::SaveImage { sandbox: sandbox(), image: ImageRef::Template { template: template() } },
            Request::DropSnapshot { sandbox: sandbox() },
            Request::Stop { sandbox: sandbox() },
            Request::StopStrays { sandbox: sandbox() },
            Request::SettleOrphans { sandboxes: vec![sandbox()], patience_ms: PatienceMs::new(10_000).unwrap() },
            Request::States { sandboxes: vec![sandbox(), sandbox()] },
            Request::EngineLog { sandbox: sandbox() },
            Request::Kill { sandbox: sandbox(), signal: Signal::Kill },
            Request::Destroy { sandbox: sandbox() },
            Request::State { sandbox: sandbox() },
            Request::List {},
            Request::ListenAgent { sandbox: sandbox() },
            Request::CloseAgent { sandbox: sandbox() },
            Request::ConnectVmm { sandbox: sandbox() },
            Request::BuildTemplate {
                template: template(),
                source: BuildSource::Debian {
                    suite: Suite::parse("bookworm").unwrap(),
                    packages: ["python3", "libstdc++6", "ca-certificates"]
                        .iter()
                        .map(|p| PackageName::parse(p).unwrap())
                        .collect(),
                },
                disk_mib: DiskMib::new(4096).unwrap(),
            },
            Request::BuildTemplate {
                template: template(),
                source: BuildSource::OciArchive {},
                disk_mib: DiskMib::new(4096).unwrap(),
            },
            Request::PublishTemplate { template: template() },
            Request::DeleteTemplate { template: template() },
            Request::ClearStaleQuotas {},
        ]
    }

    fn body(frame: &[u8]) -> &[u8] {
        let len = body_len(frame[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(len, frame.len() - HEADER_LEN);
        &frame[HEADER_LEN..]
    }

    #[test]
    fn every_request_round_trips_through_a_frame() {
        for request in every_request() {
            let frame = encode(&request).unwrap();
            assert_eq!(decode_request(body(&frame)).unwrap(), request);
        }
    }

    #[test]
    fn replies_round_trip_and_say_what_they_carry() {
        let replies = [
            Reply::Hello { version: PROTOCOL_VERSION },
            Reply::Done {},
            Reply::Started { pid: 42 },
            Reply::Listening {},
            Reply::Vmm {},
            Reply::State { state: EngineState::Paused },
            Reply::States { states: vec![EngineState::Running, EngineState::Missing] },
            Reply::Log { text: "runsc: started".into() },
            Reply::Sandboxes { sandboxes: vec![sandbox()] },
            Reply::refused(Refusal::Conflict, "that sandbox exists"),
        ];
        for reply in replies {
            let frame = encode(&reply).unwrap();
            assert_eq!(decode_reply(body(&frame)).unwrap(), reply);
        }
        assert_eq!(Reply::Started { pid: 1 }.fds(), 1);
        assert_eq!(Reply::Done {}.fds(), 0);
    }

    #[test]
    fn a_refusal_message_is_cut_to_its_bound() {
        let Reply::Refused { message, .. } = Reply::refused(Refusal::Failed, "é".repeat(MAX_MESSAGE)) else {
            panic!("not a refusal")
        };
        assert!(message.len() <= MAX_MESSAGE && message.len() > MAX_MESSAGE - 2);
    }

    #[test]
    fn frames_past_the_limit_or_empty_are_refused_before_their_body() {
        assert!(matches!(body_len((MAX_FRAME as u32 + 1).to_be_bytes()), Err(ProtoError::TooLarge(_))));
        assert!(matches!(body_len(u32::MAX.to_be_bytes()), Err(ProtoError::TooLarge(_))));
        assert!(matches!(body_len([0; 4]), Err(ProtoError::Empty)));
        assert_eq!(body_len((MAX_FRAME as u32).to_be_bytes()).unwrap(), MAX_FRAME);
        let huge = vec![b' '; MAX_FRAME + 1];
        assert!(matches!(decode_request(&huge), Err(ProtoError::TooLarge(_))));
        let packages = (0..20_000).map(|i| PackageName::parse(&format!("package-number-{i}")).unwrap()).collect();
        let request = Request::BuildTemplate {
            template: template(),
            source: BuildSource::Debian { suite: Suite::parse("bookworm").unwrap(), packages },
            disk_mib: DiskMib::new(1).unwrap(),
        };
        assert!(matches!(encode(&request), Err(ProtoError::TooLarge(_))));
    }

    #[test]
    fn malformed_json_is_refused_with_what_was_wrong() {
        for bad in [
            &b"{"[..],
            b"null",
            b"[]",
            b"{\"op\":\"pause\"}",
            b"{\"op\":\"reboot\"}",
            b"{\"op\":\"list\",\"path\":\"/\"}",
            b"\xff\xfe",
        ] {
            let err = decode_request(bad).unwrap_err();
            assert!(matches!(err, ProtoError::Malformed(_)), "{bad:?}: {err}");
            assert!(err.to_string().starts_with("a malformed message: "), "{err}");
        }
    }

    /// A hostile request in JSON, as a compromised unprivileged process
    /// would write it.
    fn hostile(json: &str) -> ProtoError {
        match decode_request(json.as_bytes()) {
            Ok(request) => panic!("accepted {json}: {request:?}"),
            Err(err) => err,
        }
    }

    #[test]
    fn ids_in_any_but_their_canonical_spelling_are_refused() {
        for id in [
            "../sbx_0123456789abcdef0123",
            "sbx_0123456789abcdef0123/..",
            "sbx_0123456789abcdef0123/../../etc",
            "sbx_../../../../etc/passwd",
            "sbx_0123456789ABCDEF0123",
            "SBX_0123456789abcdef0123",
            "sbx_0123456789abcdef012",
            "sbx_0123456789abcdef01234",
            " sbx_0123456789abcdef0123",
            "sbx_0123456789abcdef0123\u{0}",
            "%73bx_0123456789abcdef0123",
            "/var/lib/other-space/sandboxes/sbx_0123456789abcdef0123",
            "op_0123456789abcdef01234",
            "",
        ] {
            let json = serde_json::json!({"op": "destroy", "sandbox": id}).to_string();
            let err = hostile(&json);
            assert!(err.to_string().contains("not a sandbox id"), "{id:?}: {err}");
        }
    }

    #[test]
    fn names_and_images_cannot_climb_out_of_their_directory() {
        for json in [
            r#"{"op":"delete_template","template":{"name":"..","version":1}}"#,
            r#"{"op":"delete_template","template":{"name":"base/../../..","version":1}}"#,
            r#"{"op":"delete_template","template":{"name":"/etc","version":1}}"#,
            r#"{"op":"delete_template","template":{"name":".1.partial","version":1}}"#,
            r#"{"op":"drop_image","sandbox":"sbx_0123456789abcdef0123","image":{"kind":"checkpoint","name":"../../sbx_99999999999999999999"}}"#,
            r#"{"op":"drop_image","sandbox":"sbx_0123456789abcdef0123","image":{"kind":"fork","operation":"op_../../x"}}"#,
            r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"image","source":"sbx_0123456789abcdef0123/../..","image":{"kind":"fork","operation":"op_00112233445566778899"}},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
        ] {
            let err = hostile(json);
            assert!(matches!(err, ProtoError::Malformed(_)) && err.to_string().contains("not a"), "{json}: {err}");
        }
    }

    #[test]
    fn a_path_cannot_be_written_into_any_request() {
        // Every field that could carry one is a typed id; a field of
        // another name is refused, whatever it holds.
        for json in [
            r#"{"op":"destroy","sandbox":"sbx_0123456789abcdef0123","dir":"/var/lib/other"}"#,
            r#"{"op":"destroy","sandbox":"sbx_0123456789abcdef0123","data_dir":"/"}"#,
            r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"template","template":{"name":"base","version":1}},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024},"bundle":"/tmp/evil"}"#,
            r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"path","path":"/"},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
            r#"{"op":"build_template","template":{"name":"x","version":1},"source":{"kind":"directory","path":"/etc"},"disk_mib":10}"#,
            r#"{"op":"build_template","template":{"name":"x","version":1},"source":{"kind":"oci_archive","path":"/etc/shadow"},"disk_mib":10}"#,
            r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"suspended","dir":"/"},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
            r#"{"op":"list","under":"/var/lib/other"}"#,
        ] {
            assert!(matches!(hostile(json), ProtoError::Malformed(_)), "{json}");
        }
        let layout = Layout::new("/var/lib/space");
        for request in every_request() {
            for path in layout.paths_of(&request) {
                let rest = path.strip_prefix(layout.data_dir()).unwrap_or_else(|_| panic!("{path:?} left"));
                assert!(rest.components().all(|c| matches!(c, Component::Normal(_))), "{path:?}");
            }
        }
    }

    #[test]
    fn sizes_out_of_bounds_are_refused() {
        let start = |memory: u64, vcpus: u64, disk: u64| {
            format!(
                r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"suspended"}},"shape":{{"memory_mib":{memory},"vcpus":{vcpus},"disk_mib":{disk}}}}}"#
            )
        };
        assert!(decode_request(start(512, 2, 1024).as_bytes()).is_ok());
        for (memory, vcpus, disk) in [
            (0, 1, 1),
            (63, 1, 1),
            ((1 << 20) + 1, 1, 1),
            (u32::MAX as u64, 1, 1),
            (1 << 40, 1, 1),
            (512, 0, 1),
            (512, 257, 1),
            (512, 1, 0),
            (512, 1, (16 << 20) + 1),
        ] {
            let json = start(memory, vcpus, disk);
            let err = hostile(&json);
            assert!(err.to_string().contains("outside") || err.to_string().contains("invalid value"), "{json}: {err}");
        }
        for json in [
            format!(
                r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"suspended"}},"shape":{{"memory_mib":-1,"vcpus":1,"disk_mib":1}}}}"#
            ),
            format!(
                r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"suspended"}},"shape":{{"memory_mib":512.5,"vcpus":1,"disk_mib":1}}}}"#
            ),
            format!(r#"{{"op":"set_timer_slack","sandbox":"{SBX}","slack_ns":1000000001}}"#),
            format!(r#"{{"op":"set_timer_slack","sandbox":"{SBX}","slack_ns":0}}"#),
            r#"{"op":"publish_template","template":{"name":"base","version":0}}"#.to_string(),
            r#"{"op":"publish_template","template":{"name":"base","version":4294967296}}"#.to_string(),
        ] {
            hostile(&json);
        }
    }

    #[test]
    fn package_lists_are_bounded_and_hold_package_names_only() {
        let build = |packages: &str| {
            format!(
                r#"{{"op":"build_template","template":{{"name":"py","version":1}},"source":{{"kind":"debian","suite":"bookworm","packages":[{packages}]}},"disk_mib":100}}"#
            )
        };
        assert!(decode_request(build(r#""python3""#).as_bytes()).is_ok());
        let many = (0..=MAX_PACKAGES).map(|i| format!("\"p{i}\"")).collect::<Vec<_>>().join(",");
        for packages in
            ["", r#""python3","python3""#, &many, r#""--allow-unauthenticated""#, r#""a b""#, r#""pkg;rm -rf /""#]
        {
            hostile(&build(packages));
        }
        for suite in ["../../etc", "bookworm main", "-o", ""] {
            let json = format!(
                r#"{{"op":"build_template","template":{{"name":"py","version":1}},"source":{{"kind":"debian","suite":"{suite}","packages":["python3"]}},"disk_mib":100}}"#
            );
            hostile(&json);
        }
    }

    #[test]
    fn a_hello_in_another_version_is_refused() {
        assert!(decode_request(br#"{"op":"hello","version":1}"#).is_ok());
        let err = hostile(r#"{"op":"hello","version":2}"#);
        assert!(err.to_string().contains("protocol version 2"), "{err}");
    }

    #[test]
    fn a_refused_text_is_not_echoed_whole() {
        let long = format!("sbx_{}", "a".repeat(10_000));
        let err = SandboxId::parse(&long).unwrap_err().to_string();
        assert!(err.len() < 200, "{err}");
    }

    #[test]
    fn an_archive_build_carries_one_descriptor_and_nothing_else_does() {
        for request in every_request() {
            let expected = usize::from(matches!(
                request,
                Request::BuildTemplate { source: BuildSource::OciArchive {} | BuildSource::RootTar {}, .. }
            ));
            assert_eq!(request.fds(), expected, "{request:?}");
            assert!(request.fds() <= MAX_FDS);
        }
    }
}
