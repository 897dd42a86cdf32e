//! Each sandbox's egress: the connections its agent relays over the
//! channel, served by the gateway (`space-egress`) with the sandbox's
//! policy, and the audit log of what went through.

use std::collections::HashMap;
use std::sync::Arc;

use space_api::{ErrorCode, Network};
use space_egress::gateway::{Credentials, GatewayConfig, SandboxEgress};
use space_egress::policy::Policy;

pub use crate::domain::policy_of;
use crate::error::NodeError;
use crate::platform::Platform;

/// How long an agent may take to take a new environment.
const ENV_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The operator's egress settings (`space serve --egress-host`,
/// `--egress-allow-internal`, `--egress-trust`): fixed answers for names
/// (optionally with the port to dial instead), internal addresses sandboxes
/// may reach anyway, and extra roots for upstream certificates. For a
/// host's own mirror or a test's upstreams; never settable through the API.
#[derive(Debug, Clone, Default)]
pub struct EgressSettings {
    pub hosts: Vec<(String, std::net::IpAddr, Option<u16>)>,
    pub allow_internal: Vec<(std::net::IpAddr, u8)>,
    pub trust: Vec<std::path::PathBuf>,
    /// Per sandbox: connections open at once, new ones per second, and
    /// MiB per second each way (0: unlimited). `None`: the gateway's own.
    pub max_connections: Option<usize>,
    pub new_per_second: Option<u32>,
    pub rate_mib: Option<u64>,
}

/// Why the operator's egress settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EgressSettingsError {
    #[error("{pair:?}: give NAME=IP[:PORT]")]
    NotAPair { pair: String },
    #[error("{pair:?}: {address:?} is not an IP address (with an optional :PORT)")]
    BadAddress { pair: String, address: String },
    #[error("{cidr:?} is not a CIDR")]
    NotACidr { cidr: String },
    #[error("{cidr:?}: bad length (give 0 to {max})")]
    BadLength { cidr: String, max: u8 },
    #[error("reading the extra upstream roots: {0}")]
    UpstreamRoots(#[source] space_egress::ca::CaError),
}

/// Why a sandbox's kept egress CA cannot be opened.
#[derive(Debug, thiserror::Error)]
enum EgressCaError {
    #[error("its sealed key is not base64: {0}")]
    NotBase64(#[source] base64::DecodeError),
    /// This server's keyring could not be read (the detail is logged).
    #[error("{}", .0.message)]
    Keyring(NodeError),
    #[error("its key does not open with this server's keyring")]
    WrongKeyring,
    #[error("its key is not text: {0}")]
    NotText(#[source] std::string::FromUtf8Error),
    #[error(transparent)]
    Key(space_egress::ca::CaError),
}

impl EgressSettings {
    /// Reads `NAME=IP`, `NAME=IP:PORT` (`NAME=[V6]:PORT`) and `IP/LEN` forms.
    pub fn parse(hosts: &[String], allow_internal: &[String]) -> Result<EgressSettings, EgressSettingsError> {
        let hosts = hosts
            .iter()
            .map(|pair| {
                let (name, address) =
                    pair.split_once('=').ok_or_else(|| EgressSettingsError::NotAPair { pair: pair.clone() })?;
                let bad = || EgressSettingsError::BadAddress { pair: pair.clone(), address: address.to_string() };
                let (ip, port) = match address.parse::<std::net::IpAddr>() {
                    Ok(ip) => (ip, None),
                    Err(_) => {
                        let at: std::net::SocketAddr = address.parse().map_err(|_| bad())?;
                        (at.ip(), Some(Some(at.port()).filter(|p| *p > 0).ok_or_else(bad)?))
                    }
                };
                Ok((name.trim_end_matches('.').to_ascii_lowercase(), ip, port))
            })
            .collect::<Result<_, EgressSettingsError>>()?;
        let allow_internal = allow_internal
            .iter()
            .map(|cidr| {
                let (ip, len) = cidr.split_once('/').unwrap_or((cidr, ""));
                let ip: std::net::IpAddr =
                    ip.parse().map_err(|_| EgressSettingsError::NotACidr { cidr: cidr.clone() })?;
                let max = if ip.is_ipv4() { 32 } else { 128 };
                let bad_length = || EgressSettingsError::BadLength { cidr: cidr.clone(), max };
                let len = if len.is_empty() { max } else { len.parse().map_err(|_| bad_length())? };
                if len > max {
                    return Err(bad_length());
                }
                Ok((ip, len))
            })
            .collect::<Result<_, EgressSettingsError>>()?;
        Ok(EgressSettings { hosts, allow_internal, ..Default::default() })
    }
}

impl Platform {
    /// Serves the egress connections `agent` relays with the sandbox's
    /// policy (on every new agent connection: a create, a restore, a
    /// re-adoption after a restart).
    pub(crate) fn start_egress(self: &Arc<Self>, id: &str, agent: &space_engine::AgentConn) {
        let Ok(record) = self.sandbox(id) else { return };
        // Only a new agent took its environment from this handshake.
        if agent.hello().reconnect || agent.welcome().env != crate::secrets::sandbox_env(&record) {
            self.env_changed(id);
        }
        let policy = policy_of(&record.sandbox.network).unwrap_or_default();
        let ca = record.egress_ca.as_ref().and_then(|ca| match self.open_egress_ca(id, ca) {
            Ok(ca) => Some(ca),
            Err(err) => {
                tracing::error!(sandbox = %id, "its egress CA: {err}; its secrets are not added");
                None
            }
        });
        let hub = &self.egress;
        let egress = {
            let mut live = hub.live.lock().unwrap_or_else(|e| e.into_inner());
            let config = hub.config.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let events = hub.events.clone();
            live.entry(id.to_string())
                .or_insert_with(|| SandboxEgress::new(id.to_string(), Policy::default(), events, config))
                .clone()
        };
        egress.set_policy(policy);
        if let Some(ca) = ca {
            egress.set_credentials(Credentials { vault: self.vault(&record.tenant), ca: Arc::new(ca) });
        }
        agent.on_egress(Arc::new(move |stream: space_engine::EgressStream| {
            let egress = egress.clone();
            let io = stream.into_io();
            tokio::spawn(async move { egress.handle(io).await });
        }));
    }

    /// Applies the operator's egress settings (before sandboxes start).
    pub fn configure_egress(&self, settings: &EgressSettings) -> Result<(), EgressSettingsError> {
        let mut config = if settings.hosts.is_empty() {
            GatewayConfig::new(Arc::new(space_egress::gateway::SystemResolver))
        } else {
            let mut answers: HashMap<String, Vec<std::net::IpAddr>> = HashMap::new();
            for (name, ip, _) in &settings.hosts {
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
        config.dial_ports =
            settings.hosts.iter().filter_map(|(name, _, port)| Some((name.clone(), (*port)?))).collect();
        if !settings.trust.is_empty() {
            tracing::warn!("egress: upstream certificates may also be signed by {:?}", settings.trust);
            let roots =
                space_egress::ca::upstream_roots(&settings.trust).map_err(EgressSettingsError::UpstreamRoots)?;
            config.upstream_roots = Some(roots);
        }
        *self.egress.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
        Ok(())
    }

    /// How often the gateway looked `name` up through the operator's fixed
    /// answers (`None` without them): proof that a denied name never was.
    pub fn egress_lookups(&self, name: &str) -> Option<usize> {
        let names = self.egress.static_names.lock().unwrap_or_else(|e| e.into_inner());
        names.as_ref().map(|resolver| resolver.lookups_of(name))
    }

    /// Replaces a sandbox's network policy: kept, applied to its next
    /// connections at once, and its open connections that the new policy
    /// no longer allows are cut. Allowed in any state but deleted.
    pub fn set_network(
        &self,
        sandbox: &crate::access::OwnedSandbox,
        network: Network,
    ) -> Result<space_api::Sandbox, NodeError> {
        let id = sandbox.id();
        let mut network = crate::domain::checked_network(network)?;
        let record = self.sandbox(id)?;
        if record.sandbox.state == space_api::SandboxState::Deleted {
            return Err(NodeError::invalid_state("sandbox", "deleted", "change its network"));
        }
        // A variable bound before keeps its placeholder (processes already
        // hold it); a new one's placeholder is in the answer and in the
        // environment of every command started from now on.
        self.bind_secrets(&record.tenant, &mut network, Some(&record.sandbox.network))?;
        self.check_egress_ceiling(&record.tenant, &network)?;
        let policy = policy_of(&network).map_err(|e| NodeError::unprocessable(e.to_string()))?;
        self.store.node().set_sandbox_network(id, &network)?;
        self.env_changed(id);
        if let Some(egress) = self.egress.live.lock().unwrap_or_else(|e| e.into_inner()).get(id) {
            egress.set_policy(policy);
        }
        self.changed();
        Ok(self.sandbox(id)?.sandbox)
    }

    /// 422 `egress_not_permitted` when `network` allows more than the
    /// tenant's ceiling.
    pub(crate) fn check_egress_ceiling(&self, tenant: &str, network: &Network) -> Result<(), NodeError> {
        let Some(rules) = self.store.tenancy().tenant_quotas(tenant)?.egress_ceiling else {
            return Ok(());
        };
        let ceiling = space_egress::policy::Ceiling::parse(&rules)
            .map_err(|err| NodeError::internal("the tenant's egress ceiling", err))?;
        let policy = policy_of(network).map_err(|e| NodeError::unprocessable(e.to_string()))?;
        match ceiling.beyond(&policy) {
            None => Ok(()),
            Some(beyond) => Err(NodeError::new(
                ErrorCode::EgressNotPermitted,
                format!("{beyond} is beyond what this tenant's sandboxes may reach"),
            )
            .with_details(serde_json::json!({"field": "network", "rule": beyond, "ceiling": rules}))),
        }
    }

    /// A new CA for sandbox `id`, its key sealed for keeping.
    pub(crate) fn new_egress_ca(&self, id: &str) -> Result<crate::store::EgressCa, NodeError> {
        use base64::Engine as _;
        let ca = space_egress::ca::SandboxCa::generate(id).map_err(|e| NodeError::internal("making its CA", e))?;
        let sealed = self.keyring()?.seal(&format!("ca\0{id}"), ca.key_pem().as_bytes());
        Ok(crate::store::EgressCa {
            cert_pem: ca.cert_pem(),
            key_sealed: base64::engine::general_purpose::STANDARD.encode(sealed),
        })
    }

    fn open_egress_ca(
        &self,
        id: &str,
        kept: &crate::store::EgressCa,
    ) -> Result<space_egress::ca::SandboxCa, EgressCaError> {
        use base64::Engine as _;
        let sealed =
            base64::engine::general_purpose::STANDARD.decode(&kept.key_sealed).map_err(EgressCaError::NotBase64)?;
        let keyring = self.keyring().map_err(EgressCaError::Keyring)?;
        let key = keyring.open(&format!("ca\0{id}"), &sealed).ok_or(EgressCaError::WrongKeyring)?;
        let key = String::from_utf8(key).map_err(EgressCaError::NotText)?;
        space_egress::ca::SandboxCa::from_key_pem(id, &key).map_err(EgressCaError::Key)
    }

    /// Forgets a deleted sandbox's egress.
    pub(crate) fn stop_egress(&self, id: &str) {
        self.egress.live.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        self.egress.env_due.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }

    /// Notes that the agent of `id` is to be given its environment again.
    fn env_changed(&self, id: &str) {
        let change = self.egress.env_changes.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.egress.env_due.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), change);
    }

    /// Gives `agent` the sandbox's current environment if it may hold
    /// another (before a command starts): the placeholders of its network
    /// as it is now, none of a variable no longer bound.
    pub(crate) async fn give_current_env(&self, id: &str, agent: &space_engine::AgentConn) -> Result<(), NodeError> {
        let Some(change) = self.egress.env_due.lock().unwrap_or_else(|e| e.into_inner()).get(id).copied() else {
            return Ok(());
        };
        // Read after the change was taken: a later change is due again.
        let env = crate::secrets::sandbox_env(&self.sandbox(id)?);
        // The CA is the welcome's business; only the environment changes.
        let identity = space_engine::fresh_identity(&env, None)
            .map_err(|e| NodeError::internal("the sandbox's environment", e))?;
        agent.set_identity(&identity, ENV_PATIENCE).await.map_err(crate::error::exec_failure)?;
        let mut due = self.egress.env_due.lock().unwrap_or_else(|e| e.into_inner());
        if due.get(id) == Some(&change) {
            due.remove(id);
        }
        Ok(())
    }

    /// Stores egress events as they come, until the platform shuts down;
    /// then those already queued, and no more.
    pub(crate) fn store_egress_events(self: &Arc<Self>) {
        let Some(mut queued) = self.egress.queued.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        let platform = self.clone();
        let stopping = self.tasks.stopping();
        self.tasks.spawn(async move {
            let store = |(id, event): (String, _)| {
                if let Err(err) = platform.store.node().put_egress_event(&id, &event) {
                    tracing::error!(sandbox = %id, "storing an egress event: {err}");
                }
            };
            tokio::pin!(stopping);
            loop {
                tokio::select! {
                    biased;
                    () = &mut stopping => break,
                    next = queued.recv() => match next {
                        Some(next) => store(next),
                        None => return,
                    },
                }
            }
            while let Ok(next) = queued.try_recv() {
                store(next);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{EgressSettings, EgressSettingsError};

    fn parse(hosts: &[&str], internal: &[&str]) -> Result<EgressSettings, EgressSettingsError> {
        let owned = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        EgressSettings::parse(&owned(hosts), &owned(internal))
    }

    #[test]
    fn each_bad_setting_says_what_is_wrong_with_it() {
        assert!(matches!(parse(&["mirror.test"], &[]), Err(EgressSettingsError::NotAPair { .. })));
        assert!(matches!(parse(&["mirror.test=10.0.0"], &[]), Err(EgressSettingsError::BadAddress { .. })));
        assert!(matches!(parse(&["mirror.test=10.0.0.1:0"], &[]), Err(EgressSettingsError::BadAddress { .. })));
        assert!(matches!(parse(&[], &["10.0.0/8"]), Err(EgressSettingsError::NotACidr { .. })));
        let too_long = parse(&[], &["10.0.0.0/33"]).unwrap_err();
        assert!(matches!(too_long, EgressSettingsError::BadLength { max: 32, .. }), "{too_long}");
        assert_eq!(too_long.to_string(), "\"10.0.0.0/33\": bad length (give 0 to 32)");
        let settings = parse(&["Mirror.Test.=10.0.0.1:8080"], &["fd00::/8"]).unwrap();
        assert_eq!(settings.hosts[0].0, "mirror.test");
        assert_eq!(settings.hosts[0].2, Some(8080));
        assert_eq!(settings.allow_internal[0].1, 8);
    }
}
