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
    let newest = migrations.last().map_or(0, |m| m.version);
    let (good, bad) = (newest + 1, newest + 2);
    migrations.push(Migration { version: good, name: "good", sql: "CREATE TABLE extra (id TEXT);" });
    migrations.push(Migration { version: bad, name: "bad", sql: "ALTER TABLE nowhere ADD COLUMN x TEXT;" });
    let db = Db::Postgres(Postgres::connect(&pg.url).unwrap());
    let err = migrate::postgres(&db, &migrations).unwrap_err().to_string();
    assert!(err.contains(&format!("{bad:04}_bad")), "{err}");
    let extra = admin.query("SELECT 1 FROM pg_tables WHERE tablename = 'extra'", &[]).unwrap();
    assert!(extra.is_empty(), "the good migration went back with the bad one");
    assert_eq!(recorded(&mut admin), before);
    // And a newer database is refused rather than used.
    migrations.pop();
    assert_eq!(migrate::postgres(&db, &migrations).unwrap(), vec![good]);
    let err = Store::connect(&pg.url).err().expect("a newer schema is refused").to_string();
    assert!(err.contains("newer SPACE"), "{err}");
}

/// Which node holds each volume, in PostgreSQL's dialect: a name claimed
/// once per tenant, a move's hold taken by one and renewed by its holder,
/// the record moved and forgotten only where it is.
#[test]
fn volume_records_claim_once_hold_a_move_and_forget_only_where_they_are() {
    let (pg, _admin) = cluster();
    let store = Store::connect(&pg.url).unwrap();
    let volumes = store.cluster();
    assert!(volumes.claim_volume("acme", "ws", "node-a", 1000).unwrap());
    assert!(!volumes.claim_volume("acme", "ws", "node-b", 2000).unwrap(), "a name is claimed once");
    assert!(volumes.claim_volume("other", "ws", "node-b", 2000).unwrap(), "per tenant");
    let kept = volumes.volume_node("acme", "ws").unwrap().unwrap();
    assert_eq!((kept.node_id.as_str(), kept.created_at_ms, kept.moving_until_ms), ("node-a", 1000, 0));

    assert!(volumes.hold_volume_move("acme", "ws", "node-a", 5000, 65_000, false).unwrap());
    assert!(!volumes.hold_volume_move("acme", "ws", "node-a", 6000, 66_000, false).unwrap(), "held already");
    assert!(volumes.hold_volume_move("acme", "ws", "node-a", 6000, 66_000, true).unwrap(), "renewed by its holder");
    assert!(!volumes.hold_volume_move("acme", "ws", "node-a", 70_000, 130_000, true).unwrap(), "a lapsed hold");
    assert!(volumes.hold_volume_move("acme", "ws", "node-a", 70_000, 130_000, false).unwrap(), "taken anew");
    assert!(!volumes.relocate_volume("acme", "ws", "node-b", "node-c").unwrap(), "not on node-b");
    assert!(volumes.relocate_volume("acme", "ws", "node-a", "node-b").unwrap());
    volumes.release_volume_move("acme", "ws").unwrap();
    let kept = volumes.volume_node("acme", "ws").unwrap().unwrap();
    assert_eq!((kept.node_id.as_str(), kept.moving_until_ms), ("node-b", 0));

    assert!(!volumes.forget_volume("acme", "ws", "node-a", 1000).unwrap(), "not where it is");
    assert!(!volumes.forget_volume("acme", "ws", "node-b", 999).unwrap(), "not the same claim");
    assert!(volumes.forget_volume("acme", "ws", "node-b", 1000).unwrap());
    assert_eq!(volumes.volume_nodes("acme").unwrap(), vec![]);
    assert_eq!(volumes.volume_nodes("other").unwrap().len(), 1);
}
