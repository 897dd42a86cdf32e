//! Opaque, prefixed identifiers and timestamps.

use std::time::SystemTime;

pub use space_api::Timestamp;

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

/// Whether `id` is one of ours in its one canonical form (the prefix, `_`,
/// 20 lowercase hex digits, as [`new_id`] writes them), so absurd or
/// re-spelled ids are refused before any lookup.
pub fn plausible(id: &str, prefix: &str) -> bool {
    id.len() == prefix.len() + 21
        && id.starts_with(prefix)
        && id.as_bytes()[prefix.len()] == b'_'
        && id[prefix.len() + 1..].bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// The id in `text` if it is in canonical form (already
            /// percent-decoded: the router decodes paths once).
            pub fn parse(text: &str) -> Option<$name> {
                plausible(text, $prefix).then(|| $name(text.to_string()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

typed_id!(
    /// A sandbox's id, `sbx_…`.
    SandboxId,
    "sbx"
);
typed_id!(
    /// An operation's id, `op_…`.
    OperationId,
    "op"
);
typed_id!(
    /// A command's id, `cmd_…`.
    CommandId,
    "cmd"
);
typed_id!(
    /// A code context's id, `ctx_…`.
    ContextId,
    "ctx"
);

/// This moment, as the API carries times.
pub fn now() -> Timestamp {
    Timestamp::now()
}

/// The DNS-safe hostname of a sandbox.
pub fn hostname_for(sandbox_id: &str) -> String {
    sandbox_id.replace('_', "-")
}

/// The monotonic instant matching a recorded start time (for durations and
/// timeouts of re-adopted commands).
pub fn started_instant(started_at: Timestamp) -> std::time::Instant {
    let elapsed = started_at.age_at(SystemTime::now());
    std::time::Instant::now().checked_sub(elapsed).unwrap_or_else(std::time::Instant::now)
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

    #[test]
    fn only_the_canonical_spelling_parses() {
        let id = new_id("sbx");
        assert_eq!(SandboxId::parse(&id).map(|s| s.to_string()), Some(id.clone()));
        assert!(SandboxId::parse(&id.to_uppercase()).is_none());
        assert!(SandboxId::parse(&format!("sbx_{}", id[4..].to_uppercase())).is_none());
        assert!(SandboxId::parse(&format!("%73{}", &id[1..])).is_none());
        assert!(SandboxId::parse(&format!("{id}/")).is_none());
        assert!(SandboxId::parse(&format!(" {id}")).is_none());
        assert!(OperationId::parse(&id).is_none());
        assert!(CommandId::parse(&new_id("cmd")).is_some());
    }
}
