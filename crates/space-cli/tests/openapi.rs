//! The served OpenAPI document passes a standard validator
//! (`openapi-spec-validator`), and a client generated from it by a standard
//! generator (`openapi-python-client`) makes real calls to a real server.

use std::process::Command;

use space_testkit::{http, output_within, TestDataDir, PATIENCE};

mod common;

const CALLS: &str = r#"
import os, sys
sys.path.insert(0, os.environ["CLIENT_DIR"])
from space_api_client import AuthenticatedClient
from space_api_client.api.sandboxes import sandboxes_create, sandboxes_get, sandboxes_list
from space_api_client.models import CreateSandboxRequest

client = AuthenticatedClient(base_url=os.environ["SPACE_URL"], token=os.environ["SPACE_API_KEY"])
created = sandboxes_create.sync_detailed(client=client, body=CreateSandboxRequest(template="base"))
assert created.status_code == 202, created
sandbox_id = created.parsed.sandbox.id
got = sandboxes_get.sync_detailed(sandbox_id, client=client)
assert got.status_code == 200 and got.parsed.id == sandbox_id, got
listed = sandboxes_list.sync_detailed(client=client)
assert sandbox_id in [s.id for s in listed.parsed.sandboxes], listed
print("GENERATED CLIENT OK", sandbox_id)
"#;

#[test]
fn the_api_document_validates_and_a_generated_client_calls_the_server() {
    let data = TestDataDir::new();
    let venv = common::python_venv(
        &data,
        "openapi-venv",
        &["openapi-spec-validator>=0.7,<1", "openapi-python-client>=0.21,<1"],
    );
    let (server, url, _, lines) = common::spawn_server(&data, &["--dev", "--listen", "127.0.0.1:0"]);
    std::thread::spawn(move || lines.for_each(drop));
    let key = std::fs::read_to_string(space_host::datadir::dev_key_path(data.root())).unwrap().trim().to_string();
    let document = space_client::Client::with_agent(&url, &key, http()).get_text("/v1/openapi.json").unwrap();
    let path = data.root().join("openapi.json");
    std::fs::write(&path, &document).unwrap();

    let checked = output_within(Command::new(venv.join("bin/openapi-spec-validator")).arg(&path), PATIENCE);
    let said = String::from_utf8_lossy(&checked.stdout);
    assert!(
        checked.status.success() && said.contains("OK"),
        "the validator: {said} {}",
        String::from_utf8_lossy(&checked.stderr)
    );

    let out = data.root().join("generated");
    std::fs::create_dir_all(&out).unwrap();
    let generated = output_within(
        Command::new(venv.join("bin/openapi-python-client"))
            .args(["generate", "--meta", "none", "--path"])
            .arg(&path)
            .current_dir(&out),
        PATIENCE,
    );
    assert!(generated.status.success(), "the generator: {}", String::from_utf8_lossy(&generated.stderr));

    let called = output_within(
        Command::new(venv.join("bin/python"))
            .args(["-c", CALLS])
            .env("CLIENT_DIR", &out)
            .env("SPACE_URL", &url)
            .env("SPACE_API_KEY", &key),
        PATIENCE,
    );
    let said = String::from_utf8_lossy(&called.stdout);
    assert!(
        called.status.success() && said.contains("GENERATED CLIENT OK"),
        "the generated client: {said} {}",
        String::from_utf8_lossy(&called.stderr)
    );
    common::stop(server);
}
