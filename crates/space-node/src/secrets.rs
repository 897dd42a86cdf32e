//! Tenant secrets: written through the API, never returned, never logged.
//! Values are sealed (AES-256-GCM) with a key kept in a file of its own
//! (`secrets.key`, mode 0600, beside the database), bound to their tenant
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
use crate::store::{Store, TenantSecret};

/// Secrets a tenant may keep.
pub const MAX_SECRETS: usize = 256;
/// The longest value (it travels in an HTTP header).
pub const MAX_VALUE: usize = 16 * 1024;
/// Hosts one secret may list.
pub const MAX_HOSTS: usize = 32;
/// The largest set of a cluster's secrets a node takes at once (every
/// tenant's, values included: far more than one JSON request's bound).
pub const MAX_SECRET_SET: usize = 64 << 20;
fn secret_context(tenant: &str, name: &str) -> String {
    format!("secret\0{tenant}\0{name}")
}

/// A secret's name: letters, digits, `_`, `-` and `.`, 1-64 long.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

/// Whether `host` (a name or `*.suffix`) is within `allowed` (the same
/// forms): a name under one of them, or a `*.` pattern under another.
fn within(host: &str, allowed: &[String]) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    allowed.iter().any(|pattern| {
        let pattern = pattern.trim_end_matches('.').to_ascii_lowercase();
        match pattern.strip_prefix("*.") {
            None => host == pattern,
            Some(suffix) => {
                let bare = host.strip_prefix("*.").unwrap_or(&host);
                bare.ends_with(&format!(".{suffix}")) || (host.starts_with("*.") && bare == suffix)
            }
        }
    })
}

/// A secret with its value, as a control plane sends it to its nodes.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlainSecret {
    pub tenant: String,
    pub name: String,
    pub hosts: Vec<String>,
    pub value: String,
}

/// Every secret of a cluster as of its `epoch`-th change.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSet {
    pub epoch: u64,
    pub secrets: Vec<PlainSecret>,
}

/// The store's secrets, opened with `keyring` (those that do not open are
/// left out, and logged).
pub fn secret_set(store: &Store, keyring: &Keyring) -> Result<SecretSet, NodeError> {
    let (epoch, sealed) = store.all_secrets()?;
    let secrets = sealed
        .into_iter()
        .filter_map(|(tenant, name, (hosts, sealed))| {
            let plain = keyring.open(&secret_context(&tenant, &name), &sealed);
            let value = plain.and_then(|p| String::from_utf8(p).ok());
            if value.is_none() {
                tracing::error!(%tenant, secret = %name, "a secret does not open with this key");
            }
            Some(PlainSecret { tenant, name, hosts, value: value? })
        })
        .collect();
    Ok(SecretSet { epoch, secrets })
}

/// Checks, seals and keeps a tenant's secret in `store`.
pub fn put_secret(
    store: &Store,
    keyring: &Keyring,
    tenant: &str,
    name: &str,
    request: PutSecretRequest,
) -> Result<SecretInfo, NodeError> {
    if !valid_name(name) {
        return Err(NodeError::unprocessable(format!("secret name {name:?}: 1-64 letters, digits, '_', '-' or '.'")));
    }
    if request.value.is_empty() || request.value.len() > MAX_VALUE {
        return Err(NodeError::unprocessable(format!("a secret's value is 1 to {MAX_VALUE} bytes")));
    }
    if request.value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
        return Err(NodeError::unprocessable(
            "a secret's value may not hold control characters (it goes in HTTP headers)",
        ));
    }
    if request.hosts.is_empty() || request.hosts.len() > MAX_HOSTS {
        return Err(NodeError::unprocessable(format!("a secret lists 1 to {MAX_HOSTS} hosts it may be sent to")));
    }
    space_egress::policy::Binding::new(name, "", &request.hosts, Vec::new())
        .map_err(|err| NodeError::unprocessable(err.to_string()).with_details(serde_json::json!({"field": "hosts"})))?;
    let exists = store.secret(tenant, name)?.is_some();
    if !exists && store.secrets(tenant)?.len() >= MAX_SECRETS {
        return Err(NodeError::unprocessable(format!("a tenant keeps at most {MAX_SECRETS} secrets")));
    }
    let sealed = keyring.seal(&secret_context(tenant, name), request.value.as_bytes());
    store.put_secret(tenant, name, &request.hosts, &sealed, &crate::ids::now())?;
    let info = store.secrets(tenant)?.into_iter().find(|s| s.name == name);
    info.ok_or_else(|| NodeError::internal("keeping the secret", "it was not there afterwards"))
}

pub fn delete_secret(store: &Store, tenant: &str, name: &str) -> Result<(), NodeError> {
    if !valid_name(name) || !store.delete_secret(tenant, name)? {
        return Err(NodeError::not_found("secret", name));
    }
    Ok(())
}

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
        let path = self.data.root().join("secrets.key");
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
        self.store.replace_secrets(&sealed, &crate::ids::now())?;
        self.secrets_epoch.store(set.epoch, SeqCst);
        Ok(())
    }

    /// A secret's value and its hosts as they are now, read together
    /// (for the gateway only): a sandbox's binding keeps the hosts of its
    /// bind, which a later `PUT /v1/secrets/{name}` may have narrowed.
    pub(crate) fn secret_for_gateway(&self, tenant: &str, name: &str) -> Option<space_egress::inspect::Secret> {
        let (hosts, sealed) = self.store.secret(tenant, name).ok()??;
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
            let Some((hosts, _)) = self.store.secret(tenant, &binding.secret)? else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_values_open_only_with_their_key_and_context() {
        let dir = std::env::temp_dir().join(format!("space-keyring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secrets.key");
        let _ = std::fs::remove_file(&path);
        let keyring = Keyring::load_or_create(&path).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let sealed = keyring.seal("secret\0t\0a", b"sk-value");
        assert!(!sealed.windows(8).any(|w| w == b"sk-value"));
        assert_eq!(keyring.open("secret\0t\0a", &sealed).unwrap(), b"sk-value");
        assert!(keyring.open("secret\0t\0b", &sealed).is_none(), "moved to another name: refused");
        // The same file again gives the same key.
        let again = Keyring::load_or_create(&path).unwrap();
        assert_eq!(again.open("secret\0t\0a", &sealed).unwrap(), b"sk-value");
        // Many first users at once all get the one key (the second of two
        // failed with "File exists" and a warm sandbox with it).
        std::fs::remove_file(&path).unwrap();
        let start = std::sync::Barrier::new(16);
        let tokens: Vec<String> = std::thread::scope(|scope| {
            let users: Vec<_> = (0..16)
                .map(|_| {
                    let (path, start) = (&path, &start);
                    scope.spawn(move || {
                        start.wait();
                        Keyring::load_or_create(path).unwrap().token("check", "one")
                    })
                })
                .collect();
            users.into_iter().map(|u| u.join().unwrap()).collect()
        });
        assert!(tokens.iter().all(|t| *t == tokens[0]), "{tokens:?}");
        assert_eq!(Keyring::load_or_create(&path).unwrap().token("check", "one"), tokens[0]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn binding_hosts_stay_within_the_secrets_hosts() {
        let allowed = vec!["api.space.test".to_string(), "*.files.space.test".to_string()];
        assert!(within("api.space.test", &allowed));
        assert!(within("API.space.test.", &allowed));
        assert!(within("a.files.space.test", &allowed));
        assert!(within("*.b.files.space.test", &allowed));
        assert!(within("*.files.space.test", &allowed));
        assert!(!within("files.space.test", &allowed));
        assert!(!within("other.space.test", &allowed));
        assert!(!within("*.space.test", &allowed));
    }
}
