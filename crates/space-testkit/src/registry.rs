//! A real OCI Distribution registry on loopback: Debian's `docker-registry`
//! (the distribution project's registry, 2.8), with its own config and
//! storage in a temporary directory, with or without htpasswd auth. Killed
//! and reaped when dropped.
//!
//! Tests that need it skip loudly when the package is missing (the test
//! command installs it: `scripts/lib.sh`), as tests needing Firecracker do:
//! ```ignore
//! let Some(registry) = space_testkit::registry::Registry::start_or_skip("my_test", None) else { return };
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use space_process::{ReapedChild, Reaper};

use crate::PATIENCE;

/// Where Debian's `docker-registry` package puts the registry.
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";
/// The user and password the htpasswd variant accepts by default.
pub const TEST_USER: &str = "space";
pub const TEST_PASSWORD: &str = "space-test-password";
/// `TEST_USER:bcrypt(TEST_PASSWORD)` (cost 5; the registry reads only
/// bcrypt, and no bcrypt tool need be installed for the default pair).
const TEST_HTPASSWD: &str = "space:$2b$05$cWlp0dd31EhDW5QrCWa.j.lT5trQnlA8/lLiRAwm3ueLpsmyGzxLG";
/// Ports tried when another process takes the one picked first.
const PORT_ATTEMPTS: usize = 5;

/// A running registry. `host` is `127.0.0.1:PORT`.
pub struct Registry {
    pub host: String,
    /// Its config, htpasswd, log and `storage/`.
    pub dir: PathBuf,
    child: Option<ReapedChild>,
}

impl Registry {
    /// Starts a registry on a free loopback port, requiring `auth`
    /// (user, password) over HTTP Basic when given, and waits until it
    /// answers; panics, naming the fix, when it cannot (the test command
    /// installs Debian's `docker-registry`: tests never skip for it).
    pub fn start(auth: Option<(&str, &str)>) -> Registry {
        assert!(
            Path::new(REGISTRY_BIN).is_file(),
            "{REGISTRY_BIN} is missing: install Debian's docker-registry package (scripts/test.sh does)"
        );
        let dir = scratch_dir("registry");
        let htpasswd = auth.map(|(user, password)| {
            let line = if (user, password) == (TEST_USER, TEST_PASSWORD) {
                TEST_HTPASSWD.to_string()
            } else {
                format!("{user}:{}", bcrypt(password))
            };
            let path = dir.join("htpasswd");
            std::fs::write(&path, format!("{line}\n")).expect("writing htpasswd");
            path
        });
        let mut last = String::new();
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port();
            let config = dir.join("config.yml");
            std::fs::write(&config, config_yaml(&dir, port, htpasswd.as_deref())).expect("writing config.yml");
            let log = std::fs::File::create(dir.join("registry.log")).expect("creating the registry's log");
            let mut command = Command::new(REGISTRY_BIN);
            command
                .arg("serve")
                .arg(&config)
                .env_clear()
                .env("PATH", "/usr/bin:/bin")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("the log"))
                .stderr(log);
            let child = spawn_dying_with_parent(&mut command);
            let host = format!("127.0.0.1:{port}");
            match wait_ready(&host, &child) {
                Ok(()) => return Registry { host, dir, child: Some(child) },
                Err(exited) => {
                    assert!(kill_and_reap(&child), "the registry that failed to start was not reaped");
                    let said = std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default();
                    last = format!("{exited}; it said: {said}");
                    // Another process may have taken the port between the
                    // probe and the registry's bind: try another.
                    if !said.contains("address already in use") {
                        break;
                    }
                }
            }
        }
        panic!("the registry did not start: {last}");
    }

    /// The file the registry keeps blob `digest` (`sha256:…`) in, for tests
    /// that damage it after a push.
    pub fn blob_data(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self.dir.join("storage/docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            if !kill_and_reap(&child) {
                eprintln!("the registry (pid {}) was not reaped within {PATIENCE:?} of SIGKILL", child.id());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config_yaml(dir: &Path, port: u16, htpasswd: Option<&Path>) -> String {
    let mut yaml = format!(
        "version: 0.1\n\
         log:\n  level: warn\n  accesslog:\n    disabled: true\n\
         storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n\
         http:\n  addr: 127.0.0.1:{port}\n",
        storage = dir.join("storage").display()
    );
    if let Some(htpasswd) = htpasswd {
        yaml.push_str(&format!("auth:\n  htpasswd:\n    realm: space-test\n    path: {}\n", htpasswd.display()));
    }
    yaml
}

/// bcrypt of `password` by Python's `crypt` (glibc's libxcrypt), for
/// pairs other than the built-in one.
fn bcrypt(password: &str) -> String {
    let script = "import crypt, sys; print(crypt.crypt(sys.argv[1], crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=32)))";
    let out = crate::run_within(Command::new("python3").args(["-W", "ignore", "-c", script, password]), PATIENCE)
        .unwrap_or_else(|e| panic!("hashing a test password with python3's crypt: {e}"));
    let hash = String::from_utf8(out).expect("utf-8").trim().to_string();
    assert!(hash.starts_with("$2b$"), "python3's crypt gave no bcrypt hash: {hash:?}");
    hash
}

/// A port nothing listens on now (bound and released: a race the caller
/// retries).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0");
    listener.local_addr().expect("its address").port()
}

/// A new directory under the system's temp dir, named for `what`; see
/// [`ScratchDir`] for one removed when dropped.
pub fn scratch_dir(what: &str) -> PathBuf {
    let mut suffix = [0u8; 6];
    getrandom::getrandom(&mut suffix).expect("getrandom");
    let name: String = suffix.iter().map(|b| format!("{b:02x}")).collect();
    let dir = std::env::temp_dir().join(format!("space-test-{what}-{name}"));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// A [`scratch_dir`] removed with what is in it when dropped (also when
/// its test fails).
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(what: &str) -> ScratchDir {
        ScratchDir(scratch_dir(what))
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Spawns `command` through the reaper, killed by the kernel if the thread
/// that spawned it ends (a test killed half way leaves no registry behind).
fn spawn_dying_with_parent(command: &mut Command) -> ReapedChild {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only makes one
    // async-signal-safe system call (prctl).
    unsafe {
        command.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
    Reaper::global().spawn(command).unwrap_or_else(|e| panic!("starting {REGISTRY_BIN}: {e}"))
}

/// Waits until `GET /v2/` answers (200, or 401 with auth), or the child
/// ends (`Err` with how).
fn wait_ready(host: &str, child: &ReapedChild) -> Result<(), String> {
    let agent =
        ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(2)).timeout_read(Duration::from_secs(5)).build();
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(status) = child.wait_timeout(Duration::ZERO) {
            return Err(format!("it exited ({status:?})"));
        }
        match agent.get(&format!("http://{host}/v2/")).call() {
            Ok(_) | Err(ureq::Error::Status(401, _)) => return Ok(()),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("the registry on {host} did not answer GET /v2/ within {PATIENCE:?}: {e}"),
        }
    }
}

/// Whether the child was reaped within [`PATIENCE`] of SIGKILL.
fn kill_and_reap(child: &ReapedChild) -> bool {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    child.wait_timeout(PATIENCE).is_some()
}
