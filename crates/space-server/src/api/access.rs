//! Path parameters, parsed and authorized on entry. A handler of a route
//! that names a resource takes one of these extractors and gets the
//! resource as [`Platform::sandbox_for`](crate::Platform::sandbox_for) or
//! [`Platform::operation_for`](crate::Platform::operation_for) loaded it
//! for the caller — never the raw path text. The router has decoded the
//! path once; an id not in its canonical form after that (re-encoded,
//! upper-case hex, dot segments, a trailing slash) is a 404, the same
//! answer as another tenant's id or one that never existed.
//!
//! This module is the only one in the API that may read path parameters
//! (clippy's `disallowed_types` refuses `axum::extract::Path` elsewhere).

#![allow(clippy::disallowed_types)]

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use space_api::{Command, ErrorCode, Operation};

use crate::access::OwnedSandbox;
use crate::error::ApiError;
use crate::ids::{CommandId, ContextId, OperationId, SandboxId};
use crate::state::AppState;
use crate::tenants::Caller;

/// The path's parameters (percent-decoded by the router) and the caller
/// `require_key` authenticated.
async fn params(parts: &mut Parts, state: &AppState) -> Result<(HashMap<String, String>, Caller), ApiError> {
    let caller =
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            ApiError::new(ErrorCode::Unauthorized, "missing API key: send `Authorization: Bearer <key>`")
        })?;
    // A path that is not valid UTF-8 once decoded names nothing of ours.
    let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
        .await
        .map_err(|_| ApiError::new(ErrorCode::NotFound, "no such resource"))?;
    Ok((params, caller))
}

fn param<'a>(params: &'a HashMap<String, String>, name: &str) -> &'a str {
    params.get(name).map(String::as_str).unwrap_or_default()
}

/// The caller's sandbox named `text`; one a restarted server is still
/// re-adopting is waited for (then loaded again), only once the caller is
/// known to own it.
async fn owned_sandbox(state: &AppState, caller: &Caller, text: &str) -> Result<OwnedSandbox, ApiError> {
    let id = SandboxId::parse(text).ok_or_else(|| ApiError::not_found("sandbox", text))?;
    let owned = state.platform.sandbox_for(caller, &id)?;
    if !state.platform.reconciling(id.as_str()) {
        return Ok(owned);
    }
    super::until_reconciled(state, id.as_str()).await?;
    Ok(state.platform.sandbox_for(caller, &id)?)
}

/// `{id}`: a sandbox of the caller's tenant.
pub struct SandboxPath {
    pub sandbox: OwnedSandbox,
    pub caller: Caller,
}

impl FromRequestParts<AppState> for SandboxPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let sandbox = owned_sandbox(state, &caller, param(&params, "id")).await?;
        Ok(SandboxPath { sandbox, caller })
    }
}

/// `{id}/commands/{cid}`: a command of a sandbox of the caller's tenant.
pub struct CommandPath {
    pub sandbox: OwnedSandbox,
    pub command: Command,
}

impl CommandPath {
    pub fn id(&self) -> &str {
        &self.command.id
    }
}

impl FromRequestParts<AppState> for CommandPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let sandbox = owned_sandbox(state, &caller, param(&params, "id")).await?;
        let text = param(&params, "cid");
        let id = CommandId::parse(text).ok_or_else(|| ApiError::not_found("command", text))?;
        let command = state.platform.command(&sandbox, id.as_str())?;
        Ok(CommandPath { sandbox, command })
    }
}

/// `{id}/contexts/{cid}`: a code context of a sandbox of the caller's
/// tenant (looked up within that sandbox).
pub struct ContextPath {
    pub sandbox: OwnedSandbox,
    pub context: ContextId,
}

impl FromRequestParts<AppState> for ContextPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let sandbox = owned_sandbox(state, &caller, param(&params, "id")).await?;
        let text = param(&params, "cid");
        let context = ContextId::parse(text).ok_or_else(|| crate::contexts::context_not_found(text))?;
        // Found only under its own sandbox, before anything else is read.
        state.platform.get_context(&sandbox, context.as_str())?;
        Ok(ContextPath { sandbox, context })
    }
}

/// `{id}/checkpoints/{name}`: a checkpoint of a sandbox of the caller's
/// tenant (looked up within that sandbox).
pub struct CheckpointPath {
    pub sandbox: OwnedSandbox,
    pub caller: Caller,
    pub name: String,
}

impl FromRequestParts<AppState> for CheckpointPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let sandbox = owned_sandbox(state, &caller, param(&params, "id")).await?;
        // One path segment of ours: a decoded `%2F` or `..` names nothing.
        let name = param(&params, "name");
        if !space_host::template::valid_name(name)
            || !crate::checkpoints::CheckpointAt::new(state.platform.data(), sandbox.id(), name).is_whole()
        {
            return Err(crate::checkpoints::checkpoint_not_found(sandbox.id(), name).into());
        }
        Ok(CheckpointPath { sandbox, caller, name: name.to_string() })
    }
}

/// `{id}/ports/{port}[/{path}]`: a port of a sandbox of the caller's
/// tenant, and the path on the server there.
pub struct PortPath {
    pub sandbox: OwnedSandbox,
    pub port: String,
    pub path: String,
}

impl FromRequestParts<AppState> for PortPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let sandbox = owned_sandbox(state, &caller, param(&params, "id")).await?;
        let port = param(&params, "port").to_string();
        Ok(PortPath { sandbox, port, path: param(&params, "path").to_string() })
    }
}

/// `/v1/operations/{id}`: an operation of the caller's tenant.
pub struct OperationPath {
    pub id: OperationId,
    /// As it was when the request loaded it.
    pub operation: Operation,
}

impl FromRequestParts<AppState> for OperationPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let text = param(&params, "id");
        let id = OperationId::parse(text).ok_or_else(|| ApiError::not_found("operation", text))?;
        let operation = state.platform.operation_for(&caller, &id)?;
        Ok(OperationPath { id, operation })
    }
}

/// `/v1/templates/{name}`: a template the caller may see (its tenant's, or
/// shared), as `Platform::template` finds it for the caller.
pub struct TemplatePath {
    pub template: space_api::Template,
    pub caller: Caller,
}

impl FromRequestParts<AppState> for TemplatePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let template = state.platform.template(param(&params, "name"), &caller)?;
        // Managing a shared template is the operator's: refused before the
        // request is read any further.
        if parts.method != axum::http::Method::GET {
            state.platform.may_manage_template(&template.name, &caller)?;
        }
        Ok(TemplatePath { template, caller })
    }
}

/// `/v1/secrets/{name}`, with the caller: secrets are named in each
/// tenant's own space, so the name is looked up in the caller's only.
pub struct NamePath {
    pub name: String,
    pub caller: Caller,
}

impl FromRequestParts<AppState> for NamePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        Ok(NamePath { name: param(&params, "name").to_string(), caller })
    }
}

/// `/v1/volumes/{name}`: a volume of the caller's tenant, loaded from its
/// tenant's names only (another tenant's is the 404 an unknown name gets).
pub struct VolumePath {
    pub volume: crate::store::VolumeRecord,
    pub caller: Caller,
}

impl FromRequestParts<AppState> for VolumePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let volume = state.platform.volume_record(&caller.tenant, param(&params, "name"))?;
        Ok(VolumePath { volume, caller })
    }
}

/// `/v1/volumes/{name}/snapshots/{snapshot}`: the volume loaded as
/// [`VolumePath`] does, and the snapshot's name (looked up in that volume).
pub struct VolumeSnapshotPath {
    pub volume: crate::store::VolumeRecord,
    pub snapshot: String,
    pub caller: Caller,
}

impl FromRequestParts<AppState> for VolumeSnapshotPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let (params, caller) = params(parts, state).await?;
        let volume = state.platform.volume_record(&caller.tenant, param(&params, "name"))?;
        Ok(VolumeSnapshotPath { volume, snapshot: param(&params, "snapshot").to_string(), caller })
    }
}
