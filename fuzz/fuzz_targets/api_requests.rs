//! The API's request parsers and validators against arbitrary JSON: every
//! input is either refused with an error or becomes a checked spec; none
//! panics.

#![no_main]

use libfuzzer_sys::fuzz_target;
use space_api::{CommandRequest, CreateSandboxRequest, CreateTemplateRequest};
use space_server::domain::{CommandSpec, CreateSpec};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = serde_json::from_slice::<CreateSandboxRequest>(data) {
        if let Ok(spec) = CreateSpec::new(request, &space_host::template::TemplateDefaults::default()) {
            assert!(spec.vcpus >= 1 && spec.memory_mib > 0 && spec.disk_mib > 0);
        }
    }
    if let Ok(request) = serde_json::from_slice::<CommandRequest>(data) {
        if let Ok(spec) = CommandSpec::try_from(request) {
            assert!(!spec.argv.is_empty());
        }
    }
    let _ = serde_json::from_slice::<CreateTemplateRequest>(data);
});
