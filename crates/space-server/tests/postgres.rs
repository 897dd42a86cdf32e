//! State in PostgreSQL (`--database`), on a real throwaway cluster made
//! with Debian's `postgresql`: a server's sandboxes, operations, commands,
//! events, keys and secrets live there across a restart, and connections
//! of several processes share one database without colliding.

mod common;

use common::TestServer;
use serde_json::json;
use space_api::{Operation, OperationKind, OperationOrigin, OperationState, Progress};
use space_server::store::{EventFilter, Store};
use space_server::tenants::create_key;
use space_testkit::{PgCluster, TestDataDir};

#[test]
fn a_server_keeps_its_state_in_postgresql_across_a_restart() {
    let pg = PgCluster::start();
    let data = TestDataDir::new();
    let mut config = common::platform_config(&data);
    config.database = Some(pg.url.clone());
    let server = TestServer::start_with(config.clone());
    let (_, key) = create_key(server.platform.store(), "team-pg", None).unwrap();
    // One server per database until replicas claim their work.
    let second = TestDataDir::new();
    let mut other = common::platform_config(&second);
    other.database = Some(pg.url.clone());
    let refused = space_server::start_platform(&other).err().expect("a second server on the same database is refused");
    assert!(refused.to_string().contains("another SPACE server"), "{refused}");

    // The whole path of a sandbox, as a tenant.
    let auth = format!("Bearer {key}");
    let headers = [("Authorization", auth.as_str()), ("Content-Type", "application/json"), ("Idempotency-Key", "pg-1")];
    let (status, first) = server.raw("POST", "/v1/sandboxes", &headers, Some(r#"{"template":"base"}"#));
    assert_eq!(status, 202, "{first}");
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    let id = first["sandbox"]["id"].as_str().unwrap().to_string();
    let (_, again) = server.raw("POST", "/v1/sandboxes", &headers, Some(r#"{"template":"base"}"#));
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["operation"]["id"], first["operation"]["id"], "an Idempotency-Key replays from the database");
    let op = first["operation"]["id"].as_str().unwrap();
    let (_, done) = server.call_as(&key, "GET", &format!("/v1/operations/{op}?wait=60"), None);
    assert_eq!(done["state"], "succeeded", "{done}");
    let (status, ran) =
        server.call_as(&key, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo kept in pg"})));
    assert_eq!((status, ran["stdout"].as_str()), (200, Some("kept in pg\n")), "{ran}");
    let command = ran["command"]["id"].as_str().unwrap().to_string();
    for action in ["pause", "resume"] {
        let (status, body) = server.call_as(&key, "POST", &format!("/v1/sandboxes/{id}/{action}"), Some(json!({})));
        assert_eq!(status, 202, "{body}");
        let op = body["operation"]["id"].as_str().unwrap();
        let (_, done) = server.call_as(&key, "GET", &format!("/v1/operations/{op}?wait=60"), None);
        assert_eq!(done["state"], "succeeded", "{done}");
    }
    let (status, secret) = server.call_as(
        &key,
        "PUT",
        "/v1/secrets/pg-token",
        Some(json!({"value": "pg-secret-value", "hosts": ["api.space.test"]})),
    );
    assert_eq!(status, 200, "{secret}");
    let events = server.platform.store().events_from("team-pg", 0, &EventFilter::default(), 1000).unwrap();
    assert!(events.iter().any(|e| e.kind == "command.exited"), "{events:?}");
    let last_event = events.last().unwrap().id;
    // Nothing went to a SQLite file.
    assert!(!data.data.db_path().exists(), "state must not be in the data dir's SQLite file");

    // A restarted server finds all of it in the database and goes on.
    server.stop();
    let server = TestServer::start_with(config);
    let (status, sandbox) = server.call_as(&key, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!((status, sandbox["state"].as_str()), (200, Some("running")), "{sandbox}");
    let (_, old) = server.call_as(&key, "GET", &format!("/v1/sandboxes/{id}/commands/{command}"), None);
    assert_eq!(old["result"]["exit_code"], 0, "{old}");
    let (_, ran) =
        server.call_as(&key, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo still"})));
    assert_eq!(ran["stdout"], "still\n", "{ran}");
    let (_, secrets) = server.call_as(&key, "GET", "/v1/secrets", None);
    assert_eq!(secrets["secrets"][0]["name"], "pg-token", "{secrets}");
    assert!(!secrets.to_string().contains("pg-secret-value"));
    let later = server.platform.store().events_from("team-pg", last_event + 1, &EventFilter::default(), 1000).unwrap();
    assert!(later.iter().any(|e| e.kind == "command.started"), "events go on after the restart: {later:?}");
    let (status, deleted) = server.call_as(&key, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 202, "{deleted}");
    let op = deleted["operation"]["id"].as_str().unwrap();
    let (_, done) = server.call_as(&key, "GET", &format!("/v1/operations/{op}?wait=60"), None);
    assert_eq!(done["state"], "succeeded", "{done}");
}

fn operation(n: usize) -> Operation {
    Operation {
        id: format!("op_{n:020}"),
        kind: OperationKind::Pause,
        sandbox_id: Some("sbx_00000000000000000001".into()),
        template: None,
        state: OperationState::Succeeded,
        progress: Progress::new("done", 1, 1),
        error: None,
        forks: Vec::new(),
        checkpoint: None,
        frozen_ms: None,
        origin: OperationOrigin::Client,
        created_at: space_api::Timestamp::parse("2026-01-01T00:00:00Z").unwrap(),
        started_at: None,
        finished_at: None,
    }
}

#[test]
fn processes_share_one_database_and_event_ids_never_collide() {
    let pg = PgCluster::start();
    let stores: Vec<Store> = (0..2).map(|_| Store::connect(&pg.url).unwrap()).collect();
    // Both made the tables; the second found them.
    let (info, key) = create_key(&stores[0], "shared", None).unwrap();
    let hash = space_server::tenants::hash_key(&key);
    assert_eq!(stores[1].tenancy().key_tenant(&hash).unwrap().as_deref(), Some("shared"));
    assert!(stores[1].tenancy().revoke_key(&info.id, space_api::Timestamp::now()).unwrap());
    assert_eq!(stores[0].tenancy().key_tenant(&hash).unwrap(), None, "a key revoked through one is revoked for all");

    // Writers in both at once: every event gets its own id.
    std::thread::scope(|scope| {
        for (n, store) in stores.iter().enumerate() {
            scope.spawn(move || {
                for i in 0..100 {
                    store.node().put_operation(&operation(n * 1000 + i), "shared", None).unwrap();
                }
            });
        }
    });
    let events = stores[1].events_from("shared", 0, &EventFilter::default(), 1000).unwrap();
    assert_eq!(events.len(), 200);
    let mut ids: Vec<u64> = events.iter().map(|e| e.id).collect();
    ids.dedup();
    assert_eq!(ids.len(), 200, "event ids collided");
    assert_eq!(stores[0].node().tenant_operations("shared", None).unwrap().len(), 200);
    // A connection made later sees everything, and the schema again is harmless.
    let third = Store::connect(&pg.url).unwrap();
    assert_eq!(third.node().operations(Some("sbx_00000000000000000001")).unwrap().len(), 200);
}

/// Replicas started together on an empty database (the shipped Kubernetes
/// manifest starts two) all make or find the same tables: the schema is
/// made under a lock held until its transaction commits, so a second
/// replica never looks for tables that are made but not yet visible.
#[test]
fn replicas_starting_together_on_an_empty_database_all_start() {
    let pg = PgCluster::start();
    let mut admin = postgres::Client::connect(&pg.url, postgres::NoTls).unwrap();
    for round in 0..8 {
        let name = format!("replicas_{round}");
        admin.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        let url = pg.url.replace("/postgres", &format!("/{name}"));
        let barrier = std::sync::Barrier::new(3);
        let started: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let replicas: Vec<_> = (0..3)
                .map(|_| {
                    scope.spawn(|| {
                        barrier.wait();
                        Store::connect(&url).map(drop).map_err(|e| e.to_string())
                    })
                })
                .collect();
            replicas.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert!(started.iter().all(Result::is_ok), "round {round}: {started:?}");
    }
}
