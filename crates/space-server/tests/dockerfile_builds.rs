//! Templates from Dockerfiles, built through `POST /v1/templates/builds`
//! on real runsc: `FROM template:base` with RUN, COPY `--chown` and a
//! `.dockerignore`d file; a rebuild with its last RUN changed runs that
//! step alone; multi-stage `COPY --from`; `FROM` an image of a loopback
//! registry; a failing RUN fails the build naming its step and line and
//! leaves no template and no build sandbox; a RUN of a build without a
//! network reaches nothing, and with an allowlist reaches what it names; an
//! instruction SPACE does not build is a 422 with its line and reserves
//! nothing.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use common::{platform_config, TestServer};
use serde_json::{json, Value};
use space_testkit::images::push_app_image;
use space_testkit::registry::Registry;
use space_testkit::TestDataDir;

const BOUNDARY: &str = "space-build-boundary-7f3a";

/// A tar of `files` (path, mode, content).
fn context(files: &[(&str, u32, &str)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, mode, content) in files {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(*mode);
        header.set_uid(4242);
        header.set_size(content.len() as u64);
        builder.append_data(&mut header, path, content.as_bytes()).unwrap();
    }
    builder.into_inner().unwrap()
}

/// The multipart body of a build: `build` then, when given, `context`.
fn form(build: &Value, context: Option<&[u8]>) -> Vec<u8> {
    let mut body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"build\"\r\nContent-Type: application/json\r\n\r\n{build}\r\n"
    )
    .into_bytes();
    if let Some(context) = context {
        body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"context\"; filename=\"context.tar\"\r\n\
                 Content-Type: application/x-tar\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(context);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

/// Sends a build; the status and the answer.
fn send(server: &TestServer, build: Value, context: Option<&[u8]>) -> (u16, Value) {
    let content_type = format!("multipart/form-data; boundary={BOUNDARY}");
    let body = form(&build, context);
    let answer = server
        .client()
        .send_with("POST", "/v1/templates/builds", &[("Content-Type", content_type.as_str())], body.as_slice())
        .unwrap();
    (answer.status, answer.body)
}

/// Builds and waits: the finished operation and its log.
fn build(server: &TestServer, build: Value, context: Option<&[u8]>) -> (Value, String) {
    let (status, accepted) = send(server, build.clone(), context);
    assert_eq!(status, 202, "{build} → {accepted}");
    let operation = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    let id = operation["id"].as_str().unwrap();
    let log = server.client().get_text(&format!("/v1/operations/{id}/log")).unwrap_or_default();
    (operation, log)
}

fn shell(server: &TestServer, sandbox: &str, script: &str) -> String {
    let ran = server.exec(sandbox, json!({"argv": ["/bin/sh", "-c", script]}));
    assert_eq!(ran["result"]["exit_code"], 0, "{script}: {ran}");
    ran["stdout"].as_str().unwrap_or_default().to_string()
}

/// The sandboxes that have a directory in the data dir.
fn sandbox_dirs(data: &TestDataDir) -> Vec<String> {
    std::fs::read_dir(data.root().join("sandboxes"))
        .map(|dir| dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

#[test]
fn a_dockerfile_on_a_template_runs_copies_ignores_and_reuses_its_steps() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let files = context(&[
        ("app/run.sh", 0o755, "echo running\n"),
        ("app/secret.txt", 0o600, "not for the image\n"),
        (".dockerignore", 0o644, "app/secret.txt\n"),
    ]);
    let dockerfile = |last: &str| {
        format!(
            "FROM template:base\nENV GREETING=hi\nRUN echo \"built $GREETING\" > /built\nWORKDIR /app\n\
             COPY --chown=1000:1000 app/ /app/\nRUN {last}\nCMD [\"/bin/sh\", \"run.sh\"]\n"
        )
    };
    let request = |last: &str| json!({"name": "fromfile", "dockerfile": dockerfile(last)});
    let (operation, log) = build(&server, request("echo one > /last"), Some(&files));
    assert_eq!(operation["state"], "succeeded", "{operation}\n{log}");
    let template = server.ok("GET", "/v1/templates/fromfile", None);
    assert_eq!(template["defaults"]["workdir"], "/app", "{template}");
    assert_eq!(template["defaults"]["env"]["GREETING"], "hi", "{template}");
    assert_eq!(template["defaults"]["command"], json!(["/bin/sh", "run.sh"]), "{template}");
    let sandbox = server.create_sandbox(json!({"template": "fromfile"}));
    let seen = shell(
        &server,
        &sandbox,
        "cat /built /last; stat -c '%u:%g %a' /app/run.sh; test -e /app/secret.txt && echo secret || echo no-secret; \
         pwd; sh run.sh",
    );
    assert_eq!(seen, "built hi\none\n1000:1000 755\nno-secret\n/app\nrunning\n", "{log}");
    assert!(sandbox_dirs(&data).len() == 1, "build sandboxes left: {:?}", sandbox_dirs(&data));

    // Only the last RUN changed: every step before it is a cache hit.
    let (again, log) = build(&server, request("echo two > /last"), Some(&files));
    assert_eq!(again["state"], "succeeded", "{again}\n{log}");
    assert_eq!(log.matches(": cached").count(), 3, "{log}");
    assert_eq!(log.matches(": saved").count(), 1, "{log}");
    let sandbox = server.create_sandbox(json!({"template": "fromfile"}));
    assert_eq!(shell(&server, &sandbox, "cat /built /last"), "built hi\ntwo\n");
}

#[test]
fn a_failing_run_fails_the_build_naming_its_step_and_leaves_nothing() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let dockerfile = "FROM template:base\nRUN echo fine > /fine\nRUN echo about to fail && exit 3\nRUN echo never\n";
    let (operation, log) = build(&server, json!({"name": "failing", "dockerfile": dockerfile}), None);
    assert_eq!(operation["state"], "failed", "{operation}\n{log}");
    let message = operation["error"]["message"].as_str().unwrap();
    assert!(message.contains("step 2 (line 3): RUN exited with 3"), "{message}");
    assert!(log.contains("[step 2/3 line 3] about to fail"), "{log}");
    assert!(!log.contains("never"), "{log}");
    assert_eq!(server.call("GET", "/v1/templates/failing", None).0, 404);
    assert!(sandbox_dirs(&data).is_empty(), "build sandboxes left: {:?}", sandbox_dirs(&data));
}

#[test]
fn an_instruction_not_supported_is_refused_with_its_line_and_nothing_is_reserved() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let dockerfile = "FROM template:base\nRUN true\n\n\n\n\nHEALTHCHECK CMD true\n";
    let (status, refused) = send(&server, json!({"name": "unsupported", "dockerfile": dockerfile}), None);
    assert_eq!(status, 422, "{refused}");
    let error = &refused["error"];
    assert_eq!(error["code"], "invalid_value", "{refused}");
    assert_eq!(error["details"], json!({"field": "dockerfile", "instruction": "HEALTHCHECK", "line": 7}));
    assert!(error["message"].as_str().unwrap().starts_with("line 7: "), "{refused}");
    // A template this key cannot use is the request's fault too.
    let (status, refused) = send(&server, json!({"name": "unsupported", "dockerfile": "FROM template:nope\n"}), None);
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["error"]["details"]["line"], 1, "{refused}");
    assert_eq!(server.call("GET", "/v1/templates/unsupported", None).0, 404);
    let operations = server.ok("GET", "/v1/operations", None);
    assert!(!operations.to_string().contains("build_template"), "{operations}");
}

#[test]
fn a_multi_stage_build_copies_from_an_earlier_stage() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let dockerfile = "FROM template:base AS builder\nRUN mkdir -p /out/lib && echo made > /out/lib/thing \
                      && echo tool > /out/tool\n\
                      FROM template:base\nCOPY --from=builder /out/lib /opt/lib\nCOPY --from=builder /out/tool /opt/\n";
    let (operation, log) = build(&server, json!({"name": "staged", "dockerfile": dockerfile}), None);
    assert_eq!(operation["state"], "succeeded", "{operation}\n{log}");
    let sandbox = server.create_sandbox(json!({"template": "staged"}));
    assert_eq!(
        shell(&server, &sandbox, "cat /opt/lib/thing /opt/tool; test -e /out || echo no-out"),
        "made\ntool\nno-out\n"
    );
}

#[test]
fn a_dockerfile_from_a_private_image_pulls_it_with_the_builds_registry_secret() {
    use space_testkit::registry::{TEST_PASSWORD, TEST_USER};
    let registry = Registry::start(Some((TEST_USER, TEST_PASSWORD)));
    push_app_image(&registry, "private/app", "1", Some((TEST_USER, TEST_PASSWORD)));
    let data = TestDataDir::new();
    let port = registry.host.rsplit(':').next().unwrap();
    let host = "registry.space.test";
    let mut config = platform_config(&data);
    config.registry.insecure = vec![format!("{host}:{port}")];
    config.registry.hosts = vec![(host.to_string(), std::net::Ipv4Addr::LOCALHOST.into())];
    let server = TestServer::start_with(config);
    server.ok("PUT", "/v1/secrets/registry", Some(json!({"value": TEST_PASSWORD, "hosts": [host]})));
    let dockerfile = format!("FROM {host}:{port}/private/app:1\nRUN cat /etc/greeting > /copied\n");

    let (anonymous, log) = build(&server, json!({"name": "private", "dockerfile": dockerfile}), None);
    assert_eq!(anonymous["state"], "failed", "{anonymous}");
    assert!(log.contains("authentication failed"), "{log}");
    let auth = json!({"secret": "registry", "username": TEST_USER});
    let (operation, log) =
        build(&server, json!({"name": "private", "dockerfile": dockerfile, "registry_auth": auth}), None);
    assert_eq!(operation["state"], "succeeded", "{operation}\n{log}");
    assert!(!log.contains(TEST_PASSWORD), "the secret's value is in the log");
    let sandbox = server.create_sandbox(json!({"template": "private"}));
    assert_eq!(shell(&server, &sandbox, "cat /copied"), space_testkit::images::GREETING);
}

#[test]
fn a_dockerfile_from_a_registry_image_runs_in_its_shell() {
    let registry = Registry::start(None);
    push_app_image(&registry, "team/app", "1.2", None);
    let data = TestDataDir::new();
    let mut config = platform_config(&data);
    config.registry.insecure = vec![registry.host.clone()];
    let server = TestServer::start_with(config);
    let dockerfile = format!("FROM {}/team/app:1.2\nRUN echo \"$GREETING\" > /from-run\n", registry.host);
    let (operation, log) = build(&server, json!({"name": "onimage", "dockerfile": dockerfile}), None);
    assert_eq!(operation["state"], "succeeded", "{operation}\n{log}");
    let sandbox = server.create_sandbox(json!({"template": "onimage"}));
    assert_eq!(shell(&server, &sandbox, "cat /from-run; pwd"), "hello from the config\n/app\n");
}

/// An HTTP server on loopback answering `reached <path>`; the request lines
/// it saw.
fn upstream() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            // Read whole: a close with unread bytes would reset the answer.
            let mut header = String::new();
            while reader.read_line(&mut header).unwrap_or(0) > 0 && header != "\r\n" {
                header.clear();
            }
            let line = line.trim_end().to_string();
            log.lock().unwrap().push(line.clone());
            let body = format!("reached {}", line.split(' ').nth(1).unwrap_or_default());
            let _ =
                write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    });
    (port, seen)
}

#[test]
fn a_build_without_a_network_reaches_nothing_and_one_with_an_allowlist_reaches_its_host() {
    let (port, seen) = upstream();
    let data = TestDataDir::new();
    let mut config = platform_config(&data);
    config.egress = space_server::egress::EgressSettings::parse(
        &["upstream.space.test=127.0.0.1".into()],
        &["127.0.0.1/32".into()],
    )
    .unwrap();
    let server = TestServer::start_with(config);
    // The proxy variables every command has, so the name is the gateway's
    // to resolve; the timeout bounds a refusal that never answers.
    let dockerfile = format!(
        "FROM template:base\nRUN echo before > /before\n\
         RUN python3 -c \"import urllib.request; print(urllib.request.urlopen('http://upstream.space.test:{port}/from-build', timeout=20).read().decode())\"\n"
    );

    let (operation, log) = build(&server, json!({"name": "closed", "dockerfile": dockerfile}), None);
    assert_eq!(operation["state"], "failed", "{operation}\n{log}");
    let message = operation["error"]["message"].as_str().unwrap();
    assert!(message.contains("step 2 (line 3): RUN exited with 1"), "{message}");
    assert!(log.contains("[step 2/2 line 3] "), "{log}");
    assert!(seen.lock().unwrap().is_empty(), "reached without a network: {:?}", seen.lock().unwrap());
    assert_eq!(server.call("GET", "/v1/templates/closed", None).0, 404);
    assert!(sandbox_dirs(&data).is_empty(), "build sandboxes left: {:?}", sandbox_dirs(&data));

    let network = json!({"egress": "allowlist", "allow": [format!("upstream.space.test:{port}")]});
    let (operation, log) = build(&server, json!({"name": "open", "dockerfile": dockerfile, "network": network}), None);
    assert_eq!(operation["state"], "succeeded", "{operation}\n{log}");
    assert!(log.contains("[step 2/2 line 3] reached /from-build"), "{log}");
    assert_eq!(*seen.lock().unwrap(), vec!["GET /from-build HTTP/1.1".to_string()]);
    assert_eq!(server.ok("GET", "/v1/templates/open", None)["name"], "open");
    assert!(sandbox_dirs(&data).is_empty(), "build sandboxes left: {:?}", sandbox_dirs(&data));
}
