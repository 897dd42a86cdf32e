//! What E2B's code interpreter (`e2b-code-interpreter`) adds: its SDK sends
//! `/execute` and `/contexts` to the envd URL, naming port 49999 in
//! `E2b-Sandbox-Port`. They are SPACE's code contexts (`contexts.rs`) in
//! E2B's shapes: a run without a context goes to the sandbox's default
//! context of its language; results are flattened (`text`, `html`, `png`,
//! ...); the traceback is one string; the end is `number_of_executions`.
//! The context routes carry no envd token, only the sandbox's
//! `E2B-Traffic-Access-Token` (create and connect answer it). A client that
//! goes away before a run ends interrupts it, as E2B's server does.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use space_api::{CodeContext, CreateContextRequest, RunCodeRequest};

use super::error::E2bError;
use super::target::{agent, target_on, Target, INTERPRETER_PORT};
use space_node::contexts::Run;

use crate::access::OwnedSandbox;
use crate::platform::Platform;
use crate::session::Session;
use crate::E2bState;

/// E2B's result fields for the MIME types it names; others go to `extra`.
const FIELDS: &[(&str, &str)] = &[
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
];

/// Where E2B's contexts start when the caller names no directory: the
/// home of E2B's default user (the interpreter itself runs as root, as
/// E2B's does).
const E2B_CWD: &str = "/home/user";

/// The languages E2B's code interpreter starts a context of on a new
/// sandbox (its listing shows them).
const DEFAULT_LANGUAGES: &[&str] = &["python", "javascript"];

/// A result's text as E2B's server gives it: one pair of quotes around a
/// repr (`'/home/user'`) taken off.
fn e2b_text(text: &str) -> &str {
    for quote in ['\'', '"'] {
        if text.len() >= 2 && text.starts_with(quote) && text.ends_with(quote) {
            return &text[1..text.len() - 1];
        }
    }
    text
}

#[derive(Deserialize)]
struct ExecuteBody {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
struct ContextBody {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, E2bError> {
    serde_json::from_slice(body).map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("invalid body: {e}")))
}

/// SPACE's language for E2B's name of it.
fn language(given: Option<&str>) -> Result<String, E2bError> {
    match given.unwrap_or("python") {
        "python" | "python3" => Ok("python".into()),
        "javascript" | "js" => Ok("javascript".into()),
        "typescript" | "ts" => Ok("typescript".into()),
        "bash" | "sh" => Ok("bash".into()),
        other => Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            format!("language {other:?} is not served here: python, javascript, typescript or bash"),
        )),
    }
}

/// The sandbox, awake (an idle-paused one is woken), for a context route.
async fn awake(state: &E2bState, headers: &HeaderMap) -> Result<(Target, Session), E2bError> {
    let target = target_on(state, headers, INTERPRETER_PORT)?;
    let (_, session) = agent(state, &target).await?;
    Ok((target, session))
}

fn context_json(context: &CodeContext) -> Value {
    json!({"id": context.id, "language": context.language, "cwd": context.cwd})
}

fn answer<T: IntoResponse>(result: Result<T, E2bError>) -> Response {
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `POST /contexts` `{"language", "cwd"}` → `{"id", "language", "cwd"}`.
pub async fn create(State(state): State<E2bState>, headers: HeaderMap, body: Bytes) -> Response {
    answer(
        async {
            let body: ContextBody = if body.is_empty() { ContextBody::default() } else { parse(&body)? };
            let (_, session) = awake(&state, &headers).await?;
            let request = CreateContextRequest {
                language: Some(language(body.language.as_deref())?),
                cwd: body.cwd,
                env: Default::default(),
            };
            let context = state.platform.create_context_preferring(&session, request, E2B_CWD).await?;
            Ok(Json(context_json(&context)))
        }
        .await,
    )
}

/// `GET /contexts`: the sandbox's contexts, oldest first. E2B's server
/// starts a python and a javascript context with the sandbox, and its
/// listing shows them: they are started here if they are not yet (a
/// language the template cannot run is left out), and listed first, as
/// made with the sandbox.
pub async fn list(State(state): State<E2bState>, headers: HeaderMap) -> Response {
    answer(
        async {
            let target = target_on(&state, &headers, INTERPRETER_PORT)?;
            let contexts = state.platform.contexts(&target.sandbox)?;
            let missing = DEFAULT_LANGUAGES
                .iter()
                .any(|language| !contexts.iter().any(|c| c.language == *language && c.state != "dead"));
            if missing {
                let (target, session) = awake(&state, &headers).await?;
                for language in DEFAULT_LANGUAGES {
                    if let Err(err) = state.platform.default_context(&session, language, E2B_CWD).await {
                        tracing::debug!(sandbox = %target.sandbox.id(), "no default {language} context: {err}");
                    }
                }
            }
            let contexts = state.platform.contexts_defaults_first(&target.sandbox)?;
            Ok(Json(Value::Array(contexts.iter().map(context_json).collect())))
        }
        .await,
    )
}

/// `DELETE /contexts/{id}`.
pub async fn delete(State(state): State<E2bState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    answer(
        async {
            let target = target_on(&state, &headers, INTERPRETER_PORT)?;
            let session = state.platform.session(&target.sandbox).await?;
            state.platform.delete_context(&session, &id).await?;
            Ok(StatusCode::NO_CONTENT)
        }
        .await,
    )
}

/// `POST /contexts/{id}/restart`: a fresh interpreter.
pub async fn restart(State(state): State<E2bState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    answer(
        async {
            let (_, session) = awake(&state, &headers).await?;
            state.platform.restart_context(&session, &id).await?;
            Ok(StatusCode::NO_CONTENT)
        }
        .await,
    )
}

/// Interrupts the run if its client goes away before the end. It keeps the
/// context's run (`held`) until the interrupt is sent: let go at once, the
/// client's next run could start first and take the interrupt meant for
/// this one (opening the session takes a moment).
struct Unfinished {
    platform: Arc<Platform>,
    sandbox: OwnedSandbox,
    context: String,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
    ended: bool,
}

/// Whether the sandbox still runs (its interpreter died on its own) or not
/// (it was killed, or is being).
fn sandbox_runs(platform: &Platform, sandbox: &OwnedSandbox) -> bool {
    platform.reload(sandbox).is_ok_and(|now| now.record().sandbox.state == space_api::SandboxState::Running)
}

/// An answer whose connection drops before its first line: E2B's SDK then
/// asks whether the sandbox runs, and says it was killed.
fn dropped() -> Response {
    let gone = std::io::Error::other("the sandbox stopped during the run");
    Response::new(Body::from_stream(futures_util::stream::once(async move { Err::<Bytes, _>(gone) })))
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.ended {
            let (platform, sandbox, context) = (self.platform.clone(), self.sandbox.clone(), self.context.clone());
            let held = self.held.take();
            tokio::spawn(async move {
                if let Ok(session) = platform.session(&sandbox).await {
                    let _ = platform.interrupt_context(&session, &context).await;
                }
                drop(held);
            });
        }
    }
}

/// One of SPACE's run events as E2B's lines (none for what E2B has no
/// line for).
fn e2b_lines(event: &Value, errored: &mut bool) -> Vec<Value> {
    let timestamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    match event["type"].as_str().unwrap_or_default() {
        kind @ ("stdout" | "stderr") => {
            vec![json!({"type": kind, "text": event["text"], "timestamp": timestamp as u64})]
        }
        "result" => {
            let mut result = Map::new();
            result.insert("type".into(), json!("result"));
            let mut extra = Map::new();
            for (mime, value) in event["data"].as_object().into_iter().flatten() {
                match FIELDS.iter().find(|(known, _)| known == mime) {
                    Some((_, "text")) => result.insert(
                        "text".into(),
                        match value.as_str() {
                            Some(text) => json!(e2b_text(text)),
                            None => value.clone(),
                        },
                    ),
                    Some((_, field)) => result.insert((*field).into(), value.clone()),
                    None => extra.insert(mime.clone(), value.clone()),
                };
            }
            if !extra.is_empty() {
                result.insert("extra".into(), Value::Object(extra));
            }
            result.insert("is_main_result".into(), json!(event["is_main_result"].as_bool().unwrap_or(false)));
            vec![Value::Object(result)]
        }
        "error" => {
            *errored = true;
            let traceback: Vec<&str> =
                event["traceback"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            vec![
                json!({"type": "error", "name": event["name"], "value": event["value"], "traceback": traceback.join("\n")}),
            ]
        }
        "end" => {
            let mut lines = Vec::new();
            if event["status"] == "died" && !*errored {
                let why = event["error"].as_str().unwrap_or("the interpreter exited");
                lines.push(json!({"type": "error", "name": "InterpreterDied", "value": why, "traceback": why}));
            }
            if let Some(count) = event["execution_count"].as_u64() {
                lines.push(json!({"type": "number_of_executions", "execution_count": count}));
            }
            lines
        }
        _ => vec![],
    }
}

/// `POST /execute` `{"code", "context_id", "language", "env_vars"}`: the run's
/// output as NDJSON lines in E2B's shapes, as it happens.
pub async fn execute(State(state): State<E2bState>, headers: HeaderMap, body: Bytes) -> Response {
    answer(
        async {
            let body: ExecuteBody = parse(&body)?;
            let (target, session) = awake(&state, &headers).await?;
            let language = language(body.language.as_deref())?;
            let started = async {
                let context = match body.context_id {
                    Some(id) => id,
                    None => state.platform.default_context(&session, &language, E2B_CWD).await?.id,
                };
                let request =
                    RunCodeRequest { code: body.code, timeout_s: None, env: body.env_vars.unwrap_or_default() };
                let run = state.platform.run_code(&session, &context, request).await?;
                Ok::<_, space_node::error::NodeError>((context, run))
            }
            .await;
            drop(session);
            let (context, run) = match started {
                Ok(started) => started,
                // Killed while its default context started: the connection
                // drops, as when it is killed during the run.
                Err(_) if !sandbox_runs(&state.platform, &target.sandbox) => return Ok(dropped()),
                Err(err) => return Err(err.into()),
            };
            let Run { events, held } = run;
            let unfinished = Unfinished {
                platform: state.platform.clone(),
                sandbox: target.sandbox,
                context,
                held: Some(held),
                ended: false,
            };
            let lines = futures_util::stream::unfold(Some((events, unfinished, false)), |state| async move {
                let (mut events, mut unfinished, mut errored) = state?;
                let event = events.recv().await?;
                let end = event["type"] == "end";
                if end && event["status"] == "died" && !sandbox_runs(&unfinished.platform, &unfinished.sandbox) {
                    // E2B's connection drops with a killed sandbox: its SDK
                    // then finds the sandbox gone and says so.
                    unfinished.ended = true;
                    let gone = std::io::Error::other("the sandbox stopped during the run");
                    return Some((Err(gone), None));
                }
                let text: String = e2b_lines(&event, &mut errored).iter().map(|line| format!("{line}\n")).collect();
                unfinished.ended = end;
                Some((Ok::<_, std::io::Error>(text), (!end).then_some((events, unfinished, errored))))
            });
            let mut response = Response::new(Body::from_stream(lines));
            response
                .headers_mut()
                .insert(axum::http::header::CONTENT_TYPE, axum::http::HeaderValue::from_static("application/x-ndjson"));
            Ok(response)
        }
        .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_reads_as_e2b_gives_it() {
        let event = json!({"type": "result", "is_main_result": true, "data": {
            "text/plain": "'/home/user'", "e2b/data": {"a": [1]}, "e2b/chart": {"type": "bar"},
            "application/x-other": "kept"}});
        let line = &e2b_lines(&event, &mut false)[0];
        assert_eq!(line["text"], "/home/user");
        assert_eq!(line["data"], json!({"a": [1]}));
        assert_eq!(line["chart"], json!({"type": "bar"}));
        assert_eq!(line["extra"], json!({"application/x-other": "kept"}));
        for (given, shown) in [("\"q\"", "q"), ("'", "'"), ("['a']", "['a']"), ("'a' 'b'", "a' 'b"), ("42", "42")] {
            assert_eq!(e2b_text(given), shown, "{given}");
        }
    }
}
