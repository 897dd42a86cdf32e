//! Privilege separation for SPACE: what crosses between the unprivileged
//! processes (API, runtime, egress gateway, agent channel) and the small
//! root helper that does only what needs root.
//!
//! - [`proto`]: the helper's typed request set and its framing. Requests
//!   name things by canonical id and bounded size; paths are derived by the
//!   helper ([`layout::Layout`]), never received.
//! - [`peer`]: the helper's Unix socket, which serves only the configured
//!   unprivileged uid (`SO_PEERCRED`), and its client; descriptors travel
//!   as `SCM_RIGHTS`.
//! - [`client`]: the same client, blocking, for callers that are not
//!   async (the engine's host calls run on blocking threads).
//! - [`confine`]: what an unprivileged process does to itself before it
//!   starts threads: `no_new_privs`, no capabilities, a Landlock ruleset,
//!   a seccomp filter; and [`confine::status`] for `space doctor`.
//!
//! This crate must not act on sandboxes itself (that is the helper's
//! binary, over the engines) nor link the runtime.

pub mod client;
pub mod confine;
pub mod layout;
pub mod peer;
pub mod proto;
