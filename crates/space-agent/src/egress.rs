//! The egress relay: the sandbox has no network device, so programs reach
//! the outside through the proxy at `127.0.0.1:3128` (every command gets
//! the proxy variables pointing there). Each connection to it is pumped,
//! byte for byte, to a connection to the host's egress socket, where the
//! gateway decides everything; the relay never parses what it carries.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

/// Where programs in the sandbox find the proxy.
pub const PROXY_ADDR: &str = "127.0.0.1:3128";
/// Connections relayed at once; more are closed at once (the gateway has
/// its own, lower, limit per sandbox).
const MAX_RELAYED: usize = 256;

/// What every command's environment gets so that curl, pip, npm, git, apt
/// and Python's urllib use the proxy (a command's own env wins).
pub fn proxy_env() -> [(&'static str, &'static str); 9] {
    const URL: &str = "http://127.0.0.1:3128";
    const NO_PROXY: &str = "localhost,127.0.0.1,::1";
    [
        ("HTTP_PROXY", URL),
        ("HTTPS_PROXY", URL),
        ("ALL_PROXY", URL),
        ("http_proxy", URL),
        ("https_proxy", URL),
        ("all_proxy", URL),
        ("NO_PROXY", NO_PROXY),
        ("no_proxy", NO_PROXY),
        ("NODE_USE_ENV_PROXY", "1"),
    ]
}

/// The relay's open connections, so a quiesce can cut them: a snapshot
/// must not hold host sockets.
#[derive(Default, Clone)]
pub struct Relay {
    open: Arc<Mutex<Vec<Arc<UnixStream>>>>,
    count: Arc<AtomicUsize>,
}

impl Relay {
    /// Listens on [`PROXY_ADDR`] and relays to `host_socket` in the
    /// background. A sandbox whose loopback port is taken runs without it.
    pub fn start(host_socket: String) -> Relay {
        let relay = Relay::default();
        let listener = match TcpListener::bind(PROXY_ADDR) {
            Ok(listener) => listener,
            Err(err) => {
                eprintln!("space-agent: egress relay not started ({PROXY_ADDR}: {err})");
                return relay;
            }
        };
        let this = relay.clone();
        let spawned = thread::Builder::new().name("egress".into()).spawn(move || {
            for client in listener.incoming().flatten() {
                this.accept(client, &host_socket);
            }
        });
        if let Err(err) = spawned {
            eprintln!("space-agent: egress relay not started: {err}");
        }
        relay
    }

    fn accept(&self, client: TcpStream, host_socket: &str) {
        if self.count.load(Ordering::Relaxed) >= MAX_RELAYED {
            return;
        }
        let Ok(host) = UnixStream::connect(host_socket) else {
            return; // The host is not listening (a server restart): the client sees a closed connection.
        };
        let host = Arc::new(host);
        self.open.lock().unwrap_or_else(|e| e.into_inner()).push(host.clone());
        self.count.fetch_add(1, Ordering::Relaxed);
        let this = self.clone();
        let _ = thread::Builder::new().name("egress-conn".into()).spawn(move || {
            let _ = pump(client, &host);
            this.open.lock().unwrap_or_else(|e| e.into_inner()).retain(|s| !Arc::ptr_eq(s, &host));
            this.count.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Cuts every relayed connection (before a snapshot).
    pub fn cut_all(&self) {
        for host in self.open.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = host.shutdown(Shutdown::Both);
        }
    }
}

/// Copies both ways until both are done.
fn pump(client: TcpStream, host: &UnixStream) -> io::Result<()> {
    let mut client_read = client.try_clone()?;
    let mut host_write = host.try_clone()?;
    let upward = thread::Builder::new().name("egress-up".into()).spawn(move || {
        let _ = io::copy(&mut client_read, &mut host_write);
        let _ = host_write.shutdown(Shutdown::Write);
    })?;
    let mut host_read = host.try_clone()?;
    let mut client_write = client;
    let _ = io::copy(&mut host_read, &mut client_write);
    let _ = client_write.shutdown(Shutdown::Both);
    let _ = upward.join();
    Ok(())
}
