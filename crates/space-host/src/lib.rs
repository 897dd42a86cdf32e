//! Host resources the platform builds on: the data directory (on btrfs, so
//! copies are cheap), the Debian packages the engines need, and template
//! roots built from Debian packages.
//!
//! This crate prepares and describes the host; it never starts sandboxes and
//! holds no API or state-machine logic.

pub mod btrfs;
pub mod datadir;
pub mod packages;
pub mod template;

use std::process::Command;

use space_process::Reaper;

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{0}")]
    Invalid(String),
}

impl HostError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HostError {
        let what = what.into();
        move |source| HostError::Io { what, source }
    }
}

/// Runs a host command to completion; a non-zero exit is an error carrying
/// the tail of its stderr.
pub fn run(command: &mut Command) -> Result<Vec<u8>, HostError> {
    let rendered = format!("{command:?}").replace('"', "");
    let output = Reaper::global()
        .output(command)
        .map_err(HostError::io(format!("running {rendered}")))?;
    if output.status.success() {
        return Ok(output.stdout);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(8).collect();
    Err(HostError::CommandFailed {
        command: rendered,
        status: format!("{:?}", output.status),
        stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
    })
}

/// Now, as an RFC 3339 UTC string with millisecond precision.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}
