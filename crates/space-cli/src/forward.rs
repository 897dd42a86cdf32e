//! `space port-forward SBX LOCAL:REMOTE`: connections to a local port are
//! carried to a port inside the sandbox over the API's TCP tunnel (a
//! WebSocket with the `space-tcp` subprotocol), one tunnel per connection.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd};

use anyhow::{bail, Context, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tungstenite::client::IntoClientRequest;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::Message;

use crate::client::Client;

/// `LOCAL:REMOTE` (or `PORT` for both).
pub fn parse_ports(spec: &str) -> Result<(u16, u16)> {
    let (local, remote) = spec.split_once(':').unwrap_or((spec, spec));
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p > 0);
    match (local.parse::<u16>().ok(), port(remote)) {
        (Some(local), Some(remote)) => Ok((local, remote)),
        _ => bail!("give LOCAL:REMOTE ports (LOCAL 0: any free port), e.g. 8080:3000"),
    }
}

/// Listens on 127.0.0.1:`local` until interrupted.
pub fn run(client: &Client, sandbox: &str, local: u16, remote: u16) -> Result<()> {
    let listener =
        TcpListener::bind(("127.0.0.1", local)).with_context(|| format!("listening on 127.0.0.1:{local}"))?;
    let bound = listener.local_addr()?;
    // Fail now, not at the first connection, if the sandbox cannot be reached.
    let sandbox_info = client.get(&format!("/v1/sandboxes/{sandbox}"))?;
    eprintln!(
        "forwarding {bound} -> {sandbox}:{remote} ({}); Ctrl-C to stop",
        sandbox_info["state"].as_str().unwrap_or("unknown")
    );
    println!("{bound}");
    let _ = std::io::stdout().flush();
    for connection in listener.incoming() {
        let Ok(connection) = connection else { continue };
        let (url, key, path) =
            (client.base().to_string(), client.key().to_string(), format!("/v1/sandboxes/{sandbox}/ports/{remote}"));
        std::thread::spawn(move || {
            if let Err(err) = carry(&url, &key, &path, connection) {
                eprintln!("port-forward: {err:#}");
            }
        });
    }
    Ok(())
}

fn carry(base: &str, key: &str, path: &str, mut local: TcpStream) -> Result<()> {
    let url = format!("{}{path}", base.replacen("http", "ws", 1));
    let mut request = url.as_str().into_client_request().context("the tunnel URL")?;
    request.headers_mut().insert("Authorization", format!("Bearer {key}").parse()?);
    request.headers_mut().insert("Sec-WebSocket-Protocol", "space-tcp".parse()?);
    let (mut socket, _) = tungstenite::connect(request).map_err(|err| match err {
        tungstenite::Error::Http(response) => {
            let body = response.body().as_deref().map(String::from_utf8_lossy).unwrap_or_default().into_owned();
            anyhow::anyhow!("the tunnel was refused: HTTP {} {body}", response.status())
        }
        other => anyhow::anyhow!("opening the tunnel: {other}"),
    })?;
    let MaybeTlsStream::Plain(tcp) = socket.get_mut() else { bail!("unexpected TLS stream") };
    tcp.set_nonblocking(true)?;
    let net_fd = tcp.as_raw_fd();
    local.set_nonblocking(true)?;
    let mut local_open = true;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let _ = socket.flush();
        // SAFETY: both fds stay open for the duration of this poll.
        let (local_fd, net) = unsafe { (BorrowedFd::borrow_raw(local.as_raw_fd()), BorrowedFd::borrow_raw(net_fd)) };
        let mut fds = vec![PollFd::new(net, PollFlags::POLLIN)];
        if local_open {
            fds.push(PollFd::new(local_fd, PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::from(1000u16)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(err) => return Err(err).context("waiting for bytes"),
        }
        if local_open {
            loop {
                match local.read(&mut buf) {
                    Ok(0) => {
                        local_open = false;
                        break;
                    }
                    Ok(n) => socket.send(Message::Binary(buf[..n].to_vec().into()))?,
                    Err(err) if err.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        local_open = false;
                        break;
                    }
                }
            }
            if !local_open {
                let _ = socket.send(Message::Close(None));
            }
        }
        loop {
            match socket.read() {
                Ok(Message::Binary(bytes)) => write_all(&mut local, &bytes)?,
                Ok(Message::Close(_)) => {
                    let _ = local.shutdown(std::net::Shutdown::Write);
                    return Ok(());
                }
                Ok(_) => {}
                Err(tungstenite::Error::Io(err)) if err.kind() == ErrorKind::WouldBlock => break,
                Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => return Ok(()),
                Err(err) => return Err(err.into()),
            }
        }
    }
}

/// Writes all of `bytes` to a non-blocking socket.
fn write_all(local: &mut TcpStream, mut bytes: &[u8]) -> Result<()> {
    while !bytes.is_empty() {
        match local.write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(err) if err.kind() == ErrorKind::WouldBlock => {
                // SAFETY: the fd stays open for the duration of this poll.
                let fd = unsafe { BorrowedFd::borrow_raw(local.as_raw_fd()) };
                let _ = poll(&mut [PollFd::new(fd, PollFlags::POLLOUT)], PollTimeout::from(1000u16));
            }
            Err(err) => return Err(err).context("writing to the local connection"),
        }
    }
    Ok(())
}
