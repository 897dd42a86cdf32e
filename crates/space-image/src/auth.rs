//! The registry's challenge (`WWW-Authenticate`) and what answers it: HTTP
//! Basic, or a bearer token from the token service the challenge names
//! (the distribution project's token protocol).

use std::collections::HashMap;

use base64::Engine;
use zeroize::Zeroizing;

use crate::Credential;

/// What a registry's 401 asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Challenge {
    Basic,
    Bearer { realm: String, service: Option<String>, scope: Option<String> },
}

/// The first challenge this client can answer among a response's
/// `WWW-Authenticate` values.
pub(crate) fn challenge<'a>(values: impl IntoIterator<Item = &'a str>) -> Option<Challenge> {
    for value in values {
        let (scheme, params) = value.trim().split_once(' ').unwrap_or((value.trim(), ""));
        let params = parse_params(params);
        if scheme.eq_ignore_ascii_case("basic") {
            return Some(Challenge::Basic);
        }
        if scheme.eq_ignore_ascii_case("bearer") {
            if let Some(realm) = params.get("realm") {
                return Some(Challenge::Bearer {
                    realm: realm.clone(),
                    service: params.get("service").cloned(),
                    scope: params.get("scope").cloned(),
                });
            }
        }
    }
    None
}

/// `key=value, key="quoted \"value\""` (RFC 7235 auth-params), keys
/// lowercased. What does not parse ends the list.
fn parse_params(text: &str) -> HashMap<String, String> {
    let mut params = HashMap::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else { break };
        let key = key.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, remaining) = if let Some(quoted) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => value.push(c),
                }
            }
            let Some(end) = end else { break };
            (value, &quoted[end..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim().to_string(), &after[end..])
        };
        params.insert(key, value);
        rest = remaining.trim_start().trim_start_matches(',').trim_start();
    }
    params
}

/// The `Authorization` value for Basic with `credential`.
pub(crate) fn basic(username: &str, credential: &Credential) -> Zeroizing<String> {
    let pair = Zeroizing::new(format!("{username}:{}", credential.value.as_str()));
    Zeroizing::new(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair.as_bytes())))
}

/// The `Authorization` value for a bearer token.
pub(crate) fn bearer(token: &str) -> Zeroizing<String> {
    Zeroizing::new(format!("Bearer {token}"))
}

/// A token service's answer: `token`, or OAuth2's `access_token`.
#[derive(serde::Deserialize)]
struct TokenAnswer {
    token: Option<String>,
    access_token: Option<String>,
}

/// The token in a token service's JSON answer.
pub(crate) fn token_from(body: &[u8]) -> Option<Zeroizing<String>> {
    let answer: TokenAnswer = serde_json::from_slice(body).ok()?;
    let token = answer.token.filter(|t| !t.is_empty()).or(answer.access_token.filter(|t| !t.is_empty()))?;
    let token = Zeroizing::new(token);
    // A header value cannot carry control characters or spaces.
    token.bytes().all(|b| b.is_ascii_graphic()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        let bearer = r#"Bearer realm="https://auth.test/token",service="registry.test",scope="repository:a/b:pull""#;
        assert_eq!(
            challenge([bearer]),
            Some(Challenge::Bearer {
                realm: "https://auth.test/token".into(),
                service: Some("registry.test".into()),
                scope: Some("repository:a/b:pull".into()),
            })
        );
        assert_eq!(challenge([r#"Basic realm="space-test""#]), Some(Challenge::Basic));
        assert_eq!(challenge(["basic"]), Some(Challenge::Basic));
        assert_eq!(
            challenge([r#"Bearer  realm = "https://a.test/t\"x", service=svc"#]),
            Some(Challenge::Bearer { realm: "https://a.test/t\"x".into(), service: Some("svc".into()), scope: None })
        );
        // A bearer challenge without a realm cannot be answered; the next one can.
        assert_eq!(challenge(["Bearer service=x", "Basic realm=r"]), Some(Challenge::Basic));
        assert_eq!(challenge(["Negotiate"]), None);
        assert_eq!(challenge([r#"Bearer realm="unterminated"#]), None);
    }

    #[test]
    fn tokens() {
        assert_eq!(token_from(br#"{"token":"abc"}"#).as_deref().map(|t| t.as_str()), Some("abc"));
        assert_eq!(
            token_from(br#"{"access_token":"xyz","expires_in":60}"#).as_deref().map(|t| t.as_str()),
            Some("xyz")
        );
        assert_eq!(token_from(br#"{"token":"","access_token":"xyz"}"#).as_deref().map(|t| t.as_str()), Some("xyz"));
        assert!(token_from(br#"{"token":"a b"}"#).is_none());
        assert!(token_from(br#"{}"#).is_none());
        assert!(token_from(b"not json").is_none());
    }

    #[test]
    fn basic_encodes_user_and_value() {
        let credential = Credential { username: Some("u".into()), value: Zeroizing::new("p".into()), hosts: vec![] };
        assert_eq!(basic("u", &credential).as_str(), "Basic dTpw");
    }
}
