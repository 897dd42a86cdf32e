//! The egress relay: the sandbox has no network device, so programs reach
//! the outside through the proxy at `127.0.0.1:3128` (every command gets
//! the proxy variables pointing there). Each connection to it becomes a
//! stream on the agent's own channel to the host, where the gateway
//! decides everything; the relay never parses what it carries. No host
//! socket is involved, so nothing a program holds can stand in the way of a
//! snapshot, and a quiesce simply cuts the relayed connections.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;

use space_proto::{Frame, FrameKind, AGENT_STREAM_BIT, EGRESS_WINDOW, MAX_OUTPUT_CHUNK};

/// Where programs in the sandbox find the proxy.
pub const PROXY_ADDR: &str = "127.0.0.1:3128";
/// The sandbox's egress CA, where `update-ca-certificates` keeps it.
pub const CA_FILE: &str = "/usr/local/share/ca-certificates/space-egress-ca.crt";
/// The system's bundle of trusted certificates (the CA is added to it).
pub const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

static TRUSTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the sandbox trust its egress CA (the host terminates TLS with it
/// for hosts a secret is bound to): written to [`CA_FILE`] and appended to
/// [`BUNDLE`] (made if the image has none). Idempotent.
pub fn install_trust(pem: &str) {
    let pem = if pem.ends_with('\n') { pem.to_string() } else { format!("{pem}\n") };
    let write = || -> std::io::Result<()> {
        for path in [CA_FILE, BUNDLE] {
            if let Some(dir) = std::path::Path::new(path).parent() {
                std::fs::create_dir_all(dir)?;
            }
        }
        if std::fs::read_to_string(CA_FILE).ok().as_deref() != Some(pem.as_str()) {
            std::fs::write(CA_FILE, &pem)?;
        }
        let bundle = std::fs::read_to_string(BUNDLE).unwrap_or_default();
        if !bundle.contains(pem.trim_end()) {
            let mut file = std::fs::OpenOptions::new().create(true).append(true).open(BUNDLE)?;
            let separator = if bundle.is_empty() || bundle.ends_with('\n') { "" } else { "\n" };
            std::io::Write::write_all(&mut file, format!("{separator}{pem}").as_bytes())?;
        }
        Ok(())
    };
    match write() {
        Ok(()) => TRUSTED.store(true, std::sync::atomic::Ordering::Relaxed),
        Err(err) => eprintln!("space-agent: installing the egress CA: {err}"),
    }
}

/// What every command's environment gets once the CA is trusted, so that
/// OpenSSL, Python (requests, pip), curl, git and Node read the bundle.
pub fn trust_env() -> Vec<(&'static str, &'static str)> {
    if !TRUSTED.load(std::sync::atomic::Ordering::Relaxed) {
        return Vec::new();
    }
    vec![
        ("SSL_CERT_FILE", BUNDLE),
        ("REQUESTS_CA_BUNDLE", BUNDLE),
        ("CURL_CA_BUNDLE", BUNDLE),
        ("PIP_CERT", BUNDLE),
        ("GIT_SSL_CAINFO", BUNDLE),
        ("NODE_EXTRA_CA_CERTS", CA_FILE),
    ]
}

/// How long a connection to a port in the sandbox may take.
const PORT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
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

/// Bytes this side may still send on a connection.
struct Credit {
    available: Mutex<Option<usize>>,
    changed: Condvar,
}

impl Credit {
    fn new() -> Credit {
        Credit { available: Mutex::new(Some(EGRESS_WINDOW)), changed: Condvar::new() }
    }

    /// Waits until `n` bytes may be sent and takes them; false once closed.
    fn take(&self, n: usize) -> bool {
        let mut available = self.available.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match *available {
                None => return false,
                Some(left) if left >= n => {
                    *available = Some(left - n);
                    return true;
                }
                Some(_) => available = self.changed.wait(available).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    fn give(&self, n: usize) {
        let mut available = self.available.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(left) = available.as_mut() {
            *left = (*left + n).min(EGRESS_WINDOW);
        }
        self.changed.notify_all();
    }

    fn close(&self) {
        *self.available.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.changed.notify_all();
    }
}

/// What the host sent for a connection, for its writer thread.
enum ToClient {
    Data(Vec<u8>),
    Eof,
}

struct Connection {
    to_client: Sender<ToClient>,
    credit: Arc<Credit>,
    socket: TcpStream,
}

/// The relay's connections, by stream.
#[derive(Clone)]
pub struct Relay {
    connections: Arc<Mutex<HashMap<u32, Connection>>>,
    next: Arc<AtomicU32>,
    outbox: SyncSender<Frame>,
}

impl Relay {
    /// Listens on [`PROXY_ADDR`] and relays over the channel `outbox`
    /// writes to. A sandbox whose loopback port is taken runs without it.
    pub fn start(outbox: SyncSender<Frame>) -> Relay {
        let relay = Relay { connections: Arc::default(), next: Arc::new(AtomicU32::new(1)), outbox };
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
                this.accept(client);
            }
        });
        if let Err(err) = spawned {
            eprintln!("space-agent: egress relay not started: {err}");
        }
        relay
    }

    fn accept(&self, client: TcpStream) {
        let stream = AGENT_STREAM_BIT | (self.next.fetch_add(1, Ordering::Relaxed) & !AGENT_STREAM_BIT);
        self.attach(stream, client, Frame::new(stream, FrameKind::EgressOpen, Vec::new()));
    }

    /// The host asks for a connection to `port` on the sandbox's loopback
    /// (a server in the sandbox, reached through the API): connected and
    /// answered `PortOpened`, or refused with the reason.
    pub fn open_port(&self, stream: u32, payload: &[u8]) {
        let port = payload.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]])).unwrap_or(0);
        let this = self.clone();
        let _ = thread::Builder::new().name("port-open".into()).spawn(move || {
            let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            match TcpStream::connect_timeout(&address, PORT_CONNECT_TIMEOUT) {
                Ok(socket) if port > 0 => {
                    this.attach(stream, socket, Frame::new(stream, FrameKind::PortOpened, Vec::new()))
                }
                Ok(_) => {}
                Err(err) => {
                    let reason = format!("nothing answers on port {port} in the sandbox: {err}");
                    let _ = this.outbox.send(Frame::new(stream, FrameKind::EgressClose, reason.into_bytes()));
                }
            }
        });
    }

    /// Relays `client` as `stream`, announced to the host with `opened`.
    fn attach(&self, stream: u32, client: TcpStream, opened: Frame) {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        if connections.len() >= MAX_RELAYED {
            drop(connections);
            let _ = self.outbox.send(Frame::new(stream, FrameKind::EgressClose, b"too many connections".to_vec()));
            return;
        }
        let Ok(socket) = client.try_clone() else { return };
        let (to_client, from_host) = mpsc::channel();
        let credit = Arc::new(Credit::new());
        connections.insert(stream, Connection { to_client, credit: credit.clone(), socket });
        drop(connections);
        if self.outbox.send(opened).is_err() {
            self.forget(stream);
            return;
        }
        let (up, down) = (self.clone(), self.clone());
        let Ok(reader) = client.try_clone() else {
            self.forget(stream);
            return;
        };
        let _ = thread::Builder::new().name("egress-up".into()).spawn(move || up.upward(stream, reader, &credit));
        let _ =
            thread::Builder::new().name("egress-down".into()).spawn(move || down.downward(stream, client, from_host));
    }

    /// The program's bytes to the host, within the credit the host gives.
    fn upward(&self, stream: u32, mut reader: TcpStream, credit: &Credit) {
        let mut buf = vec![0u8; MAX_OUTPUT_CHUNK];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if !credit.take(n)
                || self.outbox.send(Frame::new(stream, FrameKind::EgressData, buf[..n].to_vec())).is_err()
            {
                return;
            }
        }
        let _ = self.outbox.send(Frame::new(stream, FrameKind::EgressEof, Vec::new()));
    }

    /// The host's bytes to the program, acknowledged once written.
    fn downward(&self, stream: u32, mut writer: TcpStream, from_host: Receiver<ToClient>) {
        while let Ok(message) = from_host.recv() {
            match message {
                ToClient::Data(bytes) => {
                    if writer.write_all(&bytes).is_err() {
                        break;
                    }
                    let ack = (bytes.len() as u32).to_le_bytes().to_vec();
                    if self.outbox.send(Frame::new(stream, FrameKind::EgressAck, ack)).is_err() {
                        break;
                    }
                }
                ToClient::Eof => {
                    let _ = writer.shutdown(Shutdown::Write);
                }
            }
        }
        // The host closed the stream (or the program's socket failed).
        let _ = writer.shutdown(Shutdown::Both);
        if self.forget(stream) {
            let _ = self.outbox.send(Frame::new(stream, FrameKind::EgressClose, Vec::new()));
        }
    }

    /// Drops a connection and cuts its socket; true if it was still there.
    fn forget(&self, stream: u32) -> bool {
        let removed = self.connections.lock().unwrap_or_else(|e| e.into_inner()).remove(&stream);
        if let Some(connection) = &removed {
            connection.credit.close();
            let _ = connection.socket.shutdown(Shutdown::Both);
        }
        removed.is_some()
    }

    /// A frame from the host for one of the relay's streams.
    pub fn take_frame(&self, frame: Frame) -> io::Result<()> {
        let connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        let Some(connection) = connections.get(&frame.stream) else {
            return Ok(()); // Already gone here; the host learns from our close.
        };
        match frame.kind {
            FrameKind::EgressData => {
                let _ = connection.to_client.send(ToClient::Data(frame.payload));
            }
            FrameKind::EgressEof => {
                let _ = connection.to_client.send(ToClient::Eof);
            }
            FrameKind::EgressAck => {
                let n = frame.payload.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).unwrap_or(0);
                connection.credit.give(n as usize);
            }
            FrameKind::EgressClose => {
                // The writer thread passes on what is queued, then cuts the
                // socket once it finds the queue closed.
                drop(connections);
                let removed = self.connections.lock().unwrap_or_else(|e| e.into_inner()).remove(&frame.stream);
                if let Some(connection) = removed {
                    connection.credit.close();
                }
            }
            _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "not an egress frame")),
        }
        Ok(())
    }

    /// Cuts every relayed connection (a quiesce: the host forgets them too).
    pub fn cut_all(&self) {
        let streams: Vec<u32> = self.connections.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        for stream in streams {
            self.forget(stream);
        }
    }
}
