//! E2B's fork and snapshots over SPACE's own: a fork is a SPACE fork (the
//! source keeps running; each fork starts from its memory and disk), a
//! snapshot is a SPACE snapshot template of the sandbox (its id is the
//! template's name, so `Sandbox.create(snapshot_id)` starts from it), and
//! deleting a snapshot deletes that template.

use std::collections::BTreeMap;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use space_api::e2b::form_pairs;
use space_api::{CreateTemplateRequest, Template, TemplateSource};

use crate::control::{caller, extend, json_body, sandbox_json, settle, settled, visible, DEFAULT_TIMEOUT_S};
use crate::error::E2bError;
use crate::wire::{header, page};
use crate::E2bState;

/// A fork's body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u32>,
}

/// `POST /sandboxes/{id}/fork`: `count` new sandboxes from the sandbox's
/// memory and disk as they are now, each ending `timeout` from now (201,
/// once they run).
pub async fn fork(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let body: ForkBody = json_body(&body)?;
    settled(&state, &sandbox).await?;
    let sandbox = state.platform.reload(&sandbox)?;
    let key = header(&headers, "idempotency-key");
    let platform = &state.platform;
    let (forks, operation) = platform.fork_sandbox(&sandbox, body.count.unwrap_or(1), BTreeMap::new(), key)?;
    settle(&state, &operation.id).await?;
    let mut answered = Vec::new();
    for fork in forks {
        let fork = platform.sandbox_named(&caller, &fork.id)?;
        extend(&state, &fork, body.timeout.unwrap_or(DEFAULT_TIMEOUT_S), true)?;
        let record = platform.reload(&fork)?.into_record();
        answered.push(json!({"sandbox": sandbox_json(&state, &record)?}));
    }
    Ok((StatusCode::CREATED, Json(Value::Array(answered))))
}

/// A snapshot's body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    name: Option<String>,
}

/// E2B's `SnapshotInfo` of a snapshot template.
fn snapshot_json(template: &Template) -> Value {
    json!({"snapshotID": template.name, "names": [template.name]})
}

/// The sandbox a snapshot template was made of, if it is one.
fn snapshot_source(template: &Template) -> Option<&str> {
    let source = &template.source;
    source.get("sandbox").or_else(|| source.get("checkpoint").and_then(|c| c.get("sandbox"))).and_then(Value::as_str)
}

/// `POST /sandboxes/{id}/snapshots`: a snapshot template of the sandbox as
/// it is now, named `name` (a new version of it if the caller has one of
/// that name) or a new name; answers once it is ready (201).
pub async fn create_snapshot(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let body: SnapshotBody = json_body(&body)?;
    let sandbox = state.platform.reload(&sandbox)?;
    let name = body.name.unwrap_or_else(|| crate::ids::new_id("snap"));
    let request = CreateTemplateRequest {
        name: name.clone(),
        from: TemplateSource { sandbox: Some(sandbox.id().to_string()), ..Default::default() },
        defaults: Default::default(),
        engine: None,
    };
    let (template, operation) = state.platform.build_template(request, &caller)?;
    settle(&state, &operation.id).await?;
    let template = state.platform.template(&template.name, &caller)?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&template))))
}

/// `GET /snapshots`: the caller's snapshot templates, of one sandbox
/// (`sandboxID`) or of one name (`name`), newest first, in pages.
pub async fn list_snapshots(
    State(state): State<E2bState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, E2bError> {
    let caller = caller(&state, &headers)?;
    let query: BTreeMap<String, String> = form_pairs(query.as_deref().unwrap_or_default()).into_iter().collect();
    let platform = &state.platform;
    let listed = platform
        .templates(&caller)
        .into_iter()
        .filter(|t| t.version.is_some() && platform.may_manage_template(&t.name, &caller).is_ok())
        .filter(|t| snapshot_source(t).is_some_and(|s| query.get("sandboxID").is_none_or(|id| id == s)))
        .filter(|t| query.get("name").is_none_or(|name| *name == t.name))
        .map(|t| (t.created_at.map_or(SystemTime::UNIX_EPOCH, |at| at.system_time()), snapshot_json(&t)))
        .collect();
    page(listed, &query)
}

/// `DELETE /templates/{id}`: the caller's template (a snapshot's, or any
/// other it may manage) is deleted; 404 when it has none of that name.
pub async fn delete_template(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<StatusCode, E2bError> {
    let caller = caller(&state, &headers)?;
    state.platform.delete_template(&name, &caller).await?;
    Ok(StatusCode::NO_CONTENT)
}
