//! Validated domain types and the sandbox state machine.
//!
//! Wire types from `space-api` are converted here with `TryFrom`; handlers
//! and actors only ever see the validated forms.

use std::collections::BTreeMap;

use space_api::{
    CommandRequest, CreateSandboxRequest, Egress, Lifecycle, Network, OnIdle, OperationKind, SandboxState,
};
use space_egress::policy::{Binding, Mode, Policy, RuleError};
use space_host::template::TemplateDefaults;

use crate::error::NodeError;

pub const MAX_VCPUS: u32 = 64;
pub const MIN_MEMORY_MIB: u32 = 64;
pub const MAX_MEMORY_MIB: u32 = 256 * 1024;
pub const MIN_DISK_MIB: u32 = 64;
pub const MAX_DISK_MIB: u32 = 1024 * 1024;
const MAX_ENV_ENTRIES: usize = 256;
const MAX_ENV_BYTES: usize = 64 * 1024;
const MAX_LABELS: usize = 64;
const MAX_ARGV_BYTES: usize = 256 * 1024;
pub const MAX_TIMEOUT_S: u64 = 7 * 24 * 3600;

/// A create request checked against the template's defaults.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub lifecycle: Lifecycle,
    /// The request's network, else the template's; `None`: the tenant's
    /// default applies.
    pub network: Option<Network>,
    /// Volumes to mount (checked against the tenant's volumes at create).
    pub volumes: Vec<space_api::VolumeMount>,
}

/// 422 unless labels are few and short (keys 1-63 characters without
/// `=`, values at most 255).
pub fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), NodeError> {
    if labels.len() > MAX_LABELS {
        return Err(NodeError::unprocessable(format!("at most {MAX_LABELS} labels")));
    }
    for (key, value) in labels {
        if key.is_empty() || key.len() > 63 || value.len() > 255 || key.contains('=') {
            return Err(NodeError::unprocessable(format!(
                "label {key:?}: keys are 1-63 characters without '=', values at most 255"
            ))
            .with_details(serde_json::json!({"field": "labels"})));
        }
    }
    Ok(())
}

impl CreateSpec {
    /// Validates `request`, filling gaps from the template's defaults.
    pub fn new(request: CreateSandboxRequest, defaults: &TemplateDefaults) -> Result<CreateSpec, NodeError> {
        let vcpus = request.vcpus.unwrap_or(defaults.vcpus);
        let memory_mib = request.memory_mib.unwrap_or(defaults.memory_mib);
        let disk_mib = request.disk_mib.unwrap_or(defaults.disk_mib);
        in_range("vcpus", vcpus, 1, MAX_VCPUS)?;
        in_range("memory_mib", memory_mib, MIN_MEMORY_MIB, MAX_MEMORY_MIB)?;
        in_range("disk_mib", disk_mib, MIN_DISK_MIB, MAX_DISK_MIB)?;
        validate_env(&request.env)?;
        // A variable is either the request's or a secret's placeholder: one
        // would silently replace the other.
        let bound = request.network.iter().flat_map(|network| network.secrets.keys());
        if let Some(var) = bound.into_iter().find(|var| request.env.contains_key(*var)) {
            return Err(NodeError::unprocessable(format!(
                "env.{var} is also the variable of a secret binding (network.secrets.{var}); give it one of the two"
            ))
            .with_details(serde_json::json!({"field": "env"})));
        }
        // A value that looks like a placeholder would be taken for one (and
        // dropped once no binding names its variable).
        if let Some(var) = request.env.iter().find(|(_, v)| v.starts_with(PLACEHOLDER_PREFIX)) {
            return Err(NodeError::unprocessable(format!(
                "env.{}: values starting with {:?} are the server's placeholders",
                var.0, PLACEHOLDER_PREFIX
            ))
            .with_details(serde_json::json!({"field": "env"})));
        }
        let mut env = defaults.env.clone();
        env.extend(request.env);
        check_labels(&request.labels)?;
        let lifecycle = request.lifecycle.unwrap_or(Lifecycle {
            idle_timeout_s: None,
            on_idle: Some(OnIdle::None),
            max_lifetime_s: None,
            auto_pause: None,
        });
        // Each of the two means nothing without the other.
        match (lifecycle.idle_timeout_s, lifecycle.on_idle) {
            (Some(_), None) => {
                return Err(NodeError::unprocessable("lifecycle.idle_timeout_s needs lifecycle.on_idle")
                    .with_details(serde_json::json!({"field": "lifecycle.on_idle"})))
            }
            (None, Some(on_idle)) if on_idle != OnIdle::None => {
                return Err(NodeError::unprocessable("lifecycle.on_idle needs lifecycle.idle_timeout_s")
                    .with_details(serde_json::json!({"field": "lifecycle.idle_timeout_s"})))
            }
            _ => {}
        }
        Ok(CreateSpec {
            template: request.template,
            vcpus,
            memory_mib,
            disk_mib,
            env,
            labels: request.labels,
            lifecycle,
            volumes: request.volumes,
            network: match request.network {
                Some(network) => Some(checked_network(network)?),
                // A template's network that does not read is a bug to see,
                // never a reason to fall back to a more open one.
                None => match defaults.network.clone() {
                    Some(network) => Some(
                        serde_json::from_value(network)
                            .map_err(|e| NodeError::internal("reading the template's network", e))?,
                    ),
                    None => None,
                },
            },
        })
    }
}

/// A network whose rules all read (422 naming the bad rule otherwise).
pub fn checked_network(network: Network) -> Result<Network, NodeError> {
    policy_of(&network).map_err(|err| {
        NodeError::unprocessable(err.to_string()).with_details(serde_json::json!({"field": "network"}))
    })?;
    Ok(network)
}

fn in_range(field: &str, value: u32, min: u32, max: u32) -> Result<(), NodeError> {
    if value < min || value > max {
        return Err(NodeError::unprocessable(format!("{field} must be between {min} and {max}, got {value}"))
            .with_details(serde_json::json!({"field": field, "min": min, "max": max})));
    }
    Ok(())
}

pub fn validate_env(env: &BTreeMap<String, String>) -> Result<(), NodeError> {
    if env.len() > MAX_ENV_ENTRIES {
        return Err(NodeError::unprocessable(format!("at most {MAX_ENV_ENTRIES} environment variables")));
    }
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_ENV_BYTES {
        return Err(NodeError::unprocessable(format!("the environment may hold at most {MAX_ENV_BYTES} bytes")));
    }
    for (key, value) in env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(NodeError::unprocessable(format!(
                "environment variable {key:?}: names are non-empty without '=' or NUL; values without NUL"
            ))
            .with_details(serde_json::json!({"field": "env"})));
        }
    }
    Ok(())
}

/// A command request, validated.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// Its stdin stays open: asked for, or it runs on a terminal.
    pub stdin: bool,
    pub tty: bool,
    pub timeout_s: u64,
    pub tag: Option<String>,
}

impl TryFrom<CommandRequest> for CommandSpec {
    type Error = NodeError;

    fn try_from(request: CommandRequest) -> Result<CommandSpec, NodeError> {
        let argv = match (request.argv, request.cmd) {
            (Some(argv), None) => argv,
            (None, Some(cmd)) => vec!["/bin/sh".to_string(), "-c".to_string(), cmd],
            (Some(_), Some(_)) => return Err(NodeError::bad_request("give either argv or cmd, not both")),
            (None, None) => return Err(NodeError::bad_request("give argv (a list) or cmd (a shell string)")),
        };
        if argv.first().is_none_or(|p| p.is_empty()) {
            return Err(NodeError::unprocessable("argv must name a program"));
        }
        if argv.iter().any(|a| a.contains('\0')) || argv.iter().map(String::len).sum::<usize>() > MAX_ARGV_BYTES {
            return Err(NodeError::unprocessable(format!(
                "argv must hold no NUL bytes and at most {MAX_ARGV_BYTES} bytes"
            )));
        }
        validate_env(&request.env)?;
        if let Some(cwd) = &request.cwd {
            if !cwd.starts_with('/') || cwd.contains('\0') {
                return Err(NodeError::bad_request(format!("cwd must be an absolute path, got {cwd:?}")));
            }
        }
        if request.timeout_s > MAX_TIMEOUT_S {
            return Err(NodeError::unprocessable(format!("timeout_s may be at most {MAX_TIMEOUT_S}")));
        }
        if request.tag.as_ref().is_some_and(|t| t.len() > 128) {
            return Err(NodeError::unprocessable("tag may be at most 128 bytes"));
        }
        // The agent makes the terminal the process's stdin: a closed stdin
        // on a terminal cannot be had, so asking for one is refused.
        let stdin = match (request.stdin, request.tty) {
            (Some(false), true) => {
                return Err(NodeError::unprocessable(
                    "a terminal is the command's stdin: leave stdin out (or true) with \"tty\": true",
                )
                .with_details(serde_json::json!({"field": "stdin"})))
            }
            (stdin, tty) => stdin.unwrap_or(false) || tty,
        };
        Ok(CommandSpec {
            argv,
            env: request.env,
            cwd: request.cwd,
            user: request.user,
            stdin,
            tty: request.tty,
            timeout_s: request.timeout_s,
            tag: request.tag,
        })
    }
}

/// What happens to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The engine started it and its agent answered.
    Started,
    /// A delete was accepted.
    DeleteRequested,
    /// The engine freed everything.
    Destroyed,
    /// The engine froze it, memory kept.
    Froze,
    /// The engine thawed a paused sandbox.
    Thawed,
    /// A suspend was accepted.
    SuspendRequested,
    /// The snapshot is on disk and no engine process is left.
    Checkpointed,
    /// A resume of a suspended sandbox was accepted.
    RestoreRequested,
    /// The sandbox runs again from its snapshot (or checkpoint).
    Restored,
    /// A roll back to one of its checkpoints was accepted.
    RewindRequested,
    /// A transition a server restart interrupted was undone (the engine
    /// shows the sandbox as it was before it): the request is carried out
    /// again.
    RolledBack,
    /// Something went wrong beyond repair.
    Failure,
}

/// The sandbox state machine. Every (state, event) pair is decided here.
pub fn transition(from: SandboxState, event: Event) -> Result<SandboxState, NodeError> {
    use Event::*;
    use SandboxState::*;
    let to = match (from, event) {
        (Creating, Started) => Some(Running),
        (Running | Paused | Suspended | Resuming | Suspending | Deleting | Deleted | Failed, Started) => None,
        (Creating | Running | Paused | Suspending | Suspended | Resuming | Failed, DeleteRequested) => Some(Deleting),
        (Deleting, DeleteRequested) => Some(Deleting),
        (Deleted, DeleteRequested) => Some(Deleted),
        (Deleting, Destroyed) => Some(Deleted),
        (Creating | Running | Paused | Suspending | Suspended | Resuming | Deleted | Failed, Destroyed) => None,
        (Creating | Running | Paused | Suspending | Suspended | Resuming | Deleting, Failure) => Some(Failed),
        (Deleted | Failed, Failure) => None,
        (Running, Froze) => Some(Paused),
        (Creating | Paused | Suspending | Suspended | Resuming | Deleting | Deleted | Failed, Froze) => None,
        (Paused, Thawed) => Some(Running),
        (Creating | Running | Suspending | Suspended | Resuming | Deleting | Deleted | Failed, Thawed) => None,
        (Running | Paused, SuspendRequested) => Some(Suspending),
        (Creating | Suspending | Suspended | Resuming | Deleting | Deleted | Failed, SuspendRequested) => None,
        (Suspending, Checkpointed) => Some(Suspended),
        (Creating | Running | Paused | Suspended | Resuming | Deleting | Deleted | Failed, Checkpointed) => None,
        (Suspended, RestoreRequested) => Some(Resuming),
        (Creating | Running | Paused | Suspending | Resuming | Deleting | Deleted | Failed, RestoreRequested) => None,
        (Running | Paused | Suspended, RewindRequested) => Some(Resuming),
        (Creating | Suspending | Resuming | Deleting | Deleted | Failed, RewindRequested) => None,
        (Resuming, Restored) => Some(Running),
        (Creating | Running | Paused | Suspending | Suspended | Deleting | Deleted | Failed, Restored) => None,
        (Suspending, RolledBack) => Some(Running),
        (Resuming, RolledBack) => Some(Suspended),
        (Creating | Running | Paused | Suspended | Deleting | Deleted | Failed, RolledBack) => None,
    };
    to.ok_or_else(|| NodeError::invalid_state("sandbox", from.as_str(), action_name(event)))
}

/// What a user asked for when `event` is the outcome, in words.
pub fn action_name(event: Event) -> &'static str {
    match event {
        Event::Started => "start",
        Event::DeleteRequested => "delete",
        Event::Destroyed => "finish deleting",
        Event::Failure => "fail",
        Event::Froze => "pause",
        Event::Thawed | Event::RestoreRequested | Event::Restored => "resume",
        Event::SuspendRequested | Event::Checkpointed => "suspend",
        Event::RolledBack => "roll back",
        Event::RewindRequested => "restore a checkpoint",
    }
}

/// Whether a sandbox in `state` already shows the outcome of an operation of
/// `kind`: one a restart interrupted after its work but before its end was
/// recorded is then finished, not carried out again.
pub fn settles(kind: OperationKind, state: SandboxState) -> bool {
    use SandboxState::*;
    match kind {
        OperationKind::Create => matches!(state, Running | Paused | Suspended),
        OperationKind::Delete => state == Deleted,
        OperationKind::Pause => state == Paused,
        OperationKind::Resume => state == Running,
        OperationKind::Suspend => state == Suspended,
        // Its forks say how far it came; the job looks at each.
        OperationKind::BuildTemplate
        | OperationKind::Fork
        | OperationKind::Checkpoint
        | OperationKind::RestoreCheckpoint => false,
    }
}

/// Whether commands may run in a sandbox in this state.
pub fn accepts_commands(state: SandboxState) -> bool {
    match state {
        SandboxState::Running => true,
        SandboxState::Creating
        | SandboxState::Paused
        | SandboxState::Suspending
        | SandboxState::Suspended
        | SandboxState::Resuming
        | SandboxState::Deleting
        | SandboxState::Deleted
        | SandboxState::Failed => false,
    }
}

/// The gateway's policy for a sandbox's network.
pub fn policy_of(network: &Network) -> Result<Policy, RuleError> {
    let mode = match network.egress {
        Egress::None => Mode::None,
        Egress::Allowlist => Mode::Allowlist,
        Egress::Public => Mode::Public,
    };
    let bindings = network
        .secrets
        .values()
        .map(|b| {
            let headers = b.set_header.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            Binding::new(&b.secret, b.placeholder.as_deref().unwrap_or_default(), &b.hosts, headers)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Policy::new(mode, &network.allow, &network.deny)?.with_bindings(bindings)
}

/// The start of every placeholder a sandbox sees for a secret.
pub const PLACEHOLDER_PREFIX: &str = "space_ph_";

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(request: serde_json::Value) -> Result<CreateSpec, NodeError> {
        let defaults: TemplateDefaults =
            serde_json::from_value(serde_json::json!({"vcpus": 1, "memory_mib": 512, "disk_mib": 2048, "env": {}, "workdir": "/root", "user": "root"})).unwrap();
        CreateSpec::new(serde_json::from_value(request).unwrap(), &defaults)
    }

    #[test]
    fn what_a_create_would_drop_is_refused() {
        let clash = serde_json::json!({"template": "base", "env": {"TOKEN": "mine"},
            "network": {"egress": "allowlist", "secrets": {"TOKEN": {"secret": "s"}}}});
        let err = spec(clash).unwrap_err();
        assert_eq!((err.code.http_status(), err.details["field"].as_str()), (422, Some("env")), "{}", err.message);
        let alone = serde_json::json!({"template": "base", "lifecycle": {"idle_timeout_s": 60}});
        assert!(spec(alone).unwrap_err().message.contains("needs lifecycle.on_idle"));
        let alone = serde_json::json!({"template": "base", "lifecycle": {"on_idle": "pause"}});
        assert!(spec(alone).unwrap_err().message.contains("needs lifecycle.idle_timeout_s"));
        let looks_placeholder = serde_json::json!({"template": "base", "env": {"A": "space_ph_0123"}});
        assert!(spec(looks_placeholder).unwrap_err().message.contains("placeholders"));
        for fine in [
            serde_json::json!({"template": "base", "lifecycle": {"on_idle": "none"}}),
            serde_json::json!({"template": "base", "lifecycle": {"idle_timeout_s": 60, "on_idle": "suspend"}}),
            serde_json::json!({"template": "base", "env": {"A": "1"},
                "network": {"egress": "allowlist", "secrets": {"B": {"secret": "s"}}}}),
        ] {
            assert!(spec(fine.clone()).is_ok(), "{fine}");
        }
    }

    #[test]
    fn the_state_machine_allows_only_listed_moves() {
        use SandboxState::*;
        assert_eq!(transition(Creating, Event::Started).unwrap(), Running);
        assert_eq!(transition(Running, Event::DeleteRequested).unwrap(), Deleting);
        assert_eq!(transition(Deleted, Event::DeleteRequested).unwrap(), Deleted);
        assert_eq!(transition(Deleting, Event::Destroyed).unwrap(), Deleted);
        assert_eq!(transition(Failed, Event::DeleteRequested).unwrap(), Deleting);
        let err = transition(Running, Event::Started).unwrap_err();
        assert_eq!(err.code.http_status(), 409);
        assert!(err.message.contains("running"));
        assert!(transition(Deleted, Event::Failure).is_err());
        assert_eq!(transition(Running, Event::Froze).unwrap(), Paused);
        assert_eq!(transition(Paused, Event::Thawed).unwrap(), Running);
        assert_eq!(transition(Paused, Event::DeleteRequested).unwrap(), Deleting);
        assert!(transition(Paused, Event::Froze).unwrap_err().message.contains("paused"));
        assert!(transition(Running, Event::Thawed).is_err());
        assert!(transition(Creating, Event::Froze).is_err());
        assert_eq!(transition(Paused, Event::SuspendRequested).unwrap(), Suspending);
        assert_eq!(transition(Suspending, Event::Checkpointed).unwrap(), Suspended);
        assert_eq!(transition(Suspended, Event::RestoreRequested).unwrap(), Resuming);
        assert_eq!(transition(Resuming, Event::Restored).unwrap(), Running);
        assert_eq!(transition(Suspended, Event::DeleteRequested).unwrap(), Deleting);
        assert!(transition(Suspended, Event::SuspendRequested).is_err());
        assert!(transition(Suspended, Event::Thawed).is_err());
        assert_eq!(transition(Suspending, Event::RolledBack).unwrap(), Running);
        assert_eq!(transition(Resuming, Event::RolledBack).unwrap(), Suspended);
        assert!(transition(Creating, Event::RolledBack).is_err());
    }

    #[test]
    fn create_requests_are_checked_against_defaults() {
        let defaults = TemplateDefaults::default();
        let spec =
            CreateSpec::new(CreateSandboxRequest { template: "base".into(), ..Default::default() }, &defaults).unwrap();
        assert_eq!((spec.vcpus, spec.memory_mib, spec.disk_mib), (1, 512, 2048));
        for bad in [
            CreateSandboxRequest { template: "base".into(), vcpus: Some(0), ..Default::default() },
            CreateSandboxRequest { template: "base".into(), memory_mib: Some(1), ..Default::default() },
            CreateSandboxRequest {
                template: "base".into(),
                env: [("A=B".to_string(), "x".to_string())].into(),
                ..Default::default()
            },
        ] {
            assert_eq!(CreateSpec::new(bad, &defaults).unwrap_err().code.http_status(), 422);
        }
    }

    #[test]
    fn commands_need_exactly_one_of_argv_and_cmd() {
        let both = CommandRequest { argv: Some(vec!["ls".into()]), cmd: Some("ls".into()), ..Default::default() };
        assert_eq!(CommandSpec::try_from(both).unwrap_err().code.http_status(), 400);
        assert_eq!(CommandSpec::try_from(CommandRequest::default()).unwrap_err().code.http_status(), 400);
        let shell =
            CommandSpec::try_from(CommandRequest { cmd: Some("echo hi".into()), ..Default::default() }).unwrap();
        assert_eq!(shell.argv, ["/bin/sh", "-c", "echo hi"]);
        let relative = CommandRequest { argv: Some(vec!["ls".into()]), cwd: Some("tmp".into()), ..Default::default() };
        assert_eq!(CommandSpec::try_from(relative).unwrap_err().code.http_status(), 400);
        let tty = |stdin| CommandRequest { cmd: Some("sh".into()), tty: true, stdin, ..Default::default() };
        assert!(CommandSpec::try_from(tty(None)).unwrap().stdin, "a terminal is stdin");
        assert!(CommandSpec::try_from(tty(Some(true))).unwrap().stdin);
        assert_eq!(CommandSpec::try_from(tty(Some(false))).unwrap_err().code.http_status(), 422);
    }
}
