//! E2B's REST control plane over SPACE's sandboxes. Calls are synchronous
//! where E2B's are: create, kill, pause and connect wait for the SPACE
//! operation they start and answer with its outcome.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use space_api::e2b::{form_pairs, metadata_filter, parse_time, E2B_CODE_INTERPRETER};
use space_api::{
    CreateSandboxRequest, Egress, Lifecycle, Network, OnIdle, OperationKind, OperationState, SandboxState,
};

use super::error::E2bError;
use super::target::{envd_token, traffic_token};
use super::wire::{header, page, ENVD_VERSION};
use crate::access::OwnedSandbox;
use crate::domain::CreateSpec;
use crate::ids::SandboxId;
use crate::store::SandboxRecord;
use crate::tenants::Caller;
use crate::E2bState;

/// What a create starts from before E2B's timeout is applied.
const NO_LIFECYCLE: Lifecycle =
    Lifecycle { idle_timeout_s: None, on_idle: None, max_lifetime_s: None, auto_pause: None };

/// E2B's default sandbox lifetime, in seconds.
pub(crate) const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest a synchronous call waits for its operation.
const OPERATION_PATIENCE: Duration = Duration::from_secs(300);

/// The caller of an E2B control-plane request, from `X-API-KEY` (a SPACE
/// key: the server's own or a tenant's).
pub(crate) fn caller(state: &E2bState, headers: &HeaderMap) -> Result<Caller, E2bError> {
    let caller = (state.caller)(headers)?;
    tracing::Span::current().record("tenant", caller.tenant.as_str());
    Ok(caller)
}

/// A sandbox of the caller that E2B can see (not deleted), or 404.
fn owned(state: &E2bState, caller: &Caller, id: &str) -> Result<OwnedSandbox, E2bError> {
    let missing = || E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"));
    let sandbox = state.platform.sandbox_for(caller, &SandboxId::parse(id).ok_or_else(missing)?)?;
    if matches!(sandbox.record().sandbox.state, SandboxState::Deleted | SandboxState::Deleting) {
        return Err(missing());
    }
    Ok(sandbox)
}

/// A sandbox of the caller as E2B sees it (running or paused), or 404.
pub(crate) fn visible(state: &E2bState, caller: &Caller, id: &str) -> Result<(OwnedSandbox, &'static str), E2bError> {
    let sandbox = owned(state, caller, id)?;
    match e2b_state(sandbox.record()) {
        Some(e2b_state) => Ok((sandbox, e2b_state)),
        None => Err(E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))),
    }
}

/// `running` or `paused` as E2B lists them; a sandbox the server paused
/// for idleness is running to its user (the next request wakes it).
fn e2b_state(record: &SandboxRecord) -> Option<&'static str> {
    match record.sandbox.state {
        SandboxState::Paused if record.sandbox.auto_paused => Some("running"),
        SandboxState::Running | SandboxState::Creating | SandboxState::Resuming => Some("running"),
        SandboxState::Paused | SandboxState::Suspending | SandboxState::Suspended => Some("paused"),
        SandboxState::Deleting | SandboxState::Deleted | SandboxState::Failed => None,
    }
}

fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_seconds(time).to_string()
}

/// When the sandbox ends by its lifecycle: `max_lifetime_s` after its
/// creation, or (for one that pauses instead) its idle timeout after its
/// last activity; a sandbox without either runs until deleted.
fn end_at(record: &SandboxRecord) -> SystemTime {
    let sandbox = &record.sandbox;
    if let Some(max) = sandbox.lifecycle.max_lifetime_s {
        return sandbox.created_at.system_time() + Duration::from_secs(max);
    }
    if let Some(idle) = sandbox.lifecycle.idle_timeout_s {
        return sandbox.last_activity_at.system_time() + Duration::from_secs(idle);
    }
    sandbox.created_at.system_time() + Duration::from_secs(100 * 365 * 86_400)
}

/// The lifecycle that ends a sandbox `timeout_s` from now: deleted then,
/// or (with E2B's `autoPause`) suspended after that long without activity.
fn lifecycle_for(record_created: SystemTime, timeout_s: u64, auto_pause: bool, base: &Lifecycle) -> Lifecycle {
    let mut lifecycle = base.clone();
    if auto_pause {
        lifecycle.idle_timeout_s = Some(timeout_s.max(1));
        lifecycle.on_idle = Some(OnIdle::Suspend);
        lifecycle.max_lifetime_s = None;
    } else {
        let lived = SystemTime::now().duration_since(record_created).unwrap_or_default().as_secs();
        lifecycle.max_lifetime_s = Some(lived + timeout_s.max(1));
    }
    lifecycle
}

fn pauses_on_timeout(lifecycle: &Lifecycle) -> bool {
    lifecycle.max_lifetime_s.is_none() && matches!(lifecycle.on_idle, Some(OnIdle::Suspend | OnIdle::Pause))
}

/// E2B's `Sandbox` (what create and connect answer).
pub(crate) fn sandbox_json(state: &E2bState, record: &SandboxRecord) -> Result<Value, E2bError> {
    Ok(json!({
        "templateID": record.sandbox.template,
        "sandboxID": record.sandbox.id,
        "clientID": "space",
        "alias": record.sandbox.template,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": envd_token(&state.platform, &record.sandbox.id)?,
        "trafficAccessToken": traffic_token(&state.platform, &record.sandbox.id)?,
        // Where `get_host(port)` points: `{port}-{sandboxID}.{domain}`.
        "domain": state.preview_domain,
    }))
}

/// E2B's `ListedSandbox`.
fn listed_json(record: &SandboxRecord, state: &str) -> Value {
    let sandbox = &record.sandbox;
    json!({
        "templateID": sandbox.template,
        "alias": sandbox.template,
        "sandboxID": sandbox.id,
        "clientID": "space",
        "startedAt": rfc3339(sandbox.created_at.system_time()),
        "endAt": rfc3339(end_at(record)),
        "cpuCount": sandbox.vcpus,
        "memoryMB": sandbox.memory_mib,
        "diskSizeMB": sandbox.disk_mib,
        "state": state,
        "envdVersion": ENVD_VERSION,
        "metadata": sandbox.labels,
    })
}

/// Waits for an operation to end; an error unless it succeeded.
pub(crate) async fn settle(state: &E2bState, operation_id: &str) -> Result<(), E2bError> {
    let platform = &state.platform;
    let deadline = Instant::now() + OPERATION_PATIENCE;
    let operation =
        platform.wait_for(Some(deadline), || platform.operation(operation_id), |op| op.state.is_terminal()).await?;
    match operation.state {
        OperationState::Succeeded => Ok(()),
        OperationState::Pending | OperationState::Running => Err(E2bError::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!("operation {operation_id} is still running; try again"),
        )),
        OperationState::Failed | OperationState::Cancelled => {
            let why = operation.error.map(|e| e.message).unwrap_or_else(|| "no reason recorded".into());
            Err(E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{:?} failed: {why}", operation.kind)))
        }
    }
}

/// The sandbox once no transition is under way (E2B has no states
/// between running and paused: its calls wait instead).
pub(crate) async fn settled(state: &E2bState, sandbox: &OwnedSandbox) -> Result<SandboxRecord, E2bError> {
    let platform = &state.platform;
    let stable = |r: &SandboxRecord| {
        !matches!(r.sandbox.state, SandboxState::Creating | SandboxState::Suspending | SandboxState::Resuming)
    };
    let record = platform
        .wait_for(
            Some(Instant::now() + OPERATION_PATIENCE),
            || platform.reload(sandbox).map(OwnedSandbox::into_record),
            stable,
        )
        .await?;
    Ok(record)
}

/// The body of a create, as E2B's SDK sends it. A field SPACE would not
/// honour is refused, never dropped: a caller who asked for network rules
/// (or anything else it would not get) must not be handed a sandbox that
/// lacks them. So unknown fields are refused too; the fields E2B's own
/// sandboxes have that SPACE lacks are named, to say so.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateBody {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    #[serde(default)]
    auto_pause: bool,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    /// Deprecated and ignored by E2B itself: envd access is always secured
    /// (here by the sandbox's access token), whatever it says.
    #[allow(dead_code)]
    secure: Option<bool>,
    /// True (a pause keeps memory) is what a SPACE suspend does.
    auto_pause_memory: Option<bool>,
    auto_resume: Option<Value>,
    network: Option<Value>,
    mcp: Option<Value>,
    iam: Option<Value>,
    /// SPACE volumes of the caller's tenant, mounted read-write.
    #[serde(default)]
    volume_mounts: Vec<E2bVolumeMount>,
}

/// One of E2B's `volumeMounts`: a volume's name and where it appears.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct E2bVolumeMount {
    name: String,
    path: String,
}

impl CreateBody {
    /// A 400 for the first field asking for what SPACE does not do.
    fn refuse_unsupported(&self) -> Result<(), E2bError> {
        let unsupported = |what: &str| {
            E2bError::new(
                StatusCode::BAD_REQUEST,
                format!("{what} is not supported by SPACE; the sandbox was not created"),
            )
        };
        let given = |value: &Option<Value>| match value {
            None | Some(Value::Null) => false,
            Some(Value::Object(map)) => map.values().any(|v| !v.is_null()),
            Some(Value::Array(items)) => !items.is_empty(),
            Some(_) => true,
        };
        if self.auto_pause_memory == Some(false) {
            return Err(unsupported("a pause without memory (autoPauseMemory: false)"));
        }
        let resumes = |value: &Value| value.get("enabled").and_then(Value::as_bool).unwrap_or(true);
        if self.auto_resume.as_ref().is_some_and(|v| !v.is_null() && resumes(v)) {
            return Err(unsupported("resuming a paused sandbox on traffic (autoResume)"));
        }
        for (field, value) in [("mcp", &self.mcp), ("iam", &self.iam)] {
            if given(value) {
                return Err(unsupported(field));
            }
        }
        Ok(())
    }
}

pub(crate) fn json_body<T: serde::de::DeserializeOwned + Default>(body: &Bytes) -> Result<T, E2bError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        let why = e.to_string();
        let message = match why.starts_with("unknown field") {
            true => format!("{why}: SPACE refuses what it would not honour"),
            false => format!("the body is not valid JSON for this call: {why}"),
        };
        E2bError::new(StatusCode::BAD_REQUEST, message)
    })
}

pub async fn create(
    State(state): State<E2bState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let caller = caller(&state, &headers)?;
    let body: CreateBody = json_body(&body)?;
    body.refuse_unsupported()?;
    let platform = &state.platform;
    let mut name = body.template_id.unwrap_or_else(|| "base".into());
    // E2B's code interpreter asks for its own template by this name.
    if name == E2B_CODE_INTERPRETER && platform.usable_template(&name, &caller).is_err() {
        name = space_host::template::CODE_INTERPRETER_TEMPLATE.into();
    }
    let template = platform.usable_template(&name, &caller)?;
    if !state.engine_available {
        return Err(E2bError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the {} engine is not available on this host", platform.engine_name()),
        ));
    }
    let timeout_s = body.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    // E2B's rules as SPACE's egress policy (or refused); neither given:
    // the template's (or the tenant's) default network.
    let rules = crate::network::from_create(body.network.as_ref())?;
    let network = match (&body.network, body.allow_internet_access) {
        (None | Some(Value::Null), None) => None,
        _ => Some(rules.to_space(body.allow_internet_access)?),
    };
    let request = CreateSandboxRequest {
        template: name,
        vcpus: None,
        memory_mib: None,
        disk_mib: None,
        env: body.env_vars,
        labels: body.metadata,
        lifecycle: Some(lifecycle_for(SystemTime::now(), timeout_s, body.auto_pause, &NO_LIFECYCLE)),
        network,
        volumes: body
            .volume_mounts
            .into_iter()
            .map(|m| space_api::VolumeMount { name: m.name, path: m.path, read_only: false })
            .collect(),
    };
    let spec = CreateSpec::new(request, &template.meta.defaults)?;
    let key = header(&headers, "idempotency-key").map(str::to_string);
    let (sandbox, operation) = platform.create_sandbox(spec, &template, &caller.tenant, key.as_deref())?;
    settle(&state, &operation.id).await?;
    let owned = platform.sandbox_named(&caller, &sandbox.id)?;
    // E2B's ports are public unless `network.allowPublicTraffic` is false
    // (then its traffic token opens them).
    let public = body.network.as_ref().and_then(|n| n.get("allowPublicTraffic")).and_then(Value::as_bool);
    platform.set_all_ports_public(&owned, public.unwrap_or(true))?;
    let record = owned.into_record();
    Ok((StatusCode::CREATED, Json(sandbox_json(&state, &record)?)))
}

pub async fn list(
    State(state): State<E2bState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, E2bError> {
    let caller = caller(&state, &headers)?;
    let query: BTreeMap<String, String> = form_pairs(query.as_deref().unwrap_or_default()).into_iter().collect();
    let states: Vec<String> = match query.get("state") {
        Some(list) => list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
        None => vec!["running".into(), "paused".into()],
    };
    if let Some(bad) = states.iter().find(|s| *s != "running" && *s != "paused") {
        return Err(E2bError::new(StatusCode::BAD_REQUEST, format!("unknown state {bad:?}: give running or paused")));
    }
    let metadata = query.get("metadata").map(|m| metadata_filter(m)).unwrap_or_default();
    let started_after = query.get("startedAfter").map(|t| parse_time(t));
    let listed: Vec<(SystemTime, Value)> = state
        .platform
        .live_sandboxes_of(&caller)?
        .into_iter()
        .filter_map(|r| e2b_state(&r).map(|s| (s, r)))
        .filter(|(s, _)| states.iter().any(|wanted| wanted == s))
        .filter(|(_, r)| metadata.iter().all(|(k, v)| r.sandbox.labels.get(k) == Some(v)))
        .filter(|(_, r)| query.get("template").is_none_or(|t| &r.sandbox.template == t))
        .map(|(s, r)| (r.sandbox.created_at.system_time(), listed_json(&r, s)))
        .filter(|(at, _)| started_after.is_none_or(|after| *at > after))
        .collect();
    page(listed, &query)
}

pub async fn detail(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, e2b_state) = visible(&state, &caller, &id)?;
    let record = sandbox.record();
    let mut detail = listed_json(record, e2b_state);
    detail["envdAccessToken"] = json!(envd_token(&state.platform, &id)?);
    detail["domain"] = json!(state.preview_domain);
    detail["allowInternetAccess"] = json!(record.sandbox.network.egress != Egress::None);
    detail["network"] = network_json(&record.sandbox.network);
    let on_timeout = if pauses_on_timeout(&record.sandbox.lifecycle) { "pause" } else { "kill" };
    detail["lifecycle"] = json!({"onTimeout": on_timeout, "autoResume": false});
    Ok(Json(detail))
}

/// A SPACE network as E2B's rules: the reverse of `network::E2bNetwork`.
fn network_json(network: &Network) -> Value {
    match network.egress {
        Egress::None => json!({"denyOut": ["0.0.0.0/0"]}),
        Egress::Allowlist => json!({"denyOut": ["0.0.0.0/0"], "allowOut": network.allow}),
        Egress::Public => json!({"denyOut": network.deny}),
    }
}

/// `PUT /sandboxes/{id}/network`: E2B's rules replace the sandbox's
/// network at once (what an update leaves out is cleared: all traffic
/// allowed, as E2B's default is), or are refused and change nothing.
pub async fn update_network(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let rules: crate::network::E2bNetwork = json_body(&body)?;
    let network = rules.to_space(None)?;
    state.platform.set_network(&sandbox, network)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /sandboxes/{id}`: answers once the sandbox is gone.
pub async fn kill(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let caller = caller(&state, &headers)?;
    let sandbox = owned(&state, &caller, &id)?;
    let (_, operation) = state.platform.request(&sandbox, OperationKind::Delete, None)?;
    settle(&state, &operation.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimeoutBody {
    timeout: Option<u64>,
}

/// A pause's body: `memory: false` asks for a pause that drops memory.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    memory: Option<bool>,
}

/// A connect's (or the deprecated resume's) body.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConnectBody {
    timeout: Option<u64>,
    /// False asks for a cold boot from the disk alone; SPACE resumes memory.
    memory: Option<bool>,
    /// Only in the deprecated resume: what the sandbox does at its timeout.
    auto_pause: Option<bool>,
}

/// `POST /sandboxes/{id}/timeout`: the sandbox now ends `timeout` seconds
/// from now (E2B's `endAt`), kept in its lifecycle policies.
pub async fn set_timeout(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let body: TimeoutBody = json_body(&body)?;
    let timeout_s = body
        .timeout
        .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, "give the new timeout in seconds as `timeout`"))?;
    extend(&state, &sandbox, timeout_s, true)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Sets the sandbox's end `timeout_s` from now; `shorten: false` keeps a
/// later end it already had.
pub(crate) fn extend(state: &E2bState, sandbox: &OwnedSandbox, timeout_s: u64, shorten: bool) -> Result<(), E2bError> {
    let record = sandbox.record();
    let lifecycle = &record.sandbox.lifecycle;
    let wanted = SystemTime::now() + Duration::from_secs(timeout_s);
    if !shorten && end_at(record) >= wanted {
        return Ok(());
    }
    let updated =
        lifecycle_for(record.sandbox.created_at.system_time(), timeout_s, pauses_on_timeout(lifecycle), lifecycle);
    state.platform.set_lifecycle(sandbox, &updated)?;
    Ok(())
}

/// `POST /sandboxes/{id}/pause`: E2B's pause keeps the sandbox until a
/// connect, memory included, without holding the host's memory: a SPACE
/// suspend (a snapshot on disk).
pub async fn pause(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let body: PauseBody = json_body(&body)?;
    if body.memory == Some(false) {
        // SPACE keeps a paused sandbox's memory (a suspend writes it to
        // disk) and has no pause that drops it to cold-boot later.
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            "a pause without memory (keep_memory=False) is not supported by SPACE: pause keeps memory; the \
             sandbox was not paused",
        ));
    }
    if e2b_state(&settled(&state, &sandbox).await?) != Some("running") {
        return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox {id} is already paused")));
    }
    let (_, operation) = state.platform.request(&sandbox, OperationKind::Suspend, None)?;
    settle(&state, &operation.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v2/sandboxes/{id}/connect`: a running sandbox's end moves to at
/// least `timeout` from now (200); a paused one is resumed first (201).
pub async fn connect(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let body: ConnectBody = json_body(&body)?;
    if body.memory == Some(false) {
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            "resuming from the disk alone (memory: false) is not supported by SPACE",
        ));
    }
    if body.auto_pause.is_some_and(|pauses| pauses != pauses_on_timeout(&sandbox.record().sandbox.lifecycle)) {
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            "a resume cannot change what the sandbox does at its timeout (autoPause) in SPACE",
        ));
    }
    let timeout_s = body.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    let Some(e2b_state) = e2b_state(&settled(&state, &sandbox).await?) else {
        return Err(E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found")));
    };
    let resumed = e2b_state == "paused";
    if resumed {
        let (_, operation) = state.platform.request(&sandbox, OperationKind::Resume, None)?;
        settle(&state, &operation.id).await?;
    } else {
        // Running to its user; awake (and answering) before the answer.
        let _session = state.platform.session(&sandbox).await?;
    }
    // As the resume (or the wake-up) left it.
    let sandbox = state.platform.reload(&sandbox)?;
    extend(&state, &sandbox, timeout_s, resumed)?;
    let sandbox = state.platform.reload(&sandbox)?;
    let record = sandbox.record();
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sandbox_json(&state, record)?)))
}

/// The deprecated `POST /sandboxes/{id}/resume`: a connect that answers 201.
pub async fn resume(
    state: State<E2bState>,
    headers: HeaderMap,
    id: Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let (_, json) = connect(state, headers, id, body).await?;
    Ok((StatusCode::CREATED, json))
}

/// `GET /sandboxes/{id}/metrics`: the sandbox's samples between `start`
/// and `end` (unix seconds; default: all kept), else one taken now if now
/// is between them.
pub async fn metrics(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, E2bError> {
    let caller = caller(&state, &headers)?;
    let (sandbox, _) = visible(&state, &caller, &id)?;
    let record = sandbox.record();
    let usage = state.platform.sandbox_usage(&sandbox).await?;
    let query: BTreeMap<String, String> = form_pairs(query.as_deref().unwrap_or_default()).into_iter().collect();
    let bound = |name: &str| query.get(name).and_then(|v| v.parse::<u64>().ok());
    let (start, end) = (bound("start").unwrap_or(0), bound("end").unwrap_or(u64::MAX));
    let unix = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs();
    let sample = |at: SystemTime, cpu: f64, memory: u64, disk: u64| {
        json!({
            "timestamp": rfc3339(at),
            "timestampUnix": unix(at),
            "cpuCount": record.sandbox.vcpus,
            "cpuUsedPct": cpu,
            "memUsed": memory,
            "memTotal": usage.memory_limit_bytes,
            "memCache": 0,
            "diskUsed": disk,
            "diskTotal": usage.disk_quota_bytes,
        })
    };
    let mut samples: Vec<Value> = usage
        .history
        .iter()
        .map(|p| (p.at.system_time(), p))
        .filter(|(at, _)| (start..=end).contains(&unix(*at)))
        .map(|(at, p)| sample(at, p.cpu_percent, p.memory_bytes, p.disk_bytes))
        .collect();
    // A new sandbox has no sample kept yet: one taken now stands in, when
    // now is in the range asked for (a range in the past gets none).
    let now = SystemTime::now();
    if samples.is_empty() && (start..=end).contains(&unix(now)) {
        samples.push(sample(now, usage.cpu_percent, usage.memory_bytes, usage.disk_bytes));
    }
    Ok(Json(Value::Array(samples)))
}

/// Anything else E2B's SDK may call (templates, snapshots, volumes, ...).
pub async fn unsupported() -> E2bError {
    E2bError::new(StatusCode::NOT_IMPLEMENTED, "not supported by SPACE's E2B-compatible API")
}
