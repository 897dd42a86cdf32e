//! Durable state: one SQLite file (WAL) in the data dir, or a PostgreSQL
//! database shared by a cluster's control plane replicas.
//!
//! Each record is its API object as JSON plus the columns we query by.
//! Every write completes before the change is acknowledged to a client.
//! The schema is made and changed only by the numbered migrations in
//! `migrations/` (see [`migrate`]).
//!
//! This crate owns the tables and the SQL; it knows nothing of HTTP, of
//! engines or of the node runtime, and takes and returns plain records.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

mod cluster;
pub mod db;
mod events;
pub mod migrate;
mod secrets;

use rusqlite::Connection;
use serde::{Deserialize, Serialize};
use space_api::{Command, EventType, Operation, Sandbox};

pub use self::cluster::{NodeRow, Placement};
use self::db::{vals, Conn, Db, Row, Value};
pub use self::events::{new_event, EventFilter, FeedEvent, RawEvent, EVENTS_KEPT};
pub use self::secrets::{SealedSecret, TenantSecret};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL's own message in full (`postgres::Error` alone says only
    /// "db error" for every error the server answered with).
    #[error("database: {}", .0.as_db_error().map_or_else(|| .0.to_string(), |e| e.to_string()))]
    Postgres(#[from] postgres::Error),
    #[error("database: {0}")]
    Shape(String),
    #[error("a stored record is unreadable: {0}")]
    Corrupt(#[from] serde_json::Error),
}

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
    #[serde(default = "operator_tenant")]
    pub tenant: String,
    /// The sandbox's egress CA: its certificate (which the sandbox
    /// trusts) and its key, sealed; never returned by the API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_ca: Option<EgressCa>,
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
                created_at: created.into(),
                updated_at: created.into(),
                lifecycle,
                network: space_api::Network::default(),
                last_activity_at: active.into(),
                auto_paused: false,
                failure_reason: None,
                forked_from: None,
            },
            template_version: 1,
            env: BTreeMap::new(),
            agent_session: None,
            channel_key: None,
            egress_ca: None,
            tenant: "default".into(),
        }
    }
}

/// The tenant of the server's own key (dev key or `--api-key-file`).
pub const OPERATOR_TENANT: &str = "default";

fn operator_tenant() -> String {
    OPERATOR_TENANT.to_string()
}

/// This moment as the API writes times (RFC 3339, milliseconds), for the
/// times the store stamps itself: events and applied migrations.
fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
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
    pub created_at: String,
    pub revoked_at: Option<String>,
}

type SandboxRow = (String, Option<String>, Option<String>, Option<String>);

fn sandbox_from_row((body, last_activity, network, lifecycle): SandboxRow) -> Result<SandboxRecord, StoreError> {
    let mut record: SandboxRecord = serde_json::from_str(&body)?;
    if let Some(lifecycle) = lifecycle {
        record.sandbox.lifecycle = serde_json::from_str(&lifecycle)?;
    }
    if let Some(at) = last_activity {
        record.sandbox.last_activity_at = at;
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

pub struct Store {
    db: Db,
    /// SQLite only: a second, read-only connection for followers of the
    /// event log, so their reads never wait for (or hold up) writes (WAL);
    /// `None` for an in-memory database, which a second connection cannot
    /// see, and for PostgreSQL, whose connections all read concurrently.
    reader: Option<Mutex<Connection>>,
    /// The newest event's id, bumped after each commit that adds one.
    event_head: tokio::sync::watch::Sender<u64>,
    /// Whether writes record events (on unless turned off).
    recording: std::sync::atomic::AtomicBool,
}

impl Store {
    /// The embedded store: one SQLite file (`:memory:` for tests).
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let mut conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // NORMAL in WAL mode survives a killed process; only power loss can
        // drop the last transactions.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        migrate::sqlite(&mut conn, migrate::SQLITE)?;
        let reader = match path.as_os_str() == ":memory:" {
            true => None,
            false => {
                let reader = Connection::open_with_flags(
                    path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                reader.busy_timeout(std::time::Duration::from_secs(5))?;
                Some(Mutex::new(reader))
            }
        };
        Store::with(Db::Sqlite(Mutex::new(conn)), reader)
    }

    /// The cluster store: a PostgreSQL database at `url`
    /// (`postgres://user@host/db`), brought up to this schema if it is
    /// older (or empty).
    pub fn connect(url: &str) -> Result<Store, StoreError> {
        let db = Db::Postgres(db::Postgres::connect(url)?);
        migrate::postgres(&db, migrate::POSTGRES)?;
        Store::with(db, None)
    }

    /// Claims a PostgreSQL database for this server alone. Several servers
    /// sharing one (replicas) need claims on each operation and sandbox,
    /// which are not built yet: until then a second server is refused
    /// rather than let two reconcile the same sandboxes.
    pub fn claim_for_server(&self) -> Result<(), StoreError> {
        match &self.db {
            Db::Postgres(pg) if !pg.lock_server()? => Err(StoreError::Shape(
                "another SPACE server already keeps its state in this database (one server per database for now)"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    fn with(db: Db, reader: Option<Mutex<Connection>>) -> Result<Store, StoreError> {
        let head =
            db.tx(|c| c.query_one("SELECT COALESCE(MAX(seq), 0) FROM events", &[])?.map(|r| r.int(0)).transpose())?;
        Ok(Store {
            db,
            reader,
            event_head: tokio::sync::watch::Sender::new(head.unwrap_or(0).max(0) as u64),
            recording: true.into(),
        })
    }

    fn tx<T>(&self, work: impl FnOnce(&mut dyn Conn) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.db.tx(work)
    }

    /// Records a sandbox; a new one, or one in another state than before,
    /// is also an event (in the same transaction).
    pub fn put_sandbox(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        let body = serde_json::to_string(record)?;
        let id = &record.sandbox.id;
        let state = record.sandbox.state.as_str();
        let recording = self.recording();
        let event = self.tx(|c| {
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
        self.announce(event);
        Ok(())
    }

    pub fn sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let row = self.tx(|c| {
            c.query_one("SELECT body, last_activity_at, network, lifecycle FROM sandboxes WHERE id = ?1", vals![id])
        })?;
        row.map(|r| sandbox_from_row(sandbox_row(&r)?)).transpose()
    }

    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows =
            self.tx(|c| c.query("SELECT body, last_activity_at, network, lifecycle FROM sandboxes ORDER BY seq", &[]))?;
        rows.iter().map(|r| sandbox_from_row(sandbox_row(r)?)).collect()
    }

    /// Every sandbox but the deleted ones, oldest first: what capacity,
    /// quotas and the once-a-second policies look at. Deleted records stay
    /// for their history and would otherwise be read (and parsed) on every
    /// create; a partial index keeps this to the live rows.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = self.tx(|c| c.query(LIVE_SANDBOXES, &[]))?;
        rows.iter().map(|r| sandbox_from_row(sandbox_row(r)?)).collect()
    }

    /// Records activity (a command started or ended) without touching the
    /// record the sandbox's actor owns.
    pub fn touch_sandbox(&self, id: &str, at: &str) -> Result<(), StoreError> {
        self.tx(|c| c.execute("UPDATE sandboxes SET last_activity_at = ?2 WHERE id = ?1", vals![id, at]))?;
        Ok(())
    }

    /// Replaces a sandbox's network policy without touching the record the
    /// sandbox's actor owns (the column wins over the body's copy).
    pub fn set_sandbox_network(&self, id: &str, network: &space_api::Network) -> Result<bool, StoreError> {
        let json = serde_json::to_string(network)?;
        Ok(self.tx(|c| c.execute("UPDATE sandboxes SET network = ?2 WHERE id = ?1", vals![id, json]))? > 0)
    }

    /// Replaces a sandbox's lifecycle policies without touching the record
    /// the sandbox's actor owns (the column wins over the body's copy).
    pub fn set_sandbox_lifecycle(&self, id: &str, lifecycle: &space_api::Lifecycle) -> Result<bool, StoreError> {
        let json = serde_json::to_string(lifecycle)?;
        Ok(self.tx(|c| c.execute("UPDATE sandboxes SET lifecycle = ?2 WHERE id = ?1", vals![id, json]))? > 0)
    }

    /// Records an operation; `tenant` and the key are kept from the first write.
    pub fn put_operation(
        &self,
        operation: &Operation,
        tenant: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(), StoreError> {
        let body = serde_json::to_string(operation)?;
        let recording = self.recording();
        let event = self.tx(|c| {
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
        self.announce(event);
        Ok(())
    }

    /// The tenant that owns a sandbox, without reading the whole record
    /// (asked on every request naming a sandbox).
    pub fn sandbox_tenant(&self, id: &str) -> Result<Option<String>, StoreError> {
        let row = self.tx(|c| c.query_one("SELECT tenant FROM sandboxes WHERE id = ?1", vals![id]))?;
        row.map(|r| Ok(r.opt_text(0)?.unwrap_or_else(operator_tenant))).transpose()
    }

    /// The tenant that owns an operation.
    pub fn operation_tenant(&self, id: &str) -> Result<Option<String>, StoreError> {
        self.text("SELECT tenant FROM operations WHERE id = ?1", vals![id])
    }

    pub fn put_tenant(&self, name: &str, quotas: &Quotas) -> Result<(), StoreError> {
        let quotas = serde_json::to_string(quotas)?;
        self.tx(|c| {
            c.execute(
                "INSERT INTO tenants (name, quotas) VALUES (?1, ?2) ON CONFLICT (name) DO UPDATE SET quotas = excluded.quotas",
                vals![name, quotas],
            )
        })?;
        Ok(())
    }

    pub fn tenant_quotas(&self, name: &str) -> Result<Quotas, StoreError> {
        Ok(self.one("SELECT quotas FROM tenants WHERE name = ?1", vals![name])?.unwrap_or_default())
    }

    pub fn put_key(&self, id: &str, tenant: &str, hash: &str, at: &str) -> Result<(), StoreError> {
        self.tx(|c| {
            c.execute(
                "INSERT INTO api_keys (id, tenant, hash, created_at) VALUES (?1, ?2, ?3, ?4)",
                vals![id, tenant, hash, at],
            )
        })?;
        Ok(())
    }

    /// The tenant of a key that is not revoked, by the key's hash.
    pub fn key_tenant(&self, hash: &str) -> Result<Option<String>, StoreError> {
        self.text("SELECT tenant FROM api_keys WHERE hash = ?1 AND revoked_at IS NULL", vals![hash])
    }

    pub fn keys(&self) -> Result<Vec<KeyInfo>, StoreError> {
        let rows = self
            .tx(|c| c.query("SELECT id, tenant, created_at, revoked_at FROM api_keys ORDER BY created_at, id", &[]))?;
        rows.iter()
            .map(|r| {
                Ok(KeyInfo { id: r.text(0)?, tenant: r.text(1)?, created_at: r.text(2)?, revoked_at: r.opt_text(3)? })
            })
            .collect()
    }

    /// Revokes a key; false if there is no such key.
    pub fn revoke_key(&self, id: &str, at: &str) -> Result<bool, StoreError> {
        let changed = self.tx(|c| {
            c.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?2) WHERE id = ?1", vals![id, at])
        })?;
        Ok(changed > 0)
    }

    /// The text in the first column of the one row `sql` selects.
    fn text(&self, sql: &str, values: &[Value]) -> Result<Option<String>, StoreError> {
        self.tx(|c| c.query_one(sql, values))?.map(|r| r.text(0)).transpose()
    }

    /// The JSON body of the one row `sql` selects, parsed.
    fn one<T: serde::de::DeserializeOwned>(&self, sql: &str, values: &[Value]) -> Result<Option<T>, StoreError> {
        Ok(self.text(sql, values)?.map(|b| serde_json::from_str(&b)).transpose()?)
    }

    /// The JSON bodies of every row `sql` selects, parsed.
    fn many<T: serde::de::DeserializeOwned>(&self, sql: &str, values: &[Value]) -> Result<Vec<T>, StoreError> {
        let rows = self.tx(|c| c.query(sql, values))?;
        rows.iter().map(|r| Ok(serde_json::from_str(&r.text(0)?)?)).collect()
    }

    pub fn operation(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        self.one("SELECT body FROM operations WHERE id = ?1", vals![id])
    }

    pub fn operation_by_key(&self, tenant: &str, key: &str) -> Result<Option<Operation>, StoreError> {
        self.one("SELECT body FROM operations WHERE tenant = ?1 AND idempotency_key = ?2", vals![tenant, key])
    }

    pub fn operations(&self, sandbox_id: Option<&str>) -> Result<Vec<Operation>, StoreError> {
        match sandbox_id {
            Some(id) => self.many("SELECT body FROM operations WHERE sandbox_id = ?1 ORDER BY seq", vals![id]),
            None => self.many("SELECT body FROM operations ORDER BY seq", &[]),
        }
    }

    /// A tenant's operations, optionally of one sandbox.
    pub fn tenant_operations(&self, tenant: &str, sandbox_id: Option<&str>) -> Result<Vec<Operation>, StoreError> {
        match sandbox_id {
            Some(id) => self.many(
                "SELECT body FROM operations WHERE tenant = ?1 AND sandbox_id = ?2 ORDER BY seq",
                vals![tenant, id],
            ),
            None => self.many("SELECT body FROM operations WHERE tenant = ?1 ORDER BY seq", vals![tenant]),
        }
    }

    /// Records a command; its start and its end are also events.
    pub fn put_command(&self, command: &Command) -> Result<(), StoreError> {
        let body = serde_json::to_string(command)?;
        let recording = self.recording();
        let event = self.tx(|c| {
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
        self.announce(event);
        Ok(())
    }

    pub fn put_command_stream(&self, command_id: &str, stream: u32, timeout_s: u64) -> Result<(), StoreError> {
        self.tx(|c| {
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
        self.tx(|c| {
            c.execute(
                "INSERT INTO contexts (id, sandbox_id, body) VALUES (?1, ?2, ?3)
                 ON CONFLICT (id) DO UPDATE SET body = excluded.body",
                vals![id, sandbox_id, body],
            )
        })?;
        Ok(())
    }

    pub fn delete_context(&self, id: &str) -> Result<(), StoreError> {
        self.tx(|c| c.execute("DELETE FROM contexts WHERE id = ?1", vals![id]))?;
        Ok(())
    }

    /// A sandbox's recorded code contexts.
    pub fn contexts(&self, sandbox_id: &str) -> Result<Vec<serde_json::Value>, StoreError> {
        self.many("SELECT body FROM contexts WHERE sandbox_id = ?1 ORDER BY id", vals![sandbox_id])
    }

    /// Records an egress event, keeping the newest [`EGRESS_EVENTS_KEPT`].
    pub fn put_egress_event(&self, sandbox_id: &str, event: &space_api::EgressEvent) -> Result<(), StoreError> {
        let body = serde_json::to_string(event)?;
        self.tx(|c| {
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
        self.many(
            "SELECT body FROM (SELECT seq, body FROM egress_events WHERE sandbox_id = ?1 ORDER BY seq DESC LIMIT ?2) \
             AS newest ORDER BY seq",
            vals![sandbox_id, limit],
        )
    }

    /// The agent stream and timeout of a command, if recorded.
    pub fn command_stream(&self, command_id: &str) -> Result<Option<(u32, u64)>, StoreError> {
        let row = self.tx(|c| {
            c.query_one("SELECT stream, timeout_s FROM command_streams WHERE command_id = ?1", vals![command_id])
        })?;
        row.map(|r| Ok((r.int(0)?.clamp(0, u32::MAX.into()) as u32, r.int(1)?.max(0) as u64))).transpose()
    }

    pub fn command(&self, id: &str) -> Result<Option<Command>, StoreError> {
        self.one("SELECT body FROM commands WHERE id = ?1", vals![id])
    }

    pub fn commands(&self, sandbox_id: &str) -> Result<Vec<Command>, StoreError> {
        self.many("SELECT body FROM commands WHERE sandbox_id = ?1 ORDER BY seq", vals![sandbox_id])
    }
}

fn sandbox_row(row: &Row) -> Result<SandboxRow, StoreError> {
    Ok((row.text(0)?, row.opt_text(1)?, row.opt_text(2)?, row.opt_text(3)?))
}

#[cfg(test)]
mod tests {
    use space_api::{Lifecycle, SandboxState};

    use super::*;

    #[test]
    fn live_sandboxes_and_inserts_read_indexes_not_every_record_ever_kept() {
        let store = Store::open(Path::new(":memory:")).unwrap();
        let states = [SandboxState::Running, SandboxState::Deleted, SandboxState::Paused, SandboxState::Failed];
        for (n, state) in states.into_iter().enumerate() {
            let lifecycle = Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: None, auto_pause: None };
            let mut record = SandboxRecord::sample(state, lifecycle, "2026-01-01T00:00:00Z", "2026-01-01T00:00:00Z");
            record.sandbox.id = format!("sbx_{n}");
            store.put_sandbox(&record).unwrap();
        }
        let ids = |records: Vec<SandboxRecord>| records.into_iter().map(|r| r.sandbox.id).collect::<Vec<_>>();
        assert_eq!(ids(store.live_sandboxes().unwrap()), ["sbx_0", "sbx_2", "sbx_3"]);
        assert_eq!(store.sandboxes().unwrap().len(), 4, "deleted records stay for their history");
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
