//! The public API's wire types (see `shared/API.md`).
//!
//! Request types are `deny_unknown_fields`: a typo in a request is an error,
//! never silently ignored. These types carry no validation logic; the server
//! converts them into its own validated domain types.

pub mod cluster;
pub mod e2b;
mod time;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use self::time::Timestamp;

/// The body of every non-2xx response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable and stable: one of [`ErrorCode`]'s names.
    pub code: ErrorCode,
    /// Human-readable explanation.
    pub message: String,
    #[schema(value_type = Object)]
    pub details: serde_json::Value,
}

/// Defines [`ErrorCode`] from one list: each code's wire name and status
/// are written once, and `ALL`, `as_str` and `http_status` cannot miss one.
macro_rules! error_codes {
    ($($(#[doc = $doc:literal])* $name:ident = ($wire:literal, $status:literal),)*) => {
        /// Every error code the API answers with. The wire form is the
        /// snake_case name (`not_found`, `invalid_state`, …) and never
        /// changes once released; each code is always answered with the same
        /// HTTP status ([`ErrorCode::http_status`]). A client should treat a
        /// code it does not know by its status.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum ErrorCode {
            $($(#[doc = $doc])* $name,)*
        }

        impl ErrorCode {
            /// Every code, in the order of their statuses.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name,)*];

            /// The HTTP status this code is answered with.
            pub fn http_status(self) -> u16 {
                match self {
                    $(ErrorCode::$name => $status,)*
                }
            }

            /// The code as it appears on the wire.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$name => $wire,)*
                }
            }

            /// What the code means, for documents (its doc comment).
            pub fn meaning(self) -> &'static str {
                match self {
                    $(ErrorCode::$name => concat!($($doc),*).trim_ascii_start(),)*
                }
            }
        }
    };
}

error_codes! {
    /// The request is malformed: a missing or unknown field, a bad query or path parameter.
    InvalidRequest = ("invalid_request", 400),
    /// The body is not JSON, or not of the expected shape.
    MalformedJson = ("malformed_json", 400),
    /// No API key, or one that is not valid.
    Unauthorized = ("unauthorized", 401),
    /// The key is valid but may not do this (for example another tenant's usage).
    Forbidden = ("forbidden", 403),
    /// No such resource for this caller (`details.kind` and `details.id` name it); another tenant's resources are not found either.
    NotFound = ("not_found", 404),
    /// No template of that name.
    TemplateNotFound = ("template_not_found", 404),
    /// No checkpoint of that name in this sandbox.
    CheckpointNotFound = ("checkpoint_not_found", 404),
    /// No such file or directory inside the sandbox.
    FileNotFound = ("file_not_found", 404),
    /// No volume of that name for this caller (another tenant's volumes are not found either).
    VolumeNotFound = ("volume_not_found", 404),
    /// No snapshot of that name of this volume.
    SnapshotNotFound = ("snapshot_not_found", 404),
    /// The path exists, but not with this method.
    MethodNotAllowed = ("method_not_allowed", 405),
    /// The resource is not in a state that allows this (`details.state` says which); for example exec in a paused sandbox.
    InvalidState = ("invalid_state", 409),
    /// A build of this template is already running.
    BuildInProgress = ("build_in_progress", 409),
    /// The name is already in use.
    NameTaken = ("name_taken", 409),
    /// Sandboxes or builds still use this template.
    TemplateInUse = ("template_in_use", 409),
    /// A checkpoint of that name already exists.
    CheckpointExists = ("checkpoint_exists", 409),
    /// The checkpoint is being written or restored.
    CheckpointInUse = ("checkpoint_in_use", 409),
    /// The code context is running other code.
    ContextBusy = ("context_busy", 409),
    /// The code context's interpreter has ended.
    ContextDead = ("context_dead", 409),
    /// This sandbox's engine or template cannot do this.
    NotSupported = ("not_supported", 409),
    /// The directory is not empty.
    DirectoryNotEmpty = ("directory_not_empty", 409),
    /// A file of that name already exists.
    AlreadyExists = ("already_exists", 409),
    /// A sandbox mounts the volume in a way that refuses this (`details.sandbox_id` names the holder): a second read-write mount, a delete, a restore or a move while it is mounted, a write through the files routes while a sandbox mounts it read-write.
    VolumeInUse = ("volume_in_use", 409),
    /// The body, or what it unpacks to, is larger than allowed.
    TooLarge = ("too_large", 413),
    /// The body's content type is not one this route takes.
    UnsupportedMediaType = ("unsupported_media_type", 415),
    /// A field is well formed but its value is not acceptable (`details.field` names it when known).
    InvalidValue = ("invalid_value", 422),
    /// The template build failed; the message says at which step.
    BuildFailed = ("build_failed", 422),
    /// The image named cannot be pulled: no such image or tag, credentials refused, no linux/amd64 manifest, a format not supported, or a registry address the server may not reach.
    ImageUnavailable = ("image_unavailable", 422),
    /// The network policy asks for egress that the tenant or the host does not allow.
    EgressNotPermitted = ("egress_not_permitted", 422),
    /// The command's program does not exist in the sandbox.
    ExecutableNotFound = ("executable_not_found", 422),
    /// The sandbox's file permissions refuse this.
    PermissionDenied = ("permission_denied", 422),
    /// The command's working directory does not exist.
    InvalidCwd = ("invalid_cwd", 422),
    /// The command's user does not exist in the sandbox.
    InvalidUser = ("invalid_user", 422),
    /// The command could not be started for another reason (the message says which).
    SpawnFailed = ("spawn_failed", 422),
    /// A file was expected and a directory found, or the other way round.
    WrongFileType = ("wrong_file_type", 422),
    /// The sandbox's filesystem failed the operation (for example it is full).
    IoError = ("io_error", 422),
    /// A tenant quota would be exceeded (`details.resource` names it).
    QuotaExceeded = ("quota_exceeded", 429),
    /// A fault of the server or the host; the details are in the server's log, never in the answer.
    Internal = ("internal", 500),
    /// The isolation engine failed to carry out a lifecycle step.
    EngineFailed = ("engine_failed", 500),
    /// The server stopped while the operation ran, and it could not be finished.
    Interrupted = ("interrupted", 500),
    /// A cluster route called on a server that is not part of a cluster.
    NotInClusterMode = ("not_in_cluster_mode", 501),
    /// The node holding the sandbox does not answer.
    NodeUnreachable = ("node_unreachable", 502),
    /// The registry an image was asked of does not answer, or answers outside its protocol.
    RegistryUnreachable = ("registry_unreachable", 502),
    /// Nothing listens on that port inside the sandbox.
    PortClosed = ("port_closed", 502),
    /// The sandbox's port could not be reached.
    PortUnreachable = ("port_unreachable", 502),
    /// No engine can run this sandbox on this host now.
    EngineUnavailable = ("engine_unavailable", 503),
    /// The host cannot hold more sandboxes of this size now.
    Capacity = ("capacity", 503),
    /// The host's disk is below its reserve.
    InsufficientStorage = ("insufficient_storage", 507),
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    Paused,
    Suspending,
    Suspended,
    Resuming,
    Deleting,
    Deleted,
    Failed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Suspending => "suspending",
            SandboxState::Suspended => "suspended",
            SandboxState::Resuming => "resuming",
            SandboxState::Deleting => "deleting",
            SandboxState::Deleted => "deleted",
            SandboxState::Failed => "failed",
        }
    }

    pub fn parse(text: &str) -> Option<SandboxState> {
        serde_json::from_value(serde_json::Value::String(text.to_string())).ok()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnIdle {
    Pause,
    Suspend,
    Delete,
    None,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Lifecycle {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lifetime_s: Option<u64>,
    /// Whether the server may pause the sandbox while it is idle (no
    /// command running, no request for the server's `--auto-pause-s`) and
    /// resume it on the next command or file request, before serving it.
    /// Default true; false keeps it running (background processes of
    /// finished commands, such as a server, keep running while idle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause: Option<bool>,
}

/// What a sandbox may reach outside: `none`, what `allow` lists
/// (`allowlist`), or every public address (`public`); `deny` wins over
/// both, and internal addresses are never reachable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    #[default]
    None,
    Allowlist,
    Public,
}

/// A sandbox's network: no device inside; egress through the host's
/// gateway (the proxy at `127.0.0.1:3128` in the sandbox).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Network {
    pub egress: Egress,
    /// `host`, `*.suffix` (subdomains), an IP or a CIDR, each with optional
    /// `:port[,port]` (default 80 and 443). Only with `allowlist`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// The same forms; without ports a rule covers every port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
    /// Credentials the gateway adds to requests, by the environment
    /// variable that holds the placeholder inside the sandbox. Their hosts
    /// are allowed (port 443) and their HTTPS is inspected.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, SecretBinding>,
}

/// One tenant secret bound into a sandbox: the sandbox holds only a
/// placeholder, which the gateway replaces with the value on HTTPS
/// requests to `hosts` (and refuses to send anywhere else).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretBinding {
    /// The secret's name (`PUT /v1/secrets/{name}`).
    pub secret: String,
    /// Hosts (`host` or `*.suffix`) it may go to; within the secret's own
    /// hosts, which are the default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Headers the gateway sets on every request to those hosts, `{secret}`
    /// standing for the value (`{"x-api-key": "{secret}"}`), besides
    /// replacing the placeholder wherever a header carries it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set_header: BTreeMap<String, String>,
    /// The placeholder in the sandbox's environment (set by the server; a
    /// request may only send back the one it was given, else 422).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placeholder: Option<String>,
}

/// `PUT /v1/secrets/{name}`: write-only; the value is never returned.
#[derive(Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutSecretRequest {
    pub value: String,
    /// Hosts (`host` or `*.suffix`) the secret may ever be sent to.
    pub hosts: Vec<String>,
}

impl std::fmt::Debug for PutSecretRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutSecretRequest").field("value", &"<redacted>").field("hosts", &self.hosts).finish()
    }
}

/// A secret as the API shows it: never its value.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SecretInfo {
    pub name: String,
    pub hosts: Vec<String>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

/// `GET /v1/secrets`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SecretList {
    pub secrets: Vec<SecretInfo>,
}

/// One connection a sandbox made through the egress gateway.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EgressEvent {
    pub at: Timestamp,
    /// `connect` (a tunnel) or `http` (a forwarded request).
    pub via: String,
    pub host: String,
    pub port: u16,
    /// `allowed` or `denied`.
    pub decision: String,
    /// Why it was denied: `egress_disabled`, `not_allowed`,
    /// `port_not_allowed`, `denied_rule`, `internal_address`,
    /// `not_resolved`, `bad_request`, `limit`, `unreachable`, `not_tls`,
    /// `sni_mismatch`, `idle`, `policy_changed`, `secret_not_for_host`,
    /// `wrong_host`, `ambiguous_request` (two `Host`s or two framings of
    /// one request), `encoded_answer` (a host a secret is bound to answered
    /// compressed), `secret_unavailable`, `upstream_tls`.
    pub reason: Option<String>,
    /// The allow rule that let it through (none under `public`).
    pub rule: Option<String>,
    /// The address the gateway dialed.
    pub address: Option<String>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration_ms: u64,
    /// The gateway terminated its TLS (a host a secret is bound to).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inspected: bool,
    /// Requests seen inside an inspected connection.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub requests: u64,
    /// Names (never values) of the secrets the gateway added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `GET /v1/sandboxes/{id}/egress`: the newest events last.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EgressLog {
    pub events: Vec<EgressEvent>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    pub template: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u32>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<Lifecycle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Volumes of the tenant to mount (at most [`MAX_MOUNTS`]), each at
    /// its own absolute path; any number read-only, one read-write mount
    /// of a volume at a time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// Volumes one sandbox may mount.
pub const MAX_MOUNTS: usize = 16;

/// One volume mounted into a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume's name.
    pub name: String,
    /// Where it appears: an absolute path, not `/` and not under `/proc`,
    /// `/sys`, `/dev` or `/.space`, without `.` or `..` components.
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// 1-63 of `a-z`, `0-9`, `-`, `_`, starting with a letter or digit;
    /// unique among the tenant's volumes.
    pub name: String,
    /// Its size quota: writes past it fail with `EDQUOT` inside a sandbox
    /// and 422 `io_error` through the files routes. Counted in full
    /// against the tenant's disk quota. Default 1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_mib: Option<u32>,
    /// Start as a copy-on-write copy of one of the tenant's volume snapshots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<SnapshotRef>,
}

/// A snapshot of one of the caller's volumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRef {
    pub volume: String,
    pub snapshot: String,
}

/// Storage that outlives sandboxes: a directory tree with a size quota,
/// mounted into sandboxes at create.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Volume {
    pub name: String,
    pub size_mib: u32,
    /// What its files hold on disk now.
    pub used_bytes: u64,
    pub created_at: Timestamp,
    /// The live sandboxes (running, paused or suspended) that mount it.
    pub mounted_by: Vec<VolumeHolder>,
    /// Its snapshots, oldest first.
    pub snapshots: Vec<VolumeSnapshot>,
    /// The snapshot it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<SnapshotRef>,
    /// In a cluster: the node that holds it (sandboxes that mount it are
    /// placed there). Absent on a single server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// A sandbox that mounts a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VolumeHolder {
    pub sandbox_id: String,
    pub path: String,
    pub read_only: bool,
}

/// `GET /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeList {
    pub volumes: Vec<Volume>,
}

/// `POST /v1/volumes/{name}/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeSnapshotRequest {
    /// 1-63 of `a-z`, `0-9`, `-`, `_`; unique within the volume.
    pub name: String,
}

/// A volume's files at one instant, read-only, kept until deleted (a
/// copy-on-write snapshot: it holds on disk only what changed since).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeSnapshot {
    pub name: String,
    pub volume: String,
    pub created_at: Timestamp,
    /// What only it holds on disk (counted against the tenant's disk quota).
    pub size_bytes: u64,
}

/// `GET /v1/volumes/{name}/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeSnapshotList {
    pub snapshots: Vec<VolumeSnapshot>,
}

/// `POST /v1/volumes/{name}/move` (a cluster only).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveVolumeRequest {
    /// The node to move it to.
    pub node: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub state: SandboxState,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub labels: BTreeMap<String, String>,
    /// The isolation engine running it: `gvisor` or `firecracker`.
    pub engine: String,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub lifecycle: Lifecycle,
    pub network: Network,
    pub last_activity_at: Timestamp,
    /// Paused by the server because it was idle (not by a client): the
    /// next command or file request resumes it first, transparently.
    #[serde(default)]
    pub auto_paused: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// The sandbox this one is a fork of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
    /// In a cluster: the node that holds it (its forks are on the same
    /// node). Absent on a single server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The volumes it mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// `POST /v1/sandboxes/{id}/checkpoints`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCheckpointRequest {
    /// 1-63 of `a-z`, `0-9`, `-`, `_`; unique within the sandbox.
    pub name: String,
}

/// A sandbox's memory, processes and disk saved at one instant, without
/// stopping it; restoring it rolls the sandbox back.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Checkpoint {
    pub name: String,
    pub sandbox_id: String,
    pub created_at: Timestamp,
    /// What it holds on the host: its memory image and the disk only it
    /// still keeps (counted against the tenant's disk quota).
    pub size_bytes: u64,
    /// The commands that were running when it was saved: after a restore
    /// their processes run again, as new commands.
    pub commands: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CheckpointList {
    pub checkpoints: Vec<Checkpoint>,
}

/// Checkpoints a sandbox may keep at once.
pub const MAX_CHECKPOINTS: usize = 32;

/// `POST /v1/sandboxes/{id}/contexts`: an interpreter kept alive in the
/// sandbox, whose state (variables, imports) carries from run to run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateContextRequest {
    /// `python` (IPython's shell; the default), `javascript` (Node.js),
    /// `typescript` (Node.js, each cell transpiled first) or `bash`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// Its working directory (the template's by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Environment of the interpreter, over the sandbox's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// A code context: an interpreter kept alive in a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CodeContext {
    pub id: String,
    pub sandbox_id: String,
    pub language: String,
    /// Its working directory when it started (as given, else the template's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// `starting`, `ready`, `busy` (a run is going on), or `dead` (the
    /// interpreter exited: restart it).
    pub state: String,
    pub created_at: Timestamp,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CodeContextList {
    pub contexts: Vec<CodeContext>,
}

/// `POST /v1/sandboxes/{id}/contexts/{cid}/run`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeRequest {
    pub code: String,
    /// Interrupt the run after this many seconds (the context stays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// Environment for this run only, over the context's (restored when
    /// the run ends; bash takes names of letters, digits and `_`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// Forks made at once, at most.
pub const MAX_FORKS: u32 = 16;

/// `POST /v1/sandboxes/{id}/fork`: copies of a running sandbox (memory,
/// processes, disk) at one instant.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many forks (1 to 16; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// Labels of the forks, over the source's.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// The answer to a fork: the new sandboxes (`creating`) and the one
/// operation that makes them.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkAccepted {
    pub sandboxes: Vec<Sandbox>,
    pub operation: Operation,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// Every lifecycle call answers with the sandbox and the operation it started.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxOperation {
    pub sandbox: Sandbox,
    pub operation: Operation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationKind {
    Create,
    Pause,
    Resume,
    Suspend,
    Delete,
    /// Building a template.
    BuildTemplate,
    /// Forking a sandbox (the operation's `sandbox_id` is the source).
    Fork,
    /// Saving a checkpoint of a sandbox (named in `checkpoint`).
    Checkpoint,
    /// Rolling a sandbox back to its checkpoint (named in `checkpoint`).
    RestoreCheckpoint,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationState {
    Pending,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl OperationState {
    pub fn is_terminal(self) -> bool {
        matches!(self, OperationState::Succeeded | OperationState::Failed | OperationState::Cancelled)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Progress {
    pub step: String,
    /// Steps done of `total`.
    pub done: u64,
    pub total: u64,
    /// How much of the current step's work is done, when it is measured
    /// (bytes of an image's layers, packages of a Debian build).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount: Option<ProgressAmount>,
    /// The steps ended so far and how long each took, in order (a create's
    /// engine start in its parts: root snapshot, runsc, handshake, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timings: Vec<StepTiming>,
}

impl Progress {
    pub fn new(step: impl Into<String>, done: u64, total: u64) -> Progress {
        Progress { step: step.into(), done, total, amount: None, timings: Vec::new() }
    }
}

/// One ended step of an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepTiming {
    pub step: String,
    /// Milliseconds it took (to a tenth).
    pub ms: f64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ProgressAmount {
    /// `bytes` or `packages`.
    pub unit: String,
    pub done: u64,
    pub total: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Operation {
    pub id: String,
    pub kind: OperationKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// The template a build operation makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    pub state: OperationState,
    pub progress: Progress,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
    /// A fork: the sandboxes it makes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forks: Vec<String>,
    /// A checkpoint's save or restore: the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// A fork or checkpoint: how long the sandbox was frozen while its
    /// memory and disk were saved (milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_ms: Option<u64>,
    /// Who asked for it.
    #[serde(default)]
    pub origin: OperationOrigin,
    pub created_at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
}

/// Who asked for an operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationOrigin {
    /// A client, through the API.
    #[default]
    Client,
    /// The sandbox's lifecycle policy (`idle_timeout_s`, `max_lifetime_s`).
    Policy,
    /// The server, pausing an idle sandbox (`auto_pause`).
    Idle,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OperationList {
    pub operations: Vec<Operation>,
}

/// `POST /v1/sandboxes/{id}/commands` and `/exec`: exactly one of `argv` and `cmd`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A shell string, run by `/bin/sh -c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Keep the command's stdin open for `.../stdin` and the attach
    /// WebSocket. Absent: `false`, or `true` with `tty` (a terminal is the
    /// command's stdin, so `false` with `"tty": true` is refused with 422).
    /// `/exec` refuses `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
    /// Run on a pseudo-terminal (its stdin, merged stdout and stderr);
    /// resizable. `/exec` refuses it: nothing could type into it.
    #[serde(default)]
    pub tty: bool,
    /// 0 or absent: no timeout.
    #[serde(default)]
    pub timeout_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CommandState {
    Running,
    Exited,
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ProcessResult {
    /// The exit code, or null when a signal ended it.
    pub exit_code: Option<i32>,
    /// The signal that ended it (`KILL`, `TERM`, …), or null.
    pub signal: Option<String>,
    pub timed_out: bool,
    /// The sandbox ran out of memory and the process (or one it started)
    /// was killed inside it to free memory; `signal` is then `KILL`.
    #[serde(default)]
    pub oom_killed: bool,
    pub duration_ms: u64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub finished_at: Timestamp,
    /// Set when the platform, not the process, ended the session (for
    /// example the sandbox failed); exit_code and signal are then null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Attach {
    pub output: String,
    pub stdin: String,
    pub ws: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Command {
    pub id: String,
    pub sandbox_id: String,
    pub state: CommandState,
    pub argv: Vec<String>,
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    pub started_at: Timestamp,
    pub attach: Attach,
    /// Whether its stdin is open (a terminal counts): writing to one that
    /// is not answers 409. Absent for a command recorded by an older server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
    /// Whether it runs on a terminal: resizing one that does not answers
    /// 409. Absent for a command recorded by an older server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ProcessResult>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CommandCreated {
    pub command: Command,
}

/// One sample of what a sandbox uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UsagePoint {
    pub at: Timestamp,
    /// Of its vCPUs together, since the sample before (0–100).
    pub cpu_percent: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
}

/// `GET /v1/sandboxes/{id}/metrics`: what a sandbox uses now, against its
/// limits, and a short history (every 5 s over the last 10 minutes while
/// it ran; kept in memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxUsage {
    pub sandbox_id: String,
    pub state: SandboxState,
    pub vcpus: u32,
    /// CPU time used by its engine's processes so far, in seconds.
    pub cpu_seconds: f64,
    pub cpu_percent: f64,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    /// Written by the sandbox into its own root.
    pub disk_bytes: u64,
    pub disk_quota_bytes: u64,
    /// Commands started in it, and those running now.
    pub commands: u64,
    pub commands_running: u64,
    pub history: Vec<UsagePoint>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CommandList {
    pub commands: Vec<Command>,
}

/// `POST /v1/sandboxes/{id}/exec`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExecResponse {
    pub command: Command,
    pub stdout: String,
    pub stderr: String,
    pub result: ProcessResult,
    /// True when stdout or stderr was cut to the exec limit; the whole
    /// output stays in the transcript.
    pub truncated: bool,
}

/// One line of `GET .../commands/{cid}/output`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputFrame {
    Stdout {
        /// Position of the first byte in the command's combined output.
        offset: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        /// The bytes, base64, when they are not valid UTF-8.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    Stderr {
        offset: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    Exit {
        result: ProcessResult,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EngineStatus {
    pub name: String,
    pub available: bool,
    /// Why it is (un)available.
    pub detail: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub version: String,
    /// The engine new sandboxes run on.
    pub engine: String,
    pub engines: Vec<EngineStatus>,
    pub kvm: KvmStatus,
    pub disk: DiskStatus,
    /// Live sandboxes a restarted server is still re-adopting (requests for
    /// them wait until it has).
    #[serde(default)]
    pub reconciling: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct KvmStatus {
    pub present: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DiskStatus {
    pub filesystem: String,
    pub free_bytes: u64,
    pub total_bytes: u64,
    /// Free space the host keeps: under it, creates, suspends, builds and
    /// uploads get 507 and output is counted instead of kept.
    #[serde(default)]
    pub reserve_bytes: u64,
}

/// A tenant's quotas (`null`: no limit beyond the host's).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct QuotaLimits {
    pub max_sandboxes: Option<u32>,
    pub max_vcpus: Option<u32>,
    pub max_memory_mib: Option<u64>,
    pub max_disk_mib: Option<u64>,
}

/// Host disk a tenant holds, by kind. `total_bytes` is what counts against
/// `max_disk_mib`: each root's `disk_mib` in full while its sandbox can
/// still write (what it holds once it cannot), plus the rest as measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DiskUsage {
    pub total_bytes: u64,
    /// The roots' `disk_mib`, reserved (a failed sandbox: what it holds).
    pub roots_reserved_bytes: u64,
    /// What the roots hold now (their own writes).
    pub roots_used_bytes: u64,
    /// Command output kept on the host.
    pub transcripts_bytes: u64,
    /// Suspended sandboxes' snapshots, checkpoints (their memory and the
    /// disk only they still hold) and images forks are being made from.
    pub snapshots_bytes: u64,
    /// The tenant's own templates (every version, and builds in progress).
    pub templates_bytes: u64,
    /// Image archives being uploaded.
    pub uploads_bytes: u64,
    /// The volumes' sizes, reserved (a volume over its size: what it holds).
    #[serde(default)]
    pub volumes_reserved_bytes: u64,
    /// What only the volumes' snapshots hold.
    #[serde(default)]
    pub volume_snapshots_bytes: u64,
}

/// What a tenant uses and may use: `GET /v1/usage`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub tenant: String,
    pub quotas: QuotaLimits,
    /// Sandboxes that hold resources (not deleted or failed).
    pub sandboxes: u32,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk: DiskUsage,
}

/// Runtime defaults of a template; sandboxes may override them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateDefaultsRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u32>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The network of sandboxes whose create names none (no secrets: those
    /// belong to a tenant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// The template's start command, recorded for its users (an image's
    /// `ENTRYPOINT` + `CMD` unless given): SPACE does not run it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
}

/// An image in an OCI registry: its reference alone, or with the tenant
/// secret that holds the registry's credential.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ImageSource {
    /// `registry.example/team/app:1.2`, `…@sha256:<hex>`, or a reference
    /// without a registry host when the operator set a default registry.
    Reference(String),
    WithAuth(ImageSourceWithAuth),
}

impl ImageSource {
    pub fn reference(&self) -> &str {
        match self {
            ImageSource::Reference(reference) => reference,
            ImageSource::WithAuth(detail) => &detail.reference,
        }
    }

    pub fn auth(&self) -> Option<&RegistryAuth> {
        match self {
            ImageSource::Reference(_) => None,
            ImageSource::WithAuth(detail) => detail.auth.as_ref(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageSourceWithAuth {
    pub reference: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<RegistryAuth>,
}

/// A registry credential: the name of a tenant secret (`PUT
/// /v1/secrets/{name}`) whose hosts cover the registry's host and, for a
/// token service, its host. With `username` the secret is the password
/// (Basic); without, the secret is a bearer token. The value is never
/// written to the template, its log or the operation.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryAuth {
    pub secret: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DebianSource {
    #[serde(default = "default_suite")]
    pub suite: String,
    pub packages: Vec<String>,
}

fn default_suite() -> String {
    "bookworm".into()
}

/// What a template is made from: exactly one of these.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateSource {
    /// Debian packages, installed into a fresh root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debian: Option<DebianSource>,
    /// A running (or paused) sandbox's id: a snapshot template, whose
    /// sandboxes start from its memory and disk as they are now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// One of a sandbox's checkpoints: a snapshot template of that state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointSource>,
    /// An image pulled from an OCI registry (linux/amd64); its config's
    /// env, working dir, user and start command become the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSource>,
}

/// A checkpoint, named by its sandbox and its name.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSource {
    pub sandbox: String,
    pub name: String,
}

/// `POST /v1/templates`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplateRequest {
    pub name: String,
    pub from: TemplateSource,
    #[serde(default)]
    pub defaults: TemplateDefaultsRequest,
    /// `gvisor` or `firecracker`: the engine its sandboxes run on, over the
    /// server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
}

/// Part `build` of `POST /v1/templates/builds` (multipart; part `context`,
/// a tar of the build context, follows it).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DockerfileBuildRequest {
    pub name: String,
    /// The Dockerfile's text.
    pub dockerfile: String,
    /// `--build-arg`s.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub build_args: BTreeMap<String, String>,
    /// The stage to build (the last one when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The network of the build's RUN steps (none when absent); the
    /// tenant's egress ceiling applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Over what the final stage's ENV, WORKDIR, USER, ENTRYPOINT and CMD give.
    #[serde(default)]
    pub defaults: TemplateDefaultsRequest,
    /// `gvisor` or `firecracker`: the engine its sandboxes run on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// The credential for the registry images `FROM` names: sent to those
    /// whose host is within the secret's hosts (the others are pulled
    /// anonymously).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_auth: Option<RegistryAuth>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TemplateState {
    Building,
    Ready,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateDefaults {
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// The start command recorded with the template (an image's
    /// `ENTRYPOINT` + `CMD`): not run by SPACE; run it with an exec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Template {
    pub name: String,
    pub state: TemplateState,
    /// The newest complete version (absent while the first one builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    #[schema(value_type = Object)]
    pub source: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defaults: Option<TemplateDefaults>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Timestamp>,
    /// The build in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub building_operation: Option<String>,
    /// The engine its sandboxes run on (absent: the server's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateOperation {
    pub template: Template,
    pub operation: Operation,
}

/// What an event says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub enum EventType {
    /// A sandbox was created or moved to another state (`sandbox`).
    #[serde(rename = "sandbox.state")]
    SandboxState,
    /// An operation was accepted or made progress (`operation`); template
    /// builds are operations of kind `build_template`.
    #[serde(rename = "operation.progress")]
    OperationProgress,
    /// An operation ended: succeeded, failed or cancelled (`operation`).
    #[serde(rename = "operation.finished")]
    OperationFinished,
    /// A command started (`command`).
    #[serde(rename = "command.started")]
    CommandStarted,
    /// A command ended; `command.result` says how.
    #[serde(rename = "command.exited")]
    CommandExited,
    /// Events before this one are no longer kept: a client resuming from an
    /// older id missed some (only ever the first item of a response).
    #[serde(rename = "gap")]
    Gap,
}

impl EventType {
    pub const ALL: [EventType; 6] = [
        EventType::SandboxState,
        EventType::OperationProgress,
        EventType::OperationFinished,
        EventType::CommandStarted,
        EventType::CommandExited,
        EventType::Gap,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::SandboxState => "sandbox.state",
            EventType::OperationProgress => "operation.progress",
            EventType::OperationFinished => "operation.finished",
            EventType::CommandStarted => "command.started",
            EventType::CommandExited => "command.exited",
            EventType::Gap => "gap",
        }
    }
}

/// One item of `GET /v1/events`: something that happened to one of the
/// tenant's sandboxes, operations or commands, with the object as it was
/// right after. Ids grow by one per event of the server (a tenant sees a
/// subset, so its ids have holes).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Event {
    pub id: u64,
    #[serde(rename = "type")]
    pub kind: EventType,
    pub at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<Operation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Command>,
}

/// Who may open a port of a sandbox on its preview host name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PortAccess {
    pub port: u16,
    /// Anyone with its URL (true), or only requests with the sandbox's
    /// preview token or a signed link's cookie (false, the default).
    pub public: bool,
    /// `{scheme}://{port}-{sandbox id}.{preview domain}/`; absent when the
    /// server has no preview domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// `PUT /v1/sandboxes/{id}/ports/{port}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PortAccessUpdate {
    pub public: bool,
}

/// `GET /v1/sandboxes/{id}/ports`: how the sandbox's ports are reached on
/// their preview host names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PortList {
    /// The server's preview domain (absent: previews are not served).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview_domain: Option<String>,
    /// The sandbox's preview token: sent as `X-Space-Preview-Token`, it
    /// opens any of its ports. A secret, like an API key.
    pub preview_token: String,
    /// Every port is public (an E2B sandbox created with public traffic).
    pub all_public: bool,
    /// The ports made public.
    pub ports: Vec<PortAccess>,
}

/// `GET /v1/sandboxes/{id}/ports/{port}/link`: a URL that lets a browser
/// into one port of the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PreviewLink {
    /// Opened before `expires_at`, it sets a cookie for the port's host
    /// alone and redirects to `/` there.
    pub url: String,
    pub expires_at: Timestamp,
    pub port: u16,
    pub public: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_are_their_wire_names_with_one_status_each() {
        let mut seen = std::collections::HashSet::new();
        for &code in ErrorCode::ALL {
            let wire = serde_json::to_value(code).unwrap();
            assert_eq!(wire, code.as_str(), "{code:?}");
            assert_eq!(serde_json::from_value::<ErrorCode>(wire).unwrap(), code);
            assert!((400..600).contains(&code.http_status()), "{code:?}");
            assert!(code.meaning().ends_with('.'), "{code:?} has no meaning");
            assert!(seen.insert(code.as_str()), "{code:?} twice");
        }
        assert!(serde_json::from_str::<ErrorCode>("\"no_such_code\"").is_err());
    }
}
