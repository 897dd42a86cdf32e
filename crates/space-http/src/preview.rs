//! A preview's host name, `{port}-{sandbox_id}.{domain}`: which requests
//! a server (a node, or a cluster's control plane) takes for a sandbox's
//! port rather than for its API (decision 035). The node's `preview`
//! module serves them; a control plane sends them on to the sandbox's node.

use space_core::ids::SandboxId;

/// What a control plane sends a node a preview request's host in (with
/// the node token): the node's own `Host` is the control plane's link.
pub const FORWARDED_HOST: &str = "x-space-preview-host";

/// What a name in the preview domain that names no port gets (404).
pub const NO_SUCH_PREVIEW: &str = "no such preview: a preview's host is {port}-{sandbox_id} under the domain";

/// What a private port gets without a proof (403, as E2B's proxy answers),
/// and a sandbox that does not exist alike.
pub fn private_port(port: u16) -> String {
    format!(
        "port {port} of this sandbox is private: send its preview token in X-Space-Preview-Token, or open a link \
         from GET /v1/sandboxes/{{id}}/ports/{{port}}/link"
    )
}

/// The operator's preview domain (`--preview-domain`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewDomain {
    domain: String,
}

impl PreviewDomain {
    /// A domain as the operator wrote it: lower-case labels of letters,
    /// digits and `-`, at least two of them (`preview.example.test`).
    pub fn new(domain: &str) -> Result<PreviewDomain, String> {
        let domain = domain.trim().trim_end_matches('.').to_ascii_lowercase();
        let labels: Vec<&str> = domain.split('.').collect();
        let label_ok = |l: &&str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        };
        if labels.len() < 2 || !labels.iter().all(label_ok) || domain.len() > 200 {
            return Err(format!(
                "a preview domain is a DNS name of at least two labels (such as preview.example.test), not {domain:?}"
            ));
        }
        Ok(PreviewDomain { domain })
    }

    pub fn as_str(&self) -> &str {
        &self.domain
    }

    /// The host name of a sandbox's port: the id's `_` written `-`, which a
    /// DNS name and a certificate take (`8000-sbx-4f1c….domain`).
    pub fn host(&self, id: &str, port: u16) -> String {
        format!("{port}-{}.{}", id.replace('_', "-"), self.domain)
    }

    /// Where a host falls: outside the domain (the API's), a sandbox's port,
    /// or in the domain but naming none (refused, never the API).
    pub fn classify(&self, host: &[u8]) -> Zone {
        // An optional `:port`, then an optional final dot (a fully
        // qualified name is the same name).
        let (name, bad_port) = match host.iter().rposition(|b| *b == b':') {
            Some(at) if !host.contains(&b']') => {
                let port = &host[at + 1..];
                (&host[..at], port.is_empty() || !port.iter().all(u8::is_ascii_digit))
            }
            _ => (host, false),
        };
        let trimmed = name.iter().rposition(|b| *b != b'.').map_or(&name[..0], |end| &name[..=end]);
        let dots = name.len() - trimmed.len();
        let name = trimmed;
        let lower = name.to_ascii_lowercase();
        let domain = self.domain.as_bytes();
        let inside = lower == domain
            || (lower.len() > domain.len() && lower.ends_with(domain) && lower[lower.len() - domain.len() - 1] == b'.');
        if !inside {
            return Zone::Api;
        }
        // Strict from here: written in lower case, one label before the
        // domain, `{port}-{id}`.
        if lower != name || lower.len() == domain.len() || dots > 1 || bad_port {
            return Zone::Unknown;
        }
        let label = &name[..name.len() - domain.len() - 1];
        let Ok(label) = std::str::from_utf8(label) else { return Zone::Unknown };
        let Some((port, id)) = label.split_once('-') else { return Zone::Unknown };
        let port = match port.parse::<u16>() {
            Ok(p) if p > 0 && !port.starts_with('0') && port.bytes().all(|b| b.is_ascii_digit()) => p,
            _ => return Zone::Unknown,
        };
        // `sbx-…` (as a DNS name has it) or `sbx_…` (as E2B's SDK writes it).
        let id = match id.strip_prefix("sbx-") {
            Some(rest) => format!("sbx_{rest}"),
            None => id.to_string(),
        };
        match SandboxId::parse(&id) {
            Some(id) => Zone::Port { id, port },
            None => Zone::Unknown,
        }
    }
}

/// Where a request's host falls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Zone {
    Api,
    Port {
        id: SandboxId,
        port: u16,
    },
    /// In the preview domain, naming no port of a sandbox.
    Unknown,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "sbx_4f1c0a9e2b7d3c5a8e61";

    fn domain() -> PreviewDomain {
        PreviewDomain::new("preview.space.test").unwrap()
    }

    fn port(host: &str) -> Zone {
        domain().classify(host.as_bytes())
    }

    #[test]
    fn a_host_names_a_port_of_a_sandbox_strictly() {
        let at = |port| Zone::Port { id: SandboxId::parse(ID).unwrap(), port };
        assert_eq!(port("8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test"), at(8000));
        assert_eq!(port("8000-sbx_4f1c0a9e2b7d3c5a8e61.preview.space.test"), at(8000));
        assert_eq!(port("8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test:7070"), at(8000));
        assert_eq!(port("8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test."), at(8000));
        assert_eq!(domain().host(ID, 8000), "8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test");
        for unknown in [
            "preview.space.test",
            "PREVIEW.space.test",
            "8000-SBX-4F1C0A9E2B7D3C5A8E61.preview.space.test",
            "08000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test",
            "0-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test",
            "65536-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test",
            "+80-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test",
            "8000-sbx-4f1c.preview.space.test",
            "a.8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test",
            "8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test:x",
            "api.preview.space.test",
            "8000-sbx-4f1c0a9e2b7d3c5a8e61.preview.space.test..",
        ] {
            assert_eq!(port(unknown), Zone::Unknown, "{unknown}");
        }
        for api in
            ["api.space.test", "127.0.0.1:7070", "xpreview.space.test", "preview.space.test.example", "[::1]:7070"]
        {
            assert_eq!(port(api), Zone::Api, "{api}");
        }
    }

    #[test]
    fn a_domain_is_a_dns_name() {
        assert_eq!(PreviewDomain::new("Preview.Space.Test.").unwrap().as_str(), "preview.space.test");
        for bad in ["", "test", "a..test", "-a.test", "a_b.test", "a.test/x", "*.a.test"] {
            assert!(PreviewDomain::new(bad).is_err(), "{bad}");
        }
    }
}
