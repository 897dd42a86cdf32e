//! A cluster on loopback for the `space` binary's tests: a throwaway
//! PostgreSQL, a control plane (`space serve --cluster`) and its nodes
//! (`space node`), each with its own data dir and root helper.

use std::path::{Path, PathBuf};

use space_process::ReapedChild;
use space_testkit::{PgCluster, TestDataDir};

/// A random secret in a file of `dir` (the node token, the operator's key).
pub fn write_secret(dir: &Path, name: &str) -> PathBuf {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()).unwrap();
    path
}

/// A control plane on its own PostgreSQL, serving on loopback.
pub struct ControlPlane {
    _child: ReapedChild,
    pub url: String,
    /// The file of the nodes' token, and of the operator's key.
    pub token: PathBuf,
    pub operator_key: PathBuf,
    pub data: TestDataDir,
    pub pg: PgCluster,
}

/// Starts a control plane with `extra` arguments; what it logs at WARN
/// or above is passed on to the test's output.
pub fn control_plane(extra: &[&str]) -> ControlPlane {
    let pg = PgCluster::start();
    let data = TestDataDir::new();
    let token = write_secret(data.root(), "node-token");
    let operator_key = write_secret(data.root(), "api-key");
    let mut args = vec![
        "--cluster",
        "--database",
        pg.url.as_str(),
        "--node-token-file",
        token.to_str().unwrap(),
        "--api-key-file",
        operator_key.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ];
    args.extend(extra);
    let (child, url, _, lines) = super::spawn_in(&data, "serve", &args);
    pass_on_warnings("control plane".to_string(), lines);
    ControlPlane { _child: child, url, token, operator_key, data, pg }
}

/// Node `id` over `data`, reporting to `cp`, with `extra` arguments (the
/// split's, from [`super::split_args`], or a helper's of its own).
pub fn node(data: &TestDataDir, id: &str, cp: &ControlPlane, extra: &[String]) -> ReapedChild {
    let mut args: Vec<String> =
        ["--listen", "127.0.0.1:0", "--node-id", id, "--control-plane", &cp.url].map(str::to_string).to_vec();
    args.extend(["--node-token-file".to_string(), cp.token.to_str().unwrap().to_string()]);
    args.extend(extra.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (child, _, _, lines) = super::spawn_in(data, "node", &args);
    pass_on_warnings(id.to_string(), lines);
    child
}

fn pass_on_warnings(name: String, lines: std::io::Lines<std::io::BufReader<std::process::ChildStderr>>) {
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok).filter(|l| l.contains("WARN") || l.contains("ERROR")) {
            eprintln!("[{name}] {line}");
        }
    });
}
