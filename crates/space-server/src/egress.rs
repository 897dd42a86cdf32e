//! Each sandbox's egress socket, served by the gateway (`space-egress`)
//! with the sandbox's policy while its actor lives, and the audit log of
//! what went through.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use space_api::{Egress, EgressEvent, Network};
use space_egress::gateway::{Event, GatewayConfig, SandboxEgress};
use space_egress::policy::{Mode, Policy, RuleError};
use tokio::sync::mpsc;

use crate::platform::Platform;

/// Events waiting to be stored, at most.
const EVENT_QUEUE: usize = 4096;

/// The gateway's policy for a sandbox's network.
pub fn policy_of(network: &Network) -> Result<Policy, RuleError> {
    let mode = match network.egress {
        Egress::None => Mode::None,
        Egress::Allowlist => Mode::Allowlist,
        Egress::Public => Mode::Public,
    };
    Policy::new(mode, &network.allow, &network.deny)
}

/// The egress sockets being served, by sandbox.
pub(crate) struct EgressHub {
    config: Mutex<GatewayConfig>,
    /// The operator's fixed answers, when given (its lookups are counted).
    static_names: Mutex<Option<Arc<space_egress::gateway::StaticResolver>>>,
    live: Mutex<HashMap<String, (Arc<SandboxEgress>, tokio::task::AbortHandle)>>,
    events: mpsc::Sender<(String, Event)>,
    queued: Mutex<Option<mpsc::Receiver<(String, Event)>>>,
}

impl EgressHub {
    pub(crate) fn new(config: GatewayConfig) -> EgressHub {
        let (events, queued) = mpsc::channel(EVENT_QUEUE);
        EgressHub {
            config: Mutex::new(config),
            static_names: Mutex::default(),
            live: Mutex::default(),
            events,
            queued: Mutex::new(Some(queued)),
        }
    }
}

/// The operator's egress settings (`space serve --egress-host`,
/// `--egress-allow-internal`): fixed answers for names, and internal
/// addresses sandboxes may reach anyway. Both are for a host's own mirror
/// or a test's upstreams; never settable through the API.
#[derive(Debug, Clone, Default)]
pub struct EgressSettings {
    pub hosts: Vec<(String, std::net::IpAddr)>,
    pub allow_internal: Vec<(std::net::IpAddr, u8)>,
}

impl EgressSettings {
    /// Reads `NAME=IP` and `IP/LEN` forms.
    pub fn parse(hosts: &[String], allow_internal: &[String]) -> Result<EgressSettings, String> {
        let hosts = hosts
            .iter()
            .map(|pair| {
                let (name, ip) = pair.split_once('=').ok_or_else(|| format!("{pair:?}: give NAME=IP"))?;
                let ip = ip.parse().map_err(|_| format!("{pair:?}: {ip:?} is not an IP address"))?;
                Ok((name.trim_end_matches('.').to_ascii_lowercase(), ip))
            })
            .collect::<Result<_, String>>()?;
        let allow_internal = allow_internal
            .iter()
            .map(|cidr| {
                let (ip, len) = cidr.split_once('/').unwrap_or((cidr, ""));
                let ip: std::net::IpAddr = ip.parse().map_err(|_| format!("{cidr:?} is not a CIDR"))?;
                let max = if ip.is_ipv4() { 32 } else { 128 };
                let len =
                    if len.is_empty() { max } else { len.parse().map_err(|_| format!("{cidr:?}: bad length"))? };
                if len > max {
                    return Err(format!("{cidr:?}: bad length"));
                }
                Ok((ip, len))
            })
            .collect::<Result<_, String>>()?;
        Ok(EgressSettings { hosts, allow_internal })
    }
}

impl Platform {
    /// Starts serving a sandbox's egress socket (again) with its policy.
    /// An engine without one (Firecracker, for now) has no egress.
    pub(crate) fn start_egress(&self, id: &str) {
        let Ok(record) = self.sandbox(id) else { return };
        let spec = self.engine_spec(&record);
        let Some(path) = self.engine.egress_socket(&spec) else { return };
        let policy = policy_of(&record.sandbox.network).unwrap_or_default();
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::UnixListener::from_std);
        let listener = match listener {
            Ok(listener) => listener,
            Err(err) => {
                // The sandbox dir is gone (deleted meanwhile) or unwritable.
                tracing::debug!(sandbox = %id, "no egress socket: {err}");
                return;
            }
        };
        let hub = &self.egress;
        let config = hub.config.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let egress = SandboxEgress::new(id.to_string(), policy, hub.events.clone(), config);
        let task = tokio::spawn(egress.clone().serve(listener)).abort_handle();
        if let Some((_, old)) =
            hub.live.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), (egress, task))
        {
            old.abort();
        }
    }

    /// Applies the operator's egress settings (before sandboxes start).
    pub fn configure_egress(&self, settings: &EgressSettings) {
        let mut config = if settings.hosts.is_empty() {
            GatewayConfig::new(Arc::new(space_egress::gateway::SystemResolver))
        } else {
            let mut answers: HashMap<String, Vec<std::net::IpAddr>> = HashMap::new();
            for (name, ip) in &settings.hosts {
                answers.entry(name.clone()).or_default().push(*ip);
            }
            let resolver = Arc::new(space_egress::gateway::StaticResolver::new(answers));
            *self.egress.static_names.lock().unwrap_or_else(|e| e.into_inner()) = Some(resolver.clone());
            GatewayConfig::new(resolver)
        };
        if !settings.hosts.is_empty() {
            tracing::warn!("egress: names resolve only through --egress-host ({} names)", settings.hosts.len());
        }
        if !settings.allow_internal.is_empty() {
            tracing::warn!("egress: sandboxes may reach these internal addresses: {:?}", settings.allow_internal);
        }
        config.allow_internal = settings.allow_internal.clone();
        *self.egress.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
    }

    /// How often the gateway looked `name` up through the operator's fixed
    /// answers (`None` without them): proof that a denied name never was.
    pub fn egress_lookups(&self, name: &str) -> Option<usize> {
        let names = self.egress.static_names.lock().unwrap_or_else(|e| e.into_inner());
        names.as_ref().map(|resolver| resolver.lookups_of(name))
    }

    /// Stops serving a sandbox's egress socket (it was deleted).
    pub(crate) fn stop_egress(&self, id: &str) {
        if let Some((_, task)) = self.egress.live.lock().unwrap_or_else(|e| e.into_inner()).remove(id) {
            task.abort();
        }
    }

    /// Stores egress events as they come, until the server stops.
    pub(crate) fn store_egress_events(self: &Arc<Self>) {
        let Some(mut queued) = self.egress.queued.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        let platform = self.clone();
        tokio::spawn(async move {
            while let Some((id, event)) = queued.recv().await {
                let event = EgressEvent {
                    at: crate::ids::format_time(
                        std::time::UNIX_EPOCH + std::time::Duration::from_millis(event.at_unix_ms),
                    ),
                    via: event.via,
                    host: event.host,
                    port: event.port,
                    decision: event.decision,
                    reason: event.reason,
                    rule: event.rule,
                    address: event.address,
                    bytes_up: event.bytes_up,
                    bytes_down: event.bytes_down,
                    duration_ms: event.duration_ms,
                };
                if let Err(err) = platform.store.put_egress_event(&id, &event) {
                    tracing::error!(sandbox = %id, "storing an egress event: {err}");
                }
            }
        });
    }
}
