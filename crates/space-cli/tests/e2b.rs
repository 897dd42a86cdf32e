//! The unmodified `e2b` SDK (from PyPI, pinned `>=2.63,<3`) drives a real
//! `space serve` and real sandboxes through the E2B-compatible API, set up
//! with E2B's three environment variables only (`tests/e2b/test_e2b_sdk.py`),
//! and so does E2B's code interpreter SDK (`test_e2b_code_interpreter.py`).

use std::process::Command;

use space_host::template::{BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE};
use space_testkit::{output_within, TestDataDir, PATIENCE};

mod common;

use common::SPACE;

#[test]
fn the_e2b_sdk_drives_space_unchanged() {
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE]);

    // A second tenant, to check that its key sees none of the first's sandboxes.
    let mut keys = Command::new(SPACE);
    keys.args(["keys", "create", "--tenant", "e2b-other"]).env("SPACE_DATA_DIR", data.root());
    let other = output_within(&mut keys, PATIENCE);
    assert!(other.status.success(), "{}", String::from_utf8_lossy(&other.stderr));
    let other_key = String::from_utf8(other.stdout).unwrap().trim().to_string();

    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    common::run_e2b_suite(&data, &url, &key, &other_key);
    // E2B's code interpreter SDK (`tests/e2b/test_e2b_code_interpreter.py`).
    let packages = ["e2b-code-interpreter>=2.11,<3"];
    common::run_e2b_tests(&data, "e2b-ci-venv", &packages, "test_e2b_code_interpreter", &url, &key, &other_key);
    common::stop(server);
}
