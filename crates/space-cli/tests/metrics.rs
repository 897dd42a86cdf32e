//! `GET /metrics` before and after a sandbox's create / exec / pause /
//! resume / delete, parsed with a real Prometheus text parser (the Python
//! `prometheus-client` package): counters and histograms move as they must
//! (`tests/metrics/cycle.py`).

use std::process::Command;
use std::time::Duration;

use space_api::OperationState;
use space_testkit::{http, output_within, TestDataDir};

mod common;

#[test]
fn metrics_move_with_a_sandbox_cycle() {
    let data = TestDataDir::new();
    let venv = common::python_venv(&data, "metrics-venv", &["prometheus-client>=0.20,<1"]);
    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/metrics/cycle.py");
    let ran = output_within(
        Command::new(venv.join("bin/python")).arg(script).env("SPACE_URL", &url).env("SPACE_API_KEY", &key),
        common::SUITE_PATIENCE,
    );
    let said = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success() && said.contains("METRICS OK"),
        "the metrics cycle: {said} {}",
        String::from_utf8_lossy(&ran.stderr)
    );

    // Every series the Grafana dashboard in deploy/ asks for is served (with
    // a sandbox alive, so that sandboxes by state has a series).
    let client = space_client::Client::with_agent(&url, &key, http());
    let create = space_api::CreateSandboxRequest { template: "base".into(), ..Default::default() };
    let created = client.create_sandbox(&create).unwrap();
    let done = client.wait_for_operation_within(&created.operation.id, Duration::from_secs(60)).unwrap();
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    let text = client.get_text("/metrics").unwrap();
    let served: std::collections::BTreeSet<&str> =
        text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let dashboard = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/space-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dashboard).unwrap()).unwrap();
    let mut asked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for (at, _) in expr.match_indices("space_") {
                let name: String = expr[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                assert!(served.contains(name.as_str()), "the dashboard's {name} is not in /metrics ({served:?})");
                asked += 1;
            }
        }
    }
    assert!(asked >= 10, "the dashboard asks for too little: {asked}");
    let deleted = client.delete_sandbox(&created.sandbox.id).unwrap();
    let gone = client.wait_for_operation_within(&deleted.operation.id, Duration::from_secs(60)).unwrap();
    assert_eq!(gone.state, OperationState::Succeeded, "{gone:?}");
    common::stop(server);
}
