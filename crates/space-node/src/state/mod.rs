//! What the platform holds for its features: the types of `Platform`'s
//! fields that belong to one feature. Nothing here imports `platform.rs` or
//! a feature's behaviour, so each feature's file sits above the platform it
//! works on, and the platform above its state.

pub mod builds;
pub mod contexts;
pub mod disk;
pub mod egress;
pub mod usage;
