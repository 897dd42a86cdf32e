//! Template builds in progress.

use std::collections::HashMap;
use std::sync::Mutex;

/// A build in progress: its operation once accepted, source and owner.
#[derive(Clone)]
pub(crate) struct Building {
    pub(crate) operation: Option<String>,
    pub(crate) source: serde_json::Value,
    pub(crate) owner: Option<String>,
}

/// Builds in progress, by template name.
#[derive(Default)]
pub(crate) struct Builds {
    pub(crate) in_progress: Mutex<HashMap<String, Building>>,
}
