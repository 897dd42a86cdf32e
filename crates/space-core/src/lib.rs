//! What both a node and a cluster's control plane mean by a tenant, a
//! caller, an id, a secret at rest, a valid request and an error, and the
//! sandbox state machine: the domain below the runtime (`space-node`) and
//! the control plane, which link it and not each other. It names no
//! transport and no engine.

pub mod domain;
pub mod error;
pub mod ids;
pub mod keyring;
pub mod secrets;
pub mod tasks;
pub mod tenants;
pub use space_store as store;

pub use crate::error::NodeError;
