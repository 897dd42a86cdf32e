//! Tenants and their API keys. A key is shown once, when it is made, and
//! stored only as its SHA-256 (keys are 256 random bits, so a plain hash
//! is as good as a slow one). Every sandbox, operation and command belongs
//! to the tenant whose key created it; templates built with the operator's
//! key are shared, those built with a tenant's key are that tenant's.

use sha2::{Digest, Sha256};
use space_api::{ErrorCode, SandboxState, Usage};

use crate::error::NodeError;
use crate::ids;
use crate::store::{KeyInfo, Quotas, SandboxRecord, Store, StoreError, OPERATOR_TENANT};

/// Who is calling, as the API key says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Whose resources it acts on (empty for the control plane, which
    /// names a tenant per request).
    pub tenant: String,
    pub role: Role,
}

/// What a caller may do: one of three, never two at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A tenant's key: its own resources only.
    Tenant,
    /// The server's own key: may also manage shared templates and see
    /// every tenant's usage.
    Operator,
    /// The control plane calling a node with the node token, before it
    /// says for whom ([`Caller::asserted`]).
    ControlPlane,
}

impl Caller {
    pub fn operator() -> Caller {
        Caller { tenant: OPERATOR_TENANT.to_string(), role: Role::Operator }
    }

    /// A tenant's caller.
    pub fn tenant(tenant: impl Into<String>) -> Caller {
        Caller { tenant: tenant.into(), role: Role::Tenant }
    }

    pub fn control_plane() -> Caller {
        Caller { tenant: String::new(), role: Role::ControlPlane }
    }

    pub fn is_operator(&self) -> bool {
        self.role == Role::Operator
    }

    /// The caller the control plane asserts to a node (`X-Space-Tenant`,
    /// `X-Space-Operator: true` for the cluster's own key); honoured only
    /// with the node token.
    pub fn asserted(headers: &http::HeaderMap) -> Result<Caller, crate::error::NodeError> {
        let tenant = headers.get("x-space-tenant").and_then(|v| v.to_str().ok()).unwrap_or_default();
        if !valid_tenant(tenant) {
            return Err(crate::error::NodeError::bad_request("X-Space-Tenant must name a tenant"));
        }
        let operator = headers.get("x-space-operator").is_some_and(|v| v == "true") && tenant == OPERATOR_TENANT;
        let role = if operator { Role::Operator } else { Role::Tenant };
        Ok(Caller { tenant: tenant.to_string(), role })
    }

    /// Whether a template owned by `owner` (`None`: shared) is visible.
    pub fn sees_template(&self, owner: Option<&str>) -> bool {
        owner.is_none_or(|owner| owner == self.tenant)
    }
}

/// 429 when one more sandbox of `wanted` (vCPUs, MiB of memory) would take
/// `tenant` past its sandbox, vCPU or memory quota, given the sandboxes it
/// holds (`held`, the same pairs): a single host's check and a cluster's.
pub fn check_held(tenant: &str, quotas: &Quotas, held: &[(u64, u64)], wanted: (u64, u64)) -> Result<(), NodeError> {
    let vcpus: u64 = held.iter().map(|(v, _)| v).sum();
    let memory: u64 = held.iter().map(|(_, m)| m).sum();
    if let Some(max) = quotas.max_sandboxes.filter(|max| held.len() as u64 >= u64::from(*max)) {
        let why = format!("tenant {tenant:?} may have at most {max} sandboxes; delete one first");
        return Err(quota_exceeded(tenant, "sandboxes", why));
    }
    if let Some(max) = quotas.max_vcpus.filter(|max| vcpus + wanted.0 > u64::from(*max)) {
        let why = format!("tenant {tenant:?} may use at most {max} vCPUs ({vcpus} in use)");
        return Err(quota_exceeded(tenant, "vcpus", why));
    }
    if let Some(max) = quotas.max_memory_mib.filter(|max| memory + wanted.1 > *max) {
        let why = format!("tenant {tenant:?} may use at most {max} MiB of memory ({memory} in use)");
        return Err(quota_exceeded(tenant, "memory_mib", why));
    }
    Ok(())
}

/// Tenant names: short, lowercase, safe in logs and paths.
pub fn valid_tenant(name: &str) -> bool {
    space_host::template::valid_name(name)
}

pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Makes a key for `tenant` (recording the tenant's quotas when given) and
/// returns it with its listing; the key itself is not stored.
pub fn create_key(store: &Store, tenant: &str, quotas: Option<&Quotas>) -> Result<(KeyInfo, String), StoreError> {
    let mut secret = [0u8; 32];
    getrandom::getrandom(&mut secret).expect("the kernel's random source");
    let key = format!("space_{}", secret.iter().map(|b| format!("{b:02x}")).collect::<String>());
    let id = ids::new_id("key");
    let now = ids::now();
    if let Some(quotas) = quotas {
        store.tenancy().put_tenant(tenant, quotas)?;
    }
    store.tenancy().put_key(&id, tenant, &hash_key(&key), now)?;
    Ok((KeyInfo { id, tenant: tenant.to_string(), created_at: now, revoked_at: None }, key))
}

/// The caller a presented key stands for: a tenant's key, if one matches
/// and is not revoked.
pub fn tenant_for_key(store: &Store, presented: &str) -> Result<Option<Caller>, NodeError> {
    if !presented.starts_with("space_") || presented.len() > 128 {
        return Ok(None);
    }
    let tenant = store.tenancy().key_tenant(&hash_key(presented))?;
    Ok(tenant.map(Caller::tenant))
}

/// The sandboxes of `tenant` that hold memory and vCPUs.
fn held(store: &Store, tenant: &str) -> Result<Vec<SandboxRecord>, NodeError> {
    Ok(store
        .node()
        .live_sandboxes()?
        .into_iter()
        .filter(|r| r.tenant == tenant && r.sandbox.state != SandboxState::Failed)
        .collect())
}

/// 429 when `count` more sandboxes of `wanted` (vCPUs, MiB of memory)
/// would take `tenant` past its sandbox, vCPU or memory quota on this host
/// (disk is counted by `disk.rs`).
pub fn check_quotas(
    store: &Store,
    tenant: &str,
    quotas: &Quotas,
    wanted: (u32, u32),
    count: u32,
) -> Result<(), NodeError> {
    if quotas.max_sandboxes.is_none() && quotas.max_vcpus.is_none() && quotas.max_memory_mib.is_none() {
        return Ok(());
    }
    let wanted = (u64::from(wanted.0), u64::from(wanted.1));
    let mut held: Vec<(u64, u64)> =
        held(store, tenant)?.iter().map(|r| (u64::from(r.sandbox.vcpus), u64::from(r.sandbox.memory_mib))).collect();
    // All but the last of several count as held when the last is checked.
    held.extend(std::iter::repeat_n(wanted, count.saturating_sub(1) as usize));
    check_held(tenant, quotas, &held, wanted)
}

/// What `tenant` uses of each quota, given what it holds on disk.
pub fn usage(store: &Store, tenant: &str, disk: space_api::DiskUsage) -> Result<Usage, NodeError> {
    let held = held(store, tenant)?;
    Ok(Usage {
        tenant: tenant.to_string(),
        quotas: quota_limits(&store.tenancy().tenant_quotas(tenant)?),
        sandboxes: held.len() as u32,
        vcpus: held.iter().map(|r| r.sandbox.vcpus).sum(),
        memory_mib: held.iter().map(|r| u64::from(r.sandbox.memory_mib)).sum(),
        disk,
    })
}

/// 429 `quota_exceeded` naming the tenant and the resource.
pub fn quota_exceeded(tenant: &str, resource: &str, message: String) -> NodeError {
    NodeError::new(ErrorCode::QuotaExceeded, message)
        .with_details(serde_json::json!({"tenant": tenant, "resource": resource}))
}

/// A tenant's quotas with their resource names, for the usage report.
pub fn quota_limits(quotas: &Quotas) -> space_api::QuotaLimits {
    space_api::QuotaLimits {
        max_sandboxes: quotas.max_sandboxes,
        max_vcpus: quotas.max_vcpus,
        max_memory_mib: quotas.max_memory_mib,
        max_disk_mib: quotas.max_disk_mib,
    }
}

/// A tenant's disk quota as a cluster's control plane tells a node: the
/// quota, and what the tenant holds on the other nodes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ToldQuota {
    pub max_mib: u64,
    pub elsewhere_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_and_stored_only_hashed() {
        let dir = std::env::temp_dir().join(format!("space-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = Store::open(&dir.join("space.db")).unwrap();
        let (info, key) = create_key(&store, "team-a", None).unwrap();
        let (_, other) = create_key(&store, "team-a", None).unwrap();
        assert_ne!(key, other);
        assert!(key.starts_with("space_") && key.len() == 70, "{key}");
        assert_eq!(store.tenancy().key_tenant(&hash_key(&key)).unwrap().as_deref(), Some("team-a"));
        let db = std::fs::read(dir.join("space.db")).unwrap_or_default();
        let wal = std::fs::read(dir.join("space.db-wal")).unwrap_or_default();
        let needle = key.as_bytes();
        assert!(!db.windows(needle.len()).any(|w| w == needle) && !wal.windows(needle.len()).any(|w| w == needle));
        assert!(store.tenancy().revoke_key(&info.id, space_api::Timestamp::now()).unwrap());
        assert_eq!(store.tenancy().key_tenant(&hash_key(&key)).unwrap(), None);
        assert!(!store.tenancy().revoke_key("key_nope", space_api::Timestamp::now()).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
