//! Prints the OpenAPI document every server serves at `/v1/openapi.json`
//! (the same value, built without starting a server, which would need root,
//! runsc and a data dir): the book renders its API reference from it at
//! build time (`scripts/book.py`), so the reference cannot drift from the
//! code.

use utoipa::OpenApi;

fn main() {
    let document = space_server::api::ApiDoc::openapi();
    match serde_json::to_string_pretty(&document) {
        Ok(json) => println!("{json}"),
        Err(err) => {
            eprintln!("the OpenAPI document does not serialize: {err}");
            std::process::exit(1);
        }
    }
}
