//! What a store keeps of tenants: their quotas, their API keys (only
//! hashed) and their secrets, each value sealed by the caller (the keyring
//! stays with the server), bound to its tenant and name, never readable
//! here.

use serde::{Deserialize, Serialize};
use space_api::SecretInfo;

use crate::db::{vals, Conn};
use crate::{Store, StoreError};

/// The tenant of the server's own key (dev key or `--api-key-file`).
pub const OPERATOR_TENANT: &str = "default";

pub(crate) fn operator_tenant() -> String {
    OPERATOR_TENANT.to_string()
}

/// A tenant's quotas (`None`: no limit beyond the host's capacity).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quotas {
    pub max_sandboxes: Option<u32>,
    pub max_vcpus: Option<u32>,
    pub max_memory_mib: Option<u64>,
    /// Host disk in MiB: roots, output, snapshots, templates, uploads.
    #[serde(default)]
    pub max_disk_mib: Option<u64>,
    /// The network of the tenant's sandboxes whose create and template
    /// name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<space_api::Network>,
    /// What its sandboxes may ever be allowed (egress rules; `*`: any
    /// public host); beyond it: 422 `egress_not_permitted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_ceiling: Option<Vec<String>>,
}

/// An API key as listed: never the key itself, which is stored only hashed.
#[derive(Debug, Clone, Serialize)]
pub struct KeyInfo {
    pub id: String,
    pub tenant: String,
    pub created_at: space_api::Timestamp,
    pub revoked_at: Option<space_api::Timestamp>,
}

/// A secret as kept: its hosts, and its value sealed.
pub type SealedSecret = (Vec<String>, Vec<u8>);
/// A sealed secret with its tenant and name.
pub type TenantSecret = (String, String, SealedSecret);

/// Who may do what: tenants and their quotas, API keys, and secrets at rest.
#[derive(Clone, Copy)]
pub struct TenancyStore<'a>(pub(crate) &'a Store);

impl TenancyStore<'_> {
    pub fn put_tenant(&self, name: &str, quotas: &Quotas) -> Result<(), StoreError> {
        let quotas = serde_json::to_string(quotas)?;
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO tenants (name, quotas) VALUES (?1, ?2) ON CONFLICT (name) DO UPDATE SET quotas = excluded.quotas",
                vals![name, quotas],
            )
        })?;
        Ok(())
    }

    pub fn tenant_quotas(&self, name: &str) -> Result<Quotas, StoreError> {
        Ok(self.0.one("SELECT quotas FROM tenants WHERE name = ?1", vals![name])?.unwrap_or_default())
    }

    pub fn put_key(&self, id: &str, tenant: &str, hash: &str, at: space_api::Timestamp) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO api_keys (id, tenant, hash, created_at) VALUES (?1, ?2, ?3, ?4)",
                vals![id, tenant, hash, at],
            )
        })?;
        Ok(())
    }

    /// The tenant of a key that is not revoked, by the key's hash.
    pub fn key_tenant(&self, hash: &str) -> Result<Option<String>, StoreError> {
        self.0.text("SELECT tenant FROM api_keys WHERE hash = ?1 AND revoked_at IS NULL", vals![hash])
    }

    pub fn keys(&self) -> Result<Vec<KeyInfo>, StoreError> {
        let rows = self
            .0
            .tx(|c| c.query("SELECT id, tenant, created_at, revoked_at FROM api_keys ORDER BY created_at, id", &[]))?;
        rows.iter()
            .map(|r| {
                let revoked_at = r.opt_text(3)?.map(|at| crate::time(&at)).transpose()?;
                Ok(KeyInfo { id: r.text(0)?, tenant: r.text(1)?, created_at: crate::time(&r.text(2)?)?, revoked_at })
            })
            .collect()
    }

    /// Revokes a key; false if there is no such key.
    pub fn revoke_key(&self, id: &str, at: space_api::Timestamp) -> Result<bool, StoreError> {
        let changed = self.0.tx(|c| {
            c.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?2) WHERE id = ?1", vals![id, at])
        })?;
        Ok(changed > 0)
    }

    pub fn put_secret(
        &self,
        tenant: &str,
        name: &str,
        hosts: &[String],
        sealed: &[u8],
        at: space_api::Timestamp,
    ) -> Result<(), StoreError> {
        let hosts = serde_json::to_string(hosts)?;
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO secrets (tenant, name, hosts, sealed, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?5)
                 ON CONFLICT (tenant, name) DO UPDATE SET hosts = excluded.hosts, sealed = excluded.sealed,
                 updated_at = excluded.updated_at",
                vals![tenant, name, hosts, sealed, at],
            )?;
            bump_epoch(c)
        })?;
        Ok(())
    }

    /// How many times a cluster's secrets changed (0 outside PostgreSQL).
    pub fn secrets_epoch(&self) -> Result<u64, StoreError> {
        self.0
            .tx(|c| match c.postgres() {
                true => Ok(c
                    .query_one("SELECT epoch FROM secrets_epoch WHERE id = 1", &[])?
                    .map(|r| r.int(0))
                    .transpose()?),
                false => Ok(None),
            })
            .map(|epoch| epoch.unwrap_or(0).max(0) as u64)
    }

    /// Every tenant's secrets (sealed), and the count of changes they are
    /// as of: what a cluster's nodes are sent.
    pub fn all_secrets(&self) -> Result<(u64, Vec<TenantSecret>), StoreError> {
        self.0.tx(|c| {
            let epoch = match c.postgres() {
                true => {
                    c.query_one("SELECT epoch FROM secrets_epoch WHERE id = 1", &[])?.map(|r| r.int(0)).transpose()?
                }
                false => None,
            };
            let rows = c.query("SELECT tenant, name, hosts, sealed FROM secrets ORDER BY tenant, name", &[])?;
            let secrets = rows
                .iter()
                .map(|r| Ok((r.text(0)?, r.text(1)?, (serde_json::from_str(&r.text(2)?)?, r.bytes(3)?))))
                .collect::<Result<Vec<_>, StoreError>>()?;
            Ok((epoch.unwrap_or(0).max(0) as u64, secrets))
        })
    }

    /// Replaces every secret with `secrets` (a node, sent its cluster's).
    pub fn replace_secrets(&self, secrets: &[TenantSecret], at: space_api::Timestamp) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute("DELETE FROM secrets", &[])?;
            for (tenant, name, (hosts, sealed)) in secrets {
                let hosts = serde_json::to_string(hosts)?;
                c.execute(
                    "INSERT INTO secrets (tenant, name, hosts, sealed, created_at, updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?5)",
                    vals![tenant.as_str(), name.as_str(), hosts, sealed.as_slice(), at],
                )?;
            }
            Ok(())
        })
    }

    /// A tenant's secrets, without values.
    pub fn secrets(&self, tenant: &str) -> Result<Vec<SecretInfo>, StoreError> {
        let rows = self.0.tx(|c| {
            c.query(
                "SELECT name, hosts, created_at, updated_at FROM secrets WHERE tenant = ?1 ORDER BY name",
                vals![tenant],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(SecretInfo {
                    name: r.text(0)?,
                    hosts: serde_json::from_str(&r.text(1)?)?,
                    created_at: crate::time(&r.text(2)?)?,
                    updated_at: crate::time(&r.text(3)?)?,
                })
            })
            .collect()
    }

    /// A secret's hosts and sealed value.
    pub fn secret(&self, tenant: &str, name: &str) -> Result<Option<SealedSecret>, StoreError> {
        let row = self.0.tx(|c| {
            c.query_one("SELECT hosts, sealed FROM secrets WHERE tenant = ?1 AND name = ?2", vals![tenant, name])
        })?;
        row.map(|r| Ok((serde_json::from_str(&r.text(0)?)?, r.bytes(1)?))).transpose()
    }

    pub fn delete_secret(&self, tenant: &str, name: &str) -> Result<bool, StoreError> {
        self.0.tx(|c| {
            let gone = c.execute("DELETE FROM secrets WHERE tenant = ?1 AND name = ?2", vals![tenant, name])? > 0;
            if gone {
                bump_epoch(c)?;
            }
            Ok(gone)
        })
    }
}

/// On PostgreSQL (a cluster's store), counts a change of the secrets, so
/// nodes that have an older set are sent the new one.
fn bump_epoch(c: &mut dyn Conn) -> Result<(), StoreError> {
    if c.postgres() {
        c.execute(
            "INSERT INTO secrets_epoch (id, epoch) VALUES (1, 1)
             ON CONFLICT (id) DO UPDATE SET epoch = secrets_epoch.epoch + 1",
            &[],
        )?;
    }
    Ok(())
}
