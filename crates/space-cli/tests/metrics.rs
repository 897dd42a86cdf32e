//! `GET /metrics` before and after a sandbox's create / exec / pause /
//! resume / delete, parsed with a real Prometheus text parser (the Python
//! `prometheus-client` package): counters and histograms move as they must
//! (`tests/metrics/cycle.py`).

use std::process::Command;

use space_testkit::{http, output_within, TestDataDir};

mod common;

#[test]
fn metrics_move_with_a_sandbox_cycle() {
    let data = TestDataDir::new();
    let venv = common::python_venv(&data, "metrics-venv", &["prometheus-client>=0.20,<1"]);
    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(data.root().join("dev-api-key")).unwrap().trim().to_string();
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
    let auth = format!("Bearer {key}");
    let created: serde_json::Value = http()
        .post(&format!("{url}/v1/sandboxes"))
        .set("Authorization", &auth)
        .send_json(serde_json::json!({"template": "base"}))
        .unwrap()
        .into_json()
        .unwrap();
    let op = created["operation"]["id"].as_str().unwrap();
    let done: serde_json::Value = http()
        .get(&format!("{url}/v1/operations/{op}?wait=60"))
        .set("Authorization", &auth)
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(done["state"], "succeeded", "{done}");
    let text = http()
        .get(&format!("{url}/metrics"))
        .set("Authorization", &format!("Bearer {key}"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
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
    let sandbox = created["sandbox"]["id"].as_str().unwrap();
    let deleted: serde_json::Value = http()
        .delete(&format!("{url}/v1/sandboxes/{sandbox}"))
        .set("Authorization", &auth)
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let op = deleted["operation"]["id"].as_str().unwrap();
    let gone: serde_json::Value = http()
        .get(&format!("{url}/v1/operations/{op}?wait=60"))
        .set("Authorization", &auth)
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(gone["state"], "succeeded", "{gone}");
    common::stop(server);
}
