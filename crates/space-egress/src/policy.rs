//! A sandbox's egress policy and the decisions made with it.
//!
//! Rules are written `host`, `*.suffix`, an IP or a CIDR, each optionally
//! followed by `:port[,port...]` (default: 80 and 443). Names are matched
//! lowercased and without a trailing dot; `*.a.example` matches the
//! subdomains of `a.example`, not `a.example` itself. CIDRs (and IPs) match
//! only targets given as IP literals. Precedence: addresses that are never
//! reachable (loopback, private, link-local, metadata, multicast: see
//! [`always_denied`]) beat `deny` rules, which beat `allow` rules. A name
//! is judged before it is ever looked up; its addresses are judged again
//! after.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

/// Ports a rule without ports allows.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];
/// Rules in one list, at most.
pub const MAX_RULES: usize = 256;

/// What a sandbox may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Nothing (the gateway answers every request with 403).
    #[default]
    None,
    /// Only what `allow` lists (and `deny` does not).
    Allowlist,
    /// Any public address, on any port, but what `deny` lists.
    Public,
}

/// Where a request wants to go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Name(String),
    Ip(IpAddr),
}

impl Target {
    /// Parses the host of a request: an IP literal (IPv6 in brackets or
    /// not) or a DNS name, normalised; `None` when it is neither.
    pub fn parse(host: &str) -> Option<Target> {
        let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Some(Target::Ip(ip));
        }
        normal_name(host).map(Target::Name)
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Name(name) => f.write_str(name),
            Target::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// A DNS name lowercased, without its trailing dot, if it is one: labels
/// of letters, digits, `-` and `_`, each 1-63 long, 253 at most in all.
fn normal_name(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let labels_ok = name.split('.').all(|label| {
        (1..=63).contains(&label.len())
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-')
    });
    (labels_ok && !name.is_empty() && name.len() <= 253).then_some(name)
}

/// One rule of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pattern: Pattern,
    /// Empty: any port (only for `deny` rules written without ports).
    ports: Vec<u16>,
    text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    Exact(String),
    /// `*.suffix`: the suffix, matched by names ending in `.suffix`.
    Subdomains(String),
    Cidr(IpAddr, u8),
}

/// Why a rule could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("egress rule {rule:?}: {why}")]
pub struct RuleError {
    pub rule: String,
    pub why: String,
}

impl Rule {
    /// Reads a rule; `deny` rules without ports cover every port.
    pub fn parse(text: &str, deny: bool) -> Result<Rule, RuleError> {
        let fail = |why: &str| RuleError { rule: text.to_string(), why: why.to_string() };
        let text = text.trim();
        if text.is_empty() || text.len() > 300 {
            return Err(fail("give a host, *.suffix, IP or CIDR, optionally with :ports"));
        }
        // `[v6]:ports`, `v6/len` (no ports) or `host:ports`.
        let (host, ports) = if let Some(rest) = text.strip_prefix('[') {
            let (inner, after) = rest.split_once(']').ok_or_else(|| fail("an unclosed ["))?;
            (inner, after.strip_prefix(':'))
        } else if text.matches(':').count() > 1 {
            (text, None)
        } else {
            match text.split_once(':') {
                Some((host, ports)) => (host, Some(ports)),
                None => (text, None),
            }
        };
        let ports = match ports {
            None if deny => Vec::new(),
            None => DEFAULT_PORTS.to_vec(),
            Some(list) => list
                .split(',')
                .map(|p| p.trim().parse::<u16>().ok().filter(|p| *p > 0))
                .collect::<Option<Vec<u16>>>()
                .ok_or_else(|| fail("ports are numbers from 1 to 65535, separated by commas"))?,
        };
        let pattern = if let Some((ip, len)) = host.split_once('/') {
            let ip: IpAddr = ip.parse().map_err(|_| fail("a CIDR starts with an IP address"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let len: u8 = len.parse().ok().filter(|l| *l <= max).ok_or_else(|| fail("a bad prefix length"))?;
            Pattern::Cidr(ip, len)
        } else if let Ok(ip) = host.parse::<IpAddr>() {
            Pattern::Cidr(ip, if ip.is_ipv4() { 32 } else { 128 })
        } else if let Some(suffix) = host.strip_prefix("*.") {
            Pattern::Subdomains(normal_name(suffix).ok_or_else(|| fail("not a DNS name after *."))?)
        } else {
            Pattern::Exact(normal_name(host).ok_or_else(|| fail("not a DNS name, IP or CIDR"))?)
        };
        Ok(Rule { pattern, ports, text: text.to_string() })
    }

    /// Whether it covers `target` on `port`.
    pub fn matches(&self, target: &Target, port: u16) -> bool {
        let host = match (&self.pattern, target) {
            (Pattern::Exact(want), Target::Name(name)) => want == name,
            (Pattern::Subdomains(suffix), Target::Name(name)) => {
                name.len() > suffix.len() + 1 && name.ends_with(suffix.as_str()) && {
                    let cut = name.len() - suffix.len();
                    name.as_bytes()[cut - 1] == b'.'
                }
            }
            (Pattern::Cidr(net, len), Target::Ip(ip)) => in_net(*ip, *net, *len),
            _ => false,
        };
        host && (self.ports.is_empty() || self.ports.contains(&port))
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Whether `ip` is inside `net`/`len` (never across address families).
pub fn in_net(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len)) };
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = if len == 0 { 0 } else { u128::MAX << (128 - u32::from(len)) };
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// Addresses no sandbox may reach, whatever its policy: this host and its
/// networks (loopback, RFC 1918, CGNAT, link-local and the cloud metadata
/// address in it, unique-local), unspecified, multicast, reserved and
/// broadcast; IPv4 inside IPv6 (mapped, NAT64) is judged as IPv4.
pub fn always_denied(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => denied_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return denied_v4(v4);
            }
            let segments = v6.segments();
            // 64:ff9b::/96 (NAT64) carries an IPv4 address in its last 32 bits.
            if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return denied_v4(Ipv4Addr::from((u32::from(segments[6]) << 16) | u32::from(segments[7])));
            }
            v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || segments[0] & 0xfe00 == 0xfc00 // unique local
                || segments[0] & 0xffc0 == 0xfe80 // link-local
                || v6 == Ipv6Addr::UNSPECIFIED
        }
    }
}

fn denied_v4(ip: Ipv4Addr) -> bool {
    const NETS: [(u32, u8); 11] = [
        (0x0000_0000, 8),  // "this network"
        (0x0a00_0000, 8),  // 10/8
        (0x6440_0000, 10), // 100.64/10 (CGNAT)
        (0x7f00_0000, 8),  // loopback
        (0xa9fe_0000, 16), // link-local, the metadata address 169.254.169.254
        (0xac10_0000, 12), // 172.16/12
        (0xc000_0000, 24), // 192.0.0/24 (IETF protocol assignments)
        (0xc0a8_0000, 16), // 192.168/16
        (0xc612_0000, 15), // 198.18/15 (benchmarking)
        (0xe000_0000, 4),  // multicast
        (0xf000_0000, 4),  // reserved, broadcast
    ];
    NETS.iter().any(|(net, len)| in_net(IpAddr::V4(ip), IpAddr::V4(Ipv4Addr::from(*net)), *len))
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The sandbox's egress is `none`.
    EgressDisabled,
    /// No allow rule covers the host.
    NotAllowed,
    /// An allow rule covers the host, but not on this port.
    PortNotAllowed,
    /// A deny rule covers it.
    DeniedRule,
    /// It is, or resolves to, an address no sandbox may reach.
    InternalAddress,
    /// The name did not resolve (or to nothing usable).
    NotResolved,
    /// The request was not one the gateway serves.
    BadRequest,
    /// Past a limit of the sandbox (connections).
    Limit,
    /// The upstream could not be reached.
    Unreachable,
    /// Open when the policy changed, and no longer allowed: cut.
    PolicyChanged,
    /// A tunnel to a TLS port that did not open with a TLS ClientHello.
    NotTls,
    /// The TLS server name differs from the host the tunnel was asked for.
    SniMismatch,
    /// Nothing went either way for too long (a paused sandbox's tunnel).
    Idle,
    /// A secret's placeholder headed to a host the secret is not bound to.
    SecretNotForHost,
    /// A request inside an inspected tunnel named another host.
    WrongHost,
    /// A bound secret no longer exists (deleted after the sandbox started).
    SecretUnavailable,
    /// The upstream's TLS certificate did not verify, or its handshake failed.
    UpstreamTls,
    /// The sandbox's program did not finish TLS with the gateway (it does
    /// not trust the sandbox's CA).
    ClientTls,
    /// Past the sandbox's new connections per second.
    RateLimit,
    /// The host answered a connection a secret is bound to in an encoding
    /// (gzip, br…) the redaction cannot read, though asked for `identity`.
    EncodedAnswer,
    /// A request the gateway and the host behind it could read two ways:
    /// more than one `Host` or `Content-Length`, or a body with both a
    /// length and a transfer coding (RFC 9112 §3.2, §6.3).
    Ambiguous,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::EgressDisabled => "egress_disabled",
            Reason::NotAllowed => "not_allowed",
            Reason::PortNotAllowed => "port_not_allowed",
            Reason::DeniedRule => "denied_rule",
            Reason::InternalAddress => "internal_address",
            Reason::NotResolved => "not_resolved",
            Reason::BadRequest => "bad_request",
            Reason::Limit => "limit",
            Reason::Unreachable => "unreachable",
            Reason::PolicyChanged => "policy_changed",
            Reason::NotTls => "not_tls",
            Reason::SniMismatch => "sni_mismatch",
            Reason::Idle => "idle",
            Reason::SecretNotForHost => "secret_not_for_host",
            Reason::WrongHost => "wrong_host",
            Reason::SecretUnavailable => "secret_unavailable",
            Reason::UpstreamTls => "upstream_tls",
            Reason::ClientTls => "client_tls",
            Reason::RateLimit => "rate_limit",
            Reason::Ambiguous => "ambiguous_request",
            Reason::EncodedAnswer => "encoded_answer",
        }
    }

    /// What the sandbox's program is told.
    pub fn explain(self) -> &'static str {
        match self {
            Reason::EgressDisabled => "this sandbox has no egress (network.egress is \"none\")",
            Reason::NotAllowed => "the host is not on this sandbox's egress allow list",
            Reason::PortNotAllowed => "the host is allowed, but not on this port",
            Reason::DeniedRule => "a deny rule of this sandbox's egress policy covers the host",
            Reason::InternalAddress => "the address is internal (loopback, private, link-local or metadata)",
            Reason::NotResolved => "the host name did not resolve",
            Reason::BadRequest => "the gateway serves HTTP CONNECT and absolute-form http:// requests",
            Reason::Limit => "too many connections from this sandbox at once",
            Reason::Unreachable => "the host could not be reached",
            Reason::PolicyChanged => "the sandbox's egress policy changed and no longer allows this connection",
            Reason::NotTls => "a tunnel to port 443 must start with a TLS ClientHello",
            Reason::SniMismatch => "the TLS server name is not the host the tunnel was opened to",
            Reason::Idle => "the connection was idle too long",
            Reason::SecretNotForHost => {
                "a secret's placeholder may go only to the hosts the secret is bound to, over HTTPS"
            }
            Reason::WrongHost => "a request in this tunnel named a host other than the one it was opened to",
            Reason::SecretUnavailable => "a secret bound to this sandbox no longer exists",
            Reason::UpstreamTls => "the host's TLS certificate did not verify",
            Reason::ClientTls => "the program did not accept the gateway's certificate (trust the sandbox CA)",
            Reason::RateLimit => "too many new connections per second from this sandbox",
            Reason::Ambiguous => {
                "the request is ambiguous: one Host, and one of Content-Length or Transfer-Encoding: chunked"
            }
            Reason::EncodedAnswer => {
                "the host's answer was compressed: to a host a secret is bound to, answers must be uncompressed"
            }
        }
    }
}

/// A sandbox's egress policy, ready to judge requests.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub mode: Mode,
    pub allow: Vec<Rule>,
    pub deny: Vec<Rule>,
    /// Secrets the gateway adds to HTTPS requests to their hosts.
    pub bindings: Vec<Binding>,
}

/// Port on which bound secrets travel (HTTPS).
pub const SECRET_PORT: u16 = 443;

/// A secret bound into a sandbox: where its placeholder may be replaced.
#[derive(Debug, Clone)]
pub struct Binding {
    /// The secret's name in the tenant's store.
    pub secret: String,
    /// What the sandbox holds instead of the value.
    pub placeholder: String,
    /// Hosts (exact or `*.suffix`, on port 443) it goes to.
    pub hosts: Vec<Rule>,
    /// Headers set on every request to those hosts; `{secret}` in the
    /// value stands for the secret.
    pub set_header: Vec<(String, String)>,
}

impl Binding {
    /// Reads a binding's hosts: names or `*.suffix` only (no IPs, no
    /// ports: secrets go over HTTPS to a named host). Without hosts it
    /// covers nothing.
    pub fn new(
        secret: &str,
        placeholder: &str,
        hosts: &[String],
        set_header: Vec<(String, String)>,
    ) -> Result<Binding, RuleError> {
        let hosts = hosts
            .iter()
            .map(|host| {
                let fail = |why: &str| RuleError { rule: host.clone(), why: why.into() };
                if host.contains(':') || host.contains('/') || host.parse::<IpAddr>().is_ok() {
                    return Err(fail("a secret's hosts are names or *.suffix, without ports"));
                }
                Rule::parse(&format!("{host}:{SECRET_PORT}"), false)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Binding { secret: secret.into(), placeholder: placeholder.into(), hosts, set_header })
    }

    /// Whether it may go to `host` (on port 443).
    pub fn covers(&self, host: &Target) -> bool {
        self.hosts.iter().any(|rule| rule.matches(host, SECRET_PORT))
    }
}

impl Policy {
    /// Reads the rule lists of a policy; every bad rule is an error.
    pub fn new(mode: Mode, allow: &[String], deny: &[String]) -> Result<Policy, RuleError> {
        if allow.len() > MAX_RULES || deny.len() > MAX_RULES {
            return Err(RuleError { rule: String::new(), why: format!("at most {MAX_RULES} rules per list") });
        }
        if mode != Mode::Allowlist && !allow.is_empty() {
            return Err(RuleError { rule: allow[0].clone(), why: "allow rules need \"egress\": \"allowlist\"".into() });
        }
        Ok(Policy {
            mode,
            allow: allow.iter().map(|r| Rule::parse(r, false)).collect::<Result<_, _>>()?,
            deny: deny.iter().map(|r| Rule::parse(r, true)).collect::<Result<_, _>>()?,
            bindings: Vec::new(),
        })
    }

    /// Adds secret bindings; their hosts become allowed on port 443.
    pub fn with_bindings(mut self, bindings: Vec<Binding>) -> Result<Policy, RuleError> {
        if !bindings.is_empty() && self.mode == Mode::None {
            return Err(RuleError {
                rule: bindings[0].secret.clone(),
                why: "secrets need \"egress\": \"allowlist\" or \"public\"".into(),
            });
        }
        self.bindings = bindings;
        Ok(self)
    }

    /// Whether the gateway terminates TLS to `target`:`port` (a host a
    /// secret is bound to) rather than tunnelling it untouched.
    pub fn inspects(&self, target: &Target, port: u16) -> bool {
        port == SECRET_PORT && self.bindings.iter().any(|b| b.covers(target))
    }

    /// The verdict on `target`:`port` before any lookup: `Ok` with the rule
    /// that allowed it (`None` under `public`), or why not.
    pub fn decide(&self, target: &Target, port: u16) -> Result<Option<&Rule>, Reason> {
        if self.mode == Mode::None {
            return Err(Reason::EgressDisabled);
        }
        if let Target::Ip(ip) = target {
            if always_denied(*ip) {
                return Err(Reason::InternalAddress);
            }
        }
        if self.deny.iter().any(|rule| rule.matches(target, port)) {
            return Err(Reason::DeniedRule);
        }
        if let Some(binding) = self.bindings.iter().find(|b| port == SECRET_PORT && b.covers(target)) {
            return Ok(binding.hosts.iter().find(|rule| rule.matches(target, port)));
        }
        match self.mode {
            Mode::Public => Ok(None),
            _ => match self.allow.iter().find(|rule| rule.matches(target, port)) {
                Some(rule) => Ok(Some(rule)),
                None if self.allow.iter().any(|rule| rule.matches_host(target)) => Err(Reason::PortNotAllowed),
                None => Err(Reason::NotAllowed),
            },
        }
    }
}

/// What a tenant's sandboxes may ever be allowed: rules in the same forms
/// (without ports a rule covers every port), `*` for any public host.
#[derive(Debug, Clone, Default)]
pub struct Ceiling {
    pub public: bool,
    pub rules: Vec<Rule>,
}

impl Ceiling {
    pub fn parse(rules: &[String]) -> Result<Ceiling, RuleError> {
        let mut ceiling = Ceiling::default();
        for rule in rules {
            if rule.trim() == "*" {
                ceiling.public = true;
            } else {
                ceiling.rules.push(Rule::parse(rule, true)?);
            }
        }
        Ok(ceiling)
    }

    /// The first part of `policy` beyond the ceiling, as written, if any:
    /// `public` egress, an allow rule or a secret's host.
    pub fn beyond(&self, policy: &Policy) -> Option<String> {
        if self.public || policy.mode == Mode::None {
            return None;
        }
        if policy.mode == Mode::Public {
            return Some("\"egress\": \"public\"".into());
        }
        let covered = |rule: &Rule| self.rules.iter().any(|outer| rule.within(outer));
        if let Some(rule) = policy.allow.iter().find(|rule| !covered(rule)) {
            return Some(rule.text.clone());
        }
        policy.bindings.iter().flat_map(|b| &b.hosts).find(|rule| !covered(rule)).map(|rule| rule.text.clone())
    }
}

impl Rule {
    /// Whether everything this rule covers, `outer` covers too.
    pub fn within(&self, outer: &Rule) -> bool {
        let hosts = match (&self.pattern, &outer.pattern) {
            (Pattern::Exact(name), Pattern::Exact(other)) => name == other,
            (Pattern::Exact(name), Pattern::Subdomains(_)) => outer.matches_host(&Target::Name(name.clone())),
            (Pattern::Subdomains(suffix), Pattern::Subdomains(other)) => {
                suffix == other || outer.matches_host(&Target::Name(suffix.clone()))
            }
            (Pattern::Cidr(ip, len), Pattern::Cidr(net, net_len)) => len >= net_len && in_net(*ip, *net, *net_len),
            _ => false,
        };
        let ports =
            outer.ports.is_empty() || (!self.ports.is_empty() && self.ports.iter().all(|p| outer.ports.contains(p)));
        hosts && ports
    }

    fn matches_host(&self, target: &Target) -> bool {
        Rule { ports: Vec::new(), ..self.clone() }.matches(target, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> Target {
        Target::parse(n).unwrap()
    }

    fn policy(mode: Mode, allow: &[&str], deny: &[&str]) -> Policy {
        let owned = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Policy::new(mode, &owned(allow), &owned(deny)).unwrap()
    }

    #[test]
    fn names_are_normalised_and_wildcards_match_subdomains_only() {
        let p = policy(Mode::Allowlist, &["pkgs.example", "*.files.example", "git.example:22,443"], &[]);
        assert!(p.decide(&name("PKGS.example."), 443).is_ok());
        assert!(p.decide(&name("pkgs.example"), 80).is_ok());
        assert_eq!(p.decide(&name("pkgs.example"), 8080).unwrap_err(), Reason::PortNotAllowed);
        assert!(p.decide(&name("a.b.files.example"), 443).is_ok());
        assert_eq!(p.decide(&name("files.example"), 443).unwrap_err(), Reason::NotAllowed);
        assert_eq!(p.decide(&name("evilfiles.example"), 443).unwrap_err(), Reason::NotAllowed);
        assert!(p.decide(&name("git.example"), 22).is_ok());
        assert_eq!(p.decide(&name("git.example"), 80).unwrap_err(), Reason::PortNotAllowed);
        assert_eq!(p.decide(&name("pkgs.example.evil.test"), 443).unwrap_err(), Reason::NotAllowed);
    }

    #[test]
    fn deny_beats_allow_and_internal_addresses_beat_everything() {
        let p = policy(Mode::Allowlist, &["*.example", "10.0.0.0/8:443", "203.0.113.0/24:443"], &["bad.example"]);
        assert_eq!(p.decide(&name("bad.example"), 443).unwrap_err(), Reason::DeniedRule);
        assert!(p.decide(&name("good.example"), 443).is_ok());
        assert_eq!(p.decide(&name("10.1.2.3"), 443).unwrap_err(), Reason::InternalAddress);
        assert!(p.decide(&name("203.0.113.9"), 443).is_ok());
        assert_eq!(p.decide(&name("198.51.100.1"), 443).unwrap_err(), Reason::NotAllowed);
        // A CIDR never matches a name, nor a name rule an IP.
        assert_eq!(p.decide(&name("203.0.113.9"), 80).unwrap_err(), Reason::PortNotAllowed);
        let public = policy(Mode::Public, &[], &["*.tracker.example"]);
        assert!(public.decide(&name("anything.example"), 5432).is_ok());
        assert_eq!(public.decide(&name("x.tracker.example"), 443).unwrap_err(), Reason::DeniedRule);
        for internal in ["127.0.0.1", "::1", "169.254.169.254", "192.168.1.1", "[::ffff:10.0.0.1]", "100.64.0.1"] {
            assert_eq!(public.decide(&name(internal), 443).unwrap_err(), Reason::InternalAddress, "{internal}");
        }
        let none = policy(Mode::None, &[], &[]);
        assert_eq!(none.decide(&name("anything.example"), 443).unwrap_err(), Reason::EgressDisabled);
    }

    #[test]
    fn the_always_denied_set_covers_embedded_and_odd_forms() {
        for ip in [
            "0.0.0.0",
            "127.9.9.9",
            "172.31.255.255",
            "224.0.0.1",
            "255.255.255.255",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(always_denied(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["203.0.113.10", "8.8.8.8", "2001:db8::1", "172.32.0.1", "64:ff9b::808:808"] {
            assert!(!always_denied(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn bad_rules_are_refused_with_the_reason() {
        for bad in ["", "*.", "a..b", "host:0", "host:http", "1.2.3.4/33", "[::1", "-a.example", "é.example"] {
            assert!(Rule::parse(bad, false).is_err(), "{bad:?}");
        }
        let err = Policy::new(Mode::Public, &["a.example".into()], &[]).unwrap_err();
        assert!(err.why.contains("allowlist"), "{err}");
        assert!(Rule::parse("[2001:db8::1]:443", false).unwrap().matches(&name("2001:db8::1"), 443));
        assert!(Rule::parse("2001:db8::/32", false).unwrap().matches(&name("[2001:db8::7]"), 80));
    }

    #[test]
    fn a_ceiling_bounds_rules_hosts_ports_and_secrets() {
        let ceiling =
            Ceiling::parse(&["*.pkgs.example".into(), "git.example:443".into(), "203.0.113.0/24".into()]).unwrap();
        let within = |allow: &[&str]| {
            let allow: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
            ceiling.beyond(&Policy::new(Mode::Allowlist, &allow, &[]).unwrap())
        };
        assert_eq!(within(&["a.pkgs.example", "*.b.pkgs.example:8080", "git.example:443", "203.0.113.8/30:22"]), None);
        assert_eq!(within(&["pkgs.example"]).as_deref(), Some("pkgs.example"), "the suffix itself is not a subdomain");
        assert_eq!(within(&["git.example"]).as_deref(), Some("git.example"), "port 80 is beyond git.example:443");
        assert_eq!(within(&["203.0.0.0/16"]).as_deref(), Some("203.0.0.0/16"));
        let public = Policy::new(Mode::Public, &[], &[]).unwrap();
        assert!(ceiling.beyond(&public).is_some());
        assert!(Ceiling::parse(&["*".into()]).unwrap().beyond(&public).is_none());
        assert!(ceiling.beyond(&Policy::default()).is_none(), "no egress is always within");
        let secret = Binding::new("k", "p", &["api.example".into()], vec![]).unwrap();
        let bound = Policy::new(Mode::Allowlist, &[], &[]).unwrap().with_bindings(vec![secret]).unwrap();
        assert_eq!(ceiling.beyond(&bound).as_deref(), Some("api.example:443"));
    }
}
