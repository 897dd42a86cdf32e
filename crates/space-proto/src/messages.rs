//! The JSON messages carried by control frames.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The agent's first words after it connects.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    pub protocol_version: u32,
    pub agent_version: String,
    /// The agent's pid inside the sandbox (1 when it is init).
    pub pid: u32,
    /// The agent dials again after a quiesce (its commands kept running).
    pub reconnect: bool,
    /// The channel key the host gave this agent at its first handshake
    /// (kept only in the agent's memory): on a redial it proves the
    /// connection is the sandbox's agent, not another process inside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel_key: Option<String>,
    /// On a redial: the command streams the agent still serves (their
    /// process runs, or its end is yet to be sent). A host takes over only
    /// these; a command that ended meanwhile has no stream to follow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streams: Option<Vec<u32>>,
    /// On a redial: the highest stream number the host side opened so far.
    /// A host picks new numbers past it: a frame still owed to a stream that
    /// ended (an exit sent while no host listened) follows the handshake,
    /// and must not reach a new request that got the same number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stream: Option<u32>,
}

/// The sandbox's identity, sent by the host in answer to [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Welcome {
    pub protocol_version: u32,
    pub sandbox_id: String,
    pub hostname: String,
    /// Environment every command starts with (the sandbox's env).
    pub env: BTreeMap<String, String>,
    /// The template's working directory for commands that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The template's user for commands that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The sandbox's memory: each command's address space is capped at it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// Identifies the host's side of the channel. A new value means a new
    /// host session (the server restarted): streams of the old one are
    /// dropped; the same value after a quiesce means carry on.
    pub session: u64,
    /// The host's wall clock when it sent this (ms since the epoch): a
    /// microVM restored from a snapshot wakes with the clock it was saved
    /// with, and its agent sets the guest's clock from this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_unix_ms: Option<u64>,
    /// A new channel key for the agent to present on every later dial;
    /// sent only on a connection the host trusts to be the agent (the
    /// first, before anything else ran in the sandbox). On the host's side,
    /// the key a redialing agent must present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel_key: Option<String>,
    /// The sandbox's egress CA (PEM): the agent adds it to the guest's
    /// trusted certificates, and points every command's TLS settings there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_pem: Option<String>,
    /// In a microVM: the volume drives the agent mounts before anything
    /// runs (under gVisor the runtime binds volumes itself: none here).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<GuestVolume>,
}

/// A volume drive of a microVM: the block device the host attached it as
/// (`vdb` onwards, in the order of the sandbox's mounts; `vda` is the
/// root) and where the agent mounts it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GuestVolume {
    pub device: String,
    pub path: String,
    pub read_only: bool,
}

impl Welcome {
    /// The identity of `sandbox_id` under `hostname` in this protocol's
    /// version, with nothing else: no environment, defaults, memory cap,
    /// key or CA, and session `session`.
    pub fn plain(sandbox_id: impl Into<String>, hostname: impl Into<String>, session: u64) -> Welcome {
        Welcome {
            protocol_version: crate::PROTOCOL_VERSION,
            sandbox_id: sandbox_id.into(),
            hostname: hostname.into(),
            env: BTreeMap::new(),
            workdir: None,
            user: None,
            memory_mib: None,
            session,
            clock_unix_ms: None,
            channel_key: None,
            trust_pem: None,
            volumes: Vec::new(),
        }
    }
}

/// What a sandbox taken from a warm pool becomes when it is handed out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Replaces the environment every command starts with.
    pub env: BTreeMap<String, String>,
    /// Fresh random bytes (hex) mixed into the guest's entropy pool, so
    /// sandboxes started alike never share random state.
    pub entropy_hex: String,
    /// The sandbox's egress CA (as in [`Welcome`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_pem: Option<String>,
}

/// Start a process in the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Program and arguments; `argv[0]` is looked up in `PATH` when it has no `/`.
    pub argv: Vec<String>,
    /// Added to (and overriding) the sandbox's env.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; the user's home when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// User name or numeric uid; root when absent.
    #[serde(default)]
    pub user: Option<String>,
    /// Keep stdin open for [`crate::FrameKind::Stdin`] frames.
    #[serde(default)]
    pub stdin: bool,
    /// Run on a pseudo-terminal (stdout and stderr merged, stdin open).
    #[serde(default)]
    pub tty: bool,
}

/// A terminal size, for [`crate::FrameKind::Resize`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TerminalSize {
    pub cols: u16,
    pub rows: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Started {
    pub pid: u32,
}

/// Why a process could not be started.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ExecFailure {
    /// `argv[0]` does not exist (or is not in `PATH`).
    NotFound,
    /// `argv[0]` exists but cannot be executed.
    PermissionDenied,
    /// The working directory does not exist or is not a directory.
    BadCwd,
    /// The user does not exist in the sandbox.
    BadUser,
    /// The request itself is unusable (for example an empty argv).
    Invalid,
    /// Anything else the kernel refused.
    Spawn,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ExecFailed {
    pub reason: ExecFailure,
    pub message: String,
}

/// How the process ended. Exactly one of the two fields is set.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Exited {
    pub exit_code: Option<i32>,
    /// Signal number that killed it.
    pub signal: Option<i32>,
    /// The agent killed it (or a process of its group) because the sandbox
    /// ran out of memory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub oom_killed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProtocolErrorMessage {
    pub message: String,
}

/// A file operation on a path inside the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct FileRequest {
    /// Absolute path, resolved inside the sandbox.
    pub path: String,
    /// For writes: the file's permission bits.
    #[serde(default)]
    pub mode: Option<u32>,
    /// For deletes: remove a directory and everything in it.
    #[serde(default)]
    pub recursive: bool,
    /// For reads and writes of a directory: the bytes are a tar archive of it.
    #[serde(default)]
    pub tar: bool,
    /// For writes: the account (a name in the sandbox's `/etc/passwd`)
    /// given the file and the directories the write makes; root's when
    /// absent. A file replaced keeps its owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// For writes of a file: truncate and write it where it is, as a
    /// program in the sandbox would (one create, one write, watchers see
    /// the file's own name), instead of writing a new file beside it and
    /// renaming it over (readers never see half a file).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileInfo {
    pub size: u64,
    pub mode: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DirEntry {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    pub mode: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    /// The owning user's and group's names (numbers when unnamed); absent
    /// from an agent older than them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// For a symlink: where it points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileListing {
    pub entries: Vec<DirEntry>,
}

/// What a [`PathRequest`] does.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PathOpKind {
    /// Describe the path (a symlink itself, not its target).
    Stat,
    /// Make a directory and its missing parents; `Exists` if it was there.
    Mkdir,
    /// Rename `path` to `to`, replacing a file there.
    Move,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PathRequest {
    pub op: PathOpKind,
    /// Absolute path, resolved inside the sandbox.
    pub path: String,
    /// For a move: where to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// For a mkdir: the account given the directories made (see
    /// [`FileRequest::owner`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// A path as `ls -l` would show it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PathInfo {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    pub owner: String,
    pub group: String,
    /// For a symlink: where it points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// Why a file operation failed.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FileFailure {
    NotFound,
    PermissionDenied,
    /// A directory where a file was needed, or the other way round.
    WrongType,
    /// A non-empty directory without `recursive`.
    NotEmpty,
    Invalid,
    Io,
    /// Something is already at the path.
    Exists,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileError {
    pub reason: FileFailure,
    pub message: String,
}
