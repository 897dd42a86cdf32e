//! The gateway: serves one sandbox's egress connections (relayed by its
//! agent over the channel, whatever stream they arrive as). A connection opens
//! with `CONNECT host:port` (a tunnel, whatever runs inside it) or an
//! absolute-form `http://` request (forwarded alone, its body measured, with
//! `Connection: close` and the `Host` of its target); anything else, or
//! anything [`crate::framing`] finds ambiguous, is refused. The target is judged by the sandbox's policy
//! before any lookup, its addresses after, and the gateway dials the
//! address it checked (a name is never handed to anyone else to resolve).

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::framing::{refuse, MAX_HEAD};
use crate::policy::{always_denied, Policy, Reason, Target};

/// Time allowed for a request head to arrive.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Time allowed to connect to the upstream.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections a sandbox may have open through the gateway at once.
pub const MAX_CONNECTIONS: usize = 64;
/// A connection on which nothing moves either way this long is closed
/// (the upstream side of a paused sandbox's tunnels, above all).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// New connections a sandbox may open per second (and at once, after a
/// quiet second).
pub const NEW_PER_SECOND: u32 = 20;

/// Looks names up. The gateway asks only for names its policy allowed.
pub trait Resolver: Send + Sync {
    fn resolve<'a>(&'a self, name: &'a str) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>>;
}

/// The host's own resolver (`getaddrinfo`, through tokio).
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a str) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>> {
        Box::pin(async move { Ok(tokio::net::lookup_host((name, 0)).await?.map(|a| a.ip()).collect()) })
    }
}

/// Fixed answers (for tests and operators' static maps); counts lookups
/// per name so a test can prove a name was never looked up.
#[derive(Default)]
pub struct StaticResolver {
    answers: std::collections::HashMap<String, Vec<IpAddr>>,
    pub lookups: std::sync::Mutex<Vec<String>>,
}

impl StaticResolver {
    pub fn new(answers: impl IntoIterator<Item = (String, Vec<IpAddr>)>) -> StaticResolver {
        StaticResolver { answers: answers.into_iter().collect(), lookups: Default::default() }
    }

    pub fn lookups_of(&self, name: &str) -> usize {
        self.lookups.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|n| *n == name).count()
    }
}

impl Resolver for StaticResolver {
    fn resolve<'a>(&'a self, name: &'a str) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>> {
        self.lookups.lock().unwrap_or_else(|e| e.into_inner()).push(name.to_string());
        let found = self.answers.get(name).cloned();
        Box::pin(async move { found.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such name")) })
    }
}

/// What the host's operator decides for every sandbox.
#[derive(Clone)]
pub struct GatewayConfig {
    pub resolver: Arc<dyn Resolver>,
    /// Internal addresses sandboxes may reach anyway (an internal mirror;
    /// tests' loopback upstreams). Operator configuration only.
    pub allow_internal: Vec<(IpAddr, u8)>,
    pub max_connections: usize,
    pub idle_timeout: Duration,
    /// New connections per second, per sandbox.
    pub new_per_second: u32,
    /// Bytes per second each way, per sandbox (all its connections
    /// together); 0: unlimited.
    pub bytes_per_second: u64,
    /// What upstream certificates are checked against where the gateway
    /// terminates TLS (the system's roots unless the operator adds some).
    pub upstream_roots: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
    /// Names whose connections go to another port than the one asked for,
    /// whatever it was (a mirror, or a test's upstream, on its own port).
    /// Operator configuration only.
    pub dial_ports: std::collections::HashMap<String, u16>,
}

impl GatewayConfig {
    pub fn new(resolver: Arc<dyn Resolver>) -> GatewayConfig {
        GatewayConfig {
            resolver,
            allow_internal: Vec::new(),
            max_connections: MAX_CONNECTIONS,
            idle_timeout: IDLE_TIMEOUT,
            new_per_second: NEW_PER_SECOND,
            bytes_per_second: 0,
            upstream_roots: None,
            dial_ports: Default::default(),
        }
    }

    fn reachable(&self, ip: IpAddr) -> bool {
        !always_denied(ip) || self.allow_internal.iter().any(|(net, len)| crate::policy::in_net(ip, *net, *len))
    }
}

/// One connection through the gateway, as the audit log keeps it.
pub type Event = space_api::EgressEvent;

/// Where an open connection goes, whether it is inspected, and what cuts it.
type Relayed = (Target, u16, bool, Arc<tokio::sync::Notify>);

/// What the gateway needs to add a sandbox's secrets to its requests.
#[derive(Clone)]
pub struct Credentials {
    pub vault: Arc<dyn crate::inspect::Vault>,
    pub ca: Arc<crate::ca::SandboxCa>,
}

/// One sandbox's side of the gateway: its policy (replaceable while it
/// runs) and where its events go.
pub struct SandboxEgress {
    id: String,
    policy: RwLock<Arc<Policy>>,
    events: mpsc::Sender<(String, Event)>,
    open: AtomicUsize,
    config: GatewayConfig,
    /// Connections carrying bytes now: where they go, and how to cut them.
    relayed: std::sync::Mutex<std::collections::HashMap<u64, Relayed>>,
    next_relayed: std::sync::atomic::AtomicU64,
    credentials: RwLock<Option<Credentials>>,
    /// New connections: a bucket of `new_per_second` tokens.
    opened: std::sync::Mutex<Bucket>,
    /// Bytes from the sandbox, and to it.
    up_rate: Arc<std::sync::Mutex<Bucket>>,
    down_rate: Arc<std::sync::Mutex<Bucket>>,
}

/// A token bucket that may run into debt: what was taken beyond the
/// tokens is paid back before anything more goes.
struct Bucket {
    tokens: f64,
    rate: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: f64) -> Bucket {
        Bucket { tokens: rate, rate, at: Instant::now() }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * self.rate).min(self.rate);
        self.at = now;
    }

    /// Takes one token if there is one.
    fn take_one(&mut self) -> bool {
        self.refill();
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return true;
        }
        false
    }

    /// How long until the bucket is out of debt (zero: now).
    fn wait(&mut self) -> Duration {
        self.refill();
        if self.tokens >= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(-self.tokens / self.rate)
    }

    fn spend(&mut self, n: usize) {
        self.tokens -= n as f64;
    }
}

impl SandboxEgress {
    /// `id` names the sandbox in the events it sends.
    pub fn new(
        id: String,
        policy: Policy,
        events: mpsc::Sender<(String, Event)>,
        config: GatewayConfig,
    ) -> Arc<SandboxEgress> {
        Arc::new(SandboxEgress {
            id,
            policy: RwLock::new(Arc::new(policy)),
            events,
            open: AtomicUsize::new(0),
            relayed: Default::default(),
            next_relayed: Default::default(),
            credentials: RwLock::default(),
            opened: std::sync::Mutex::new(Bucket::new(f64::from(config.new_per_second.max(1)))),
            up_rate: Arc::new(std::sync::Mutex::new(Bucket::new(config.bytes_per_second as f64))),
            down_rate: Arc::new(std::sync::Mutex::new(Bucket::new(config.bytes_per_second as f64))),
            config,
        })
    }

    /// Where the sandbox's secrets come from, and its CA.
    pub fn set_credentials(&self, credentials: Credentials) {
        *self.credentials.write().unwrap_or_else(|e| e.into_inner()) = Some(credentials);
    }

    /// Replaces the policy: new connections are judged by it at once, and
    /// open ones it no longer allows are cut (inspected ones always: their
    /// secrets may have changed).
    pub fn set_policy(&self, policy: Policy) {
        let relayed = self.relayed.lock().unwrap_or_else(|e| e.into_inner());
        for (target, port, inspected, cut) in relayed.values() {
            if *inspected || policy.decide(target, *port).is_err() {
                cut.notify_one();
            }
        }
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(policy);
    }

    fn policy(&self) -> Arc<Policy> {
        self.policy.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Serves one connection from the sandbox.
    pub async fn handle<S: AsyncRead + AsyncWrite + Unpin>(&self, mut client: S) {
        let started = Instant::now();
        let mut event = Event {
            at: space_api::Timestamp::now(),
            via: String::new(),
            host: String::new(),
            port: 0,
            decision: "denied".into(),
            reason: None,
            rule: None,
            address: None,
            bytes_up: 0,
            bytes_down: 0,
            duration_ms: 0,
            inspected: false,
            requests: 0,
            secrets: Vec::new(),
        };
        if !self.opened.lock().unwrap_or_else(|e| e.into_inner()).take_one() {
            refuse(&mut client, 429, Reason::RateLimit).await;
            event.reason = Some(Reason::RateLimit.as_str().into());
            return self.record(event, started);
        }
        let _slot = match Slot::take(&self.open, self.config.max_connections) {
            Some(slot) => slot,
            None => {
                refuse(&mut client, 429, Reason::Limit).await;
                event.reason = Some(Reason::Limit.as_str().into());
                return self.record(event, started);
            }
        };
        let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await {
            Ok(Ok(read)) => read,
            _ => {
                refuse(&mut client, 400, Reason::BadRequest).await;
                event.reason = Some(Reason::BadRequest.as_str().into());
                return self.record(event, started);
            }
        };
        let request = match Request::parse(&head) {
            Ok(request) => request,
            Err(reason) => {
                refuse(&mut client, 400, reason).await;
                event.reason = Some(reason.as_str().into());
                return self.record(event, started);
            }
        };
        event.via = if request.connect { "connect" } else { "http" }.into();
        event.host = request.target.to_string();
        event.port = request.port;
        let policy = self.policy();
        // A placeholder in plain HTTP goes nowhere: secrets travel only
        // over HTTPS, added by the gateway.
        if !request.connect && crate::inspect::carries_placeholder(&head, &policy) {
            refuse(&mut client, 403, Reason::SecretNotForHost).await;
            event.reason = Some(Reason::SecretNotForHost.as_str().into());
            return self.record(event, started);
        }
        let inspected = request.connect && policy.inspects(&request.target, request.port);
        let credentials = self.credentials.read().unwrap_or_else(|e| e.into_inner()).clone();
        let credentials = match (inspected, credentials) {
            (false, _) => None,
            (true, Some(credentials)) => Some(credentials),
            (true, None) => {
                refuse(&mut client, 403, Reason::SecretUnavailable).await;
                event.reason = Some(Reason::SecretUnavailable.as_str().into());
                return self.record(event, started);
            }
        };
        let upstream = match self.open_upstream(&policy, &request, &mut event).await {
            Ok(upstream) => upstream,
            Err((status, reason)) => {
                refuse(&mut client, status, reason).await;
                event.reason = Some(reason.as_str().into());
                return self.record(event, started);
            }
        };
        let mut rest = rest;
        if request.connect {
            if client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.is_err() {
                return self.record(event, started);
            }
            // A TLS port: the tunnel must open with a ClientHello for the
            // host it was asked for (no other site behind the same address).
            if TLS_PORTS.contains(&request.port) && credentials.is_none() {
                if let Err(reason) = check_server_name(&mut client, &request.target, &mut rest).await {
                    event.reason = Some(reason.as_str().into());
                    return self.record(event, started);
                }
            }
        }
        event.decision = "allowed".into();
        let cut = Arc::new(tokio::sync::Notify::new());
        let key = self.next_relayed.fetch_add(1, Ordering::Relaxed);
        let entry = (request.target.clone(), request.port, inspected, cut.clone());
        self.relayed.lock().unwrap_or_else(|e| e.into_inner()).insert(key, entry);
        let moved = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (up_rate, down_rate) = match self.config.bytes_per_second {
            0 => (None, None),
            _ => (Some(self.up_rate.clone()), Some(self.down_rate.clone())),
        };
        let client = Watched {
            inner: client,
            moved: moved.clone(),
            up: 0,
            down: 0,
            up_rate: Throttle::new(up_rate),
            down_rate: Throttle::new(down_rate),
        };
        if let Some(credentials) = credentials {
            let seen = Arc::new(std::sync::Mutex::new(crate::inspect::Seen::default()));
            let inspection = crate::inspect::Inspection {
                host: request.target.to_string(),
                policy,
                vault: credentials.vault,
                ca: credentials.ca,
                roots: self.upstream_roots(),
            };
            event.inspected = true;
            let mut client = Prefixed { rest, inner: client };
            let served = crate::inspect::serve(&mut client, upstream, inspection, seen.clone());
            let outcome = tokio::select! {
                served = served => served.err(),
                () = cut.notified() => Some(Reason::PolicyChanged),
                () = idle(&moved, self.config.idle_timeout) => Some(Reason::Idle),
            };
            let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
            let client = client.inner;
            (event.bytes_up, event.bytes_down) = (client.up, client.down);
            event.requests = seen.requests;
            event.secrets = seen.secrets.into_iter().collect();
            if let Some(reason) = seen.refused.or(outcome.filter(|r| *r != Reason::Unreachable)) {
                if seen.refused.is_some() || seen.requests == 0 {
                    event.decision = "denied".into();
                }
                event.reason = Some(reason.as_str().into());
            }
        } else {
            tokio::select! {
                (up, down) = relay(client, upstream, &request, &rest) => {
                    event.bytes_up = up;
                    event.bytes_down = down;
                }
                () = cut.notified() => event.reason = Some(Reason::PolicyChanged.as_str().into()),
                () = idle(&moved, self.config.idle_timeout) => event.reason = Some(Reason::Idle.as_str().into()),
            }
        }
        self.relayed.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
        self.record(event, started);
    }

    fn upstream_roots(&self) -> Arc<tokio_rustls::rustls::ClientConfig> {
        static SYSTEM: std::sync::OnceLock<Arc<tokio_rustls::rustls::ClientConfig>> = std::sync::OnceLock::new();
        self.config.upstream_roots.clone().unwrap_or_else(|| {
            SYSTEM.get_or_init(|| crate::ca::upstream_roots(&[]).expect("the system's roots")).clone()
        })
    }

    /// Judges the request, resolves and dials; the HTTP status and reason
    /// when it does not get through.
    async fn open_upstream(
        &self,
        policy: &Policy,
        request: &Request,
        event: &mut Event,
    ) -> Result<TcpStream, (u16, Reason)> {
        let rule = policy.decide(&request.target, request.port).map_err(|reason| (403, reason))?;
        event.rule = rule.map(|r| r.text().to_string());
        let candidates = match &request.target {
            Target::Ip(ip) => vec![*ip],
            Target::Name(name) => match self.config.resolver.resolve(name).await {
                Ok(ips) if !ips.is_empty() => ips,
                _ => return Err((502, Reason::NotResolved)),
            },
        };
        // Rebinding: an allowed name that points inside is refused.
        let reachable: Vec<IpAddr> = candidates.into_iter().filter(|ip| self.config.reachable(*ip)).collect();
        let Some(ip) = reachable.first().copied() else {
            return Err((403, Reason::InternalAddress));
        };
        let port = match &request.target {
            Target::Name(name) => self.config.dial_ports.get(name).copied().unwrap_or(request.port),
            Target::Ip(_) => request.port,
        };
        let address = SocketAddr::new(ip, port);
        event.address = Some(address.to_string());
        match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => Ok(stream),
            _ => Err((502, Reason::Unreachable)),
        }
    }

    fn record(&self, mut event: Event, started: Instant) {
        event.duration_ms = started.elapsed().as_millis() as u64;
        if self.events.try_send((self.id.clone(), event)).is_err() {
            tracing::warn!("egress events are arriving faster than they are stored; one was dropped");
        }
    }
}

/// A counted place among a sandbox's open connections.
struct Slot<'a>(&'a AtomicUsize);

impl<'a> Slot<'a> {
    fn take(open: &'a AtomicUsize, max: usize) -> Option<Slot<'a>> {
        let before = open.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(open))
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request as the gateway needs it.
struct Request {
    connect: bool,
    target: Target,
    port: u16,
    /// For a forwarded request: its head in origin form, `Connection: close`.
    forward_head: Vec<u8>,
    /// For a forwarded request: how its body ends (nothing after it goes).
    body: crate::framing::BodyLength,
}

impl Request {
    fn parse(head: &[u8]) -> Result<Request, Reason> {
        let mut headers = [httparse::EMPTY_HEADER; crate::framing::MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(head) {
            Ok(httparse::Status::Complete(_)) => {}
            _ => return Err(Reason::BadRequest),
        }
        let bad = |()| Reason::BadRequest;
        let (method, uri) = (parsed.method.ok_or(Reason::BadRequest)?, parsed.path.ok_or(Reason::BadRequest)?);
        if method.eq_ignore_ascii_case("CONNECT") {
            let (target, port) = split_authority(uri, None).map_err(bad)?;
            let body = crate::framing::BodyLength::None;
            return Ok(Request { connect: true, target, port, forward_head: Vec::new(), body });
        }
        // Absolute form, plain HTTP only: HTTPS goes through CONNECT.
        let rest = uri.strip_prefix("http://").ok_or(Reason::BadRequest)?;
        let (authority, path) = match rest.find(['/', '?']) {
            Some(cut) => (&rest[..cut], &rest[cut..]),
            None => (rest, "/"),
        };
        if authority.contains('@') {
            return Err(Reason::BadRequest);
        }
        let (target, port) = split_authority(authority, Some(80)).map_err(bad)?;
        let body = crate::framing::check_head(&parsed, None)?;
        let path = if path.starts_with('?') { format!("/{path}") } else { path.to_string() };
        // The Host is the target's, whatever the sandbox wrote (RFC 9112
        // §3.2.2): the address dialled is the target's, and another Host
        // would reach another site behind it.
        let mut out = format!("{method} {path} HTTP/1.1\r\nHost: {authority}\r\n").into_bytes();
        for header in parsed.headers.iter() {
            let name = header.name.to_ascii_lowercase();
            if name.starts_with("proxy-") || name == "connection" || name == "keep-alive" || name == "host" {
                continue;
            }
            out.extend_from_slice(header.name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(header.value);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"Connection: close\r\n\r\n");
        Ok(Request { connect: false, target, port, forward_head: out, body })
    }
}

/// `host:port` (`[v6]:port`); `default` when the port may be left out.
fn split_authority(authority: &str, default: Option<u16>) -> Result<(Target, u16), ()> {
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && (host.starts_with('[') || !host.contains(':')) => {
            (host, Some(port.parse::<u16>().map_err(|_| ())?))
        }
        _ => (authority, None),
    };
    let port = port.or(default).filter(|p| *p > 0).ok_or(())?;
    Ok((Target::parse(host).ok_or(())?, port))
}

/// Reads up to the end of the request head; returns the head and what
/// came after it.
async fn read_head<S: AsyncRead + Unpin>(client: &mut S) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        let end = buf[from..].windows(4).position(|w| w == b"\r\n\r\n").map(|end| from + end + 4);
        if let Some(end) = end.filter(|end| *end <= MAX_HEAD) {
            let rest = buf.split_off(end);
            return Ok((buf, rest));
        }
        if end.is_some() || buf.len() > MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "request head too large"));
        }
    }
}

/// Resolves once `moved` has not changed for `timeout`.
async fn idle(moved: &std::sync::atomic::AtomicU64, timeout: Duration) {
    let mut last = moved.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(timeout).await;
        let now = moved.load(Ordering::Relaxed);
        if now == last {
            return;
        }
        last = now;
    }
}

/// The sandbox's side of a connection, counting the bytes that move on it
/// either way (every byte of a relayed connection passes here).
struct Watched<S> {
    inner: S,
    moved: Arc<std::sync::atomic::AtomicU64>,
    /// Bytes from the sandbox, and to it.
    up: u64,
    down: u64,
    up_rate: Throttle,
    down_rate: Throttle,
}

/// Holds a direction back while the sandbox's byte bucket is in debt.
struct Throttle {
    bucket: Option<Arc<std::sync::Mutex<Bucket>>>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Throttle {
    fn new(bucket: Option<Arc<std::sync::Mutex<Bucket>>>) -> Throttle {
        Throttle { bucket, sleep: None }
    }

    /// Ready when bytes may go.
    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let Some(bucket) = &self.bucket else { return std::task::Poll::Ready(()) };
        loop {
            if let Some(sleep) = &mut self.sleep {
                std::task::ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
            }
            let wait = bucket.lock().unwrap_or_else(|e| e.into_inner()).wait();
            if wait.is_zero() {
                return std::task::Poll::Ready(());
            }
            self.sleep = Some(Box::pin(tokio::time::sleep(wait)));
        }
    }

    fn spend(&self, n: usize) {
        if let Some(bucket) = &self.bucket {
            bucket.lock().unwrap_or_else(|e| e.into_inner()).spend(n);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::task::ready!(self.up_rate.poll_ready(cx));
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.moved.fetch_add(n as u64, Ordering::Relaxed);
        self.up += n as u64;
        self.up_rate.spend(n);
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::task::ready!(self.down_rate.poll_ready(cx));
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = polled {
            self.moved.fetch_add(n as u64, Ordering::Relaxed);
            self.down += n as u64;
            self.down_rate.spend(n);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A stream whose first bytes were already read (what followed a request
/// head): they are read again first.
struct Prefixed<S> {
    rest: Vec<u8>,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        if !self.rest.is_empty() {
            let n = self.rest.len().min(buf.remaining());
            buf.put_slice(&self.rest[..n]);
            self.rest.drain(..n);
            return std::task::Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Ports whose tunnels must carry TLS for the host asked for.
const TLS_PORTS: [u16; 1] = [443];

/// Reads the tunnel's first bytes (into `rest`, which goes upstream
/// afterwards) until its ClientHello is whole; the server name, when it
/// gives one, must be the tunnel's host.
async fn check_server_name<S: AsyncRead + Unpin>(
    client: &mut S,
    target: &Target,
    rest: &mut Vec<u8>,
) -> Result<(), Reason> {
    let read = async {
        let mut chunk = [0u8; 4096];
        loop {
            match crate::tls::client_hello(rest) {
                crate::tls::Hello::Incomplete if rest.len() < crate::tls::MAX_HELLO => {}
                crate::tls::Hello::Sni(name) => return Ok(name),
                _ => return Err(Reason::NotTls),
            }
            match client.read(&mut chunk).await {
                Ok(0) | Err(_) => return Err(Reason::NotTls),
                Ok(n) => rest.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let name = tokio::time::timeout(HEAD_TIMEOUT, read).await.map_err(|_| Reason::NotTls)??;
    match (name, target) {
        (Some(name), Target::Name(host)) if name != *host => Err(Reason::SniMismatch),
        _ => Ok(()),
    }
}

/// Pumps bytes both ways until both sides are done; returns (up, down).
async fn relay<S: AsyncRead + AsyncWrite + Unpin>(
    mut client: S,
    mut upstream: TcpStream,
    request: &Request,
    rest: &[u8],
) -> (u64, u64) {
    let mut up = 0;
    if !request.connect {
        return forward_one(client, upstream, request, rest).await;
    }
    if !rest.is_empty() {
        if upstream.write_all(rest).await.is_err() {
            return (0, 0);
        }
        up += rest.len() as u64;
    }
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((more_up, down)) => (up + more_up, down),
        Err(_) => (up, 0),
    }
}

/// Sends a forwarded request upstream, its head and exactly its body
/// (whatever the sandbox sends after it stays unread: with `Connection:
/// close`, no second request rides on this one), and its answer back,
/// until the upstream is done. The upstream's side is never half-closed:
/// some servers take that for a client gone. Returns (up, down).
async fn forward_one<S: AsyncRead + AsyncWrite + Unpin>(
    client: S,
    mut upstream: TcpStream,
    request: &Request,
    rest: &[u8],
) -> (u64, u64) {
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let (mut from_upstream, mut to_upstream) = upstream.split();
    let send = async {
        to_upstream.write_all(&request.forward_head).await?;
        let mut up = request.forward_head.len() as u64;
        let mut framer = crate::framing::Framer::new(request.body);
        let mut pending = rest.to_vec();
        let mut chunk = vec![0u8; 16 * 1024];
        while !framer.done() {
            if pending.is_empty() {
                let n = from_client.read(&mut chunk).await?;
                if n == 0 {
                    break;
                }
                pending.extend_from_slice(&chunk[..n]);
            }
            let n = framer.feed(&pending).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
            to_upstream.write_all(&pending[..n]).await?;
            up += n as u64;
            pending.drain(..n);
        }
        io::Result::Ok(up)
    };
    let receive = async {
        let down = tokio::io::copy(&mut from_upstream, &mut to_client).await.unwrap_or(0);
        let _ = to_client.shutdown().await;
        down
    };
    tokio::pin!(send, receive);
    tokio::select! {
        down = &mut receive => (0, down),
        sent = &mut send => match sent {
            // A malformed chunk: the upstream has part of a body, and no more.
            Err(_) => (0, 0),
            Ok(up) => (up, receive.await),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Mode;

    type Events = mpsc::Receiver<(String, Event)>;

    fn egress(mode: Mode, allow: &[&str]) -> (Arc<SandboxEgress>, Events, Arc<StaticResolver>) {
        let resolver = Arc::new(StaticResolver::new([
            ("allowed.space.test".to_string(), vec!["127.0.0.1".parse().unwrap()]),
            ("inside.space.test".to_string(), vec!["10.0.0.1".parse().unwrap()]),
        ]));
        let mut config = GatewayConfig::new(resolver.clone());
        config.allow_internal = vec![("127.0.0.1".parse().unwrap(), 32)];
        let allow: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
        let (events, received) = mpsc::channel(64);
        let policy = Policy::new(mode, &allow, &[]).unwrap();
        (SandboxEgress::new("sbx_t".into(), policy, events, config), received, resolver)
    }

    /// An upstream on loopback that accepts and then just holds every
    /// connection; returns its port.
    async fn holding_upstream() -> u16 {
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = upstream.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = upstream.accept().await {
                held.push(socket);
            }
        });
        port
    }

    async fn exchange(egress: &SandboxEgress, request: &[u8]) -> String {
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        ours.write_all(request).await.unwrap();
        // The client says all it has to say, then reads to the end.
        ours.shutdown().await.unwrap();
        let served = egress.handle(theirs);
        let read = async {
            let mut answer = Vec::new();
            let _ = ours.read_to_end(&mut answer).await;
            answer
        };
        let ((), answer) = tokio::join!(served, read);
        String::from_utf8_lossy(&answer).into_owned()
    }

    #[tokio::test]
    async fn allowed_requests_are_forwarded_and_denied_names_never_looked_up() {
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = upstream.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = upstream.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = socket.read(&mut buf).await.unwrap();
                    let seen = String::from_utf8_lossy(&buf[..n]).into_owned();
                    let body = seen.lines().next().unwrap_or("").to_string();
                    let answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                    socket.write_all(answer.as_bytes()).await.unwrap();
                });
            }
        });
        let (egress, mut events, resolver) = egress(Mode::Allowlist, &[&format!("allowed.space.test:{port}")]);

        let answer = exchange(
            &egress,
            format!("GET http://allowed.space.test:{port}/x?y=1 HTTP/1.1\r\nHost: allowed.space.test\r\nProxy-Authorization: z\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("GET /x?y=1 HTTP/1.1"), "{answer}");
        let (_, event) = events.recv().await.unwrap();
        assert_eq!((event.decision.as_str(), event.via.as_str(), event.port), ("allowed", "http", port));
        assert!(event.bytes_down > 0 && event.bytes_up > 0, "{event:?}");

        let answer = exchange(
            &egress,
            format!("CONNECT allowed.space.test:{port} HTTP/1.1\r\n\r\nGET /tunnel HTTP/1.1\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200 Connection established"), "{answer}");
        assert!(answer.ends_with("GET /tunnel HTTP/1.1"), "{answer}");
        assert_eq!(events.recv().await.unwrap().1.via, "connect");

        let answer = exchange(&egress, b"CONNECT denied.space.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 403") && answer.contains("not_allowed"), "{answer}");
        assert_eq!(resolver.lookups_of("denied.space.test"), 0, "a denied name is never looked up");
        let (_, event) = events.recv().await.unwrap();
        assert_eq!((event.decision.as_str(), event.reason.as_deref()), ("denied", Some("not_allowed")));

        let answer =
            exchange(&egress, format!("CONNECT allowed.space.test:{} HTTP/1.1\r\n\r\n", port + 1).as_bytes()).await;
        assert!(answer.contains("port_not_allowed"), "{answer}");
    }

    #[tokio::test]
    async fn internal_answers_bad_requests_and_disabled_egress_are_refused() {
        let (egress, mut events, _) = egress(Mode::Public, &[]);
        // An allowed name that resolves inside (rebinding).
        let answer = exchange(&egress, b"CONNECT inside.space.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 403") && answer.contains("internal_address"), "{answer}");
        let answer = exchange(&egress, b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n").await;
        assert!(answer.contains("internal_address"), "{answer}");
        let answer = exchange(&egress, b"CONNECT nowhere.space.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 502") && answer.contains("not_resolved"), "{answer}");
        for bad in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"GET https://a.example/ HTTP/1.1\r\n\r\n",
            b"GET http://user@a.example/ HTTP/1.1\r\n\r\n",
            b"CONNECT a.example HTTP/1.1\r\n\r\n",
            b"\x16\x03\x01\x02\x00garbage\r\n\r\n",
        ] {
            let answer = exchange(&egress, bad).await;
            assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        }
        let huge = format!("GET http://a.example/ HTTP/1.1\r\nX: {}\r\n\r\n", "y".repeat(MAX_HEAD));
        assert!(exchange(&egress, huge.as_bytes()).await.starts_with("HTTP/1.1 400"));
        egress.set_policy(Policy::default());
        assert!(egress.relayed.lock().unwrap().is_empty());
        let answer = exchange(&egress, b"CONNECT allowed.space.test:443 HTTP/1.1\r\n\r\n").await;
        assert!(answer.contains("egress_disabled"), "{answer}");
        while let Ok((_, event)) = events.try_recv() {
            assert_eq!(event.decision, "denied", "{event:?}");
        }
        assert_eq!(egress.open_connections(), 0);
    }

    #[tokio::test]
    async fn a_policy_change_cuts_the_tunnels_it_no_longer_allows() {
        let port = holding_upstream().await;
        let (egress, mut events, _) = egress(Mode::Allowlist, &[&format!("allowed.space.test:{port}")]);
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        ours.write_all(format!("CONNECT allowed.space.test:{port} HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
        let served = tokio::spawn({
            let egress = egress.clone();
            async move { egress.handle(theirs).await }
        });
        let mut established = [0u8; 39];
        ours.read_exact(&mut established).await.unwrap();
        assert!(established.starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&established));
        // Still allowed: nothing happens to it.
        egress.set_policy(Policy::new(Mode::Allowlist, &[format!("*.space.test:{port}")], &[]).unwrap());
        let quiet = tokio::time::timeout(Duration::from_millis(200), ours.read(&mut [0u8; 1])).await;
        assert!(quiet.is_err(), "a tunnel the new policy allows stays open");
        // No longer allowed: cut, and recorded as such.
        egress.set_policy(Policy::new(Mode::Allowlist, &["other.space.test".into()], &[]).unwrap());
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), ours.read_to_end(&mut rest)).await.unwrap().unwrap();
        served.await.unwrap();
        let (_, event) = events.recv().await.unwrap();
        assert_eq!((event.decision.as_str(), event.reason.as_deref()), ("allowed", Some("policy_changed")));
    }

    #[tokio::test]
    async fn a_tls_tunnel_must_ask_for_the_host_it_was_opened_to() {
        let host = Target::parse("pkgs.space.test").unwrap();
        let check = |bytes: Vec<u8>, target: Target| async move {
            let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
            ours.write_all(&bytes).await.unwrap();
            drop(ours);
            let mut rest = Vec::new();
            let verdict = check_server_name(&mut theirs, &target, &mut rest).await;
            (verdict, rest)
        };
        let hello = crate::tls::tests::hello_for(Some("pkgs.space.test"));
        let (verdict, rest) = check(hello.clone(), host.clone()).await;
        assert_eq!(verdict, Ok(()));
        assert_eq!(rest, hello, "the ClientHello goes on upstream untouched");
        let (verdict, _) = check(crate::tls::tests::hello_for(Some("other.example")), host.clone()).await;
        assert_eq!(verdict, Err(Reason::SniMismatch));
        let (verdict, _) = check(crate::tls::tests::hello_for(None), host.clone()).await;
        assert_eq!(verdict, Ok(()), "no server name: nothing to compare");
        let (verdict, _) = check(b"GET / HTTP/1.1\r\n\r\n".to_vec(), host.clone()).await;
        assert_eq!(verdict, Err(Reason::NotTls));
        let half = crate::tls::tests::hello_for(Some("pkgs.space.test"))[..20].to_vec();
        let (verdict, _) = check(half, host).await;
        assert_eq!(verdict, Err(Reason::NotTls), "a hello cut short");
    }

    #[tokio::test]
    async fn a_connection_on_which_nothing_moves_is_closed() {
        let port = holding_upstream().await;
        let resolver =
            Arc::new(StaticResolver::new([("allowed.space.test".to_string(), vec!["127.0.0.1".parse().unwrap()])]));
        let mut config = GatewayConfig::new(resolver);
        config.allow_internal = vec![("127.0.0.1".parse().unwrap(), 32)];
        config.idle_timeout = Duration::from_millis(300);
        let (events, mut received) = mpsc::channel(4);
        let policy = Policy::new(Mode::Allowlist, &[format!("allowed.space.test:{port}")], &[]).unwrap();
        let egress = SandboxEgress::new("sbx_t".into(), policy, events, config);
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        ours.write_all(format!("CONNECT allowed.space.test:{port} HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
        let served = tokio::spawn(async move { egress.handle(theirs).await });
        // Bytes keep it open past the timeout...
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            ours.write_all(b"x").await.unwrap();
        }
        assert!(!served.is_finished(), "a connection in use stays open");
        // ...silence closes it.
        tokio::time::timeout(Duration::from_secs(5), served).await.unwrap().unwrap();
        let (_, event) = received.recv().await.unwrap();
        assert_eq!(event.reason.as_deref(), Some("idle"));
    }

    /// A TLS upstream on loopback for `host`, signed by a CA of its own;
    /// answers every request with the `authorization` header it got (in
    /// its body) and keeps what it got. Returns its port and the gateway
    /// configuration's roots trusting it.
    async fn tls_upstream(
        host: &str,
    ) -> (u16, Arc<tokio_rustls::rustls::ClientConfig>, Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio_rustls::rustls;
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf =
            rcgen::CertificateParams::new(vec![host.to_string()]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
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
        let got = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (acceptor, seen) = (tokio_rustls::TlsAcceptor::from(Arc::new(server)), got.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (acceptor, seen) = (acceptor.clone(), seen.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(socket).await else { return };
                    let Ok((head, _)) = read_head(&mut tls).await else { return };
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let auth = head
                        .lines()
                        .find_map(|l| l.strip_prefix("authorization: ").or(l.strip_prefix("Authorization: ")))
                        .unwrap_or("")
                        .to_string();
                    seen.lock().unwrap().push(head);
                    let body = format!("you sent {auth}");
                    let answer =
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (port, Arc::new(client), got)
    }

    struct OneSecret;
    impl crate::inspect::Vault for OneSecret {
        fn secret(&self, name: &str) -> Option<crate::inspect::Secret> {
            let hosts = vec!["api.space.test".into()];
            (name == "llm").then(|| crate::inspect::Secret { value: "sk-the-real-thing".into(), hosts })
        }
    }

    #[tokio::test]
    async fn a_bound_secret_reaches_only_its_host_and_never_comes_back() {
        use tokio_rustls::rustls;
        let (port, roots, got) = tls_upstream("api.space.test").await;
        let resolver = Arc::new(StaticResolver::new([
            ("api.space.test".to_string(), vec!["127.0.0.1".parse().unwrap()]),
            ("other.space.test".to_string(), vec!["127.0.0.1".parse().unwrap()]),
        ]));
        let mut config = GatewayConfig::new(resolver);
        config.allow_internal = vec![("127.0.0.1".parse().unwrap(), 32)];
        config.upstream_roots = Some(roots);
        config.dial_ports = [("api.space.test".to_string(), port), ("other.space.test".to_string(), port)].into();
        let binding =
            crate::policy::Binding::new("llm", "space_ph_0123456789abcdef", &["api.space.test".into()], vec![])
                .unwrap();
        let policy = Policy::new(Mode::Allowlist, &["other.space.test".into()], &[])
            .unwrap()
            .with_bindings(vec![binding])
            .unwrap();
        let (events, mut received) = mpsc::channel(8);
        let egress = SandboxEgress::new("sbx_t".into(), policy, events, config);
        let ca = Arc::new(crate::ca::SandboxCa::generate("sbx_t").unwrap());
        egress.set_credentials(Credentials { vault: Arc::new(OneSecret), ca: ca.clone() });

        // The sandbox's side: trusts only its CA, talks HTTPS through CONNECT.
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca.cert_pem().as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let sandbox_tls = Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        let https = |host: &'static str, auth: &'static str| {
            let (egress, sandbox_tls) = (egress.clone(), sandbox_tls.clone());
            async move {
                let (mut ours, theirs) = tokio::io::duplex(1 << 16);
                let served = tokio::spawn(async move { egress.handle(theirs).await });
                ours.write_all(format!("CONNECT {host}:443 HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
                let (head, _) = read_head(&mut ours).await.unwrap();
                assert!(head.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));
                let name = rustls::pki_types::ServerName::try_from(host).unwrap();
                let mut tls = tokio_rustls::TlsConnector::from(sandbox_tls).connect(name, ours).await.unwrap();
                let request =
                    format!("GET /v1 HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n");
                tls.write_all(request.as_bytes()).await.unwrap();
                let mut answer = Vec::new();
                let _ = tls.read_to_end(&mut answer).await;
                served.await.unwrap();
                String::from_utf8_lossy(&answer).into_owned()
            }
        };
        let answer = https("api.space.test", "Bearer space_ph_0123456789abcdef").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(got.lock().unwrap()[0].contains("Bearer sk-the-real-thing"), "the upstream got the value");
        // The body comes chunked (its length changed): join the chunks.
        let body = answer.split_once("\r\n\r\n").unwrap().1;
        let body: String = body.split("\r\n").skip(1).step_by(2).collect();
        assert_eq!(body, "you sent Bearer space_ph_0123456789abcdef", "echoed back as the placeholder");
        assert!(!answer.contains("sk-the-real-thing"));
        let (_, event) = received.recv().await.unwrap();
        assert!(event.inspected && event.decision == "allowed", "{event:?}");
        assert_eq!((event.requests, event.secrets.clone()), (1, vec!["llm".to_string()]));

        // The placeholder to another host over plain HTTP: refused.
        let answer = exchange(
            &egress,
            b"GET http://other.space.test/ HTTP/1.1\r\nHost: other.space.test\r\nX-Key: space_ph_0123456789abcdef\r\n\r\n",
        )
        .await;
        assert!(answer.contains("secret_not_for_host"), "{answer}");
        let (_, event) = received.recv().await.unwrap();
        assert_eq!(event.reason.as_deref(), Some("secret_not_for_host"));
        // Inside the inspected tunnel, a request for another host: refused.
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        let served = tokio::spawn({
            let egress = egress.clone();
            async move { egress.handle(theirs).await }
        });
        ours.write_all(b"CONNECT api.space.test:443 HTTP/1.1\r\n\r\n").await.unwrap();
        read_head(&mut ours).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.space.test").unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(sandbox_tls.clone()).connect(name, ours).await.unwrap();
        tls.write_all(b"GET / HTTP/1.1\r\nHost: other.space.test\r\nX-Key: space_ph_0123456789abcdef\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let _ = tls.read_to_end(&mut answer).await;
        served.await.unwrap();
        assert!(String::from_utf8_lossy(&answer).contains("wrong_host"));
        let (_, event) = received.recv().await.unwrap();
        assert_eq!((event.decision.as_str(), event.reason.as_deref()), ("denied", Some("wrong_host")));
        assert_eq!(got.lock().unwrap().len(), 1, "nothing refused reached the upstream");
    }

    #[tokio::test]
    async fn new_connections_per_second_and_bytes_per_second_are_capped_per_sandbox() {
        // One new connection per second: of ten at once, the first goes
        // through and the rest are told why.
        let (port, _seen) = {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(async move {
                while let Ok((mut socket, _)) = listener.accept().await {
                    tokio::spawn(async move {
                        // Sends 3 MiB, then closes.
                        let chunk = vec![b'x'; 1 << 20];
                        for _ in 0..3 {
                            if socket.write_all(&chunk).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            });
            (port, ())
        };
        let resolver =
            Arc::new(StaticResolver::new([("allowed.space.test".to_string(), vec!["127.0.0.1".parse().unwrap()])]));
        let mut config = GatewayConfig::new(resolver);
        config.allow_internal = vec![("127.0.0.1".parse().unwrap(), 32)];
        config.new_per_second = 1;
        let (events, _received) = mpsc::channel(64);
        let policy = Policy::new(Mode::Allowlist, &[format!("allowed.space.test:{port}")], &[]).unwrap();
        let egress = SandboxEgress::new("sbx_t".into(), policy.clone(), events.clone(), config.clone());
        let mut refused = 0;
        for _ in 0..10 {
            let answer = exchange(&egress, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
            if answer.contains("rate_limit") {
                assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
                refused += 1;
            }
        }
        assert!(refused >= 1, "ten new connections at once, one allowed per second");

        // 1 MiB/s each way: 3 MiB down take at least two seconds (a lower
        // bound, which a loaded machine only makes longer).
        config.new_per_second = NEW_PER_SECOND;
        config.bytes_per_second = 1 << 20;
        let egress = SandboxEgress::new("sbx_t".into(), policy, events, config);
        let started = Instant::now();
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        let served = tokio::spawn(async move { egress.handle(theirs).await });
        ours.write_all(format!("CONNECT allowed.space.test:{port} HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
        let mut received = Vec::new();
        let _ = ours.read_to_end(&mut received).await;
        drop(ours);
        served.await.unwrap();
        let body = received.len() - b"HTTP/1.1 200 Connection established\r\n\r\n".len();
        assert_eq!(body, 3 << 20);
        assert!(started.elapsed() >= Duration::from_millis(1900), "took {:?}", started.elapsed());
    }
}
