//! Tenants: keys, isolation (another tenant's resource is 404 on every
//! route, list and stream), shared and own templates, and quotas.

mod common;

use common::TestServer;
use serde_json::{json, Value};
use space_host::oci::{write_archive, ArchiveFormat, ImageSettings};
use space_server::store::Quotas;
use space_server::tenants::create_key;
use space_testkit::TestDataDir;

/// A one-file image, enough for a template that only has to exist.
fn tiny_image(data: &TestDataDir) -> std::path::PathBuf {
    let dir = data.root().join("tiny");
    std::fs::create_dir_all(&dir).unwrap();
    let layer = dir.join("layer.tar");
    let mut builder = tar::Builder::new(std::fs::File::create(&layer).unwrap());
    let mut header = tar::Header::new_gnu();
    header.set_size(3);
    header.set_mode(0o644);
    builder.append_data(&mut header, "etc/owner", &b"a\n"[..]).unwrap();
    builder.into_inner().unwrap();
    let archive = dir.join("image.tar");
    write_archive(&archive, ArchiveFormat::DockerSave, &[layer], &ImageSettings::default()).unwrap();
    archive
}

/// Imports an image archive as a template with a tenant's key, streamed
/// from the file; the answer, checked against the contract.
fn import_as(server: &TestServer, key: &str, path: &str, archive: &std::path::Path) -> (u16, Value) {
    let file = std::fs::File::open(archive).unwrap();
    let answer = server.client_as(key).send_with("POST", path, &[("Content-Type", "application/x-tar")], file).unwrap();
    server.check("POST", path, answer.status, "application/json", &answer.body);
    (answer.status, answer.body)
}

fn expect(server: &TestServer, key: &str, method: &str, path: &str, body: Option<Value>, status: u16) -> Value {
    let (got, value) = server.call_as(key, method, path, body);
    assert_eq!(got, status, "{method} {path} as another tenant: {value}");
    value
}

/// Deletes a sandbox with a tenant's key and waits until it is gone.
fn delete_as(server: &TestServer, key: &str, id: &str) {
    let (status, deleted) = server.call_as(key, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 202, "{deleted}");
    let op = deleted["operation"]["id"].as_str().unwrap();
    assert_eq!(expect(server, key, "GET", &format!("/v1/operations/{op}?wait=30"), None, 200)["state"], "succeeded");
}

#[test]
fn tenants_see_only_their_own_sandboxes_operations_commands_and_templates() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let (_, a) = create_key(server.platform.store(), "team-a", None).unwrap();
    let (b_info, b) = create_key(server.platform.store(), "team-b", None).unwrap();

    // A's sandbox, command and operation.
    let (status, accepted) = server.call_as(&a, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["sandbox"]["id"].as_str().unwrap().to_string();
    let op = accepted["operation"]["id"].as_str().unwrap().to_string();
    let done = expect(&server, &a, "GET", &format!("/v1/operations/{op}?wait=30"), None, 200);
    assert_eq!(done["state"], "succeeded", "{done}");
    let ran = expect(&server, &a, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo mine"})), 200);
    assert_eq!(ran["stdout"], "mine\n");
    let cid = ran["command"]["id"].as_str().unwrap().to_string();

    // B gets exactly what an unknown id gets, everywhere.
    let sbx = format!("/v1/sandboxes/{id}");
    let cmd = format!("{sbx}/commands/{cid}");
    for (method, path, body) in [
        ("GET", sbx.clone(), None),
        ("DELETE", sbx.clone(), None),
        ("POST", format!("{sbx}/pause"), Some(json!({}))),
        ("POST", format!("{sbx}/resume"), Some(json!({}))),
        ("POST", format!("{sbx}/suspend"), Some(json!({}))),
        ("POST", format!("{sbx}/exec"), Some(json!({"cmd": "id"}))),
        ("POST", format!("{sbx}/commands"), Some(json!({"cmd": "id"}))),
        ("GET", format!("{sbx}/commands"), None),
        ("GET", cmd.clone(), None),
        ("POST", format!("{cmd}/stdin"), Some(json!({"data": "x"}))),
        ("POST", format!("{cmd}/signal"), Some(json!({"signal": "TERM"}))),
        ("GET", format!("/v1/operations/{op}"), None),
    ] {
        let answer = expect(&server, &b, method, &path, body, 404);
        assert_eq!(answer["error"]["code"], "not_found", "{method} {path}: {answer}");
    }
    // Streams, files and the attach socket: their answers are not JSON.
    for path in [
        format!("{cmd}/output"),
        format!("{sbx}/files?path=/etc/hostname"),
        format!("/v1/operations/{op}/log"),
        format!("{cmd}/attach"),
    ] {
        let answer = server.client_as(&b).call_bytes("GET", &path, &[], None).unwrap();
        assert_eq!(answer.status, 404, "GET {path} as another tenant");
    }
    let listed = expect(&server, &b, "GET", "/v1/sandboxes", None, 200);
    assert_eq!(listed["sandboxes"], json!([]), "B lists none of A's sandboxes");
    let operations = expect(&server, &b, "GET", "/v1/operations", None, 200);
    assert_eq!(operations["operations"], json!([]));
    let operations = expect(&server, &b, "GET", &format!("/v1/operations?sandbox_id={id}"), None, 200);
    assert_eq!(operations["operations"], json!([]));
    // The operator's key is a tenant too: it does not see A's sandbox either.
    server.error("GET", &sbx, None, 404, "not_found");
    assert_eq!(expect(&server, &a, "GET", "/v1/sandboxes", None, 200)["sandboxes"].as_array().unwrap().len(), 1);

    // Idempotency keys are per tenant: B's use of A's key makes B's own sandbox.
    let create = |key: &str| {
        let body = json!({"template": "base"});
        let answer =
            server.client_as(key).call_with("POST", "/v1/sandboxes", &[("Idempotency-Key", "same-key")], Some(&body));
        let answer = answer.unwrap();
        assert_eq!(answer.status, 202, "{}", answer.body);
        answer.body
    };
    let first = create(&a);
    let other = create(&b);
    assert_ne!(first["sandbox"]["id"], other["sandbox"]["id"], "{first} {other}");
    let theirs = other["sandbox"]["id"].as_str().unwrap();
    assert_eq!(server.platform.store().node().sandbox(theirs).unwrap().unwrap().tenant, "team-b");
    delete_as(&server, &b, theirs);

    // Templates: A's own is invisible to B; shared ones are visible to all
    // and managed only with the operator's key.
    let archive = tiny_image(&data);
    let (status, accepted) = import_as(&server, &a, "/v1/templates?name=team-a-tools", &archive);
    assert_eq!(status, 202, "{accepted}");
    let built = expect(
        &server,
        &a,
        "GET",
        &format!("/v1/operations/{}?wait=30", accepted["operation"]["id"].as_str().unwrap()),
        None,
        200,
    );
    assert_eq!(built["state"], "succeeded", "{built}");
    expect(&server, &a, "GET", "/v1/templates/team-a-tools", None, 200);
    let answer = expect(&server, &b, "GET", "/v1/templates/team-a-tools", None, 404);
    assert_eq!(answer["error"]["code"], "template_not_found");
    let names = |key: &str| -> Vec<String> {
        expect(&server, key, "GET", "/v1/templates", None, 200)["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(names(&a).contains(&"team-a-tools".to_string()) && names(&a).contains(&"base".to_string()));
    assert!(!names(&b).contains(&"team-a-tools".to_string()) && names(&b).contains(&"base".to_string()));
    let answer = expect(&server, &b, "POST", "/v1/sandboxes", Some(json!({"template": "team-a-tools"})), 404);
    assert_eq!(answer["error"]["code"], "template_not_found");
    let answer = expect(
        &server,
        &b,
        "POST",
        "/v1/templates",
        Some(json!({"name": "team-a-tools", "from": {"debian": {"packages": ["jq"]}}})),
        409,
    );
    assert_eq!(answer["error"]["code"], "name_taken");
    expect(
        &server,
        &b,
        "POST",
        "/v1/templates",
        Some(json!({"name": "base", "from": {"debian": {"packages": ["jq"]}}})),
        409,
    );
    expect(&server, &b, "DELETE", "/v1/templates/team-a-tools", None, 404);
    let answer = expect(&server, &b, "DELETE", "/v1/templates/base", None, 403);
    assert_eq!(answer["error"]["code"], "forbidden");

    // Keys: a bad one and a revoked one are 401.
    assert_eq!(
        expect(&server, "space_not-a-real-key", "GET", "/v1/sandboxes", None, 401)["error"]["code"],
        "unauthorized"
    );
    assert!(server.platform.store().tenancy().revoke_key(&b_info.id, space_api::Timestamp::now()).unwrap());
    expect(&server, &b, "GET", "/v1/sandboxes", None, 401);

    for sandbox in [id, first["sandbox"]["id"].as_str().unwrap().to_string()] {
        delete_as(&server, &a, &sandbox);
    }
}

#[test]
fn quotas_refuse_with_429_and_name_the_limit() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let quotas = Quotas {
        max_sandboxes: Some(1),
        max_vcpus: Some(2),
        max_memory_mib: Some(768),
        max_disk_mib: None,
        ..Quotas::default()
    };
    let (_, key) = create_key(server.platform.store(), "small", Some(&quotas)).unwrap();
    let answer =
        expect(&server, &key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 1024})), 429);
    assert_eq!(answer["error"]["code"], "quota_exceeded");
    assert_eq!(answer["error"]["details"]["resource"], "memory_mib", "{answer}");
    assert!(answer["error"]["message"].as_str().unwrap().contains("768 MiB"), "{answer}");
    let answer = expect(&server, &key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "vcpus": 3})), 429);
    assert!(answer["error"]["message"].as_str().unwrap().contains("2 vCPUs"), "{answer}");
    let (status, accepted) =
        server.call_as(&key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256})));
    assert_eq!(status, 202, "{accepted}");
    let answer =
        expect(&server, &key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256})), 429);
    assert!(answer["error"]["message"].as_str().unwrap().contains("at most 1 sandboxes"), "{answer}");
    // Other tenants are not limited by it.
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 256}));
    server.delete_sandbox(&id);
    delete_as(&server, &key, accepted["sandbox"]["id"].as_str().unwrap());
    // Once deleted, it no longer counts.
    let (status, again) =
        server.call_as(&key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256})));
    assert_eq!(status, 202, "{again}");
    delete_as(&server, &key, again["sandbox"]["id"].as_str().unwrap());
}

#[test]
fn networks_come_from_the_request_the_template_or_the_tenant_and_never_pass_the_ceiling() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let quotas = Quotas {
        network: Some(space_api::Network {
            egress: space_api::Egress::Allowlist,
            allow: vec!["tenant.space.test".into()],
            ..Default::default()
        }),
        egress_ceiling: Some(vec!["*.space.test".into(), "git.example:443".into()]),
        ..Quotas::default()
    };
    let (_, key) = create_key(server.platform.store(), "netted", Some(&quotas)).unwrap();
    let network_of =
        |id: &str| expect(&server, &key, "GET", &format!("/v1/sandboxes/{id}"), None, 200)["network"].clone();
    let create = |body: Value| {
        let (status, accepted) = server.call_as(&key, "POST", "/v1/sandboxes", Some(body));
        assert_eq!(status, 202, "{accepted}");
        let operation = accepted["operation"]["id"].as_str().unwrap();
        let done = expect(&server, &key, "GET", &format!("/v1/operations/{operation}?wait=60"), None, 200);
        assert_eq!(done["state"], "succeeded", "{done}");
        accepted["sandbox"]["id"].as_str().unwrap().to_string()
    };

    // No network in the request or the template: the tenant's default.
    let from_tenant = create(json!({"template": "base"}));
    assert_eq!(network_of(&from_tenant)["allow"], json!(["tenant.space.test"]));
    // The request's own wins.
    let from_request =
        create(json!({"template": "base", "network": {"egress": "allowlist", "allow": ["mine.space.test:8443"]}}));
    assert_eq!(network_of(&from_request)["allow"], json!(["mine.space.test:8443"]));

    // A template's network (given at import) wins over the tenant's.
    let archive = tiny_image(&data);
    let network = r#"{"egress":"allowlist","allow":["tmpl.space.test"]}"#;
    let path = format!("/v1/templates?name=netted-tools&network={}", urlencode(network));
    let (status, accepted) = import_as(&server, &key, &path, &archive);
    assert_eq!(status, 202, "{accepted}");
    let operation = accepted["operation"]["id"].as_str().unwrap();
    let built = expect(&server, &key, "GET", &format!("/v1/operations/{operation}?wait=60"), None, 200);
    assert_eq!(built["state"], "succeeded", "{built}");
    let template = expect(&server, &key, "GET", "/v1/templates/netted-tools", None, 200);
    assert_eq!(template["defaults"]["network"]["allow"], json!(["tmpl.space.test"]), "{template}");
    let from_template = create(json!({"template": "netted-tools"}));
    assert_eq!(network_of(&from_template)["allow"], json!(["tmpl.space.test"]));

    // Beyond the ceiling: at create and live, with the rule named; what
    // was there is untouched.
    for network in [
        json!({"egress": "public"}),
        json!({"egress": "allowlist", "allow": ["pkgs.example"]}),
        json!({"egress": "allowlist", "allow": ["git.example"]}),
    ] {
        let refused =
            expect(&server, &key, "POST", "/v1/sandboxes", Some(json!({"template": "base", "network": network})), 422);
        assert_eq!(refused["error"]["code"], "egress_not_permitted", "{refused}");
        assert!(refused["error"]["details"]["rule"].is_string(), "{refused}");
        let path = format!("/v1/sandboxes/{from_tenant}/network");
        let refused = expect(&server, &key, "PUT", &path, Some(network.clone()), 422);
        assert_eq!(refused["error"]["code"], "egress_not_permitted", "{refused}");
    }
    assert_eq!(network_of(&from_tenant)["allow"], json!(["tenant.space.test"]));
    let within = json!({"egress": "allowlist", "allow": ["git.example:443", "a.b.space.test"]});
    let changed = expect(&server, &key, "PUT", &format!("/v1/sandboxes/{from_tenant}/network"), Some(within), 200);
    assert_eq!(changed["network"]["allow"], json!(["git.example:443", "a.b.space.test"]));
    // Other tenants (here the operator) have no ceiling.
    let free = server.create_sandbox(json!({"template": "base", "network": {"egress": "public"}}));
    server.delete_sandbox(&free);
    for id in [from_tenant, from_request, from_template] {
        delete_as(&server, &key, &id);
    }
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}
