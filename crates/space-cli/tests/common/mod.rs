//! Shared by the `space` binary's tests: starting `space serve`.

use std::io::{BufRead, BufReader, Lines};
use std::process::{ChildStderr, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use space_process::{ReapedChild, Reaper};

#[allow(dead_code)] // not every test binary runs a cluster
pub mod cluster;
use space_testkit::{agent_bin, output_within, TestDataDir, PATIENCE};

pub const SPACE: &str = env!("CARGO_BIN_EXE_space");

/// Starts `space serve ARGS` over `data` as SPACE runs in production: a
/// root `space helper` (one per data dir, kept for the test's life, so a
/// restarted server finds it) and the server confined beside it as the
/// test user ([`TEST_USER`]); returns the server, its URL, what it said
/// before it did, and the rest of what it says (the caller must drain it).
#[allow(dead_code)] // not every test binary uses it
pub fn spawn_server(
    data: &TestDataDir,
    args: &[&str],
) -> (ReapedChild, String, Vec<String>, Lines<BufReader<ChildStderr>>) {
    if args.contains(&"--helper-socket") {
        // The test runs a helper of its own.
        return spawn_in(data, "serve", args);
    }
    let split = split_args(data);
    let mut args: Vec<&str> = args.to_vec();
    args.extend(split.iter().map(String::as_str));
    spawn_in(data, "serve", &args)
}

/// What makes a server (or a node) of `data` run as the split: the socket
/// of a helper serving `data` (started on first use, kept for the test's
/// life) and the user it confines itself as.
pub fn split_args(data: &TestDataDir) -> Vec<String> {
    let socket = helper_for(data);
    let socket = socket.to_str().expect("a socket path in UTF-8").to_string();
    vec!["--helper-socket".into(), socket, "--user".into(), TEST_USER.into()]
}

/// The user a confined test server runs as.
pub const TEST_USER: &str = "space-test";

/// [`TEST_USER`]'s uid and gid; made if this host lacks it.
#[allow(dead_code)] // not every test binary uses it
pub fn test_user() -> (u32, u32) {
    let found = || nix::unistd::User::from_name(TEST_USER).expect("reading the user database");
    let deadline = std::time::Instant::now() + PATIENCE;
    while found().is_none() {
        let made = output_within(
            Command::new("useradd")
                .args(["--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"])
                .args(["--shell", "/usr/sbin/nologin", TEST_USER]),
            PATIENCE,
        );
        // 9: another test made it first; 10: another holds the lock.
        match made.status {
            space_process::ExitStatus::Exited(0 | 9) => break,
            space_process::ExitStatus::Exited(10) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            _ => panic!("useradd {TEST_USER}: {made:?}"),
        }
    }
    let user = found().expect("the test user exists");
    (user.uid.as_raw(), user.gid.as_raw())
}

/// The socket of the helper serving `data` (started on first use).
fn helper_for(data: &TestDataDir) -> std::path::PathBuf {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static HELPERS: OnceLock<Mutex<HashMap<std::path::PathBuf, ReapedChild>>> = OnceLock::new();
    let socket = data.root().join("run").join("helper.sock");
    let mut helpers = HELPERS.get_or_init(Default::default).lock().unwrap();
    if helpers.get(data.root()).is_some_and(|helper| helper.wait_timeout(Duration::ZERO).is_none()) {
        return socket;
    }
    let (uid, _) = test_user();
    let _ = std::fs::remove_file(&socket);
    helpers.insert(data.root().to_path_buf(), spawn_helper(data, &socket, uid));
    socket
}

/// `space helper` over `data`, serving `uid` on `socket` (it dies with the
/// test), once it listens.
#[allow(dead_code)] // not every test binary uses it
pub fn spawn_helper(data: &TestDataDir, socket: &std::path::Path, uid: u32) -> ReapedChild {
    spawn_helper_with(Command::new(SPACE), data, socket, uid)
}

/// [`spawn_helper`] from `command` (`SPACE`, its environment as the test
/// wants it).
#[allow(dead_code)] // not every test binary uses it
pub fn spawn_helper_with(mut command: Command, data: &TestDataDir, socket: &std::path::Path, uid: u32) -> ReapedChild {
    command
        .args(["helper", "--data-dir"])
        .arg(data.root())
        .arg("--socket")
        .arg(socket)
        .args(["--allow-uid", &uid.to_string(), "--agent-bin"])
        .arg(agent_bin())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    die_with_test(&mut command);
    let helper = Reaper::global().spawn(&mut command).expect("starting space helper");
    let ended = std::cell::Cell::new(false);
    space_testkit::wait_until("the helper's socket", PATIENCE, || {
        ended.set(helper.wait_timeout(Duration::ZERO).is_some());
        socket.exists() || ended.get()
    });
    assert!(!ended.get(), "space helper ended before it served");
    helper
}

/// A child that dies with the test: one that panics before it stops its
/// processes must not leave them running.
fn die_with_test(command: &mut Command) {
    // SAFETY: between fork and exec this only calls prctl, which is
    // async-signal-safe and allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(command, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// [`spawn_server`] for another subcommand that serves (`space node`).
pub fn spawn_in(
    data: &TestDataDir,
    subcommand: &str,
    args: &[&str],
) -> (ReapedChild, String, Vec<String>, Lines<BufReader<ChildStderr>>) {
    spawn_command(Command::new(SPACE), data, subcommand, args)
}

/// [`spawn_in`] through `command` (`SPACE` itself, or `nsenter … SPACE`).
pub fn spawn_command(
    mut command: Command,
    data: &TestDataDir,
    subcommand: &str,
    args: &[&str],
) -> (ReapedChild, String, Vec<String>, Lines<BufReader<ChildStderr>>) {
    command
        .arg(subcommand)
        .args(args)
        .arg("--data-dir")
        .arg(data.root())
        .arg("--agent-bin")
        .arg(agent_bin())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    die_with_test(&mut command);
    let mut child = Reaper::global().spawn(&mut command).unwrap();
    let mut lines = BufReader::new(child.child.stderr.take().unwrap()).lines();
    // A server that neither says where it listens nor exits is killed once
    // patience is out, which ends its stderr and so the wait below.
    let (listening, too_late) = (std::sync::mpsc::channel::<()>(), Arc::new(AtomicBool::new(false)));
    let (pid, late) = (child.id() as i32, too_late.clone());
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = listening.1.recv_timeout(PATIENCE * 2) {
            late.store(true, Ordering::SeqCst);
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    });
    let mut seen = Vec::new();
    let url = loop {
        let Some(line) = lines.next().and_then(Result::ok) else {
            let late = too_late.load(Ordering::SeqCst);
            let why = if late { "did not say where it listens within its patience (killed)" } else { "exited" };
            panic!("`space {subcommand}` {why}: {seen:?}");
        };
        if let Some(at) = line.find("http://").or_else(|| line.find("https://")) {
            // A text line ends with the address; a JSON one quotes it.
            break line[at..].split(['"', ' ']).next().unwrap_or_default().trim().to_string();
        }
        seen.push(line);
    };
    let _ = listening.0.send(());
    (child, url, seen, lines)
}

/// Stops a server with SIGTERM; it must exit cleanly within 20 s.
#[allow(dead_code)] // not every test binary uses it
pub fn stop(child: ReapedChild) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = child.wait_timeout(std::time::Duration::from_secs(20)).expect("the server stops on SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// How long installing packages from PyPI may take (a slow mirror, a
/// package built from source). This and the next stay under the test
/// runner's watchdog (3 minutes, .config/nextest.toml), so that a stuck
/// install or suite fails saying which.
pub const PIP_PATIENCE: Duration = Duration::from_secs(120);

/// How long a suite of Python tests against a server may take.
pub const SUITE_PATIENCE: Duration = Duration::from_secs(150);

/// A fresh Python venv under the test's data dir with `packages` installed
/// from PyPI; returns its directory.
#[allow(dead_code)] // not every test binary uses it
pub fn python_venv(data: &TestDataDir, name: &str, packages: &[&str]) -> std::path::PathBuf {
    let venv = data.root().join(name);
    let made = output_within(Command::new("python3").args(["-m", "venv"]).arg(&venv), PATIENCE);
    assert!(made.status.success(), "python3 -m venv: {}", String::from_utf8_lossy(&made.stderr));
    let pip = output_within(Command::new(venv.join("bin/pip")).args(["install", "-q"]).args(packages), PIP_PATIENCE);
    assert!(pip.status.success(), "pip install {packages:?}: {}", String::from_utf8_lossy(&pip.stderr));
    venv
}

#[allow(dead_code)] // not every test binary uses it
/// Runs the unmodified `e2b` SDK's suite (`tests/e2b/test_e2b_sdk.py`, the
/// SDK from PyPI in a venv under `data`) against the server at `url`, with
/// E2B's own environment variables only; `other_key` is another tenant's.
pub fn run_e2b_suite(data: &TestDataDir, url: &str, key: &str, other_key: &str) {
    run_e2b_tests(data, "e2b-venv", &["e2b>=2.63,<3"], "test_e2b_sdk", url, key, other_key);
}

#[allow(dead_code)] // not every test binary uses it
/// [`run_e2b_suite`] through a cluster's control plane, which does not
/// serve what only a node can (signed file URLs, whose path names no
/// sandbox to place them by).
pub fn run_e2b_suite_through_a_control_plane(data: &TestDataDir, url: &str, key: &str, other_key: &str) {
    let env = [("SPACE_THROUGH_CONTROL_PLANE", "1")];
    run_e2b_tests_with(data, "e2b-venv", &["e2b>=2.63,<3"], "test_e2b_sdk", url, key, other_key, &env);
}

#[allow(dead_code)] // not every test binary uses it
/// Runs `tests/e2b/<module>.py` with `packages` (E2B's SDKs, from PyPI) in a
/// venv under `data`, against the server at `url`, configured with E2B's
/// own environment variables only.
pub fn run_e2b_tests(
    data: &TestDataDir,
    venv: &str,
    packages: &[&str],
    module: &str,
    url: &str,
    key: &str,
    other_key: &str,
) {
    run_e2b_tests_with(data, venv, packages, module, url, key, other_key, &[]);
}

#[allow(dead_code)] // not every test binary uses it
#[allow(clippy::too_many_arguments)]
/// [`run_e2b_tests`] with more environment variables for the module.
pub fn run_e2b_tests_with(
    data: &TestDataDir,
    venv: &str,
    packages: &[&str],
    module: &str,
    url: &str,
    key: &str,
    other_key: &str,
    env: &[(&str, &str)],
) {
    let venv = python_venv(data, venv, packages);
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b");
    let mut run = Command::new(venv.join("bin/python"));
    run.args(["-m", "unittest", "-v", module])
        .current_dir(&tests)
        .env("E2B_API_URL", format!("{url}/e2b"))
        .env("E2B_SANDBOX_URL", format!("{url}/e2b/envd"))
        .env("E2B_API_KEY", key)
        .env("SPACE_OTHER_KEY", other_key)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .envs(env.iter().copied());
    let ran = output_within(&mut run, SUITE_PATIENCE);
    let report = String::from_utf8_lossy(&ran.stderr);
    eprintln!("{report}");
    assert!(ran.status.success() && report.contains("\nOK"), "the e2b SDK's tests failed: {report}");
}

#[allow(dead_code)] // not every test binary uses it
/// A one-layer image: busybox as /bin/sh, a file, and a working directory.
pub fn busybox_image(dir: &std::path::Path) -> std::path::PathBuf {
    let layer_path = dir.join("layer.tar");
    let mut layer = tar::Builder::new(std::fs::File::create(&layer_path).unwrap());
    let mut add = |path: &str, kind: tar::EntryType, mode: u32, content: &[u8], link: Option<&str>| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(content.len() as u64);
        match link {
            Some(target) => layer.append_link(&mut header, path, target).unwrap(),
            None => layer.append_data(&mut header, path, content).unwrap(),
        }
    };
    add("bin", tar::EntryType::Directory, 0o755, b"", None);
    add("bin/busybox", tar::EntryType::Regular, 0o755, &std::fs::read(space_testkit::busybox_static()).unwrap(), None);
    for tool in ["sh", "cat", "pwd"] {
        add(&format!("bin/{tool}"), tar::EntryType::Symlink, 0o777, b"", Some("busybox"));
    }
    add("srv", tar::EntryType::Directory, 0o755, b"", None);
    add("srv/hello.txt", tar::EntryType::Regular, 0o644, b"from the image\n", None);
    layer.into_inner().unwrap();
    let archive = dir.join("image.tar");
    let settings =
        space_host::oci::ImageSettings { env: vec!["PATH=/bin".into()], working_dir: Some("/srv".into()), user: None };
    space_host::oci::write_archive(&archive, space_host::oci::ArchiveFormat::DockerSave, &[layer_path], &settings)
        .unwrap();
    archive
}
