//! `/v1/sandboxes`: create, list, get, delete.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Extension;
use axum::Json;
use space_api::{
    CreateSandboxRequest, ErrorBody, ForkAccepted, ForkRequest, OperationKind, Sandbox, SandboxList, SandboxOperation,
    SandboxState,
};
use space_http::extract::{ApiJson, ApiQuery, NoBody, NoQuery};

use super::access::SandboxPath;
use super::idempotency_key;
use crate::domain::CreateSpec;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Caller;

/// Replays the operation an `Idempotency-Key` already started, if any.
pub(super) fn replay(
    state: &AppState,
    caller: &Caller,
    key: Option<&str>,
    kind: OperationKind,
) -> Result<Option<SandboxOperation>, ApiError> {
    let Some(key) = key else { return Ok(None) };
    let Some(operation) = state.platform.operation_by_key(caller, key)? else {
        return Ok(None);
    };
    if operation.kind != kind {
        return Err(ApiError::unprocessable("this Idempotency-Key was already used for a different request"));
    }
    let sandbox_id = operation.sandbox_id.clone().unwrap_or_default();
    let sandbox = state.platform.sandbox_named(caller, &sandbox_id)?.into_record().sandbox;
    Ok(Some(SandboxOperation { sandbox, operation }))
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes",
    request_body = CreateSandboxRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses(
        (status = 202, description = "Accepted; follow the operation", body = SandboxOperation),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, description = "Unknown template, or a volume the tenant lacks", body = ErrorBody),
        (status = 409, description = "A volume asked read-write is mounted read-write by another sandbox (`volume_in_use`), or the template's engine takes no volumes", body = ErrorBody),
        (status = 422, body = ErrorBody), (status = 429, description = "Past the tenant's quota", body = ErrorBody),
        (status = 503, body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<CreateSandboxRequest>,
) -> Result<(StatusCode, Json<SandboxOperation>), ApiError> {
    let key = idempotency_key(&headers)?;
    if let Some(replayed) = replay(&state, &caller, key.as_deref(), OperationKind::Create)? {
        // The first request's answer is for that request only.
        let record = state.platform.sandbox_named(&caller, &replayed.sandbox.id)?.into_record();
        if !same_create(&request, &record) {
            return Err(ApiError::unprocessable("this Idempotency-Key was already used for a different request"));
        }
        return Ok((StatusCode::ACCEPTED, Json(replayed)));
    }
    let platform = &state.platform;
    let template = platform.usable_template(&request.template, &caller)?;
    if !state.health.engine_available {
        return Err(ApiError::unavailable(format!(
            "the {} engine is not available on this host",
            platform.engine_name()
        )));
    }
    let spec = CreateSpec::new(request, &template.meta.defaults)?;
    let (sandbox, operation) = platform.create_sandbox(spec, &template, &caller.tenant, key.as_deref())?;
    Ok((StatusCode::ACCEPTED, Json(SandboxOperation { sandbox, operation })))
}

/// Whether the sandbox `record` could have come from `request`: what the
/// request names is what the sandbox has (what it leaves out came from
/// defaults, which a repeat may leave out too).
fn same_create(request: &CreateSandboxRequest, record: &crate::store::SandboxRecord) -> bool {
    let sandbox = &record.sandbox;
    let same_network = |asked: &space_api::Network| {
        let had = &sandbox.network;
        asked.egress == had.egress
            && asked.allow == had.allow
            && asked.deny == had.deny
            && asked.secrets.len() == had.secrets.len()
            && asked.secrets.iter().all(|(var, binding)| {
                had.secrets.get(var).is_some_and(|bound| {
                    bound.secret == binding.secret
                        && bound.set_header == binding.set_header
                        && (binding.hosts.is_empty() || bound.hosts == binding.hosts)
                })
            })
    };
    request.template == sandbox.template
        && request.vcpus.is_none_or(|v| v == sandbox.vcpus)
        && request.memory_mib.is_none_or(|m| m == sandbox.memory_mib)
        && request.disk_mib.is_none_or(|d| d == sandbox.disk_mib)
        && request.labels == sandbox.labels
        && request.env.iter().all(|(k, v)| record.env.get(k) == Some(v))
        && request.lifecycle.as_ref().is_none_or(|l| *l == sandbox.lifecycle)
        && request.network.as_ref().is_none_or(same_network)
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only sandboxes in this state.
    state: Option<String>,
    /// Only sandboxes with this label, as `key=value`.
    label: Option<String>,
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiQuery(query): ApiQuery<ListQuery>,
) -> Result<Json<SandboxList>, ApiError> {
    let wanted_state = match &query.state {
        None => None,
        Some(text) => {
            Some(SandboxState::parse(text).ok_or_else(|| ApiError::bad_request(format!("unknown state {text:?}")))?)
        }
    };
    let wanted_label = match &query.label {
        None => None,
        Some(text) => {
            Some(text.split_once('=').ok_or_else(|| ApiError::bad_request("label must be given as key=value"))?)
        }
    };
    let sandboxes = state
        .platform
        .sandboxes_of(&caller)?
        .into_iter()
        .map(|record| record.sandbox)
        .filter(|s| wanted_state.is_none_or(|wanted| s.state == wanted))
        .filter(|s| wanted_label.is_none_or(|(k, v)| s.labels.get(k).is_some_and(|have| have == v)))
        .collect();
    Ok(Json(SandboxList { sandboxes }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Sandbox), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(path: SandboxPath, _: NoQuery) -> Json<Sandbox> {
    Json(path.sandbox.into_record().sandbox)
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, body = SandboxOperation), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn delete(
    path: SandboxPath,
    state: State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    _: NoBody,
) -> LifecycleAnswer {
    lifecycle(path, state, headers, OperationKind::Delete).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, description = "Accepted: every process is frozen in memory once it succeeds", body = SandboxOperation),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Not running", body = ErrorBody)))]
pub async fn pause(
    path: SandboxPath,
    state: State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    _: NoBody,
) -> LifecycleAnswer {
    lifecycle(path, state, headers, OperationKind::Pause).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, description = "Accepted: the sandbox runs again once it succeeds (from paused or suspended)", body = SandboxOperation),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Neither paused nor suspended", body = ErrorBody),
        (status = 503, description = "No room on this host to bring a suspended sandbox back", body = ErrorBody)))]
pub async fn resume(
    path: SandboxPath,
    state: State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    _: NoBody,
) -> LifecycleAnswer {
    lifecycle(path, state, headers, OperationKind::Resume).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/suspend", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, description = "Accepted: memory, processes and disk go to a snapshot on disk and the engine process exits", body = SandboxOperation),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Neither running nor paused", body = ErrorBody),
        (status = 429, description = "The snapshot would take the tenant past its disk quota", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn suspend(
    path: SandboxPath,
    state: State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    _: NoBody,
) -> LifecycleAnswer {
    lifecycle(path, state, headers, OperationKind::Suspend).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "sandboxes",
    request_body = ForkRequest,
    params(("id" = String, Path, description = "Sandbox id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe key")),
    responses((status = 202, description = "Accepted: the forks (`creating`) and the operation that makes them; the source runs on, frozen only while its memory and disk are saved (`frozen_ms`)", body = ForkAccepted),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Neither running nor paused, or its engine cannot fork", body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 429, description = "The forks would take the tenant past a quota", body = ErrorBody),
        (status = 503, description = "The host cannot hold the forks' memory", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn fork(
    SandboxPath { sandbox, caller }: SandboxPath,
    State(state): State<AppState>,
    headers: HeaderMap,
    _: NoQuery,
    ApiJson(request): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<ForkAccepted>), ApiError> {
    let id = sandbox.id();
    let key = idempotency_key(&headers)?;
    if let Some(SandboxOperation { operation, .. }) = replay(&state, &caller, key.as_deref(), OperationKind::Fork)? {
        if operation.sandbox_id.as_deref() != Some(id) {
            return Err(ApiError::unprocessable("this Idempotency-Key was already used for a different sandbox"));
        }
        let sandboxes: Vec<_> = operation
            .forks
            .iter()
            .map(|f| state.platform.sandbox_named(&caller, f).map(|s| s.into_record().sandbox))
            .collect::<Result<_, _>>()?;
        // The first fork's answer is for that fork only: as many, labelled
        // as asked.
        let labelled = |s: &Sandbox| request.labels.iter().all(|(k, v)| s.labels.get(k) == Some(v));
        if sandboxes.len() != request.count.unwrap_or(1) as usize || !sandboxes.iter().all(labelled) {
            return Err(ApiError::unprocessable("this Idempotency-Key was already used for a different request"));
        }
        return Ok((StatusCode::ACCEPTED, Json(ForkAccepted { sandboxes, operation })));
    }
    let count = request.count.unwrap_or(1);
    let (sandboxes, operation) = state.platform.fork_sandbox(&sandbox, count, request.labels, key.as_deref())?;
    Ok((StatusCode::ACCEPTED, Json(ForkAccepted { sandboxes, operation })))
}

type LifecycleAnswer = Result<(StatusCode, Json<SandboxOperation>), ApiError>;

/// Every lifecycle call: replay an `Idempotency-Key`, or hand the request
/// to the sandbox's actor and answer 202 with the operation.
async fn lifecycle(
    SandboxPath { sandbox, caller }: SandboxPath,
    State(state): State<AppState>,
    headers: HeaderMap,
    kind: OperationKind,
) -> LifecycleAnswer {
    let id = sandbox.id();
    let key = idempotency_key(&headers)?;
    if let Some(replayed) = replay(&state, &caller, key.as_deref(), kind)? {
        if replayed.sandbox.id == id {
            return Ok((StatusCode::ACCEPTED, Json(replayed)));
        }
        return Err(ApiError::unprocessable("this Idempotency-Key was already used for a different sandbox"));
    }
    let (sandbox, operation) = state.platform.request(&sandbox, kind, key.as_deref())?;
    Ok((StatusCode::ACCEPTED, Json(SandboxOperation { sandbox, operation })))
}
