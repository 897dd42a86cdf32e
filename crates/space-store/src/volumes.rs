//! What a node keeps of its volumes (issue 37, decision 031): one row per
//! live volume, its snapshots beside it. A volume's row is written after
//! its subvolume is made and removed before the subvolume goes, so a crash
//! leaves at most a subvolume no row names, which the sweep at start
//! removes; the same for a snapshot.

use serde::{Deserialize, Serialize};
use space_api::{SnapshotRef, Timestamp};

use crate::db::vals;
use crate::node::NodeStore;
use crate::StoreError;

/// A volume as kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// `vol_…`: its name on disk.
    pub id: String,
    pub tenant: String,
    pub name: String,
    pub size_mib: u32,
    pub created_at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<SnapshotRef>,
}

/// A volume's snapshot as kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub volume_id: String,
    pub name: String,
    pub created_at: Timestamp,
}

impl NodeStore<'_> {
    /// Records a new volume; `false` (nothing written) when the tenant has
    /// one of that name already.
    pub fn insert_volume(&self, volume: &VolumeRecord) -> Result<bool, StoreError> {
        let body = serde_json::to_string(volume)?;
        self.0.tx(|c| {
            let taken = c.query_one(
                "SELECT id FROM volumes WHERE tenant = ?1 AND name = ?2",
                vals![volume.tenant.as_str(), volume.name.as_str()],
            )?;
            if taken.is_some() {
                return Ok(false);
            }
            c.execute(
                "INSERT INTO volumes (id, tenant, name, body) VALUES (?1, ?2, ?3, ?4)",
                vals![volume.id.as_str(), volume.tenant.as_str(), volume.name.as_str(), body.as_str()],
            )?;
            Ok(true)
        })
    }

    /// Records a volume another node handed over, with its snapshots, in
    /// one transaction; `false` (nothing written) when the tenant has one
    /// of that name already. The same volume recorded already is `true`.
    pub fn adopt_volume(&self, volume: &VolumeRecord, snapshots: &[SnapshotRecord]) -> Result<bool, StoreError> {
        let body = serde_json::to_string(volume)?;
        let bodies: Vec<String> = snapshots.iter().map(serde_json::to_string).collect::<Result<_, _>>()?;
        self.0.tx(|c| {
            let taken = c.query_one(
                "SELECT id FROM volumes WHERE tenant = ?1 AND name = ?2",
                vals![volume.tenant.as_str(), volume.name.as_str()],
            )?;
            if let Some(row) = taken {
                return Ok(row.text(0)? == volume.id);
            }
            c.execute(
                "INSERT INTO volumes (id, tenant, name, body) VALUES (?1, ?2, ?3, ?4)",
                vals![volume.id.as_str(), volume.tenant.as_str(), volume.name.as_str(), body.as_str()],
            )?;
            for (snapshot, body) in snapshots.iter().zip(&bodies) {
                c.execute(
                    "INSERT INTO volume_snapshots (volume_id, name, body) VALUES (?1, ?2, ?3)",
                    vals![volume.id.as_str(), snapshot.name.as_str(), body.as_str()],
                )?;
            }
            Ok(true)
        })
    }

    /// The tenant's volume of that name.
    pub fn volume_named(&self, tenant: &str, name: &str) -> Result<Option<VolumeRecord>, StoreError> {
        self.0.one("SELECT body FROM volumes WHERE tenant = ?1 AND name = ?2", vals![tenant, name])
    }

    /// A tenant's volumes by name.
    pub fn tenant_volumes(&self, tenant: &str) -> Result<Vec<VolumeRecord>, StoreError> {
        self.0.many("SELECT body FROM volumes WHERE tenant = ?1 ORDER BY name", vals![tenant])
    }

    /// Every volume of every tenant (for the sweep at start and disk use).
    pub fn all_volumes(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        self.0.many("SELECT body FROM volumes ORDER BY id", &[])
    }

    /// Forgets a volume and its snapshots (before their subvolumes go).
    pub fn delete_volume(&self, id: &str) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute("DELETE FROM volume_snapshots WHERE volume_id = ?1", vals![id])?;
            c.execute("DELETE FROM volumes WHERE id = ?1", vals![id])
        })?;
        Ok(())
    }

    /// Records a snapshot; `false` when the volume has one of that name.
    pub fn insert_volume_snapshot(&self, snapshot: &SnapshotRecord) -> Result<bool, StoreError> {
        let body = serde_json::to_string(snapshot)?;
        self.0.tx(|c| {
            let taken = c.query_one(
                "SELECT name FROM volume_snapshots WHERE volume_id = ?1 AND name = ?2",
                vals![snapshot.volume_id.as_str(), snapshot.name.as_str()],
            )?;
            if taken.is_some() {
                return Ok(false);
            }
            c.execute(
                "INSERT INTO volume_snapshots (volume_id, name, body) VALUES (?1, ?2, ?3)",
                vals![snapshot.volume_id.as_str(), snapshot.name.as_str(), body.as_str()],
            )?;
            Ok(true)
        })
    }

    /// A volume's snapshots, oldest first.
    pub fn volume_snapshots(&self, volume_id: &str) -> Result<Vec<SnapshotRecord>, StoreError> {
        let mut snapshots: Vec<SnapshotRecord> =
            self.0.many("SELECT body FROM volume_snapshots WHERE volume_id = ?1", vals![volume_id])?;
        snapshots.sort_by(|a, b| a.created_at.cmp(&b.created_at).then_with(|| a.name.cmp(&b.name)));
        Ok(snapshots)
    }

    pub fn delete_volume_snapshot(&self, volume_id: &str, name: &str) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute("DELETE FROM volume_snapshots WHERE volume_id = ?1 AND name = ?2", vals![volume_id, name])
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Store;

    fn volume(tenant: &str, name: &str, id: &str) -> VolumeRecord {
        VolumeRecord {
            id: id.into(),
            tenant: tenant.into(),
            name: name.into(),
            size_mib: 64,
            created_at: Timestamp::now(),
            from_snapshot: None,
        }
    }

    #[test]
    fn names_are_unique_within_a_tenant_and_snapshots_go_with_their_volume() {
        let store = Store::open(std::path::Path::new(":memory:")).unwrap();
        let node = store.node();
        assert!(node.insert_volume(&volume("t1", "ws", "vol_1")).unwrap());
        assert!(!node.insert_volume(&volume("t1", "ws", "vol_2")).unwrap(), "a second ws of t1");
        assert!(node.insert_volume(&volume("t2", "ws", "vol_3")).unwrap(), "t2's own ws");
        assert_eq!(node.volume_named("t1", "ws").unwrap().unwrap().id, "vol_1");
        assert_eq!(node.tenant_volumes("t2").unwrap().len(), 1);
        let snap = SnapshotRecord { volume_id: "vol_1".into(), name: "s1".into(), created_at: Timestamp::now() };
        assert!(node.insert_volume_snapshot(&snap).unwrap());
        assert!(!node.insert_volume_snapshot(&snap).unwrap());
        assert_eq!(node.volume_snapshots("vol_1").unwrap(), vec![snap]);
        node.delete_volume("vol_1").unwrap();
        assert!(node.volume_named("t1", "ws").unwrap().is_none());
        assert!(node.volume_snapshots("vol_1").unwrap().is_empty());
        assert!(node.insert_volume(&volume("t1", "ws", "vol_4")).unwrap(), "the name is free again");
    }
}
