//! Crash-safety under load: clients create, exec, pause, suspend, resume and
//! delete sandboxes while the server (`space serve`, a real process) is
//! killed with SIGKILL at random moments and started again, several times.
//! Afterwards every answered command still has its result and transcript,
//! every operation has ended, every sandbox is in a usable state (none
//! failed because of a restart), every accepted delete was carried out,
//! and nothing of a deleted sandbox is left on the host. A pull or a
//! Dockerfile build cut short by a kill ends failed and leaves nothing.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use space_process::ReapedChild;
use space_testkit::{processes_mentioning, wait_for, wait_until, TestDataDir, PATIENCE};

mod common;
const CLIENTS: usize = 3;
const KILLS: usize = 6;

/// Starts `space serve --dev` on an ephemeral port; returns it and its URL.
fn serve(data: &TestDataDir) -> (ReapedChild, String) {
    serve_with_pool(data, "1")
}

/// [`serve`] with `warm` members in the warm pool.
fn serve_with_pool(data: &TestDataDir, warm: &str) -> (ReapedChild, String) {
    let (child, url, seen, lines) =
        common::spawn_server(data, &["--dev", "--listen", "127.0.0.1:0", "--warm-pool", warm]);
    // The server's log, kept across restarts for a failure's post-mortem.
    let log_path = data.root().join("serve.log");
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(log_path).unwrap();
    std::thread::spawn(move || {
        for line in seen.into_iter().map(Ok).chain(lines) {
            let Ok(line) = line else { break };
            let _ = writeln!(log, "{line}");
        }
    });
    (child, url)
}

/// A random number below `n`.
fn below(n: u64) -> u64 {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes).unwrap();
    u64::from_le_bytes(bytes) % n.max(1)
}

/// A client of whichever server runs now. Requests that meet a dead
/// server fail (None) and are not retried blindly: a lifecycle request
/// might have been accepted before the answer was lost.
#[derive(Clone)]
struct Client {
    url: Arc<RwLock<String>>,
    key: String,
}

impl Client {
    /// The API's own client, of the server that runs now; `patience` is
    /// each call's deadline.
    fn api(&self, patience: Duration) -> space_client::Client {
        let agent = ureq::AgentBuilder::new().timeout(patience).build();
        space_client::Client::with_agent(&self.url.read().unwrap(), &self.key, agent)
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Option<(u16, Value)> {
        self.api(Duration::from_secs(90)).call(method, path, body.as_ref()).ok()
    }

    /// Calls until the server answers (it may be restarting).
    fn call_until_answered(&self, method: &str, path: &str) -> (u16, Value) {
        wait_for(&format!("{method} {path} to be answered"), PATIENCE, || self.call(method, path, None))
    }

    fn wait_operation(&self, id: &str) -> Option<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some((200, op)) = self.call("GET", &format!("/v1/operations/{id}?wait=20"), None) {
                if matches!(op["state"].as_str(), Some("succeeded" | "failed" | "cancelled")) {
                    return Some(op);
                }
            } else {
                std::thread::sleep(Duration::from_millis(200)); // the server is restarting
            }
        }
        None
    }
}

/// What the clients were told, to check after the dust settles.
#[derive(Default)]
struct Record {
    /// Commands whose result was returned: sandbox, command id, stdout.
    answered: Vec<(String, String, String)>,
    /// Every sandbox a create was accepted for.
    created: Vec<String>,
    /// Sandboxes a delete was accepted (202) for.
    deleted: Vec<String>,
    /// Lifecycle requests accepted (202), by kind.
    accepted: BTreeMap<String, usize>,
}

fn client_loop(client: Client, stop: Arc<AtomicBool>, record: Arc<Mutex<Record>>) {
    let mut mine: Vec<String> = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let action = if mine.is_empty() { 0 } else { below(10) };
        let target = mine.get(below(mine.len() as u64) as usize).cloned();
        match (action, target) {
            (0 | 1, _) if mine.len() < 4 => {
                let Some((202, answer)) =
                    client.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256})))
                else {
                    continue;
                };
                let id = answer["sandbox"]["id"].as_str().unwrap().to_string();
                record.lock().unwrap().created.push(id.clone());
                *record.lock().unwrap().accepted.entry("create".into()).or_default() += 1;
                mine.push(id);
                client.wait_operation(answer["operation"]["id"].as_str().unwrap());
            }
            (2..=5, Some(id)) => {
                let token = format!("token-{n}-{}", below(1 << 30));
                let body = json!({"cmd": format!("echo {token}; sleep 0.{}", below(5)), "timeout_s": 30});
                if let Some((200, answer)) = client.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(body)) {
                    if answer["result"]["exit_code"] == 0 {
                        let cid = answer["command"]["id"].as_str().unwrap().to_string();
                        let stdout = answer["stdout"].as_str().unwrap().to_string();
                        assert_eq!(stdout, format!("{token}\n"), "{answer}");
                        record.lock().unwrap().answered.push((id, cid, stdout));
                    }
                }
            }
            (6..=8, Some(id)) => {
                let kind = ["pause", "resume", "suspend", "resume"][below(4) as usize];
                if let Some((202, answer)) = client.call("POST", &format!("/v1/sandboxes/{id}/{kind}"), None) {
                    *record.lock().unwrap().accepted.entry(kind.into()).or_default() += 1;
                    client.wait_operation(answer["operation"]["id"].as_str().unwrap());
                }
            }
            (_, Some(id)) => {
                if let Some((202, answer)) = client.call("DELETE", &format!("/v1/sandboxes/{id}"), None) {
                    record.lock().unwrap().deleted.push(id.clone());
                    *record.lock().unwrap().accepted.entry("delete".into()).or_default() += 1;
                    mine.retain(|m| *m != id);
                    client.wait_operation(answer["operation"]["id"].as_str().unwrap());
                }
            }
            _ => {}
        }
    }
}

/// On a failure, keeps the servers' log (the data dir goes with the test).
struct KeepLogOnFailure(std::path::PathBuf);

impl Drop for KeepLogOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let kept = std::env::temp_dir().join("space-crash-test-serve.log");
            if std::fs::copy(&self.0, &kept).is_ok() {
                eprintln!("the servers' log: {}", kept.display());
            }
        }
    }
}

#[test]
fn killing_the_server_under_load_loses_nothing_it_accepted() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let _log = KeepLogOnFailure(data.root().join("serve.log"));
    let (mut server, url) = serve(&data);
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let client = Client { url: Arc::new(RwLock::new(url)), key };
    let stop = Arc::new(AtomicBool::new(false));
    let record = Arc::new(Mutex::new(Record::default()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, stop, record) = (client.clone(), stop.clone(), record.clone());
            std::thread::spawn(move || client_loop(client, stop, record))
        })
        .collect();

    for kill in 0..KILLS {
        // A random moment: load runs for 2-6 s between kills.
        std::thread::sleep(Duration::from_millis(2000 + below(4000)));
        let pid = nix::unistd::Pid::from_raw(server.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
        server.wait_timeout(Duration::from_secs(10)).expect("the killed server is reaped");
        let (restarted, url) = serve(&data);
        eprintln!("kill {}: restarted on {url}", kill + 1);
        server = restarted;
        *client.url.write().unwrap() = url;
    }
    stop.store(true, Ordering::Relaxed);
    for handle in clients {
        handle.join().expect("a client panicked");
    }
    let record = std::mem::take(&mut *record.lock().unwrap());
    eprintln!(
        "{} sandboxes, {} commands answered, accepted: {:?}",
        record.created.len(),
        record.answered.len(),
        record.accepted
    );
    assert!(record.created.len() >= CLIENTS && !record.answered.is_empty(), "the load did something");

    // Every operation ends, none left pending or running.
    let log = std::fs::read_to_string(data.root().join("serve.log")).unwrap_or_default();
    eprintln!(
        "after the restarts: {} operations carried out again, {} interrupted transitions settled, {} sandboxes re-adopted",
        log.matches("carrying out an operation accepted before the restart").count(),
        log.matches("settled a transition the restart interrupted").count(),
        log.matches("re-adopted after a restart").count(),
    );
    let operations = wait_for("every operation to end", PATIENCE * 3, || {
        let (status, list) = client.call_until_answered("GET", "/v1/operations");
        assert_eq!(status, 200);
        let ops = list["operations"].as_array().unwrap().clone();
        ops.iter().all(|op| matches!(op["state"].as_str(), Some("succeeded" | "failed" | "cancelled"))).then_some(ops)
    });
    let failed: Vec<&Value> = operations.iter().filter(|op| op["state"] == "failed").collect();
    for op in &failed {
        let code = op["error"]["code"].as_str().unwrap_or("");
        // A request can still be refused for the state it meets (a pause
        // of a sandbox another client suspended): never for a restart.
        assert_ne!(code, "interrupted", "an operation was dropped by a restart: {op}");
        assert!(code == "invalid_state" || code == "capacity", "an operation failed: {op}");
    }

    // Every sandbox settles in a valid state, none failed by a restart.
    for id in &record.created {
        let (status, sandbox) = client.call_until_answered("GET", &format!("/v1/sandboxes/{id}"));
        assert_eq!(status, 200, "{sandbox}");
        let state = sandbox["state"].as_str().unwrap();
        assert_ne!(state, "failed", "a sandbox was lost: {sandbox}");
        if record.deleted.contains(id) {
            assert_eq!(state, "deleted", "an accepted delete was carried out: {sandbox}");
            assert_eq!(processes_mentioning(id), 0, "no engine process of deleted {id} is left");
            assert!(!data.data.sandbox_dir(id).exists(), "no files of deleted {id} are left");
            for controller in ["memory", "pids", "cpu"] {
                let cgroup = std::path::Path::new("/sys/fs/cgroup").join(controller).join("space").join(id);
                assert!(!cgroup.exists(), "no cgroup of deleted {id} is left: {}", cgroup.display());
            }
            continue;
        }
        // Usable: resumed if need be, it runs a command.
        if matches!(state, "paused" | "suspended") {
            let (status, answer) = client.call("POST", &format!("/v1/sandboxes/{id}/resume"), None).unwrap();
            assert_eq!(status, 202, "{answer}");
            let op = client.wait_operation(answer["operation"]["id"].as_str().unwrap()).unwrap();
            assert_eq!(op["state"], "succeeded", "{op}");
        }
        let (status, answer) =
            client.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo usable"}))).unwrap();
        assert_eq!((status, answer["stdout"].as_str()), (200, Some("usable\n")), "{answer}");
    }

    // Every answered command keeps its result and its transcript.
    for (id, cid, stdout) in &record.answered {
        if record.deleted.contains(id) {
            continue;
        }
        let (status, command) = client.call_until_answered("GET", &format!("/v1/sandboxes/{id}/commands/{cid}"));
        assert_eq!(status, 200, "{command}");
        assert_eq!(command["result"]["exit_code"], 0, "{command}");
        // The transcript as kept, not followed: a command whose exit frame
        // was lost must fail this, not wait for it.
        let output = format!("/v1/sandboxes/{id}/commands/{cid}/output");
        let frames = client.api(Duration::from_secs(60)).get_text(&output).unwrap();
        assert!(frames.contains(stdout.trim()), "the transcript of {cid} kept its output: {frames}");
    }

    // Clean up: everything deleted, nothing left.
    for id in &record.created {
        let _ = client.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    }
    for id in &record.created {
        wait_until(&format!("{id} to be deleted"), PATIENCE, || {
            client.call("GET", &format!("/v1/sandboxes/{id}"), None).is_some_and(|(_, s)| s["state"] == "deleted")
        });
        assert_eq!(processes_mentioning(id), 0, "nothing of {id} is left");
    }
    common::stop(server);
}

/// Stops (SIGSTOP) a sandbox's engine, as a loaded host or a stuck sentry
/// would hold it, and lets it go again (SIGCONT) when dropped: the sentry
/// and the gofer, the processes of its cgroup whose parent is not in it
/// (the sentry's own children, which run the sandbox's tasks, wait on it).
struct Stopped(Vec<i32>);

impl Stopped {
    fn new(id: &str) -> Stopped {
        let procs = std::path::Path::new("/sys/fs/cgroup/pids/space").join(id).join("cgroup.procs");
        let listed = std::fs::read_to_string(&procs).unwrap_or_else(|e| panic!("{}: {e}", procs.display()));
        let members: Vec<i32> = listed.split_whitespace().filter_map(|pid| pid.parse().ok()).collect();
        let parent = |pid: i32| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // The parent is the second field after the parenthesised name.
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
        };
        let engine: Vec<i32> =
            members.iter().copied().filter(|pid| parent(*pid).is_some_and(|p| !members.contains(&p))).collect();
        assert!(!engine.is_empty(), "the sandbox's engine processes: {members:?}");
        for pid in &engine {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGSTOP).unwrap();
        }
        Stopped(engine)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGCONT);
        }
    }
}

/// A sandbox whose agent does not dial back for a while after a restart
/// (its engine's processes stopped across it) holds up no other sandbox:
/// operations accepted before the restart for others are carried out at
/// once, and it is not failed: once it runs again it is re-adopted, with
/// its command's output.
#[test]
fn a_sandbox_slow_to_come_back_holds_up_no_other() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let _log = KeepLogOnFailure(data.root().join("serve.log"));
    let (server, url) = serve_with_pool(&data, "0");
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let client = Client { url: Arc::new(RwLock::new(url)), key };
    let create = || {
        let (status, answer) =
            client.call("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 256}))).unwrap();
        assert_eq!(status, 202, "{answer}");
        let id = answer["sandbox"]["id"].as_str().unwrap().to_string();
        (id, answer["operation"]["id"].as_str().unwrap().to_string())
    };
    let (slow, slow_create) = create();
    let (other, other_create) = create();
    for op in [&slow_create, &other_create] {
        let op = client.wait_operation(op).expect("the create ended");
        assert_eq!(op["state"], "succeeded", "{op}");
    }
    // A command of the slow sandbox runs across the restart.
    let (status, command) = client
        .call("POST", &format!("/v1/sandboxes/{slow}/commands"), Some(json!({"cmd": "sleep 2; echo across"})))
        .unwrap();
    assert_eq!(status, 201, "{command}");
    let command_id = command["command"]["id"].as_str().unwrap().to_string();

    let stopped = Stopped::new(&slow);
    // Accepted right before the kill, so under way across it.
    let (status, answer) = client.call("POST", &format!("/v1/sandboxes/{other}/suspend"), None).unwrap();
    assert_eq!(status, 202, "{answer}");
    let suspend = answer["operation"]["id"].as_str().unwrap().to_string();
    let (_, op) = client.call("GET", &format!("/v1/operations/{suspend}"), None).unwrap();
    assert!(matches!(op["state"].as_str(), Some("pending" | "running")), "still under way at the kill: {op}");
    kill_server(&server);
    let (server, url) = serve_with_pool(&data, "0");
    *client.url.write().unwrap() = url;

    // The other's operations go on while the slow one's agent cannot dial
    // in: the one accepted before the restart (a re-adoption used to hold
    // it up to 120 s), and one accepted after it.
    let began = Instant::now();
    let op = client.wait_operation(&suspend).expect("the other sandbox's suspend ended within 60 s");
    assert_eq!(op["state"], "succeeded", "{op}");
    let (status, answer) = client.call("POST", &format!("/v1/sandboxes/{other}/resume"), None).unwrap();
    assert_eq!(status, 202, "{answer}");
    let op = client.wait_operation(answer["operation"]["id"].as_str().unwrap()).expect("the resume ended");
    assert_eq!(op["state"], "succeeded", "{op}");
    eprintln!("the other sandbox's operations ended {:?} after the restart", began.elapsed());
    let log = || std::fs::read_to_string(data.root().join("serve.log")).unwrap_or_default();
    // Still stopped: the server waits on, it does not give the sandbox up.
    wait_until("the wait for the slow agent to be logged", PATIENCE, || {
        log().lines().any(|line| line.contains(slow.as_str()) && line.contains("slow to dial in"))
    });
    assert!(
        !log().lines().any(|line| line.contains(slow.as_str()) && line.contains("re-adopted after a restart")),
        "the slow sandbox was not re-adopted while its processes were stopped"
    );

    // Let go, it is re-adopted, not failed, with its command's output.
    drop(stopped);
    let (status, answer) = client
        .call("POST", &format!("/v1/sandboxes/{slow}/exec"), Some(json!({"cmd": "echo back"})))
        .expect("an answer");
    assert_eq!((status, answer["stdout"].as_str()), (200, Some("back\n")), "{answer}");
    let (status, sandbox) = client.call_until_answered("GET", &format!("/v1/sandboxes/{slow}"));
    assert_eq!((status, sandbox["state"].as_str()), (200, Some("running")), "{sandbox}");
    let command = wait_for("the command across the restart to end", PATIENCE, || {
        let (_, command) = client.call_until_answered("GET", &format!("/v1/sandboxes/{slow}/commands/{command_id}"));
        (command["state"] == "exited").then_some(command)
    });
    assert_eq!(command["result"]["exit_code"], 0, "{command}");
    let output = format!("/v1/sandboxes/{slow}/commands/{command_id}/output");
    let frames = client.api(Duration::from_secs(30)).get_text(&output).unwrap();
    assert!(frames.contains("across"), "the command's output came through: {frames}");

    for id in [&slow, &other] {
        let _ = client.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    }
    for id in [&slow, &other] {
        wait_until(&format!("{id} to be deleted"), PATIENCE, || {
            client.call("GET", &format!("/v1/sandboxes/{id}"), None).is_some_and(|(_, s)| s["state"] == "deleted")
        });
    }
    common::stop(server);
}

/// `space serve ARGS` (a `--dev` server) on `data`, its log read and
/// dropped, and a client of it with the dev key.
fn serve_dev(data: &TestDataDir, args: &[&str]) -> (ReapedChild, Client) {
    let (server, url, _, lines) = common::spawn_server(data, args);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    (server, Client { url: Arc::new(RwLock::new(url)), key })
}

/// SIGKILLs the server and reaps it.
fn kill_server(server: &ReapedChild) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    server.wait_timeout(Duration::from_secs(10)).expect("the killed server is reaped");
}

/// `space serve ARGS` again on `data`, `client` pointed at it.
fn restart_server(data: &TestDataDir, args: &[&str], client: &Client) -> ReapedChild {
    let (restarted, url, _, lines) = common::spawn_server(data, args);
    std::thread::spawn(move || lines.for_each(drop));
    *client.url.write().unwrap() = url;
    restarted
}

/// `operation`, cut short by the kill, ended failed, saying why.
fn assert_ended_by_restart(client: &Client, operation: &str) {
    let (_, op) = client.call_until_answered("GET", &format!("/v1/operations/{operation}"));
    assert_eq!(op["state"], "failed", "{op}");
    assert!(op["error"]["message"].as_str().unwrap_or("").contains("restarted"), "{op}");
}

/// A registry on loopback that serves one image but sends only the first
/// MiB of its layer, then holds the connection open: a pull stays under way
/// until the test ends.
struct StallingRegistry {
    host: String,
    stop: Arc<AtomicBool>,
}

impl StallingRegistry {
    fn start() -> StallingRegistry {
        use sha2::Digest;
        let digest = |bytes: &[u8]| format!("sha256:{:x}", sha2::Sha256::digest(bytes));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let host = listener.local_addr().unwrap().to_string();
        let layer_size: usize = 8 << 20;
        let layer_digest = format!("sha256:{}", "7".repeat(64));
        let config = json!({"architecture": "amd64", "os": "linux", "config": {},
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", "8".repeat(64))]}})
        .to_string();
        let manifest = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(config.as_bytes()),
                "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest,
                "size": layer_size}]})
        .to_string();
        let config_path = format!("/v2/stall/app/blobs/{}", digest(config.as_bytes()));
        let layer_path = format!("/v2/stall/app/blobs/{layer_digest}");
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                if stopping.load(Ordering::Relaxed) {
                    return;
                }
                let mut request = [0u8; 4096];
                let read = std::io::Read::read(&mut stream, &mut request).unwrap_or(0);
                let line = String::from_utf8_lossy(&request[..read]).lines().next().unwrap_or("").to_string();
                let path = line.split(' ').nth(1).unwrap_or("").to_string();
                let (kind, body): (&str, &[u8]) = match path.as_str() {
                    "/v2/" => ("application/json", b"{}"),
                    "/v2/stall/app/manifests/1" => ("application/vnd.oci.image.manifest.v1+json", manifest.as_bytes()),
                    p if p == config_path => ("application/octet-stream", config.as_bytes()),
                    p if p == layer_path => {
                        let head = format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {layer_size}\r\n\r\n"
                        );
                        let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&vec![0x1f; 1 << 20]));
                        let stopping = stopping.clone();
                        // Held open, silent, until the test ends.
                        std::thread::spawn(move || {
                            while !stopping.load(Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(100));
                            }
                            drop(stream);
                        });
                        continue;
                    }
                    _ => ("application/json", b"{\"errors\":[{\"code\":\"NAME_UNKNOWN\"}]}"),
                };
                let status = if body.starts_with(b"{\"errors") { "404 Not Found" } else { "200 OK" };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body));
            }
        });
        StallingRegistry { host, stop }
    }
}

impl Drop for StallingRegistry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so it sees the stop.
        let _ = std::net::TcpStream::connect(&self.host);
    }
}

#[test]
fn a_pull_cut_short_by_a_killed_server_ends_failed_and_leaves_nothing() {
    let data = TestDataDir::new();
    let registry = StallingRegistry::start();
    let args = ["--dev", "--listen", "127.0.0.1:0", "--insecure-registry", registry.host.as_str()];
    let (mut server, client) = serve_dev(&data, &args);
    let image = format!("{}/stall/app:1", registry.host);
    let (status, accepted) =
        client.call("POST", "/v1/templates", Some(json!({"name": "stalled", "from": {"image": image}}))).unwrap();
    assert_eq!(status, 202, "{accepted}");
    let operation = accepted["operation"]["id"].as_str().unwrap().to_string();
    let uploads = data.root().join("run/uploads");
    let blobs = || -> Vec<String> {
        let names = std::fs::read_dir(&uploads).into_iter().flatten().flatten();
        names.map(|e| e.file_name().to_string_lossy().into_owned()).filter(|name| name.starts_with(".blob-")).collect()
    };
    wait_until("the layer to be downloading", PATIENCE, || !blobs().is_empty());
    kill_server(&server);
    assert!(!blobs().is_empty(), "the killed pull left its blob");

    server = restart_server(&data, &args, &client);
    assert_ended_by_restart(&client, &operation);
    let (status, _) = client.call_until_answered("GET", "/v1/templates/stalled");
    assert_eq!(status, 404, "no template, nor one building");
    assert!(blobs().is_empty(), "the blob was swept: {:?}", blobs());
    drop(registry);
    common::stop(server);
}

/// Sends a Dockerfile build (`POST /v1/templates/builds`, its `build` part
/// alone); the status and the answer.
fn send_build(client: &Client, build: &Value) -> (u16, Value) {
    const BOUNDARY: &str = "space-crash-boundary";
    let body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"build\"\r\nContent-Type: application/json\r\n\r\n\
         {build}\r\n--{BOUNDARY}--\r\n"
    );
    let content_type = format!("multipart/form-data; boundary={BOUNDARY}");
    let answer = client
        .api(Duration::from_secs(90))
        .send_with("POST", "/v1/templates/builds", &[("Content-Type", content_type.as_str())], body.as_bytes())
        .unwrap();
    (answer.status, answer.body)
}

#[test]
fn a_dockerfile_build_killed_in_a_run_step_ends_failed_and_its_build_sandbox_is_swept() {
    let data = TestDataDir::new();
    // No pooled sandboxes: every sandbox dir is the build's.
    let args = ["--dev", "--listen", "127.0.0.1:0", "--warm-pool", "0", "--hot-pool", "0"];
    let (mut server, client) = serve_dev(&data, &args);
    let dockerfile = |last: &str| format!("FROM template:base\nRUN echo one > /one\nRUN {last}\n");
    let running_step = "echo started; sleep 30";
    let (status, accepted) = send_build(&client, &json!({"name": "cut", "dockerfile": dockerfile(running_step)}));
    assert_eq!(status, 202, "{accepted}");
    let operation = accepted["operation"]["id"].as_str().unwrap().to_string();
    let sandboxes = data.root().join("sandboxes");
    let build_sandboxes = || -> Vec<String> {
        let names = std::fs::read_dir(&sandboxes).into_iter().flatten().flatten();
        names.map(|e| e.file_name().to_string_lossy().into_owned()).collect()
    };
    // Running, not starting: its output is in the log (a kill while runsc
    // still starts the sandbox would take the start down with the server).
    let running = wait_for("the RUN step to run in its build sandbox", PATIENCE, || {
        let log = client.api(Duration::from_secs(30)).get_text(&format!("/v1/operations/{operation}/log")).ok()?;
        let ids = build_sandboxes();
        (log.contains("] started") && ids.len() == 1 && processes_mentioning(&ids[0]) > 0).then(|| ids[0].clone())
    });
    kill_server(&server);
    assert!(processes_mentioning(&running) > 0, "the build sandbox outlives its server");

    server = restart_server(&data, &args, &client);
    assert_ended_by_restart(&client, &operation);
    let (status, template) = client.call_until_answered("GET", "/v1/templates/cut");
    assert_eq!(status, 404, "no template, nor one building: {template}");
    // The start-up sweep runs in the background.
    wait_until("the build sandbox to be swept", PATIENCE, || {
        build_sandboxes().is_empty() && processes_mentioning(&running) == 0
    });

    let (status, accepted) = send_build(&client, &json!({"name": "cut", "dockerfile": dockerfile("true")}));
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["operation"]["id"].as_str().unwrap();
    let op = client.wait_operation(id).expect("the rebuild ends");
    let log = client.api(Duration::from_secs(30)).get_text(&format!("/v1/operations/{id}/log")).unwrap_or_default();
    assert_eq!(op["state"], "succeeded", "{op}\n{log}");
    assert_eq!(log.matches(": cached").count(), 1, "the step before the cut one is reused: {log}");
    assert_eq!(log.matches(": saved").count(), 1, "{log}");
    assert!(build_sandboxes().is_empty(), "build sandboxes left: {:?}", build_sandboxes());
    common::stop(server);
}

/// A body that sends `first` bytes of `fill`, then waits (up to the test's
/// patience) until `go_on` is set, and ends with an error: a client cut
/// off in the middle of an upload.
struct HeldBody {
    left: usize,
    fill: u8,
    go_on: Arc<AtomicBool>,
}

impl std::io::Read for HeldBody {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            wait_until("the server to be killed", PATIENCE, || self.go_on.load(Ordering::SeqCst));
            return Err(std::io::Error::other("the upload is cut off"));
        }
        let n = buf.len().min(self.left);
        buf[..n].fill(self.fill);
        self.left -= n;
        Ok(n)
    }
}

/// The one volume's `data` directory on disk (a single-volume data dir).
fn volume_data(data: &TestDataDir) -> std::path::PathBuf {
    let volumes = std::fs::read_dir(data.root().join("volumes")).unwrap().flatten();
    let dirs: Vec<_> = volumes.map(|e| e.path()).filter(|p| p.join("data").is_dir()).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].join("data")
}

fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_volume_stays_whole_when_the_server_is_killed_during_a_write_and_during_snapshots() {
    let data = TestDataDir::new();
    let args = ["--dev", "--listen", "127.0.0.1:0", "--warm-pool", "0", "--hot-pool", "0"];
    let (mut server, client) = serve_dev(&data, &args);
    let (status, made) = client.call("POST", "/v1/volumes", Some(json!({"name": "ws", "size_mib": 256}))).unwrap();
    assert_eq!(status, 201, "{made}");
    let api = |client: &Client| client.api(Duration::from_secs(60));
    let written = api(&client).call_bytes("PUT", "/v1/volumes/ws/files?path=/data", &[], Some(b"old")).unwrap();
    assert_eq!(written.status, 201);
    let on_disk = volume_data(&data);

    // A write of 8 MiB of a new version, cut off by the kill.
    let go_on = Arc::new(AtomicBool::new(false));
    let body = HeldBody { left: 8 << 20, fill: b'n', go_on: go_on.clone() };
    let writer = {
        let api = api(&client);
        std::thread::spawn(move || api.send_with("PUT", "/v1/volumes/ws/files?path=/data", &[], body).map(|a| a.status))
    };
    let staged = || names_in(&on_disk).into_iter().any(|name| name.contains("space-write"));
    wait_until("the new version to be staged beside /data", PATIENCE, staged);
    kill_server(&server);
    go_on.store(true, Ordering::SeqCst);
    assert!(writer.join().unwrap().is_err(), "the cut-off write was not answered as written");
    server = restart_server(&data, &args, &client);
    let (status, _) = client.call_until_answered("GET", "/v1/volumes/ws");
    assert_eq!(status, 200);
    let read = api(&client).call_bytes("GET", "/v1/volumes/ws/files?path=/data", &[], None).unwrap();
    assert_eq!((read.status, read.body), (200, b"old".to_vec()), "the old file, whole");
    wait_until("the cut-off write's staging file to go", PATIENCE, || !staged());
    assert_eq!(names_in(&on_disk), ["data"]);

    // Snapshots taken one after another while the server is killed.
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(Mutex::new(Vec::<String>::new()));
    let snapshotter = {
        let (client, stop, answered) = (client.clone(), stop.clone(), answered.clone());
        std::thread::spawn(move || {
            for n in 0..200 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let name = format!("s{n}");
                match client.call("POST", "/v1/volumes/ws/snapshots", Some(json!({"name": name}))) {
                    Some((201, _)) => answered.lock().unwrap().push(name),
                    Some(_) => {}
                    None => break,
                }
            }
        })
    };
    wait_until("a few snapshots to be answered", PATIENCE, || answered.lock().unwrap().len() >= 3);
    kill_server(&server);
    stop.store(true, Ordering::SeqCst);
    snapshotter.join().unwrap();
    server = restart_server(&data, &args, &client);
    let (status, listed) = client.call_until_answered("GET", "/v1/volumes/ws/snapshots");
    assert_eq!(status, 200, "{listed}");
    let listed: Vec<String> =
        listed["snapshots"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap().to_string()).collect();
    eprintln!("snapshots answered before the kill: {}, kept: {}", answered.lock().unwrap().len(), listed.len());
    for name in answered.lock().unwrap().iter() {
        assert!(listed.contains(name), "snapshot {name} was answered, and is kept: {listed:?}");
    }
    // What is on disk is what is listed: a snapshot cut short was swept.
    let mut expected = listed.clone();
    expected.sort();
    assert_eq!(names_in(&on_disk.with_file_name("snapshots")), expected);
    // Each holds the volume as it was.
    for name in &listed {
        let from = json!({"name": format!("from-{name}"), "from_snapshot": {"volume": "ws", "snapshot": name}});
        let (status, made) = client.call("POST", "/v1/volumes", Some(from)).unwrap();
        assert_eq!(status, 201, "{made}");
        let read =
            api(&client).call_bytes("GET", &format!("/v1/volumes/from-{name}/files?path=/data"), &[], None).unwrap();
        assert_eq!((read.status, read.body), (200, b"old".to_vec()), "snapshot {name}");
        client.call("DELETE", &format!("/v1/volumes/from-{name}"), None).unwrap();
    }
    assert_eq!(processes_mentioning("volume-files-child"), 0, "no files child outlived its request");
    common::stop(server);
}
