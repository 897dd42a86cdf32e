//! Request headers a program in a sandbox sends to a host a secret is
//! bound to (inside a tunnel the gateway terminates): any names and values,
//! with placeholders of a secret bound there and of one bound elsewhere,
//! in plain text or inside `Authorization: Basic`. Adding secrets must
//! never panic, must refuse the request whenever the other secret's
//! placeholder is in it, and must never put the other secret's value in.

#![no_main]

use base64::Engine as _;
use libfuzzer_sys::fuzz_target;
use space_egress::inspect::{add_secrets, Secret, Vault};
use space_egress::policy::{Binding, Mode, Policy, Reason, Target};
use http::{HeaderMap, HeaderName, HeaderValue};

const HERE: &str = "space_ph_00000000000000000000000000000001";
const ELSEWHERE: &str = "space_ph_00000000000000000000000000000002";

struct Values;
impl Vault for Values {
    fn secret(&self, name: &str) -> Option<Secret> {
        let (value, host) = match name {
            "here" => ("value-for-api", "api.space.test"),
            "elsewhere" => ("value-for-other", "other.space.test"),
            _ => return None,
        };
        Some(Secret { value: value.into(), hosts: vec![host.into()] })
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let here = Binding::new("here", HERE, &["api.space.test".into()], vec![]).unwrap();
    let elsewhere = Binding::new("elsewhere", ELSEWHERE, &["other.space.test".into()], vec![]).unwrap();
    let policy = Policy::new(Mode::Allowlist, &[], &[]).unwrap().with_bindings(vec![here, elsewhere]).unwrap();
    let mut headers = HeaderMap::new();
    for line in rest.split(|b| *b == b'\n') {
        let (name, value) = match line.iter().position(|b| *b == b':') {
            Some(at) => (&line[..at], &line[at + 1..]),
            None => continue,
        };
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) else { continue };
        headers.append(name, value);
    }
    let mut carried = Vec::new();
    if flags & 1 != 0 {
        carried.push(HERE);
    }
    if flags & 2 != 0 {
        carried.push(ELSEWHERE);
    }
    let text = carried.join(" ");
    let value = if flags & 4 != 0 {
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("user:{text}")))
    } else {
        format!("Bearer {text}")
    };
    if !carried.is_empty() {
        headers.append("authorization", HeaderValue::from_str(&value).unwrap());
    }
    let sent_elsewhere = flags & 2 != 0 || headers.iter().any(|(_, v)| contains(v.as_bytes(), ELSEWHERE.as_bytes()));
    let typed_value = contains(rest, b"value-for-other");
    let result = add_secrets(&mut headers, &Target::Name("api.space.test".into()), &policy, &Values);
    if sent_elsewhere {
        assert_eq!(result.as_ref().err(), Some(&Reason::SecretNotForHost), "another host's placeholder went through");
    }
    if result.is_ok() && !typed_value {
        for (_, value) in &headers {
            assert!(!contains(value.as_bytes(), b"value-for-other"), "another host's value was added");
            if let Some(encoded) = value.as_bytes().strip_prefix(b"Basic ") {
                if let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded) {
                    assert!(!contains(&decoded, b"value-for-other"), "another host's value was added");
                }
            }
        }
    }
});

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
