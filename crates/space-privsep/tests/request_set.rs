//! The requests the gVisor engine's seam added to the set: their lists
//! and texts are bounded, and a start names a template's image by its own
//! kind only.

use space_privsep::proto::{decode_reply, decode_request, encode, Reply, HEADER_LEN, MAX_LISTED, MAX_MESSAGE};

const SBX: &str = "sbx_0123456789abcdef0123";

fn sandboxes(n: usize) -> String {
    (0..n).map(|_| format!("\"{SBX}\"")).collect::<Vec<_>>().join(",")
}

fn refused(json: &str) -> String {
    match decode_request(json.as_bytes()) {
        Ok(request) => panic!("accepted {json}: {request:?}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn lists_of_sandboxes_are_bounded() {
    let states = |n| format!(r#"{{"op":"states","sandboxes":[{}]}}"#, sandboxes(n));
    assert!(decode_request(states(MAX_LISTED).as_bytes()).is_ok());
    assert!(refused(&states(MAX_LISTED + 1)).contains("over"));
    let settle = |n, ms| format!(r#"{{"op":"settle_orphans","sandboxes":[{}],"patience_ms":{ms}}}"#, sandboxes(n));
    assert!(decode_request(settle(3, 1000).as_bytes()).is_ok());
    assert!(refused(&settle(MAX_LISTED + 1, 1000)).contains("over"));
    for ms in [0, 600_001] {
        assert!(refused(&settle(1, ms)).contains("outside"), "{ms}");
    }
    let reply = Reply::States { states: Vec::new() };
    assert!(decode_reply(&encode(&reply).unwrap()[HEADER_LEN..]).is_ok());
}

#[test]
fn a_log_is_bounded() {
    let fits = Reply::Log { text: "x".repeat(MAX_MESSAGE) };
    assert!(decode_reply(&encode(&fits).unwrap()[HEADER_LEN..]).is_ok());
    let long = Reply::Log { text: "x".repeat(MAX_MESSAGE + 1) };
    assert!(decode_reply(&encode(&long).unwrap()[HEADER_LEN..]).is_err());
}

#[test]
fn a_template_image_is_saved_into_its_build_but_started_by_its_own_kind() {
    let template = r#"{"kind":"template","template":{"name":"snap","version":4}}"#;
    assert!(decode_request(format!(r#"{{"op":"save_image","sandbox":"{SBX}","image":{template}}}"#).as_bytes()).is_ok());
    let start = format!(
        r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"image","source":"{SBX}","image":{template}}},"shape":{{"memory_mib":512,"vcpus":1,"disk_mib":1024}}}}"#
    );
    assert!(refused(&start).contains("names the template"));
    let published = format!(
        r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"template_image","template":{{"name":"snap","version":4}}}},"shape":{{"memory_mib":512,"vcpus":1,"disk_mib":1024}}}}"#
    );
    assert!(decode_request(published.as_bytes()).is_ok());
}
