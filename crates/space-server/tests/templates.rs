//! Templates built from Debian packages through the API, on real runsc.

mod common;

use std::time::Duration;

use common::TestServer;
use serde_json::json;
use space_testkit::TestDataDir;

#[test]
fn a_debian_template_builds_as_an_operation_and_runs_its_packages() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let (status, accepted) = server.call(
        "POST",
        "/v1/templates",
        Some(json!({"name": "jqbox", "from": {"debian": {"packages": ["jq"]}}, "defaults": {"env": {"TOOL": "jq"}}})),
    );
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(accepted["template"]["state"], "building");
    let op = accepted["operation"]["id"].as_str().unwrap().to_string();
    assert_eq!(accepted["operation"]["kind"], "build_template");
    let listed = server.ok("GET", "/v1/templates/jqbox", None);
    assert_eq!(listed["state"], "building");
    server.error(
        "POST",
        "/v1/templates",
        Some(json!({"name": "jqbox", "from": {"debian": {"packages": ["jq"]}}})),
        409,
        "build_in_progress",
    );

    // Progress moves through real steps while it builds.
    let mut steps = Vec::new();
    let mut packages_seen = Vec::new();
    let operation = loop {
        let operation = server.ok("GET", &format!("/v1/operations/{op}"), None);
        let amount = &operation["progress"]["amount"];
        if amount["unit"] == "packages" {
            packages_seen.push((amount["done"].as_u64().unwrap(), amount["total"].as_u64().unwrap()));
        }
        let step = operation["progress"]["step"].as_str().unwrap().to_string();
        if steps.last() != Some(&step) {
            steps.push(step);
        }
        if matches!(operation["state"].as_str(), Some("succeeded" | "failed")) {
            break operation;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(operation["state"], "succeeded", "{operation}");
    assert!(steps.iter().any(|s| s.starts_with("mmdebstrap")), "progress showed the build's steps: {steps:?}");
    assert!(
        !packages_seen.is_empty() && packages_seen.iter().all(|(done, total)| done <= total),
        "progress counted packages: {packages_seen:?}"
    );
    let auth = format!("Bearer {}", server.key);
    let (status, log) = server.raw("GET", &format!("/v1/operations/{op}/log"), &[("Authorization", &auth)], None);
    assert_eq!(status, 200);
    assert!(log.contains("jq"), "the log tells what was installed");

    let template = server.ok("GET", "/v1/templates/jqbox", None);
    assert_eq!((template["state"].as_str(), template["version"].as_u64()), (Some("ready"), Some(1)));
    let id = server.create_sandbox(json!({"template": "jqbox"}));
    let jq = server.exec(&id, json!({"cmd": "echo '{\"a\": [1, 2]}' | jq -c '.a | length'; echo $TOOL"}));
    assert_eq!(jq["stdout"], "2\njq\n", "{jq}");

    // In use: refused. Free: every version goes.
    server.error("DELETE", "/v1/templates/jqbox", None, 409, "template_in_use");
    server.delete_sandbox(&id);
    let (status, _) = server.raw("DELETE", "/v1/templates/jqbox", &[("Authorization", &auth)], None);
    assert_eq!(status, 204);
    server.error("GET", "/v1/templates/jqbox", None, 404, "template_not_found");
    assert!(!data.data.templates_dir().join("jqbox").exists());
    let names: Vec<String> = server.ok("GET", "/v1/templates", None)["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["base"]);
}

#[test]
fn bad_template_requests_are_refused_and_a_failed_build_leaves_nothing() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    server.error(
        "POST",
        "/v1/templates",
        Some(json!({"name": "Bad Name", "from": {"debian": {"packages": ["jq"]}}})),
        400,
        "invalid_request",
    );
    server.error(
        "POST",
        "/v1/templates",
        Some(json!({"name": "x", "from": {"debian": {"packages": ["jq; rm -rf /"]}}})),
        422,
        "invalid_value",
    );
    server.error(
        "POST",
        "/v1/templates",
        Some(json!({"name": "x", "from": {"debian": {"packages": []}}})),
        422,
        "invalid_value",
    );
    server.error("POST", "/v1/templates", Some(json!({"name": "x", "from": {"oci": {}}})), 400, "invalid_request");
    // A default environment is checked as a create's is.
    server.error(
        "POST",
        "/v1/templates",
        Some(json!({"name": "x", "from": {"debian": {"packages": ["jq"]}}, "defaults": {"env": {"A=B": "1"}}})),
        422,
        "invalid_value",
    );
    // The query is for image archives: a JSON build would drop it (a
    // network among them), so it is refused, not ignored.
    for query in ["network=%7B%22egress%22%3A%22none%22%7D", "vcpus=2", "memory_mib=1024", "disk_mib=4096"] {
        let refused = server.error(
            "POST",
            &format!("/v1/templates?{query}"),
            Some(json!({"name": "x", "from": {"debian": {"packages": ["jq"]}}})),
            400,
            "invalid_request",
        );
        assert!(refused["error"]["message"].as_str().unwrap().contains("none in the query"), "{refused}");
    }

    let (status, accepted) = server.call(
        "POST",
        "/v1/templates",
        Some(json!({"name": "broken", "from": {"debian": {"packages": ["no-such-package-xyz"]}}})),
    );
    assert_eq!(status, 202);
    let op = accepted["operation"]["id"].as_str().unwrap();
    let operation = server.wait_operation(op);
    assert_eq!(operation["state"], "failed");
    assert_eq!(operation["error"]["code"], "build_failed");
    let auth = format!("Bearer {}", server.key);
    let (status, log) = server.raw("GET", &format!("/v1/operations/{op}/log"), &[("Authorization", &auth)], None);
    assert_eq!(status, 200);
    assert!(log.contains("no-such-package-xyz"), "the log shows why: {log}");
    server.error("GET", "/v1/templates/broken", None, 404, "template_not_found");
    let leftovers: Vec<_> =
        std::fs::read_dir(data.data.templates_dir().join("broken")).map(|d| d.flatten().count()).into_iter().collect();
    assert!(leftovers.iter().all(|n| *n == 0), "no half-built version is left");
}

#[test]
fn a_directory_becomes_a_template_and_sandboxes_never_change_it() {
    let data = TestDataDir::new();
    // A directory holding a root filesystem: a writable copy of base with a marker.
    let source = data.root().join("source-root");
    space_host::btrfs::snapshot(&data.data.template("base").unwrap().rootfs(), &source).unwrap();
    std::fs::write(source.join("etc/marker"), "from a directory\n").unwrap();
    let defaults = space_host::template::TemplateDefaults::default();
    let agent = space_testkit::agent_bin();
    let imported = space_host::template::import_dir(&data.data, "fromdir", &source, &defaults, &agent, |_| {}).unwrap();
    assert_eq!(imported.meta.version, 1);

    let server = TestServer::start(&data);
    let first = server.create_sandbox(json!({"template": "fromdir"}));
    assert_eq!(server.exec(&first, json!({"argv": ["cat", "/etc/marker"]}))["stdout"], "from a directory\n");
    server.exec(
        &first,
        json!({"cmd": "echo changed > /etc/marker; rm /bin/true-not-there 2>/dev/null; touch /etc/new-file"}),
    );
    let second = server.create_sandbox(json!({"template": "fromdir"}));
    let seen = server.exec(&second, json!({"cmd": "cat /etc/marker; ls /etc/new-file 2>&1 | grep -c 'No such'"}));
    assert_eq!(seen["stdout"], "from a directory\n1\n", "a sandbox's writes never reach its template");
    assert_eq!(
        std::fs::read_to_string(imported.rootfs().join("etc/marker")).unwrap(),
        "from a directory\n",
        "the template's root on disk is untouched"
    );
}

#[test]
fn a_rebuild_makes_a_new_version_and_the_old_one_goes_with_its_last_sandbox() {
    let data = TestDataDir::new();
    let source = data.root().join("source-root");
    space_host::btrfs::snapshot(&data.data.template("base").unwrap().rootfs(), &source).unwrap();
    let defaults = space_host::template::TemplateDefaults::default();
    let agent = space_testkit::agent_bin();
    std::fs::write(source.join("etc/generation"), "one\n").unwrap();
    space_host::template::import_dir(&data.data, "gen", &source, &defaults, &agent, |_| {}).unwrap();

    let server = TestServer::start(&data);
    let old = server.create_sandbox(json!({"template": "gen"}));
    std::fs::write(source.join("etc/generation"), "two\n").unwrap();
    let v2 = space_host::template::import_dir(&data.data, "gen", &source, &defaults, &agent, |_| {}).unwrap();
    assert_eq!(v2.meta.version, 2);
    let new = server.create_sandbox(json!({"template": "gen"}));
    assert_eq!(
        server.exec(&old, json!({"argv": ["cat", "/etc/generation"]}))["stdout"],
        "one\n",
        "a sandbox keeps its version"
    );
    assert_eq!(server.exec(&new, json!({"argv": ["cat", "/etc/generation"]}))["stdout"], "two\n");
    std::thread::sleep(Duration::from_millis(1500));
    let v1 = data.data.templates_dir().join("gen/1");
    assert!(v1.exists(), "version 1 stays while a sandbox uses it");

    server.delete_sandbox(&old);
    for _ in 0..50 {
        if !v1.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!v1.exists(), "version 1 is reclaimed once its last sandbox is gone");
    assert!(data.data.templates_dir().join("gen/2").exists());
}
