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
//! `Store` opens the database; its tables are reached through one facade
//! per role, each in its own file: [`NodeStore`] (`store.node()`: a node's
//! sandboxes, operations, commands, contexts and egress log),
//! [`TenancyStore`] (`store.tenancy()`: tenants, keys, secrets) and
//! [`ClusterStore`] (`store.cluster()`: nodes, placements, feeds). The
//! event log every role writes to stays on `Store` itself.

use std::path::Path;
use std::sync::Mutex;

mod cluster;
pub mod db;
mod events;
pub mod migrate;
mod node;
mod tenancy;
mod volumes;

use rusqlite::Connection;

pub use self::cluster::{ClusterStore, NodeRow, Placement, VolumeNode};
use self::db::{Conn, Db, Value};
pub use self::events::{new_event, EventFilter, EventReader, FeedEvent, RawEvent, EVENTS_KEPT};
pub use self::node::{EgressCa, NodeStore, PortAccess, SandboxRecord, EGRESS_EVENTS_KEPT};
pub use self::tenancy::{KeyInfo, Quotas, SealedSecret, TenancyStore, TenantSecret, OPERATOR_TENANT};
pub use self::volumes::{SnapshotRecord, VolumeRecord};

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

/// This moment as the API writes times (RFC 3339, milliseconds), for the
/// times the store stamps itself: events and applied migrations.
fn now() -> String {
    space_api::Timestamp::now().to_string()
}

/// A time the store kept as text, read back.
fn time(text: &str) -> Result<space_api::Timestamp, StoreError> {
    space_api::Timestamp::parse(text).ok_or_else(|| StoreError::Shape(format!("a stored time is unreadable: {text:?}")))
}

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

    /// A node's own tables.
    pub fn node(&self) -> NodeStore<'_> {
        NodeStore(self)
    }

    /// Tenants, keys and secrets.
    pub fn tenancy(&self) -> TenancyStore<'_> {
        TenancyStore(self)
    }

    /// A control plane's tables.
    pub fn cluster(&self) -> ClusterStore<'_> {
        ClusterStore(self)
    }

    /// The event log, read-only.
    pub fn events(&self) -> EventReader<'_> {
        EventReader(self)
    }

    fn tx<T>(&self, work: impl FnOnce(&mut dyn Conn) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.db.tx(work)
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
}
