//! `/v1/sandboxes/{id}/files`: read, write and delete paths inside a
//! sandbox, streamed both ways. Paths are resolved by the agent inside the
//! sandbox; nothing here touches a host path.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use space_api::{ErrorBody, ErrorCode};
use space_engine::{AgentConn, FileRead};
use space_http::extract::ApiQuery;

use super::access::SandboxPath;
use crate::access::OwnedSandbox;
use crate::error::ApiError;
use crate::session::Session;
use crate::state::AppState;
pub(crate) use space_node::error::file_error;

/// The largest file one PUT may write.
pub use space_node::MAX_FILE_BYTES;

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct FileQuery {
    /// Absolute path inside the sandbox (or the volume).
    pub(crate) path: String,
    /// For PUT: permission bits in octal (default 0644).
    pub(crate) mode: Option<String>,
    /// For DELETE: remove a directory with everything in it.
    pub(crate) recursive: Option<bool>,
    /// `tar`: GET a directory as a tar archive, or PUT one to unpack into
    /// the directory `path`.
    pub(crate) format: Option<String>,
}

/// What a files request does, for the parameters that apply to it.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum FileAction {
    Read,
    Write,
    Delete,
}

impl FileQuery {
    /// The query, refused (400) where it names a parameter the action
    /// would not honour.
    pub(crate) fn checked(self, action: FileAction) -> Result<FileQuery, ApiError> {
        let refuse = |why: &str| Err(ApiError::bad_request(why.to_string()));
        if self.mode.is_some() && (action != FileAction::Write || self.format.is_some()) {
            return refuse("mode applies to writing a single file (a tar's entries carry their own)");
        }
        if self.recursive.is_some() && action != FileAction::Delete {
            return refuse("recursive applies to DELETE");
        }
        if self.format.is_some() && action == FileAction::Delete {
            return refuse("format applies to GET and PUT");
        }
        Ok(self)
    }

    pub(crate) fn tar(&self) -> Result<bool, ApiError> {
        match self.format.as_deref() {
            None => Ok(false),
            Some("tar") => Ok(true),
            Some(other) => Err(ApiError::bad_request(format!("format must be tar, got {other:?}"))),
        }
    }
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct FileWritten {
    pub path: String,
    pub size: u64,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct FileEntry {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    /// Permission bits in octal, such as `0644`.
    pub mode: String,
    /// Last modification, RFC 3339.
    pub mtime: space_api::Timestamp,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct DirListing {
    pub entries: Vec<FileEntry>,
}

pub(crate) fn checked_path(path: &str) -> Result<&str, ApiError> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(ApiError::bad_request(format!("path must be an absolute path, got {path:?}")));
    }
    Ok(path)
}

/// The running sandbox's agent (woken first if the server paused it for
/// idleness), with the session that keeps it awake; or why there is none.
pub(crate) async fn agent_for(state: &AppState, sandbox: &OwnedSandbox) -> Result<(AgentConn, Session), ApiError> {
    let session = state.platform.session(sandbox).await?;
    let agent = session.agent("use its files")?.clone();
    Ok((agent, session))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), FileQuery),
    responses(
        (status = 200, description = "A regular file's bytes (application/octet-stream), or a directory's listing", body = DirListing),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn read(
    SandboxPath { sandbox, .. }: SandboxPath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<FileQuery>,
) -> Result<Response, ApiError> {
    let query = query.checked(FileAction::Read)?;
    checked_path(&query.path)?;
    query.tar()?;
    let (agent, work) = agent_for(&state, &sandbox).await?;
    state.platform.mark_active(&sandbox);
    read_with(&agent, work, &query).await
}

/// A read through `agent` (a sandbox's, or a volume's files child), whose
/// body keeps `keep` until it has streamed.
pub(crate) async fn read_with<K: Send + 'static>(
    agent: &AgentConn,
    keep: K,
    query: &FileQuery,
) -> Result<Response, ApiError> {
    let path = checked_path(&query.path)?;
    let tar = query.tar()?;
    let work = keep;
    match agent.read_file(path, tar).await.map_err(file_error)? {
        FileRead::Dir(listing) => {
            let entries = listing
                .entries
                .into_iter()
                .map(|e| FileEntry {
                    name: e.name,
                    kind: e.kind,
                    size: e.size,
                    mode: format!("{:04o}", e.mode),
                    mtime: (std::time::UNIX_EPOCH + std::time::Duration::from_secs(e.mtime.max(0) as u64)).into(),
                })
                .collect();
            Ok(Json(DirListing { entries }).into_response())
        }
        FileRead::File { info, data } => {
            // The body streams after this returns: it keeps the sandbox awake.
            let chunks = futures_util::stream::unfold((data, work), |(mut data, work)| async move {
                match data.next_chunk().await {
                    Ok(Some(bytes)) => Some((Ok::<_, std::io::Error>(Bytes::from(bytes)), (data, work))),
                    Ok(None) => None,
                    // Cut the body short: the length header tells the client.
                    Err(err) => Some((Err(std::io::Error::other(err.to_string())), (data, work))),
                }
            });
            let mut response = Response::new(Body::from_stream(chunks));
            let headers = response.headers_mut();
            if tar {
                // An archive's length is not known until it is written.
                headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-tar"));
            } else {
                headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
                headers.insert(header::CONTENT_LENGTH, HeaderValue::from(info.size));
            }
            headers
                .insert("x-file-mode", HeaderValue::from_str(&format!("{:04o}", info.mode)).expect("octal is ASCII"));
            Ok(response)
        }
    }
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), FileQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 201, description = "Written (parent directories created)", body = FileWritten),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn write(
    SandboxPath { sandbox, .. }: SandboxPath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<FileQuery>,
    body: Body,
) -> Result<(StatusCode, Json<FileWritten>), ApiError> {
    let query = query.checked(FileAction::Write)?;
    let path = checked_path(&query.path)?.to_string();
    let mode = write_mode(&query)?;
    let tar = query.tar()?;
    let (agent, _work) = agent_for(&state, &sandbox).await?;
    // The file lands in the sandbox's root, under its own quota; the host's
    // reserve still comes first.
    state.platform.check_reserve("upload a file", 0)?;
    let written = write_with(&agent, path, mode, tar, body).await?;
    state.platform.mark_active(&sandbox);
    Ok(written)
}

/// The mode a PUT asks for (default 0644).
pub(crate) fn write_mode(query: &FileQuery) -> Result<u32, ApiError> {
    match &query.mode {
        None => Ok(0o644),
        Some(text) => u32::from_str_radix(text, 8).ok().filter(|m| *m <= 0o7777).ok_or_else(|| {
            ApiError::bad_request(format!("mode must be octal permission bits such as 0644, got {text:?}"))
        }),
    }
}

/// A write of `body` through `agent` (a file, or a tar unpacked into `path`).
pub(crate) async fn write_with(
    agent: &AgentConn,
    path: String,
    mode: u32,
    tar: bool,
    body: Body,
) -> Result<(StatusCode, Json<FileWritten>), ApiError> {
    let upload = agent.write_file(&path, mode, tar).await.map_err(file_error)?;
    let mut stream = body.into_data_stream();
    let mut size = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        size += chunk.len();
        if size > MAX_FILE_BYTES {
            return Err(ApiError::new(ErrorCode::TooLarge, format!("a file may be at most {MAX_FILE_BYTES} bytes")));
        }
        for piece in chunk.chunks(space_proto::MAX_OUTPUT_CHUNK) {
            upload.send(piece.to_vec()).await.map_err(file_error)?;
        }
    }
    upload.finish().await.map_err(file_error)?;
    Ok((StatusCode::CREATED, Json(FileWritten { path, size: size as u64 })))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), FileQuery),
    responses((status = 204, description = "Deleted"), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn delete(
    SandboxPath { sandbox, .. }: SandboxPath,
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<FileQuery>,
) -> Result<StatusCode, ApiError> {
    let query = query.checked(FileAction::Delete)?;
    let path = checked_path(&query.path)?;
    let (agent, _work) = agent_for(&state, &sandbox).await?;
    agent.delete_path(path, query.recursive.unwrap_or(false)).await.map_err(file_error)?;
    state.platform.mark_active(&sandbox);
    Ok(StatusCode::NO_CONTENT)
}
