//! E2B's network rules (`allowOut`, `denyOut`, per-host header `rules`,
//! `allow_internet_access`) as a SPACE egress policy. What maps is kept
//! exactly; what SPACE would enforce differently is refused with E2B's
//! error, never accepted and dropped.
//!
//! E2B: everything is allowed unless `denyOut` covers it, and `allowOut`
//! wins over `denyOut`; `denyOut: ["0.0.0.0/0"]` (or
//! `allow_internet_access: false`) makes `allowOut` an allow list. SPACE:
//! `public` with `deny` rules, or `allowlist` with `allow` rules (a `deny`
//! rule beats an `allow` rule). So:
//! - all traffic denied: `allowlist` of `allowOut` (the other `denyOut`
//!   entries deny nothing more, and E2B's precedence lets `allowOut`
//!   through them), or no egress when `allowOut` is empty;
//! - otherwise: `public` with `denyOut` as `deny`; an `allowOut` entry
//!   inside a `denyOut` entry is refused (SPACE's deny would win), one
//!   outside them changes nothing.
//!
//! A header transform is a SPACE secret binding: its value names a tenant
//! secret as `${e2b.secrets.NAME}` (or `{secret}` style text around it),
//! and the gateway sets the header on HTTPS requests to that host. A literal
//! value (no secret) is refused: SPACE's gateway sets headers from secrets.

use std::collections::BTreeMap;
use std::net::IpAddr;

use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;
use space_api::{Egress, Network, SecretBinding};

use crate::error::E2bError;

/// E2B's selector for all traffic (`ctx.all_traffic`).
const ALL_TRAFFIC: [&str; 2] = ["0.0.0.0/0", "::/0"];

/// E2B's `network` (create) or the body of `PUT /sandboxes/{id}/network`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct E2bNetwork {
    #[serde(default)]
    allow_out: Option<Vec<String>>,
    #[serde(default)]
    deny_out: Option<Vec<String>>,
    #[serde(default)]
    rules: Option<BTreeMap<String, Vec<E2bRule>>>,
    #[serde(default)]
    egress_proxy: Option<Value>,
    /// Only in a create: whether ports are open without the traffic
    /// token. The SDK sends `true` whenever it sends `network` at all, so
    /// it is accepted either way; SPACE's ports stay private (the traffic
    /// token, or a port made public with SPACE's own API).
    #[serde(default)]
    #[allow(dead_code)]
    allow_public_traffic: Option<bool>,
    /// Only in a create.
    #[serde(default)]
    mask_request_host: Option<String>,
    /// Only in an update (a create has it beside `network`).
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct E2bRule {
    #[serde(default)]
    transform: Option<E2bTransform>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct E2bTransform {
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

fn refused(message: impl Into<String>) -> E2bError {
    E2bError::new(StatusCode::BAD_REQUEST, message.into())
}

/// An IP or CIDR rule as a network, `None` for a host name.
fn cidr(rule: &str) -> Option<(IpAddr, u8)> {
    match rule.split_once('/') {
        Some((ip, len)) => {
            let ip: IpAddr = ip.parse().ok()?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            Some((ip, len.parse().ok().filter(|l| *l <= max)?))
        }
        None => rule.parse::<IpAddr>().ok().map(|ip| (ip, if ip.is_ipv4() { 32 } else { 128 })),
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)) << 96,
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// Whether two networks share an address.
fn overlap(a: (IpAddr, u8), b: (IpAddr, u8)) -> bool {
    if a.0.is_ipv4() != b.0.is_ipv4() {
        return false;
    }
    // Both are in the top bits (see `bits`): their common prefix decides.
    let len = u32::from(a.1.min(b.1));
    let mask = if len == 0 { 0 } else { u128::MAX << (128 - len) };
    bits(a.0) & mask == bits(b.0) & mask
}

/// Whether `host` is in the allow list as written (itself, or a `*.`
/// rule over it).
fn listed(host: &str, allow: &[String]) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    allow.iter().any(|rule| {
        let rule = rule.split(':').next().unwrap_or_default().trim_end_matches('.').to_ascii_lowercase();
        match rule.strip_prefix("*.") {
            Some(suffix) => host.ends_with(&format!(".{suffix}")),
            None => rule == host,
        }
    })
}

/// What a header value's `${e2b.secrets.NAME}` names, with the value as
/// SPACE's gateway writes it (`{secret}` standing for the secret).
fn secret_header(value: &str) -> Result<(String, String), E2bError> {
    const OPEN: &str = "${e2b.secrets.";
    let start = value.find(OPEN).ok_or_else(|| {
        refused(
            "a header transform without a secret is not supported by SPACE: its gateway sets headers from the \
             tenant's secrets; write the value as ${e2b.secrets.NAME} over a secret made with PUT /v1/secrets/NAME",
        )
    })?;
    let rest = &value[start + OPEN.len()..];
    let end = rest.find('}').ok_or_else(|| refused("an unclosed ${e2b.secrets. in a header transform"))?;
    let name = &rest[..end];
    let after = &rest[end + 1..];
    if after.contains(OPEN) {
        return Err(refused("a header transform may name one secret only in SPACE"));
    }
    Ok((name.to_string(), format!("{}{{secret}}{after}", &value[..start])))
}

impl E2bNetwork {
    /// The SPACE network these rules ask for. `allow_internet_access` is
    /// the create's own field (an update carries it inside), `None` when
    /// not given: then internet access is on, as E2B's default is.
    pub fn to_space(&self, allow_internet_access: Option<bool>) -> Result<Network, E2bError> {
        if self.egress_proxy.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(refused("an egress proxy (egressProxy) is not supported by SPACE"));
        }
        if self.mask_request_host.is_some() {
            return Err(refused("maskRequestHost is not supported by SPACE"));
        }
        let internet = allow_internet_access.or(self.allow_internet_access).unwrap_or(true);
        let allow_out = self.allow_out.clone().unwrap_or_default();
        let deny_out = self.deny_out.clone().unwrap_or_default();
        let all_denied = !internet || deny_out.iter().any(|rule| ALL_TRAFFIC.contains(&rule.trim()));
        let secrets = self.bindings()?;
        let network = if all_denied {
            for host in secrets.values().flat_map(|b| &b.hosts) {
                if !listed(host, &allow_out) {
                    return Err(refused(format!(
                        "rules name {host}, which allowOut does not list: with all traffic denied SPACE would \
                         still let its HTTPS through; list it in allowOut too"
                    )));
                }
            }
            let egress = if allow_out.is_empty() && secrets.is_empty() { Egress::None } else { Egress::Allowlist };
            Network { egress, allow: allow_out, deny: Vec::new(), secrets }
        } else {
            let denied: Vec<(IpAddr, u8)> = deny_out.iter().filter_map(|rule| cidr(rule)).collect();
            for rule in &allow_out {
                let Some(allowed) = cidr(rule) else {
                    return Err(refused(format!(
                        "allowOut names the host {rule:?}: host names are allowed only with all other traffic \
                         denied (denyOut: [\"0.0.0.0/0\"])"
                    )));
                };
                if denied.iter().any(|d| overlap(allowed, *d)) {
                    return Err(refused(format!(
                        "allowOut {rule:?} lets through part of a denyOut entry, which SPACE cannot do unless \
                         all other traffic is denied (denyOut: [\"0.0.0.0/0\"])"
                    )));
                }
            }
            Network { egress: Egress::Public, allow: Vec::new(), deny: deny_out, secrets }
        };
        crate::domain::checked_network(network.clone())?;
        Ok(network)
    }

    /// The header transforms as secret bindings, one per host and secret,
    /// under variables `E2B_SECRET_<n>` (the placeholder's, in the sandbox).
    fn bindings(&self) -> Result<BTreeMap<String, SecretBinding>, E2bError> {
        let mut by_host_secret: BTreeMap<(String, String), BTreeMap<String, String>> = BTreeMap::new();
        for (host, rules) in self.rules.iter().flatten() {
            for rule in rules {
                for (header, value) in rule.transform.iter().flat_map(|t| &t.headers) {
                    let (secret, written) = secret_header(value)?;
                    by_host_secret.entry((host.clone(), secret)).or_default().insert(header.clone(), written);
                }
            }
        }
        Ok(by_host_secret
            .into_iter()
            .enumerate()
            .map(|(n, ((host, secret), set_header))| {
                (format!("E2B_SECRET_{n}"), SecretBinding { secret, hosts: vec![host], set_header, placeholder: None })
            })
            .collect())
    }
}

/// E2B's `network` of a create, as sent (`null` or absent: none).
pub fn from_create(value: Option<&Value>) -> Result<E2bNetwork, E2bError> {
    match value {
        None | Some(Value::Null) => Ok(E2bNetwork::default()),
        Some(value) => {
            let network: E2bNetwork = serde_json::from_value(value.clone())
                .map_err(|e| refused(format!("network: {e}: SPACE refuses what it would not honour")))?;
            if network.allow_internet_access.is_some() {
                return Err(refused("network: unknown field `allow_internet_access` (give it beside network)"));
            }
            Ok(network)
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn space(network: Value, internet: Option<bool>) -> Result<Network, String> {
        from_create(Some(&network)).and_then(|n| n.to_space(internet)).map_err(|e| e.message)
    }

    #[test]
    fn deny_all_with_allow_out_is_an_allow_list() {
        let net =
            space(json!({"denyOut": ["0.0.0.0/0", "10.1.0.0/16"], "allowOut": ["192.0.2.1", "pkgs.example"]}), None)
                .unwrap();
        assert_eq!((net.egress, net.deny.len()), (Egress::Allowlist, 0));
        assert_eq!(net.allow, ["192.0.2.1", "pkgs.example"]);
        let none = space(json!({"denyOut": ["0.0.0.0/0"]}), None).unwrap();
        assert_eq!(none.egress, Egress::None);
        let off = space(json!({"allowOut": ["192.0.2.1"]}), Some(false)).unwrap();
        assert_eq!((off.egress, off.allow), (Egress::Allowlist, vec!["192.0.2.1".to_string()]));
        assert_eq!(space(json!({}), Some(false)).unwrap().egress, Egress::None);
    }

    #[test]
    fn deny_out_alone_is_public_less_those() {
        let net = space(json!({"denyOut": ["198.51.100.0/24"], "allowOut": ["192.0.2.1"]}), Some(true)).unwrap();
        assert_eq!((net.egress, net.deny), (Egress::Public, vec!["198.51.100.0/24".to_string()]));
        assert_eq!(space(json!({}), None).unwrap().egress, Egress::Public);
    }

    #[test]
    fn what_space_would_enforce_differently_is_refused() {
        for (network, why) in [
            (json!({"denyOut": ["198.51.100.0/24"], "allowOut": ["198.51.100.7"]}), "lets through part"),
            (json!({"allowOut": ["pkgs.example"]}), "host names are allowed only"),
            (json!({"egressProxy": {"address": "proxy.example:1080"}}), "egress proxy"),
            (json!({"maskRequestHost": "${PORT}-x.example"}), "maskRequestHost"),
            (json!({"rules": {"api.example": [{"transform": {"headers": {"X-T": "literal"}}}]}}), "without a secret"),
            (
                json!({"denyOut": ["0.0.0.0/0"], "rules": {"api.example": [{"transform": {"headers": {"X-T": "${e2b.secrets.tok}"}}}]}}),
                "which allowOut does not list",
            ),
            (json!({"denyOut": ["not a rule at all"]}), "egress rule"),
            (json!({"somethingNew": 1}), "unknown field"),
        ] {
            let err = space(network.clone(), None).unwrap_err();
            assert!(err.contains(why), "{network}: {err}");
        }
        for public in [true, false] {
            assert!(space(json!({"allowPublicTraffic": public}), None).is_ok(), "the SDK always sends it");
        }
    }

    #[test]
    fn header_transforms_are_secret_bindings_for_their_host() {
        let net = space(
            json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["api.example"], "rules": {"api.example": [
                {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.tok}", "X-Key": "${e2b.secrets.tok}"}}}
            ]}}),
            None,
        )
        .unwrap();
        let binding = &net.secrets["E2B_SECRET_0"];
        assert_eq!((binding.secret.as_str(), binding.hosts.clone()), ("tok", vec!["api.example".to_string()]));
        assert_eq!(binding.set_header["Authorization"], "Bearer {secret}");
        assert_eq!(binding.set_header["X-Key"], "{secret}");
    }

    #[test]
    fn networks_overlap_by_their_common_prefix() {
        let net = |s: &str| cidr(s).unwrap();
        assert!(overlap(net("10.0.0.0/8"), net("10.2.3.4")));
        assert!(!overlap(net("10.0.0.0/8"), net("11.0.0.1")));
        assert!(overlap(net("0.0.0.0/0"), net("192.0.2.1")));
        assert!(!overlap(net("2001:db8::/32"), net("192.0.2.1")));
        assert!(overlap(net("2001:db8::/32"), net("2001:db8::1")));
        assert_eq!(cidr("pkgs.example"), None);
    }
}
