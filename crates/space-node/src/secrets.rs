//! Tenant secrets: written through the API, never returned, never logged.
//! Values are sealed (AES-256-GCM) with a key kept in a file of its own
//! (`state/secrets.key`, mode 0600, beside the database), bound to their tenant
//! and name, so neither the database nor its dump holds a readable value.
//! A sandbox holds only placeholders; the egress gateway reads a value when
//! a request to one of the secret's hosts needs it.

use std::collections::BTreeMap;
use std::sync::Arc;

use ring::rand::{SecureRandom, SystemRandom};
use space_api::{Network, PutSecretRequest, SecretInfo};

pub use crate::domain::PLACEHOLDER_PREFIX;
use crate::error::NodeError;
pub use crate::keyring::Keyring;
use crate::platform::Platform;
use crate::store::TenantSecret;
pub use space_core::secrets::{
    delete_secret, put_secret, secret_context, secret_set, valid_name, within, PlainSecret, SecretSet, MAX_HOSTS,
    MAX_SECRETS, MAX_SECRET_SET, MAX_VALUE,
};

/// The gateway's way to a tenant's secrets.
struct TenantVault {
    platform: std::sync::Weak<Platform>,
    tenant: String,
}

impl space_egress::inspect::Vault for TenantVault {
    fn secret(&self, name: &str) -> Option<space_egress::inspect::Secret> {
        self.platform.upgrade()?.secret_for_gateway(&self.tenant, name)
    }
}

impl Platform {
    pub fn keyring(&self) -> Result<&Keyring, NodeError> {
        if let Some(keyring) = self.keyring.get() {
            return Ok(keyring);
        }
        let path = self.data.secrets_key_path();
        let keyring = Keyring::load_or_create(&path)
            .map_err(|err| NodeError::internal(&format!("the secrets key ({})", path.display()), err))?;
        Ok(self.keyring.get_or_init(|| keyring))
    }

    /// Writes (or replaces) a tenant's secret; in use from the next request.
    pub fn put_secret(&self, tenant: &str, name: &str, request: PutSecretRequest) -> Result<SecretInfo, NodeError> {
        put_secret(&self.store, self.keyring()?, tenant, name, request)
    }

    pub fn delete_secret(&self, tenant: &str, name: &str) -> Result<(), NodeError> {
        delete_secret(&self.store, tenant, name)
    }

    /// Takes a cluster's secrets as this node's own (sealed with this
    /// node's key), unless it has a newer set already.
    pub fn take_secrets(&self, set: SecretSet) -> Result<(), NodeError> {
        use std::sync::atomic::Ordering::SeqCst;
        let _one_at_a_time = self.secrets_taken.lock().unwrap_or_else(|e| e.into_inner());
        if set.epoch <= self.secrets_epoch.load(SeqCst) {
            return Ok(());
        }
        let keyring = self.keyring()?;
        let sealed: Vec<TenantSecret> = set
            .secrets
            .into_iter()
            .map(|s| {
                let sealed = keyring.seal(&secret_context(&s.tenant, &s.name), s.value.as_bytes());
                (s.tenant, s.name, (s.hosts, sealed))
            })
            .collect();
        self.store.tenancy().replace_secrets(&sealed, crate::ids::now())?;
        self.secrets_epoch.store(set.epoch, SeqCst);
        Ok(())
    }

    /// A secret's value and its hosts as they are now, read together
    /// (for the gateway only): a sandbox's binding keeps the hosts of its
    /// bind, which a later `PUT /v1/secrets/{name}` may have narrowed.
    pub(crate) fn secret_for_gateway(&self, tenant: &str, name: &str) -> Option<space_egress::inspect::Secret> {
        let (hosts, sealed) = self.store.tenancy().secret(tenant, name).ok()??;
        let plain = self.keyring().ok()?.open(&secret_context(tenant, name), &sealed)?;
        Some(space_egress::inspect::Secret { value: String::from_utf8(plain).ok()?, hosts })
    }

    pub(crate) fn vault(self: &Arc<Self>, tenant: &str) -> Arc<dyn space_egress::inspect::Vault> {
        Arc::new(TenantVault { platform: Arc::downgrade(self), tenant: tenant.to_string() })
    }

    /// Checks a network's secret bindings against the tenant's secrets and
    /// gives each a placeholder (kept from `before` for a variable already
    /// bound); returns the environment the placeholders go in.
    pub(crate) fn bind_secrets(
        &self,
        tenant: &str,
        network: &mut Network,
        before: Option<&Network>,
    ) -> Result<BTreeMap<String, String>, NodeError> {
        let fail = |env: &str, why: String| {
            NodeError::unprocessable(format!("network.secrets.{env}: {why}"))
                .with_details(serde_json::json!({"field": "network.secrets"}))
        };
        let mut env = BTreeMap::new();
        for (var, binding) in network.secrets.iter_mut() {
            if var.is_empty() || var.len() > 128 || !var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(fail(var, "the variable's name is letters, digits and '_'".into()));
            }
            let Some((hosts, _)) = self.store.tenancy().secret(tenant, &binding.secret)? else {
                return Err(fail(var, format!("there is no secret {:?} (PUT /v1/secrets/{{name}})", binding.secret)));
            };
            if binding.hosts.is_empty() {
                binding.hosts = hosts.clone();
            }
            if let Some(host) = binding.hosts.iter().find(|h| !within(h, &hosts)) {
                return Err(fail(var, format!("{host:?} is not among the secret's hosts {hosts:?}")));
            }
            for name in binding.set_header.keys() {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    return Err(fail(var, format!("{name:?} is not a header name")));
                }
            }
            let kept = before.and_then(|b| b.secrets.get(var)).and_then(|b| b.placeholder.clone());
            // The server chooses placeholders: one sent back as a sandbox
            // showed it is fine, any other would be silently replaced.
            if binding.placeholder.is_some() && binding.placeholder != kept {
                return Err(fail(
                    var,
                    "placeholder is set by the server; leave it out (or send the one it gave)".into(),
                ));
            }
            let placeholder = kept.unwrap_or_else(new_placeholder);
            binding.placeholder = Some(placeholder.clone());
            env.insert(var.clone(), placeholder);
        }
        Ok(env)
    }
}

/// The environment a sandbox's commands get: its own (`record.env`, set at
/// create), with the placeholders of its network as it is now. A binding
/// made later (`PUT .../network`) adds its placeholder; a variable no
/// longer bound loses the one it had, which nothing would inject any more.
/// Derived from the network kept in the store, so a restart changes
/// nothing of it.
pub(crate) fn sandbox_env(record: &crate::store::SandboxRecord) -> BTreeMap<String, String> {
    let bound = &record.sandbox.network.secrets;
    let mut env = record.env.clone();
    env.retain(|var, value| !value.starts_with(PLACEHOLDER_PREFIX) || bound.contains_key(var));
    for (var, binding) in bound {
        if let Some(placeholder) = &binding.placeholder {
            env.insert(var.clone(), placeholder.clone());
        }
    }
    env
}

fn new_placeholder() -> String {
    let mut bytes = [0u8; 16];
    SystemRandom::new().fill(&mut bytes).expect("the kernel's random source");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{PLACEHOLDER_PREFIX}{hex}")
}
