//! The OpenAPI document: the contract, served at `/v1/openapi.json` and
//! checked against real responses by the tests.

use axum::Json;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{
    attach, checkpoints, commands, contexts, egress, events, files, health, operations, output, ports, sandboxes,
    secrets, templates, usage,
};

#[derive(OpenApi)]
#[openapi(
    info(title = "SPACE API", description = "Sandboxed Platform for Agentic Code Execution", version = "1"),
    paths(
        health::health,
        sandboxes::create, sandboxes::list, sandboxes::get, sandboxes::delete, sandboxes::pause, sandboxes::resume,
        sandboxes::suspend,
        sandboxes::fork,
        checkpoints::create,
        checkpoints::list,
        checkpoints::restore,
        checkpoints::delete,
        contexts::create,
        contexts::list,
        contexts::get,
        contexts::delete,
        contexts::interrupt,
        contexts::restart,
        contexts::run,
        operations::get, operations::list, templates::log,
        templates::create, templates::list, templates::get, templates::delete,
        commands::create, commands::list, commands::get, commands::stdin, commands::signal, commands::resize, commands::exec,
        output::output, attach::attach,
        files::read, files::write, files::delete,
        usage::usage, usage::sandbox, events::events, egress::log, egress::set_network,
        secrets::put, secrets::list, secrets::delete, ports::proxy, ports::proxy_root,
    ),
    components(schemas(commands::SignalRequest, commands::ResizeRequest, files::FileWritten, files::DirListing, files::FileEntry)),
    modifiers(&BearerAuth, &UniqueOperationIds),
    security(("bearer" = [])),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

/// utoipa names an operation after its handler, and several handlers
/// share a name (`list`, `get`, ...): each id gets its tag in front, so
/// every id is unique, as OpenAPI requires and client generators rely on.
struct UniqueOperationIds;

impl Modify for UniqueOperationIds {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ];
            for operation in operations.into_iter().flatten() {
                let tag = operation.tags.as_ref().and_then(|t| t.first()).cloned().unwrap_or_default();
                if let Some(id) = operation.operation_id.as_mut() {
                    if !tag.is_empty() && !id.starts_with(&format!("{tag}_")) {
                        *id = format!("{tag}_{id}");
                    }
                }
            }
        }
    }
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "meta",
    responses((status = 200, description = "This document", content_type = "application/json")))]
pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
