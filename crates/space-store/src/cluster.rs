//! What the control plane of a cluster keeps (decision 009): the nodes with
//! their leases, and where each sandbox, operation and volume lives. Its
//! tables are in the first migration of each dialect, but for the
//! volumes' (`volume_nodes`, migration 3).

use super::db::{vals, Conn};
use super::{Store, StoreError};

/// A node as the control plane knows it.
#[derive(Debug, Clone)]
pub struct NodeRow {
    pub id: String,
    pub url: String,
    pub lease_until_ms: i64,
    /// Its last report (JSON).
    pub report: String,
}

/// Where a sandbox lives, and its object as the control plane last saw it.
#[derive(Debug, Clone)]
pub struct Placement {
    pub node_id: String,
    pub tenant: String,
    pub sandbox: String,
    /// When the control plane placed it (ms since the epoch).
    pub placed_at_ms: i64,
}

/// The node that holds a tenant's volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeNode {
    pub tenant: String,
    pub name: String,
    pub node_id: String,
    /// When the control plane claimed the name (ms since the epoch).
    pub created_at_ms: i64,
    /// Until when a move holds it (ms since the epoch; 0 or past: none).
    pub moving_until_ms: i64,
}

const VOLUME_NODE: &str = "SELECT tenant, name, node_id, created_at_ms, moving_until_ms FROM volume_nodes";

fn volume_nodes_of(c: &mut dyn Conn, filter: &str, values: &[super::db::Value]) -> Result<Vec<VolumeNode>, StoreError> {
    c.query(&format!("{VOLUME_NODE} {filter}"), values)?
        .iter()
        .map(|r| {
            Ok(VolumeNode {
                tenant: r.text(0)?,
                name: r.text(1)?,
                node_id: r.text(2)?,
                created_at_ms: r.int(3)?,
                moving_until_ms: r.int(4)?,
            })
        })
        .collect()
}

const PLACEMENT: &str = "SELECT node_id, tenant, sandbox, placed_at_ms FROM placements";

fn placements_of(c: &mut dyn Conn, filter: &str, values: &[super::db::Value]) -> Result<Vec<Placement>, StoreError> {
    c.query(&format!("{PLACEMENT} {filter}"), values)?
        .iter()
        .map(|r| {
            Ok(Placement { node_id: r.text(0)?, tenant: r.text(1)?, sandbox: r.text(2)?, placed_at_ms: r.int(3)? })
        })
        .collect()
}

fn node_row(c: &mut dyn Conn, sql: &str, values: &[super::db::Value]) -> Result<Vec<NodeRow>, StoreError> {
    c.query(sql, values)?
        .iter()
        .map(|r| Ok(NodeRow { id: r.text(0)?, url: r.text(1)?, lease_until_ms: r.int(2)?, report: r.text(3)? }))
        .collect()
}

/// A control plane's tables: nodes and their leases, where each sandbox and operation was placed, template pulls and event feeds.
#[derive(Clone, Copy)]
pub struct ClusterStore<'a>(pub(crate) &'a Store);

impl ClusterStore<'_> {
    /// A node's heartbeat: its address and report, and a lease until then.
    pub fn heartbeat_node(&self, id: &str, url: &str, report: &str, lease_until_ms: i64) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO nodes (id, url, lease_until_ms, report) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (id) DO UPDATE SET url = excluded.url, lease_until_ms = excluded.lease_until_ms,
                 report = excluded.report",
                vals![id, url, lease_until_ms, report],
            )
        })?;
        Ok(())
    }

    pub fn nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        self.0.tx(|c| node_row(c, "SELECT id, url, lease_until_ms, report FROM nodes ORDER BY id", &[]))
    }

    pub fn node(&self, id: &str) -> Result<Option<NodeRow>, StoreError> {
        Ok(self
            .0
            .tx(|c| node_row(c, "SELECT id, url, lease_until_ms, report FROM nodes WHERE id = ?1", vals![id]))?
            .into_iter()
            .next())
    }

    /// Records (or refreshes) where a sandbox lives; placed at `now_ms`
    /// if new.
    pub fn put_placement(
        &self,
        sandbox_id: &str,
        node_id: &str,
        tenant: &str,
        sandbox: &str,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO placements (sandbox_id, node_id, tenant, sandbox, placed_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (sandbox_id) DO UPDATE SET sandbox = excluded.sandbox",
                vals![sandbox_id, node_id, tenant, sandbox, now_ms],
            )
        })?;
        Ok(())
    }

    pub fn placement(&self, sandbox_id: &str) -> Result<Option<Placement>, StoreError> {
        Ok(self.0.tx(|c| placements_of(c, "WHERE sandbox_id = ?1", vals![sandbox_id]))?.into_iter().next())
    }

    /// A tenant's placements.
    pub fn placements(&self, tenant: &str) -> Result<Vec<Placement>, StoreError> {
        self.0.tx(|c| placements_of(c, "WHERE tenant = ?1", vals![tenant]))
    }

    /// The placements on a node made after `since_ms` (what its last
    /// report cannot have counted yet).
    pub fn placements_since(&self, node_id: &str, since_ms: i64) -> Result<Vec<Placement>, StoreError> {
        self.0.tx(|c| placements_of(c, "WHERE node_id = ?1 AND placed_at_ms > ?2", vals![node_id, since_ms]))
    }

    /// The node a create with this Idempotency-Key goes to: the one
    /// recorded first, by whichever replica, else `node_id` (now recorded).
    pub fn create_key_node(&self, tenant: &str, key: &str, node_id: &str) -> Result<String, StoreError> {
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO create_keys (tenant, idempotency_key, node_id) VALUES (?1, ?2, ?3)
                 ON CONFLICT (tenant, idempotency_key) DO NOTHING",
                vals![tenant, key, node_id],
            )?;
            let row = c.query_one(
                "SELECT node_id FROM create_keys WHERE tenant = ?1 AND idempotency_key = ?2",
                vals![tenant, key],
            )?;
            row.map(|r| r.text(0)).transpose()?.ok_or_else(|| StoreError::Shape("a create key vanished".into()))
        })
    }

    /// Claims asking `node_id` to pull template `name` until `now_ms + for_ms`;
    /// false if another replica's claim still holds.
    pub fn claim_template_pull(&self, node_id: &str, name: &str, now_ms: i64, for_ms: i64) -> Result<bool, StoreError> {
        let claimed = self.0.tx(|c| {
            c.query(
                "INSERT INTO template_pulls (node_id, name, until_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT (node_id, name) DO UPDATE SET until_ms = excluded.until_ms
                 WHERE template_pulls.until_ms < ?4 RETURNING node_id",
                vals![node_id, name, now_ms + for_ms, now_ms],
            )
        })?;
        Ok(!claimed.is_empty())
    }

    /// Claims following node `node_id`'s events for `owner` (a replica)
    /// until `until_ms`, if nobody else's claim holds at `now_ms`; the id of
    /// the node's last event already taken in.
    pub fn claim_feed(
        &self,
        node_id: &str,
        owner: &str,
        now_ms: i64,
        until_ms: i64,
    ) -> Result<Option<u64>, StoreError> {
        let row = self.0.tx(|c| {
            c.query_one(
                "INSERT INTO node_feeds (node_id, last_seq, owner, until_ms) VALUES (?1, 0, ?2, ?3)
                 ON CONFLICT (node_id) DO UPDATE SET owner = excluded.owner, until_ms = excluded.until_ms
                 WHERE node_feeds.owner = ?2 OR node_feeds.until_ms < ?4 RETURNING last_seq",
                vals![node_id, owner, until_ms, now_ms],
            )
        })?;
        row.map(|r| Ok(r.int(0)?.max(0) as u64)).transpose()
    }

    /// Marks a node's sandboxes as announced lost (`lost`) or back; true
    /// for the one caller that changed it, which announces it.
    pub fn mark_feed_lost(&self, node_id: &str, lost: bool) -> Result<bool, StoreError> {
        let (to, from): (i64, i64) = if lost { (1, 0) } else { (0, 1) };
        Ok(self.0.tx(|c| {
            c.execute("UPDATE node_feeds SET lost = ?1 WHERE node_id = ?2 AND lost = ?3", vals![to, node_id, from])
        })? > 0)
    }

    /// The placements on a node.
    pub fn placements_on(&self, node_id: &str) -> Result<Vec<Placement>, StoreError> {
        self.0.tx(|c| placements_of(c, "WHERE node_id = ?1", vals![node_id]))
    }

    /// Keeps every replica from asking `node_ids` to pull template `name`
    /// until `until_ms` (it is being deleted).
    pub fn hold_template_pulls(&self, node_ids: &[String], name: &str, until_ms: i64) -> Result<(), StoreError> {
        self.0.tx(|c| {
            for node in node_ids {
                c.execute(
                    "INSERT INTO template_pulls (node_id, name, until_ms) VALUES (?1, ?2, ?3)
                     ON CONFLICT (node_id, name) DO UPDATE SET until_ms = excluded.until_ms
                     WHERE template_pulls.until_ms < excluded.until_ms",
                    vals![node.as_str(), name, until_ms],
                )?;
            }
            Ok(())
        })
    }

    pub fn put_operation_node(&self, operation_id: &str, node_id: &str, tenant: &str) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO operation_nodes (operation_id, node_id, tenant) VALUES (?1, ?2, ?3)
                 ON CONFLICT (operation_id) DO NOTHING",
                vals![operation_id, node_id, tenant],
            )
        })?;
        Ok(())
    }

    /// The node and tenant of an operation.
    pub fn operation_node(&self, operation_id: &str) -> Result<Option<(String, String)>, StoreError> {
        let row = self.0.tx(|c| {
            c.query_one("SELECT node_id, tenant FROM operation_nodes WHERE operation_id = ?1", vals![operation_id])
        })?;
        row.map(|r| Ok((r.text(0)?, r.text(1)?))).transpose()
    }

    /// Claims volume `name` of `tenant` for `node_id` before the node is
    /// asked to make it; `false` if the tenant already has a volume of
    /// that name (recorded by any replica).
    pub fn claim_volume(&self, tenant: &str, name: &str, node_id: &str, now_ms: i64) -> Result<bool, StoreError> {
        let claimed = self.0.tx(|c| {
            c.execute(
                "INSERT INTO volume_nodes (tenant, name, node_id, created_at_ms) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (tenant, name) DO NOTHING",
                vals![tenant, name, node_id, now_ms],
            )
        })?;
        Ok(claimed > 0)
    }

    pub fn volume_node(&self, tenant: &str, name: &str) -> Result<Option<VolumeNode>, StoreError> {
        Ok(self
            .0
            .tx(|c| volume_nodes_of(c, "WHERE tenant = ?1 AND name = ?2", vals![tenant, name]))?
            .into_iter()
            .next())
    }

    /// A tenant's volumes, by name.
    pub fn volume_nodes(&self, tenant: &str) -> Result<Vec<VolumeNode>, StoreError> {
        self.0.tx(|c| volume_nodes_of(c, "WHERE tenant = ?1 ORDER BY name", vals![tenant]))
    }

    /// Forgets volume `name` of `tenant` if it is still recorded on
    /// `node_id` as first claimed at `created_at_ms` (a volume of the
    /// same name made again since, or moved, stays); whether it did.
    pub fn forget_volume(
        &self,
        tenant: &str,
        name: &str,
        node_id: &str,
        created_at_ms: i64,
    ) -> Result<bool, StoreError> {
        let removed = self.0.tx(|c| {
            c.execute(
                "DELETE FROM volume_nodes WHERE tenant = ?1 AND name = ?2 AND node_id = ?3 AND created_at_ms = ?4",
                vals![tenant, name, node_id, created_at_ms],
            )
        })?;
        Ok(removed > 0)
    }

    /// Holds volume `name` of `tenant` on `node_id` for a move until
    /// `until_ms`, if no other move holds it at `now_ms`; renewing a hold
    /// is claiming it again with the same `node_id` while it still holds
    /// (`renew`). Whether it holds now.
    pub fn hold_volume_move(
        &self,
        tenant: &str,
        name: &str,
        node_id: &str,
        now_ms: i64,
        until_ms: i64,
        renew: bool,
    ) -> Result<bool, StoreError> {
        let held = self.0.tx(|c| {
            let condition = if renew { "moving_until_ms >= ?4" } else { "moving_until_ms < ?4" };
            c.execute(
                &format!(
                    "UPDATE volume_nodes SET moving_until_ms = ?5
                     WHERE tenant = ?1 AND name = ?2 AND node_id = ?3 AND {condition}"
                ),
                vals![tenant, name, node_id, now_ms, until_ms],
            )
        })?;
        Ok(held > 0)
    }

    /// Records that volume `name` of `tenant` is on `to` now, if it was
    /// on `from` (a move's hold, if any, stays); whether it was.
    pub fn relocate_volume(&self, tenant: &str, name: &str, from: &str, to: &str) -> Result<bool, StoreError> {
        let moved = self.0.tx(|c| {
            c.execute(
                "UPDATE volume_nodes SET node_id = ?4 WHERE tenant = ?1 AND name = ?2 AND node_id = ?3",
                vals![tenant, name, from, to],
            )
        })?;
        Ok(moved > 0)
    }

    /// Ends a move's hold on volume `name` of `tenant`, wherever it is.
    pub fn release_volume_move(&self, tenant: &str, name: &str) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute(
                "UPDATE volume_nodes SET moving_until_ms = 0 WHERE tenant = ?1 AND name = ?2",
                vals![tenant, name],
            )
        })?;
        Ok(())
    }
}
