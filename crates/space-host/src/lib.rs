//! Host resources the platform builds on: the data directory (on btrfs, so
//! copies are cheap), the Debian packages the engines need, and template
//! roots built from Debian packages.
//!
//! This crate prepares and describes the host; it never starts sandboxes and
//! holds no API or state-machine logic.

pub mod btrfs;
pub mod datadir;
pub mod download;
pub mod guest;
mod layer;
pub mod oci;
pub mod packages;
pub mod postgres;
pub mod template;
mod template_meta;

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
    CommandFailed { command: String, status: String, stderr: String },
    #[error("{0}")]
    Invalid(String),
}

impl HostError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HostError {
        let what = what.into();
        move |source| HostError::Io { what, source }
    }
}

/// Whether the CPU offers hardware virtualization (Intel VT-x or AMD-V), as
/// Firecracker needs; `kvm_pvm`'s software `/dev/kvm` does not count.
pub fn hardware_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .filter(|line| line.starts_with("flags"))
            .any(|line| line.split_whitespace().any(|flag| flag == "vmx" || flag == "svm"))
    })
}

/// Runs a host command to completion; a non-zero exit is an error carrying
/// the tail of its stderr.
pub fn run(command: &mut Command) -> Result<Vec<u8>, HostError> {
    let rendered = format!("{command:?}").replace('"', "");
    let output = Reaper::global().output(command).map_err(HostError::io(format!("running {rendered}")))?;
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

/// Whether the ELF executable at `path` is statically linked (has no
/// program interpreter). The agent must be: it runs in roots we did not build.
pub fn is_static_elf(path: &std::path::Path) -> std::io::Result<bool> {
    let bytes = std::fs::read(path)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a 64-bit little-endian ELF file");
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return Err(bad());
    }
    let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
    let phoff = u64::from_le_bytes(bytes[0x20..0x28].try_into().map_err(|_| bad())?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    for index in 0..phnum {
        let at = phoff + index * phentsize;
        let header = bytes.get(at..at + 4).ok_or_else(bad)?;
        if u32::from_le_bytes(header.try_into().map_err(|_| bad())?) == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    #[test]
    fn tells_static_from_dynamic_executables() {
        // Whatever runs this test is dynamically linked (cargo test binaries are).
        let me = std::env::current_exe().unwrap();
        assert!(!super::is_static_elf(&me).unwrap());
        assert!(super::is_static_elf(std::path::Path::new("/etc/hostname")).is_err());
    }
}
