//! The unmodified `e2b` SDK (from PyPI, pinned `>=2.63,<3`) drives a real
//! `space serve` and real sandboxes through the E2B-compatible API, set up
//! with E2B's three environment variables only (`tests/e2b/test_e2b_sdk.py`).

use std::process::Command;

use space_process::Reaper;
use space_testkit::TestDataDir;

mod common;

use common::SPACE;

#[test]
fn the_e2b_sdk_drives_space_unchanged() {
    let data = TestDataDir::new();
    let venv = common::python_venv(&data, "e2b-venv", &["e2b>=2.63,<3"]);

    // A second tenant, to check that its key sees none of the first's sandboxes.
    let mut keys = Command::new(SPACE);
    keys.args(["keys", "create", "--tenant", "e2b-other"]).env("SPACE_DATA_DIR", data.root());
    let other = Reaper::global().output(&mut keys).unwrap();
    assert!(other.status.success(), "{}", String::from_utf8_lossy(&other.stderr));
    let other_key = String::from_utf8(other.stdout).unwrap().trim().to_string();

    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(data.root().join("dev-api-key")).unwrap().trim().to_string();
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b");
    let mut run = Command::new(venv.join("bin/python"));
    run.args(["-m", "unittest", "-v", "test_e2b_sdk"])
        .current_dir(&tests)
        .env("E2B_API_URL", format!("{url}/e2b"))
        .env("E2B_SANDBOX_URL", format!("{url}/e2b/envd"))
        .env("E2B_API_KEY", &key)
        .env("SPACE_OTHER_KEY", &other_key)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let ran = Reaper::global().output(&mut run).unwrap();
    let report = String::from_utf8_lossy(&ran.stderr);
    eprintln!("{report}");
    assert!(ran.status.success() && report.contains("\nOK"), "the e2b SDK's tests failed: {report}");
    common::stop(server);
}
