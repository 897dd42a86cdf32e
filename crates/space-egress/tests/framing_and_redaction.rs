//! The gateway against a sandbox that tries to get a secret back or past
//! it: echoes of what the gateway wrote (the value, the `Basic`
//! credentials it encoded again), requests with two `Host`s or another
//! one, bodies with two lengths, and a secret used on after its owner
//! narrowed its hosts or deleted it. The upstreams are servers of this
//! test on loopback, reached through made-up names.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use http_body_util::BodyExt as _;
use space_egress::ca::SandboxCa;
use space_egress::gateway::{Credentials, GatewayConfig, SandboxEgress, StaticResolver};
use space_egress::inspect::{Secret, Vault};
use space_egress::policy::{Binding, Mode, Policy};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::rustls;

const VALUE: &str = "sk-live-0123456789abcdefghij";
const PLACEHOLDER: &str = "space_ph_00112233445566778899aabbccddeeff";
const DEADLINE: Duration = Duration::from_secs(10);

/// The secret `llm`, whose hosts its owner may change (`None`: deleted).
struct OneSecret(Mutex<Option<Vec<String>>>);
impl Vault for OneSecret {
    fn secret(&self, name: &str) -> Option<Secret> {
        let hosts = self.0.lock().unwrap().clone()?;
        (name == "llm").then(|| Secret { value: VALUE.to_string(), hosts })
    }
}

/// Every request head an upstream read, in order.
type Heads = Arc<Mutex<Vec<String>>>;

/// Reads one request head and its `Content-Length` body; `None` at the end.
async fn read_request<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.drain(..end);
    let length: usize = header_values(&head, "content-length").first().and_then(|l| l.parse().ok()).unwrap_or(0);
    while buf.len() < length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf.drain(..length).collect();
    Some((head, body))
}

fn header_values(head: &str, name: &str) -> Vec<String> {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim().to_string())
        .collect()
}

/// An HTTPS server for `api.space.test` (keep-alive): `/echo` answers with
/// every request header as a response header `x-echo-NAME` and in a JSON
/// body sent seven bytes a chunk; `/last` answers with the authorization
/// of the request before it. Returns its port, roots trusting it, and the
/// heads it read.
async fn echoing_upstream() -> (u16, Arc<rustls::ClientConfig>, Heads) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let names = vec!["api.space.test".to_string(), "open.space.test".to_string()];
    let leaf = rcgen::CertificateParams::new(names).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()))
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads: Heads = Arc::default();
    let last = Arc::new(Mutex::new(String::new()));
    let (acceptor, seen) = (tokio_rustls::TlsAcceptor::from(Arc::new(server)), heads.clone());
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (acceptor, seen, last) = (acceptor.clone(), seen.clone(), last.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else { return };
                let mut buf = Vec::new();
                while let Some((head, _)) = read_request(&mut tls, &mut buf).await {
                    seen.lock().unwrap().push(head.clone());
                    let auth = header_values(&head, "authorization").join(", ");
                    let previous = std::mem::replace(&mut *last.lock().unwrap(), auth);
                    let mut answer = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n".to_string();
                    // A host that compresses whatever it is asked for.
                    if head.starts_with("GET /gzip ") {
                        answer += "Content-Encoding: gzip\r\n";
                    }
                    let body = if head.starts_with("GET /last ") {
                        format!("the last request sent {previous}")
                    } else {
                        let mut json = Vec::new();
                        for line in head.lines().skip(1).filter(|l| l.contains(':')) {
                            let (name, value) = line.split_once(':').unwrap();
                            answer += &format!("x-echo-{}: {}\r\n", name.trim(), value.trim());
                            json.push(format!("{:?}: {:?}", name.trim().to_ascii_lowercase(), value.trim()));
                        }
                        format!("{{\"headers\": {{{}}}}}", json.join(", "))
                    };
                    answer += "\r\n";
                    if tls.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    // A value may be cut anywhere between the reads.
                    for piece in body.as_bytes().chunks(7) {
                        let chunk = [format!("{:x}\r\n", piece.len()).as_bytes(), piece, b"\r\n"].concat();
                        if tls.write_all(&chunk).await.is_err() || tls.flush().await.is_err() {
                            return;
                        }
                    }
                    let _ = tls.write_all(b"0\r\n\r\n").await;
                }
            });
        }
    });
    (port, Arc::new(client), heads)
}

/// A plain-HTTP server that reads each request as its head says, then
/// keeps whatever else arrives within a moment (what a gateway let ride
/// behind it), answers with the head it read, and closes. Returns its port
/// and, per connection, everything it read.
async fn plain_upstream() -> (u16, Heads) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let received: Heads = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let Some((head, body)) = read_request(&mut socket, &mut buf).await else { return };
                let mut buf = [body, buf].concat();
                let mut more = [0u8; 4096];
                // Absence can only be waited for: a moment, bounded.
                while let Ok(Ok(n @ 1..)) =
                    tokio::time::timeout(Duration::from_millis(300), socket.read(&mut more)).await
                {
                    buf.extend_from_slice(&more[..n]);
                }
                let extra = String::from_utf8_lossy(&buf).into_owned();
                log.lock().unwrap().push(format!("{head}{extra}"));
                let answer =
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{head}", head.len());
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    (port, received)
}

struct Sandbox {
    egress: Arc<SandboxEgress>,
    /// What the sandbox trusts: its own CA.
    tls: Arc<rustls::ClientConfig>,
    vault: Arc<OneSecret>,
}

/// A sandbox with `llm` bound to api.space.test.
async fn sandbox(tls_port: u16, roots: Arc<rustls::ClientConfig>, plain_port: u16) -> Sandbox {
    sandbox_bound(tls_port, roots, plain_port, &["api.space.test"]).await
}

/// A sandbox with `llm` bound to `bound`, which the secret lists too.
async fn sandbox_bound(tls_port: u16, roots: Arc<rustls::ClientConfig>, plain_port: u16, bound: &[&str]) -> Sandbox {
    let loopback = vec!["127.0.0.1".parse().unwrap()];
    let names = ["api.space.test", "open.space.test", "allowed.space.test", "other.space.test"];
    let resolver = Arc::new(StaticResolver::new(names.map(|n| (n.to_string(), loopback.clone()))));
    let mut config = GatewayConfig::new(resolver);
    config.allow_internal = vec![("127.0.0.1".parse().unwrap(), 32)];
    config.upstream_roots = Some(roots);
    config.dial_ports = [
        ("api.space.test".to_string(), tls_port),
        ("open.space.test".to_string(), tls_port),
        ("allowed.space.test".to_string(), plain_port),
        ("other.space.test".to_string(), plain_port),
    ]
    .into();
    let bound: Vec<String> = bound.iter().map(|h| h.to_string()).collect();
    let binding = Binding::new("llm", PLACEHOLDER, &bound, vec![]).unwrap();
    let allow = ["open.space.test".to_string(), "allowed.space.test".to_string()];
    let policy = Policy::new(Mode::Allowlist, &allow, &[]).unwrap().with_bindings(vec![binding]).unwrap();
    let (events, mut received) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move { while received.recv().await.is_some() {} });
    let egress = SandboxEgress::new("sbx_t".into(), policy, events, config);
    let ca = Arc::new(SandboxCa::generate("sbx_t").unwrap());
    let vault = Arc::new(OneSecret(Mutex::new(Some(bound))));
    egress.set_credentials(Credentials { vault: vault.clone(), ca: ca.clone() });
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca.cert_pem().as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Sandbox { egress, tls: Arc::new(tls), vault }
}

impl Sandbox {
    /// A connection to the gateway, as the sandbox's relay hands it over.
    fn connect(&self) -> tokio::io::DuplexStream {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let egress = self.egress.clone();
        tokio::spawn(async move { egress.handle(theirs).await });
        ours
    }

    /// HTTPS to `host` through CONNECT, as far as the TLS stream.
    async fn tunnel(&self, host: &'static str) -> impl AsyncRead + AsyncWrite + Unpin + Send + 'static {
        let mut ours = self.connect();
        ours.write_all(format!("CONNECT {host}:443 HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
        let mut established = [0u8; 39];
        let read = tokio::time::timeout(DEADLINE, ours.read_exact(&mut established)).await;
        read.expect("the CONNECT's answer in time").unwrap();
        assert!(established.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&established));
        let name = rustls::pki_types::ServerName::try_from(host).unwrap();
        let connecting = tokio_rustls::TlsConnector::from(self.tls.clone()).connect(name, ours);
        tokio::time::timeout(DEADLINE, connecting).await.expect("the TLS handshake in time").unwrap()
    }

    /// Writes `bytes` (raw, as an attacker would) and reads until the end.
    async fn raw(&self, mut stream: impl AsyncRead + AsyncWrite + Unpin, bytes: &[u8]) -> String {
        stream.write_all(bytes).await.unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut answer)).await;
        assert!(read.is_ok(), "an answer and the end within {DEADLINE:?}");
        String::from_utf8_lossy(&answer).into_owned()
    }
}

/// An HTTP/1.1 connection in a tunnel to `host`.
struct Connection {
    host: &'static str,
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>,
}

impl Connection {
    async fn open(sandbox: &Sandbox, host: &'static str) -> Connection {
        let tls = sandbox.tunnel(host).await;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await.unwrap();
        tokio::spawn(connection);
        Connection { host, sender }
    }

    /// A GET of `path` with `headers`: what came back (head and body).
    async fn send(&mut self, path: &str, headers: &[(&str, String)]) -> String {
        let mut request = hyper::Request::get(path).header("host", self.host);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let request = request.body(http_body_util::Empty::<bytes::Bytes>::new()).unwrap();
        let response = tokio::time::timeout(DEADLINE, self.sender.send_request(request)).await.unwrap().unwrap();
        let head = format!("{:?} {:?}", response.status(), response.headers());
        let body = tokio::time::timeout(DEADLINE, response.into_body().collect()).await.unwrap().unwrap().to_bytes();
        format!("{head}\n{}", String::from_utf8_lossy(&body))
    }
}

/// Requests on one connection in a tunnel to api.space.test, each with
/// `headers`; what came back of each (head and body).
async fn exchange(sandbox: &Sandbox, requests: &[(&str, Vec<(&str, String)>)]) -> Vec<String> {
    let mut connection = Connection::open(sandbox, "api.space.test").await;
    let mut answers = Vec::new();
    for (path, headers) in requests {
        answers.push(connection.send(path, headers).await);
    }
    answers
}

/// Whether `text` holds the value: plain, or inside anything base64.
fn leaks(text: &str) -> bool {
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let is_b64 = |c: char| c.is_ascii_alphanumeric() || c == '+' || c == '/' || c == '=';
    text.contains(VALUE)
        || text.split(|c| !is_b64(c)).any(|run| {
            // A run may end inside a group: try each cut.
            (0..4).any(|cut| {
                let run = run.trim_end_matches('=');
                let run = &run[..run.len().saturating_sub(cut)];
                engine.decode(run).is_ok_and(|bytes| String::from_utf8_lossy(&bytes).contains(VALUE))
            })
        })
}

#[tokio::test]
async fn every_form_of_a_secret_the_gateway_wrote_comes_back_as_the_placeholder() {
    let (tls_port, roots, heads) = echoing_upstream().await;
    let (plain_port, _) = plain_upstream().await;
    let sandbox = sandbox(tls_port, roots, plain_port).await;
    let b64 = base64::engine::general_purpose::STANDARD;
    // User names of each length modulo three: the value sits at each of
    // the three offsets base64 can put it at.
    for user in ["x", "xy", "xyz", "x-access-token"] {
        let basic = format!("Basic {}", b64.encode(format!("{user}:{PLACEHOLDER}")));
        let answers = exchange(
            &sandbox,
            &[
                ("/echo", vec![("authorization", basic.clone()), ("x-key", PLACEHOLDER.to_string())]),
                // The previous request's credentials, answered later.
                ("/last", vec![]),
            ],
        )
        .await;
        let sent = heads.lock().unwrap().iter().rev().nth(1).cloned().unwrap();
        let written = format!("Basic {}", b64.encode(format!("{user}:{VALUE}")));
        assert!(sent.contains(&written) && sent.contains(VALUE), "the host got the value: {sent}");
        for answer in &answers {
            assert!(!leaks(answer), "a form of the value came back: {answer}");
        }
        // The echo reads back as what the sandbox sent.
        assert!(answers[0].contains(&basic[6..]) && answers[0].contains(PLACEHOLDER), "{}", answers[0]);
    }
    let bearer = exchange(&sandbox, &[("/echo", vec![("authorization", format!("Bearer {PLACEHOLDER}"))])]).await;
    assert!(!leaks(&bearer[0]) && bearer[0].contains(&format!("Bearer {PLACEHOLDER}")), "{}", bearer[0]);
    // A request with no placeholder to a host a secret is bound to still
    // asks for an uncompressed answer (the host may echo an earlier
    // request's value), and a compressed one does not reach the sandbox.
    let gzipped = exchange(&sandbox, &[("/gzip", vec![("accept-encoding", "gzip".to_string())])]).await;
    assert!(gzipped[0].starts_with("502") && gzipped[0].contains("encoded_answer"), "{}", gzipped[0]);
    let sent = heads.lock().unwrap().last().cloned().unwrap();
    assert_eq!(header_values(&sent, "accept-encoding"), ["identity"], "{sent}");
}

#[tokio::test]
async fn a_tunnel_takes_one_host_its_own_before_any_secret_is_added() {
    let (tls_port, roots, heads) = echoing_upstream().await;
    let (plain_port, _) = plain_upstream().await;
    let sandbox = sandbox(tls_port, roots, plain_port).await;
    let key = format!("Authorization: Bearer {PLACEHOLDER}\r\n");
    for (request, reason) in [
        (format!("GET /echo HTTP/1.1\r\nHost: api.space.test\r\nHost: open.space.test\r\n{key}\r\n"), "ambiguous_request"),
        (format!("GET /echo HTTP/1.1\r\nHost: open.space.test\r\nHost: api.space.test\r\n{key}\r\n"), "ambiguous_request"),
        (format!("GET /echo HTTP/1.1\r\nHost: open.space.test\r\n{key}\r\n"), "wrong_host"),
        (format!("GET /echo HTTP/1.1\r\n{key}\r\n"), "ambiguous_request"),
        (format!("GET https://api.space.test/echo HTTP/1.1\r\nHost: open.space.test\r\n{key}\r\n"), "wrong_host"),
        (format!("GET https://open.space.test/echo HTTP/1.1\r\nHost: api.space.test\r\n{key}\r\n"), "wrong_host"),
        (format!("POST /echo HTTP/1.1\r\nHost: api.space.test\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n{key}\r\n0\r\n\r\n"), "ambiguous_request"),
        (format!("POST /echo HTTP/1.1\r\nHost: api.space.test\r\nContent-Length: 5\r\nContent-Length: 5\r\n{key}\r\nhello"), "ambiguous_request"),
    ] {
        let answer = sandbox.raw(sandbox.tunnel("api.space.test").await, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400") && answer.contains(reason), "{request:?}: {answer}");
    }
    assert!(heads.lock().unwrap().is_empty(), "nothing refused reached the host: {:?}", heads.lock().unwrap());

    // A good request, then a bad one on the same connection: the first is
    // answered, the second refused, nothing of it sent on.
    let good = format!("GET /echo HTTP/1.1\r\nHost: api.space.test\r\n{key}\r\n");
    let bad = format!("GET /echo HTTP/1.1\r\nHost: api.space.test\r\nHost: open.space.test\r\n{key}\r\n");
    let answer = sandbox.raw(sandbox.tunnel("api.space.test").await, format!("{good}{bad}").as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("HTTP/1.1 400"), "{answer}");
    assert_eq!(heads.lock().unwrap().len(), 1, "{:?}", heads.lock().unwrap());
}

#[tokio::test]
async fn plain_http_goes_with_its_targets_host_and_exactly_its_body() {
    let (tls_port, roots, _) = echoing_upstream().await;
    let (plain_port, received) = plain_upstream().await;
    let sandbox = sandbox(tls_port, roots, plain_port).await;
    let request = "GET http://allowed.space.test/who HTTP/1.1\r\nHost: other.space.test\r\n\r\n";
    let answer = sandbox.raw(sandbox.connect(), request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let got = received.lock().unwrap().pop().unwrap();
    assert_eq!(header_values(&got, "host"), ["allowed.space.test"], "{got}");

    for request in [
        "GET http://allowed.space.test/ HTTP/1.1\r\nHost: allowed.space.test\r\nHost: other.space.test\r\n\r\n",
        "POST http://allowed.space.test/ HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n",
        "POST http://allowed.space.test/ HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 36\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
        "POST http://allowed.space.test/ HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\nx",
    ] {
        let answer = sandbox.raw(sandbox.connect(), request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("ambiguous_request"), "{request:?}: {answer}");
    }
    assert!(received.lock().unwrap().is_empty(), "{:?}", received.lock().unwrap());

    // What follows a body stays with the gateway, whichever way it is measured.
    let behind = "GET /smuggled HTTP/1.1\r\nHost: other.space.test\r\n\r\n";
    for (framing, body) in
        [("Content-Length: 5", "hello"), ("Transfer-Encoding: chunked", "5;x=y\r\nhello\r\n0\r\nT: 1\r\n\r\n")]
    {
        let request = format!("POST http://allowed.space.test/ HTTP/1.1\r\n{framing}\r\n\r\n{body}{behind}");
        let answer = sandbox.raw(sandbox.connect(), request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let got = received.lock().unwrap().pop().unwrap();
        assert!(got.ends_with(body) && !got.contains("smuggled"), "{got:?}");
    }
}

#[tokio::test]
async fn a_secret_narrowed_or_deleted_after_the_bind_is_judged_again_at_each_request() {
    let (tls_port, roots, heads) = echoing_upstream().await;
    let (plain_port, _) = plain_upstream().await;
    let sandbox = sandbox_bound(tls_port, roots, plain_port, &["api.space.test", "open.space.test"]).await;
    let key = [("authorization", format!("Bearer {PLACEHOLDER}"))];
    let reached = |host: &str| {
        let heads = heads.lock().unwrap();
        heads.iter().filter(|h| h.contains(&format!("host: {host}")) && h.contains(VALUE)).count()
    };

    // One connection: the value goes with the first request; the owner
    // then takes api.space.test off the secret's hosts, and the second is
    // refused as for a host never bound, nothing of it sent on.
    let mut api = Connection::open(&sandbox, "api.space.test").await;
    let first = api.send("/echo", &key).await;
    assert!(first.starts_with("200") && !leaks(&first), "{first}");
    assert_eq!(reached("api.space.test"), 1);
    *sandbox.vault.0.lock().unwrap() = Some(vec!["open.space.test".into()]);
    let second = api.send("/echo", &key).await;
    assert!(second.starts_with("403") && second.contains("secret_not_for_host"), "{second}");
    assert_eq!(heads.lock().unwrap().len(), 1, "{:?}", heads.lock().unwrap());

    // The host it still lists keeps getting it, until the secret is
    // deleted between two requests of one connection.
    let mut open = Connection::open(&sandbox, "open.space.test").await;
    let third = open.send("/echo", &key).await;
    assert!(third.starts_with("200") && !leaks(&third), "{third}");
    assert_eq!(reached("open.space.test"), 1);
    *sandbox.vault.0.lock().unwrap() = None;
    let fourth = open.send("/echo", &key).await;
    assert!(fourth.starts_with("403") && fourth.contains("secret_unavailable"), "{fourth}");
    assert_eq!(heads.lock().unwrap().len(), 2, "{:?}", heads.lock().unwrap());
}
