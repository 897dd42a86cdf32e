//! Authorization where a resource is loaded: a caller reaches a sandbox or
//! an operation only through [`Platform::sandbox_for`] and
//! [`Platform::operation_for`], which take the caller and a typed,
//! canonical id and answer another tenant's resource with the same 404 an
//! unknown one gets. The HTTP edge (`api/access.rs`) turns path parameters
//! into these and nothing else; no check ever matches request text.

use space_api::{Command, EgressEvent, Lifecycle, Operation, SecretInfo, Usage};

use crate::error::NodeError;
use crate::ids::{OperationId, SandboxId};
use crate::platform::Platform;
use crate::store::{PortAccess, SandboxRecord};
use crate::tenants::Caller;

/// A sandbox its caller may act on. Only [`Platform::sandbox_for`] makes
/// one, after the owner check.
#[derive(Debug, Clone)]
pub struct OwnedSandbox {
    id: SandboxId,
    record: SandboxRecord,
}

/// Why [`Platform::sandbox_by_token`] gave no sandbox.
#[derive(Debug)]
pub enum TokenRefused {
    /// No token the request sent is the sandbox's.
    Wrong,
    /// The token is right but the sandbox is gone.
    NotFound,
    Node(NodeError),
}

impl OwnedSandbox {
    pub fn id(&self) -> &str {
        self.id.as_str()
    }

    /// The sandbox's record as it was when it was loaded.
    pub fn record(&self) -> &SandboxRecord {
        &self.record
    }

    pub fn into_record(self) -> SandboxRecord {
        self.record
    }
}

impl Platform {
    /// The sandbox `id` if `caller`'s tenant owns it; 404 otherwise, the
    /// same answer as for an id that never existed.
    pub fn sandbox_for(&self, caller: &Caller, id: &SandboxId) -> Result<OwnedSandbox, NodeError> {
        let record = self.store.node().sandbox(id.as_str())?.filter(|record| record.tenant == caller.tenant);
        let record = record.ok_or_else(|| NodeError::not_found("sandbox", id.as_str()))?;
        Ok(OwnedSandbox { id: id.clone(), record })
    }

    /// The sandbox `id` for a request that holds one of the sandbox's own
    /// tokens (E2B's envd and traffic tokens, which the keyring derives from
    /// the id): `presented` pairs each token's purpose with what the request
    /// sent for it. The tokens are compared first, in constant time, so a
    /// request without one learns nothing of whether `id` exists.
    pub fn sandbox_by_token(&self, id: &str, presented: &[(&str, &[u8])]) -> Result<OwnedSandbox, TokenRefused> {
        let keyring = self.keyring().map_err(TokenRefused::Node)?;
        let mut authentic = false;
        for (purpose, sent) in presented {
            authentic |= space_proto::constant_time_eq(sent, keyring.token(purpose, id).as_bytes());
        }
        if !authentic {
            return Err(TokenRefused::Wrong);
        }
        let id = SandboxId::parse(id).ok_or(TokenRefused::NotFound)?;
        match self.store.node().sandbox(id.as_str()) {
            Ok(Some(record)) => Ok(OwnedSandbox { id, record }),
            Ok(None) => Err(TokenRefused::NotFound),
            Err(err) => Err(TokenRefused::Node(err.into())),
        }
    }

    /// The sandbox `id` for a request to one of its ports on its preview
    /// host name, which carries no API key: `proven` says whether the
    /// request holds a proof derived from the id alone (its preview token,
    /// a link or cookie signed for it), checked before anything is looked
    /// up; without one, only a port its owner made public is served.
    /// Refused without a proof or a public port alike, whether the sandbox
    /// exists or not ([`TokenRefused::Wrong`]), so the answer tells a
    /// stranger nothing.
    pub fn sandbox_for_preview(&self, id: &SandboxId, port: u16, proven: bool) -> Result<OwnedSandbox, TokenRefused> {
        let access = self.store.node().port_access(id.as_str()).map_err(|e| TokenRefused::Node(e.into()))?;
        if !proven && !access.as_ref().is_some_and(|a| a.is_public(port)) {
            return Err(TokenRefused::Wrong);
        }
        match self.store.node().sandbox(id.as_str()) {
            Ok(Some(record)) if access.is_some() => Ok(OwnedSandbox { id: id.clone(), record }),
            Ok(_) => Err(TokenRefused::NotFound),
            Err(err) => Err(TokenRefused::Node(err.into())),
        }
    }

    /// Who may open the sandbox's ports without its preview token.
    pub fn port_access(&self, sandbox: &OwnedSandbox) -> Result<PortAccess, NodeError> {
        let access = self.store.node().port_access(sandbox.id())?;
        access.ok_or_else(|| NodeError::not_found("sandbox", sandbox.id()))
    }

    /// Makes one port of the sandbox public (`true`) or private again.
    pub fn set_port_public(&self, sandbox: &OwnedSandbox, port: u16, public: bool) -> Result<PortAccess, NodeError> {
        let mut access = self.port_access(sandbox)?;
        match public {
            true => access.public.insert(port),
            false => access.public.remove(&port),
        };
        self.store_port_access(sandbox, &access)?;
        Ok(access)
    }

    /// Makes every port of the sandbox public, or only those made public
    /// one by one (E2B's `allowPublicTraffic`).
    pub fn set_all_ports_public(&self, sandbox: &OwnedSandbox, all: bool) -> Result<(), NodeError> {
        let mut access = self.port_access(sandbox)?;
        access.all_public = all;
        self.store_port_access(sandbox, &access)
    }

    fn store_port_access(&self, sandbox: &OwnedSandbox, access: &PortAccess) -> Result<(), NodeError> {
        if !self.store.node().set_port_access(sandbox.id(), access)? {
            return Err(NodeError::not_found("sandbox", sandbox.id()));
        }
        Ok(())
    }

    /// The operation `id` if `caller`'s tenant owns it; 404 otherwise.
    pub fn operation_for(&self, caller: &Caller, id: &OperationId) -> Result<Operation, NodeError> {
        match self.store.node().operation_tenant(id.as_str())? {
            Some(tenant) if tenant == caller.tenant => self.operation(id.as_str()),
            _ => Err(NodeError::not_found("operation", id.as_str())),
        }
    }

    /// [`Platform::sandbox_for`] for an id as text (from a record the
    /// caller's request reached, such as an operation's): one that is not
    /// an id in its canonical spelling is not found.
    pub fn sandbox_named(&self, caller: &Caller, id: &str) -> Result<OwnedSandbox, NodeError> {
        let parsed = SandboxId::parse(id).ok_or_else(|| NodeError::not_found("sandbox", id))?;
        self.sandbox_for(caller, &parsed)
    }

    /// `sandbox` as it is now (a sandbox its caller was already allowed).
    pub fn reload(&self, sandbox: &OwnedSandbox) -> Result<OwnedSandbox, NodeError> {
        let record = self.store.node().sandbox(sandbox.id())?;
        let record = record.ok_or_else(|| NodeError::not_found("sandbox", sandbox.id()))?;
        Ok(OwnedSandbox { id: sandbox.id.clone(), record })
    }

    /// The operations of `caller`'s tenant, of one sandbox or all.
    pub fn operations_of(&self, caller: &Caller, sandbox_id: Option<&str>) -> Result<Vec<Operation>, NodeError> {
        Ok(self.store.node().tenant_operations(&caller.tenant, sandbox_id)?)
    }

    /// The operation `caller`'s tenant started with `key` (an idempotency
    /// key), if any.
    pub fn operation_by_key(&self, caller: &Caller, key: &str) -> Result<Option<Operation>, NodeError> {
        Ok(self.store.node().operation_by_key(&caller.tenant, key)?)
    }

    /// Every sandbox of `caller`'s tenant, deleted ones included.
    pub fn sandboxes_of(&self, caller: &Caller) -> Result<Vec<SandboxRecord>, NodeError> {
        Ok(self.store.node().sandboxes()?.into_iter().filter(|r| r.tenant == caller.tenant).collect())
    }

    /// The sandboxes of `caller`'s tenant that are not deleted.
    pub fn live_sandboxes_of(&self, caller: &Caller) -> Result<Vec<SandboxRecord>, NodeError> {
        Ok(self.store.node().live_sandboxes()?.into_iter().filter(|r| r.tenant == caller.tenant).collect())
    }

    /// The commands a sandbox has run and runs, oldest first.
    pub fn commands_of(&self, sandbox: &OwnedSandbox) -> Result<Vec<Command>, NodeError> {
        Ok(self.store.node().commands(sandbox.id())?)
    }

    /// The newest `limit` requests the sandbox's egress gateway decided.
    pub fn egress_log(&self, sandbox: &OwnedSandbox, limit: u32) -> Result<Vec<EgressEvent>, NodeError> {
        Ok(self.store.node().egress_events(sandbox.id(), limit)?)
    }

    /// Records that a request used the sandbox now (its idle clock starts
    /// again). Best effort: a request that did its work is not failed for
    /// a stamp.
    pub fn mark_active(&self, sandbox: &OwnedSandbox) {
        if let Err(err) = self.store.node().touch_sandbox(sandbox.id(), crate::ids::now()) {
            tracing::warn!(sandbox = sandbox.id(), "recording activity: {err}");
        }
    }

    /// Gives the sandbox a new lifecycle (its end and what happens then).
    pub fn set_lifecycle(&self, sandbox: &OwnedSandbox, lifecycle: &Lifecycle) -> Result<(), NodeError> {
        if !self.store.node().set_sandbox_lifecycle(sandbox.id(), lifecycle)? {
            return Err(NodeError::not_found("sandbox", sandbox.id()));
        }
        self.changed();
        Ok(())
    }

    /// The names of `caller`'s tenant's secrets (never their values).
    pub fn secrets_of(&self, caller: &Caller) -> Result<Vec<SecretInfo>, NodeError> {
        Ok(self.store.tenancy().secrets(&caller.tenant)?)
    }

    /// Who holds the API key `presented`, if anyone.
    pub fn caller_for_key(&self, presented: &str) -> Result<Option<Caller>, NodeError> {
        crate::tenants::tenant_for_key(&self.store, presented)
    }

    /// What `tenant` holds here against its quotas.
    pub fn usage_of(&self, tenant: &str) -> Result<Usage, NodeError> {
        crate::tenants::usage(&self.store, tenant, self.disk_usage(tenant)?)
    }
}
