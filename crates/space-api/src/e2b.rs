//! E2B's wire conventions that both a node's E2B adapter and a cluster's
//! control plane speak: the form-encoded queries of its list call, its
//! paging, its timestamps and the name of its code interpreter's template.
//! Plain functions over text and JSON values: the HTTP answer around them
//! is each side's own.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The template E2B's code interpreter creates its sandboxes from; SPACE's
/// `code-interpreter` serves it unless a template of this name exists.
pub const E2B_CODE_INTERPRETER: &str = "code-interpreter-v1";

/// What a request without its sandbox's envd token is answered (401),
/// whether the sandbox exists or not: a cluster's control plane answers
/// the same for an id it cannot place, so no caller learns which ids exist.
pub const WRONG_TOKEN: &str = "missing or wrong access token for this sandbox";

/// A list's page when the query names no `limit`.
pub const PAGE: usize = 100;

/// The start of a SPACE key in E2B's form (see [`e2b_key`]).
pub const E2B_KEY_PREFIX: &str = "e2b_";

/// A SPACE key in the shape E2B's SDK insists on (`e2b_` and lowercase hex
/// digits, refused otherwise unless `E2B_VALIDATE_API_KEY=false`): the
/// key's own bytes in hex. The same secret, only spelled differently: it
/// is as valid as the key, revoked with it, and never kept or logged.
pub fn e2b_key(space_key: &str) -> String {
    let mut out = String::with_capacity(E2B_KEY_PREFIX.len() + 2 * space_key.len());
    out.push_str(E2B_KEY_PREFIX);
    for byte in space_key.bytes() {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// The SPACE key an `X-API-KEY` stands for: the key itself, or the key an
/// [`e2b_key`] form spells (`None` for `e2b_` text that spells no SPACE
/// key, which then matches no key at all).
pub fn presented_key(presented: &str) -> Option<std::borrow::Cow<'_, str>> {
    let Some(hex) = presented.strip_prefix(E2B_KEY_PREFIX) else {
        return Some(std::borrow::Cow::Borrowed(presented));
    };
    // Twice the longest key a server accepts.
    if hex.len() % 2 != 0 || hex.len() > 256 {
        return None;
    }
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    let bytes: Vec<u8> =
        hex.as_bytes().chunks(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect::<Option<_>>()?;
    let key = String::from_utf8(bytes).ok()?;
    key.starts_with("space_").then_some(std::borrow::Cow::Owned(key))
}

/// An RFC 3339 time as E2B sends it; one that does not parse is now.
pub fn parse_time(text: &str) -> SystemTime {
    humantime::parse_rfc3339_weak(text).unwrap_or_else(|_| SystemTime::now())
}

/// `a=b&c=d` decoded as a form (`+` is a space).
pub fn form_pairs(text: &str) -> Vec<(String, String)> {
    text.split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(&k.replace('+', " ")), percent_decode(&v.replace('+', " ")))
        })
        .collect()
}

/// `metadata=k1=v1&k2=v2`, each key and value percent-encoded once more
/// inside the already decoded query value.
pub fn metadata_filter(text: &str) -> Vec<(String, String)> {
    form_pairs(text).into_iter().map(|(k, v)| (percent_decode(&k), percent_decode(&v))).collect()
}

/// `%XX` escapes decoded; a `%` that starts none stays as it is.
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One page of a list as E2B answers it: the items, and the `nextToken`
/// of the page after it (sent as `X-Next-Token`) when there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub items: Vec<Value>,
    pub next_token: Option<usize>,
}

/// One page of `listed` (each with its start): newest first unless
/// `order=asc`, `limit` a page, from the page `nextToken` names. `query` is
/// the list's decoded query; a bad `limit` or `nextToken` is the message of
/// a 400.
pub fn page(mut listed: Vec<(SystemTime, Value)>, query: &BTreeMap<String, String>) -> Result<Page, String> {
    let limit = match query.get("limit") {
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("limit must be a positive number, got {text:?}"))?,
        None => PAGE,
    };
    let skip = match query.get("nextToken").filter(|t| !t.is_empty()) {
        Some(token) => token.parse::<usize>().map_err(|_| "nextToken is not one this server gave".to_string())?,
        None => 0,
    };
    listed.sort_by_key(|(at, _)| *at);
    if query.get("order").map(String::as_str) != Some("asc") {
        listed.reverse();
    }
    let total = listed.len();
    let items: Vec<Value> = listed.into_iter().skip(skip).take(limit).map(|(_, v)| v).collect();
    let next_token = (skip.saturating_add(limit) < total).then(|| skip + limit);
    Ok(Page { items, next_token })
}

/// E2B's `Sandbox`: what a node's adapter answers a create (and a connect)
/// with, which a cluster's control plane reads to record where the new
/// sandbox lives before passing the answer on as sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub alias: String,
    pub envd_version: String,
    pub envd_access_token: String,
    pub traffic_access_token: String,
    pub domain: Option<String>,
}

/// E2B's `ListedSandbox`: an item of its sandbox list, as a node's adapter
/// answers it; a cluster's control plane merges every node's and pages
/// them by `startedAt`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub alias: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// RFC 3339.
    pub started_at: String,
    /// RFC 3339.
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    /// `running` or `paused`.
    pub state: String,
    pub envd_version: String,
    pub metadata: BTreeMap<String, String>,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn metadata_filters_are_decoded_twice() {
        // {"a b": "x&y=z"} as the SDK sends it, after the query's own decoding.
        let once = percent_decode("a%252520b%3Dx%252526y%25253Dz");
        assert_eq!(metadata_filter(&once), vec![("a b".to_string(), "x&y=z".to_string())]);
        assert_eq!(form_pairs("state=running%2Cpaused&limit=2").len(), 2);
    }

    #[test]
    fn a_page_is_newest_first_and_names_the_next() {
        let at = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let listed: Vec<(SystemTime, Value)> = (1..=3).map(|n| (at(n), Value::from(n))).collect();
        let query = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let first = page(listed.clone(), &query(&[("limit", "2")])).unwrap();
        assert_eq!(first, Page { items: vec![3.into(), 2.into()], next_token: Some(2) });
        let rest = page(listed.clone(), &query(&[("limit", "2"), ("nextToken", "2")])).unwrap();
        assert_eq!(rest, Page { items: vec![1.into()], next_token: None });
        assert_eq!(page(listed.clone(), &query(&[("limit", "3")])).unwrap().next_token, None);
        let ascending = page(listed.clone(), &query(&[("order", "asc")])).unwrap();
        assert_eq!(ascending.items, vec![Value::from(1), 2.into(), 3.into()]);
        assert!(page(listed.clone(), &query(&[("limit", "0")])).is_err());
        assert!(page(listed, &query(&[("nextToken", "x")])).is_err());
    }

    #[test]
    fn e2b_answers_read_as_the_adapter_writes_them() {
        let listed = r#"{"templateID": "base", "alias": "base", "sandboxID": "sbx-1", "clientID": "space",
            "startedAt": "2024-01-02T03:04:05Z", "endAt": "2124-01-02T03:04:05Z", "cpuCount": 1, "memoryMB": 512,
            "diskSizeMB": 1024, "state": "running", "envdVersion": "0.5.7", "metadata": {"k": "v"}}"#;
        let item: ListedSandbox = serde_json::from_str(listed).unwrap();
        assert_eq!((item.sandbox_id.as_str(), item.memory_mb), ("sbx-1", 512));
        let again: Value = serde_json::to_value(&item).unwrap();
        assert_eq!(again, serde_json::from_str::<Value>(listed).unwrap(), "written back as it was read");
        let created = r#"{"templateID": "base", "sandboxID": "sbx-1", "clientID": "space", "alias": "base",
            "envdVersion": "0.5.7", "envdAccessToken": "t", "trafficAccessToken": "u", "domain": null}"#;
        assert_eq!(serde_json::from_str::<CreatedSandbox>(created).unwrap().sandbox_id, "sbx-1");
        let partial = r#"{"sandboxID": "sbx-1"}"#;
        assert!(serde_json::from_str::<CreatedSandbox>(partial).is_err(), "an answer short of E2B's shape");
    }

    #[test]
    fn a_time_that_does_not_parse_is_now() {
        assert_eq!(parse_time("2024-01-02T03:04:05Z"), SystemTime::UNIX_EPOCH + Duration::from_secs(1_704_164_645));
        assert!(parse_time("yesterday") > SystemTime::now() - Duration::from_secs(60));
    }

    #[test]
    fn a_key_in_e2b_form_spells_the_key_and_nothing_else() {
        let key = "space_dev_0123456789abcdef";
        let e2b = e2b_key(key);
        assert!(e2b.starts_with("e2b_") && e2b[4..].bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_eq!(presented_key(&e2b).as_deref(), Some(key));
        assert_eq!(presented_key(key).as_deref(), Some(key), "a plain key is taken as it is");
        // E2B text that spells no SPACE key matches none.
        for bad in ["e2b_", "e2b_0", "e2b_zz", "e2b_6162", "e2b_ABCD", &format!("e2b_{}", "61".repeat(200))] {
            assert_eq!(presented_key(bad), None, "{bad}");
        }
    }
}
