//! Tenant secrets at rest: written through the API, never returned, never
//! logged. Values are sealed with the keyring, bound to their tenant and
//! name, so neither the database nor its dump holds a readable value. Both
//! a server and a cluster's control plane keep them this way; a node binds
//! them into sandboxes' networks (`space-node`'s `secrets.rs`).

use space_api::{PutSecretRequest, SecretInfo};

use crate::error::NodeError;
use crate::keyring::Keyring;
use crate::store::Store;

/// Secrets a tenant may keep.
pub const MAX_SECRETS: usize = 256;
/// The longest value (it travels in an HTTP header).
pub const MAX_VALUE: usize = 16 * 1024;
/// Hosts one secret may list.
pub const MAX_HOSTS: usize = 32;
/// The largest set of a cluster's secrets a node takes at once (every
/// tenant's, values included: far more than one JSON request's bound).
pub const MAX_SECRET_SET: usize = 64 << 20;
pub fn secret_context(tenant: &str, name: &str) -> String {
    format!("secret\0{tenant}\0{name}")
}

/// A secret's name: letters, digits, `_`, `-` and `.`, 1-64 long.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

/// Whether `host` (a name or `*.suffix`) is within `allowed` (the same
/// forms): a name under one of them, or a `*.` pattern under another.
pub fn within(host: &str, allowed: &[String]) -> bool {
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
    let (epoch, sealed) = store.tenancy().all_secrets()?;
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
    let exists = store.tenancy().secret(tenant, name)?.is_some();
    if !exists && store.tenancy().secrets(tenant)?.len() >= MAX_SECRETS {
        return Err(NodeError::unprocessable(format!("a tenant keeps at most {MAX_SECRETS} secrets")));
    }
    let sealed = keyring.seal(&secret_context(tenant, name), request.value.as_bytes());
    store.tenancy().put_secret(tenant, name, &request.hosts, &sealed, crate::ids::now())?;
    let info = store.tenancy().secrets(tenant)?.into_iter().find(|s| s.name == name);
    info.ok_or_else(|| NodeError::internal("keeping the secret", "it was not there afterwards"))
}

pub fn delete_secret(store: &Store, tenant: &str, name: &str) -> Result<(), NodeError> {
    if !valid_name(name) || !store.tenancy().delete_secret(tenant, name)? {
        return Err(NodeError::not_found("secret", name));
    }
    Ok(())
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
