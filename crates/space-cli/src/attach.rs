//! `space exec -i/-t`: an interactive session over the attach WebSocket,
//! like `docker exec -it`: the local terminal in raw mode, its size sent on
//! start and on every SIGWINCH, and the command's exit code returned.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::termios::{self, SetArg, Termios};
use tungstenite::client::IntoClientRequest;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::Message;

use crate::client::Client;

static WINDOW_CHANGED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_winch(_: libc::c_int) {
    WINDOW_CHANGED.store(true, Ordering::Relaxed);
}

/// Puts the terminal back as it was when dropped.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    fn enter() -> Result<Option<RawMode>> {
        let stdin = std::io::stdin();
        if !nix::unistd::isatty(stdin.as_raw_fd()).unwrap_or(false) {
            return Ok(None);
        }
        let saved = termios::tcgetattr(stdin.as_fd()).context("reading the terminal's mode")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).context("entering raw mode")?;
        Ok(Some(RawMode { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

/// The local terminal's size, if stdout is one.
fn window_size() -> Option<(u16, u16)> {
    let mut size = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes one winsize into the valid, initialised
    // struct we pass; the fd is our stdout.
    let ok = unsafe { libc::ioctl(std::io::stdout().as_raw_fd(), libc::TIOCGWINSZ, &mut size) } == 0;
    // The server refuses a size of 0.
    (ok && size.ws_col > 0 && size.ws_row > 0).then_some((size.ws_col, size.ws_row))
}

fn resize_message((cols, rows): (u16, u16)) -> Message {
    Message::Text(serde_json::json!({"resize": {"cols": cols, "rows": rows}}).to_string().into())
}

/// The shell's convention for a process result: its code, or 128 + signal.
fn exit_code(result: &serde_json::Value) -> i32 {
    match (result["exit_code"].as_i64(), result["signal"].as_str()) {
        (Some(code), _) => code as i32,
        (None, Some(signal)) => 128 + crate::cmd::signal_number(signal),
        (None, None) => 255,
    }
}

/// Runs the session until the command exits; returns its exit code.
/// When our stdin ends, the command's is closed with an `{"eof": true}`
/// frame on the same socket.
/// If the socket ends without the exit frame, the result is fetched from
/// `command_path` instead: the caller never has to guess how it ended.
pub fn interactive(client: &Client, attach_path: &str, command_path: &str, tty: bool) -> Result<i32> {
    let url = format!("{}{attach_path}", client.base().replacen("http", "ws", 1));
    let mut request = url.as_str().into_client_request().context("the attach URL")?;
    request.headers_mut().insert("Authorization", format!("Bearer {}", client.key()).parse()?);
    let (mut socket, _) = tungstenite::connect(request).context("attaching over WebSocket")?;
    let MaybeTlsStream::Plain(tcp) = socket.get_mut() else { bail!("unexpected TLS stream") };
    tcp.set_nonblocking(true)?;
    let tcp_fd = tcp.as_raw_fd();

    let _raw = if tty { RawMode::enter()? } else { None };
    if tty {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            let action = nix::sys::signal::SigAction::new(
                nix::sys::signal::SigHandler::Handler(on_winch),
                nix::sys::signal::SaFlags::SA_RESTART,
                nix::sys::signal::SigSet::empty(),
            );
            let _ = nix::sys::signal::sigaction(nix::sys::signal::Signal::SIGWINCH, &action);
        }
        if let Some(size) = window_size() {
            let _ = socket.send(resize_message(size));
        }
    }

    let mut stdin = std::io::stdin();
    let mut stdin_open = true;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        if WINDOW_CHANGED.swap(false, Ordering::Relaxed) {
            if let Some(size) = window_size() {
                let _ = socket.send(resize_message(size));
            }
        }
        let _ = socket.flush();
        // SAFETY: both fds stay open for the duration of this poll.
        let (stdin_fd, net_fd) = unsafe { (BorrowedFd::borrow_raw(stdin.as_raw_fd()), BorrowedFd::borrow_raw(tcp_fd)) };
        let mut fds = vec![PollFd::new(net_fd, PollFlags::POLLIN)];
        if stdin_open {
            fds.push(PollFd::new(stdin_fd, PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::from(100u16)) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(err) => return Err(err).context("waiting for input"),
        }
        let stdin_ready = stdin_open && fds.get(1).and_then(|f| f.revents()).is_some_and(|r| !r.is_empty());
        if stdin_ready {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    stdin_open = false;
                    // On the same socket, so it arrives after every byte before it.
                    let _ = socket.send(Message::Text(r#"{"eof": true}"#.into()));
                }
                Ok(n) => {
                    let _ = socket.send(Message::Binary(buf[..n].to_vec().into()));
                }
            }
        }
        loop {
            match socket.read() {
                Ok(Message::Binary(bytes)) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&bytes)?;
                    out.flush()?;
                }
                Ok(Message::Text(text)) => {
                    let end: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    if !end["exit"].is_null() {
                        return Ok(exit_code(&end["exit"]));
                    }
                    // A frame of ours the server refused; the session goes on.
                    if let Some(message) = end["error"]["message"].as_str() {
                        eprint!("space: {message}{}", if tty { "\r\n" } else { "\n" });
                    }
                }
                Ok(_) => {}
                Err(tungstenite::Error::Io(err)) if err.kind() == ErrorKind::WouldBlock => break,
                // Closed (or broken) before we read the exit frame: ask.
                Err(_) => {
                    let command = client.get(&format!("{command_path}?wait=60"))?;
                    return Ok(exit_code(&command["result"]));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(0));
    }
}
