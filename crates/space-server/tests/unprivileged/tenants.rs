//! Tenant quotas and isolation: a tenant past its sandbox, vCPU or memory
//! quota is refused with 429 `quota_exceeded`, others are not, and no
//! tenant sees or moves another's sandbox.

use serde_json::json;
use space_engine::fake::{Call, Fault};

use crate::harness::{Node, World};

/// Creates a sandbox as the tenant with `key`: the status, and the id
/// once it runs.
fn create_as(node: &Node, key: &str, body: serde_json::Value) -> (u16, Option<String>) {
    let (status, answer) = node.call_as(key, "POST", "/v1/sandboxes", Some(body));
    if status != 202 {
        assert_eq!(answer["error"]["code"], "quota_exceeded", "{answer}");
        return (status, None);
    }
    let operation = node.wait_op_as(key, answer["operation"]["id"].as_str().unwrap());
    assert_eq!(operation["state"], "succeeded", "{operation}");
    (status, answer["sandbox"]["id"].as_str().map(str::to_string))
}

#[test]
fn a_tenant_past_its_sandbox_quota_is_refused_and_others_are_not() {
    let world = World::new();
    let node = world.start();
    let limited = node.tenant("limited", json!({"max_sandboxes": 1}));
    let free = node.tenant("free", serde_json::Value::Null);
    let (_, first) = create_as(&node, &limited, json!({"template": "base"}));
    assert_eq!(create_as(&node, &limited, json!({"template": "base"})).0, 429);
    assert_eq!(create_as(&node, &free, json!({"template": "base"})).0, 202);
    let first = first.unwrap();
    let (status, answer) = node.call_as(&limited, "DELETE", &format!("/v1/sandboxes/{first}"), None);
    assert_eq!(status, 202, "{answer}");
    node.wait_op_as(&limited, answer["operation"]["id"].as_str().unwrap());
    assert_eq!(create_as(&node, &limited, json!({"template": "base"})).0, 202);
}

#[test]
fn memory_and_vcpu_quotas_count_what_the_tenant_holds() {
    let world = World::new();
    let node = world.start();
    let key = node.tenant("small", json!({"max_memory_mib": 300, "max_vcpus": 1}));
    assert_eq!(create_as(&node, &key, json!({"template": "base"})).0, 202);
    assert_eq!(create_as(&node, &key, json!({"template": "base", "memory_mib": 64})).0, 429, "vCPUs");
    let other = node.tenant("wide", json!({"max_vcpus": 4, "max_memory_mib": 300}));
    assert_eq!(create_as(&node, &other, json!({"template": "base", "vcpus": 2})).0, 202);
    assert_eq!(create_as(&node, &other, json!({"template": "base", "vcpus": 1, "memory_mib": 128})).0, 429, "memory");
}

#[test]
fn a_failed_sandbox_does_not_count_toward_the_quota() {
    let world = World::new();
    let node = world.start();
    let key = node.tenant("unlucky", json!({"max_sandboxes": 1}));
    world.engine.fault(Call::Create, None, Fault::Fail);
    let (status, answer) = node.call_as(&key, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202);
    assert_eq!(node.wait_op_as(&key, answer["operation"]["id"].as_str().unwrap())["state"], "failed");
    assert_eq!(create_as(&node, &key, json!({"template": "base"})).0, 202);
}

#[test]
fn forks_count_toward_the_quota() {
    let world = World::new();
    let node = world.start();
    let key = node.tenant("forker", json!({"max_sandboxes": 2}));
    let (_, id) = create_as(&node, &key, json!({"template": "base"}));
    let id = id.unwrap();
    let path = format!("/v1/sandboxes/{id}/fork");
    let (status, answer) = node.call_as(&key, "POST", &path, Some(json!({"count": 2})));
    assert_eq!(status, 429, "{answer}");
    assert_eq!(world.engine.count(Call::SaveImage, &id), 0);
    let (status, answer) = node.call_as(&key, "POST", &path, Some(json!({"count": 1})));
    assert_eq!(status, 202, "{answer}");
}

#[test]
fn a_tenant_neither_sees_nor_moves_another_tenants_sandbox() {
    let world = World::new();
    let node = world.start();
    let owner = node.tenant("owner", serde_json::Value::Null);
    let stranger = node.tenant("stranger", serde_json::Value::Null);
    let (_, id) = create_as(&node, &owner, json!({"template": "base"}));
    let id = id.unwrap();
    for (method, path) in [
        ("GET", format!("/v1/sandboxes/{id}")),
        ("POST", format!("/v1/sandboxes/{id}/pause")),
        ("DELETE", format!("/v1/sandboxes/{id}")),
    ] {
        let (status, answer) = node.call_as(&stranger, method, &path, None);
        assert_eq!(status, 404, "{method} {path}: {answer}");
    }
    let listed = node.call_as(&stranger, "GET", "/v1/sandboxes", None).1;
    assert!(!listed.to_string().contains(&id), "{listed}");
    assert_eq!(world.engine.count(Call::Pause, &id), 0);
    assert_eq!(node.call_as(&owner, "GET", &format!("/v1/sandboxes/{id}"), None).0, 200);
}
