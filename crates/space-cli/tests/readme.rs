//! The README's five-minute tour runs as written: its curl, CLI and Python
//! SDK blocks, read from README.md itself, against a dev server of the
//! test's own. A README that shows a field, a route or a call that is not
//! (or no longer) there fails here, not on a newcomer's first try.

use std::process::Command;
use std::time::Duration;

use space_testkit::{output_within, TestDataDir, PATIENCE};

mod common;

use common::{stop, SPACE};

/// How long one block of the tour may take: several creates, a fork, a
/// suspend and a resume on a loaded host.
const TOUR_PATIENCE: Duration = Duration::from_secs(150);

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The first fenced block of `lang` under the README's heading `heading`.
fn block(heading: &str, lang: &str) -> String {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let section =
        readme.split_once(&format!("\n{heading}\n")).unwrap_or_else(|| panic!("no {heading:?} in README.md")).1;
    let fenced =
        section.split_once(&format!("```{lang}\n")).unwrap_or_else(|| panic!("no {lang} block under {heading:?}")).1;
    fenced.split_once("\n```").unwrap().0.to_string()
}

/// Runs `script` with bash (stopping at the first failure) in a scratch
/// directory, `space` under test first on PATH and the server in the
/// environment; returns stdout, or fails with what it said.
fn bash(data: &TestDataDir, url: &str, key: &str, script: &str) -> String {
    let work = data.root().join("tour");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("notes.txt"), "notes\n").unwrap();
    let bin = std::path::Path::new(SPACE).parent().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let ran = output_within(
        Command::new("bash")
            .args(["-euo", "pipefail", "-c", script])
            .current_dir(&work)
            .env("PATH", path)
            .env("SPACE_URL", url)
            .env("SPACE_API_KEY", key),
        TOUR_PATIENCE,
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
    assert!(
        ran.status.success(),
        "the tour's block failed ({:?}):\n{script}\nstdout: {stdout}\nstderr: {stderr}",
        ran.status
    );
    stdout.into_owned()
}

fn dev_server(data: &TestDataDir) -> (space_process::ReapedChild, String, String) {
    let (server, url, _, lines) = common::spawn_server(data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop)); // keep the pipe drained
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    (server, url, key)
}

#[test]
fn the_readme_tour_with_curl_runs() {
    let data = TestDataDir::new();
    let (server, url, key) = dev_server(&data);
    // Its first line reads the key of the server on the default address
    // with sudo; here the environment already names this test's server.
    let script: String = block("### With curl", "sh")
        .lines()
        .filter(|l| !l.starts_with("export SPACE_URL="))
        .collect::<Vec<_>>()
        .join("\n");
    let out = bash(&data, &url, &key, &script);
    assert_eq!(out.matches("succeeded").count(), 2, "the create and the fork succeed: {out}");
    assert!(out.contains("\"exit\": 0"), "the command ran: {out}");
    assert_eq!(out.lines().filter(|l| *l == "42").count(), 2, "the file is read back, and the fork has it: {out}");
    assert!(out.trim_end().ends_with(|c: char| c.is_ascii_hexdigit()), "a delete operation's id last: {out}");
    stop(server);
}

#[test]
fn the_readme_tour_with_the_cli_runs() {
    let data = TestDataDir::new();
    let (server, url, key) = dev_server(&data);
    // `space exec -it` wants a terminal, which a test has not: cli.rs
    // drives it over a pseudo-terminal.
    let script: String =
        block("### With the CLI", "sh").lines().filter(|l| !l.contains(" exec -it ")).collect::<Vec<_>>().join("\n");
    let out = bash(&data, &url, &key, &script);
    assert_eq!(
        out.lines().filter(|l| *l == "42").count(),
        2,
        "python's answer, then the fork's copy of the file: {out}"
    );
    let copied = std::fs::read_to_string(data.root().join("tour/answer")).unwrap();
    assert_eq!(copied, "42\n", "space cp brought the file out");
    stop(server);
}

#[test]
fn the_readme_tour_with_the_python_sdk_runs() {
    let data = TestDataDir::new();
    let venv = data.root().join("venv");
    let made = output_within(Command::new("python3").args(["-m", "venv"]).arg(&venv), PATIENCE);
    assert!(made.status.success(), "python3 -m venv: {}", String::from_utf8_lossy(&made.stderr));
    let pip = output_within(
        Command::new(venv.join("bin/pip")).args(["install", "-q"]).arg(repo().join("sdk/python")),
        common::PIP_PATIENCE,
    );
    assert!(pip.status.success(), "pip install ./sdk/python: {}", String::from_utf8_lossy(&pip.stderr));
    let (server, url, key) = dev_server(&data);
    let ran = output_within(
        Command::new(venv.join("bin/python"))
            .args(["-c", &block("### With the Python SDK", "python")])
            .env("SPACE_URL", &url)
            .env("SPACE_API_KEY", &key),
        TOUR_PATIENCE,
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
    assert!(ran.status.success(), "the tour's Python failed: {stdout}\n{stderr}");
    assert_eq!(stdout.lines().filter(|l| *l == "42").count(), 2, "python's answer, the fork's copy: {stdout}");
    assert!(stdout.contains("b'42\\n'"), "the file read back: {stdout}");
    stop(server);
}

/// The fenced blocks of the README's section `heading` (up to the next
/// `## `), in order, each with its language.
fn section_blocks(heading: &str) -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let section =
        readme.split_once(&format!("\n{heading}\n")).unwrap_or_else(|| panic!("no {heading:?} in README.md")).1;
    let section = section.split("\n## ").next().unwrap();
    section
        .split("\n```")
        .collect::<Vec<_>>()
        .chunks(2)
        .filter_map(|pair| pair.get(1))
        .filter_map(|block| block.split_once('\n'))
        .map(|(lang, body)| (lang.to_string(), body.to_string()))
        .collect()
}

#[test]
fn the_readme_volumes_with_curl_the_cli_and_the_python_sdk_run() {
    let data = TestDataDir::new();
    let blocks = section_blocks("## Volumes");
    let langs: Vec<&str> = blocks.iter().map(|(lang, _)| lang.as_str()).collect();
    assert_eq!(langs, ["sh", "sh", "python"], "curl, the CLI, the SDK");
    let venv = data.root().join("venv");
    let made = output_within(Command::new("python3").args(["-m", "venv"]).arg(&venv), PATIENCE);
    assert!(made.status.success(), "python3 -m venv: {}", String::from_utf8_lossy(&made.stderr));
    let pip = output_within(
        Command::new(venv.join("bin/pip")).args(["install", "-q"]).arg(repo().join("sdk/python")),
        common::PIP_PATIENCE,
    );
    assert!(pip.status.success(), "pip install ./sdk/python: {}", String::from_utf8_lossy(&pip.stderr));
    let (server, url, key) = dev_server(&data);

    let out = bash(&data, &url, &key, &blocks[0].1);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"ws"), "{out}");
    assert_eq!(lines.iter().filter(|l| **l == "succeeded").count(), 2, "the create and the delete: {out}");
    assert!(lines.contains(&"SEEDED"), "the sandbox's write, read after it is gone: {out}");
    assert_eq!(lines.last(), Some(&"204"), "{out}");

    bash(&data, &url, &key, &blocks[1].1);
    let count = std::fs::read_to_string(data.root().join("tour/count")).unwrap();
    assert_eq!(count, "1\n", "the line count the sandbox wrote, fetched after it is gone");

    let ran = output_within(
        Command::new(venv.join("bin/python"))
            .args(["-c", &blocks[2].1])
            .env("SPACE_URL", &url)
            .env("SPACE_API_KEY", &key),
        TOUR_PATIENCE,
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
    assert!(ran.status.success(), "the volumes' Python failed: {stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "b'kds eht morf'");
    stop(server);
}
