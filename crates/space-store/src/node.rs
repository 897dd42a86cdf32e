//! What a node keeps of its sandboxes: their records, operations, commands
//! and the streams to pick them up again, code contexts and the egress
//! log. A change of state, an operation and a command's start and end are
//! also events, written in the change's own transaction.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use space_api::{Command, EventType, Operation, Sandbox};

use crate::db::{vals, Row};
use crate::tenancy::operator_tenant;
use crate::{events, Store, StoreError};

/// What the server keeps about a sandbox beyond its API object.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub sandbox: Sandbox,
    pub template_version: u32,
    /// The sandbox-wide environment; never returned by the API.
    pub env: BTreeMap<String, String>,
    /// The host session its agent knows; a restarted server reuses it to
    /// re-adopt the sandbox with its command streams.
    #[serde(default)]
    pub agent_session: Option<u64>,
    /// The key its agent presents when it dials again (after a resume or a
    /// server restart); never returned by the API.
    #[serde(default)]
    pub channel_key: Option<String>,
    /// The tenant that owns it; records from before tenants are the operator's.
    #[serde(default = "crate::tenancy::operator_tenant")]
    pub tenant: String,
    /// The sandbox's egress CA: its certificate (which the sandbox
    /// trusts) and its key, sealed; never returned by the API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_ca: Option<EgressCa>,
    /// The id of each volume in `sandbox.volumes`, in its order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_ids: Vec<String>,
}

/// Who may open a sandbox's ports on its preview host name without its
/// preview token or a signed link: the ports made public, or every port
/// (an E2B sandbox created with public traffic).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortAccess {
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub public: std::collections::BTreeSet<u16>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all_public: bool,
}

impl PortAccess {
    pub fn is_public(&self, port: u16) -> bool {
        self.all_public || self.public.contains(&port)
    }
}

/// A sandbox's egress CA as kept.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EgressCa {
    pub cert_pem: String,
    /// The key's PEM, sealed with the server's keyring (base64).
    pub key_sealed: String,
}

impl SandboxRecord {
    /// Records what the host needs to take its agent back later: the
    /// session and the channel key of this handshake.
    pub fn remember_agent(&mut self, welcome: &space_proto::Welcome) {
        self.agent_session = Some(welcome.session);
        self.channel_key = welcome.channel_key.clone();
    }
}

#[cfg(any(test, feature = "testing"))]
impl SandboxRecord {
    /// A record for unit tests of policies: created and last active when
    /// given, with this lifecycle.
    pub fn sample(
        state: space_api::SandboxState,
        lifecycle: space_api::Lifecycle,
        created: &str,
        active: &str,
    ) -> SandboxRecord {
        SandboxRecord {
            sandbox: Sandbox {
                id: "sbx_1".into(),
                template: "base".into(),
                state,
                vcpus: 1,
                memory_mib: 256,
                disk_mib: 1024,
                labels: BTreeMap::new(),
                engine: "gvisor".into(),
                created_at: space_api::Timestamp::parse(created).expect("a sample's time"),
                updated_at: space_api::Timestamp::parse(created).expect("a sample's time"),
                lifecycle,
                network: space_api::Network::default(),
                volumes: Vec::new(),
                last_activity_at: space_api::Timestamp::parse(active).expect("a sample's time"),
                auto_paused: false,
                failure_reason: None,
                forked_from: None,
                node: None,
            },
            template_version: 1,
            env: BTreeMap::new(),
            agent_session: None,
            channel_key: None,
            egress_ca: None,
            tenant: "default".into(),
            volume_ids: Vec::new(),
        }
    }
}

type SandboxRow = (String, Option<String>, Option<String>, Option<String>);

fn sandbox_from_row((body, last_activity, network, lifecycle): SandboxRow) -> Result<SandboxRecord, StoreError> {
    let mut record: SandboxRecord = serde_json::from_str(&body)?;
    if let Some(lifecycle) = lifecycle {
        record.sandbox.lifecycle = serde_json::from_str(&lifecycle)?;
    }
    if let Some(at) = last_activity {
        record.sandbox.last_activity_at = crate::time(&at)?;
    }
    if let Some(network) = network {
        record.sandbox.network = serde_json::from_str(&network)?;
    }
    Ok(record)
}

const LIVE_SANDBOXES: &str =
    "SELECT body, last_activity_at, network, lifecycle FROM sandboxes WHERE state <> 'deleted' ORDER BY seq";

/// Egress events kept per sandbox (the oldest go first).
pub const EGRESS_EVENTS_KEPT: u32 = 10_000;

/// A node's own tables: its sandboxes, their operations, commands, code contexts and egress log.
#[derive(Clone, Copy)]
pub struct NodeStore<'a>(pub(crate) &'a Store);

impl NodeStore<'_> {
    /// Records a sandbox; a new one, or one in another state than before,
    /// is also an event (in the same transaction).
    pub fn put_sandbox(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        let body = serde_json::to_string(record)?;
        let id = &record.sandbox.id;
        let state = record.sandbox.state.as_str();
        let recording = self.0.recording();
        let event = self.0.tx(|c| {
            let before = c.query_one("SELECT state FROM sandboxes WHERE id = ?1", vals![id])?;
            let before = before.map(|r| r.text(0)).transpose()?;
            c.execute(
                "INSERT INTO sandboxes (id, seq, state, body, tenant)
                 VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM sandboxes), ?2, ?3, ?4)
                 ON CONFLICT (id) DO UPDATE SET state = excluded.state, body = excluded.body",
                vals![id, state, body.as_str(), record.tenant.as_str()],
            )?;
            if !recording || before.as_deref() == Some(state) {
                return Ok(None);
            }
            // As the API shows it: the columns kept apart win over the body.
            let row = c
                .query_one("SELECT body, last_activity_at, network, lifecycle FROM sandboxes WHERE id = ?1", vals![id])?
                .ok_or_else(|| StoreError::Shape("a sandbox vanished inside its own write".into()))?;
            let sandbox = sandbox_from_row(sandbox_row(&row)?)?.sandbox;
            let mut item = events::new_event(EventType::SandboxState, Some(id));
            item.sandbox = Some(sandbox);
            events::insert(c, &record.tenant, &item).map(Some)
        })?;
        self.0.announce(event);
        Ok(())
    }

    pub fn sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let row = self.0.tx(|c| {
            c.query_one("SELECT body, last_activity_at, network, lifecycle FROM sandboxes WHERE id = ?1", vals![id])
        })?;
        row.map(|r| sandbox_from_row(sandbox_row(&r)?)).transpose()
    }

    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = self
            .0
            .tx(|c| c.query("SELECT body, last_activity_at, network, lifecycle FROM sandboxes ORDER BY seq", &[]))?;
        rows.iter().map(|r| sandbox_from_row(sandbox_row(r)?)).collect()
    }

    /// Every sandbox but the deleted ones, oldest first: what capacity,
    /// quotas and the once-a-second policies look at. Deleted records stay
    /// for their history and would otherwise be read (and parsed) on every
    /// create; a partial index keeps this to the live rows.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = self.0.tx(|c| c.query(LIVE_SANDBOXES, &[]))?;
        rows.iter().map(|r| sandbox_from_row(sandbox_row(r)?)).collect()
    }

    /// Records activity (a command started or ended) without touching the
    /// record the sandbox's actor owns.
    pub fn touch_sandbox(&self, id: &str, at: space_api::Timestamp) -> Result<(), StoreError> {
        self.0.tx(|c| c.execute("UPDATE sandboxes SET last_activity_at = ?2 WHERE id = ?1", vals![id, at]))?;
        Ok(())
    }

    /// Replaces a sandbox's network policy without touching the record the
    /// sandbox's actor owns (the column wins over the body's copy).
    pub fn set_sandbox_network(&self, id: &str, network: &space_api::Network) -> Result<bool, StoreError> {
        let json = serde_json::to_string(network)?;
        Ok(self.0.tx(|c| c.execute("UPDATE sandboxes SET network = ?2 WHERE id = ?1", vals![id, json]))? > 0)
    }

    /// Replaces a sandbox's lifecycle policies without touching the record
    /// the sandbox's actor owns (the column wins over the body's copy).
    pub fn set_sandbox_lifecycle(&self, id: &str, lifecycle: &space_api::Lifecycle) -> Result<bool, StoreError> {
        let json = serde_json::to_string(lifecycle)?;
        Ok(self.0.tx(|c| c.execute("UPDATE sandboxes SET lifecycle = ?2 WHERE id = ?1", vals![id, json]))? > 0)
    }

    /// Who may open the sandbox's ports on its preview host name (all
    /// private when never set); `None`: no such sandbox.
    pub fn port_access(&self, id: &str) -> Result<Option<PortAccess>, StoreError> {
        let row = self.0.tx(|c| c.query_one("SELECT port_access FROM sandboxes WHERE id = ?1", vals![id]))?;
        let Some(row) = row else { return Ok(None) };
        match row.opt_text(0)? {
            Some(json) => Ok(Some(serde_json::from_str(&json)?)),
            None => Ok(Some(PortAccess::default())),
        }
    }

    /// Replaces who may open the sandbox's ports, without touching the
    /// record the sandbox's actor owns; false: no such sandbox.
    pub fn set_port_access(&self, id: &str, access: &PortAccess) -> Result<bool, StoreError> {
        let json = serde_json::to_string(access)?;
        Ok(self.0.tx(|c| c.execute("UPDATE sandboxes SET port_access = ?2 WHERE id = ?1", vals![id, json]))? > 0)
    }

    /// Records an operation; `tenant` and the key are kept from the first write.
    pub fn put_operation(
        &self,
        operation: &Operation,
        tenant: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(), StoreError> {
        let body = serde_json::to_string(operation)?;
        let recording = self.0.recording();
        let event = self.0.tx(|c| {
            c.execute(
                "INSERT INTO operations (id, seq, sandbox_id, idempotency_key, body, tenant)
                 VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM operations), ?2, ?3, ?4, ?5)
                 ON CONFLICT (id) DO UPDATE SET body = excluded.body",
                vals![operation.id.as_str(), operation.sandbox_id.as_deref(), idempotency_key, body.as_str(), tenant],
            )?;
            if !recording {
                return Ok(None);
            }
            let tenant = c
                .query_one("SELECT tenant FROM operations WHERE id = ?1", vals![operation.id.as_str()])?
                .map(|r| r.text(0))
                .transpose()?
                .unwrap_or_default();
            let kind = match operation.state.is_terminal() {
                true => EventType::OperationFinished,
                false => EventType::OperationProgress,
            };
            let mut item = events::new_event(kind, operation.sandbox_id.as_deref());
            item.operation = Some(operation.clone());
            events::insert(c, &tenant, &item).map(Some)
        })?;
        self.0.announce(event);
        Ok(())
    }

    /// The tenant that owns a sandbox, without reading the whole record
    /// (asked on every request naming a sandbox).
    pub fn sandbox_tenant(&self, id: &str) -> Result<Option<String>, StoreError> {
        let row = self.0.tx(|c| c.query_one("SELECT tenant FROM sandboxes WHERE id = ?1", vals![id]))?;
        row.map(|r| Ok(r.opt_text(0)?.unwrap_or_else(operator_tenant))).transpose()
    }

    /// The tenant that owns an operation.
    pub fn operation_tenant(&self, id: &str) -> Result<Option<String>, StoreError> {
        self.0.text("SELECT tenant FROM operations WHERE id = ?1", vals![id])
    }

    pub fn operation(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        self.0.one("SELECT body FROM operations WHERE id = ?1", vals![id])
    }

    pub fn operation_by_key(&self, tenant: &str, key: &str) -> Result<Option<Operation>, StoreError> {
        self.0.one("SELECT body FROM operations WHERE tenant = ?1 AND idempotency_key = ?2", vals![tenant, key])
    }

    pub fn operations(&self, sandbox_id: Option<&str>) -> Result<Vec<Operation>, StoreError> {
        match sandbox_id {
            Some(id) => self.0.many("SELECT body FROM operations WHERE sandbox_id = ?1 ORDER BY seq", vals![id]),
            None => self.0.many("SELECT body FROM operations ORDER BY seq", &[]),
        }
    }

    /// A tenant's operations, optionally of one sandbox.
    pub fn tenant_operations(&self, tenant: &str, sandbox_id: Option<&str>) -> Result<Vec<Operation>, StoreError> {
        match sandbox_id {
            Some(id) => self.0.many(
                "SELECT body FROM operations WHERE tenant = ?1 AND sandbox_id = ?2 ORDER BY seq",
                vals![tenant, id],
            ),
            None => self.0.many("SELECT body FROM operations WHERE tenant = ?1 ORDER BY seq", vals![tenant]),
        }
    }

    /// Records a command; its start and its end are also events.
    pub fn put_command(&self, command: &Command) -> Result<(), StoreError> {
        let body = serde_json::to_string(command)?;
        let recording = self.0.recording();
        let event = self.0.tx(|c| {
            let before = c.query_one("SELECT body FROM commands WHERE id = ?1", vals![command.id.as_str()])?;
            let ended_before = match before {
                Some(row) => Some(serde_json::from_str::<Command>(&row.text(0)?)?.result.is_some()),
                None => None,
            };
            c.execute(
                "INSERT INTO commands (id, seq, sandbox_id, body)
                 VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM commands), ?2, ?3)
                 ON CONFLICT (id) DO UPDATE SET body = excluded.body",
                vals![command.id.as_str(), command.sandbox_id.as_str(), body.as_str()],
            )?;
            let kind = match ended_before {
                None if command.result.is_none() => EventType::CommandStarted,
                Some(false) | None if command.result.is_some() => EventType::CommandExited,
                _ => return Ok(None),
            };
            if !recording {
                return Ok(None);
            }
            let tenant =
                c.query_one("SELECT tenant FROM sandboxes WHERE id = ?1", vals![command.sandbox_id.as_str()])?;
            let tenant = tenant.map(|r| r.opt_text(0)).transpose()?.flatten().unwrap_or_else(operator_tenant);
            let mut item = events::new_event(kind, Some(&command.sandbox_id));
            item.command = Some(command.clone());
            events::insert(c, &tenant, &item).map(Some)
        })?;
        self.0.announce(event);
        Ok(())
    }

    pub fn put_command_stream(&self, command_id: &str, stream: u32, timeout_s: u64) -> Result<(), StoreError> {
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO command_streams (command_id, stream, timeout_s) VALUES (?1, ?2, ?3)
                 ON CONFLICT (command_id) DO UPDATE SET stream = excluded.stream, timeout_s = excluded.timeout_s",
                vals![command_id, stream, timeout_s],
            )
        })?;
        Ok(())
    }

    /// Records a code context of `sandbox_id` (`body`: what picking it up
    /// again needs).
    pub fn put_context(&self, id: &str, sandbox_id: &str, body: &serde_json::Value) -> Result<(), StoreError> {
        let body = body.to_string();
        self.0.tx(|c| {
            c.execute(
                "INSERT INTO contexts (id, sandbox_id, body) VALUES (?1, ?2, ?3)
                 ON CONFLICT (id) DO UPDATE SET body = excluded.body",
                vals![id, sandbox_id, body],
            )
        })?;
        Ok(())
    }

    pub fn delete_context(&self, id: &str) -> Result<(), StoreError> {
        self.0.tx(|c| c.execute("DELETE FROM contexts WHERE id = ?1", vals![id]))?;
        Ok(())
    }

    /// A sandbox's recorded code contexts.
    pub fn contexts(&self, sandbox_id: &str) -> Result<Vec<serde_json::Value>, StoreError> {
        self.0.many("SELECT body FROM contexts WHERE sandbox_id = ?1 ORDER BY id", vals![sandbox_id])
    }

    /// Records an egress event, keeping the newest [`EGRESS_EVENTS_KEPT`].
    pub fn put_egress_event(&self, sandbox_id: &str, event: &space_api::EgressEvent) -> Result<(), StoreError> {
        let body = serde_json::to_string(event)?;
        self.0.tx(|c| {
            c.execute("INSERT INTO egress_events (sandbox_id, body) VALUES (?1, ?2)", vals![sandbox_id, body])?;
            c.execute(
                "DELETE FROM egress_events WHERE sandbox_id = ?1 AND seq <= (SELECT seq FROM egress_events \
                 WHERE sandbox_id = ?1 ORDER BY seq DESC LIMIT 1 OFFSET ?2)",
                vals![sandbox_id, EGRESS_EVENTS_KEPT],
            )
        })?;
        Ok(())
    }

    /// A sandbox's egress events, oldest first: the newest `limit`.
    pub fn egress_events(&self, sandbox_id: &str, limit: u32) -> Result<Vec<space_api::EgressEvent>, StoreError> {
        self.0.many(
            "SELECT body FROM (SELECT seq, body FROM egress_events WHERE sandbox_id = ?1 ORDER BY seq DESC LIMIT ?2) \
             AS newest ORDER BY seq",
            vals![sandbox_id, limit],
        )
    }

    /// The agent stream and timeout of a command, if recorded.
    pub fn command_stream(&self, command_id: &str) -> Result<Option<(u32, u64)>, StoreError> {
        let row = self.0.tx(|c| {
            c.query_one("SELECT stream, timeout_s FROM command_streams WHERE command_id = ?1", vals![command_id])
        })?;
        row.map(|r| Ok((r.int(0)?.clamp(0, u32::MAX.into()) as u32, r.int(1)?.max(0) as u64))).transpose()
    }

    pub fn command(&self, id: &str) -> Result<Option<Command>, StoreError> {
        self.0.one("SELECT body FROM commands WHERE id = ?1", vals![id])
    }

    pub fn commands(&self, sandbox_id: &str) -> Result<Vec<Command>, StoreError> {
        self.0.many("SELECT body FROM commands WHERE sandbox_id = ?1 ORDER BY seq", vals![sandbox_id])
    }
}

fn sandbox_row(row: &Row) -> Result<SandboxRow, StoreError> {
    Ok((row.text(0)?, row.opt_text(1)?, row.opt_text(2)?, row.opt_text(3)?))
}

#[cfg(test)]
mod tests {
    use space_api::{Lifecycle, SandboxState};

    use super::*;
    use crate::db::Db;

    #[test]
    fn live_sandboxes_and_inserts_read_indexes_not_every_record_ever_kept() {
        let store = Store::open(std::path::Path::new(":memory:")).unwrap();
        let states = [SandboxState::Running, SandboxState::Deleted, SandboxState::Paused, SandboxState::Failed];
        for (n, state) in states.into_iter().enumerate() {
            let lifecycle = Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: None, auto_pause: None };
            let mut record = SandboxRecord::sample(state, lifecycle, "2026-01-01T00:00:00Z", "2026-01-01T00:00:00Z");
            record.sandbox.id = format!("sbx_{n}");
            store.node().put_sandbox(&record).unwrap();
        }
        let ids = |records: Vec<SandboxRecord>| records.into_iter().map(|r| r.sandbox.id).collect::<Vec<_>>();
        assert_eq!(ids(store.node().live_sandboxes().unwrap()), ["sbx_0", "sbx_2", "sbx_3"]);
        assert_eq!(store.node().sandboxes().unwrap().len(), 4, "deleted records stay for their history");
        let Db::Sqlite(conn) = &store.db else { unreachable!("an in-memory store is SQLite") };
        let conn = conn.lock().unwrap();
        let plan = |sql: &str| -> String {
            let mut query = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let steps = query.query_map([], |row| row.get::<_, String>(3)).unwrap();
            steps.collect::<Result<Vec<_>, _>>().unwrap().join("; ")
        };
        let live = plan(LIVE_SANDBOXES);
        assert!(live.contains("sandboxes_live"), "a scan of every record: {live}");
        // Each insert takes the next seq: from an index, not a scan.
        for table in ["sandboxes", "operations", "commands"] {
            let next = plan(&format!("SELECT COALESCE(MAX(seq), 0) + 1 FROM {table}"));
            assert!(next.contains("INDEX"), "{table}: {next}");
        }
    }
}
