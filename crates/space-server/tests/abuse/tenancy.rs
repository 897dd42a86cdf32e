//! A tenant with a valid key going after another tenant's resources by
//! spelling their ids the way a path-text check would not recognise
//! (`tests/route_matrix.rs` tries every route; these are the attempts of
//! the report, end to end).

use serde_json::json;
use space_testkit::TestDataDir;

use super::common::TestServer;
use super::{wait_as, Suite};

const DEFENCES: &[(&str, &str)] = &[
    (
        "run a command in another tenant's sandbox with a percent-encoded id",
        "ids decoded, parsed and owner-checked where the sandbox is loaded (404)",
    ),
    ("delete another tenant's sandbox with a percent-encoded id", "the same load, for every lifecycle call (404)"),
    ("read another tenant's operation with a percent-encoded id", "operations loaded for the caller (404)"),
    (
        "read another tenant's placeholders with a percent-encoded id",
        "the sandbox's record loaded for the caller (404)",
    ),
    (
        "restore another tenant's checkpoint through `..` in a checkpoint's name",
        "a checkpoint name is one segment of ours, checked where the checkpoint is loaded (404)",
    ),
    (
        "delete a shared template as a tenant, or learn who uses it",
        "403 before anything else for a tenant; shared templates are the operator's",
    ),
];

#[test]
fn tenancy_attempts_all_fail() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let mut suite = Suite::new(DEFENCES);
    let store = server.platform.store();
    let (_, alice) = space_server::tenants::create_key(store, "alice", None).unwrap();
    let (_, bob) = space_server::tenants::create_key(store, "bob", None).unwrap();
    let (status, created) = server.call_as(&alice, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{created}");
    let sandbox = created["sandbox"]["id"].as_str().unwrap().to_string();
    let operation = created["operation"]["id"].as_str().unwrap().to_string();
    assert_eq!(wait_as(&server, &alice, &operation)["state"], "succeeded");
    let encoded = format!("%73{}", &sandbox[1..]);

    let (status, ran) =
        server.call_as(&bob, "POST", &format!("/v1/sandboxes/{encoded}/exec"), Some(json!({"cmd": "id"})));
    suite.check(
        "run a command in another tenant's sandbox with a percent-encoded id",
        status == 404 && ran["stdout"].is_null(),
        format!("{status} {ran}"),
    );
    let (status, deleting) = server.call_as(&bob, "DELETE", &format!("/v1/sandboxes/{encoded}"), None);
    let (_, still) = server.call_as(&alice, "GET", &format!("/v1/sandboxes/{sandbox}"), None);
    suite.check(
        "delete another tenant's sandbox with a percent-encoded id",
        status == 404 && still["state"] == "running",
        format!("{status} {deleting} / alice sees {}", still["state"]),
    );
    let (status, seen) = server.call_as(&bob, "GET", &format!("/v1/operations/%6f{}", &operation[1..]), None);
    suite.check(
        "read another tenant's operation with a percent-encoded id",
        status == 404 && seen["sandbox_id"].is_null(),
        format!("{status} {seen}"),
    );
    let (status, record) = server.call_as(&bob, "GET", &format!("/v1/sandboxes/{encoded}"), None);
    suite.check(
        "read another tenant's placeholders with a percent-encoded id",
        status == 404 && record["network"].is_null() && record["id"].is_null(),
        format!("{status} {record}"),
    );

    // Bob's own sandbox and checkpoint (so his checkpoints directory exists
    // for a `..` to climb out of), then alice's checkpoint through a name.
    let save = |key: &str, id: &str, name: &str| {
        let (status, saving) =
            server.call_as(key, "POST", &format!("/v1/sandboxes/{id}/checkpoints"), Some(json!({"name": name})));
        assert_eq!(status, 202, "{saving}");
        assert_eq!(wait_as(&server, key, saving["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    };
    save(&alice, &sandbox, "first");
    let (status, own) = server.call_as(&bob, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{own}");
    let bobs = own["sandbox"]["id"].as_str().unwrap().to_string();
    assert_eq!(wait_as(&server, &bob, own["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    save(&bob, &bobs, "mine");
    let climb = format!("..%2F..%2F{sandbox}%2Fcheckpoints%2Ffirst");
    let (restore, restored) =
        server.call_as(&bob, "POST", &format!("/v1/sandboxes/{bobs}/checkpoints/{climb}/restore"), None);
    let from = json!({"name": "stolen", "from": {"checkpoint": {"sandbox": bobs, "name": format!("../../{sandbox}/checkpoints/first")}}});
    let (build, built) = server.call_as(&bob, "POST", "/v1/templates", Some(from));
    suite.check(
        "restore another tenant's checkpoint through `..` in a checkpoint's name",
        restore == 404 && build == 404,
        format!("restore: {restore} {restored} / template build: {build} {built}"),
    );

    // `base` is shared and alice's sandbox uses it.
    let mut answers = Vec::new();
    for spelled in ["base", "%62ase", "%62%61%73%65"] {
        let (status, answer) = server.call_as(&bob, "DELETE", &format!("/v1/templates/{spelled}"), None);
        answers.push((status, answer));
    }
    let (status, base) = server.call("GET", "/v1/templates/base", None);
    suite.check(
        "delete a shared template as a tenant, or learn who uses it",
        answers.iter().all(|(status, answer)| *status == 403 && !answer.to_string().contains("sandbox"))
            && status == 200
            && base["state"] == "ready",
        format!("{answers:?} / base: {status} {}", base["state"]),
    );

    suite.tally();
    suite.assert_all_held();
}
