//! Versioned migrations: the schema is the numbered scripts in
//! `migrations/{sqlite,pg}/NNNN_name.sql`, each applied once, in order, and
//! recorded in the `schema_version` table in the same transaction as its
//! statements, so an open that fails leaves the database as it was.
//!
//! Migration 1 is the schema of before versions ("schema 3"). A SQLite file
//! from before versions (no `schema_version` table) may be older still: the
//! column probing that used to run on every open brings its tables up to
//! migration 1's shape first, then migration 1 adds what it lacks.

use rusqlite::{Connection, TransactionBehavior};

use crate::db::{vals, Conn, Db, SqliteConn};
use crate::StoreError;

/// One step of the schema.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Its number: the next after the one before, never reused.
    pub version: i64,
    pub name: &'static str,
    /// The statements, without values.
    pub sql: &'static str,
}

/// The migrations of the embedded store, in order.
pub const SQLITE: &[Migration] = &[
    Migration { version: 1, name: "initial", sql: include_str!("../migrations/sqlite/0001_initial.sql") },
    Migration { version: 2, name: "volumes", sql: include_str!("../migrations/sqlite/0002_volumes.sql") },
    Migration { version: 3, name: "volume_nodes", sql: include_str!("../migrations/sqlite/0003_volume_nodes.sql") },
    Migration { version: 4, name: "port_access", sql: include_str!("../migrations/sqlite/0004_port_access.sql") },
];

/// The migrations of the cluster store, in order: the same versions and
/// names as [`SQLITE`], in PostgreSQL's dialect.
pub const POSTGRES: &[Migration] = &[
    Migration { version: 1, name: "initial", sql: include_str!("../migrations/pg/0001_initial.sql") },
    Migration { version: 2, name: "volumes", sql: include_str!("../migrations/pg/0002_volumes.sql") },
    Migration { version: 3, name: "volume_nodes", sql: include_str!("../migrations/pg/0003_volume_nodes.sql") },
    Migration { version: 4, name: "port_access", sql: include_str!("../migrations/pg/0004_port_access.sql") },
];

/// What SQLite's `PRAGMA user_version` said before versions: migration 1's
/// schema was "schema 3".
const LEGACY_SCHEMA: i64 = 3;

/// The PostgreSQL advisory lock that replicas take turns on to migrate.
const MIGRATION_LOCK: i64 = 7_270_001;

const VERSIONS: &str = "CREATE TABLE IF NOT EXISTS schema_version (
    version BIGINT PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at TEXT NOT NULL
)";

/// Brings a SQLite database up to the newest of `migrations`; the versions
/// it applied (none: it was up to date).
pub fn sqlite(conn: &mut Connection, migrations: &[Migration]) -> Result<Vec<i64>, StoreError> {
    // IMMEDIATE takes the write lock before reading the version, so another
    // process opening the same file at once (`space keys` beside a server)
    // waits and then finds the work done, rather than both applying it.
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let applied = {
        let c = &mut SqliteConn(&tx);
        // Binaries from before versions read only `user_version`: it stays
        // "schema 3" at migration 1 and grows with each migration after,
        // so they refuse a file of a shape they do not know.
        let guard = LEGACY_SCHEMA + newest(migrations) - 1;
        let user_version = c.query_one("PRAGMA user_version", &[])?.map(|r| r.int(0)).transpose()?.unwrap_or(0);
        if user_version > guard {
            return Err(newer(user_version - LEGACY_SCHEMA + 1));
        }
        let versioned =
            c.query_one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'", &[])?.is_some();
        if !versioned {
            before_versions(c)?;
        }
        let applied = apply(c, migrations)?;
        c.batch(&format!("PRAGMA user_version = {guard}"))?;
        applied
    };
    tx.commit()?;
    Ok(applied)
}

/// Brings a PostgreSQL database up to the newest of `migrations`; the
/// versions it applied.
pub fn postgres(db: &Db, migrations: &[Migration]) -> Result<Vec<i64>, StoreError> {
    db.tx(|c| {
        // A transaction's lock, which only its commit releases: replicas
        // starting together take turns, and each finds the tables the one
        // before committed. (A session lock released before the commit let
        // the next replica in too early: its CREATE TABLE IF NOT EXISTS did
        // not see the uncommitted table, and failed on the type PostgreSQL
        // had made for it.)
        c.execute("SELECT pg_advisory_xact_lock(?1)", vals![MIGRATION_LOCK])?;
        apply(c, migrations)
    })
}

fn newest(migrations: &[Migration]) -> i64 {
    migrations.last().map_or(0, |m| m.version)
}

fn newer(version: i64) -> StoreError {
    StoreError::Shape(format!("the database was written by a newer SPACE (schema version {version})"))
}

/// Applies the migrations not yet recorded, in order, inside the caller's
/// transaction.
fn apply(c: &mut dyn Conn, migrations: &[Migration]) -> Result<Vec<i64>, StoreError> {
    c.batch(VERSIONS)?;
    let recorded = c.query("SELECT version FROM schema_version ORDER BY version", &[])?;
    let recorded = recorded.iter().map(|r| r.int(0)).collect::<Result<Vec<_>, _>>()?;
    if let Some(&version) = recorded.last().filter(|&&v| v > newest(migrations)) {
        return Err(newer(version));
    }
    let mut applied = Vec::new();
    for migration in migrations.iter().filter(|m| !recorded.contains(&m.version)) {
        c.batch(migration.sql).map_err(|err| {
            StoreError::Shape(format!("migration {:04}_{}: {err}", migration.version, migration.name))
        })?;
        c.execute(
            "INSERT INTO schema_version (version, name, applied_at) VALUES (?1, ?2, ?3)",
            vals![migration.version, migration.name, crate::now()],
        )?;
        applied.push(migration.version);
    }
    Ok(applied)
}

/// Brings the tables of a SQLite file from before versions to migration
/// 1's shape (what every open did before versions, by probing columns);
/// tables it lacks altogether are migration 1's to make.
fn before_versions(c: &mut dyn Conn) -> Result<(), StoreError> {
    let table = |c: &mut dyn Conn, table: &str| -> Result<bool, StoreError> {
        Ok(c.query_one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1", vals![table])?.is_some())
    };
    let lacks = |c: &mut dyn Conn, table: &str, column: &str| -> Result<bool, StoreError> {
        Ok(c.query_one("SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2", vals![table, column])?.is_none())
    };
    if table(c, "operations")? && lacks(c, "operations", "tenant")? {
        // Schema 1 had no tenants: its operations are the operator's.
        c.batch("ALTER TABLE operations ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'")?;
    }
    if table(c, "sandboxes")? {
        // A network or lifecycle changed after create (an E2B
        // `set_timeout`) is kept apart from the body, as last activity is.
        if lacks(c, "sandboxes", "network")? {
            c.batch("ALTER TABLE sandboxes ADD COLUMN network TEXT")?;
        }
        if lacks(c, "sandboxes", "lifecycle")? {
            c.batch("ALTER TABLE sandboxes ADD COLUMN lifecycle TEXT")?;
        }
        // The owner is a column, as it is asked for on every request.
        if lacks(c, "sandboxes", "tenant")? {
            c.batch(
                "ALTER TABLE sandboxes ADD COLUMN tenant TEXT;
                 UPDATE sandboxes SET tenant = COALESCE(json_extract(body, '$.tenant'), 'default');",
            )?;
        }
    }
    // An Idempotency-Key was unique across tenants; migration 1 makes it
    // unique per tenant.
    c.batch("DROP INDEX IF EXISTS operations_by_key")
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::{SandboxRecord, Store};

    /// A directory of its own under the system's temp dir (no root needed),
    /// removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let dir = std::env::temp_dir().join(format!("space-store-{name}-{}-{nanos}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn db(&self) -> PathBuf {
            self.0.join("space.db")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn recorded(path: &Path) -> Vec<(i64, String, String)> {
        let conn = Connection::open(path).unwrap();
        let mut query = conn.prepare("SELECT version, name, applied_at FROM schema_version ORDER BY version").unwrap();
        let rows = query.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    }

    fn user_version(path: &Path) -> i64 {
        Connection::open(path).unwrap().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap()
    }

    fn record(id: &str, tenant: &str) -> SandboxRecord {
        let lifecycle =
            space_api::Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: None, auto_pause: None };
        let mut record = SandboxRecord::sample(
            space_api::SandboxState::Running,
            lifecycle,
            "2026-01-01T00:00:00Z",
            "2026-01-01T00:00:00Z",
        );
        record.sandbox.id = id.into();
        record.tenant = tenant.into();
        record
    }

    #[test]
    fn both_dialects_list_the_same_migrations_numbered_in_order() {
        let names = |list: &[Migration]| list.iter().map(|m| (m.version, m.name)).collect::<Vec<_>>();
        assert_eq!(names(SQLITE), names(POSTGRES));
        for (n, migration) in SQLITE.iter().enumerate() {
            assert_eq!(migration.version, n as i64 + 1, "{}", migration.name);
        }
    }

    #[test]
    fn a_fresh_database_gets_every_migration_once_and_a_reopen_changes_nothing() {
        let dir = TempDir::new("fresh");
        let store = Store::open(&dir.db()).unwrap();
        store.node().put_sandbox(&record("sbx_1", "acme")).unwrap();
        drop(store);
        let first = recorded(&dir.db());
        let versions: Vec<i64> = first.iter().map(|(v, _, _)| *v).collect();
        assert_eq!(versions, SQLITE.iter().map(|m| m.version).collect::<Vec<_>>());
        assert_eq!(user_version(&dir.db()), LEGACY_SCHEMA + newest(SQLITE) - 1);

        let mut conn = Connection::open(dir.db()).unwrap();
        assert_eq!(sqlite(&mut conn, SQLITE).unwrap(), Vec::<i64>::new(), "a reopen applies nothing");
        drop(conn);
        let store = Store::open(&dir.db()).unwrap();
        assert_eq!(store.node().sandbox_tenant("sbx_1").unwrap().as_deref(), Some("acme"));
        drop(store);
        assert_eq!(recorded(&dir.db()), first, "each migration is recorded once, when it was applied");
    }

    #[test]
    fn a_data_dir_from_before_versions_comes_up_with_its_rows() {
        let dir = TempDir::new("old");
        // Schema 1: no tenants, no network or lifecycle columns, and an
        // Idempotency-Key unique across everyone.
        let old = Connection::open(dir.db()).unwrap();
        old.execute_batch(
            "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, state TEXT NOT NULL,
                 body TEXT NOT NULL, last_activity_at TEXT);
             CREATE TABLE operations (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, sandbox_id TEXT,
                 idempotency_key TEXT, body TEXT NOT NULL);
             CREATE UNIQUE INDEX operations_by_key ON operations (idempotency_key);
             CREATE TABLE commands (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, sandbox_id TEXT NOT NULL,
                 body TEXT NOT NULL);
             PRAGMA user_version = 1;",
        )
        .unwrap();
        let body = serde_json::to_string(&record("sbx_1", "acme")).unwrap();
        old.execute(
            "INSERT INTO sandboxes (id, seq, state, body, last_activity_at) VALUES ('sbx_1', 1, 'running', ?1, ?2)",
            rusqlite::params![body, "2026-02-02T00:00:00Z"],
        )
        .unwrap();
        let operation = serde_json::json!({
            "id": "op_1", "kind": "create", "sandbox_id": "sbx_1", "state": "succeeded",
            "progress": {"step": "done", "done": 1, "total": 1}, "created_at": "2026-01-01T00:00:00Z",
        });
        old.execute(
            "INSERT INTO operations (id, seq, sandbox_id, idempotency_key, body) VALUES ('op_1', 1, 'sbx_1', 'k1', ?1)",
            [operation.to_string()],
        )
        .unwrap();
        drop(old);

        let store = Store::open(&dir.db()).unwrap();
        let kept = store.node().sandbox("sbx_1").unwrap().expect("the old sandbox is still there");
        assert_eq!(kept.sandbox.last_activity_at.to_string(), "2026-02-02T00:00:00.000Z");
        assert_eq!(store.node().sandbox_tenant("sbx_1").unwrap().as_deref(), Some("acme"), "the owner column, filled");
        let op = store.node().operation_by_key("default", "k1").unwrap().expect("an old operation is the operator's");
        assert_eq!(op.id, "op_1");
        // The key is unique per tenant now: another tenant may use it.
        let mut theirs = op.clone();
        theirs.id = "op_2".into();
        store.node().put_operation(&theirs, "acme", Some("k1")).unwrap();
        // Tables schema 1 lacked are there, and writes record events.
        store.node().put_sandbox(&record("sbx_2", "acme")).unwrap();
        store.tenancy().put_tenant("acme", &crate::Quotas::default()).unwrap();
        assert!(!store.latest_events("acme", &crate::EventFilter::default(), 10).unwrap().is_empty());
        drop(store);
        let versions: Vec<i64> = recorded(&dir.db()).iter().map(|(v, _, _)| *v).collect();
        assert_eq!(versions, SQLITE.iter().map(|m| m.version).collect::<Vec<_>>());
    }

    #[test]
    fn a_failing_migration_leaves_the_database_as_it_was() {
        let dir = TempDir::new("failing");
        drop(Store::open(&dir.db()).unwrap());
        let before = recorded(&dir.db());
        let mut migrations = SQLITE.to_vec();
        let good = newest(SQLITE) + 1;
        migrations.push(Migration { version: good, name: "good", sql: "CREATE TABLE extra (id TEXT);" });
        migrations.push(Migration { version: good + 1, name: "bad", sql: "ALTER TABLE nowhere ADD COLUMN x TEXT;" });
        let mut conn = Connection::open(dir.db()).unwrap();
        let err = sqlite(&mut conn, &migrations).unwrap_err().to_string();
        assert!(err.contains(&format!("{:04}_bad", good + 1)), "{err}");
        let extra: i64 =
            conn.query_row("SELECT COUNT(*) FROM sqlite_master WHERE name = 'extra'", [], |r| r.get(0)).unwrap();
        assert_eq!(extra, 0, "the good migration went back with the bad one");
        drop(conn);
        assert_eq!(recorded(&dir.db()), before);
        assert_eq!(user_version(&dir.db()), LEGACY_SCHEMA + newest(SQLITE) - 1);
    }

    #[test]
    fn a_database_of_a_newer_schema_is_refused() {
        let dir = TempDir::new("newer");
        drop(Store::open(&dir.db()).unwrap());
        let mut later = SQLITE.to_vec();
        later.push(Migration { version: newest(SQLITE) + 1, name: "later", sql: "CREATE TABLE later (id TEXT);" });
        let mut conn = Connection::open(dir.db()).unwrap();
        assert_eq!(sqlite(&mut conn, &later).unwrap(), vec![newest(SQLITE) + 1]);
        drop(conn);
        let err = Store::open(&dir.db()).err().expect("a newer schema is refused").to_string();
        assert!(err.contains("newer SPACE"), "{err}");
    }
}
