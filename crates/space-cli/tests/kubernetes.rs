//! `deploy/kubernetes` checked without a cluster (none can run here):
//! strict validation against the Kubernetes schemas shipped by the
//! `kubernetes-validate` package from PyPI, each `space` command line in
//! the manifests against the binary's `--help`, and the Kind config against
//! the node DaemonSets (`tests/kubernetes/check.py`).

use std::process::Command;

use space_testkit::{output_within, TestDataDir};

mod common;

#[test]
fn the_kubernetes_manifests_validate_and_name_only_real_flags() {
    let data = TestDataDir::new();
    let venv = common::python_venv(&data, "k8s-venv", &["kubernetes-validate>=1.30,<2"]);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let ran = output_within(
        Command::new(venv.join("bin/python"))
            .arg(root.join("tests/kubernetes/check.py"))
            .env("DEPLOY", root.join("../../deploy/kubernetes"))
            .env("SPACE_BIN", common::SPACE),
        common::SUITE_PATIENCE,
    );
    let said = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success() && said.contains("KUBERNETES OK"),
        "the manifests: {said} {}",
        String::from_utf8_lossy(&ran.stderr)
    );
}
