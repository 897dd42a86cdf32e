//! Authorization where a resource is loaded: a caller reaches a sandbox or
//! an operation only through [`Platform::sandbox_for`] and
//! [`Platform::operation_for`], which take the caller and a typed,
//! canonical id and answer another tenant's resource with the same 404 an
//! unknown one gets. The HTTP edge (`api/access.rs`) turns path parameters
//! into these and nothing else; no check ever matches request text.

use space_api::Operation;

use crate::error::NodeError;
use crate::ids::{OperationId, SandboxId};
use crate::platform::Platform;
use crate::store::SandboxRecord;
use crate::tenants::Caller;

/// A sandbox its caller may act on. Only [`Platform::sandbox_for`] makes
/// one, after the owner check.
#[derive(Debug, Clone)]
pub struct OwnedSandbox {
    id: SandboxId,
    record: SandboxRecord,
}

impl OwnedSandbox {
    pub fn id(&self) -> &str {
        self.id.as_str()
    }

    pub fn into_record(self) -> SandboxRecord {
        self.record
    }
}

impl Platform {
    /// The sandbox `id` if `caller`'s tenant owns it; 404 otherwise, the
    /// same answer as for an id that never existed.
    pub fn sandbox_for(&self, caller: &Caller, id: &SandboxId) -> Result<OwnedSandbox, NodeError> {
        let record = self.store.sandbox(id.as_str())?.filter(|record| record.tenant == caller.tenant);
        let record = record.ok_or_else(|| NodeError::not_found("sandbox", id.as_str()))?;
        Ok(OwnedSandbox { id: id.clone(), record })
    }

    /// The operation `id` if `caller`'s tenant owns it; 404 otherwise.
    pub fn operation_for(&self, caller: &Caller, id: &OperationId) -> Result<Operation, NodeError> {
        match self.store.operation_tenant(id.as_str())? {
            Some(tenant) if tenant == caller.tenant => self.operation(id.as_str()),
            _ => Err(NodeError::not_found("operation", id.as_str())),
        }
    }
}
