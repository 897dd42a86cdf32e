//! The server's control logic — the sandbox actor, recovery and adoption
//! after a restart, warm and hot pools, idle pauses and dozing, lifecycle
//! policies, host capacity and tenant quotas, and stopping a platform in
//! the process (`Platform::shutdown`) — against a real `Platform`
//! and the real router, over the fake engine (`space_engine::fake`). No
//! root, btrfs, runsc or network namespace: plain `cargo test` as any user.
//! `SPACE_UNPRIVILEGED_TMP` says where the data dirs go (default: the
//! system's temporary directory).

mod harness;

mod actor;
mod capacity;
mod idle;
mod pools;
mod recovery;
mod shutdown;
mod tenants;
