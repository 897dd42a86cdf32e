//! Previews in a real browser: Debian's Chromium driven over WebDriver
//! (chromedriver, through the `selenium` package from PyPI) against a real
//! `space serve --preview-domain preview.space.test`, with every
//! `*.space.test` name mapped to the server (`tests/previews/drive.py`).
//! Screenshots are saved under `target/preview-screenshots/`.

use std::process::Command;

use space_testkit::{output_within, TestDataDir, PATIENCE};

mod common;
use common::SPACE;

#[test]
fn previews_work_in_a_real_browser() {
    for binary in ["/usr/bin/chromium", "/usr/bin/chromedriver"] {
        assert!(
            std::path::Path::new(binary).exists(),
            "{binary} is missing: scripts/test.sh installs Debian's chromium and chromium-driver"
        );
    }
    let data = TestDataDir::with_templates(&["base", "polyglot"]);
    let venv = common::python_venv(&data, "previews-venv", &["selenium>=4.20,<5"]);
    let mut keys = Command::new(SPACE);
    keys.args(["keys", "create", "--tenant", "previews"]).env("SPACE_DATA_DIR", data.root());
    let made = output_within(&mut keys, PATIENCE);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let key = String::from_utf8(made.stdout).unwrap().trim().to_string();
    let (server, url, _, lines) =
        common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0", "--preview-domain", "preview.space.test"]);
    std::thread::spawn(move || lines.for_each(drop));
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let shots = manifest.join("../../target/preview-screenshots");
    let ran = output_within(
        Command::new(venv.join("bin/python"))
            .arg(manifest.join("tests/previews/drive.py"))
            .env("SPACE_URL", &url)
            .env("KEY", &key)
            .env("WEBAPP", manifest.join("../space-server/tests/common/webapp.py"))
            .env("SCREENSHOTS", &shots)
            // Selenium must not look for a driver anywhere else.
            .env("SE_OFFLINE", "true"),
        common::SUITE_PATIENCE,
    );
    let said = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success() && said.contains("PREVIEWS OK"),
        "previews in Chromium (screenshots in {}): {said} {}",
        shots.display(),
        String::from_utf8_lossy(&ran.stderr)
    );
    common::stop(server);
}
