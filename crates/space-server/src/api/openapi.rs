//! The OpenAPI document: the contract, served at `/v1/openapi.json` and
//! checked against real responses by the tests.

use axum::Json;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{
    attach, checkpoints, commands, contexts, egress, events, files, health, operations, output, ports, sandboxes,
    secrets, templates, usage, volumes,
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
        templates::create, templates::build, templates::list, templates::get, templates::delete,
        commands::create, commands::list, commands::get, commands::stdin, commands::signal, commands::resize, commands::exec,
        output::output, attach::attach,
        files::read, files::write, files::delete,
        usage::usage, usage::sandbox, events::events, egress::log, egress::set_network,
        secrets::put, secrets::list, secrets::delete, ports::proxy, ports::proxy_root, ports::list, ports::set_access, ports::link,
        volumes::create, volumes::list, volumes::get, volumes::delete, volumes::snapshot, volumes::snapshots,
        volumes::delete_snapshot, volumes::restore, volumes::move_volume, volumes::read_file, volumes::write_file,
        volumes::delete_file,
    ),
    components(schemas(templates::DockerfileBuildForm, commands::SignalRequest, commands::ResizeRequest, files::FileWritten, files::DirListing, files::FileEntry)),
    modifiers(&BearerAuth, &UniqueOperationIds, &ErrorCodes),
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

/// Each error code with its status and meaning, in the description of the
/// `ErrorCode` schema (the enum alone lists only the names).
struct ErrorCodes;

impl Modify for ErrorCodes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let schemas = &mut openapi.components.get_or_insert_with(Default::default).schemas;
        if let Some(utoipa::openapi::RefOr::T(utoipa::openapi::schema::Schema::Object(schema))) =
            schemas.get_mut("ErrorCode")
        {
            let mut text = schema.description.clone().unwrap_or_default();
            for code in space_api::ErrorCode::ALL {
                text.push_str(&format!("\n- `{code}` ({}): {}", code.http_status(), code.meaning()));
            }
            schema.description = Some(text);
        }
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

/// The document as JSON text, for a cluster's control plane to serve as a
/// node does (it links none of this crate: the composition root hands it
/// over, decision 020).
pub fn document_json() -> String {
    serde_json::to_string(&ApiDoc::openapi()).unwrap_or_default()
}

/// Whether the operation at `method` and route template `route` takes an
/// `Idempotency-Key`, as the document says (read from it once).
pub(crate) fn takes_idempotency_key(method: &str, route: &str) -> bool {
    static KEYED: std::sync::OnceLock<std::collections::HashSet<(String, String)>> = std::sync::OnceLock::new();
    let keyed = KEYED.get_or_init(|| {
        let document = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
        let mut keyed = std::collections::HashSet::new();
        for (path, item) in document["paths"].as_object().into_iter().flatten() {
            for (verb, operation) in item.as_object().into_iter().flatten() {
                let parameters = operation["parameters"].as_array().into_iter().flatten();
                let takes = parameters.into_iter().any(|p| {
                    p["in"] == "header" && p["name"].as_str().is_some_and(|n| n.eq_ignore_ascii_case("idempotency-key"))
                });
                if takes {
                    keyed.insert((verb.to_ascii_uppercase(), path.clone()));
                }
            }
        }
        keyed
    });
    keyed.contains(&(method.to_ascii_uppercase(), route.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client learns every error code, with what it means, from the document.
    #[test]
    fn the_document_lists_every_error_code() {
        let document = serde_json::to_value(ApiDoc::openapi()).unwrap();
        let schema = &document["components"]["schemas"]["ErrorCode"];
        let listed: Vec<&str> = schema["enum"].as_array().into_iter().flatten().filter_map(|c| c.as_str()).collect();
        let all: Vec<&str> = space_api::ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(listed, all, "{schema}");
        assert_eq!(
            document["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["$ref"],
            "#/components/schemas/ErrorCode"
        );
    }
}
