//! The unmodified `e2b` SDK (from PyPI, pinned `>=2.63,<3`) drives a real
//! `space serve` and real sandboxes through the E2B-compatible API, set up
//! with E2B's three environment variables only (`tests/e2b/test_e2b_sdk.py`),
//! and so does E2B's code interpreter SDK (`test_e2b_code_interpreter.py`);
//! the npm packages `e2b` and `@e2b/code-interpreter` do too, under Node.js
//! (`test_e2b_npm.mjs`).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
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

    // Two names the sandboxes' gateway resolves to one local server, for
    // E2B's network rules (`tests/e2b/test_e2b_control.py`).
    let upstream = upstream();
    let hosts = [format!("allowed.space.test=127.0.0.1:{upstream}"), format!("denied.space.test=127.0.0.1:{upstream}")];
    let (server, url, _, lines) = common::spawn_server(
        &data,
        &[
            "--dev",
            "--listen",
            "127.0.0.1:0",
            "--egress-host",
            &hosts[0],
            "--egress-host",
            &hosts[1],
            "--egress-allow-internal",
            "127.0.0.1/32",
        ],
    );
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    common::run_e2b_suite(&data, &url, &key, &other_key);
    // What E2B's control plane has beyond that (network rules, fork,
    // snapshots, the base's account), with the key in E2B's own shape.
    let key_file = data.root().join("dev-key-for-e2b-form");
    std::fs::write(&key_file, &key).unwrap();
    // The key on standard input (`output_within` gives the child none).
    let mut e2b_form = Command::new("sh");
    e2b_form.args(["-c", "exec \"$0\" keys e2b < \"$1\"", SPACE]).arg(&key_file);
    let e2b_form = output_within(&mut e2b_form, PATIENCE);
    assert!(e2b_form.status.success(), "{}", String::from_utf8_lossy(&e2b_form.stderr));
    let e2b_key = String::from_utf8(e2b_form.stdout).unwrap().trim().to_string();
    assert_eq!(e2b_key, space_api::e2b::e2b_key(&key));
    assert!(e2b_key.starts_with("e2b_"), "{e2b_key}");
    let packages = ["e2b>=2.63,<3"];
    let env = [("SPACE_KEY", key.as_str())];
    common::run_e2b_tests_with(&data, "e2b-venv", &packages, "test_e2b_control", &url, &e2b_key, &other_key, &env);
    // E2B's code interpreter SDK (`tests/e2b/test_e2b_code_interpreter.py`).
    let packages = ["e2b-code-interpreter>=2.11,<3"];
    common::run_e2b_tests(&data, "e2b-ci-venv", &packages, "test_e2b_code_interpreter", &url, &key, &other_key);
    common::stop(server);
}

/// A local server that answers every request with `upstream saw <request
/// line>`; its port.
fn upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                }
                let body = format!("upstream saw {}", line.trim_end());
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    port
}

/// The unmodified npm packages (`e2b`, `@e2b/code-interpreter`, from the
/// npm registry, pinned to major 2) under Node.js, configured with E2B's
/// three variables only.
#[test]
fn the_npm_e2b_packages_drive_space_unchanged() {
    let data = TestDataDir::with_templates(&[BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE]);
    let project = data.root().join("npm-e2b");
    std::fs::create_dir_all(&project).unwrap();
    let mut install = Command::new("npm");
    install
        .args(["install", "--no-audit", "--no-fund", "--loglevel=error", "e2b@^2", "@e2b/code-interpreter@^2"])
        .current_dir(&project);
    let installed = output_within(&mut install, common::PIP_PATIENCE);
    assert!(installed.status.success(), "npm install: {}", String::from_utf8_lossy(&installed.stderr));
    // Node resolves the packages from the script's own directory.
    let script = project.join("test_e2b_npm.mjs");
    std::fs::copy(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b/test_e2b_npm.mjs"), &script)
        .unwrap();

    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let mut run = Command::new("node");
    run.arg(&script)
        .current_dir(&project)
        .env("E2B_API_URL", format!("{url}/e2b"))
        .env("E2B_SANDBOX_URL", format!("{url}/e2b/envd"))
        .env("E2B_API_KEY", &key)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN");
    let ran = output_within(&mut run, common::SUITE_PATIENCE);
    let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
    assert!(ran.status.success() && stdout.contains("NPM SDK OK"), "the npm SDKs' script failed: {stdout}\n{stderr}");
    common::stop(server);
}
