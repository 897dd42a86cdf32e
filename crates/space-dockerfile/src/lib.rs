//! Dockerfile planning for SPACE template builds, with no sandbox and no
//! I/O beyond the tar streams it is handed: parse a Dockerfile into stages
//! of steps ([`plan`]), expand variables by Docker's rules ([`expand`]),
//! match `.dockerignore` patterns ([`dockerignore`]), turn a COPY from the
//! build context into a layer tar ([`copy_layer`]) and key each step for the
//! layer cache ([`cache_key()`]).
//!
//! It runs RUN steps nowhere and resolves no image: the server's builder
//! does that, inside build sandboxes, from this crate's plan.

mod cache_key;
mod context;
pub mod dockerignore;
pub mod expand;
mod glob;
mod model;
mod plan;
mod words;

pub use cache_key::cache_key;
pub use context::{copy_layer, CopyError, CopyStats};
pub use dockerignore::{Ignore, IgnoreError};
pub use glob::BadPattern;
pub use model::{Base, BuildPlan, CopyFrom, CopyStep, ImageConfig, PlanError, Stage, Step, StepKind};
pub use plan::{plan, plan_with_bases};
