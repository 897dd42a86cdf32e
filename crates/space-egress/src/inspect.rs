//! Inspected tunnels: HTTPS to a host a secret is bound to. The gateway
//! ends the sandbox's TLS with a certificate from the sandbox's own CA,
//! reads each HTTP/1.1 request, replaces the placeholders of the secrets
//! bound to that host whose own hosts, read at that request, still include
//! it (refusing any other secret's placeholder), sets the bindings'
//! headers, and sends the request on over its own TLS connection
//! to the host, whose certificate it checks. Every form of a secret value
//! the gateway wrote (the value, and the `Basic` credentials it encoded
//! again) goes back to the sandbox in responses (headers, bodies and
//! trailers) as the placeholder form the sandbox sent. Each request head
//! is judged before any of this ([`crate::framing`]): one `Host`, the
//! tunnel's, and a body of one length.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{
    HeaderMap, HeaderName, HeaderValue, ACCEPT_ENCODING, AUTHORIZATION, CONTENT_ENCODING, CONTENT_LENGTH, HOST,
};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls;

use crate::ca::SandboxCa;
use crate::policy::{Binding, Policy, Reason, Target};

/// Where the gateway reads a tenant's secrets, by name, when a request
/// needs one (so a secret written again is used from its next request).
pub trait Vault: Send + Sync {
    fn secret(&self, name: &str) -> Option<Secret>;
}

/// A secret as it is when a request needs it.
pub struct Secret {
    pub value: String,
    /// The hosts its owner lets it go to now (names or `*.suffix`). A
    /// binding copied the hosts it was given when it was made; these may
    /// since have narrowed, so a value goes only where both allow.
    pub hosts: Vec<String>,
}

impl Secret {
    /// Whether its hosts cover `target`, with a binding's own matching;
    /// hosts that do not read cover nothing.
    pub fn covers(&self, target: &Target) -> bool {
        Binding::new("", "", &self.hosts, Vec::new()).is_ok_and(|hosts| hosts.covers(target))
    }
}

/// The value of `binding`'s secret for a request to `target`, which the
/// binding covers: refused as for a host it was never bound to when the
/// secret no longer lists that host (its hosts narrowed after the bind).
fn value_for(binding: &Binding, target: &Target, vault: &dyn Vault) -> Result<String, Reason> {
    let secret = vault.secret(&binding.secret).ok_or(Reason::SecretUnavailable)?;
    if !secret.covers(target) {
        return Err(Reason::SecretNotForHost);
    }
    Ok(secret.value)
}

/// What an inspected connection did, for its event.
#[derive(Debug, Default)]
pub struct Seen {
    pub requests: u64,
    pub secrets: BTreeSet<String>,
    /// The first request refused, and why (the connection then closes).
    pub refused: Option<Reason>,
}

/// What an inspected connection needs.
pub struct Inspection {
    pub host: String,
    pub policy: Arc<Policy>,
    pub vault: Arc<dyn Vault>,
    pub ca: Arc<SandboxCa>,
    pub roots: Arc<rustls::ClientConfig>,
}

type Reply = Response<Either<Redacting, Full<Bytes>>>;

/// Serves the sandbox's side (`client`, just past `200 Connection
/// established`) against `upstream` until either side is done.
pub async fn serve<C>(
    client: C,
    upstream: TcpStream,
    inspection: Inspection,
    seen: Arc<Mutex<Seen>>,
) -> Result<(), Reason>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let start = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), client)
        .await
        .map_err(|_| Reason::NotTls)?;
    if let Some(name) = start.client_hello().server_name() {
        if !name.eq_ignore_ascii_case(&inspection.host) {
            return Err(Reason::SniMismatch);
        }
    }
    let config = inspection.ca.server_config(&inspection.host).map_err(|_| Reason::ClientTls)?;
    let tls = start.into_stream(config).await.map_err(|_| Reason::ClientTls)?;
    // The upstream's TLS; a failure is told to the sandbox's program in
    // an HTTP answer on its own (now working) TLS.
    let sender = match connect_upstream(&inspection, upstream).await {
        Ok(sender) => Some(tokio::sync::Mutex::new(sender)),
        Err(reason) => {
            seen.lock().unwrap_or_else(|e| e.into_inner()).refused = Some(reason);
            None
        }
    };
    // The server reads only requests whose heads passed; at the first that
    // does not, it sees the stream end, and the refusal is written after
    // what it had to answer.
    let mut guarded = crate::framing::Guarded::new(tls, &inspection.host);
    let (inspection, sender, served_seen) = (Arc::new(inspection), Arc::new(sender), seen.clone());
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let (inspection, sender, seen) = (inspection.clone(), sender.clone(), served_seen.clone());
        async move { Ok::<_, Infallible>(forward(request, &inspection, &sender, &seen).await) }
    });
    // Half-close: the answers to requests before a refused one are still
    // written after the server sees the end.
    let served = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .half_close(true)
        .serve_connection(TokioIo::new(&mut guarded), service)
        .await;
    if let Some(reason) = guarded.refused() {
        {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.requests += 1;
            seen.refused.get_or_insert(reason);
        }
        crate::framing::refuse(guarded.inner_mut(), 400, reason).await;
        return Ok(());
    }
    served.map_err(|_| Reason::Unreachable)
}

async fn connect_upstream(
    inspection: &Inspection,
    upstream: TcpStream,
) -> Result<hyper::client::conn::http1::SendRequest<Incoming>, Reason> {
    let name = rustls::pki_types::ServerName::try_from(inspection.host.clone()).map_err(|_| Reason::UpstreamTls)?;
    let tls = tokio_rustls::TlsConnector::from(inspection.roots.clone())
        .connect(name, upstream)
        .await
        .map_err(|_| Reason::UpstreamTls)?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|_| Reason::UpstreamTls)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

async fn forward(
    mut request: Request<Incoming>,
    inspection: &Inspection,
    sender: &Option<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>>,
    seen: &Mutex<Seen>,
) -> Reply {
    let refuse = |reason: Reason, status: StatusCode| {
        let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.refused.get_or_insert(reason);
        refusal(status, reason)
    };
    seen.lock().unwrap_or_else(|e| e.into_inner()).requests += 1;
    let Some(sender) = sender else {
        return refuse(Reason::UpstreamTls, StatusCode::BAD_GATEWAY);
    };
    // The head passed `framing::check_head`: its one Host (if any) names
    // the tunnel's host; HTTP/1.0 without one gets it.
    if !request.headers().contains_key(HOST) {
        match HeaderValue::from_str(&inspection.host) {
            Ok(host) => request.headers_mut().insert(HOST, host),
            Err(_) => return refuse(Reason::BadRequest, StatusCode::BAD_REQUEST),
        };
    }
    let target = Target::Name(inspection.host.clone());
    let injected = match add_secrets(request.headers_mut(), &target, &inspection.policy, inspection.vault.as_ref()) {
        Ok(injected) => injected,
        Err(reason) => return refuse(reason, StatusCode::FORBIDDEN),
    };
    // The values to hide again in what comes back.
    let values: Vec<(Vec<u8>, Vec<u8>)> = inspection
        .policy
        .bindings
        .iter()
        .filter(|b| b.covers(&target))
        .filter_map(|b| {
            Some((inspection.vault.secret(&b.secret)?.value.into_bytes(), b.placeholder.clone().into_bytes()))
        })
        .filter(|(value, _)| !value.is_empty())
        .collect();
    let pairs = redactions(injected.written, &values);
    if !pairs.is_empty() {
        // A compressed answer could carry a value past the redaction, which
        // reads plain bytes only — this request's value, or one a host
        // echoes from an earlier request that carried it.
        request.headers_mut().insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    }
    seen.lock().unwrap_or_else(|e| e.into_inner()).secrets.extend(injected.used);
    let head_only = request.method() == hyper::Method::HEAD;
    let response = {
        let mut sender = sender.lock().await;
        if sender.ready().await.is_err() {
            return refuse(Reason::Unreachable, StatusCode::BAD_GATEWAY);
        }
        match sender.send_request(request).await {
            Ok(response) => response,
            Err(_) => return refuse(Reason::Unreachable, StatusCode::BAD_GATEWAY),
        }
    };
    let (mut parts, body) = response.into_parts();
    let has_body = !head_only && parts.status != StatusCode::NO_CONTENT && parts.status != StatusCode::NOT_MODIFIED;
    let encoded = parts.headers.get_all(CONTENT_ENCODING).iter().any(|v| {
        v.to_str()
            .map_or(true, |v| v.split(',').any(|c| !c.trim().is_empty() && !c.trim().eq_ignore_ascii_case("identity")))
    });
    if has_body && !pairs.is_empty() && encoded {
        // Asked for identity and compressed all the same: what it holds
        // cannot be read for values, so it does not reach the sandbox.
        return refuse(Reason::EncodedAnswer, StatusCode::BAD_GATEWAY);
    }
    redact_headers(&mut parts.headers, &pairs);
    if has_body && !pairs.is_empty() {
        // Lengths change where a value is hidden: the body goes chunked.
        parts.headers.remove(CONTENT_LENGTH);
    }
    Response::from_parts(parts, Either::Left(Redacting::new(body, pairs)))
}

/// What [`add_secrets`] did to a request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Injected {
    /// The secrets' names used.
    pub used: BTreeSet<String>,
    /// The `Basic` credentials the gateway encoded again, each with what
    /// the sandbox had sent in its place: (written, sent).
    pub written: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Replaces, in every header, the placeholders of the secrets bound to
/// `target` with their values (inside `Authorization: Basic` too, where
/// git puts a token), and sets the bindings' headers. Any other secret's
/// placeholder refuses the request, as does a bound one whose secret no
/// longer lists `target` among its hosts (read now, not at the bind).
pub fn add_secrets(
    headers: &mut HeaderMap,
    target: &Target,
    policy: &Policy,
    vault: &dyn Vault,
) -> Result<Injected, Reason> {
    let mut used = BTreeSet::new();
    let mut written = Vec::new();
    let substitute = |text: &[u8], used: &mut BTreeSet<String>| -> Result<Option<Vec<u8>>, Reason> {
        let mut out: Option<Vec<u8>> = None;
        for binding in &policy.bindings {
            let current = out.as_deref().unwrap_or(text);
            if find(current, binding.placeholder.as_bytes()).is_none() {
                continue;
            }
            if !binding.covers(target) {
                return Err(Reason::SecretNotForHost);
            }
            let value = value_for(binding, target, vault)?;
            let pairs = [(binding.placeholder.clone().into_bytes(), value.into_bytes())];
            out = replace_all(current, &pairs);
            used.insert(binding.secret.clone());
        }
        Ok(out)
    };
    for (name, value) in headers.iter_mut() {
        let mut replaced = substitute(value.as_bytes(), &mut used)?;
        if name == AUTHORIZATION {
            let text = replaced.as_deref().unwrap_or(value.as_bytes());
            if let Some(encoded) = text.strip_prefix(b"Basic ").or_else(|| text.strip_prefix(b"basic ")) {
                let engine = base64::engine::general_purpose::STANDARD;
                if let Ok(decoded) = engine.decode(encoded.trim_ascii()) {
                    if let Some(inner) = substitute(&decoded, &mut used)? {
                        let encoded = engine.encode(inner);
                        written.push((encoded.clone().into_bytes(), engine.encode(&decoded).into_bytes()));
                        replaced = Some(format!("Basic {encoded}").into_bytes());
                    }
                }
            }
        }
        if let Some(replaced) = replaced {
            *value = HeaderValue::from_bytes(&replaced).map_err(|_| Reason::BadRequest)?;
        }
    }
    for binding in policy.bindings.iter().filter(|b| b.covers(target)) {
        for (name, template) in &binding.set_header {
            let value = value_for(binding, target, vault)?;
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| Reason::BadRequest)?;
            let value = HeaderValue::from_str(&template.replace("{secret}", &value)).map_err(|_| Reason::BadRequest)?;
            headers.insert(name, value);
            used.insert(binding.secret.clone());
        }
    }
    Ok(Injected { used, written })
}

/// What to hide in a response, and what goes in its place, longest-lived
/// forms first: the `Basic` credentials the gateway wrote go back as the
/// sandbox sent them; each value as its placeholder; and the base64 of
/// each value at each of the three offsets a value can have in base64
/// input (the part no neighbouring byte changes), as the placeholder's at
/// the same offset. The last catch the value inside any `Basic`
/// credentials the gateway wrote, whichever request wrote them and
/// whatever the user name, when a host answers them later (an echo of the
/// previous request).
fn redactions(written: Vec<(Vec<u8>, Vec<u8>)>, values: &[(Vec<u8>, Vec<u8>)]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut pairs = written;
    for (value, placeholder) in values {
        pairs.push((value.clone(), placeholder.clone()));
    }
    for (value, placeholder) in values {
        for offset in 0..3 {
            if let (Some(from), Some(to)) = (base64_core(value, offset), base64_core(placeholder, offset)) {
                pairs.push((from, to));
            }
        }
    }
    pairs
}

/// The base64 found in the encoding of any input holding `bytes` where its
/// three-byte groups start `offset` bytes into them: the encoding of the
/// whole groups inside `bytes`. `None` when that is too short (under 8
/// characters) to stand for the value alone.
fn base64_core(bytes: &[u8], offset: usize) -> Option<Vec<u8>> {
    let whole = bytes.len().checked_sub(offset)? / 3 * 3;
    let engine = base64::engine::general_purpose::STANDARD_NO_PAD;
    (whole >= 6).then(|| engine.encode(&bytes[offset..offset + whole]).into_bytes())
}

/// Hides `pairs` in every header value; a value that cannot be written
/// back is emptied rather than left as it came.
fn redact_headers(headers: &mut HeaderMap, pairs: &[(Vec<u8>, Vec<u8>)]) {
    for value in headers.values_mut() {
        if let Some(hidden) = replace_all(value.as_bytes(), pairs) {
            *value = HeaderValue::from_bytes(&hidden).unwrap_or_else(|_| HeaderValue::from_static(""));
        }
    }
}

/// Whether `bytes` carry the placeholder of any secret bound to the
/// sandbox (for a request the gateway cannot add secrets to).
pub fn carries_placeholder(bytes: &[u8], policy: &Policy) -> bool {
    policy.bindings.iter().any(|b| find(bytes, b.placeholder.as_bytes()).is_some())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || needle.len() > haystack.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// `text` with every `from` replaced by its `to`; `None` if none occurs.
fn replace_all(text: &[u8], pairs: &[(Vec<u8>, Vec<u8>)]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for (from, to) in pairs {
        let current = out.as_deref().unwrap_or(text);
        if find(current, from).is_none() {
            continue;
        }
        let mut next = Vec::with_capacity(current.len());
        let mut rest = current;
        while let Some(at) = find(rest, from) {
            next.extend_from_slice(&rest[..at]);
            next.extend_from_slice(to);
            rest = &rest[at + from.len()..];
        }
        next.extend_from_slice(rest);
        out = Some(next);
    }
    out
}

fn refusal(status: StatusCode, reason: Reason) -> Reply {
    let body = format!("space egress: {} ({})\n", reason.explain(), reason.as_str());
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert("x-space-egress", HeaderValue::from_static(reason.as_str()));
    headers.insert("content-type", HeaderValue::from_static("text/plain"));
    headers.insert("connection", HeaderValue::from_static("close"));
    response
}

/// A response body with secret values turned back into placeholders; it
/// holds back the few bytes that could be the start of a value cut by a
/// chunk boundary.
pub struct Redacting {
    inner: Incoming,
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
    keep: usize,
    held: Vec<u8>,
    trailers: Option<HeaderMap>,
}

impl Redacting {
    fn new(inner: Incoming, pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Redacting {
        let keep = pairs.iter().map(|(value, _)| value.len().saturating_sub(1)).max().unwrap_or(0);
        Redacting { inner, pairs, keep, held: Vec::new(), trailers: None }
    }
}

impl Body for Redacting {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        loop {
            if this.trailers.is_some() {
                if !this.held.is_empty() {
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(std::mem::take(&mut this.held))))));
                }
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if this.pairs.is_empty() => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(data) => {
                        this.held.extend_from_slice(&data);
                        if let Some(hidden) = replace_all(&this.held, &this.pairs) {
                            this.held = hidden;
                        }
                        let cut = this.held.len().saturating_sub(this.keep);
                        if cut > 0 {
                            let out: Vec<u8> = this.held.drain(..cut).collect();
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                        }
                    }
                    Err(frame) => match frame.into_trailers() {
                        Ok(mut trailers) => {
                            redact_headers(&mut trailers, &this.pairs);
                            this.trailers = Some(trailers);
                        }
                        Err(_) => continue,
                    },
                },
                Some(Err(err)) => return Poll::Ready(Some(Err(err))),
                None if this.held.is_empty() => return Poll::Ready(None),
                None => return Poll::Ready(Some(Ok(Frame::data(Bytes::from(std::mem::take(&mut this.held)))))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.trailers.is_none() && self.inner.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Binding, Mode};

    struct Fixed;
    impl Vault for Fixed {
        fn secret(&self, name: &str) -> Option<Secret> {
            (name == "llm").then(|| Secret { value: "sk-real-value".into(), hosts: vec!["*.space.test".into()] })
        }
    }

    /// The secret `llm` with hosts its owner changes between requests.
    struct Changing(Mutex<Vec<String>>);
    impl Vault for Changing {
        fn secret(&self, name: &str) -> Option<Secret> {
            let hosts = self.0.lock().unwrap().clone();
            (name == "llm").then(|| Secret { value: "sk-real-value".into(), hosts })
        }
    }

    fn policy() -> Policy {
        let llm = Binding::new("llm", "space_ph_aaaa", &["api.space.test".into()], vec![]).unwrap();
        let git = Binding::new("git", "space_ph_bbbb", &["git.space.test".into()], vec![]).unwrap();
        Policy::new(Mode::Allowlist, &[], &[]).unwrap().with_bindings(vec![llm, git]).unwrap()
    }

    #[test]
    fn placeholders_become_values_only_for_their_hosts() {
        let api = Target::Name("api.space.test".into());
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_static("Bearer space_ph_aaaa"));
        let injected = add_secrets(&mut headers, &api, &policy(), &Fixed).unwrap();
        assert_eq!(headers[AUTHORIZATION], "Bearer sk-real-value");
        assert_eq!(injected.used.into_iter().collect::<Vec<_>>(), ["llm"]);
        assert!(injected.written.is_empty());

        // Inside Basic credentials (git over HTTPS).
        let engine = base64::engine::general_purpose::STANDARD;
        let basic = format!("Basic {}", engine.encode("x-access-token:space_ph_aaaa"));
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_str(&basic).unwrap());
        let injected = add_secrets(&mut headers, &api, &policy(), &Fixed).unwrap();
        let sent = headers[AUTHORIZATION].to_str().unwrap().strip_prefix("Basic ").unwrap().to_string();
        assert_eq!(engine.decode(&sent).unwrap(), b"x-access-token:sk-real-value");
        let asked = engine.encode("x-access-token:space_ph_aaaa").into_bytes();
        assert_eq!(injected.written, vec![(sent.into_bytes(), asked)], "what it wrote, and what it goes back as");

        // Another secret's placeholder to this host: refused, nothing added.
        let mut headers = HeaderMap::new();
        headers.insert("x-token", HeaderValue::from_static("space_ph_bbbb"));
        assert_eq!(add_secrets(&mut headers, &api, &policy(), &Fixed), Err(Reason::SecretNotForHost));
        // A secret that is gone.
        let git = Target::Name("git.space.test".into());
        let mut headers = HeaderMap::new();
        headers.insert("x-token", HeaderValue::from_static("space_ph_bbbb"));
        assert_eq!(add_secrets(&mut headers, &git, &policy(), &Fixed), Err(Reason::SecretUnavailable));
        assert!(carries_placeholder(b"GET /?k=space_ph_bbbb", &policy()));
        assert!(!carries_placeholder(b"GET /?k=space_ph_cccc", &policy()));
    }

    #[test]
    fn set_header_writes_the_value_into_a_template() {
        let binding = Binding::new(
            "llm",
            "space_ph_aaaa",
            &["*.space.test".into()],
            vec![("x-api-key".into(), "key {secret}".into())],
        )
        .unwrap();
        let policy = Policy::new(Mode::Public, &[], &[]).unwrap().with_bindings(vec![binding]).unwrap();
        let mut headers = HeaderMap::new();
        add_secrets(&mut headers, &Target::Name("api.space.test".into()), &policy, &Fixed).unwrap();
        assert_eq!(headers["x-api-key"], "key sk-real-value");
        let mut headers = HeaderMap::new();
        add_secrets(&mut headers, &Target::Name("space.test".into()), &policy, &Fixed).unwrap();
        assert!(headers.is_empty(), "*.suffix does not cover the suffix itself");
    }

    #[test]
    fn a_value_goes_only_where_the_binding_and_the_secret_as_it_is_now_both_allow() {
        let binding = Binding::new(
            "llm",
            "space_ph_aaaa",
            &["api.space.test".into(), "git.space.test".into()],
            vec![("x-api-key".into(), "{secret}".into())],
        )
        .unwrap();
        let policy = Policy::new(Mode::Allowlist, &[], &[]).unwrap().with_bindings(vec![binding]).unwrap();
        let vault = Changing(Mutex::new(vec!["api.space.test".into(), "git.space.test".into()]));
        let send = |host: &str, vault: &Changing| {
            let mut headers = HeaderMap::new();
            headers.insert(AUTHORIZATION, HeaderValue::from_static("Bearer space_ph_aaaa"));
            add_secrets(&mut headers, &Target::Name(host.into()), &policy, vault).map(|_| headers)
        };
        assert_eq!(send("git.space.test", &vault).unwrap()[AUTHORIZATION], "Bearer sk-real-value");
        // Narrowed after the bind: refused as a host never bound, the
        // set_header binding too; the host still listed keeps it.
        *vault.0.lock().unwrap() = vec!["api.space.test".into()];
        assert_eq!(send("git.space.test", &vault).unwrap_err(), Reason::SecretNotForHost);
        let mut bare = HeaderMap::new();
        let git = Target::Name("git.space.test".into());
        assert_eq!(add_secrets(&mut bare, &git, &policy, &vault), Err(Reason::SecretNotForHost));
        assert!(bare.is_empty());
        let sent = send("api.space.test", &vault).unwrap();
        assert_eq!(sent[AUTHORIZATION], "Bearer sk-real-value");
        assert_eq!(sent["x-api-key"], "sk-real-value");
        // Widened: the binding stays as it was made.
        *vault.0.lock().unwrap() = vec!["*.space.test".into()];
        assert!(send("git.space.test", &vault).is_ok());
        assert_eq!(send("other.space.test", &vault).unwrap_err(), Reason::SecretNotForHost);
        // Hosts that do not read cover nothing.
        *vault.0.lock().unwrap() = vec!["10.0.0.1".into()];
        assert_eq!(send("api.space.test", &vault).unwrap_err(), Reason::SecretNotForHost);
    }

    #[test]
    fn values_are_replaced_across_any_cut() {
        let pairs = vec![(b"sk-real-value".to_vec(), b"space_ph_aaaa".to_vec())];
        assert_eq!(
            replace_all(b"a sk-real-value b sk-real-value", &pairs).unwrap(),
            b"a space_ph_aaaa b space_ph_aaaa"
        );
        assert!(replace_all(b"nothing here", &pairs).is_none());
    }
}
