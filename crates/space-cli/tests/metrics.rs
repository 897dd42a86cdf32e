//! `GET /metrics` before and after a sandbox's create / exec / pause /
//! resume / delete, parsed with a real Prometheus text parser (the Python
//! `prometheus-client` package): counters and histograms move as they must
//! (`tests/metrics/cycle.py`).

use std::process::Command;

use space_process::Reaper;
use space_testkit::TestDataDir;

mod common;

#[test]
fn metrics_move_with_a_sandbox_cycle() {
    let data = TestDataDir::new();
    let venv = common::python_venv(&data, "metrics-venv", &["prometheus-client>=0.20,<1"]);
    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(data.root().join("dev-api-key")).unwrap().trim().to_string();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/metrics/cycle.py");
    let ran = Reaper::global()
        .output(Command::new(venv.join("bin/python")).arg(script).env("SPACE_URL", &url).env("SPACE_API_KEY", &key))
        .unwrap();
    let said = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success() && said.contains("METRICS OK"),
        "the metrics cycle: {said} {}",
        String::from_utf8_lossy(&ran.stderr)
    );
    common::stop(server);
}
