//! Where the client may connect: public addresses only, over HTTPS, except
//! for the operator's insecure-listed `host[:port]`s. Checked on every URL
//! the client asks for, on every redirect, and when a name resolves (a URL
//! with an address in it is never resolved, so both are needed).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;
use space_egress::policy::always_denied;
use tokio_rustls::rustls;

use crate::reference::canonical_host;
use crate::{ImageError, RegistryConfig};

/// Longest a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a registry may stay silent while it sends a body.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Redirects followed for one request (a blob's storage host is one).
const MAX_REDIRECTS: usize = 5;

/// The operator's insecure list, parsed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Insecure {
    /// Host (as a URL writes it: lowercase, IPv6 in brackets) and port
    /// (`None`: every port).
    entries: Vec<(String, Option<u16>)>,
}

impl Insecure {
    pub(crate) fn parse(list: &[String]) -> Result<Insecure, ImageError> {
        let mut entries = Vec::new();
        for entry in list {
            let host = canonical_host(entry)
                .map_err(|why| ImageError::Config(format!("insecure registry {entry:?}: {why}")))?;
            let (name, port) = split_port(&host);
            entries.push((name.to_string(), port));
        }
        Ok(Insecure { entries })
    }

    /// Whether `host:port` is listed.
    pub(crate) fn allows(&self, host: &str, port: u16) -> bool {
        let host = host.to_ascii_lowercase();
        self.entries.iter().any(|(name, listed)| *name == host && listed.is_none_or(|p| p == port))
    }

    /// Whether `registry` (`host[:port]`, no scheme) is listed, for the
    /// scheme the client speaks to it: a listed registry is spoken to over
    /// plain HTTP (port 80 unless it names one).
    pub(crate) fn lists_registry(&self, registry: &str) -> bool {
        let (host, port) = split_port(registry);
        self.allows(host, port.unwrap_or(80))
    }

    /// Whether some port of `host` is listed: the resolver then lets the
    /// name resolve to any address, so a URL to another port of it must be
    /// refused before it connects.
    fn names_host(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        self.entries.iter().any(|(name, _)| *name == host)
    }
}

/// `host[:port]` (checked) → host, port.
fn split_port(host: &str) -> (&str, Option<u16>) {
    let split_at = if host.starts_with('[') { host.find("]:").map(|i| i + 1) } else { host.rfind(':') };
    match split_at {
        Some(i) => (&host[..i], host[i + 1..].parse().ok()),
        None => (host, None),
    }
}

/// An address the policy refuses: carried through reqwest's errors (from
/// the resolver and the redirect policy) to become [`ImageError::Refused`].
#[derive(Debug)]
pub(crate) struct AddressRefused(pub(crate) String);

impl std::fmt::Display for AddressRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AddressRefused {}

/// Whether the client may ask `url` at all.
pub(crate) fn check_url(url: &Url, insecure: &Insecure) -> Result<(), AddressRefused> {
    let Some(host) = url.host_str() else {
        return Err(AddressRefused(format!("{url} names no host")));
    };
    let port = url.port_or_known_default().unwrap_or(0);
    if !url.username().is_empty() || url.password().is_some() {
        return Err(AddressRefused(format!("a URL with credentials in it (host {host})")));
    }
    let listed = insecure.allows(host, port);
    match url.scheme() {
        "https" => {}
        "http" if listed => {}
        "http" => {
            return Err(AddressRefused(format!(
                "plain HTTP to {host}:{port}: allowed only for an insecure-listed registry"
            )))
        }
        other => return Err(AddressRefused(format!("scheme {other:?} (host {host})"))),
    }
    let address = match url.host() {
        Some(url::Host::Ipv4(v4)) => Some(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => Some(IpAddr::V6(v6)),
        _ => None,
    };
    match address {
        Some(ip) if always_denied(ip) && !listed => Err(AddressRefused(format!(
            "{host}:{port} is a loopback, private or link-local address and not an insecure-listed registry"
        ))),
        None if !listed && insecure.names_host(host) => {
            Err(AddressRefused(format!("{host}:{port}: only other ports of this host are insecure-listed")))
        }
        _ => Ok(()),
    }
}

/// Resolves names with the system resolver, keeping only the addresses the
/// policy allows (all of them for an insecure-listed host).
struct PublicOnly {
    insecure: Insecure,
    /// The operator's fixed answers (`--registry-host NAME=IP`), asked
    /// instead of the system resolver for those names.
    fixed: Vec<(String, IpAddr)>,
}

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let name = name.as_str().to_string();
        let listed = self.insecure.names_host(&name);
        let fixed: Vec<SocketAddr> = self
            .fixed
            .iter()
            .filter(|(fixed, _)| fixed.eq_ignore_ascii_case(&name))
            .map(|(_, ip)| SocketAddr::new(*ip, 0))
            .collect();
        Box::pin(async move {
            let found: Vec<SocketAddr> = match fixed.is_empty() {
                true => tokio::net::lookup_host((name.as_str(), 0)).await?.collect(),
                false => fixed,
            };
            let allowed = allowed_addresses(&name, found, listed)?;
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

fn allowed_addresses(
    name: &str,
    found: Vec<SocketAddr>,
    listed: bool,
) -> Result<Vec<SocketAddr>, Box<dyn std::error::Error + Send + Sync>> {
    if listed {
        return Ok(found);
    }
    let allowed: Vec<SocketAddr> = found.iter().copied().filter(|a| !always_denied(a.ip())).collect();
    if allowed.is_empty() && !found.is_empty() {
        return Err(Box::new(AddressRefused(format!(
            "{name} resolves only to loopback, private or link-local addresses, and is not an insecure-listed \
             registry"
        ))));
    }
    Ok(allowed)
}

/// The HTTP client: HTTP/1.1, rustls on ring with the system roots and the
/// operator's, the address policy on names and redirects, no proxy (a
/// proxy would resolve names past the policy), timeouts on connecting and
/// on each read.
pub(crate) fn http_client(config: &RegistryConfig, insecure: &Insecure) -> Result<reqwest::Client, ImageError> {
    let tls = tls_config(&config.extra_ca_pem)?;
    let redirects = insecure.clone();
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() > MAX_REDIRECTS {
            return attempt.error(AddressRefused(format!("more than {MAX_REDIRECTS} redirects")));
        }
        match check_url(attempt.url(), &redirects) {
            Ok(()) => attempt.follow(),
            Err(refused) => attempt.error(AddressRefused(format!("a redirect to {}", refused.0))),
        }
    });
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .dns_resolver(Arc::new(PublicOnly { insecure: insecure.clone(), fixed: config.hosts.clone() }))
        .redirect(policy)
        .referer(false)
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .user_agent(config.user_agent.clone())
        .build()
        .map_err(|e| ImageError::Config(format!("the HTTP client: {}", chain(&e))))
}

fn tls_config(extra_pem: &[Vec<u8>]) -> Result<rustls::ClientConfig, ImageError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    // A host without the bundle can still reach registries the operator
    // gave a CA for.
    if let Ok(certs) = CertificateDer::pem_file_iter("/etc/ssl/certs/ca-certificates.crt") {
        roots.add_parsable_certificates(certs.flatten());
    }
    for (n, pem) in extra_pem.iter().enumerate() {
        let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| ImageError::Config(format!("extra CA {}: {e}", n + 1)))?;
        if certs.is_empty() {
            return Err(ImageError::Config(format!("extra CA {}: no certificate in it", n + 1)));
        }
        roots.add_parsable_certificates(certs);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ImageError::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// An error and its causes on one line.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A transport error as the caller sees it: a refusal by the policy, or a
/// network failure.
pub(crate) fn transport_error(err: reqwest::Error, what: &str) -> ImageError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(cause) = source {
        if let Some(refused) = cause.downcast_ref::<AddressRefused>() {
            return ImageError::Refused(format!("{what}: {refused}"));
        }
        source = cause.source();
    }
    if err.is_timeout() {
        return ImageError::Network(format!("{what}: timed out ({})", chain(&err)));
    }
    ImageError::Network(format!("{what}: {}", chain(&err)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insecure(list: &[&str]) -> Insecure {
        Insecure::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn url(text: &str) -> Url {
        Url::parse(text).unwrap()
    }

    #[test]
    fn public_https_is_allowed_and_private_addresses_only_when_listed() {
        let none = insecure(&[]);
        assert!(check_url(&url("https://registry.test/v2/"), &none).is_ok());
        assert!(check_url(&url("https://192.0.2.10/v2/"), &none).is_ok());
        for refused in [
            "http://registry.test/v2/",
            "https://127.0.0.1:5000/v2/",
            "https://10.1.2.3/v2/",
            "https://169.254.169.254/latest",
            "https://[::1]/v2/",
            "https://[fe80::1]/v2/",
            "https://[::ffff:127.0.0.1]/v2/",
            "https://user:pass@registry.test/v2/",
            "ftp://registry.test/v2/",
        ] {
            assert!(check_url(&url(refused), &none).is_err(), "{refused}");
        }
        let listed = insecure(&["127.0.0.1:5000", "reg.test", "[::1]:8080"]);
        assert!(check_url(&url("http://127.0.0.1:5000/v2/"), &listed).is_ok());
        assert!(check_url(&url("http://127.0.0.1:5001/v2/"), &listed).is_err());
        assert!(check_url(&url("https://127.0.0.1:5001/v2/"), &listed).is_err());
        assert!(check_url(&url("http://reg.test:1234/v2/"), &listed).is_ok());
        assert!(check_url(&url("http://[::1]:8080/v2/"), &listed).is_ok());
        assert!(check_url(&url("http://[::1]:8081/v2/"), &listed).is_err());
        let port_only = insecure(&["reg.test:5000"]);
        assert!(check_url(&url("https://reg.test:5001/v2/"), &port_only).is_err());
        assert!(check_url(&url("https://reg.test/v2/"), &port_only).is_err());
        assert!(port_only.lists_registry("reg.test:5000"));
        assert!(!port_only.lists_registry("reg.test"));
        assert!(listed.lists_registry("reg.test"));
    }

    #[test]
    fn names_resolving_to_private_addresses_are_refused_unless_listed() {
        let found: Vec<SocketAddr> = vec!["127.0.0.1:0".parse().unwrap(), "10.0.0.1:0".parse().unwrap()];
        assert!(allowed_addresses("reg.test", found.clone(), false).is_err());
        assert_eq!(allowed_addresses("reg.test", found.clone(), true).unwrap(), found);
        let mixed: Vec<SocketAddr> = vec!["127.0.0.1:0".parse().unwrap(), "192.0.2.7:0".parse().unwrap()];
        assert_eq!(allowed_addresses("reg.test", mixed, false).unwrap(), vec!["192.0.2.7:0".parse().unwrap()]);
    }

    #[test]
    fn insecure_entries_must_parse() {
        for bad in ["http://reg.test", "reg.test:x", "", "reg.test/path"] {
            assert!(Insecure::parse(&[bad.to_string()]).is_err(), "{bad}");
        }
    }
}
