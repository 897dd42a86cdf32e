//! What a node holds of its disk: the quotas it was told, transcript bytes
//! per sandbox, its defaults, and how a tree's size is counted.

pub use space_core::tenants::ToldQuota;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Free space the host keeps by default, in MiB.
pub const DEFAULT_DISK_RESERVE_MIB: u64 = 2048;
/// Output kept per sandbox by default (all its commands' transcripts).
pub const DEFAULT_MAX_SANDBOX_OUTPUT_BYTES: u64 = 1 << 30;
/// What a suspend may write beyond the sandbox's `memory_mib`: the
/// engine's own memory is in the snapshot too.
pub const SNAPSHOT_OVERHEAD_BYTES: u64 = 256 << 20;

/// Per-sandbox transcript bytes on disk, loaded when first needed.
#[derive(Default)]
pub(crate) struct OutputUse {
    pub(crate) by_sandbox: std::sync::Mutex<HashMap<String, Arc<AtomicU64>>>,
}

/// Bytes taken by regular files under `dir`, never following a link.
pub fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&entry.path()),
            Ok(t) if t.is_file() => entry.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}
