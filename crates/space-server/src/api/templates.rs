//! `/v1/templates`: build from Debian packages (an operation), list,
//! inspect, delete; and `/v1/operations/{id}/log` for build logs.

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::StreamExt;
use space_api::{
    CreateTemplateRequest, ErrorBody, ErrorCode, Operation, Template, TemplateDefaultsRequest, TemplateList,
    TemplateOperation,
};
use space_http::extract::{json_rejection, ApiQuery, NoBody, NoQuery, MAX_JSON_BODY};
use tokio::io::AsyncWriteExt;

use super::access::{OperationPath, TemplatePath};
use crate::error::ApiError;
use crate::state::AppState;
use crate::templates::{checked_overrides, Upload};
use crate::tenants::Caller;

/// Query of `POST /v1/templates` with an image archive as the body.
#[derive(Debug, Default, PartialEq, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ImportQuery {
    /// The template's name (for an image archive body).
    name: Option<String>,
    /// Default vCPUs (over the image's and the platform's).
    vcpus: Option<u32>,
    /// Default memory in MiB.
    memory_mib: Option<u32>,
    /// Default disk in MiB.
    disk_mib: Option<u32>,
    /// Default working directory (over the image's `WorkingDir`).
    workdir: Option<String>,
    /// Default user (over the image's `User`).
    user: Option<String>,
    /// `gvisor` or `firecracker`: the engine its sandboxes run on.
    engine: Option<String>,
    /// The network of its sandboxes whose create names none, as JSON
    /// (`{"egress": "allowlist", "allow": [...]}`).
    network: Option<String>,
}

/// The largest image archive accepted (further limited by free disk).
pub const MAX_IMAGE_BYTES: u64 = 64 << 30;

#[utoipa::path(post, path = "/v1/templates", tag = "templates", params(ImportQuery),
    request_body(description = "JSON to build from Debian packages or to make a snapshot template of a sandbox \
        or a checkpoint, or an OCI image archive (`docker save` output or an OCI image layout in a tar, \
        optionally gzip-compressed) with `?name=`",
        content((CreateTemplateRequest = "application/json"), (Vec<u8> = "application/x-tar"))),
    responses((status = 202, description = "Accepted; follow the build operation", body = TemplateOperation),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "A snapshot template's sandbox or checkpoint is not there", body = ErrorBody),
        (status = 409, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 415, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 429, description = "The tenant's disk quota is used up", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiQuery(query): ApiQuery<ImportQuery>,
    request: Request,
) -> Result<(StatusCode, Json<TemplateOperation>), ApiError> {
    let content_type = request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let mime = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let (template, operation) = match mime.as_str() {
        "application/json" => {
            // Every parameter is for an image archive: a JSON build would
            // drop it (a `?network=` among them), so none is taken.
            if query != ImportQuery::default() {
                return Err(ApiError::bad_request(
                    "a JSON build takes its name and defaults in the body, none in the query",
                ));
            }
            let body = axum::body::to_bytes(request.into_body(), MAX_JSON_BODY).await.map_err(|_| {
                ApiError::new(ErrorCode::TooLarge, format!("the request body exceeds {} bytes", MAX_JSON_BODY))
            })?;
            let Json(request) = Json::<CreateTemplateRequest>::from_bytes(&body).map_err(json_rejection)?;
            match request.from.image.is_some() {
                // Resolved before it is accepted: an image that is not there
                // is the request's fault, told at once.
                true => state.platform.image_template(request, &caller).await?,
                false => state.platform.build_template(request, &caller)?,
            }
        }
        "application/x-tar" | "application/tar" | "application/gzip" => import(&state, &caller, query, request).await?,
        _ => {
            return Err(ApiError::new(
                ErrorCode::UnsupportedMediaType,
                "send JSON (`application/json`) to build from Debian packages, or an image archive \
                 (`application/x-tar`) with `?name=`",
            ))
        }
    };
    Ok((StatusCode::ACCEPTED, Json(TemplateOperation { template, operation })))
}

/// Streams an uploaded image archive to disk, then starts its import.
async fn import(
    state: &AppState,
    caller: &Caller,
    query: ImportQuery,
    request: Request,
) -> Result<(Template, Operation), ApiError> {
    let name = query.name.ok_or_else(|| ApiError::bad_request("give the template's name: ?name=<name>"))?;
    let overrides = checked_overrides(TemplateDefaultsRequest {
        vcpus: query.vcpus,
        memory_mib: query.memory_mib,
        disk_mib: query.disk_mib,
        env: Default::default(),
        workdir: query.workdir,
        user: query.user,
        command: None,
        network: match query.network.as_deref() {
            Some(json) => Some(serde_json::from_str(json).map_err(|e| {
                ApiError::bad_request(format!("network is a network as JSON: {e}"))
                    .with_details(serde_json::json!({"field": "network"}))
            })?),
            None => None,
        },
    })?;
    let engine = crate::templates::checked_engine(query.engine, state.platform.data().ext4_images())?;
    let slot = state.platform.reserve_build(&name, serde_json::json!({"oci": {}}), caller)?;
    let (free, _) = state.platform.data().disk_space();
    // The archive and the root made of it both take disk: each may have
    // half of what the tenant's quota and the host's reserve leave.
    let allowance = state.platform.build_allowance(&caller.tenant)?;
    let limit = MAX_IMAGE_BYTES.min(free / 2).min(allowance / 2);
    let too_large = || {
        if limit == allowance / 2 {
            crate::disk::quota_exceeded(
                &caller.tenant,
                "disk",
                format!(
                    "the archive exceeds {limit} bytes: half of what the tenant's disk quota (or the host's \
                     free space above its reserve) leaves, the other half being for the root made of it"
                ),
            )
            .into()
        } else {
            ApiError::new(
                ErrorCode::TooLarge,
                format!("the archive exceeds {limit} bytes (the limit, or half the free space of the data dir)"),
            )
        }
    };
    if request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok()) > Some(limit) {
        return Err(too_large());
    }
    let dir = state.platform.uploads_dir();
    tokio::fs::create_dir_all(&dir).await.map_err(|e| ApiError::internal("creating the upload dir", e))?;
    // Named by tenant: what a tenant is uploading counts as its disk.
    let file_name = format!("{}{}.tar", crate::disk::upload_prefix(&caller.tenant), crate::ids::new_id("upload"));
    let upload = Upload { path: dir.join(file_name) };
    let mut file =
        tokio::fs::File::create(&upload.path).await.map_err(|e| ApiError::internal("storing the upload", e))?;
    let mut body = request.into_body().into_data_stream();
    let mut written = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the upload: {e}")))?;
        written += chunk.len() as u64;
        if written > limit {
            return Err(too_large());
        }
        file.write_all(&chunk).await.map_err(|e| ApiError::internal("storing the upload", e))?;
    }
    file.flush().await.map_err(|e| ApiError::internal("storing the upload", e))?;
    if written == 0 {
        return Err(ApiError::bad_request("the body is empty: send an image archive"));
    }
    Ok(state.platform.import_image(slot, upload, overrides, engine)?)
}

#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = TemplateList), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    _: NoQuery,
) -> Json<TemplateList> {
    Json(TemplateList { templates: state.platform.templates(&caller) })
}

#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses((status = 200, body = Template), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(TemplatePath { template, .. }: TemplatePath, _: NoQuery) -> Json<Template> {
    Json(template)
}

#[utoipa::path(delete, path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses((status = 204, description = "Every version is gone"), (status = 401, body = ErrorBody),
        (status = 403, description = "A shared template, and not the server's own key", body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, description = "In use or being built", body = ErrorBody)))]
pub async fn delete(
    TemplatePath { template, caller }: TemplatePath,
    State(state): State<AppState>,
    _: NoQuery,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    state.platform.delete_template(&template.name, &caller).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/operations/{id}/log", tag = "operations",
    params(("id" = String, Path, description = "Operation id")),
    responses((status = 200, description = "The operation's log as text", content_type = "text/plain"),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn log(path: OperationPath, State(state): State<AppState>, _: NoQuery) -> Result<Response, ApiError> {
    let text = tokio::fs::read(state.platform.data().log_path(path.id.as_str()))
        .await
        .map_err(|_| ApiError::new(ErrorCode::NotFound, "this operation has no log"))?;
    let mut response = text.into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    Ok(response)
}

/// The multipart form of `POST /v1/templates/builds`, as the document shows it.
#[allow(dead_code)]
#[derive(utoipa::ToSchema)]
pub struct DockerfileBuildForm {
    /// JSON: the build (first).
    build: space_api::DockerfileBuildRequest,
    /// A tar of the build context (after `build`; may be left out when
    /// nothing is copied from it).
    #[schema(value_type = Option<String>, format = Binary)]
    context: Option<Vec<u8>>,
}

#[utoipa::path(post, path = "/v1/templates/builds", tag = "templates",
    request_body(description = "multipart/form-data: part `build` (JSON: the Dockerfile's text, build args, \
        target, the RUN steps' network, defaults), then part `context` (a tar of the build context)",
        content((DockerfileBuildForm = "multipart/form-data"))),
    responses((status = 202, description = "Accepted; follow the build operation", body = TemplateOperation),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 415, body = ErrorBody),
        (status = 422, description = "An instruction not supported (named with its line), a bad name, \
            defaults or network", body = ErrorBody),
        (status = 429, description = "The tenant's disk quota is used up", body = ErrorBody),
        (status = 507, description = "The host's free disk is under its reserve", body = ErrorBody)))]
pub async fn build(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    _: NoQuery,
    request: Request,
) -> Result<(StatusCode, Json<TemplateOperation>), ApiError> {
    use axum::extract::FromRequest as _;
    let mut form = axum::extract::Multipart::from_request(request, &()).await.map_err(|e| {
        ApiError::new(
            ErrorCode::UnsupportedMediaType,
            format!("send multipart/form-data: part `build` (JSON), then part `context` (a tar): {e}"),
        )
    })?;
    let multipart = |e: axum::extract::multipart::MultipartError| {
        let why = std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default();
        ApiError::bad_request(format!("the form: {e}: {why}"))
    };
    let first = form.next_field().await.map_err(multipart)?;
    let Some(first) = first.filter(|field| field.name() == Some("build")) else {
        return Err(ApiError::bad_request("the first part of the form is `build` (JSON)"));
    };
    let mut json = Vec::new();
    let mut first = first;
    while let Some(chunk) = first.chunk().await.map_err(multipart)? {
        json.extend_from_slice(&chunk);
        if json.len() > MAX_JSON_BODY + space_node::dockerfile_builds::MAX_DOCKERFILE_BYTES {
            return Err(ApiError::new(ErrorCode::TooLarge, "part `build` is too large"));
        }
    }
    // A part holds the form until it is dropped.
    drop(first);
    let Json(build) = Json::<space_api::DockerfileBuildRequest>::from_bytes(&json).map_err(json_rejection)?;
    // Planned (and its name reserved) before a byte of the context is read.
    let planned = state.platform.plan_dockerfile_build(build, &caller)?;
    let context = match form.next_field().await.map_err(multipart)? {
        None => None,
        Some(field) if field.name() == Some("context") => Some(store_context(&state, &caller, field).await?),
        Some(_) => return Err(ApiError::bad_request("the second part of the form is `context` (a tar)")),
    };
    if form.next_field().await.map_err(multipart)?.is_some() {
        return Err(ApiError::bad_request("the form has two parts: `build`, then `context`"));
    }
    let (template, operation) = state.platform.start_dockerfile_build(planned, context)?;
    Ok((StatusCode::ACCEPTED, Json(TemplateOperation { template, operation })))
}

/// Streams a build context to the uploads dir, within half of what the
/// tenant may use for a build (the other half is for its layers).
async fn store_context(
    state: &AppState,
    caller: &Caller,
    mut field: axum::extract::multipart::Field<'_>,
) -> Result<Upload, ApiError> {
    let (free, _) = state.platform.data().disk_space();
    let allowance = state.platform.build_allowance(&caller.tenant)?;
    let limit = MAX_IMAGE_BYTES.min(free / 2).min(allowance / 2);
    let dir = state.platform.uploads_dir();
    tokio::fs::create_dir_all(&dir).await.map_err(|e| ApiError::internal("creating the upload dir", e))?;
    let file_name = format!("{}{}.tar", crate::disk::upload_prefix(&caller.tenant), crate::ids::new_id("context"));
    let upload = Upload { path: dir.join(file_name) };
    let mut file =
        tokio::fs::File::create(&upload.path).await.map_err(|e| ApiError::internal("storing the context", e))?;
    let mut written = 0u64;
    while let Some(chunk) =
        field.chunk().await.map_err(|e| ApiError::bad_request(format!("reading the context: {e}")))?
    {
        written += chunk.len() as u64;
        if written > limit {
            return Err(crate::disk::quota_exceeded(
                &caller.tenant,
                "disk",
                format!("the build context exceeds {limit} bytes: half of what the tenant's build may use"),
            )
            .into());
        }
        file.write_all(&chunk).await.map_err(|e| ApiError::internal("storing the context", e))?;
    }
    file.flush().await.map_err(|e| ApiError::internal("storing the context", e))?;
    Ok(upload)
}
