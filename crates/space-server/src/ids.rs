//! Opaque, prefixed identifiers and timestamps.

use std::time::SystemTime;

/// A new random id such as `sbx_4f1c0a9e2b7d3c5a8e61`.
pub fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 10];
    getrandom::getrandom(&mut bytes).expect("the kernel's random source is unavailable");
    let mut id = String::with_capacity(prefix.len() + 1 + 20);
    id.push_str(prefix);
    id.push('_');
    for b in bytes {
        id.push_str(&format!("{b:02x}"));
    }
    id
}

/// Whether `id` looks like one of ours, so absurd ids are refused early.
pub fn plausible(id: &str, prefix: &str) -> bool {
    id.len() == prefix.len() + 21
        && id.starts_with(prefix)
        && id.as_bytes()[prefix.len()] == b'_'
        && id[prefix.len() + 1..].bytes().all(|b| b.is_ascii_hexdigit())
}

pub fn now() -> String {
    format_time(SystemTime::now())
}

pub fn format_time(time: SystemTime) -> String {
    humantime::format_rfc3339_millis(time).to_string()
}

/// The DNS-safe hostname of a sandbox.
pub fn hostname_for(sandbox_id: &str) -> String {
    sandbox_id.replace('_', "-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_recognised() {
        let a = new_id("sbx");
        assert!(plausible(&a, "sbx"), "{a}");
        assert_ne!(a, new_id("sbx"));
        assert!(!plausible(&a, "cmd"));
        assert!(!plausible("sbx_../../etc", "sbx"));
    }
}
