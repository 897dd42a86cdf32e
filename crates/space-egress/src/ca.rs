//! Each sandbox's own certificate authority: the sandbox trusts it, and the
//! gateway signs with it a certificate for each host whose HTTPS it
//! terminates (a host a secret is bound to). Its key never leaves the host.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Hosts whose certificates are kept, at most (per sandbox).
const MAX_LEAVES: usize = 256;

/// Why a certificate could not be made or read.
#[derive(Debug, thiserror::Error)]
#[error("sandbox CA: {0}")]
pub struct CaError(String);

fn fail(err: impl std::fmt::Display) -> CaError {
    CaError(err.to_string())
}

/// A sandbox's CA, and the server configurations made with it, by host.
pub struct SandboxCa {
    cert: rcgen::Certificate,
    key: KeyPair,
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl SandboxCa {
    /// A new CA (ECDSA P-256) for sandbox `id`.
    pub fn generate(id: &str) -> Result<SandboxCa, CaError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(fail)?;
        SandboxCa::with_key(id, key)
    }

    /// The CA of sandbox `id` from its key (as [`SandboxCa::key_pem`] gave
    /// it): the same subject and key, so what the sandbox already trusts
    /// verifies what it signs.
    pub fn from_key_pem(id: &str, key_pem: &str) -> Result<SandboxCa, CaError> {
        SandboxCa::with_key(id, KeyPair::from_pem(key_pem).map_err(fail)?)
    }

    fn with_key(id: &str, key: KeyPair) -> Result<SandboxCa, CaError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
        params.distinguished_name.push(DnType::OrganizationName, "SPACE");
        params.distinguished_name.push(DnType::CommonName, format!("SPACE egress CA for {id}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = rcgen::date_time_ymd(2026, 1, 1);
        params.not_after = rcgen::date_time_ymd(2046, 1, 1);
        let cert = params.self_signed(&key).map_err(fail)?;
        Ok(SandboxCa { cert, key, leaves: Mutex::default() })
    }

    /// The certificate the sandbox trusts (PEM).
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// The private key (PEM; kept sealed on the host).
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A TLS server configuration presenting a certificate for `host`
    /// signed by this CA (HTTP/1.1 only), made once per host.
    pub fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, CaError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(config) = leaves.get(host) {
            return Ok(config.clone());
        }
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(fail)?;
        let mut params = CertificateParams::new(vec![host.to_string()]).map_err(fail)?;
        params.distinguished_name.push(DnType::CommonName, host);
        params.not_before = rcgen::date_time_ymd(2026, 1, 1);
        params.not_after = rcgen::date_time_ymd(2046, 1, 1);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let leaf = params.signed_by(&key, &self.cert, &self.key).map_err(fail)?;
        let chain = vec![leaf.der().clone(), self.cert.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(fail)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(fail)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_string(), config.clone());
        Ok(config)
    }
}

/// The roots the gateway checks upstream certificates against: the host's
/// system bundle, plus the operator's extra PEM files (an internal CA; a
/// test's own).
pub fn upstream_roots(extra: &[std::path::PathBuf]) -> Result<Arc<rustls::ClientConfig>, CaError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let system = std::path::Path::new("/etc/ssl/certs/ca-certificates.crt");
    if let Ok(certs) = CertificateDer::pem_file_iter(system) {
        roots.add_parsable_certificates(certs.flatten());
    }
    for path in extra {
        let certs = CertificateDer::pem_file_iter(path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        let certs: Vec<_> = certs.collect::<Result<_, _>>().map_err(|e| fail(format!("{}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(fail(format!("{}: no certificate in it", path.display())));
        }
        roots.add_parsable_certificates(certs);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(fail)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;

    #[test]
    fn a_ca_read_back_from_its_key_signs_what_the_first_one_verifies() {
        let ca = SandboxCa::generate("sbx_1").unwrap();
        let again = SandboxCa::from_key_pem("sbx_1", &ca.key_pem()).unwrap();
        // The same subject and key: the sandbox's trusted certificate
        // verifies leaves made after a restart.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.cert.der().clone()).unwrap();
        let leaf = {
            let config = again.server_config("api.space.test").unwrap();
            drop(config);
            let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
            let params = CertificateParams::new(vec!["api.space.test".to_string()]).unwrap();
            params.signed_by(&key, &again.cert, &again.key).unwrap()
        };
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.space.test").unwrap();
        let now = rustls::pki_types::UnixTime::now();
        verifier.verify_server_cert(leaf.der(), &[], &name, &[], now).expect("verified");
        let other = rustls::pki_types::ServerName::try_from("other.space.test").unwrap();
        assert!(verifier.verify_server_cert(leaf.der(), &[], &other, &[], now).is_err());
    }
}
