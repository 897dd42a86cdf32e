//! A tenant using a template's image reference to make the server reach
//! what it must not (its own loopback, the metadata address, a private
//! name), or another tenant's registry credential.

use std::net::TcpListener;

use serde_json::json;
use space_testkit::TestDataDir;

use super::common::TestServer;
use super::Suite;

const DEFENCES: &[(&str, &str)] = &[
    (
        "make the server connect to its own loopback through an image reference",
        "the registry client connects only to public addresses unless the operator listed the registry",
    ),
    (
        "reach the cloud metadata address through an image reference",
        "link-local addresses are refused before any connection",
    ),
    (
        "reach a loopback service through a name that resolves to it",
        "the client's resolver drops loopback, private and link-local answers",
    ),
    ("pull with another tenant's registry secret", "secrets are loaded for the caller's tenant (422: no such secret)"),
];

#[test]
fn registry_attempts_all_fail() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let mut suite = Suite::new(DEFENCES);
    let store = server.platform.store();
    let (_, alice) = space_server::tenants::create_key(store, "alice", None).unwrap();
    let (_, bob) = space_server::tenants::create_key(store, "bob", None).unwrap();
    let pull = |key: &str, name: &str, image: serde_json::Value| {
        server.call_as(key, "POST", "/v1/templates", Some(json!({"name": name, "from": {"image": image}})))
    };

    // A listener on the server's loopback that must never hear from it.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let (status, answer) = pull(&bob, "ssrf", json!(format!("127.0.0.1:{port}/internal/app:1")));
    // The refusal came before any connection could: one made would wait
    // in the listener's backlog now.
    let heard = listener.accept().is_ok();
    suite.check(
        "make the server connect to its own loopback through an image reference",
        status == 422 && answer["error"]["code"] == "image_unavailable" && !heard,
        format!("{status} {answer}, the listener heard it: {heard}"),
    );
    let (status, answer) = pull(&bob, "metadata", json!("169.254.169.254/latest/meta-data:1"));
    suite.check(
        "reach the cloud metadata address through an image reference",
        status == 422 && answer["error"]["message"].as_str().is_some_and(|m| m.contains("link-local")),
        format!("{status} {answer}"),
    );
    let (status, answer) = pull(&bob, "named", json!(format!("localhost:{port}/internal/app:1")));
    let heard = listener.accept().is_ok();
    suite.check(
        "reach a loopback service through a name that resolves to it",
        status == 422 && answer["error"]["code"] == "image_unavailable" && !heard,
        format!("{status} {answer}, the listener heard it: {heard}"),
    );

    let (status, _) = server.call_as(
        &alice,
        "PUT",
        "/v1/secrets/registry",
        Some(json!({"value": "alices-password", "hosts": ["registry.space.test"]})),
    );
    assert_eq!(status, 200);
    let theirs =
        json!({"reference": "registry.space.test/alice/app:1", "auth": {"secret": "registry", "username": "alice"}});
    let (status, answer) = pull(&bob, "theirs", theirs);
    suite.check(
        "pull with another tenant's registry secret",
        status == 422 && answer["error"]["message"].as_str().is_some_and(|m| m.contains("there is no secret")),
        format!("{status} {answer}"),
    );
    for name in ["ssrf", "metadata", "named", "theirs"] {
        assert_eq!(server.call_as(&bob, "GET", &format!("/v1/templates/{name}"), None).0, 404, "{name} was made");
    }

    suite.tally();
    suite.assert_all_held();
}
