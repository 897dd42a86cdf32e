//! The web console in a real browser: Debian's Chromium driven over
//! WebDriver (chromedriver, through the `selenium` package from PyPI)
//! against a real `space serve` (`tests/console/drive.py`). Screenshots are
//! saved under `target/console-screenshots/`.

use std::process::Command;

use space_testkit::{output_within, TestDataDir, PATIENCE};

mod common;
use common::SPACE;

fn tenant_key(data: &TestDataDir, tenant: &str) -> String {
    let mut keys = Command::new(SPACE);
    keys.args(["keys", "create", "--tenant", tenant]).env("SPACE_DATA_DIR", data.root());
    let made = output_within(&mut keys, PATIENCE);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    String::from_utf8(made.stdout).unwrap().trim().to_string()
}

#[test]
fn the_console_works_in_a_real_browser() {
    for binary in ["/usr/bin/chromium", "/usr/bin/chromedriver"] {
        assert!(
            std::path::Path::new(binary).exists(),
            "{binary} is missing: scripts/test.sh installs Debian's chromium and chromium-driver"
        );
    }
    let data = TestDataDir::new();
    let venv = common::python_venv(&data, "console-venv", &["selenium>=4.20,<5"]);
    let (a, b) = (tenant_key(&data, "console-a"), tenant_key(&data, "console-b"));
    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let shots = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/console-screenshots");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/console/drive.py");
    let ran = output_within(
        Command::new(venv.join("bin/python"))
            .arg(script)
            .env("SPACE_URL", &url)
            .env("KEY_A", &a)
            .env("KEY_B", &b)
            .env("SCREENSHOTS", &shots)
            // Selenium must not look for a driver anywhere else.
            .env("SE_OFFLINE", "true"),
        common::SUITE_PATIENCE,
    );
    let said = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success() && said.contains("CONSOLE OK"),
        "the console in Chromium (screenshots in {}): {said} {}",
        shots.display(),
        String::from_utf8_lossy(&ran.stderr)
    );
    common::stop(server);
}
