//! Credentials through the egress gateway, end to end on a real sandbox
//! (the polyglot template: curl, git, pip). The "internet" is one HTTPS
//! server of this test on 127.0.0.1 with its own CA, answering for four
//! made-up names: a private package index and a git host that want
//! credentials, an API that echoes what it was sent, and another host.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::{platform_config, TestServer};
use serde_json::{json, Value};
use space_host::template::{BASE_TEMPLATE, POLYGLOT_TEMPLATE};
use space_testkit::{wait_until, TestDataDir, PATIENCE};
use tokio_rustls::rustls;

const HOSTS: [&str; 4] = ["api.space.test", "git.space.test", "pypi.space.test", "other.space.test"];

/// What the upstream saw: (host, path, authorization) per request.
type Seen = Arc<Mutex<Vec<(String, String, String)>>>;

struct Upstream {
    port: u16,
    ca_file: PathBuf,
    seen: Seen,
    /// The credentials it wants (`user:password` in Basic), by host.
    wants: Arc<Mutex<std::collections::HashMap<String, String>>>,
}

/// An HTTPS server for [`HOSTS`], its certificate signed by a CA written to
/// `dir`: `/echo` answers with the authorization it got; `/simple/...`,
/// `/files/...` and `/repo.git/...` serve `dir/www` to whoever brings the
/// host's credentials (401 with a Basic challenge otherwise).
fn upstream(dir: &Path) -> Upstream {
    let ca = space_testkit::TestCa::new(dir, "upstream-ca");
    let config = ca.server(&HOSTS.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    let ca_file = ca.file.clone();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let wants: Arc<Mutex<std::collections::HashMap<String, String>>> = Arc::default();
    let www = dir.join("www");
    let (log, wanted) = (seen.clone(), wants.clone());
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (config, log, wanted, www) = (config.clone(), log.clone(), wanted.clone(), www.clone());
            std::thread::spawn(move || {
                let Ok(connection) = rustls::ServerConnection::new(config) else { return };
                let mut reader = BufReader::new(rustls::StreamOwned::new(connection, tcp));
                serve_requests(&mut reader, &log, &wanted, &www);
            });
        }
    });
    Upstream { port, ca_file, seen, wants }
}

fn serve_requests<S: Read + Write>(
    reader: &mut BufReader<S>,
    log: &Seen,
    wanted: &Mutex<std::collections::HashMap<String, String>>,
    www: &Path,
) {
    use base64::Engine as _;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let (mut host, mut auth) = (String::new(), String::new());
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header == "\r\n" {
                break;
            }
            let (name, value) = header.split_once(':').unwrap_or(("", ""));
            match name.to_ascii_lowercase().as_str() {
                "host" => host = value.trim().to_string(),
                "authorization" => auth = value.trim().to_string(),
                _ => {}
            }
        }
        let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        log.lock().unwrap().push((host.clone(), path.clone(), auth.clone()));
        let mut kind = "application/octet-stream";
        let (status, body): (&str, Vec<u8>) = if path == "/echo" {
            ("200 OK", format!("you sent: {auth}").into_bytes())
        } else {
            let want = wanted.lock().unwrap().get(&host).cloned();
            let given = auth
                .strip_prefix("Basic ")
                .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                .map(|b| String::from_utf8_lossy(&b).into_owned());
            let file = www.join(path.trim_start_matches('/').split('?').next().unwrap_or(""));
            let file = if file.is_dir() { file.join("index.html") } else { file };
            if file.extension().is_some_and(|e| e == "html") {
                kind = "text/html";
            }
            match (want, given) {
                (Some(want), Some(given)) if want == given => match std::fs::read(&file) {
                    Ok(bytes) => ("200 OK", bytes),
                    Err(_) => ("404 Not Found", b"no such file".to_vec()),
                },
                _ => ("401 Unauthorized", b"credentials, please".to_vec()),
            }
        };
        let stream = reader.get_mut();
        let challenge = if status.starts_with("401") { "WWW-Authenticate: Basic realm=\"test\"\r\n" } else { "" };
        let head =
            format!("HTTP/1.1 {status}\r\n{challenge}Content-Type: {kind}\r\nContent-Length: {}\r\n\r\n", body.len());
        if stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(&body))
            .and_then(|()| stream.flush())
            .is_err()
        {
            return;
        }
    }
}

/// A bare git repository (dumb HTTP: served as plain files) and a one-wheel
/// package index under `www`.
fn publish(www: &Path) {
    // Through the reaper: it waits for any child of this process, so a
    // plain `output()` could find its child already reaped (ECHILD).
    let run = |args: &[&str], cwd: &Path| {
        let mut command = std::process::Command::new(args[0]);
        command.args(&args[1..]).current_dir(cwd);
        let out = space_testkit::output_within(&mut command, space_testkit::PATIENCE);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    std::fs::create_dir_all(www).unwrap();
    let work = www.parent().unwrap().join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("README"), "cloned through the gateway\n").unwrap();
    run(&["git", "init", "-q", "-b", "main"], &work);
    run(&["git", "-c", "user.name=t", "-c", "user.email=t@space.test", "add", "README"], &work);
    run(&["git", "-c", "user.name=t", "-c", "user.email=t@space.test", "commit", "-q", "-m", "first"], &work);
    run(&["git", "clone", "-q", "--bare", work.to_str().unwrap(), www.join("repo.git").to_str().unwrap()], www);
    run(&["git", "update-server-info"], &www.join("repo.git"));
    // A wheel, and the simple index (PEP 503) that links to it.
    let wheel = www.join("files");
    std::fs::create_dir_all(&wheel).unwrap();
    let script = r#"
import base64, hashlib, sys, zipfile
files = {
    "spacedemo/__init__.py": b"ANSWER = 42\n",
    "spacedemo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: spacedemo\nVersion: 1.0\n",
    "spacedemo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: space-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for name, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{name},sha256={digest},{len(data)}\n"
record += "spacedemo-1.0.dist-info/RECORD,,\n"
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
    z.writestr("spacedemo-1.0.dist-info/RECORD", record)
"#;
    let path = wheel.join("spacedemo-1.0-py3-none-any.whl");
    run(&["python3", "-c", script, path.to_str().unwrap()], www);
    let index = www.join("simple/spacedemo");
    std::fs::create_dir_all(&index).unwrap();
    std::fs::write(
        index.join("index.html"),
        "<html><body><a href=\"/files/spacedemo-1.0-py3-none-any.whl\">spacedemo-1.0-py3-none-any.whl</a></body></html>",
    )
    .unwrap();
}

fn sh(server: &TestServer, id: &str, script: &str) -> (i64, String) {
    let ran = server.exec(id, json!({"argv": ["sh", "-c", script], "timeout_s": 300}));
    let out = format!("{}{}", ran["stdout"].as_str().unwrap_or(""), ran["stderr"].as_str().unwrap_or(""));
    (ran["result"]["exit_code"].as_i64().unwrap_or(-1), out)
}

fn events(server: &TestServer, id: &str) -> Vec<Value> {
    server.ok("GET", &format!("/v1/sandboxes/{id}/egress"), None)["events"].as_array().unwrap().clone()
}

/// Files under the data dir `root` (links not followed; not its templates
/// or apt cache, made before any secret existed) whose bytes hold any of
/// `needles`. GNU grep reads gigabytes of sandbox roots in seconds, where a
/// byte-window search in a debug build took minutes.
fn files_holding(root: &Path, needles: &[&str]) -> Vec<String> {
    let mut grep = std::process::Command::new("grep");
    grep.args(["-rlF", "--binary-files=text", "--devices=skip"]);
    for needle in needles {
        grep.arg("-e").arg(needle);
    }
    let entries = std::fs::read_dir(root).unwrap().flatten();
    grep.args(entries.filter(|e| e.file_name() != "templates" && e.file_name() != "cache").map(|e| e.path()));
    let out = space_testkit::output_within(&mut grep, space_testkit::PATIENCE * 2);
    // 0: found some, 1: found none; anything else is an error.
    let ok = matches!(out.status, space_process::ExitStatus::Exited(0 | 1));
    assert!(ok, "grep: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

/// Everything the server logs during the test, at every level.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

#[test]
fn secrets_reach_only_their_hosts_and_never_enter_the_sandbox() {
    let logs = Logs::default();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(logs.clone())
        .try_init()
        .expect("this test binary's only subscriber");
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, POLYGLOT_TEMPLATE]);
    let upstream = upstream(data.root());
    publish(&data.root().join("www"));
    let mut config = platform_config(&data);
    let hosts: Vec<String> = HOSTS.iter().map(|h| format!("{h}=127.0.0.1:{}", upstream.port)).collect();
    config.egress = space_server::egress::EgressSettings::parse(&hosts, &["127.0.0.1/32".into()]).unwrap();
    config.egress.trust = vec![upstream.ca_file.clone()];
    // The sandbox comes from the hot pool: it trusts the CA it was started
    // with, which must be the one its egress signs with.
    config.hot_pool = 1;
    let server = TestServer::start_with(config);
    wait_until("a hot member of each template", PATIENCE, || server.platform.warm().hot_count() == 2);

    // Values made of parts, so no command line of this test holds one whole.
    let unique = std::process::id();
    let (llm, git, pypi) =
        (format!("sk-llm-{unique}-value"), format!("ghp-git-{unique}-value"), format!("pypi-tok-{unique}-value"));
    upstream.wants.lock().unwrap().insert("git.space.test".into(), format!("x-access-token:{git}"));
    upstream.wants.lock().unwrap().insert("pypi.space.test".into(), format!("__token__:{pypi}"));

    // Secrets are written, listed without values, and checked.
    for (name, value, host) in
        [("llm", &llm, "api.space.test"), ("git", &git, "git.space.test"), ("pypi", &pypi, "pypi.space.test")]
    {
        let info = server.ok("PUT", &format!("/v1/secrets/{name}"), Some(json!({"value": value, "hosts": [host]})));
        server.check("PUT", &format!("/v1/secrets/{name}"), 200, "application/json", &info);
        assert_eq!(info["hosts"], json!([host]));
        assert!(!info.to_string().contains(value.as_str()));
    }
    let listed = server.ok("GET", "/v1/secrets", None);
    server.check("GET", "/v1/secrets", 200, "application/json", &listed);
    assert_eq!(listed["secrets"].as_array().unwrap().len(), 3);
    assert!(!listed.to_string().contains(&llm) && !listed.to_string().contains("value\""), "{listed}");
    let bad = json!({"value": "v", "hosts": ["10.0.0.1"]});
    server.error("PUT", "/v1/secrets/bad", Some(bad), 422, "invalid_value");
    server.error("PUT", "/v1/secrets/bad", Some(json!({"value": "", "hosts": ["a.space.test"]})), 422, "invalid_value");
    server.error(
        "PUT",
        "/v1/secrets/a%20b",
        Some(json!({"value": "v", "hosts": ["a.space.test"]})),
        422,
        "invalid_value",
    );
    // Bindings name existing secrets, within their hosts.
    let missing =
        json!({"template": "polyglot", "network": {"egress": "allowlist", "secrets": {"K": {"secret": "nope"}}}});
    server.error("POST", "/v1/sandboxes", Some(missing), 422, "invalid_value");
    let wider = json!({"template": "polyglot", "network": {"egress": "allowlist",
        "secrets": {"K": {"secret": "llm", "hosts": ["other.space.test"]}}}});
    server.error("POST", "/v1/sandboxes", Some(wider), 422, "invalid_value");

    let hits = server.platform.metrics().warm_hits.get();
    let id = server.create_sandbox(json!({"template": "polyglot", "network": {
        "egress": "allowlist",
        "allow": ["other.space.test"],
        "secrets": {
            "LLM_KEY": {"secret": "llm"},
            "GIT_TOKEN": {"secret": "git"},
            "PYPI_TOKEN": {"secret": "pypi"},
        }
    }}));
    assert_eq!(server.platform.metrics().warm_hits.get(), hits + 1, "served by the hot pool");
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    let placeholder = sandbox["network"]["secrets"]["LLM_KEY"]["placeholder"].as_str().unwrap().to_string();
    assert!(placeholder.starts_with("space_ph_"), "{sandbox}");

    // curl with the placeholder: the API gets the value, and what it echoes
    // comes back as the placeholder.
    let (code, out) =
        sh(&server, &id, "curl -sS --fail-with-body https://api.space.test/echo -H \"Authorization: Bearer $LLM_KEY\"");
    assert_eq!((code, out.trim()), (0, format!("you sent: Bearer {placeholder}").as_str()));
    assert!(upstream
        .seen
        .lock()
        .unwrap()
        .iter()
        .any(|(h, p, a)| h == "api.space.test" && p == "/echo" && *a == format!("Bearer {llm}")));

    // git clone over HTTPS, the token in Basic credentials.
    let (code, out) = sh(
        &server,
        &id,
        "git clone -q https://x-access-token:$GIT_TOKEN@git.space.test/repo.git /tmp/repo && cat /tmp/repo/README",
    );
    assert_eq!((code, out.trim()), (0, "cloned through the gateway"), "{out}");

    // pip install from a private index.
    let (code, out) = sh(
        &server,
        &id,
        "python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q --disable-pip-version-check \
         --index-url https://__token__:$PYPI_TOKEN@pypi.space.test/simple spacedemo \
         && /tmp/venv/bin/python -c 'import spacedemo; print(spacedemo.ANSWER)'",
    );
    assert_eq!((code, out.trim().lines().last().unwrap_or("")), (0, "42"), "{out}");

    // A placeholder to a host its secret is not bound to: refused, and
    // the upstream never hears of it.
    let (_, out) = sh(&server, &id, "curl -sS https://git.space.test/echo -H \"Authorization: Bearer $LLM_KEY\" -D -");
    assert!(out.contains("403") && out.contains("secret_not_for_host"), "{out}");
    let (_, out) = sh(&server, &id, "curl -sS http://other.space.test/echo -H \"X-Key: $LLM_KEY\" -D -");
    assert!(out.contains("403") && out.contains("secret_not_for_host"), "{out}");
    let seen = upstream.seen.lock().unwrap().clone();
    assert!(
        !seen.iter().any(|(h, _, a)| h != "api.space.test" && (a.contains(&placeholder) || a.contains(&llm))),
        "{seen:?}"
    );
    let log = events(&server, &id);
    let inspected: Vec<&Value> = log.iter().filter(|e| e["inspected"] == true && e["decision"] == "allowed").collect();
    assert!(inspected.iter().any(|e| e["host"] == "api.space.test" && e["secrets"] == json!(["llm"])), "{log:?}");
    assert!(inspected.iter().any(|e| e["host"] == "git.space.test" && e["secrets"] == json!(["git"])), "{log:?}");
    assert!(log.iter().any(|e| e["reason"] == "secret_not_for_host"), "{log:?}");

    // Inside: only placeholders, in the environment and in every process.
    let scan = format!(
        "import os\nneedles = [b'{}' + b'{}', b'{}' + b'{}', b'{}' + b'{}']\nhits = []\n\
         for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n    for f in ('environ', 'cmdline'):\n        try:\n            data = open(f'/proc/{{pid}}/{{f}}', 'rb').read()\n        except OSError:\n            continue\n        hits += [f'/proc/{{pid}}/{{f}}' for n in needles if n in data]\n\
         print('HITS', hits)\nprint('ENV', os.environ.get('LLM_KEY'))",
        &llm[..6], &llm[6..], &git[..6], &git[6..], &pypi[..6], &pypi[6..]
    );
    let ran = server.exec(&id, json!({"argv": ["python3", "-c", scan]}));
    let out = ran["stdout"].as_str().unwrap_or("");
    assert!(out.contains("HITS []") && out.contains(&format!("ENV {placeholder}")), "{ran}");

    // Nothing on the host's side of the sandbox holds a value either: its
    // root (every file in it), transcripts, the database (sealed values),
    // and, after a suspend, the snapshot of its memory.
    let (_, suspending) = server.call("POST", &format!("/v1/sandboxes/{id}/suspend"), None);
    assert_eq!(server.wait_operation(suspending["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let values = [llm.as_str(), git.as_str(), pypi.as_str()];
    // The scan finds what is there: a file planted with one value...
    let control = data.root().join("scan-control");
    std::fs::write(&control, format!("before {git} after")).unwrap();
    assert_eq!(files_holding(data.root(), &values), vec![control.display().to_string()]);
    std::fs::remove_file(&control).unwrap();
    // ...and nothing else holds any.
    let found = files_holding(data.root(), &values);
    assert!(found.is_empty(), "a secret value is in {found:?}");
    let (_, resuming) = server.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(server.wait_operation(resuming["operation"]["id"].as_str().unwrap())["state"], "succeeded");

    // After the resume, and after the value is rotated, the next request
    // carries the new value; a deleted secret is refused, not leaked.
    let rotated = format!("sk-llm-{unique}-rotated");
    server.ok("PUT", "/v1/secrets/llm", Some(json!({"value": rotated, "hosts": ["api.space.test"]})));
    let (code, out) =
        sh(&server, &id, "curl -sS --fail-with-body https://api.space.test/echo -H \"Authorization: Bearer $LLM_KEY\"");
    assert_eq!(code, 0, "{out}");
    assert!(upstream.seen.lock().unwrap().iter().any(|(_, _, a)| *a == format!("Bearer {rotated}")));
    let auth = format!("Bearer {}", server.key);
    let (status, _) = server.raw("DELETE", "/v1/secrets/llm", &[("Authorization", &auth)], None);
    assert_eq!(status, 204);
    let (_, out) = sh(&server, &id, "curl -sS https://api.space.test/echo -H \"Authorization: Bearer $LLM_KEY\" -D -");
    assert!(out.contains("secret_unavailable"), "{out}");
    server.error("DELETE", "/v1/secrets/llm", None, 404, "not_found");

    // The server logged at every level throughout, and never a value.
    let logged = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(logged.contains("space_server") || logged.contains("space_egress"), "the capture works");
    for value in [&llm, &git, &pypi, &rotated] {
        assert!(!logged.contains(value.as_str()), "a secret value is in the server's log");
    }
}

/// A binding added with `PUT .../network` reaches every command started
/// later, and one removed leaves them, also after a restart: the
/// sandbox's environment follows its network (before, new commands kept
/// the create's placeholders, so a new binding's never reached them).
#[test]
fn commands_started_after_a_network_change_get_its_placeholders() {
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, POLYGLOT_TEMPLATE]);
    let upstream = upstream(data.root());
    let mut config = platform_config(&data);
    let hosts: Vec<String> = HOSTS.iter().map(|h| format!("{h}=127.0.0.1:{}", upstream.port)).collect();
    config.egress = space_server::egress::EgressSettings::parse(&hosts, &["127.0.0.1/32".into()]).unwrap();
    config.egress.trust = vec![upstream.ca_file.clone()];
    let server = TestServer::start_with(config.clone());
    let value = format!("sk-later-{}-value", std::process::id());
    server.ok("PUT", "/v1/secrets/early", Some(json!({"value": "early-value", "hosts": ["other.space.test"]})));
    server.ok("PUT", "/v1/secrets/later", Some(json!({"value": value, "hosts": ["api.space.test"]})));
    let id = server.create_sandbox(json!({"template": "polyglot", "network": {"egress": "allowlist",
        "secrets": {"KEPT": {"secret": "early"}, "DROPPED": {"secret": "early"}}}}));
    let created = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    let kept = created["network"]["secrets"]["KEPT"]["placeholder"].as_str().unwrap().to_string();
    let env = |server: &TestServer| sh(server, &id, "echo \"$KEPT|${ADDED-unset}|${DROPPED-unset}\"").1;
    assert_eq!(
        env(&server).trim(),
        format!("{kept}|unset|{}", created["network"]["secrets"]["DROPPED"]["placeholder"].as_str().unwrap())
    );

    let put = server.ok(
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "allowlist", "secrets": {"KEPT": {"secret": "early"}, "ADDED": {"secret": "later"}}})),
    );
    assert_eq!(
        put["network"]["secrets"]["KEPT"]["placeholder"],
        kept.as_str(),
        "a variable bound before keeps its placeholder"
    );
    let added = put["network"]["secrets"]["ADDED"]["placeholder"].as_str().unwrap().to_string();
    assert!(added.starts_with("space_ph_") && added != kept, "{put}");
    // Placeholders are the server's to choose: one of the client's own is
    // refused, not silently replaced; the ones it was given may come back.
    let forged =
        json!({"egress": "allowlist", "secrets": {"KEPT": {"secret": "early", "placeholder": "space_ph_mine"}}});
    server.error("PUT", &format!("/v1/sandboxes/{id}/network"), Some(forged), 422, "invalid_value");
    let echoed = server.ok(
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "allowlist", "secrets": put["network"]["secrets"].clone()})),
    );
    assert_eq!(echoed["network"]["secrets"], put["network"]["secrets"]);
    let forged = json!({"template": "base", "network": {"egress": "allowlist", "secrets": {"X": {"secret": "early", "placeholder": "space_ph_x"}}}});
    server.error("POST", "/v1/sandboxes", Some(forged), 422, "invalid_value");
    // The first thing started after the change is a code context's
    // interpreter: it too gets the network's placeholders.
    let (status, context) =
        server.call("POST", &format!("/v1/sandboxes/{id}/contexts"), Some(json!({"language": "bash"})));
    assert_eq!(status, 201, "{context}");
    let auth = format!("Bearer {}", server.key);
    let (status, ran) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/contexts/{}/run", context["id"].as_str().unwrap()),
        &[("Authorization", &auth), ("Content-Type", "application/json")],
        Some(&json!({"code": "echo \"$KEPT|${ADDED-unset}|${DROPPED-unset}\""}).to_string()),
    );
    assert_eq!(status, 200, "{ran}");
    let printed: String = ran
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| event["type"] == "stdout")
        .map(|event| event["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(printed.trim(), format!("{kept}|{added}|unset"), "the context's environment: {ran}");
    assert_eq!(env(&server).trim(), format!("{kept}|{added}|unset"));
    // The new placeholder is injected like any other.
    let (code, out) =
        sh(&server, &id, "curl -sS --fail-with-body https://api.space.test/echo -H \"Authorization: Bearer $ADDED\"");
    assert_eq!((code, out.trim()), (0, format!("you sent: Bearer {added}").as_str()));
    assert!(upstream
        .seen
        .lock()
        .unwrap()
        .iter()
        .any(|(h, _, a)| h == "api.space.test" && *a == format!("Bearer {value}")));

    // A restarted server re-adopts the sandbox: still the network's placeholders.
    server.stop();
    let server = TestServer::start_with(config.clone());
    assert_eq!(env(&server).trim(), format!("{kept}|{added}|unset"));

    // Changed while suspended, then the server restarts: the resumed agent
    // kept its memory, and with it the old environment, until it is given
    // the new one.
    let lifecycle = |server: &TestServer, action: &str| {
        let (_, answer) = server.call("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
        assert_eq!(server.wait_operation(answer["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    };
    lifecycle(&server, "suspend");
    let network = json!({"egress": "allowlist", "secrets": {"KEPT": {"secret": "early"}}});
    server.ok("PUT", &format!("/v1/sandboxes/{id}/network"), Some(network));
    server.stop();
    let server = TestServer::start_with(config);
    lifecycle(&server, "resume");
    assert_eq!(env(&server).trim(), format!("{kept}|unset|unset"));
    server.delete_sandbox(&id);
}

/// Narrowing a secret's hosts (`PUT /v1/secrets/{name}`) holds for a
/// sandbox bound before it: the binding copied the hosts of the bind, and
/// the gateway reads the secret's hosts as they are at each request. A
/// host taken off is refused as one never bound, and the (rotated) value
/// never reaches it; a host still listed keeps getting it. Widening the
/// secret again widens no binding past its own hosts.
#[test]
fn narrowing_a_secrets_hosts_holds_for_sandboxes_bound_before() {
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, POLYGLOT_TEMPLATE]);
    let upstream = upstream(data.root());
    let mut config = platform_config(&data);
    let hosts: Vec<String> = HOSTS.iter().map(|h| format!("{h}=127.0.0.1:{}", upstream.port)).collect();
    config.egress = space_server::egress::EgressSettings::parse(&hosts, &["127.0.0.1/32".into()]).unwrap();
    config.egress.trust = vec![upstream.ca_file.clone()];
    let server = TestServer::start_with(config);
    let unique = std::process::id();
    let (first, rotated) = (format!("sk-wide-{unique}-value"), format!("sk-narrow-{unique}-value"));
    let both = json!(["api.space.test", "git.space.test"]);
    server.ok("PUT", "/v1/secrets/wide", Some(json!({"value": first, "hosts": both})));
    let id = server.create_sandbox(json!({"template": "polyglot", "network": {"egress": "allowlist",
        "allow": ["other.space.test"], "secrets": {"KEY": {"secret": "wide"}}}}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["network"]["secrets"]["KEY"]["hosts"], both, "the binding copied the secret's hosts");
    let placeholder = sandbox["network"]["secrets"]["KEY"]["placeholder"].as_str().unwrap().to_string();
    let echo = |host: &str| {
        sh(&server, &id, &format!("curl -sS -k https://{host}/echo -H \"Authorization: Bearer $KEY\" -D -")).1
    };
    let sent = |host: &str, auth: &str| {
        upstream.seen.lock().unwrap().iter().filter(|(h, p, a)| h == host && p == "/echo" && a == auth).count()
    };
    for host in ["api.space.test", "git.space.test"] {
        let out = echo(host);
        assert!(out.contains("200") && out.contains(&placeholder), "{host}: {out}");
        assert_eq!(sent(host, &format!("Bearer {first}")), 1, "{host}");
    }

    // Narrowed (and rotated): git.space.test is refused like a host the
    // secret was never bound to; api.space.test gets the new value.
    server.ok("PUT", "/v1/secrets/wide", Some(json!({"value": rotated, "hosts": ["api.space.test"]})));
    let before = upstream.seen.lock().unwrap().len();
    let out = echo("git.space.test");
    assert!(out.contains("403") && out.contains("secret_not_for_host"), "{out}");
    assert_eq!(upstream.seen.lock().unwrap().len(), before, "the refused request never reached the host");
    let out = echo("api.space.test");
    assert!(out.contains("200") && out.contains(&placeholder), "{out}");
    assert_eq!(sent("api.space.test", &format!("Bearer {rotated}")), 1);
    wait_until("the refusal's event", PATIENCE, || {
        events(&server, &id).iter().any(|e| e["host"] == "git.space.test" && e["reason"] == "secret_not_for_host")
    });

    // Widened past the binding: the binding's hosts still bound it. A host
    // it never covered gets a tunnel the gateway does not open, so only
    // the placeholder goes there (the sandbox skips the certificate check
    // to see what arrived).
    let wider = json!({"value": rotated, "hosts": ["api.space.test", "git.space.test", "other.space.test"]});
    server.ok("PUT", "/v1/secrets/wide", Some(wider));
    echo("other.space.test");
    assert_eq!(sent("other.space.test", &format!("Bearer {placeholder}")), 1, "{:?}", upstream.seen.lock().unwrap());
    let seen = upstream.seen.lock().unwrap().clone();
    assert!(!seen.iter().any(|(h, _, a)| h == "other.space.test" && a.contains(&rotated)), "{seen:?}");
    assert!(!seen.iter().any(|(h, _, a)| h == "git.space.test" && a.contains(&rotated)), "{seen:?}");
    server.delete_sandbox(&id);
}
