//! The migrations on PostgreSQL, on throwaway clusters of Debian's
//! `postgresql` (which the test command installs). Replicas migrating at
//! once are space-server's `tests/postgres.rs`.

use postgres::{Client, NoTls};
use space_host::postgres::Throwaway;
use space_store::db::{Db, Postgres};
use space_store::migrate::{self, Migration, POSTGRES};
use space_store::Store;

fn cluster() -> (Throwaway, Client) {
    let pg = Throwaway::start().unwrap_or_else(|e| panic!("a throwaway PostgreSQL: {e}"));
    let admin = Client::connect(&pg.url, NoTls).unwrap();
    (pg, admin)
}

fn recorded(admin: &mut Client) -> Vec<(i64, String, String)> {
    let rows = admin.query("SELECT version, name, applied_at FROM schema_version ORDER BY version", &[]).unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
}

#[test]
fn a_database_from_before_versions_comes_up_with_its_rows_and_a_reconnect_changes_nothing() {
    let (pg, mut admin) = cluster();
    // What every start made before versions: these tables, no record of them.
    admin.batch_execute(POSTGRES[0].sql).unwrap();
    admin.batch_execute("INSERT INTO tenants (name, quotas) VALUES ('acme', '{\"max_sandboxes\": 3}')").unwrap();

    let store = Store::connect(&pg.url).unwrap();
    assert_eq!(store.tenancy().tenant_quotas("acme").unwrap().max_sandboxes, Some(3), "the old rows are kept");
    drop(store);
    let first = recorded(&mut admin);
    let versions: Vec<i64> = first.iter().map(|(v, _, _)| *v).collect();
    assert_eq!(versions, POSTGRES.iter().map(|m| m.version).collect::<Vec<_>>());

    drop(Store::connect(&pg.url).unwrap());
    assert_eq!(recorded(&mut admin), first, "a reconnect applies nothing");
}

#[test]
fn a_failing_migration_leaves_the_database_as_it_was() {
    let (pg, mut admin) = cluster();
    drop(Store::connect(&pg.url).unwrap());
    let before = recorded(&mut admin);
    let mut migrations = POSTGRES.to_vec();
    migrations.push(Migration { version: 2, name: "good", sql: "CREATE TABLE extra (id TEXT);" });
    migrations.push(Migration { version: 3, name: "bad", sql: "ALTER TABLE nowhere ADD COLUMN x TEXT;" });
    let db = Db::Postgres(Postgres::connect(&pg.url).unwrap());
    let err = migrate::postgres(&db, &migrations).unwrap_err().to_string();
    assert!(err.contains("0003_bad"), "{err}");
    let extra = admin.query("SELECT 1 FROM pg_tables WHERE tablename = 'extra'", &[]).unwrap();
    assert!(extra.is_empty(), "migration 2 went back with 3");
    assert_eq!(recorded(&mut admin), before);
    // And a newer database is refused rather than used.
    migrations.pop();
    assert_eq!(migrate::postgres(&db, &migrations).unwrap(), vec![2]);
    let err = Store::connect(&pg.url).err().expect("a newer schema is refused").to_string();
    assert!(err.contains("newer SPACE"), "{err}");
}
