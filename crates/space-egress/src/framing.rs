//! HTTP/1 request framing as the gateway enforces it, on plain HTTP and
//! inside terminated tunnels alike. Where the gateway and the host behind
//! it could read a request differently (which host it is for, where its
//! body ends) the request is refused, never forwarded for the upstream to
//! guess: more than one `Host` or `Content-Length`, `Content-Length`
//! beside `Transfer-Encoding`, a coding other than `chunked` (RFC 9112
//! §3.2, §6.1, §6.3). Bodies are measured by the same rules, so exactly
//! the bytes of each request reach the upstream, whatever follows them.
//! A refused request is answered here too, the same way on both paths.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::policy::Reason;

/// The longest request head read.
pub const MAX_HEAD: usize = 32 * 1024;
/// Header lines of one request head, at most (hyper's server default).
pub const MAX_HEADERS: usize = 100;
/// Bytes of chunk extensions in one chunk-size line, and of trailers.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 8192;

/// How a request's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyLength {
    None,
    Bytes(u64),
    Chunked,
}

/// Judges a parsed request head. In a tunnel (`tunnel` is its host), the
/// one `Host` must name that host, and so must an absolute-form target;
/// a forwarded plain-HTTP request may carry one `Host` at most (the
/// gateway writes its own, from the target). Returns how its body ends.
pub fn check_head(request: &httparse::Request<'_, '_>, tunnel: Option<&str>) -> Result<BodyLength, Reason> {
    let http_10 = request.version == Some(0);
    let lines = |name: &'static str| request.headers.iter().filter(move |h| h.name.eq_ignore_ascii_case(name));
    let mut hosts = lines("host");
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(Reason::Ambiguous);
    }
    if let Some(tunnel) = tunnel {
        let method = request.method.unwrap_or("");
        let target = request.path.unwrap_or("");
        if method.eq_ignore_ascii_case("CONNECT") {
            return Err(Reason::BadRequest);
        }
        match host {
            Some(host) => {
                let value = std::str::from_utf8(host.value).map_err(|_| Reason::WrongHost)?;
                if !names(value.trim_matches([' ', '\t']), tunnel) {
                    return Err(Reason::WrongHost);
                }
            }
            // HTTP/1.1 requires it (RFC 9112 §3.2); 1.0 gets the tunnel's.
            None if !http_10 => return Err(Reason::Ambiguous),
            None => {}
        }
        // Absolute form only when the target is not a path: a query may hold
        // a URL of its own (`/cb?redirect_uri=https://…`).
        if let Some((scheme, rest)) = target.split_once("://").filter(|_| !target.starts_with('/')) {
            let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
            if !scheme.eq_ignore_ascii_case("https") || authority.contains('@') || !names(authority, tunnel) {
                return Err(Reason::WrongHost);
            }
        } else if !(target.starts_with('/') || target == "*" && method.eq_ignore_ascii_case("OPTIONS")) {
            return Err(Reason::BadRequest);
        }
    }
    let mut codings = lines("transfer-encoding");
    let coding = codings.next();
    let mut lengths = lines("content-length");
    let length = lengths.next();
    if codings.next().is_some() || lengths.next().is_some() {
        return Err(Reason::Ambiguous);
    }
    match (coding, length) {
        (Some(_), Some(_)) => Err(Reason::Ambiguous),
        (Some(coding), None) => {
            let chunked = coding.value.trim_ascii().eq_ignore_ascii_case(b"chunked");
            if http_10 || !chunked {
                return Err(Reason::Ambiguous);
            }
            Ok(BodyLength::Chunked)
        }
        (None, Some(length)) => {
            let digits = length.value.trim_ascii();
            if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
                return Err(Reason::Ambiguous);
            }
            let n: u64 = std::str::from_utf8(digits).ok().and_then(|d| d.parse().ok()).ok_or(Reason::Ambiguous)?;
            Ok(if n == 0 { BodyLength::None } else { BodyLength::Bytes(n) })
        }
        (None, None) => Ok(BodyLength::None),
    }
}

/// Whether `authority` (`name`, `name:443`, with or without a trailing
/// dot) names `host` on the port inspected tunnels serve.
fn names(authority: &str, host: &str) -> bool {
    let name = match authority.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => {
            if port.parse::<u16>().ok() != Some(crate::policy::SECRET_PORT) {
                return false;
            }
            name
        }
        _ => authority,
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty() && name.eq_ignore_ascii_case(host)
}

/// Parses a request head at the start of `bytes`: `Ok(None)` while it is
/// incomplete, else its length and how its body ends.
pub fn parse_head(bytes: &[u8], tunnel: Option<&str>) -> Result<Option<(usize, BodyLength)>, Reason> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => Ok(Some((n, check_head(&request, tunnel)?))),
        Ok(httparse::Status::Partial) if bytes.len() <= MAX_HEAD => Ok(None),
        _ => Err(Reason::BadRequest),
    }
}

/// Measures one request body as it streams by.
#[derive(Debug)]
pub struct Framer {
    state: State,
    /// Bytes of the current chunk-size line's extensions, or of trailers.
    line: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    /// A chunk-size line: its first digit.
    Start,
    Size(u64, u8),
    SizeSpace(u64),
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// After the last chunk: a trailer line, or the end.
    TrailerStart,
    Trailer,
    TrailerLf,
    EndLf,
    Done,
}

impl Framer {
    pub fn new(body: BodyLength) -> Framer {
        let state = match body {
            BodyLength::None => State::Done,
            BodyLength::Bytes(n) => State::Length(n),
            BodyLength::Chunked => State::Start,
        };
        Framer { state, line: 0 }
    }

    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// How many bytes at the start of `bytes` belong to the body (all of
    /// them unless it ends inside); an error for a malformed chunk.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<usize, Reason> {
        let mut at = 0;
        while at < bytes.len() && !self.done() {
            if let State::Length(rest) | State::Data(rest) = self.state {
                let take = usize::try_from(rest).unwrap_or(usize::MAX).min(bytes.len() - at);
                at += take;
                let left = rest - take as u64;
                self.state = match (self.state, left) {
                    (State::Length(_), 0) => State::Done,
                    (State::Length(_), _) => State::Length(left),
                    (_, 0) => State::DataCr,
                    _ => State::Data(left),
                };
                continue;
            }
            self.state = self.step(bytes[at])?;
            at += 1;
        }
        Ok(at)
    }

    /// One byte of chunked framing (RFC 9112 §7.1; hyper's decoder reads
    /// the same, and accepts more: what it would read otherwise is refused).
    fn step(&mut self, byte: u8) -> Result<State, Reason> {
        let hex = (byte as char).to_digit(16).map(u64::from);
        let next = match (self.state, byte, hex) {
            (State::Start, _, Some(d)) => State::Size(d, 1),
            (State::Size(size, n), _, Some(d)) if n < 16 => State::Size(size * 16 + d, n + 1),
            (State::Size(size, _) | State::SizeSpace(size), b' ' | b'\t', _) => State::SizeSpace(size),
            (State::Size(size, _) | State::SizeSpace(size), b';', _) => {
                self.line = 0;
                State::Extension(size)
            }
            (State::Size(size, _) | State::SizeSpace(size) | State::Extension(size), b'\r', _) => State::SizeLf(size),
            // Extensions are tokens: no quoted strings, whose CR or LF
            // another parser might read as the line's end.
            (State::Extension(size), b' ' | b'\t' | 0x21..=0x7e, _) if byte != b'"' && self.line < MAX_CHUNK_LINE => {
                self.line += 1;
                State::Extension(size)
            }
            (State::SizeLf(0), b'\n', _) => {
                self.line = 0;
                State::TrailerStart
            }
            (State::SizeLf(size), b'\n', _) => State::Data(size),
            (State::DataCr, b'\r', _) => State::DataLf,
            (State::DataLf, b'\n', _) => State::Start,
            (State::TrailerStart, b'\r', _) => State::EndLf,
            (State::Trailer, b'\r', _) => State::TrailerLf,
            (State::TrailerStart | State::Trailer, _, _) if byte != b'\n' && self.line < MAX_TRAILERS => {
                self.line += 1;
                State::Trailer
            }
            (State::TrailerLf, b'\n', _) => State::TrailerStart,
            (State::EndLf, b'\n', _) => State::Done,
            _ => return Err(Reason::Ambiguous),
        };
        Ok(next)
    }
}

/// The sandbox's side of a terminated tunnel, as the HTTP server reads it:
/// each request head is held back until it is whole and judged, and its
/// body measured, so the server sees only requests that passed. A refused
/// one ends the stream there (the server sees its end), and `refused`
/// says why, for the gateway to answer once the server is done.
pub struct Guarded<S> {
    inner: S,
    host: String,
    /// Read, not yet judged.
    pending: Vec<u8>,
    /// Judged, for the server (from `ready_at`).
    ready: Vec<u8>,
    ready_at: usize,
    /// The body being read; `None` between requests.
    body: Option<Framer>,
    refused: Option<Reason>,
}

impl<S> Guarded<S> {
    pub fn new(inner: S, host: &str) -> Guarded<S> {
        Guarded {
            inner,
            host: host.to_string(),
            pending: Vec::new(),
            ready: Vec::new(),
            ready_at: 0,
            body: None,
            refused: None,
        }
    }

    /// Why a request was refused, if one was.
    pub fn refused(&self) -> Option<Reason> {
        self.refused
    }

    pub fn inner_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Moves what can be judged from `pending` to `ready`; whether
    /// anything moved (or the stream was refused).
    fn judge(&mut self) -> bool {
        let verdict = match &mut self.body {
            Some(framer) => {
                let fed = framer.feed(&self.pending);
                if framer.done() {
                    self.body = None;
                }
                fed.map(Some)
            }
            None => parse_head(&self.pending, Some(&self.host)).map(|head| {
                head.map(|(n, length)| {
                    let framer = Framer::new(length);
                    self.body = (!framer.done()).then_some(framer);
                    n
                })
            }),
        };
        match verdict {
            Ok(Some(n)) => {
                if self.ready_at == self.ready.len() {
                    self.ready.clear();
                    self.ready_at = 0;
                }
                self.ready.extend(self.pending.drain(..n));
                true
            }
            Ok(None) => false,
            Err(reason) => {
                self.refused = Some(reason);
                true
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ready_at < this.ready.len() {
                let n = (this.ready.len() - this.ready_at).min(buf.remaining());
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                return Poll::Ready(Ok(()));
            }
            if this.refused.is_some() {
                return Poll::Ready(Ok(()));
            }
            if !this.pending.is_empty() && this.judge() {
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                // The sandbox is done; an unfinished request is dropped.
                return Poll::Ready(Ok(()));
            }
            this.pending.extend_from_slice(read.filled());
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    /// Kept open after a refusal: the gateway still has to say why.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.refused.is_some() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Answers a refused request in the gateway's own words (the reason in
/// `X-Space-Egress` and the body) and closes the connection: what a
/// plain request and a request in a terminated tunnel are both told.
pub(crate) async fn refuse<S: AsyncWrite + Unpin>(client: &mut S, status: u16, reason: Reason) {
    let phrase = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        429 => "Too Many Requests",
        _ => "Bad Gateway",
    };
    let body = format!("space egress: {} ({})\n", reason.explain(), reason.as_str());
    let head = format!(
        "HTTP/1.1 {status} {phrase}\r\nX-Space-Egress: {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason.as_str(),
        body.len()
    );
    let _ = client.write_all(head.as_bytes()).await;
    let _ = client.write_all(body.as_bytes()).await;
    let _ = client.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str, tunnel: Option<&str>) -> Result<BodyLength, Reason> {
        parse_head(text.as_bytes(), tunnel).map(|h| h.expect("a whole head").1)
    }

    #[test]
    fn hosts_must_be_one_and_the_tunnels() {
        let tunnel = Some("api.space.test");
        assert_eq!(head("GET / HTTP/1.1\r\nHost: api.space.test\r\n\r\n", tunnel), Ok(BodyLength::None));
        assert_eq!(head("GET / HTTP/1.1\r\nHost: API.space.test.:443\r\n\r\n", tunnel), Ok(BodyLength::None));
        let two = "GET / HTTP/1.1\r\nHost: api.space.test\r\nhost: open.space.test\r\n\r\n";
        assert_eq!(head(two, tunnel), Err(Reason::Ambiguous));
        assert_eq!(head(two, None), Err(Reason::Ambiguous), "on plain HTTP too");
        assert_eq!(head("GET / HTTP/1.1\r\n\r\n", tunnel), Err(Reason::Ambiguous), "HTTP/1.1 needs one");
        assert_eq!(head("GET / HTTP/1.0\r\n\r\n", tunnel), Ok(BodyLength::None));
        for wrong in ["open.space.test", "api.space.test:8443", "api.space.test.evil.test", ""] {
            let text = format!("GET / HTTP/1.1\r\nHost: {wrong}\r\n\r\n");
            assert_eq!(head(&text, tunnel), Err(Reason::WrongHost), "{wrong}");
        }
        let absolute = "GET https://api.space.test/x HTTP/1.1\r\nHost: api.space.test\r\n\r\n";
        assert_eq!(head(absolute, tunnel), Ok(BodyLength::None));
        for target in ["https://open.space.test/", "http://api.space.test/", "https://u@api.space.test/"] {
            let text = format!("GET {target} HTTP/1.1\r\nHost: api.space.test\r\n\r\n");
            assert_eq!(head(&text, tunnel), Err(Reason::WrongHost), "{target}");
        }
        let connect = "CONNECT open.space.test:443 HTTP/1.1\r\nHost: api.space.test\r\n\r\n";
        assert_eq!(head(connect, tunnel), Err(Reason::BadRequest));
        // A URL in the query of a path is no absolute form (OAuth callbacks).
        let callback = "GET /cb?redirect_uri=https://open.space.test/x HTTP/1.1\r\nHost: api.space.test\r\n\r\n";
        assert_eq!(head(callback, tunnel), Ok(BodyLength::None));
    }

    #[test]
    fn a_body_has_one_length() {
        let with = |lines: &str| head(&format!("POST / HTTP/1.1\r\nHost: api.space.test\r\n{lines}\r\n"), None);
        assert_eq!(with("Content-Length: 5\r\n"), Ok(BodyLength::Bytes(5)));
        assert_eq!(with("Transfer-Encoding: Chunked\r\n"), Ok(BodyLength::Chunked));
        assert_eq!(with(""), Ok(BodyLength::None));
        for bad in [
            "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
            "Content-Length: 5\r\nContent-Length: 5\r\n",
            "Content-Length: 5\r\nContent-Length: 6\r\n",
            "Content-Length: 5, 5\r\n",
            "Content-Length: +5\r\n",
            "Content-Length: \r\n",
            "Transfer-Encoding: gzip, chunked\r\n",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: identity\r\n",
        ] {
            assert_eq!(with(bad), Err(Reason::Ambiguous), "{bad:?}");
        }
        let old = "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(head(old, None), Err(Reason::Ambiguous), "no chunked in HTTP/1.0");
    }

    #[test]
    fn chunked_bodies_end_where_they_say_byte_by_byte() {
        let body = b"5;name=v\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\nGET /next HTTP/1.1\r\n";
        let end = body.len() - b"GET /next HTTP/1.1\r\n".len();
        let mut framer = Framer::new(BodyLength::Chunked);
        assert_eq!(framer.feed(body), Ok(end));
        assert!(framer.done());
        // The same, one byte at a time.
        let mut framer = Framer::new(BodyLength::Chunked);
        let mut taken = 0;
        for byte in body.chunks(1) {
            taken += framer.feed(byte).unwrap();
        }
        assert_eq!(taken, end);
        let mut framer = Framer::new(BodyLength::Bytes(3));
        assert_eq!(framer.feed(b"abcdef"), Ok(3));
        assert!(framer.done());
        for bad in [
            &b"x\r\n"[..],
            b"5\nhello\r\n",
            b"5\r\nhelloX",
            b"1;a=\"\r\n\"\r\n",
            b"0\r\nX: 1\n\r\n",
            b"11111111111111111\r\n",
        ] {
            let mut framer = Framer::new(BodyLength::Chunked);
            assert_eq!(framer.feed(bad), Err(Reason::Ambiguous), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[tokio::test]
    async fn a_guarded_stream_passes_good_requests_and_stops_at_a_bad_one() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut ours, theirs) = tokio::io::duplex(1 << 16);
        let good = "POST / HTTP/1.1\r\nHost: api.space.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        // Its body holds what looks like a bad head: it is body, not a head.
        let inner = "GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n";
        let second =
            format!("POST / HTTP/1.1\r\nHost: api.space.test\r\nContent-Length: {}\r\n\r\n{inner}", inner.len());
        let bad = "GET / HTTP/1.1\r\nHost: api.space.test\r\nHost: open.space.test\r\n\r\n";
        ours.write_all(format!("{good}{second}{bad}GET /after HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
        drop(ours);
        let mut guarded = Guarded::new(theirs, "api.space.test");
        let mut passed = String::new();
        guarded.read_to_string(&mut passed).await.unwrap();
        assert_eq!(passed, format!("{good}{second}"));
        assert_eq!(guarded.refused(), Some(Reason::Ambiguous));
    }
}
