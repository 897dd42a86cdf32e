//! Debian packages the platform needs, installed idempotently with apt-get.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::{run, HostError};

/// Where we enable bookworm-backports (for a current `runsc`).
pub const BACKPORTS_SOURCES: &str = "/etc/apt/sources.list.d/space-bookworm-backports.sources";
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
/// runsc builds older than this lack `--overlay2=none` and break `stat` inside.
const MIN_RUNSC_VERSION: &str = "0.0~20240729";

/// A package and the suite it must come from (None: the default suites).
#[derive(Debug, Clone, Copy)]
pub struct Package {
    pub name: &'static str,
    pub backports: bool,
}

/// What `space setup` installs.
pub const REQUIRED: &[Package] = &[
    Package { name: "runsc", backports: true },
    Package { name: "btrfs-progs", backports: false },
    Package { name: "mmdebstrap", backports: false },
    Package { name: "iproute2", backports: false },
];

/// The installed version of `name`, if installed.
pub fn installed_version(name: &str) -> Option<String> {
    let out = run(Command::new("dpkg-query").args(["-W", "-f", "${Status}|${Version}", name])).ok()?;
    let text = String::from_utf8_lossy(&out);
    let (status, version) = text.split_once('|')?;
    status.ends_with(" installed").then(|| version.to_string())
}

fn version_at_least(version: &str, minimum: &str) -> bool {
    run(Command::new("dpkg").args(["--compare-versions", version, "ge", minimum])).is_ok()
}

/// The Debian mirror the host's apt is configured with.
pub fn configured_mirror() -> String {
    let mut texts = Vec::new();
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|e| e == "sources" || e == "list") {
                texts.push(fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
    }
    texts.push(fs::read_to_string("/etc/apt/sources.list").unwrap_or_default());
    texts.iter().find_map(|t| mirror_in(t)).unwrap_or_else(|| DEFAULT_MIRROR.to_string())
}

/// Finds the mirror serving bookworm in deb822 or one-line apt sources.
fn mirror_in(text: &str) -> Option<String> {
    for stanza in text.split("\n\n") {
        let field = |name: &str| stanza.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()));
        if let (Some(uris), Some(suites)) = (field("URIs:"), field("Suites:")) {
            if suites.split_whitespace().any(|s| s == "bookworm") {
                return uris.split_whitespace().next().map(str::to_string);
            }
        }
    }
    text.lines().find_map(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        (words.first() == Some(&"deb") && words.len() >= 3 && words[2] == "bookworm").then(|| words[1].to_string())
    })
}

/// Installs what is missing from [`REQUIRED`]; returns one line per action.
pub fn ensure_required(mut say: impl FnMut(&str)) -> Result<(), HostError> {
    let missing: Vec<Package> = REQUIRED
        .iter()
        .copied()
        .filter(|p| match installed_version(p.name) {
            None => true,
            Some(v) => p.name == "runsc" && !version_at_least(&v, MIN_RUNSC_VERSION),
        })
        .collect();
    if missing.is_empty() {
        say("packages: all present");
        return Ok(());
    }
    if missing.iter().any(|p| p.backports) && !Path::new(BACKPORTS_SOURCES).exists() {
        let mirror = configured_mirror();
        let sources = format!(
            "Types: deb\nURIs: {mirror}\nSuites: bookworm-backports\nComponents: main\n\
             Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        );
        fs::write(BACKPORTS_SOURCES, sources).map_err(HostError::io(format!("writing {BACKPORTS_SOURCES}")))?;
        say(&format!("packages: enabled bookworm-backports from {mirror}"));
    }
    say("packages: apt-get update");
    run(Command::new("apt-get").args(["update", "-q"]))?;
    for package in &missing {
        say(&format!("packages: installing {}", package.name));
        let mut command = Command::new("apt-get");
        command.env("DEBIAN_FRONTEND", "noninteractive").args(["install", "-y", "-q", "--no-install-recommends"]);
        if package.backports {
            command.args(["-t", "bookworm-backports"]);
        }
        run(command.arg(package.name))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_bookworm_mirror() {
        let deb822 =
            "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                      Types: deb\nURIs: http://sec.example\nSuites: bookworm-security\n";
        assert_eq!(mirror_in(deb822).as_deref(), Some("http://mirror.example/debian"));
        assert_eq!(
            mirror_in("deb http://m.example/debian bookworm main\n").as_deref(),
            Some("http://m.example/debian")
        );
        assert_eq!(mirror_in("deb http://sec.example bookworm-security main\n"), None);
    }
}
