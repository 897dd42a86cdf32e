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
use futures_util::StreamExt;
use serde_json::{json, Value};
use space_engine::{AgentConn, FileRead};

use super::connect::{RpcError, MAX_MESSAGE};
use super::error::E2bError;
use super::target::{agent, target};
use super::wire::header;
use super::{filesystem, process};
use crate::E2bState;
use space_node::error::file_error;
use space_node::MAX_FILE_BYTES;

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
    let target = match target(&state, &headers) {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    let path = target.path(query.get("path").map(String::as_str).unwrap_or_default());
    let (agent, work) = match agent(&state, &target).await {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
    match agent.read_file(&path, false).await {
        Ok(FileRead::File { info, data }) => {
            let body = Body::from_stream(futures_util::stream::unfold((data, work), |(mut data, work)| async move {
                match data.next_chunk().await {
                    Ok(Some(chunk)) => Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), (data, work))),
                    Ok(None) => None,
                    Err(err) => Some((Err(std::io::Error::other(err.to_string())), (data, work))),
                }
            }));
            let mut response = Response::new(body);
            let headers = response.headers_mut();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(info.size));
            response
        }
        Ok(FileRead::Dir(_)) => {
            E2bError::new(StatusCode::BAD_REQUEST, format!("{path} is a directory")).into_response()
        }
        Err(err) => rest_file_error(err).into_response(),
    }
}

/// Writes one file from a stream of chunks (gzip-decoded when asked).
async fn write_one<S, E>(agent: &AgentConn, path: &str, mut chunks: S, gzip: bool) -> Result<Value, E2bError>
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    use std::io::Write as _;
    let upload = agent.write_file(path, 0o644, false).await.map_err(rest_file_error)?;
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
    let target = match target(&state, &headers) {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    let query = Query::<BTreeMap<String, String>>::try_from_uri(request.uri()).map(|q| q.0).unwrap_or_default();
    let given = query.get("path").cloned();
    let (agent, _work) = match agent(&state, &target).await {
        Ok(found) => found,
        Err(refused) => return refused.into_response(),
    };
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
            match write_one(&agent, &path, field, false).await {
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
        match write_one(&agent, &path, request.into_body().into_data_stream(), gzip).await {
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
    headers: HeaderMap,
    body: Body,
) -> Response {
    let target = match target(&state, &headers) {
        Ok(target) => target,
        Err(refused) => return refused.into_response(),
    };
    match (service.as_str(), method.as_str()) {
        ("process.Process", "Start") => process::start(state, target, &headers, body).await,
        ("process.Process", "Connect") => process::connect(state, target, &headers, body).await,
        ("process.Process", "StreamInput") => process::stream_input(state, target, body).await,
        ("process.Process", _) | ("filesystem.Filesystem", _) => {
            let request = match unary_request(body).await {
                Ok(request) => request,
                Err(err) => return err.into_response(),
            };
            let answered = if service == "process.Process" {
                process::unary(&state, &target, &method, request).await
            } else {
                filesystem::unary(&state, &target, &method, request).await
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
