//! Templates from images in a real registry (Debian's `docker-registry`,
//! the distribution project's, on loopback), pushed there by `skopeo` from
//! OCI layouts this test writes, pulled through the API and run on real
//! runsc: the image's files, whiteouts, environment, working dir and start
//! command; a second template of the same image downloads nothing and
//! shares its layer chains; a private image with a tenant secret whose
//! value appears nowhere; and bad images refused at once or failed with
//! nothing left behind.

mod common;

use std::path::Path;

use common::{platform_config, TestServer};
use serde_json::{json, Value};
use space_testkit::images::{push_app_image, GREETING};
use space_testkit::oci_layout::{self, Compression, Image, Layer, Member, PushFormat};
use space_testkit::registry::{Registry, ScratchDir, TEST_PASSWORD, TEST_USER};
use space_testkit::TestDataDir;

/// A server that may pull from `registry` (plain HTTP on loopback).
fn server_for(data: &TestDataDir, registry: &Registry) -> TestServer {
    let mut config = platform_config(data);
    config.registry.insecure = vec![registry.host.clone()];
    TestServer::start_with(config)
}

fn create_template(server: &TestServer, body: Value) -> Value {
    let (status, accepted) = server.call("POST", "/v1/templates", Some(body.clone()));
    assert_eq!(status, 202, "{body} → {accepted}");
    assert_eq!(accepted["template"]["state"], "building", "{accepted}");
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap())
}

fn shell(server: &TestServer, sandbox: &str, script: &str) -> String {
    let ran = server.exec(sandbox, json!({"argv": ["/bin/sh", "-c", script]}));
    assert_eq!(ran["result"]["exit_code"], 0, "{script}: {ran}");
    ran["stdout"].as_str().unwrap_or_default().to_string()
}

/// The layer chains in the data dir's cache, and its partial ones.
fn chains(data: &TestDataDir) -> (usize, usize) {
    let entries: Vec<String> = std::fs::read_dir(data.root().join("cache/layers"))
        .map(|dir| dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let partial = entries.iter().filter(|name| name.ends_with(".partial")).count();
    (entries.len() - partial, partial)
}

fn operation_log(server: &TestServer, operation: &Value) -> String {
    let id = operation["id"].as_str().unwrap();
    server.client().get_text(&format!("/v1/operations/{id}/log")).unwrap_or_else(|e| panic!("the log of {id}: {e}"))
}

#[test]
fn an_image_in_a_registry_becomes_a_template_and_a_second_one_shares_its_layers() {
    let registry = Registry::start(None);
    let written = push_app_image(&registry, "team/app", "1.2", None);
    let data = TestDataDir::new();
    let server = server_for(&data, &registry);

    let reference = format!("{}/team/app:1.2", registry.host);
    let operation = create_template(&server, json!({"name": "pulled", "from": {"image": reference}}));
    assert_eq!(operation["state"], "succeeded", "{operation}\n{}", operation_log(&server, &operation));
    let template = server.ok("GET", "/v1/templates/pulled", None);
    let image = &template["source"]["image"];
    assert_eq!(image["digest"], written.images[0].manifest_digest.as_str(), "{template}");
    assert_eq!(image["layers"], 2, "{template}");
    let defaults = &template["defaults"];
    assert_eq!(defaults["workdir"], "/app", "{template}");
    assert_eq!(defaults["env"]["GREETING"], "hello from the config", "{template}");
    assert_eq!(defaults["command"], json!(["/bin/sh", "run.sh"]), "{template}");
    assert_eq!(chains(&data), (2, 0));

    let sandbox = server.create_sandbox(json!({"template": "pulled"}));
    let seen = shell(
        &server,
        &sandbox,
        "cat /etc/greeting; echo; test -e /etc/gone && echo gone-present || echo gone-absent; \
         ls /cache; pwd; echo \"$GREETING\"",
    );
    assert_eq!(seen, "from the top layer\ngone-absent\nnew\n/app\nhello from the config\n");
    // The recorded start command runs as the image meant it to.
    let ran = server.exec(&sandbox, json!({"argv": defaults["command"]}));
    assert_eq!(ran["stdout"], "running\n", "{ran}");

    // The same image pinned by digest: every layer cached, no new chain,
    // the new root a snapshot of the same top chain.
    let pinned = format!("{}/team/app@{}", registry.host, written.images[0].manifest_digest);
    let again = create_template(&server, json!({"name": "pulled-again", "from": {"image": pinned}}));
    assert_eq!(again["state"], "succeeded", "{again}");
    let log = operation_log(&server, &again);
    assert_eq!(log.matches(" cached").count(), 2, "{log}");
    assert!(!log.contains("applied"), "{log}");
    assert_eq!(chains(&data), (2, 0));
    let second = server.create_sandbox(json!({"template": "pulled-again"}));
    assert_eq!(shell(&server, &second, "cat /etc/greeting"), GREETING);

    // Deleting both templates leaves the chains (a cache), and a template
    // made from them afterwards still runs.
    for id in [&sandbox, &second] {
        let deleted = server.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
        server.wait_operation(deleted["operation"]["id"].as_str().unwrap());
    }
    for name in ["pulled", "pulled-again"] {
        let (status, answer) = server.call("DELETE", &format!("/v1/templates/{name}"), None);
        assert!((200..300).contains(&status), "deleting {name}: {answer}");
    }
    assert_eq!(chains(&data), (2, 0));
    let third = create_template(&server, json!({"name": "pulled-third", "from": {"image": reference}}));
    assert_eq!(third["state"], "succeeded", "{third}");
    let sandbox = server.create_sandbox(json!({"template": "pulled-third"}));
    assert_eq!(shell(&server, &sandbox, "cat /cache/new"), "kept");
}

#[test]
fn a_private_image_is_pulled_with_a_tenant_secret_that_is_never_written_down() {
    let registry = Registry::start(Some((TEST_USER, TEST_PASSWORD)));
    push_app_image(&registry, "private/app", "v1", Some((TEST_USER, TEST_PASSWORD)));
    let data = TestDataDir::new();
    // Reached by a name (a secret's hosts are names), fixed to loopback.
    let port = registry.host.rsplit(':').next().unwrap();
    let host = "registry.space.test".to_string();
    let mut config = platform_config(&data);
    config.registry.insecure = vec![format!("{host}:{port}")];
    config.registry.hosts = vec![(host.clone(), std::net::Ipv4Addr::LOCALHOST.into())];
    let server = TestServer::start_with(config);
    let reference = format!("{host}:{port}/private/app:v1");

    // No credential: refused at once, nothing reserved.
    let refused = server.error(
        "POST",
        "/v1/templates",
        Some(json!({"name": "private", "from": {"image": reference}})),
        422,
        "image_unavailable",
    );
    assert_eq!(refused["error"]["details"]["field"], "from.image", "{refused}");
    // A secret with the wrong password.
    server.ok("PUT", "/v1/secrets/wrong", Some(json!({"value": "not-the-password", "hosts": [host]})));
    let wrong = json!({"name": "private", "from": {"image": {"reference": reference,
        "auth": {"secret": "wrong", "username": TEST_USER}}}});
    server.error("POST", "/v1/templates", Some(wrong), 422, "image_unavailable");
    // A secret whose hosts do not cover the registry.
    server.ok("PUT", "/v1/secrets/elsewhere", Some(json!({"value": TEST_PASSWORD, "hosts": ["registry.example"]})));
    let elsewhere = json!({"name": "private", "from": {"image": {"reference": reference,
        "auth": {"secret": "elsewhere", "username": TEST_USER}}}});
    let refused = server.error("POST", "/v1/templates", Some(elsewhere), 422, "image_unavailable");
    assert!(refused["error"]["message"].as_str().unwrap().contains("registry.example"), "{refused}");
    // No such secret.
    let missing = json!({"name": "private", "from": {"image": {"reference": reference,
        "auth": {"secret": "nope", "username": TEST_USER}}}});
    server.error("POST", "/v1/templates", Some(missing), 422, "invalid_value");
    assert_eq!(server.call("GET", "/v1/templates/private", None).0, 404);

    server.ok("PUT", "/v1/secrets/registry", Some(json!({"value": TEST_PASSWORD, "hosts": [host]})));
    let operation = create_template(
        &server,
        json!({"name": "private", "from": {"image": {"reference": reference,
            "auth": {"secret": "registry", "username": TEST_USER}}}}),
    );
    assert_eq!(operation["state"], "succeeded", "{operation}\n{}", operation_log(&server, &operation));
    let template = server.ok("GET", "/v1/templates/private", None);
    assert_eq!(template["source"]["image"]["auth"], json!({"secret": "registry"}), "{template}");
    let sandbox = server.create_sandbox(json!({"template": "private"}));
    assert_eq!(shell(&server, &sandbox, "cat /etc/greeting"), GREETING);

    // The password is in none of what the server wrote.
    let mut written = operation_log(&server, &operation);
    written.push_str(&operation.to_string());
    written.push_str(&template.to_string());
    // The record, and the state (where the secret is sealed).
    for file in ["templates/private/1/template.json", "state/space.db", "state/space.db-wal"] {
        let bytes = std::fs::read(data.root().join(file)).unwrap_or_default();
        written.push_str(&String::from_utf8_lossy(&bytes));
    }
    assert!(!written.contains(TEST_PASSWORD), "the secret's value was written down");
}

#[test]
fn bad_images_are_refused_at_once_or_fail_leaving_nothing() {
    let registry = Registry::start(None);
    let written = push_app_image(&registry, "team/app", "ok", None);
    let data = TestDataDir::new();
    let server = server_for(&data, &registry);
    let host = &registry.host;

    for (what, image, code) in [
        ("an unknown tag", format!("{host}/team/app:nope"), "image_unavailable"),
        ("an unknown repository", format!("{host}/team/nothing:1"), "image_unavailable"),
        ("a reference without a host", "app:1".to_string(), "image_unavailable"),
        (
            "a digest the registry does not have",
            format!("{host}/team/app@sha256:{}", "0".repeat(64)),
            "image_unavailable",
        ),
        ("not a reference", "UPPER CASE/../x".to_string(), "image_unavailable"),
    ] {
        let body = json!({"name": "bad", "from": {"image": image}});
        let refused = server.error("POST", "/v1/templates", Some(body), 422, code);
        assert_eq!(refused["error"]["details"]["field"], "from.image", "{what}: {refused}");
    }
    // An image bigger than what the tenant's disk quota leaves: 429 at
    // once, nothing downloaded.
    let noise: Vec<u8> = (0..3u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let big = ScratchDir::new("big-layout");
    oci_layout::write(
        &big,
        "1",
        &[Image::amd64(vec![Layer::new(Compression::None, vec![Member::file("big", noise)])])],
    );
    oci_layout::push(&big, "1", host, "team/big", None, PushFormat::Oci);
    let quotas = space_server::store::Quotas { max_disk_mib: Some(1), ..Default::default() };
    let (_, small) = space_server::tenants::create_key(server.platform.store(), "small", Some(&quotas)).unwrap();
    let (status, refused) = server.call_as(
        &small,
        "POST",
        "/v1/templates",
        Some(json!({"name": "big", "from": {"image": format!("{host}/team/big:1")}})),
    );
    assert_eq!((status, refused["error"]["code"].as_str()), (429, Some("quota_exceeded")), "{refused}");
    // Two sources at once.
    let both = json!({"name": "bad", "from": {"image": format!("{host}/team/app:ok"), "debian": {"packages": ["jq"]}}});
    server.error("POST", "/v1/templates", Some(both), 422, "invalid_value");
    assert_eq!(server.call("GET", "/v1/templates/bad", None).0, 404);

    // A blob damaged in the registry after the push: the pull fails, no
    // template, no chain of it, nothing partial.
    let (top_digest, _) = written.images[0].layers[1].clone();
    std::fs::write(registry.blob_data(&top_digest), b"not the layer it claims to be").unwrap();
    let failed = create_template(&server, json!({"name": "damaged", "from": {"image": format!("{host}/team/app:ok")}}));
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["error"]["code"], "build_failed", "{failed}");
    let message = failed["error"]["message"].as_str().unwrap();
    assert!(message.contains("digest"), "{message}");
    assert_eq!(server.call("GET", "/v1/templates/damaged", None).0, 404);
    assert_eq!(chains(&data), (1, 0), "only the base layer's chain is kept");
    assert!(!Path::new(&data.root().join("templates/damaged")).exists());
    let uploads: Vec<_> =
        std::fs::read_dir(data.root().join("run/uploads")).map(|d| d.flatten().count()).into_iter().collect();
    assert!(uploads.iter().all(|n| *n == 0), "a downloaded blob was left: {uploads:?}");
}

#[test]
fn a_layer_that_climbs_out_of_its_root_fails_the_pull_with_nothing_left() {
    let registry = Registry::start(None);
    let layout = ScratchDir::new("escape-layout");
    let marker = format!("space-registry-escape-{}", std::process::id());
    let escaping = Layer::new(
        Compression::Gzip,
        vec![Member::Symlink { path: "up".into(), target: "../../../../../../../tmp".into() }],
    );
    let image =
        Image::amd64(vec![escaping, Layer::new(Compression::Gzip, vec![Member::file(&format!("up/{marker}"), "out")])]);
    oci_layout::write(&layout, "x", &[image]);
    oci_layout::push(&layout, "x", &registry.host, "evil/escape", None, PushFormat::Oci);
    let data = TestDataDir::new();
    let server = server_for(&data, &registry);
    let failed = create_template(
        &server,
        json!({"name": "escape", "from": {"image": format!("{}/evil/escape:x", registry.host)}}),
    );
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(failed["error"]["message"].as_str().unwrap().contains("outside"), "{failed}");
    assert!(!Path::new("/tmp").join(&marker).exists());
    assert_eq!(chains(&data), (0, 0));
    assert_eq!(server.call("GET", "/v1/templates/escape", None).0, 404);
}

#[test]
fn the_layer_cache_keeps_to_its_size_and_templates_outlive_their_chains() {
    let registry = Registry::start(None);
    push_app_image(&registry, "team/app", "1", None);
    let data = TestDataDir::new();
    let mut config = platform_config(&data);
    config.registry.insecure = vec![registry.host.clone()];
    // No room at all: every chain goes once the pull that made it is done.
    config.layer_cache_mib = 0;
    let server = TestServer::start_with(config);
    let reference = format!("{}/team/app:1", registry.host);

    let first = create_template(&server, json!({"name": "first", "from": {"image": reference}}));
    assert_eq!(first["state"], "succeeded", "{first}");
    assert_eq!(chains(&data), (0, 0), "evicted after the pull");
    let sandbox = server.create_sandbox(json!({"template": "first"}));
    assert_eq!(shell(&server, &sandbox, "cat /etc/greeting /cache/new"), format!("{GREETING}kept"));

    // The next pull of the image applies its layers again.
    let second = create_template(&server, json!({"name": "second", "from": {"image": reference}}));
    assert_eq!(second["state"], "succeeded", "{second}");
    let log = operation_log(&server, &second);
    assert_eq!(log.matches(" applied").count(), 2, "{log}");
    assert_eq!(chains(&data), (0, 0));
}
