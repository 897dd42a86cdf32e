//! The agent's file code, shared with the host's confined child that
//! serves a volume's files (decision 031) so both answer file requests
//! alike: [`files`] (read, list, tar down and up, write by temporary file
//! and rename, delete, path operations), the [`pool`] of threads it runs
//! on, the [`users`] it names owners by, and [`files_only`], the serve
//! loop of a peer that answers file requests and nothing else.
//!
//! Everything here resolves paths in the calling process's own view: the
//! sandbox's inside a sandbox, the volume's (its root directory) in the
//! files child. None of it may run commands, relay egress or open ports.

pub mod files;
pub mod files_only;
pub mod pool;
pub mod users;
