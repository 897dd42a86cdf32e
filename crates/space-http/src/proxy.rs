//! A proxy's rules and splice: which headers of a request go on to a
//! server it is relayed to (a sandbox's port, or a cluster's node), and
//! how that server's answer, or the upgrade it accepts, comes back.

use axum::body::Body;
use axum::extract::ws::{Message, WebSocket};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::HttpError;

/// Headers that belong to one hop, never passed on (an upgrade's own are
/// put back when there is one).
pub const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Headers that carry a caller's credentials or SPACE's word about the
/// caller, never passed into a sandbox: the API key (`Authorization`; E2B's
/// `X-API-KEY`), E2B's envd and traffic tokens (`X-Access-Token`, and every
/// `E2B-*` header: they name E2B's routing and tokens, nothing of the app's),
/// and what a control plane asserts to a node (`X-Space-*`).
const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "proxy-authorization", "x-api-key", "x-access-token"];
const CREDENTIAL_PREFIXES: [&str; 2] = ["e2b-", "x-space-"];
/// Shorter strings would be found in innocent headers. Tenant keys have 70
/// characters; the operator's key is whatever its file holds.
const SHORTEST_CREDENTIAL: usize = 8;

/// The headers of a request to a port as the server in the sandbox gets
/// them (its `Host`, and an upgrade's `Connection`/`Upgrade`, are set by
/// the caller of this). Refuses a request a proxy could frame two ways:
/// more than one `Host`, or both `Content-Length` and `Transfer-Encoding`
/// (RFC 9112 §3.2, §6.3). Drops hop-by-hop headers (those `Connection`
/// names too), the credential headers above, the `bearer.*` WebSocket
/// subprotocol (the others go through, in order), and any header, cookie or
/// subprotocol that holds a credential the request presents, plain or
/// base64-encoded. The app's own cookies go through: SPACE sets and reads
/// no cookie (the console keeps its key in `sessionStorage` and sends it as
/// a header or the subprotocol), so every cookie is some app's.
pub fn inward_headers(incoming: &HeaderMap) -> Result<HeaderMap, HttpError> {
    if incoming.get_all(header::HOST).iter().count() > 1 {
        return Err(HttpError::bad_request("more than one Host header (RFC 9112 §3.2)"));
    }
    if incoming.contains_key(header::CONTENT_LENGTH) && incoming.contains_key(header::TRANSFER_ENCODING) {
        return Err(HttpError::bad_request("both Content-Length and Transfer-Encoding (RFC 9112 §6.3)"));
    }
    let per_hop: Vec<String> = incoming
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .collect();
    let scrubbed = without_presented_credentials(incoming);
    let mut outgoing = HeaderMap::new();
    for (name, value) in &scrubbed {
        let named = name.as_str();
        let dropped = name == header::HOST
            || HOP_BY_HOP.contains(&named)
            || per_hop.iter().any(|listed| listed == named)
            || CREDENTIAL_HEADERS.contains(&named)
            || CREDENTIAL_PREFIXES.iter().any(|prefix| named.starts_with(prefix))
            || (name == header::CONTENT_LENGTH && outgoing.contains_key(header::CONTENT_LENGTH));
        if !dropped {
            outgoing.append(name.clone(), value.clone());
        }
    }
    Ok(outgoing)
}

/// `incoming` less every header, cookie and WebSocket subprotocol that holds
/// a credential the request presents (plain or base64-encoded, see
/// [`presented_credentials`]), and less the `bearer.*` subprotocol: the
/// port proxy's rule, and the control plane's before a request goes on to
/// a node (which never sees the tenant's key, so could not look for it).
/// The remaining cookies are one `Cookie` line, the remaining subprotocols
/// one line, in their order.
pub fn without_presented_credentials(incoming: &HeaderMap) -> HeaderMap {
    let secrets = presented_credentials(incoming);
    let holds_secret = |text: &[u8]| secrets.iter().any(|s| text.windows(s.len()).any(|w| w == s.as_slice()));
    let mut outgoing = HeaderMap::new();
    for (name, value) in incoming {
        if name == header::COOKIE || name == header::SEC_WEBSOCKET_PROTOCOL || holds_secret(value.as_bytes()) {
            continue;
        }
        outgoing.append(name.clone(), value.clone());
    }
    // One Cookie line (HTTP/1.1 allows no more), less any pair holding a
    // credential.
    let cookies: Vec<&[u8]> = incoming
        .get_all(header::COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b';'))
        .map(|pair| pair.trim_ascii())
        .filter(|pair| !pair.is_empty() && !holds_secret(pair))
        .collect();
    if let Ok(value) = HeaderValue::from_bytes(&cookies.join(&b"; "[..])) {
        if !cookies.is_empty() {
            outgoing.insert(header::COOKIE, value);
        }
    }
    let protocols: Vec<&str> = incoming
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !is_bearer_protocol(p) && !holds_secret(p.as_bytes()))
        .collect();
    if let Ok(value) = HeaderValue::from_str(&protocols.join(", ")) {
        if !protocols.is_empty() {
            outgoing.insert(header::SEC_WEBSOCKET_PROTOCOL, value);
        }
    }
    outgoing
}

fn is_bearer_protocol(protocol: &str) -> bool {
    protocol.get(..7).is_some_and(|p| p.eq_ignore_ascii_case("bearer."))
}

/// Every credential the request presents, in each form it may be written
/// elsewhere in it: plain, and base64 (standard and URL-safe) at each of the
/// three alignments it can have inside a longer encoded text (`Basic`
/// encodes `user:key`).
fn presented_credentials(headers: &HeaderMap) -> Vec<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    use base64::Engine as _;
    let mut plain: Vec<Vec<u8>> = Vec::new();
    for name in [
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "x-access-token",
        "e2b-traffic-access-token",
        "x-space-preview-token",
    ] {
        for value in headers.get_all(name) {
            let value = value.as_bytes().trim_ascii();
            // `Bearer <key>`: the key; a bare token: itself.
            let token = value.splitn(2, |b| *b == b' ').nth(1).unwrap_or(value).trim_ascii();
            plain.push(token.to_vec());
        }
    }
    for protocol in headers.get_all(header::SEC_WEBSOCKET_PROTOCOL).iter().filter_map(|v| v.to_str().ok()) {
        for encoded in protocol.split(',').map(str::trim).filter(|p| is_bearer_protocol(p)).map(|p| &p[7..]) {
            plain.push(encoded.as_bytes().to_vec());
            if let Ok(key) = URL_SAFE_NO_PAD.decode(encoded.trim_end_matches('=')) {
                plain.push(key);
            }
        }
    }
    plain.retain(|s| s.len() >= SHORTEST_CREDENTIAL);
    let mut forms = Vec::new();
    for secret in &plain {
        forms.push(secret.clone());
        for engine in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
            for skip in 0..3usize {
                let mut shifted = vec![0u8; skip];
                shifted.extend_from_slice(secret);
                let encoded = engine.encode(&shifted);
                // The characters that hold bits of the leading zeros, or of
                // whatever follows the secret, are not the secret's own.
                let head = [0, 2, 3][skip];
                let tail = usize::from(shifted.len() % 3 != 0);
                forms.push(encoded.as_bytes()[head..encoded.len() - tail].to_vec());
            }
        }
    }
    forms.sort();
    forms.dedup();
    forms
}

/// Why a request could not be relayed to a server (in a sandbox, or
/// another member of a cluster).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Http(#[from] hyper::Error),
    #[error("it answered with an upgrade nobody asked for")]
    UnaskedUpgrade,
}

/// Sends `outgoing` over `io` (HTTP/1.1) and answers with what comes back,
/// streamed; an upgrade (a WebSocket) is spliced to the client's side.
/// Hop-by-hop headers of the answer are dropped.
pub async fn relay<I>(
    io: I,
    outgoing: hyper::Request<Body>,
    client_side: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, RelayError>
where
    I: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
{
    let mut sender = http1(io).await?;
    let response = sender.send_request(outgoing).await?;
    answer(response, client_side)
}

/// An HTTP/1.1 connection over `io`, driven by a task of its own (which
/// lets it be upgraded).
pub async fn http1<I>(io: I) -> Result<hyper::client::conn::http1::SendRequest<Body>, hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::Builder::new().handshake::<_, Body>(io).await?;
    tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    });
    Ok(sender)
}

/// What [`relay`] answers with `response`.
pub fn answer(
    mut response: hyper::Response<hyper::body::Incoming>,
    client_side: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, RelayError> {
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let (Some(client_side), server_side) = (client_side, hyper::upgrade::on(&mut response)) else {
            return Err(RelayError::UnaskedUpgrade);
        };
        tokio::spawn(async move {
            if let (Ok(client), Ok(server)) = (client_side.await, server_side.await) {
                let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(server)).await;
            }
        });
        let (parts, _) = response.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = response.into_parts();
    for name in HOP_BY_HOP {
        parts.headers.remove(name);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// Pumps a TCP tunnel: binary messages in are bytes to the port, bytes
/// from it go out as binary messages; either side closing ends it.
pub async fn tunnel_tcp(socket: WebSocket, io: tokio::io::DuplexStream) {
    let (mut ws_out, mut ws_in) = socket.split();
    let (mut port_read, mut port_write) = tokio::io::split(io);
    let inward = async {
        while let Some(Ok(message)) = ws_in.next().await {
            match message {
                Message::Binary(bytes) if port_write.write_all(&bytes).await.is_err() => break,
                Message::Close(_) => break,
                _ => {}
            }
        }
        let _ = port_write.shutdown().await;
    };
    let outward = async {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match port_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if ws_out.send(Message::Binary(buf[..n].to_vec().into())).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = ws_out.send(Message::Close(None)).await;
    };
    tokio::join!(inward, outward);
}

#[cfg(test)]
mod tests {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    use base64::Engine as _;

    use super::*;

    const KEY: &str = "space_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(header::HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn inward(pairs: &[(&str, &str)]) -> HeaderMap {
        inward_headers(&headers(pairs)).expect("forwarded")
    }

    /// Everything forwarded, as one text.
    fn text(map: &HeaderMap) -> String {
        map.iter().map(|(n, v)| format!("{n}: {}\n", String::from_utf8_lossy(v.as_bytes()))).collect()
    }

    #[test]
    fn the_bearer_subprotocol_is_dropped_and_the_others_go_through_in_order() {
        let bearer = format!("bearer.{}", URL_SAFE_NO_PAD.encode(KEY));
        let got = inward(&[
            ("upgrade", "websocket"),
            ("sec-websocket-protocol", &format!("chat, {bearer}")),
            ("sec-websocket-protocol", "v2.app"),
        ]);
        assert_eq!(got[header::SEC_WEBSOCKET_PROTOCOL], "chat, v2.app");
        assert_eq!(got.get_all(header::SEC_WEBSOCKET_PROTOCOL).iter().count(), 1);
        let only = inward(&[("sec-websocket-protocol", &bearer)]);
        assert!(!only.contains_key(header::SEC_WEBSOCKET_PROTOCOL), "{}", text(&only));
        let shouted = inward(&[("sec-websocket-protocol", &format!("Bearer.{}, chat", URL_SAFE_NO_PAD.encode("x")))]);
        assert_eq!(shouted[header::SEC_WEBSOCKET_PROTOCOL], "chat");
    }

    #[test]
    fn credential_headers_of_space_and_e2b_are_dropped() {
        let got = inward(&[
            ("authorization", &format!("Bearer {KEY}")),
            ("proxy-authorization", "Basic eDp5"),
            ("x-api-key", KEY),
            ("X-Api-Key", "another"),
            ("x-access-token", "envd-token-of-the-sandbox"),
            ("e2b-traffic-access-token", "traffic-token-of-the-sandbox"),
            ("e2b-sandbox-id", "sbx_x"),
            ("x-space-tenant", "alice"),
            ("x-space-operator", "true"),
            ("accept", "text/html"),
        ]);
        assert_eq!(text(&got), "accept: text/html\n");
    }

    #[test]
    fn what_goes_on_to_a_node_holds_the_key_nowhere() {
        // The control plane's rule: any header, only less the key.
        let basic = STANDARD.encode(format!("me:{KEY}"));
        let got = without_presented_credentials(&headers(&[
            ("authorization", &format!("Bearer {KEY}")),
            ("cookie", &format!("app=1; k={KEY}")),
            ("x-forwarded-auth", &format!("Basic {basic}")),
            ("sec-websocket-protocol", &format!("bearer.{}, chat", URL_SAFE_NO_PAD.encode(KEY))),
            ("accept", "text/html"),
        ]));
        assert_eq!(text(&got), "accept: text/html\ncookie: app=1\nsec-websocket-protocol: chat\n");
    }

    #[test]
    fn the_apps_cookies_go_through_and_a_cookie_holding_the_key_does_not() {
        let got = inward(&[
            ("authorization", &format!("Bearer {KEY}")),
            ("cookie", &format!("_xsrf=2|abc; space={KEY}")),
            ("cookie", &format!("session=s1; k={}", URL_SAFE_NO_PAD.encode(KEY))),
        ]);
        assert_eq!(got[header::COOKIE], "_xsrf=2|abc; session=s1");
        assert_eq!(got.get_all(header::COOKIE).iter().count(), 1);
        let none = inward(&[("x-api-key", KEY), ("cookie", &format!("k={KEY}"))]);
        assert!(!none.contains_key(header::COOKIE), "{}", text(&none));
    }

    #[test]
    fn the_key_in_any_encoding_in_any_header_is_dropped() {
        let basic = STANDARD.encode(format!("user:{KEY}"));
        // The key at each of the three alignments base64 can give it.
        let shifted = STANDARD.encode(format!(":{KEY}!"));
        let bearer = format!("bearer.{}", URL_SAFE_NO_PAD.encode(KEY));
        for (name, value) in [
            ("x-my-auth", format!("Basic {basic}")),
            ("x-other", shifted),
            ("referer", format!("https://app.test/?key={KEY}")),
            ("x-echo", URL_SAFE_NO_PAD.encode(KEY)),
        ] {
            let got = inward(&[("sec-websocket-protocol", &bearer), (name, &value), ("accept", "*/*")]);
            assert_eq!(text(&got), "accept: */*\n", "{name}: {value}");
        }
        // A short or absent credential drops nothing else.
        let got = inward(&[("x-api-key", "a"), ("x-note", "a b c")]);
        assert_eq!(text(&got), "x-note: a b c\n");
    }

    #[test]
    fn framing_is_one_host_one_length_and_no_hop_by_hop_header() {
        let two_hosts = inward_headers(&headers(&[("host", "a.test"), ("host", "b.test")]));
        assert_eq!(two_hosts.unwrap_err().status(), StatusCode::BAD_REQUEST);
        let both = inward_headers(&headers(&[("content-length", "5"), ("transfer-encoding", "chunked")]));
        assert_eq!(both.unwrap_err().status(), StatusCode::BAD_REQUEST);
        let got = inward(&[
            ("host", "api.test"),
            ("content-length", "5"),
            ("content-length", "5"),
            ("connection", "keep-alive, X-Per-Hop"),
            ("x-per-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("trailer", "x-t"),
            ("upgrade", "websocket"),
            ("x-kept", "1"),
        ]);
        assert_eq!(text(&got), "content-length: 5\nx-kept: 1\n");
    }
}
