//! Volumes (issue 37): a tenant, or code inside a sandbox, trying to reach
//! the host or another tenant through a volume, or to become a second
//! writer of one.

use serde_json::json;
use space_testkit::TestDataDir;

use super::common::TestServer;
use super::{wait_as, Suite};

const DEFENCES: &[(&str, &str)] = &[
    (
        "mount another tenant's volume by its name, plainly or percent-encoded",
        "a volume is looked up among the caller's tenant's only, where it is loaded (404, nothing made)",
    ),
    (
        "read the host's files through a link a sandbox planted in a volume",
        "the files child's root directory is the volume: every link resolves inside it (404, or 422 for a loop)",
    ),
    (
        "write onto the host through a link a sandbox planted in a volume",
        "the same chroot: the write lands inside the volume",
    ),
    (
        "mount a volume over /proc, /.space or the sandbox's root",
        "MountPath, checked by the platform (422) and again by the helper",
    ),
    (
        "become a second writer of a volume by forking its writer",
        "a fork of a sandbox that mounts a volume read-write is refused (409 volume_in_use)",
    ),
];

#[test]
fn volumes_attempts_all_fail() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let mut suite = Suite::new(DEFENCES);
    let store = server.platform.store();
    let (_, alice) = space_server::tenants::create_key(store, "alice", None).unwrap();
    let (_, bob) = space_server::tenants::create_key(store, "bob", None).unwrap();
    let (status, made) =
        server.call_as(&alice, "POST", "/v1/volumes", Some(json!({"name": "private", "size_mib": 32})));
    assert_eq!(status, 201, "{made}");

    let before = server.call_as(&bob, "GET", "/v1/sandboxes", None).1["sandboxes"].as_array().map_or(0, Vec::len);
    let mut answers = Vec::new();
    for name in ["private", "%70rivate"] {
        let body = json!({"template": "base", "volumes": [{"name": name, "path": "/steal"}]});
        answers.push(server.call_as(&bob, "POST", "/v1/sandboxes", Some(body)).0);
        answers.push(server.call_as(&bob, "GET", &format!("/v1/volumes/{name}/files?path=/"), None).0);
    }
    let after = server.call_as(&bob, "GET", "/v1/sandboxes", None).1["sandboxes"].as_array().map_or(0, Vec::len);
    suite.check(
        "mount another tenant's volume by its name, plainly or percent-encoded",
        answers.iter().all(|s| *s == 404) && before == after,
        format!("{answers:?}, bob's sandboxes {before} → {after}"),
    );

    // Alice's sandbox plants links to the host's places.
    let body = json!({"template": "base", "volumes": [{"name": "private", "path": "/v"}]});
    let (status, created) = server.call_as(&alice, "POST", "/v1/sandboxes", Some(body));
    assert_eq!(status, 202, "{created}");
    let writer = created["sandbox"]["id"].as_str().unwrap().to_string();
    assert_eq!(wait_as(&server, &alice, created["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let plant = "ln -s / /v/host && ln -s /proc/1/root /v/init && ln -s ../../../../../etc /v/etc && echo planted";
    let (_, planted) =
        server.call_as(&alice, "POST", &format!("/v1/sandboxes/{writer}/exec"), Some(json!({"cmd": plant})));
    assert_eq!(planted["stdout"], "planted\n", "{planted}");

    let fork = server.call_as(&alice, "POST", &format!("/v1/sandboxes/{writer}/fork"), Some(json!({}))).1;
    suite.check(
        "become a second writer of a volume by forking its writer",
        fork["error"]["code"] == "volume_in_use",
        &fork,
    );
    let (status, deleting) = server.call_as(&alice, "DELETE", &format!("/v1/sandboxes/{writer}"), None);
    assert_eq!(status, 202, "{deleting}");
    assert_eq!(wait_as(&server, &alice, deleting["operation"]["id"].as_str().unwrap())["state"], "succeeded");

    let client = server.client_as(&alice);
    let read = |path: &str| {
        let answer = client.call_bytes("GET", &format!("/v1/volumes/private/files?path={path}"), &[], None).unwrap();
        (answer.status, String::from_utf8_lossy(&answer.body).into_owned())
    };
    let reads: Vec<(u16, String)> = ["/host/etc/passwd", "/init/etc/passwd", "/etc/passwd", "/host/proc/self/environ"]
        .iter()
        .map(|p| read(p))
        .collect();
    suite.check(
        "read the host's files through a link a sandbox planted in a volume",
        // Not found, or a loop of links (`/etc` → `../../etc` is itself
        // once `..` stops at the volume's root): never a host file.
        reads.iter().all(|(status, body)| [404, 422].contains(status) && !body.contains("root:")),
        format!("{reads:?}"),
    );
    let marker = format!("/tmp/space-abuse-volume-{}", std::process::id());
    let wrote = client
        .call_bytes("PUT", &format!("/v1/volumes/private/files?path=/host{marker}"), &[], Some(b"pwned"))
        .unwrap();
    let inside = read(&marker);
    suite.check(
        "write onto the host through a link a sandbox planted in a volume",
        !std::path::Path::new(&marker).exists() && (wrote.status != 201 || inside == (200, "pwned".to_string())),
        format!("PUT {} / host has it: {} / inside: {inside:?}", wrote.status, std::path::Path::new(&marker).exists()),
    );
    let _ = std::fs::remove_file(&marker);

    let mut refused = Vec::new();
    for path in ["/proc", "/proc/self", "/.space", "/.space/host", "/", "/dev/shm", "/sys/fs/cgroup"] {
        let body = json!({"template": "base", "volumes": [{"name": "private", "path": path}]});
        refused.push((path, server.call_as(&alice, "POST", "/v1/sandboxes", Some(body)).0));
    }
    suite.check(
        "mount a volume over /proc, /.space or the sandbox's root",
        refused.iter().all(|(_, status)| *status == 422),
        format!("{refused:?}"),
    );

    suite.tally();
    suite.assert_all_held();
}
