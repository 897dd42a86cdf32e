//! Host disk a tenant causes is bounded and accounted: per-sandbox output
//! caps, tenant disk quotas over roots, output, snapshots, templates and
//! uploads (429 naming the resource), usage in the API, and the host's free
//! space reserve (507) under which the server keeps serving.

mod common;

use common::{platform_config, TestServer};
use serde_json::{json, Value};
use space_server::store::Quotas;
use space_server::tenants::create_key;
use space_testkit::{wait_for, TestDataDir, PATIENCE};

const MIB: u64 = 1 << 20;

fn usage(server: &TestServer, key: &str) -> Value {
    let (status, usage) = server.call_as(key, "GET", "/v1/usage", None);
    assert_eq!(status, 200, "{usage}");
    usage
}

fn create_as(server: &TestServer, key: &str, body: Value) -> (u16, Value) {
    server.call_as(key, "POST", "/v1/sandboxes", Some(body))
}

fn wait_running(server: &TestServer, key: &str, accepted: &Value) -> String {
    let op = accepted["operation"]["id"].as_str().unwrap();
    let (_, done) = server.call_as(key, "GET", &format!("/v1/operations/{op}?wait=60"), None);
    assert_eq!(done["state"], "succeeded", "{done}");
    accepted["sandbox"]["id"].as_str().unwrap().to_string()
}

fn exec_as(server: &TestServer, key: &str, id: &str, cmd: &str) -> Value {
    let (status, answer) =
        server.call_as(key, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": cmd, "timeout_s": 120})));
    assert_eq!(status, 200, "{answer}");
    answer
}

fn lifecycle_as(server: &TestServer, key: &str, id: &str, action: &str) -> (u16, Value) {
    server.call_as(key, "POST", &format!("/v1/sandboxes/{id}/{action}"), None)
}

#[test]
fn a_tenants_disk_is_counted_by_kind_and_bounded_with_429() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let quotas = Quotas { max_disk_mib: Some(1536), ..Quotas::default() };
    let (_, key) = create_key(server.platform.store(), "disky", Some(&quotas)).unwrap();

    let (status, accepted) = create_as(&server, &key, json!({"template": "base", "memory_mib": 256, "disk_mib": 512}));
    assert_eq!(status, 202, "{accepted}");
    let id = wait_running(&server, &key, &accepted);
    let fresh = usage(&server, &key);
    assert_eq!(fresh["tenant"], "disky");
    assert_eq!(fresh["quotas"]["max_disk_mib"], 1536);
    assert_eq!(fresh["sandboxes"], 1);
    assert_eq!(fresh["disk"]["roots_reserved_bytes"], 512 * MIB, "{fresh}");

    // Output and the root's own writes show up as they happen.
    exec_as(
        &server,
        &key,
        &id,
        "head -c 3000000 /dev/zero; dd if=/dev/urandom of=/root/blob bs=1M count=100 2>/dev/null",
    );
    let seen = wait_for("the root's writes and the output in the usage", PATIENCE, || {
        // btrfs counts a root's writes at a commit; the sandbox's writes may
        // reach the host after any one sync, so each look forces one.
        data.sync();
        let now = usage(&server, &key);
        let grown = now["disk"]["roots_used_bytes"].as_u64().unwrap() >= 100 * MIB
            && now["disk"]["transcripts_bytes"].as_u64().unwrap() >= 3_000_000;
        grown.then_some(now)
    });
    let disk = &seen["disk"];
    assert_eq!(disk["roots_reserved_bytes"], 512 * MIB, "the root's writes stay within what it reserves: {seen}");
    let total = disk["total_bytes"].as_u64().unwrap();
    assert_eq!(total, 512 * MIB + disk["transcripts_bytes"].as_u64().unwrap(), "{seen}");

    // Builds running at once share what is left: each is granted what the
    // others were not, and gives it back when it ends.
    let room = server.platform.build_allowance("disky").unwrap();
    assert!(room > 900 * MIB && room < 1024 * MIB, "{room}");
    let first = server.platform.grant_build_allowance("disky").unwrap();
    assert_eq!(first.bytes, room);
    let second = server.platform.grant_build_allowance("disky").unwrap();
    assert_eq!((second.bytes, server.platform.build_allowance("disky").unwrap()), (0, 0));
    drop((first, second));
    assert_eq!(server.platform.build_allowance("disky").unwrap(), room);

    // A second root that does not fit: 429 naming the disk.
    let (status, refused) = create_as(&server, &key, json!({"template": "base", "disk_mib": 1024}));
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["code"], "quota_exceeded");
    assert_eq!(refused["error"]["details"]["resource"], "disk", "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("1536 MiB of disk"), "{refused}");

    // A suspend writes the sandbox's memory to disk: counted, and bounded
    // by the memory limit.
    let (status, suspending) = lifecycle_as(&server, &key, &id, "suspend");
    assert_eq!(status, 202, "{suspending}");
    wait_running(&server, &key, &suspending);
    let suspended = usage(&server, &key);
    let snapshot = suspended["disk"]["snapshots_bytes"].as_u64().unwrap();
    assert!(snapshot > 0, "the snapshot is counted: {suspended}");
    assert!(snapshot <= 256 * MIB + space_server::disk::SNAPSHOT_OVERHEAD_BYTES, "the snapshot is {snapshot} bytes");
    let (status, resuming) = lifecycle_as(&server, &key, &id, "resume");
    assert_eq!(status, 202, "{resuming}");
    wait_running(&server, &key, &resuming);
    assert_eq!(usage(&server, &key)["disk"]["snapshots_bytes"], 0, "the snapshot goes once restored");

    // With the quota nearly used up, a suspend is refused before it writes.
    server
        .platform
        .store()
        .tenancy()
        .put_tenant("disky", &Quotas { max_disk_mib: Some(600), ..Quotas::default() })
        .unwrap();
    let (status, refused) = lifecycle_as(&server, &key, &id, "suspend");
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["details"]["resource"], "disk");
    assert_eq!(server.call_as(&key, "GET", &format!("/v1/sandboxes/{id}"), None).1["state"], "running");

    // Template builds and uploads count too; with nothing left, both are refused.
    server
        .platform
        .store()
        .tenancy()
        .put_tenant("disky", &Quotas { max_disk_mib: Some(514), ..Quotas::default() })
        .unwrap();
    let build = json!({"name": "mine", "from": {"debian": {"suite": "bookworm", "packages": ["jq"]}}});
    let (status, refused) = server.call_as(&key, "POST", "/v1/templates", Some(build));
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["details"]["resource"], "disk");
    let answer = server.early_answer(
        &format!(
            "POST /v1/templates?name=upload HTTP/1.1\r\nAuthorization: Bearer {key}\r\nContent-Type: application/x-tar"
        ),
        &[0u8; 4096],
    );
    let status: u16 = answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("\"resource\":\"disk\""), "{body}");
    let uploads = server.platform.data().run_dir().join("uploads");
    let left: Vec<_> = std::fs::read_dir(&uploads).map(|d| d.flatten().collect()).unwrap_or_default();
    assert!(left.is_empty(), "a refused upload leaves nothing: {left:?}");

    // Only the operator may look at another tenant's usage.
    let (status, _) = server.call_as(&key, "GET", "/v1/usage?tenant=default", None);
    assert_eq!(status, 403);
    let theirs = server.ok("GET", "/v1/usage?tenant=disky", None);
    assert_eq!(theirs["sandboxes"], 1);

    // Deleting gives it all back.
    let (status, deleting) = server.call_as(&key, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 202, "{deleting}");
    wait_running(&server, &key, &deleting);
    assert_eq!(usage(&server, &key)["disk"]["total_bytes"], 0);
}

#[test]
fn a_sandboxs_output_is_capped_across_all_its_commands() {
    let data = TestDataDir::new();
    let mut config = platform_config(&data);
    config.max_output_mib = 2;
    config.max_sandbox_output_mib = 3;
    let server = TestServer::start_with(config);
    let id = server.create_sandbox(json!({"template": "base"}));
    let mut kept = 0;
    let mut notes = Vec::new();
    for _ in 0..6 {
        let ran = server.exec(&id, json!({"cmd": "head -c 1000000 /dev/zero", "timeout_s": 60}));
        assert_eq!(ran["result"]["exit_code"], 0, "{ran}");
        kept += ran["result"]["stdout_bytes"].as_u64().unwrap();
        notes.extend(ran["result"]["error"].as_str().map(str::to_string));
    }
    assert!((2 * MIB..=3 * MIB).contains(&kept), "{kept} bytes kept of 6 MB");
    assert!(notes.iter().any(|n| n.contains("output limit")), "{notes:?}");
    let on_disk = space_server::disk::tree_bytes(&server.platform.data().sandbox_state_dir(&id).join("commands"));
    assert!(on_disk <= 3 * MIB, "{on_disk} bytes of transcripts on the host");
    // The sandbox itself keeps working; small output still fits nowhere,
    // and says so, while other sandboxes are not affected.
    let ran = server.exec(&id, json!({"argv": ["echo", "hi"]}));
    assert_eq!(ran["result"]["exit_code"], 0);
    let other = server.create_sandbox(json!({"template": "base"}));
    let ran = server.exec(&other, json!({"argv": ["echo", "hi"]}));
    assert_eq!(ran["stdout"], "hi\n");
}

#[test]
fn under_the_hosts_reserve_new_work_gets_507_and_the_server_keeps_serving() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    // Reserve more than the disk has: the host is "low" from now on.
    server.platform.set_disk_reserve_bytes(u64::MAX / 2);

    let low = |value: &Value| {
        value["error"]["code"] == "insufficient_storage" && value["error"]["details"]["resource"] == "host_disk"
    };
    let refused = server.error("POST", "/v1/sandboxes", Some(json!({"template": "base"})), 507, "insufficient_storage");
    assert!(low(&refused) && refused["error"]["message"].as_str().unwrap().contains("reserve"), "{refused}");
    let build = json!({"name": "late", "from": {"debian": {"suite": "bookworm", "packages": ["jq"]}}});
    let refused = server.error("POST", "/v1/templates", Some(build), 507, "insufficient_storage");
    assert!(low(&refused));
    let refused = server.error("POST", &format!("/v1/sandboxes/{id}/suspend"), None, 507, "insufficient_storage");
    assert!(low(&refused));
    let put = server.client().upload_bytes(&id, "/root/f", b"data");
    assert_eq!(put.as_ref().map_err(space_client::ClientError::status), Err(Some(507)), "{put:?}");

    // What runs keeps running; its output is counted, not kept.
    let ran = server.exec(&id, json!({"argv": ["echo", "still here"]}));
    assert_eq!(ran["result"]["exit_code"], 0, "{ran}");
    assert_eq!(ran["stdout"], "", "{ran}");
    assert!(ran["result"]["error"].as_str().unwrap().contains("low on disk"), "{ran}");
    let health = server.ok("GET", "/v1/health", None);
    assert_eq!(health["status"], "ok");
    assert!(health["disk"]["reserve_bytes"].as_u64().unwrap() > health["disk"]["free_bytes"].as_u64().unwrap());
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "running");

    // With room again, everything works as before.
    server.platform.set_disk_reserve_bytes(0);
    let ran = server.exec(&id, json!({"argv": ["echo", "back"]}));
    assert_eq!(ran["stdout"], "back\n");
    let again = server.create_sandbox(json!({"template": "base"}));
    server.delete_sandbox(&again);
}
