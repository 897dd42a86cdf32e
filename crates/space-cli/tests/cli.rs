//! The `space` binary as a user runs it: a dev server, then the CLI.
//! Children are spawned through the reaper: the fixtures use it, and it
//! reaps every child of this process.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

use space_process::{ExitStatus, Output, ReapedChild, Reaper};
use space_testkit::{agent_bin, output_within, within, TestDataDir, PATIENCE};

mod common;
#[path = "cli/volumes.rs"]
mod volumes;

use common::{stop, SPACE};

/// Starts `space serve --dev` on an ephemeral port; returns it and its URL.
fn serve(data: &TestDataDir) -> (ReapedChild, String) {
    let (child, url, seen) = serve_with(data, &["--dev", "--listen", "127.0.0.1:0"]);
    assert!(seen.iter().any(|l| l.contains("development mode")), "dev mode says so loudly: {seen:?}");
    (child, url)
}

/// Starts `space serve ARGS`; returns it, its URL and what it said first.
fn serve_with(data: &TestDataDir, args: &[&str]) -> (ReapedChild, String, Vec<String>) {
    let (child, url, seen, lines) = common::spawn_server(data, args);
    std::thread::spawn(move || lines.for_each(drop)); // keep the pipe drained
    (child, url, seen)
}

fn space(data: &TestDataDir, url: &str, args: &[&str]) -> Output {
    let mut command = Command::new(SPACE);
    command.args(args).env("SPACE_URL", url).env("SPACE_DATA_DIR", data.root()).env_remove("SPACE_API_KEY");
    output_within(&mut command, CLI_PATIENCE)
}

/// How long one `space` command may take: a create or a fork waits for
/// its operation, which may take a while on a loaded host.
const CLI_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

#[test]
fn dev_server_and_cli_run_a_sandbox() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let key_path = space_host::datadir::dev_key_path(data.root());
    let key = std::fs::read_to_string(&key_path).unwrap();
    assert_eq!(std::fs::metadata(&key_path).unwrap().permissions().mode() & 0o777, 0o600);

    let created = space(&data, &url, &["sandbox", "create", "--quiet", "--env", "WHO=cli"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let id = String::from_utf8(created.stdout).unwrap().trim().to_string();
    assert!(id.starts_with("sbx_"), "{id}");

    let exec = space(&data, &url, &["exec", &id, "--", "sh", "-c", "echo hi $WHO; echo oops >&2; exit 3"]);
    assert_eq!(exec.status, ExitStatus::Exited(3), "the command's exit code is the CLI's");
    assert_eq!(String::from_utf8_lossy(&exec.stdout), "hi cli\n");
    assert_eq!(String::from_utf8_lossy(&exec.stderr), "oops\n");
    let missing = space(&data, &url, &["exec", &id, "--", "no-such-binary"]);
    assert_eq!(missing.status, ExitStatus::Exited(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("executable_not_found"));

    let local = data.root().join("cp-in.txt");
    std::fs::write(&local, "copied in\n").unwrap();
    let into = space(&data, &url, &["cp", local.to_str().unwrap(), &format!("{id}:/root/sub/cp.txt")]);
    assert!(into.status.success(), "{}", String::from_utf8_lossy(&into.stderr));
    let back = data.root().join("cp-out.txt");
    let out = space(&data, &url, &["cp", &format!("{id}:/root/sub/cp.txt"), back.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "copied in\n");
    let missing = space(&data, &url, &["cp", &format!("{id}:/nope"), back.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("file_not_found"));
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "copied in\n", "a failed copy leaves the local file alone");

    // Directories travel both ways.
    let tree = data.root().join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("sub/deep.txt"), "deep\n").unwrap();
    let up = space(&data, &url, &["cp", tree.to_str().unwrap(), &format!("{id}:/root/tree")]);
    assert!(up.status.success(), "{}", String::from_utf8_lossy(&up.stderr));
    let down = data.root().join("tree-back");
    let fetched = space(&data, &url, &["cp", &format!("{id}:/root/tree"), down.to_str().unwrap()]);
    assert!(fetched.status.success(), "{}", String::from_utf8_lossy(&fetched.stderr));
    assert_eq!(std::fs::read_to_string(down.join("sub/deep.txt")).unwrap(), "deep\n");

    // Interactive: our stdin reaches the command, its end closes the command's.
    let mut command = Command::new(SPACE);
    command
        .args(["exec", "-i", &id, "--", "sh", "-c", "read first; echo \"got $first\"; cat; exit 4"])
        .env("SPACE_URL", &url)
        .env("SPACE_DATA_DIR", data.root())
        .env_remove("SPACE_API_KEY")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Reaper::global().spawn(&mut command).unwrap();
    std::io::Write::write_all(child.child.stdin.as_mut().unwrap(), b"hello\nrest of input\n").unwrap();
    drop(child.child.stdin.take());
    let mut pipe = child.child.stdout.take().unwrap();
    let stdout = within("the output of exec -i", CLI_PATIENCE, move || {
        let mut stdout = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut stdout).unwrap();
        stdout
    });
    let status = child.wait_timeout(std::time::Duration::from_secs(30)).expect("exec -i ends when the command does");
    assert_eq!(status, ExitStatus::Exited(4));
    assert_eq!(stdout, "got hello\nrest of input\n");
    let tty = space(&data, &url, &["exec", "-t", &id, "--", "tty"]);
    assert_eq!(tty.status, ExitStatus::Exited(0));
    assert!(String::from_utf8_lossy(&tty.stdout).starts_with("/dev/pts/"), "{}", String::from_utf8_lossy(&tty.stdout));

    // Events: what happened to this sandbox, as JSON and for a person, and
    // a follower that sees the next change as it happens.
    let events = space(&data, &url, &["events", "--from", "0", "--sandbox", &id, "--json"]);
    assert!(events.status.success(), "{}", String::from_utf8_lossy(&events.stderr));
    let events: Vec<serde_json::Value> =
        String::from_utf8(events.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(events.iter().all(|e| e["sandbox_id"] == id.as_str()), "{events:#?}");
    assert!(events.iter().any(|e| e["type"] == "sandbox.state" && e["sandbox"]["state"] == "running"));
    assert!(events.iter().any(|e| e["type"] == "command.exited" && e["command"]["result"]["exit_code"] == 3));
    let exits = space(&data, &url, &["events", "--from", "0", "--sandbox", &id, "--types", "command.exited"]);
    let exits = String::from_utf8(exits.stdout).unwrap();
    assert!(exits.lines().all(|l| l.contains(" command.exited ")) && exits.contains(" exit 3 after "), "{exits}");
    // From the next id on: nothing is missed however late the follower connects.
    let next = (events.iter().map(|e| e["id"].as_u64().unwrap()).max().unwrap() + 1).to_string();
    let mut follow = Command::new(SPACE);
    follow
        .args(["events", "--follow", "--from", &next, "--types", "sandbox", "--sandbox", &id])
        .env("SPACE_URL", &url)
        .env("SPACE_DATA_DIR", data.root())
        .env_remove("SPACE_API_KEY")
        .stdout(Stdio::piped());
    let mut follower = Reaper::global().spawn(&mut follow).unwrap();
    let lines = std::io::BufRead::lines(std::io::BufReader::new(follower.child.stdout.take().unwrap()));
    let (seen_tx, seen) = std::sync::mpsc::channel();
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(|l| drop(seen_tx.send(l))));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut states = Vec::new();
    for action in ["pause", "resume"] {
        assert!(space(&data, &url, &["sandbox", action, &id]).status.success());
        let want = if action == "pause" { " paused" } else { " running" };
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = seen.recv_timeout(left).unwrap_or_else(|_| panic!("no{want} event followed: {states:?}"));
            states.push(line.clone());
            if line.ends_with(want) {
                break;
            }
        }
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(follower.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let _ = follower.wait_timeout(std::time::Duration::from_secs(10));

    // Egress from the command line: a policy at create and changed live,
    // and the log of what the sandbox tried.
    let net = space(
        &data,
        &url,
        &["sandbox", "create", "-q", "--allow-host", "pkgs.space.test:443", "--deny-host", "x.space.test"],
    );
    assert!(net.status.success(), "{}", String::from_utf8_lossy(&net.stderr));
    let net = String::from_utf8(net.stdout).unwrap().trim().to_string();
    let shown = String::from_utf8(space(&data, &url, &["sandbox", "get", &net]).stdout).unwrap();
    assert!(shown.contains("\"allowlist\"") && shown.contains("pkgs.space.test:443"), "{shown}");
    let tried = space(&data, &url, &["exec", &net, "--", "python3", "-c", "import urllib.request\ntry:\n    urllib.request.urlopen('http://other.space.test/')\nexcept Exception as e:\n    print(e)"]);
    assert!(String::from_utf8_lossy(&tried.stdout).contains("403"), "{}", String::from_utf8_lossy(&tried.stdout));
    let log = String::from_utf8(space(&data, &url, &["sandbox", "egress", &net]).stdout).unwrap();
    assert!(log.contains("denied") && log.contains("other.space.test:80 not_allowed"), "{log}");
    let changed = space(&data, &url, &["sandbox", "network", &net, "--egress", "none"]);
    assert!(
        String::from_utf8_lossy(&changed.stdout).contains("\"none\""),
        "{}",
        String::from_utf8_lossy(&changed.stderr)
    );
    let bad = space(&data, &url, &["sandbox", "network", &net, "--allow-host", "bad..name"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("bad..name"));
    assert!(space(&data, &url, &["sandbox", "rm", &net]).status.success());

    // Secrets: the value comes from stdin, is never shown, and a sandbox
    // bound to it holds only a placeholder.
    let value_file = data.root().join("value");
    std::fs::write(&value_file, "cli-secret-value\n").unwrap();
    let mut set = Command::new("sh");
    let line = format!("{SPACE} secret set cli-token --host api.space.test < {}", value_file.display());
    set.args(["-c", &line]).env("SPACE_URL", &url).env("SPACE_DATA_DIR", data.root()).env_remove("SPACE_API_KEY");
    let set = output_within(&mut set, CLI_PATIENCE);
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    assert!(!String::from_utf8_lossy(&set.stdout).contains("cli-secret-value"));
    let listed = String::from_utf8(space(&data, &url, &["secret", "ls"]).stdout).unwrap();
    assert!(listed.contains("cli-token") && listed.contains("api.space.test") && !listed.contains("value"), "{listed}");
    let bound = space(&data, &url, &["sandbox", "create", "-q", "--secret", "API_TOKEN=cli-token"]);
    assert!(bound.status.success(), "{}", String::from_utf8_lossy(&bound.stderr));
    let bound = String::from_utf8(bound.stdout).unwrap().trim().to_string();
    let env = space(&data, &url, &["exec", &bound, "--", "sh", "-c", "echo $API_TOKEN"]);
    let env = String::from_utf8_lossy(&env.stdout).to_string();
    assert!(env.starts_with("space_ph_") && !env.contains("cli-secret-value"), "{env}");
    assert!(space(&data, &url, &["sandbox", "rm", &bound]).status.success());
    assert!(space(&data, &url, &["secret", "rm", "cli-token"]).status.success());
    let gone = space(&data, &url, &["secret", "rm", "cli-token"]);
    assert!(!gone.status.success() && String::from_utf8_lossy(&gone.stderr).contains("not_found"), "{gone:?}");

    // A server in the sandbox, reached on a local port.
    let started = space(
        &data,
        &url,
        &["exec", &id, "--", "sh", "-c", "python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &"],
    );
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    let mut forward = Command::new(SPACE);
    forward
        .args(["port-forward", &id, "0:8000"])
        .env("SPACE_URL", &url)
        .env("SPACE_DATA_DIR", data.root())
        .env_remove("SPACE_API_KEY")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut forward = Reaper::global().spawn(&mut forward).unwrap();
    let said = forward.child.stdout.take().unwrap();
    let first = within("port-forward to say its local address", PATIENCE, move || {
        let mut first = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(said), &mut first).unwrap();
        first
    });
    let local: std::net::SocketAddr = first.trim().parse().expect("the local address");
    let mut page = String::new();
    // By hand: what answers here is the sandbox's own server through the forward, not the API.
    space_testkit::wait_until("the server through the forwarded port", space_testkit::PATIENCE, || {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect(local) else { return false };
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let _ = stream.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n");
        page.clear();
        let _ = stream.read_to_string(&mut page);
        page.starts_with("HTTP/1.0 200")
    });
    assert!(page.contains("Directory listing"), "{page}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(forward.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    forward.wait_timeout(std::time::Duration::from_secs(20)).expect("port-forward stops on SIGTERM");

    let listed = space(&data, &url, &["sandbox", "ls"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&id));
    let removed = space(&data, &url, &["sandbox", "rm", &id]);
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
    let gone = space(&data, &url, &["sandbox", "get", &id]);
    assert!(String::from_utf8_lossy(&gone.stdout).contains("\"deleted\""));
    stop(server);

    let (server, _) = serve(&data);
    assert_eq!(std::fs::read_to_string(&key_path).unwrap(), key, "the dev key is reused on restart");
    stop(server);
}

#[test]
fn an_image_archive_imports_from_the_cli_and_a_bad_one_shows_its_log() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let archive = common::busybox_image(data.root());

    let imported = space(&data, &url, &["template", "import-oci", archive.to_str().unwrap(), "--name", "cliimage"]);
    assert!(imported.status.success(), "{}", String::from_utf8_lossy(&imported.stderr));
    let template: serde_json::Value = serde_json::from_slice(&imported.stdout).unwrap();
    assert_eq!((template["state"].as_str(), template["defaults"]["workdir"].as_str()), (Some("ready"), Some("/srv")));
    let listed = space(&data, &url, &["template", "ls"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains("cliimage"));

    let created = space(&data, &url, &["sandbox", "create", "--quiet", "--template", "cliimage"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let id = String::from_utf8(created.stdout).unwrap().trim().to_string();
    let exec = space(&data, &url, &["exec", &id, "--", "sh", "-c", "pwd; cat hello.txt"]);
    assert_eq!(String::from_utf8_lossy(&exec.stdout), "/srv\nfrom the image\n");
    assert!(space(&data, &url, &["sandbox", "rm", &id]).status.success());

    let garbage = data.root().join("garbage.tar");
    std::fs::write(&garbage, vec![7u8; 4096]).unwrap();
    let failed = space(&data, &url, &["template", "import-oci", garbage.to_str().unwrap(), "--name", "broken"]);
    assert_eq!(failed.status, ExitStatus::Exited(1));
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(stderr.contains("import failed: the upload is not a tar archive"), "the log is shown: {stderr}");
    stop(server);
}

#[test]
fn dev_mode_refuses_a_public_address() {
    let data = TestDataDir::new();
    let mut command = Command::new(SPACE);
    command
        .args(["serve", "--dev", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(data.root())
        .arg("--agent-bin")
        .arg(agent_bin());
    let out = output_within(&mut command, PATIENCE);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
}

#[test]
fn sigkill_of_the_server_loses_nothing() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let created = space(&data, &url, &["sandbox", "create", "--quiet"]);
    let id = String::from_utf8(created.stdout).unwrap().trim().to_string();
    let suspended_id =
        String::from_utf8(space(&data, &url, &["sandbox", "create", "--quiet"]).stdout).unwrap().trim().to_string();
    for sandbox in [&id, &suspended_id] {
        let started = space(
            &data,
            &url,
            &["exec", sandbox, "--", "sh", "-c", "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /root/bg.pid"],
        );
        assert_eq!(started.status, ExitStatus::Exited(0), "{}", String::from_utf8_lossy(&started.stderr));
    }
    let suspended = space(&data, &url, &["sandbox", "suspend", &suspended_id]);
    assert!(suspended.status.success(), "{}", String::from_utf8_lossy(&suspended.stderr));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    assert!(server.wait_timeout(std::time::Duration::from_secs(10)).is_some());

    let (server, url) = serve(&data);
    let alive = space(&data, &url, &["exec", &id, "--", "sh", "-c", "kill -0 $(cat /root/bg.pid) && echo alive"]);
    assert_eq!(String::from_utf8_lossy(&alive.stdout), "alive\n", "{}", String::from_utf8_lossy(&alive.stderr));
    let resumed = space(&data, &url, &["sandbox", "resume", &suspended_id]);
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    let alive =
        space(&data, &url, &["exec", &suspended_id, "--", "sh", "-c", "kill -0 $(cat /root/bg.pid) && echo alive"]);
    assert_eq!(String::from_utf8_lossy(&alive.stdout), "alive\n", "{}", String::from_utf8_lossy(&alive.stderr));
    for sandbox in [&id, &suspended_id] {
        assert!(space(&data, &url, &["sandbox", "rm", sandbox]).status.success());
    }
    stop(server);
}

/// `space mcp` against `url`: the process, its stdin, its lines out.
fn mcp(data: &TestDataDir, url: &str) -> (ReapedChild, std::process::ChildStdin, McpAnswers) {
    let mut command = Command::new(SPACE);
    command
        .arg("mcp")
        .env("SPACE_URL", url)
        .env("SPACE_DATA_DIR", data.root())
        .env("SPACE_API_KEY", std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = Reaper::global().spawn(&mut command).unwrap();
    let stdin = child.child.stdin.take().unwrap();
    let lines = BufReader::new(child.child.stdout.take().unwrap()).lines();
    let (tx, answers) = std::sync::mpsc::channel();
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(|line| drop(tx.send(line))));
    (child, stdin, McpAnswers(answers))
}

/// The `initialize` parameters of a test's MCP session.
fn mcp_initialize() -> serde_json::Value {
    serde_json::json!({"protocolVersion": "2024-11-05", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}})
}

/// Sends one JSON-RPC request to `space mcp` and reads its answer.
fn mcp_ask(
    stdin: &mut std::process::ChildStdin,
    lines: &mut McpAnswers,
    id: u64,
    method: &str,
    params: serde_json::Value,
) -> serde_json::Value {
    use std::io::Write;
    let request = serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    writeln!(stdin, "{request}").unwrap();
    stdin.flush().unwrap();
    let answer = lines.next();
    assert_eq!(answer["id"], id, "{answer}");
    answer
}

/// The lines `space mcp` writes, each waited for with a deadline.
struct McpAnswers(std::sync::mpsc::Receiver<String>);

impl McpAnswers {
    fn next(&mut self) -> serde_json::Value {
        let line = self.0.recv_timeout(CLI_PATIENCE).expect("an answer from space mcp in time");
        serde_json::from_str(&line).unwrap()
    }
}

/// The text a successful `space` call printed.
fn printed(out: Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn forks_checkpoints_and_snapshot_templates_from_the_cli_and_a_fork_a_sigkill_cut_short() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let id = printed(space(&data, &url, &["sandbox", "create", "--quiet"])).trim().to_string();
    printed(space(&data, &url, &["exec", &id, "--", "sh", "-c", "echo one > /root/n"]));
    let forks = printed(space(&data, &url, &["sandbox", "fork", &id, "-n", "2", "--label", "kind=fork"]));
    let forks: Vec<&str> = forks.lines().collect();
    assert_eq!(forks.len(), 2, "{forks:?}");
    for fork in &forks {
        assert_eq!(printed(space(&data, &url, &["exec", fork, "--", "cat", "/root/n"])), "one\n");
        assert!(printed(space(&data, &url, &["sandbox", "get", fork])).contains(&format!("\"forked_from\": \"{id}\"")));
    }
    printed(space(&data, &url, &["sandbox", "checkpoint", &id, "first"]));
    assert!(printed(space(&data, &url, &["sandbox", "checkpoints", &id])).contains("first"));
    printed(space(&data, &url, &["exec", &id, "--", "sh", "-c", "echo two > /root/n"]));
    printed(space(&data, &url, &["sandbox", "restore", &id, "first"]));
    assert_eq!(printed(space(&data, &url, &["exec", &id, "--", "cat", "/root/n"])), "one\n");
    printed(space(&data, &url, &["template", "from-sandbox", "snap", &id, "--checkpoint", "first"]));
    let child = printed(space(&data, &url, &["sandbox", "create", "--template", "snap", "--quiet"])).trim().to_string();
    assert_eq!(printed(space(&data, &url, &["exec", &child, "--", "cat", "/root/n"])), "one\n");
    printed(space(&data, &url, &["sandbox", "rm-checkpoint", &id, "first"]));
    let refused = space(&data, &url, &["sandbox", "restore", &id, "first"]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("checkpoint_not_found"));

    // A fork accepted (202) and then the server SIGKILLed: the restarted
    // server makes it, whatever it had done.
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let client = space_client::Client::with_deadline(&url, &key, PATIENCE * 2);
    let accepted = client.post(&format!("/v1/sandboxes/{id}/fork"), &serde_json::json!({"count": 3})).unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    assert!(server.wait_timeout(std::time::Duration::from_secs(10)).is_some());
    let (server, url) = serve(&data);
    let operation = accepted["operation"]["id"].as_str().unwrap();
    let waited = printed(space(&data, &url, &["op", "wait", operation]));
    assert!(waited.contains("\"succeeded\""), "{waited}");
    for fork in accepted["sandboxes"].as_array().unwrap() {
        let fork = fork["id"].as_str().unwrap();
        assert_eq!(printed(space(&data, &url, &["exec", fork, "--", "cat", "/root/n"])), "one\n");
        printed(space(&data, &url, &["sandbox", "rm", fork]));
    }
    for sandbox in forks.iter().copied().chain([child.as_str(), id.as_str()]) {
        printed(space(&data, &url, &["sandbox", "rm", sandbox]));
    }
    printed(space(&data, &url, &["template", "rm", "snap"]));
    stop(server);
}

#[test]
fn code_contexts_from_the_cli_and_mcp() {
    use space_host::template::{BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE};
    use std::io::Write;
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE]);
    let (server, url) = serve(&data);
    let id = printed(space(
        &data,
        &url,
        &["sandbox", "create", "--template", "code-interpreter", "--memory-mib", "1024", "--quiet"],
    ));
    let id = id.trim();
    assert_eq!(printed(space(&data, &url, &["run", id, "--python", "-c", "print('out')\n6 * 7"])), "out\n42\n");
    let failed = space(&data, &url, &["run", id, "--python", "-c", "1 / 0"]);
    assert_eq!(failed.status, ExitStatus::Exited(1));
    assert!(
        String::from_utf8_lossy(&failed.stderr).contains("ZeroDivisionError"),
        "{}",
        String::from_utf8_lossy(&failed.stderr)
    );

    // The MCP tool keeps one context per sandbox: state carries over.
    let (child, mut stdin, mut lines) = mcp(&data, &url);
    let mut call = |n: u64, code: &str| -> serde_json::Value {
        let request = serde_json::json!({"jsonrpc": "2.0", "id": n, "method": "tools/call",
            "params": {"name": "run_code", "arguments": {"sandbox_id": id, "code": code}}});
        writeln!(stdin, "{request}").unwrap();
        stdin.flush().unwrap();
        let answer = lines.next();
        answer["result"].clone()
    };
    assert_eq!(call(1, "z = 5")["isError"], false);
    let doubled = call(2, "z * 2");
    assert_eq!(doubled["content"][0]["text"], "10\n", "{doubled}");
    let chart = call(3, "import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()");
    assert_eq!(chart["content"][1]["mimeType"], "image/png", "{chart}");
    let raised = call(4, "undefined_name");
    assert_eq!(raised["isError"], true);
    assert!(raised["content"][0]["text"].as_str().unwrap().contains("NameError"), "{raised}");
    drop(stdin);
    assert!(child.wait_timeout(std::time::Duration::from_secs(10)).is_some());
    printed(space(&data, &url, &["sandbox", "rm", id]));
    stop(server);
}

fn run(program: &str, args: &[&str]) -> Output {
    output_within(Command::new(program).args(args), PATIENCE)
}

#[test]
fn tenant_keys_are_made_listed_and_revoked_and_a_public_address_needs_tls() {
    let data = TestDataDir::new();
    let made = space(&data, "", &["keys", "create", "--tenant", "team-x", "--max-sandboxes", "2"]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let key = String::from_utf8(made.stdout).unwrap().trim().to_string();
    assert!(key.starts_with("space_") && String::from_utf8_lossy(&made.stderr).contains("shown once"));
    let listed = String::from_utf8(space(&data, "", &["keys", "ls"]).stdout).unwrap();
    assert!(listed.contains("team-x") && !listed.contains(&key), "{listed}");
    let id = listed.lines().find(|l| l.contains("team-x")).unwrap().split_whitespace().next().unwrap().to_string();
    let bad = space(&data, "", &["keys", "create", "--tenant", "Not A Name"]);
    assert_eq!(bad.status, ExitStatus::Exited(1));

    // The tenant's key works against a running server, until it is revoked.
    let operator_key = data.root().join("operator-key");
    std::fs::write(&operator_key, "an-operator-key-of-some-length").unwrap();
    let dir = data.root().to_str().unwrap().to_string();
    let (cert, pem_key) = (format!("{dir}/cert.pem"), format!("{dir}/key.pem"));
    let made = run(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            &pem_key,
            "-out",
            &cert,
        ],
    );
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let key_file = operator_key.to_str().unwrap();
    let (server, url, _) = serve_with(
        &data,
        &["--listen", "127.0.0.1:0", "--api-key-file", key_file, "--tls-cert", &cert, "--tls-key", &pem_key],
    );
    assert!(url.starts_with("https://"), "{url}");
    // curl, not the API's client: that speaks plain HTTP only, and this checks the TLS listener under the test's CA.
    let curl = |extra: &[&str], target: &str| {
        let auth = format!("Authorization: Bearer {key}");
        let mut args = vec!["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", &auth];
        args.extend_from_slice(extra);
        args.push(target);
        String::from_utf8(run("curl", &args).stdout).unwrap()
    };
    let sandboxes = format!("{url}/v1/sandboxes");
    assert_eq!(curl(&["--cacert", &cert], &sandboxes), "200", "the tenant's key over TLS");
    assert_ne!(curl(&[], &sandboxes.replace("https://", "http://")), "200", "no plain HTTP on the TLS port");
    assert!(space(&data, "", &["keys", "revoke", &id]).status.success());
    assert_eq!(curl(&["--cacert", &cert], &sandboxes), "401", "a revoked key is refused at once");
    stop(server);

    // Plain HTTP on a public address must be asked for by name.
    let mut command = Command::new(SPACE);
    command.args(["serve", "--listen", "0.0.0.0:0", "--api-key-file", key_file, "--data-dir", &dir]);
    let refused = output_within(&mut command, PATIENCE);
    assert_eq!(refused.status, ExitStatus::Exited(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--insecure-http"));
}

#[test]
fn doctor_tells_which_engine_runs_here_and_why_not() {
    let data = TestDataDir::new();
    let mut command = Command::new(SPACE);
    command
        .args(["doctor", "--data-dir"])
        .arg(data.root())
        .arg("--agent-bin")
        .arg(agent_bin())
        .env_remove("FIRECRACKER_BIN");
    let out = output_within(&mut command, PATIENCE);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status, ExitStatus::Exited(0), "{text}");
    assert!(text.lines().any(|l| l.starts_with("gvisor") && l.contains(" yes ")), "{text}");
    let firecracker = text.lines().find(|l| l.starts_with("firecracker")).expect("a firecracker line");
    assert!(firecracker.contains(" no "), "no firecracker binary is given: {text}");
    if !space_host::hardware_virtualization() {
        assert!(firecracker.contains("vmx/svm"), "the missing hardware virtualization is named: {firecracker}");
        assert!(text.contains("engine    gvisor"), "{text}");
    }
}

#[test]
fn mcp_lists_its_tools_and_runs_echo_in_a_new_sandbox() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let (child, mut stdin, mut lines) = mcp(&data, &url);
    let mut ask =
        |id: u64, method: &str, params: serde_json::Value| mcp_ask(&mut stdin, &mut lines, id, method, params);
    let init = ask(1, "initialize", mcp_initialize());
    assert_eq!(init["result"]["serverInfo"]["name"], "space");
    let tools = ask(2, "tools/list", serde_json::json!({}));
    let names: Vec<&str> =
        tools["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    for expected in [
        "create_sandbox",
        "run_command",
        "write_file",
        "read_file",
        "list_sandboxes",
        "http_to_port",
        "pause_sandbox",
        "resume_sandbox",
        "suspend_sandbox",
        "delete_sandbox",
        "fork_sandbox",
        "checkpoint_sandbox",
        "restore_checkpoint",
    ] {
        assert!(names.contains(&expected), "{expected} in {names:?}");
    }
    assert!(tools["result"]["tools"].as_array().unwrap().iter().all(|t| t["inputSchema"]["type"] == "object"));

    let created = ask(
        3,
        "tools/call",
        serde_json::json!({"name": "create_sandbox", "arguments": {"allow_hosts": ["pkgs.space.test"]}}),
    );
    assert_eq!(created["result"]["isError"], false, "{created}");
    let sandbox: serde_json::Value =
        serde_json::from_str(created["result"]["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(sandbox["network"]["allow"][0], "pkgs.space.test", "{sandbox}");
    let id = sandbox["id"].as_str().unwrap().to_string();
    let ran = ask(
        4,
        "tools/call",
        serde_json::json!({"name": "run_command", "arguments": {"sandbox_id": id, "command": "echo hello from mcp; exit 3"}}),
    );
    let result: serde_json::Value =
        serde_json::from_str(ran["result"]["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(
        (result["stdout"].as_str(), result["exit_code"].as_i64()),
        (Some("hello from mcp\n"), Some(3)),
        "{result}"
    );
    let wrote = ask(
        5,
        "tools/call",
        serde_json::json!({"name": "write_file", "arguments": {"sandbox_id": id, "path": "/root/mcp/note.txt", "content": "noted"}}),
    );
    assert_eq!(wrote["result"]["isError"], false, "{wrote}");
    let read = ask(
        6,
        "tools/call",
        serde_json::json!({"name": "read_file", "arguments": {"sandbox_id": id, "path": "/root/mcp/note.txt"}}),
    );
    assert_eq!(read["result"]["content"][0]["text"], "noted");
    // A server the agent started in the sandbox, asked over HTTP.
    let served = ask(
        20,
        "tools/call",
        serde_json::json!({"name": "run_command", "arguments": {"sandbox_id": id,
            "command": "cd /root/mcp && python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &"}}),
    );
    assert_eq!(served["result"]["isError"], false, "{served}");
    let mut page = serde_json::Value::Null;
    space_testkit::wait_until("the server in the sandbox", space_testkit::PATIENCE, || {
        page = ask(
            21,
            "tools/call",
            serde_json::json!({"name": "http_to_port", "arguments": {"sandbox_id": id, "port": 8000, "path": "/note.txt"}}),
        );
        page["result"]["content"][0]["text"] == "HTTP 200\nnoted"
    });
    // A checkpoint to roll back to, and forks to try things in.
    let call = |ask: &mut dyn FnMut(u64, &str, serde_json::Value) -> serde_json::Value, n: u64, tool: &str, args| {
        let answer = ask(n, "tools/call", serde_json::json!({"name": tool, "arguments": args}));
        assert_eq!(answer["result"]["isError"], false, "{answer}");
        answer["result"]["content"][0]["text"].as_str().unwrap().to_string()
    };
    call(&mut ask, 30, "checkpoint_sandbox", serde_json::json!({"sandbox_id": id, "name": "noted"}));
    call(&mut ask, 31, "run_command", serde_json::json!({"sandbox_id": id, "command": "rm /root/mcp/note.txt"}));
    call(&mut ask, 32, "restore_checkpoint", serde_json::json!({"sandbox_id": id, "name": "noted"}));
    let read = call(&mut ask, 33, "read_file", serde_json::json!({"sandbox_id": id, "path": "/root/mcp/note.txt"}));
    assert_eq!(read, "noted");
    let forked = call(&mut ask, 34, "fork_sandbox", serde_json::json!({"sandbox_id": id, "count": 2}));
    let forks: serde_json::Value = serde_json::from_str(&forked).unwrap();
    assert_eq!(forks["forks"].as_array().map(Vec::len), Some(2), "{forks}");
    for (n, fork) in forks["forks"].as_array().unwrap().iter().enumerate() {
        let read = call(
            &mut ask,
            40 + n as u64,
            "read_file",
            serde_json::json!({"sandbox_id": fork, "path": "/root/mcp/note.txt"}),
        );
        assert_eq!(read, "noted");
        call(&mut ask, 50 + n as u64, "delete_sandbox", serde_json::json!({"sandbox_id": fork}));
    }
    // Errors are tool errors, not crashes.
    let missing = ask(
        7,
        "tools/call",
        serde_json::json!({"name": "run_command", "arguments": {"sandbox_id": "sbx_nope", "command": "true"}}),
    );
    assert_eq!(missing["result"]["isError"], true, "{missing}");
    let unknown = ask(8, "no/such/method", serde_json::json!({}));
    assert_eq!(unknown["error"]["code"], -32601);
    let deleted = ask(9, "tools/call", serde_json::json!({"name": "delete_sandbox", "arguments": {"sandbox_id": id}}));
    assert_eq!(deleted["result"]["isError"], false, "{deleted}");
    drop(stdin);
    assert!(
        child.wait_timeout(std::time::Duration::from_secs(10)).is_some_and(|s| s.success()),
        "mcp ends with its input"
    );
    stop(server);
}

#[test]
fn a_template_from_a_registry_image_from_the_cli() {
    let data = TestDataDir::new();
    let registry = space_testkit::registry::Registry::start(None);
    space_testkit::images::push_app_image(&registry, "cli/app", "2", None);
    let (server, url, _) =
        serve_with(&data, &["--dev", "--listen", "127.0.0.1:0", "--insecure-registry", &registry.host]);
    let reference = format!("{}/cli/app:2", registry.host);

    let made = space(&data, &url, &["template", "create", "pulled", "--from-image", &reference, "--workdir", "/etc"]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let template: serde_json::Value = serde_json::from_slice(&made.stdout).unwrap();
    assert_eq!(template["state"], "ready", "{template}");
    assert_eq!(template["defaults"]["workdir"], "/etc", "the flag wins over the image's: {template}");
    assert_eq!(template["defaults"]["command"], serde_json::json!(["/bin/sh", "run.sh"]), "{template}");
    let created = space(&data, &url, &["sandbox", "create", "--quiet", "--template", "pulled"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let id = String::from_utf8(created.stdout).unwrap().trim().to_string();
    let exec = space(&data, &url, &["exec", &id, "--", "cat", "greeting"]);
    assert_eq!(String::from_utf8_lossy(&exec.stdout), space_testkit::images::GREETING, "{exec:?}");

    // An image that is not there: refused before anything is built.
    let missing = space(&data, &url, &["template", "create", "nope", "--from-image", &format!("{reference}-missing")]);
    assert!(!missing.status.success());
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(said.contains("image_unavailable") && said.contains("not found"), "{said}");
    let listed = space(&data, &url, &["template", "ls"]);
    assert!(!String::from_utf8_lossy(&listed.stdout).contains("nope"));

    // And as an agent would, through MCP.
    let (child, mut stdin, mut lines) = mcp(&data, &url);
    let mut ask =
        |id: u64, method: &str, params: serde_json::Value| mcp_ask(&mut stdin, &mut lines, id, method, params);
    ask(1, "initialize", mcp_initialize());
    let call = |name: &str, image: &str| serde_json::json!({"name": "template_from_image", "arguments": {"name": name, "image": image}});
    let made = ask(2, "tools/call", call("via-mcp", &reference));
    assert_eq!(made["result"]["isError"], false, "{made}");
    let said = made["result"]["content"][0]["text"].as_str().unwrap();
    assert!(said.contains("\"via-mcp\"") && said.contains("\"ready\""), "{said}");
    let missing = ask(3, "tools/call", call("via-mcp-missing", &format!("{reference}-missing")));
    assert_eq!(missing["result"]["isError"], true, "{missing}");
    drop(stdin);
    assert!(child.wait_timeout(std::time::Duration::from_secs(10)).is_some_and(|s| s.success()), "mcp ends");
    stop(server);
}

#[test]
fn a_template_from_a_dockerfile_from_the_cli() {
    let data = TestDataDir::new();
    let (server, url) = serve(&data);
    let context = data.root().join("context");
    std::fs::create_dir_all(context.join("app")).unwrap();
    std::fs::write(context.join("app/hello.txt"), "hello from the context\n").unwrap();
    std::fs::write(context.join("secret.txt"), "never sent\n").unwrap();
    std::fs::write(context.join(".dockerignore"), "secret.txt\n").unwrap();
    let dockerfile = context.join("Dockerfile");
    std::fs::write(
        &dockerfile,
        "FROM template:base\nARG GREETING=hi\nCOPY . /srv/\nRUN echo \"$GREETING\" > /srv/greeting\nWORKDIR /srv\n\
         COPY --chown=nobody:nogroup app/hello.txt /srv/owned.txt\n",
    )
    .unwrap();
    let (file, dir) = (dockerfile.to_str().unwrap(), context.to_str().unwrap());
    let built = space(&data, &url, &["template", "build", "fromfile", "-f", file, dir, "--build-arg", "GREETING=hey"]);
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let template: serde_json::Value = serde_json::from_slice(&built.stdout).unwrap();
    assert_eq!(template["defaults"]["workdir"], "/srv", "{template}");
    let created = space(&data, &url, &["sandbox", "create", "--quiet", "--template", "fromfile"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let id = String::from_utf8(created.stdout).unwrap().trim().to_string();
    let seen = space(
        &data,
        &url,
        &["exec", &id, "--", "sh", "-c", "cat app/hello.txt greeting; stat -c %u:%g owned.txt; ls -a"],
    );
    let seen = String::from_utf8_lossy(&seen.stdout).into_owned();
    // Names in --chown are the image's own (Debian's nobody and nogroup).
    assert!(seen.starts_with("hello from the context\nhey\n65534:65534\n"), "{seen}");
    assert!(!seen.contains("secret.txt"), "an ignored file was sent: {seen}");

    // A user the image does not have: the build fails naming it.
    std::fs::write(&dockerfile, "FROM template:base\nCOPY --chown=nosuchuser app/hello.txt /srv/\n").unwrap();
    let failed = space(&data, &url, &["template", "build", "unowned", "-f", file, dir]);
    assert!(!failed.status.success());
    let said = String::from_utf8_lossy(&failed.stderr);
    assert!(said.contains("no user \"nosuchuser\""), "{said}");
    // An instruction not built: refused at once, naming it and its line.
    std::fs::write(&dockerfile, "FROM template:base\nHEALTHCHECK CMD true\n").unwrap();
    let refused = space(&data, &url, &["template", "build", "nope", "-f", file, dir]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("line 2: HEALTHCHECK"), "{said}");
    // Neither a Dockerfile nor packages, or both.
    let neither = space(&data, &url, &["template", "build", "nope"]);
    assert!(!neither.status.success());
    let both = space(&data, &url, &["template", "build", "nope", "-f", file, "--debian-packages", "jq"]);
    assert!(!both.status.success());

    // An agent's way: the Dockerfile and its files through MCP.
    let (child, mut stdin, mut lines) = mcp(&data, &url);
    let mut ask =
        |id: u64, method: &str, params: serde_json::Value| mcp_ask(&mut stdin, &mut lines, id, method, params);
    ask(1, "initialize", mcp_initialize());
    let build = serde_json::json!({"name": "template_build", "arguments": {"name": "via-mcp",
        "dockerfile": "FROM template:base\nCOPY notes.txt /srv/notes.txt\nRUN wc -c /srv/notes.txt > /srv/size\n",
        "files": {"notes.txt": "four"}}});
    let made = ask(2, "tools/call", build);
    assert_eq!(made["result"]["isError"], false, "{made}");
    let failing = serde_json::json!({"name": "template_build", "arguments": {"name": "via-mcp-failing",
        "dockerfile": "FROM template:base\nRUN exit 3\n"}});
    let failed = ask(3, "tools/call", failing);
    assert_eq!(failed["result"]["isError"], true, "{failed}");
    let said = failed["result"]["content"][0]["text"].as_str().unwrap_or("");
    assert!(said.contains("line 2"), "the failing step is named: {said}");
    drop(stdin);
    assert!(child.wait_timeout(std::time::Duration::from_secs(10)).is_some_and(|s| s.success()), "mcp ends");
    stop(server);
}

#[test]
fn python_sdk_in_a_fresh_venv_and_the_walkthrough_against_a_real_server() {
    use space_host::template::{BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE};
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE]);
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let venv = data.root().join("venv");
    let made = output_within(Command::new("python3").args(["-m", "venv"]).arg(&venv), PATIENCE);
    assert!(made.status.success(), "python3 -m venv: {}", String::from_utf8_lossy(&made.stderr));
    let pip = output_within(
        Command::new(venv.join("bin/pip"))
            .args(["install", "-q"])
            .arg(format!("{}[attach]", repo.join("sdk/python").display())),
        common::PIP_PATIENCE,
    );
    assert!(pip.status.success(), "pip install ./sdk/python: {}", String::from_utf8_lossy(&pip.stderr));

    // An image in a registry on loopback, for `Template.from_image`.
    let registry = space_testkit::registry::Registry::start(None);
    space_testkit::images::push_app_image(&registry, "sdk/app", "1", None);
    let (server, url, _) =
        serve_with(&data, &["--dev", "--listen", "127.0.0.1:0", "--insecure-registry", &registry.host]);
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let python = venv.join("bin/python");
    let mut tests = Command::new(&python);
    tests
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(repo.join("sdk/python/tests"))
        .env("SPACE_URL", &url)
        .env("SPACE_API_KEY", &key)
        .env("SPACE_TEST_IMAGE", format!("{}/sdk/app:1", registry.host));
    let ran = output_within(&mut tests, common::SUITE_PATIENCE);
    let report = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success() && report.contains("OK"), "the SDK's tests: {report}");
    assert!(!report.contains("SPACE_TEST_IMAGE names no image"), "the image tests ran: {report}");

    // The walkthrough, unattended: a transcript directory stays, the sandbox goes.
    let walk = data.root().join("walk");
    std::fs::create_dir_all(&walk).unwrap();
    let mut command = Command::new(&python);
    command
        .arg(repo.join("examples/first_sandbox.py"))
        .current_dir(&walk)
        .env("SPACE_URL", &url)
        .env("SPACE_API_KEY", &key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Reaper::global().spawn(&mut command).unwrap();
    std::io::Write::write_all(child.child.stdin.as_mut().unwrap(), b"delete\n").unwrap();
    drop(child.child.stdin.take());
    let mut pipe = child.child.stdout.take().unwrap();
    let out = within("the walkthrough's output", std::time::Duration::from_secs(120), move || {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut out).unwrap();
        out
    });
    assert_eq!(child.wait_timeout(std::time::Duration::from_secs(120)), Some(ExitStatus::Exited(0)), "{out}");
    let runs: Vec<_> = std::fs::read_dir(walk.join("space-runs")).unwrap().flatten().collect();
    assert_eq!(runs.len(), 1, "one run directory");
    let id = runs[0].file_name().to_string_lossy().into_owned();
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(runs[0].path().join("run.json")).unwrap()).unwrap();
    assert_eq!(run["commands"].as_array().unwrap().len(), 4);
    assert_eq!(run["commands"][3]["exit_code"], 3);
    assert!(out.contains("accepts at once") && out.contains("succeeded"), "{out}");
    let got = space(&data, &url, &["sandbox", "get", &id]);
    assert!(String::from_utf8_lossy(&got.stdout).contains("\"deleted\""), "no sandbox is left");
    stop(server);
}

/// A dynamically linked agent (such as the debug build `cargo build` puts
/// beside a debug `space`) cannot be a sandbox's PID 1 or the guest's
/// `/init`: naming one is a clear error, before anything is started.
#[test]
fn a_dynamically_linked_agent_is_refused() {
    let data = TestDataDir::new();
    let dynamic = std::env::current_exe().unwrap(); // this test binary is dynamically linked
    let mut command = Command::new(SPACE);
    command.args(["serve", "--dev", "--listen", "127.0.0.1:0", "--data-dir"]).arg(data.root());
    command.arg("--agent-bin").arg(&dynamic);
    let out = output_within(&mut command, PATIENCE);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused: {said}");
    assert!(said.contains("not a statically linked executable"), "{said}");
}

#[test]
fn json_logs_carry_request_ids_and_tenants_and_never_keys() {
    let data = TestDataDir::new();
    let (server, url, _, lines) =
        common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0", "--log-format", "json"]);
    let logged = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = logged.clone();
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(|l| sink.lock().unwrap().push(l)));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let client = space_client::Client::with_deadline(&url, &key, PATIENCE * 2);

    let ours = client.call_with("GET", "/v1/sandboxes", &[("X-Request-Id", "trace-me-1")], None).unwrap();
    assert_eq!((ours.status, ours.header("x-request-id")), (200, Some("trace-me-1")), "{ours:?}");
    let missing = "op_00000000000000000000";
    let answer = client.call_with("GET", &format!("/v1/operations/{missing}"), &[], None).unwrap();
    assert_eq!(answer.status, 404, "{answer:?}");
    let given = answer.header("x-request-id").unwrap_or_default().to_string();
    assert!(given.starts_with("req_"), "{given}");

    let line_for = |id: &str| {
        logged
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["span"]["request_id"] == id && v["fields"]["message"] == "request")
    };
    let first =
        space_testkit::wait_for("the first request's log line", space_testkit::PATIENCE, || line_for("trace-me-1"));
    assert_eq!(first["fields"]["status"], 200, "{first}");
    assert_eq!(first["span"]["tenant"], "default", "{first}");
    assert_eq!(first["span"]["route"], "/v1/sandboxes", "{first}");
    let second = space_testkit::wait_for("the second request's log line", space_testkit::PATIENCE, || line_for(&given));
    assert_eq!(second["fields"]["status"], 404, "{second}");
    assert_eq!(second["span"]["operation"], missing, "{second}");
    stop(server);
    let all = logged.lock().unwrap().join("\n");
    assert!(!all.contains(&key), "the key is never logged");
}

/// A test that panics with a server running leaves it to its data dir's
/// drop: the server goes first (alive, it would start sandboxes after the
/// sweep), then every sandbox over the dir; nothing outlives the dir.
#[test]
fn dropping_a_test_data_dir_stops_the_server_over_it_and_its_sandboxes() {
    let data = TestDataDir::new();
    let root = data.root().to_string_lossy().into_owned();
    let (server, url, _) = serve_with(&data, &["--dev", "--listen", "127.0.0.1:0", "--warm-pool", "1"]);
    let created = space(&data, &url, &["sandbox", "create", "--quiet"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    assert!(space_testkit::processes_mentioning(&format!("--root={root}/")) > 0, "a sandbox runs");
    drop(data);
    assert!(server.wait_timeout(std::time::Duration::from_secs(10)).is_some(), "the server still runs");
    assert_eq!(space_testkit::processes_mentioning(&format!("--root={root}/")), 0, "a sandbox outlived its dir");
}

/// A test the runner's watchdog kills runs no destructor: the server and
/// sandboxes over its data dir outlive it, until a later test's fixtures
/// (or the test command, after the run) sweep what makers that are gone
/// left. A maker that runs keeps everything.
#[test]
fn what_a_killed_test_left_is_swept_once_it_is_gone() {
    // Stands in for the killed test: the data dir is named as its.
    let maker = Reaper::global().spawn(Command::new("sleep").arg("600")).unwrap();
    let data = TestDataDir::made_by(maker.id());
    let root = data.root().to_path_buf();
    let (server, url, _) = serve_with(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    let created = space(&data, &url, &["sandbox", "create", "--quiet"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let id = String::from_utf8(created.stdout).unwrap().trim().to_string();
    let sandboxes = format!("--root={}/", root.display());
    assert!(space_testkit::processes_mentioning(&sandboxes) > 0, "a sandbox runs");
    std::mem::forget(data);

    let swept = space_testkit::leftovers::sweep(true);
    assert!(!swept.data_dirs.contains(&root), "the dir of a test that runs was swept");
    assert!(root.is_dir() && space_testkit::processes_mentioning(&sandboxes) > 0, "a running test's sandbox was swept");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(maker.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    assert!(maker.wait_timeout(std::time::Duration::from_secs(10)).is_some());
    let swept = space_testkit::leftovers::sweep(true);
    assert!(swept.data_dirs.contains(&root), "{swept:?}");
    assert!(server.wait_timeout(std::time::Duration::from_secs(10)).is_some(), "the server over the dir still runs");
    assert_eq!(space_testkit::processes_mentioning(&sandboxes), 0, "a sandbox outlived its killed test");
    assert!(space_testkit::sandbox_cgroups(&id).is_empty(), "the sandbox's cgroups are left");
    assert!(!root.exists(), "the data dir is left");
}

/// A system user made for one test, removed when it ends however it ends.
struct ScratchUser(String);

impl Drop for ScratchUser {
    fn drop(&mut self) {
        // `userdel` takes the user's own group with it; `groupdel` is for
        // a group left behind all the same. Neither may hold the test, and
        // either gives up at once while another tool holds the lock of the
        // user database (another test run's setup), so each is tried again.
        let gone = |tool: &str| match tool {
            "userdel" => nix::unistd::User::from_name(&self.0).is_ok_and(|u| u.is_none()),
            _ => nix::unistd::Group::from_name(&self.0).is_ok_and(|g| g.is_none()),
        };
        for tool in ["userdel", "groupdel"] {
            for attempt in 1..=10 {
                if gone(tool) {
                    break;
                }
                let mut command = Command::new(tool);
                command.arg(&self.0).stdout(Stdio::null()).stderr(Stdio::null());
                if let Ok(child) = Reaper::global().spawn(&mut command) {
                    if child.wait_timeout(std::time::Duration::from_secs(30)).is_none() {
                        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
                        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                    }
                }
                if !gone(tool) {
                    std::thread::sleep(std::time::Duration::from_millis(200 * attempt));
                }
            }
        }
    }
}

/// `program` as found on PATH, if it is there.
fn on_path(program: &str) -> Option<std::path::PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(program)).find(|p| p.is_file())
}

/// Owner, group and permission bits of `path` (not followed).
fn owner_and_mode(path: &std::path::Path) -> (u32, u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (meta.uid(), meta.gid(), meta.mode() & 0o7777)
}

/// `space setup --privileges-only --systemd` makes the user, gives it its
/// paths and nothing else, writes units that hold the hardening, and a
/// second run changes nothing; what drifted since is put back.
#[test]
fn setup_makes_the_user_its_paths_and_units_once() {
    let data = TestDataDir::with_templates(&[]);
    let root = data.root().to_path_buf();
    let name = format!("spt{}", std::process::id());
    let user = ScratchUser(name.clone());
    drop(ScratchUser(name.clone())); // one a killed run of this pid left
    let (units, tmpfiles, run) = (root.join("units"), root.join("tmpfiles"), root.join("run-space"));
    let setup = |user: &str| {
        let mut command = Command::new(SPACE);
        command
            .args(["setup", "--privileges-only", "--systemd", "--data-dir"])
            .arg(&root)
            .args(["--user", user, "--run-dir"])
            .arg(&run)
            .arg("--unit-dir")
            .arg(&units)
            .arg("--tmpfiles-dir")
            .arg(&tmpfiles)
            .arg("--agent-bin")
            .arg(agent_bin());
        let output = output_within(&mut command, CLI_PATIENCE);
        (output.status, String::from_utf8_lossy(&output.stderr).into_owned())
    };

    let (status, said) = setup(&name);
    assert!(status.success(), "{said}");
    assert!(said.contains(&format!("user {name}: created")), "{said}");
    assert!(!said.contains("nothing changed"), "{said}");
    let account = nix::unistd::User::from_name(&name).unwrap().expect("setup made the user");
    let (uid, gid) = (account.uid.as_raw(), account.gid.as_raw());
    assert_ne!(uid, 0);
    assert_eq!(account.dir, root, "its home is the data dir");
    assert_eq!(account.shell, std::path::Path::new("/usr/sbin/nologin"));
    assert_eq!(nix::unistd::Group::from_gid(account.gid).unwrap().expect("its group").name, name);
    for dir in [root.join("state"), root.join("logs"), root.join("run/uploads")] {
        assert_eq!(owner_and_mode(&dir), (uid, gid, 0o700), "{}", dir.display());
    }
    assert_eq!(owner_and_mode(&run), (0, gid, 0o750));
    assert_eq!(owner_and_mode(&root.join("state/api-key")), (uid, gid, 0o600));
    for dir in [root.clone(), root.join("run"), root.join("templates"), root.join("sandboxes")] {
        let (owner, _, mode) = owner_and_mode(&dir);
        assert_eq!((owner, mode & 0o022), (0, 0), "{} stays root's and not writable by the user", dir.display());
    }

    let helper = std::fs::read_to_string(units.join("space-helper.service")).unwrap();
    let server = std::fs::read_to_string(units.join("space.service")).unwrap();
    let has = |unit: &str, line: &str| unit.lines().any(|l| l == line);
    let exec = |unit: &str| unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap().to_string();
    assert!(
        exec(&helper).ends_with(&format!(
            "space helper --data-dir {root} --socket {run}/helper.sock --allow-uid {uid} --agent-bin {agent}",
            root = root.display(),
            run = run.display(),
            agent = std::fs::canonicalize(agent_bin()).unwrap().display()
        )),
        "{helper}"
    );
    for line in [
        "CapabilityBoundingSet=CAP_SYS_ADMIN CAP_CHOWN CAP_DAC_OVERRIDE CAP_FOWNER CAP_FSETID CAP_SETUID CAP_SETGID \
         CAP_SETPCAP CAP_KILL CAP_SYS_PTRACE CAP_SYS_NICE CAP_MKNOD CAP_SYS_CHROOT CAP_SYS_RESOURCE CAP_NET_ADMIN \
         CAP_SETFCAP",
        "ProtectSystem=strict",
        &format!("ReadWritePaths={} {} /sys/fs/cgroup", root.display(), run.display()),
        "PrivateTmp=yes",
        "ProtectHome=yes",
        "Delegate=yes",
        "KillMode=process",
    ] {
        assert!(has(&helper, line), "the helper's unit lacks {line:?}:\n{helper}");
    }
    assert!(!helper.contains("User="), "the helper is root's");
    assert!(
        exec(&server).contains(&format!(
            " serve --data-dir {root} --helper-socket {run}/helper.sock --api-key-file {root}/state/api-key",
            root = root.display(),
            run = run.display()
        )),
        "{server}"
    );
    for line in [
        &format!("User={name}"),
        "Requires=space-helper.service",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        &format!(
            "ReadWritePaths={root}/state {root}/logs {root}/run/uploads {run}",
            root = root.display(),
            run = run.display()
        ),
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "RestrictNamespaces=yes",
        "SystemCallArchitectures=native",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "LockPersonality=yes",
        "ProtectKernelTunables=yes",
    ] {
        assert!(has(&server, line), "the server's unit lacks {line:?}:\n{server}");
    }
    assert!(server.lines().filter(|l| l.starts_with("CapabilityBoundingSet=")).count() == 1, "{server}");
    let tmpfiles_line = std::fs::read_to_string(tmpfiles.join("space.conf")).unwrap();
    assert!(has(&tmpfiles_line, &format!("d {} 0750 root {name} -", run.display())), "{tmpfiles_line}");
    match on_path("systemd-analyze") {
        // Unknown keys are only warned about: a clean verify says nothing.
        Some(analyze) => {
            let verify = output_within(
                Command::new(analyze)
                    .args(["verify", "--man=no"])
                    .arg(units.join("space-helper.service"))
                    .arg(units.join("space.service")),
                CLI_PATIENCE,
            );
            let complaints = String::from_utf8_lossy(&verify.stderr);
            assert!(verify.status.success() && complaints.trim().is_empty(), "systemd-analyze verify: {complaints}");
        }
        None => eprintln!("no systemd-analyze here: the units are not verified"),
    }

    let (status, said) = setup(&name);
    assert!(status.success(), "{said}");
    assert!(said.contains(&format!("user {name} and what it owns: nothing changed")), "a second run: {said}");
    assert_eq!(std::fs::read_to_string(units.join("space.service")).unwrap(), server);

    // What drifted is put back, and said.
    std::fs::set_permissions(root.join("run/uploads"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::lchown(root.join("logs"), Some(0), Some(0)).unwrap();
    std::fs::write(root.join("state/space.db"), "").unwrap();
    let (status, said) = setup(&name);
    assert!(status.success(), "{said}");
    assert!(said.contains("uploads: mode 0755 → 0700") && said.contains("logs: owner 0:0 →"), "{said}");
    assert!(said.contains("state: 1 of its entries given to"), "root's file in state/ is the user's now: {said}");
    assert_eq!(owner_and_mode(&root.join("run/uploads")), (uid, gid, 0o700));
    assert_eq!(owner_and_mode(&root.join("logs")), (uid, gid, 0o700));
    assert_eq!(owner_and_mode(&root.join("state/space.db")).0, uid);

    let (status, said) = setup("root");
    assert!(!status.success() && said.contains("is root"), "the server is never made root's: {said}");

    drop(user);
    assert!(nix::unistd::User::from_name(&name).unwrap().is_none(), "the scratch user is gone");
}

/// `space doctor`'s processes section shows a running helper as what it
/// is: root, with root's capabilities, no seccomp, no no_new_privs, and
/// only the server's requests as its input. Stopped, it is gone from it.
#[test]
fn doctor_shows_the_privileges_of_a_running_helper() {
    let data = TestDataDir::with_templates(&[]);
    let socket = data.root().join("doctor-helper.sock");
    let helper = common::spawn_helper(&data, &socket, 65534);
    let pid = helper.id();
    /// A helper left by a failing test would serve on.
    struct Kill(u32);
    impl Drop for Kill {
        fn drop(&mut self) {
            let pid = nix::unistd::Pid::from_raw(self.0 as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let kill = Kill(pid);
    let doctor = || {
        let mut command = Command::new(SPACE);
        command.arg("doctor").arg("--data-dir").arg(data.root()).arg("--agent-bin").arg(agent_bin());
        String::from_utf8(output_within(&mut command, CLI_PATIENCE).stdout).unwrap()
    };
    let report = doctor();
    let heading = format!("  helper    pid {pid}");
    let block: Vec<&str> = report
        .lines()
        .skip_while(|l| *l != heading)
        .enumerate()
        .take_while(|(i, l)| *i == 0 || l.starts_with("            "))
        .map(|(_, l)| l)
        .collect();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let cap_eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    let cap_eff = u64::from_str_radix(cap_eff, 16).unwrap();
    drop(kill);
    let field = |key: &str| {
        block.iter().find_map(|l| l.trim_start().strip_prefix(key)).map(str::trim).unwrap_or_else(|| {
            panic!("no {key} for the helper (pid {pid}) in:\n{report}");
        })
    };
    assert_eq!(field("user"), "root (uid 0)");
    let caps: Vec<&str> = field("capabilities").split(' ').collect();
    assert_eq!(caps.len(), cap_eff.count_ones() as usize, "one name per capability it holds: {caps:?}");
    assert_eq!(cap_eff & 1 != 0, caps.contains(&"cap_chown"));
    assert_eq!(cap_eff & (1 << 21) != 0, caps.contains(&"cap_sys_admin"));
    assert!(caps.contains(&"cap_sys_admin"), "root's helper holds CAP_SYS_ADMIN: {caps:?}");
    assert_eq!(field("no_new_privs"), "no");
    assert_eq!(field("seccomp"), "0 (disabled)");
    assert!(field("landlock").starts_with("kernel ABI ") || field("landlock") == "not offered by this kernel");
    assert!(field("reads").starts_with("the typed requests of the unprivileged server on its socket"));
    assert!(report.contains("  server    "), "the server's part is there, running or not:\n{report}");

    assert!(helper.wait_timeout(std::time::Duration::from_secs(30)).is_some(), "the helper ended");
    let report = doctor();
    assert!(!report.contains(&heading), "a helper that ended is not shown:\n{report}");
}

#[test]
fn doctor_shows_the_confined_server_as_security_md_says() {
    let data = TestDataDir::new();
    let (server, _) = serve(&data);
    let pid = server.id();
    let mut command = Command::new(SPACE);
    command.arg("doctor").arg("--data-dir").arg(data.root()).arg("--agent-bin").arg(agent_bin());
    let report = String::from_utf8(output_within(&mut command, CLI_PATIENCE).stdout).unwrap();
    let heading = format!("  server    pid {pid}");
    let block: Vec<&str> = report
        .lines()
        .skip_while(|l| *l != heading)
        .enumerate()
        .take_while(|(i, l)| *i == 0 || l.starts_with("            "))
        .map(|(_, l)| l.trim())
        .collect();
    let field = |key: &str| {
        block
            .iter()
            .find_map(|l| l.strip_prefix(key).map(str::trim))
            .unwrap_or_else(|| panic!("no {key} for the server in: {report}"))
    };
    assert!(field("user").starts_with(&format!("{} (uid", common::TEST_USER)), "{report}");
    assert_eq!(field("capabilities"), "none", "{report}");
    assert_eq!(field("no_new_privs"), "yes", "{report}");
    assert!(field("seccomp").starts_with("2"), "{report}");
    assert!(field("landlock").starts_with("enforced ("), "the server recorded its ruleset: {report}");
    stop(server);
}
