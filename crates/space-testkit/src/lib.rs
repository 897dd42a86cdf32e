//! Fixtures for tests that run real sandboxes.
//!
//! `scripts/test.sh` prepares a shared data dir (`SPACE_TEST_DATA_DIR`,
//! default `/var/lib/space-test`) with `space setup`, which puts it on btrfs
//! and builds the `base` template, and builds the static agent
//! (`SPACE_AGENT_BIN`). Each test then gets its own scratch data dir inside
//! it, with a snapshot of `base`, so tests never share sandboxes or state.
//! Nothing here skips: a missing fixture is a loud failure naming the fix
//! (Debian's `docker-registry` and `skopeo` for [`registry`], which the
//! test command installs).
//! What a killed test leaves is swept by the tests after it ([`leftovers`]).

mod bounded;
pub mod images;
pub mod leftovers;
pub mod oci_layout;
pub mod registry;

use std::path::{Path, PathBuf};

use space_host::datadir::DataDir;
use space_host::template::BASE_TEMPLATE;

pub use crate::bounded::{http, output_within, run_within, within};

const DEFAULT_SHARED: &str = "/var/lib/space-test";

/// The shared test data dir prepared by `space setup`.
pub fn shared_data_dir() -> PathBuf {
    std::env::var_os("SPACE_TEST_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(DEFAULT_SHARED))
}

/// The static agent binary.
pub fn agent_bin() -> PathBuf {
    let path = std::env::var_os("SPACE_AGENT_BIN").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/x86_64-unknown-linux-gnu/release/space-agent")
    });
    assert!(
        path.is_file(),
        "the static agent {} is missing: run scripts/test.sh (it builds it) or set SPACE_AGENT_BIN",
        path.display()
    );
    path
}

/// The `space` binary (`SPACE_BIN`, else the one `cargo build -p
/// space-cli` left beside this test binary's `deps/`): the platform a test
/// runs in process starts it again as its confined image importer.
pub fn space_bin() -> PathBuf {
    let path = std::env::var_os("SPACE_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let test_binary = std::env::current_exe().expect("this test binary's path");
        // target/<profile>/deps/<test> → target/<profile>/space
        test_binary.parent().and_then(Path::parent).map(|profile| profile.join("space")).unwrap_or_default()
    });
    assert!(
        path.is_file(),
        "the space binary {} is missing: run scripts/test.sh or `cargo build -p space-cli` (or set SPACE_BIN)",
        path.display()
    );
    path
}

/// A statically linked busybox from Debian's `busybox-static` package
/// (downloaded and unpacked once into the shared data dir), for images
/// built in tests: it runs in any root without libraries.
pub fn busybox_static() -> PathBuf {
    let dir = shared_data_dir().join("fixtures");
    let bin = dir.join("busybox");
    if bin.is_file() {
        return bin;
    }
    let work = dir.join(format!(".busybox-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("creating the fixtures dir");
    run_within(std::process::Command::new("apt-get").args(["download", "busybox-static"]).current_dir(&work), PATIENCE)
        .unwrap_or_else(|e| panic!("downloading Debian's busybox-static ({e}): is apt configured?"));
    let deb = std::fs::read_dir(&work)
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .expect("apt-get download left no .deb");
    run_within(std::process::Command::new("dpkg-deb").arg("-x").arg(&deb).arg(work.join("x")), PATIENCE)
        .expect("unpacking busybox-static");
    // Another test process may have won the race; either copy is the same.
    std::fs::rename(work.join("x/bin/busybox"), &bin).expect("placing busybox");
    let _ = std::fs::remove_dir_all(&work);
    bin
}

/// How many processes on the host have `text` in their command line (a
/// sandbox id shows up in its runsc sandbox and gofer processes).
pub fn processes_mentioning(text: &str) -> usize {
    processes_matching(text).len()
}

/// The pids of processes with `text` in their command line.
pub fn processes_matching(text: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("reading /proc")
        .filter_map(|e| {
            let entry = e.ok()?;
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline).contains(text).then_some(pid)
        })
        .collect()
}

/// An isolated data dir holding a snapshot of the shared `base` template.
/// Removed (with every subvolume in it) on drop.
pub struct TestDataDir {
    pub data: DataDir,
}

impl TestDataDir {
    pub fn new() -> TestDataDir {
        TestDataDir::with_templates(&[BASE_TEMPLATE])
    }

    /// A scratch data dir with snapshots of these shared templates (built
    /// by `space setup`; the test command asks it for `polyglot` too).
    pub fn with_templates(templates: &[&str]) -> TestDataDir {
        leftovers::sweep(false);
        TestDataDir::made_for(&leftovers::owner_tag(), templates)
    }

    /// A scratch data dir named as made by process `pid` (which must be
    /// running): swept once it is gone. Dropped, it is removed all the same.
    pub fn made_by(pid: u32) -> TestDataDir {
        let owner = leftovers::owner_tag_of(pid as i32).expect("the maker runs");
        TestDataDir::made_for(&owner, &[BASE_TEMPLATE])
    }

    fn made_for(owner: &str, templates: &[&str]) -> TestDataDir {
        let shared = DataDir::open(&shared_data_dir()).unwrap_or_else(|e| {
            panic!("the shared test data dir is not ready ({e}): run scripts/test.sh, which runs `space setup` on it")
        });
        let mut suffix = [0u8; 6];
        getrandom::getrandom(&mut suffix).expect("getrandom");
        let name: String = suffix.iter().map(|b| format!("{b:02x}")).collect();
        let data = shared
            .scratch(&format!("test-{name}"), templates)
            .unwrap_or_else(|e| panic!("making a test data dir ({e}): run scripts/test.sh"));
        leftovers::mark_owner(data.root(), owner);
        TestDataDir { data }
    }

    pub fn root(&self) -> &Path {
        self.data.root()
    }

    /// Commits the filesystem's transaction, so btrfs's quota counts are
    /// current. `syncfs` also reports writeback errors of anyone on the
    /// shared test filesystem (another test's sandbox writing past its
    /// quota gets ENOSPC): those are not this test's, and the commit is
    /// made either way.
    pub fn sync(&self) {
        if let Ok(dir) = std::fs::File::open(self.root()) {
            let _ = nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir));
        }
    }
}

impl Default for TestDataDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestDataDir {
    fn drop(&mut self) {
        // A test that failed half way leaves its sandboxes running (and,
        // running, holding memory and CPU under every later test).
        leftovers::remove_data_dir(self.data.root());
    }
}

/// The cgroup directories (v1 controllers' and v2) of sandbox `id` that
/// exist: the engine's `space/<id>`.
pub fn sandbox_cgroups(id: &str) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten().map(|c| c.path()).collect();
    roots.push(PathBuf::from("/sys/fs/cgroup"));
    roots.into_iter().map(|root| root.join("space").join(id)).filter(|dir| dir.is_dir()).collect()
}

/// How long tests wait for a condition that should come soon: long enough
/// for a loaded 2-core machine, short enough that a real hang fails.
pub const PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Polls `check` until it returns `Some`, or panics naming `what` once
/// `patience` has passed. Tests wait for conditions, never for fixed sleeps.
pub fn wait_for<T>(what: &str, patience: std::time::Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + patience;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(std::time::Instant::now() < deadline, "waited {patience:?} for {what}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Like [`wait_for`] for a plain condition.
pub fn wait_until(what: &str, patience: std::time::Duration, mut check: impl FnMut() -> bool) {
    wait_for(what, patience, || check().then_some(()))
}

/// A throwaway PostgreSQL cluster (see `space_host::postgres`); the test
/// command installs Debian's `postgresql`, so a missing one is a failure.
pub struct PgCluster {
    _cluster: space_host::postgres::Throwaway,
    /// `postgres://space@127.0.0.1:PORT/postgres`
    pub url: String,
}

impl PgCluster {
    pub fn start() -> PgCluster {
        let cluster =
            space_host::postgres::Throwaway::start().unwrap_or_else(|e| panic!("a throwaway PostgreSQL: {e}"));
        PgCluster { url: cluster.url.clone(), _cluster: cluster }
    }
}

impl PgCluster {
    /// In `netns`, on `address`, also taking clients from `clients` (CIDR).
    pub fn start_in(netns: &NetNs, address: &str, clients: &str) -> PgCluster {
        let cluster = space_host::postgres::Throwaway::start_in(Some(&netns.name), address, Some(clients))
            .unwrap_or_else(|e| panic!("a throwaway PostgreSQL: {e}"));
        PgCluster { url: cluster.url.clone(), _cluster: cluster }
    }
}

/// A network namespace a test makes (`ip netns add`), with its loopback up;
/// deleted (with its links) when dropped. Its processes are started through
/// `nsenter --net=…` ([`NetNs::command`]).
pub struct NetNs {
    pub name: String,
}

fn ip(args: &[&str]) {
    run_within(std::process::Command::new("ip").args(args), PATIENCE).unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
}

impl NetNs {
    pub fn new(role: &str) -> NetNs {
        assert!(!role.contains('-'), "a namespace's role has no dash (the sweep reads the name): {role}");
        let mut suffix = [0u8; 3];
        getrandom::getrandom(&mut suffix).unwrap();
        // Named for this process, so that one killed leaves it to be swept.
        let (owner, suffix) = (leftovers::owner_tag(), suffix.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let name = format!("sp-{role}-{owner}-{suffix}");
        ip(&["netns", "add", &name]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        NetNs { name }
    }

    /// Joins `here` (or the test's own namespace, `None`) to `other` with a
    /// veth pair: `address` on this side, `other_address` there (CIDR each).
    pub fn link(here: Option<&NetNs>, address: &str, other: &NetNs, other_address: &str) {
        let mut tag = [0u8; 3];
        getrandom::getrandom(&mut tag).unwrap();
        let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        let (a, b) = (format!("va{tag}"), format!("vb{tag}"));
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
        ip(&["link", "set", &b, "netns", &other.name]);
        ip(&["-n", &other.name, "addr", "add", other_address, "dev", &b]);
        ip(&["-n", &other.name, "link", "set", &b, "up"]);
        match here {
            Some(here) => {
                ip(&["link", "set", &a, "netns", &here.name]);
                ip(&["-n", &here.name, "addr", "add", address, "dev", &a]);
                ip(&["-n", &here.name, "link", "set", &a, "up"]);
            }
            None => {
                ip(&["addr", "add", address, "dev", &a]);
                ip(&["link", "set", &a, "up"]);
            }
        }
    }

    /// Sends what has no nearer route through `gateway`.
    pub fn route_via(&self, gateway: &str) {
        ip(&["-n", &self.name, "route", "add", "default", "via", gateway]);
    }

    /// Forwards packets between its links (a router between namespaces).
    pub fn forward(&self) {
        let mut command = self.command("sysctl");
        run_within(command.args(["-q", "-w", "net.ipv4.ip_forward=1"]), PATIENCE).expect("turning forwarding on");
    }

    /// Gives the namespace one more address (CIDR) on its loopback device.
    pub fn add_address(&self, address: &str) {
        ip(&["-n", &self.name, "addr", "add", address, "dev", "lo"]);
    }

    /// A TCP listener in this namespace, bound to `address` (a thread
    /// enters the namespace to make it; the socket stays there).
    pub fn bind(&self, address: &str) -> std::net::TcpListener {
        let (path, address) = (format!("/run/netns/{}", self.name), address.to_string());
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("entering the namespace");
            std::net::TcpListener::bind(&address).unwrap_or_else(|e| panic!("binding {address}: {e}"))
        })
        .join()
        .expect("the thread that binds")
    }

    /// `program` run in this namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
        let mut command = std::process::Command::new("nsenter");
        command.arg(format!("--net=/run/netns/{}", self.name)).arg(program);
        command
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = run_within(std::process::Command::new("ip").args(["netns", "del", &self.name]), PATIENCE);
    }
}

/// A certificate authority of a test's own (its certificate written to
/// `file`), and certificates it signs: for the "internet" a test stands up,
/// or a cluster's members.
pub struct TestCa {
    key: rcgen::KeyPair,
    ca: rcgen::Certificate,
    pub file: std::path::PathBuf,
}

impl TestCa {
    pub fn new(dir: &std::path::Path, name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let ca = params.self_signed(&key).unwrap();
        let file = dir.join(format!("{name}.pem"));
        std::fs::write(&file, ca.pem()).unwrap();
        TestCa { key, ca, file }
    }

    /// A certificate for `names` (host names or IP addresses) and its key,
    /// both PEM.
    pub fn issue(&self, names: &[String]) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(names.to_vec()).unwrap().signed_by(&key, &self.ca, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A TLS server's configuration with a certificate for `names`.
    pub fn server(&self, names: &[String]) -> std::sync::Arc<tokio_rustls::rustls::ServerConfig> {
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        let (cert, key) = self.issue(names);
        let chain = rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        std::sync::Arc::new(
            rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(vec![chain], key)
                .unwrap(),
        )
    }
}
