//! E2B's in-sandbox API (envd) served by the host: every request names its
//! sandbox in `E2b-Sandbox-Id` and carries the sandbox's `X-Access-Token`;
//! the work goes to the sandbox's agent like SPACE's own file and command
//! requests.

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use futures_util::StreamExt;
use serde_json::{json, Value};
use space_engine::{AgentConn, FileRead};

use super::connect::{Envelopes, RpcError, MAX_MESSAGE};
use super::error::E2bError;
use super::target::{agent, envd_token, target, wrong_token, Target};
use super::wire::header;
use super::{filesystem, process};
use crate::session::Session;
use crate::E2bState;
use space_node::error::file_error;
use space_node::MAX_FILE_BYTES;

/// E2B's default user: its sandboxes have an account `user` (home
/// `/home/user`, passwordless sudo), and envd acts as it unless asked for
/// another. SPACE's E2B sandboxes have it too (see `control.rs`); in a
/// sandbox without it (a template of SPACE's own), envd acts as root.
pub const DEFAULT_USER: &str = "user";

/// The sandboxes known to have E2B's default user (read from their
/// `/etc/passwd`: the account comes with the template).
fn has_default_user_cache() -> &'static std::sync::Mutex<std::collections::HashMap<String, bool>> {
    static CACHE: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, bool>>> =
        std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Whether `/etc/passwd` text has an account named `name`.
fn passwd_has(passwd: &str, name: &str) -> bool {
    passwd.lines().any(|line| line.split(':').next() == Some(name))
}

async fn has_default_user(agent: &AgentConn, sandbox_id: &str) -> bool {
    if let Some(known) = has_default_user_cache().lock().unwrap_or_else(|e| e.into_inner()).get(sandbox_id) {
        return *known;
    }
    let mut passwd = Vec::new();
    if let Ok(FileRead::File { mut data, .. }) = agent.read_file("/etc/passwd", false).await {
        while let Ok(Some(chunk)) = data.next_chunk().await {
            passwd.extend_from_slice(&chunk);
            if passwd.len() > 4 << 20 {
                break;
            }
        }
    }
    let found = passwd_has(&String::from_utf8_lossy(&passwd), DEFAULT_USER);
    if found {
        // Only a yes is kept: an account made later is found next time.
        let mut cache = has_default_user_cache().lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() > 4096 {
            cache.clear();
        }
        cache.insert(sandbox_id.to_string(), true);
    }
    found
}

/// The sandbox's agent, with who acts settled in `target.user`: whom the
/// request names, else E2B's default user where the sandbox has it, else
/// root. Paths resolve against that user's home.
pub(crate) async fn acting(state: &E2bState, target: &mut Target) -> Result<(AgentConn, Session), E2bError> {
    let (agent, work) = agent(state, target).await?;
    if target.user.is_none() {
        let user = if has_default_user(&agent, &target.id).await { DEFAULT_USER } else { "root" };
        target.user = Some(user.to_string());
    }
    Ok((agent, work))
}

/// Whom what the request makes belongs to (`None`: root).
pub(crate) fn owner_of(target: &Target) -> Option<String> {
    target.user.clone().filter(|user| user != "root")
}

/// E2B's signature of a file URL (`download_url`/`upload_url`): `v1_` and
/// the unpadded base64 of SHA-256 over `path:operation:user:token`, with
/// `:expiration` when the URL expires. `user` is as the URL names it
/// (empty for the default).
fn signature(path: &str, operation: &str, user: &str, token: &str, expiration: Option<&str>) -> String {
    use sha2::Digest as _;
    let raw = match expiration {
        Some(expiration) => format!("{path}:{operation}:{user}:{token}:{expiration}"),
        None => format!("{path}:{operation}:{user}:{token}"),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

/// The target of a `/files` request: by the sandbox's `X-Access-Token`,
/// or by a signed URL (`signature`, `signature_expiration`: what the SDK's
/// `download_url`/`upload_url` give, which carry no header). A signed URL
/// names its sandbox in `E2b-Sandbox-Id` when a client sends one; a bare
/// one (fetched by a browser or `curl`) is matched against the sandboxes
/// this server holds: only the sandbox whose token made the signature
/// matches. Every comparison takes the same time whatever the bytes.
fn files_target(
    state: &E2bState,
    headers: &HeaderMap,
    query: &BTreeMap<String, String>,
    operation: &str,
) -> Result<Target, E2bError> {
    let Some(signed) = query.get("signature") else {
        return target(state, headers);
    };
    let expiration = query.get("signature_expiration").map(String::as_str);
    if let Some(expiration) = expiration {
        let at: i64 = expiration
            .parse()
            .map_err(|_| E2bError::new(StatusCode::BAD_REQUEST, "signature_expiration must be a Unix time"))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        if at < now as i64 {
            return Err(E2bError::new(StatusCode::UNAUTHORIZED, "signature is already expired"));
        }
    }
    let path = query.get("path").map(String::as_str).unwrap_or_default();
    let user = query.get("username").map(String::as_str).unwrap_or_default();
    let candidates = match header(headers, "e2b-sandbox-id").filter(|id| !id.is_empty()) {
        Some(id) => vec![id.to_string()],
        None => state.platform.held_sandbox_ids().map_err(E2bError::from)?,
    };
    let mut matched = None;
    for id in candidates {
        let Ok(token) = envd_token(&state.platform, &id) else { continue };
        let expected = signature(path, operation, user, &token, expiration);
        if space_proto::constant_time_eq(signed.as_bytes(), expected.as_bytes()) && matched.is_none() {
            matched = Some((id, token));
        }
    }
    let Some((id, token)) = matched else {
        return Err(E2bError::new(StatusCode::UNAUTHORIZED, "invalid signature"));
    };
    // From here as if the sandbox's own token had come in its header.
    let mut signed_headers = HeaderMap::new();
    signed_headers.insert("e2b-sandbox-id", HeaderValue::from_str(&id).map_err(|_| wrong_token())?);
    signed_headers.insert("x-access-token", HeaderValue::from_str(&token).map_err(|_| wrong_token())?);
    let mut target = target(state, &signed_headers)?;
    target.user = Some(user.to_string()).filter(|u| !u.is_empty());
    Ok(target)
}

/// The largest body of an RPC (a stdin message, base64).
pub const MAX_RPC_BODY: usize = MAX_MESSAGE + 1024;

/// `GET /health`: 204 while the sandbox runs.
pub async fn health(State(state): State<E2bState>, headers: HeaderMap) -> Response {
    let target = match target(&state, &headers) {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    match agent(&state, &target).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(refused) => refused.into_response(),
    }
}

/// A file error in envd's REST shape (404 for a missing file).
fn rest_file_error(err: space_engine::AgentError) -> E2bError {
    file_error(err).into()
}

/// `GET /files?path=...`: the file's bytes.
pub async fn read_file(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let mut target = match files_target(&state, &headers, &query, "read") {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    if let Some(user) = query.get("username").filter(|u| !u.is_empty()) {
        target.user = Some(user.clone());
    }
    let (agent, work) = match acting(&state, &mut target).await {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    let path = target.path(query.get("path").map(String::as_str).unwrap_or_default());
    match agent.read_file(&path, false).await {
        Ok(FileRead::File { info, data }) => {
            let body = Body::from_stream(futures_util::stream::unfold((data, work), |(mut data, work)| async move {
                match data.next_chunk().await {
                    Ok(Some(chunk)) => Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), (data, work))),
                    Ok(None) => None,
                    Err(err) => Some((Err(std::io::Error::other(err.to_string())), (data, work))),
                }
            }));
            // No Content-Length: the size a stat gives is not what a read
            // gives for every file (`/proc`'s say 0; a log grows), and the
            // agent sends what it reads.
            let _ = info;
            let mut response = Response::new(body);
            response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            response
        }
        Ok(FileRead::Dir(_)) => {
            E2bError::new(StatusCode::BAD_REQUEST, format!("{path} is a directory")).into_response()
        }
        Err(err) => rest_file_error(err).into_response(),
    }
}

/// Writes one file from a stream of chunks (gzip-decoded when asked).
/// Written in place, as envd writes (a program watching the directory sees
/// the file's own name created and written), owned by the acting user.
async fn write_one<S, E>(
    agent: &AgentConn,
    path: &str,
    owner: Option<String>,
    mut chunks: S,
    gzip: bool,
) -> Result<Value, E2bError>
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    use std::io::Write as _;
    let request =
        space_proto::FileRequest { path: path.into(), mode: Some(0o644), owner, in_place: true, ..Default::default() };
    let upload = agent.write_file_with(request).await.map_err(rest_file_error)?;
    let too_large =
        || E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("a file may be at most {MAX_FILE_BYTES} bytes"));
    let mut decoder = gzip.then(|| flate2::write::GzDecoder::new(Vec::new()));
    let mut size = 0usize;
    loop {
        let chunk = match chunks.next().await {
            Some(Ok(chunk)) => chunk.to_vec(),
            Some(Err(err)) => return Err(E2bError::new(StatusCode::BAD_REQUEST, format!("reading the upload: {err}"))),
            None => match decoder.take() {
                // The rest the decoder holds.
                Some(decoder) => decoder
                    .finish()
                    .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("the gzip stream is broken: {e}")))?,
                None => break,
            },
        };
        let plain = match decoder.as_mut() {
            Some(decoder) => {
                decoder
                    .write_all(&chunk)
                    .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("the gzip stream is broken: {e}")))?;
                std::mem::take(decoder.get_mut())
            }
            None => chunk,
        };
        size += plain.len();
        if size > MAX_FILE_BYTES {
            return Err(too_large());
        }
        for piece in plain.chunks(space_proto::MAX_OUTPUT_CHUNK) {
            upload.send(piece.to_vec()).await.map_err(rest_file_error)?;
        }
    }
    upload.finish().await.map_err(rest_file_error)?;
    let name = path.rsplit('/').next().unwrap_or(path).to_string();
    Ok(json!({"name": name, "type": "file", "path": path}))
}

/// `POST /files`: one or more files, as `multipart/form-data` (one part
/// named `file` per file, its filename the target unless `path` is given)
/// or as a raw body for `path` (gzip-compressed with `Content-Encoding`).
pub async fn write_files(State(state): State<E2bState>, request: Request) -> Response {
    let headers = request.headers().clone();
    let query = Query::<BTreeMap<String, String>>::try_from_uri(request.uri()).map(|q| q.0).unwrap_or_default();
    let mut target = match files_target(&state, &headers, &query, "write") {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    if let Some(user) = query.get("username").filter(|u| !u.is_empty()) {
        target.user = Some(user.clone());
    }
    if let Some((name, _)) = headers.iter().find(|(name, _)| name.as_str().starts_with("x-metadata-")) {
        // envd keeps them as the file's extended attributes, which
        // gVisor's filesystems do not hold for users: refused, never dropped.
        return E2bError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "file metadata ({name}) is not supported: the sandbox's filesystem keeps no user extended attributes"
            ),
        )
        .into_response();
    }
    let given = query.get("path").cloned();
    let (agent, _work) = match acting(&state, &mut target).await {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    let owner = owner_of(&target);
    if let Err(err) = state.platform.check_reserve("upload a file", 0) {
        return E2bError::from(err).into_response();
    }
    let content_type = header(&headers, "content-type").unwrap_or_default().to_ascii_lowercase();
    let mut written = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        let mut multipart = match axum::extract::Multipart::from_request(request, &state).await {
            Ok(multipart) => multipart,
            Err(err) => return E2bError::new(StatusCode::BAD_REQUEST, err.body_text()).into_response(),
        };
        loop {
            let field = match multipart.next_field().await {
                Ok(Some(field)) => field,
                Ok(None) => break,
                Err(err) => return E2bError::new(StatusCode::BAD_REQUEST, err.body_text()).into_response(),
            };
            if field.name() != Some("file") {
                continue;
            }
            let name = given.clone().or_else(|| field.file_name().map(str::to_string)).unwrap_or_default();
            if name.is_empty() {
                return E2bError::new(StatusCode::BAD_REQUEST, "a file part needs a filename or the path parameter")
                    .into_response();
            }
            let path = target.path(&name);
            match write_one(&agent, &path, owner.clone(), field, false).await {
                Ok(entry) => written.push(entry),
                Err(refused) => return refused.into_response(),
            }
        }
    } else {
        let Some(given) = given else {
            return E2bError::new(StatusCode::BAD_REQUEST, "give the target as the path parameter").into_response();
        };
        let gzip = header(&headers, "content-encoding").is_some_and(|e| e.eq_ignore_ascii_case("gzip"));
        let path = target.path(&given);
        match write_one(&agent, &path, owner, request.into_body().into_data_stream(), gzip).await {
            Ok(entry) => written.push(entry),
            Err(refused) => return refused.into_response(),
        }
    }
    if written.is_empty() {
        return E2bError::new(StatusCode::BAD_REQUEST, "no file in the request").into_response();
    }
    state.platform.mark_active(&target.sandbox);
    Json(written).into_response()
}

/// `POST /<package.Service>/<Method>`: a Connect RPC.
pub async fn rpc(
    State(state): State<E2bState>,
    Path((service, method)): Path<(String, String)>,
    reset: Option<axum::Extension<space_http::server::ResetOnClose>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let reset = reset.map(|axum::Extension(reset)| reset);
    let mut target = match target(&state, &headers) {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    match (service.as_str(), method.as_str()) {
        ("filesystem.Filesystem", "WatchDir") => {
            let request = match Envelopes::new(body).next().await {
                Ok(Some(request)) => request,
                Ok(None) => return RpcError::invalid("the request holds no message").into_response(),
                Err(err) => return err.into_response(),
            };
            let (agent, _work) = match acting(&state, &mut target).await {
                Ok(found) => found,
                Err(refused) => return refused.into_response(),
            };
            super::watch::stream(&agent, &target, &headers, &request).await
        }
        ("process.Process", "Start") => process::start(state, target, &headers, body, reset).await,
        ("process.Process", "Connect") => process::connect(state, target, &headers, body, reset).await,
        ("process.Process", "StreamInput") => process::stream_input(state, target, body).await,
        ("process.Process", _) | ("filesystem.Filesystem", _) => {
            let request = match unary_request(body).await {
                Ok(request) => request,
                Err(err) => return err.into_response(),
            };
            let answered = if service == "process.Process" {
                process::unary(&state, &target, &method, request).await
            } else {
                filesystem::unary(&state, &mut target, &method, request).await
            };
            match answered {
                Ok(value) => Json(value).into_response(),
                Err(err) => err.into_response(),
            }
        }
        _ => RpcError::new("unimplemented", format!("{service}/{method} is not served by SPACE")).into_response(),
    }
}

/// A unary call's JSON message (`{}` when the body is empty).
async fn unary_request(body: Body) -> Result<Value, RpcError> {
    let bytes = axum::body::to_bytes(body, MAX_RPC_BODY)
        .await
        .map_err(|e| RpcError::new("resource_exhausted", format!("reading the request: {e}")))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(&bytes).map_err(|e| RpcError::invalid(format!("the request is not JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_made_as_the_sdk_makes_them() {
        // SHA-256 of "a.txt:read::tok", as the SDK's `get_signature` hashes
        // a URL for the default user with no expiry.
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(b"a.txt:read::tok");
        let plain = format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest));
        assert_eq!(signature("a.txt", "read", "", "tok", None), plain);
        assert!(!signature("a.txt", "read", "", "tok", None).ends_with('='));
        // Every part counts.
        let expiring = signature("a.txt", "read", "", "tok", Some("1700000000"));
        assert_ne!(expiring, plain);
        assert_ne!(signature("a.txt", "write", "", "tok", None), plain);
        assert_ne!(signature("a.txt", "read", "user", "tok", None), plain);
        assert_ne!(signature("a.txt", "read", "", "other", None), plain);
    }

    #[test]
    fn the_default_user_is_found_by_name() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n";
        assert!(passwd_has(passwd, "user"));
        assert!(!passwd_has("root:x:0:0:root:/root:/bin/bash\nusers:x:100:100::/:/bin/sh\n", "user"));
    }
}
