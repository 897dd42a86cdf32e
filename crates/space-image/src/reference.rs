//! Image references: `[host[:port]/]repository[:tag][@sha256:hex]`, with
//! the grammar of the distribution project's `reference` package.

use std::fmt;

use crate::{ImageError, RegistryConfig};

/// Longest repository path (the distribution project's limit for a name).
const MAX_NAME: usize = 255;
const MAX_TAG: usize = 128;

/// A parsed image reference. A reference with neither tag nor digest gets
/// the tag `latest`; one with a digest is pulled by it (its tag is kept
/// only for display).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `host[:port]`, lowercase; an IPv6 address in brackets.
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 lowercase hex>`.
    pub digest: Option<String>,
}

impl ImageRef {
    /// Parses `text`; a reference without a host goes to the configured
    /// default registry.
    pub fn parse(text: &str, config: &RegistryConfig) -> Result<ImageRef, ImageError> {
        let invalid = |why: &str| ImageError::InvalidReference(format!("{text:?}: {why}"));
        if text.is_empty() {
            return Err(invalid("empty"));
        }
        if text.contains("://") {
            return Err(invalid("name the registry's host without a scheme (host[:port]/repository:tag)"));
        }
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(invalid("it contains white space"));
        }
        let (name_and_tag, digest) = match text.split_once('@') {
            Some((name, digest)) => (name, Some(parse_digest(digest).map_err(|why| invalid(&why))?)),
            None => (text, None),
        };
        let (name, tag) = match name_and_tag.rfind(':') {
            Some(colon) if !name_and_tag[colon..].contains('/') => {
                (&name_and_tag[..colon], Some(name_and_tag[colon + 1..].to_string()))
            }
            _ => (name_and_tag, None),
        };
        if let Some(tag) = &tag {
            if !valid_tag(tag) {
                return Err(invalid("a tag is 1-128 letters, digits, '_', '.' and '-', not starting with '.' or '-'"));
            }
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, rest)) if first.contains(['.', ':']) || first == "localhost" => {
                (canonical_host(first).map_err(|why| invalid(&why))?, rest.to_string())
            }
            _ => {
                let Some(default) = &config.default_registry else {
                    return Err(invalid(
                        "it names no registry host: write host[:port]/repository, or have the operator set a \
                         default registry",
                    ));
                };
                let registry = canonical_host(default)
                    .map_err(|why| ImageError::Config(format!("the default registry {default:?}: {why}")))?;
                let repository = match &config.default_namespace {
                    Some(namespace) if !name.contains('/') => format!("{namespace}/{name}"),
                    _ => name.to_string(),
                };
                (registry, repository)
            }
        };
        if repository.is_empty() || repository.len() > MAX_NAME {
            return Err(invalid("the repository path is empty or longer than 255 characters"));
        }
        if !repository.split('/').all(valid_path_component) {
            return Err(invalid(
                "a repository is lowercase letters and digits, separated by '/', and inside a part by '.', '_', \
                 '__' or dashes",
            ));
        }
        let tag = if tag.is_none() && digest.is_none() { Some("latest".to_string()) } else { tag };
        Ok(ImageRef { registry, repository, tag, digest })
    }

    /// What the manifest is asked for by: the digest when pinned.
    pub fn manifest_reference(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or("latest")
    }

    /// The registry's host without its port (what credentials' `hosts`
    /// name).
    pub fn registry_host(&self) -> &str {
        host_without_port(&self.registry)
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// `host[:port]` → `host` (brackets kept around an IPv6 address).
pub(crate) fn host_without_port(registry: &str) -> &str {
    if registry.starts_with('[') {
        return registry.find(']').map(|end| &registry[..=end]).unwrap_or(registry);
    }
    registry.rsplit_once(':').map(|(host, _)| host).unwrap_or(registry)
}

/// Checks `sha256:<hex>` (the only algorithm registries use for content
/// this client verifies).
pub(crate) fn parse_digest(digest: &str) -> Result<String, String> {
    let Some((algorithm, hex)) = digest.split_once(':') else {
        return Err(format!("{digest:?} is not a digest (sha256:<64 hex digits>)"));
    };
    if algorithm != "sha256" {
        return Err(format!("digest algorithm {algorithm:?} is not supported (only sha256)"));
    }
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(format!("{digest:?} is not sha256:<64 lowercase hex digits>"));
    }
    Ok(digest.to_string())
}

/// `host[:port]` checked and lowercased: DNS labels or an IPv4 address, or
/// an IPv6 address in brackets; a port 1-65535.
pub(crate) fn canonical_host(text: &str) -> Result<String, String> {
    let why = || format!("{text:?} is not host[:port]");
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (v6, after) = rest.split_once(']').ok_or_else(why)?;
        v6.parse::<std::net::Ipv6Addr>().map_err(|_| why())?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(why)?),
        };
        (format!("[{}]", v6.to_ascii_lowercase()), port)
    } else {
        let (host, port) = match text.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        };
        let labels_ok = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !labels_ok {
            return Err(why());
        }
        (host.to_ascii_lowercase(), port)
    };
    match port {
        None => Ok(host),
        Some(port) => match port.parse::<u16>() {
            Ok(n) if n > 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok(format!("{host}:{n}")),
            _ => Err(why()),
        },
    }
}

fn valid_tag(tag: &str) -> bool {
    let bytes = tag.as_bytes();
    (1..=MAX_TAG).contains(&bytes.len())
        && (bytes[0].is_ascii_alphanumeric() || bytes[0] == b'_')
        && bytes.iter().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(b))
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn valid_path_component(part: &str) -> bool {
    let bytes = part.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && !alnum(bytes[i]) {
            i += 1;
        }
        let separator = &part[start..i];
        let dashes = separator.bytes().all(|b| b == b'-');
        if !(separator == "." || separator == "_" || separator == "__" || dashes) {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIN: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn parse(text: &str) -> Result<ImageRef, ImageError> {
        ImageRef::parse(text, &RegistryConfig::default())
    }

    fn with_default(text: &str) -> Result<ImageRef, ImageError> {
        let config = RegistryConfig {
            default_registry: Some("Registry.Test".into()),
            default_namespace: Some("library".into()),
            ..RegistryConfig::default()
        };
        ImageRef::parse(text, &config)
    }

    #[test]
    fn hosts_ports_tags_and_digests() {
        let r = parse("127.0.0.1:5000/team/app:1.2").unwrap();
        assert_eq!((r.registry.as_str(), r.repository.as_str()), ("127.0.0.1:5000", "team/app"));
        assert_eq!((r.tag.as_deref(), r.digest.as_deref()), (Some("1.2"), None));
        assert_eq!(r.to_string(), "127.0.0.1:5000/team/app:1.2");
        assert_eq!(r.registry_host(), "127.0.0.1");

        let r = parse("Registry.Test/app").unwrap();
        assert_eq!((r.registry.as_str(), r.tag.as_deref()), ("registry.test", Some("latest")));

        let r = parse(&format!("registry.test/a/b@{PIN}")).unwrap();
        assert_eq!((r.tag.as_deref(), r.digest.as_deref()), (None, Some(PIN)));
        assert_eq!(r.manifest_reference(), PIN);

        let r = parse(&format!("registry.test:443/a:v1@{PIN}")).unwrap();
        assert_eq!((r.tag.as_deref(), r.manifest_reference()), (Some("v1"), PIN));
        assert_eq!(r.to_string(), format!("registry.test:443/a:v1@{PIN}"));

        let r = parse("localhost/app:x").unwrap();
        assert_eq!((r.registry.as_str(), r.registry_host()), ("localhost", "localhost"));

        let r = parse("[::1]:5000/app").unwrap();
        assert_eq!((r.registry.as_str(), r.registry_host()), ("[::1]:5000", "[::1]"));

        let r = parse("registry.test/my-app/sub_dir/x__y.z:Tag_1.0-rc").unwrap();
        assert_eq!(r.repository, "my-app/sub_dir/x__y.z");
    }

    #[test]
    fn a_reference_without_a_host_needs_a_default_registry() {
        for text in ["debian:bookworm-slim", "team/app", "app"] {
            let err = parse(text).unwrap_err();
            assert!(matches!(err, ImageError::InvalidReference(_)), "{text}: {err}");
            assert!(err.to_string().contains("default registry"), "{err}");
            assert!(err.is_input_error());
        }
        let r = with_default("debian:bookworm-slim").unwrap();
        assert_eq!(r.to_string(), "registry.test/library/debian:bookworm-slim");
        // Only one-component names get the namespace, as `docker pull` does.
        assert_eq!(with_default("team/app").unwrap().to_string(), "registry.test/team/app:latest");
        // A first component without '.' or ':' is a path, not a host.
        assert_eq!(with_default("team/app").unwrap().registry, "registry.test");
    }

    #[test]
    fn malformed_references_are_refused() {
        let bad = [
            "",
            "https://registry.test/app",
            "registry.test/App",
            "registry.test/app:",
            "registry.test/app:.x",
            "registry.test/app:-x",
            "registry.test/app/",
            "registry.test//app",
            "registry.test/-app",
            "registry.test/app-",
            "registry.test/a..b",
            "registry.test/a___b",
            "registry.test/app@sha256:abc",
            "registry.test/app@md5:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "registry.test/app@sha256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            "registry.test:0/app",
            "registry.test:99999/app",
            "registry.test:x/app",
            "reg_istry.test/app",
            "-registry.test/app",
            "[::1/app",
            "registry.test/app name",
            "registry.test/app\n",
        ];
        for text in bad {
            let err = parse(text).unwrap_err();
            assert!(matches!(err, ImageError::InvalidReference(_)), "{text:?}: {err}");
        }
        let long = format!("registry.test/{}", "a".repeat(256));
        assert!(parse(&long).is_err());
        let long_tag = format!("registry.test/app:{}", "t".repeat(129));
        assert!(parse(&long_tag).is_err());
        assert!(parse(&format!("registry.test/app:{}", "t".repeat(128))).is_ok());
    }

    #[test]
    fn a_port_is_not_a_tag() {
        let r = parse("registry.test:5000/app").unwrap();
        assert_eq!((r.registry.as_str(), r.tag.as_deref()), ("registry.test:5000", Some("latest")));
    }

    #[test]
    fn hosts_without_ports() {
        assert_eq!(host_without_port("registry.test:5000"), "registry.test");
        assert_eq!(host_without_port("registry.test"), "registry.test");
        assert_eq!(host_without_port("[::1]:5000"), "[::1]");
        assert_eq!(host_without_port("[::1]"), "[::1]");
    }
}
