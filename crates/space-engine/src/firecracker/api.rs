//! A typed client for Firecracker's API socket (HTTP/1.1 over a Unix
//! socket). Every call expects the documented answer: 204 (or 200 with the
//! documented body); a 4xx carries Firecracker's `fault_message`, and any
//! other answer is an error too.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use crate::EngineError;

#[derive(Debug, Clone, Serialize)]
pub struct BootSource {
    pub kernel_image_path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<PathBuf>,
    pub boot_args: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct MachineConfig {
    pub vcpu_count: u32,
    pub mem_size_mib: u32,
    pub smt: bool,
    pub track_dirty_pages: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Drive {
    pub drive_id: String,
    pub path_on_host: PathBuf,
    pub is_root_device: bool,
    pub is_read_only: bool,
}

/// A hybrid vsock: the guest connects to CID 2, port P; the host listens
/// on `<uds_path>_<P>`.
#[derive(Debug, Clone, Serialize)]
pub struct Vsock {
    pub guest_cid: u32,
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct InstanceInfo {
    pub app_name: String,
    pub id: String,
    /// `Not started`, `Running` or `Paused`.
    pub state: String,
    pub vmm_version: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotCreate {
    pub snapshot_type: &'static str,
    pub snapshot_path: PathBuf,
    pub mem_file_path: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemBackend {
    pub backend_type: &'static str,
    pub backend_path: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotLoad {
    pub snapshot_path: PathBuf,
    /// The memory file, mapped privately: clones of one snapshot share
    /// its pages until they write them.
    pub mem_backend: MemBackend,
    pub resume_vm: bool,
    /// A vsock socket of its own, for each process restored from one
    /// snapshot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vsock_override: Option<VsockOverride>,
}

#[derive(Debug, Clone, Serialize)]
pub struct VsockOverride {
    pub uds_path: PathBuf,
}

#[derive(Deserialize)]
struct Fault {
    fault_message: String,
}

/// The API of one Firecracker process.
#[derive(Debug, Clone)]
pub struct Api {
    socket: PathBuf,
}

impl Api {
    pub fn new(socket: &Path) -> Api {
        Api { socket: socket.to_path_buf() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), EngineError> {
        let failed =
            |what: &str, e: &dyn std::fmt::Display| EngineError::Runtime(format!("firecracker API {what} {path}: {e}"));
        let stream = super::at_socket(&self.socket, |p| std::os::unix::net::UnixStream::connect(p))
            .and_then(|stream| {
                stream.set_nonblocking(true)?;
                tokio::net::UnixStream::from_std(stream)
            })
            .map_err(|e| failed("connecting for", &e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failed("handshake for", &e))?;
        tokio::spawn(connection);
        let has_body = body.is_some();
        let mut request =
            Request::builder().method(method).uri(format!("http://localhost{path}")).header("Host", "localhost");
        if has_body {
            request = request.header("Content-Type", "application/json");
        }
        request = request.header("Accept", "application/json");
        let request =
            request.body(Full::new(Bytes::from(body.unwrap_or_default()))).map_err(|e| failed("building", &e))?;
        let response = sender.send_request(request).await.map_err(|e| failed("calling", &e))?;
        let status = response.status();
        let bytes = response.into_body().collect().await.map_err(|e| failed("reading", &e))?.to_bytes();
        Ok((status, bytes))
    }

    /// A PUT or PATCH that must answer 204.
    async fn command(&self, method: Method, path: &str, body: &impl Serialize) -> Result<(), EngineError> {
        let json = serde_json::to_vec(body).map_err(|e| EngineError::Runtime(e.to_string()))?;
        let (status, bytes) = self.call(method.clone(), path, Some(json)).await?;
        match status {
            StatusCode::NO_CONTENT => Ok(()),
            status if status.is_client_error() || status.is_server_error() => {
                let fault = serde_json::from_slice::<Fault>(&bytes)
                    .map(|f| f.fault_message)
                    .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
                Err(EngineError::Runtime(format!("firecracker refused {method} {path} ({status}): {fault}")))
            }
            status => Err(EngineError::Runtime(format!("firecracker answered {method} {path} with {status}, not 204"))),
        }
    }

    pub async fn instance_info(&self) -> Result<InstanceInfo, EngineError> {
        let (status, bytes) = self.call(Method::GET, "/", None).await?;
        if status != StatusCode::OK {
            return Err(EngineError::Runtime(format!("firecracker answered GET / with {status}")));
        }
        serde_json::from_slice(&bytes).map_err(|e| EngineError::Runtime(format!("firecracker's instance info: {e}")))
    }

    /// [`Api::instance_info`] for callers off the async threads, within
    /// `patience`: asked from a thread of its own, outside any runtime the
    /// caller may be in.
    pub fn instance_info_blocking(&self, patience: Duration) -> Result<InstanceInfo, EngineError> {
        let asking = || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(EngineError::io("a runtime to ask firecracker's API"))?;
            runtime.block_on(async {
                tokio::time::timeout(patience, self.instance_info()).await.map_err(|_| {
                    EngineError::Runtime(format!("firecracker's API did not answer GET / within {patience:?}"))
                })?
            })
        };
        std::thread::scope(|scope| {
            scope.spawn(asking).join().unwrap_or_else(|_| Err(EngineError::Runtime("asking the API panicked".into())))
        })
    }

    pub async fn boot_source(&self, boot: &BootSource) -> Result<(), EngineError> {
        self.command(Method::PUT, "/boot-source", boot).await
    }

    pub async fn machine_config(&self, machine: &MachineConfig) -> Result<(), EngineError> {
        self.command(Method::PUT, "/machine-config", machine).await
    }

    pub async fn drive(&self, drive: &Drive) -> Result<(), EngineError> {
        self.command(Method::PUT, &format!("/drives/{}", drive.drive_id), drive).await
    }

    pub async fn vsock(&self, vsock: &Vsock) -> Result<(), EngineError> {
        self.command(Method::PUT, "/vsock", vsock).await
    }

    pub async fn start(&self) -> Result<(), EngineError> {
        self.command(Method::PUT, "/actions", &serde_json::json!({"action_type": "InstanceStart"})).await
    }

    /// Presses Ctrl-Alt-Del on the guest's keyboard controller (x86): the
    /// agent, as init, then stops the guest cleanly.
    pub async fn send_ctrl_alt_del(&self) -> Result<(), EngineError> {
        self.command(Method::PUT, "/actions", &serde_json::json!({"action_type": "SendCtrlAltDel"})).await
    }

    pub async fn pause(&self) -> Result<(), EngineError> {
        self.command(Method::PATCH, "/vm", &serde_json::json!({"state": "Paused"})).await
    }

    pub async fn resume(&self) -> Result<(), EngineError> {
        self.command(Method::PATCH, "/vm", &serde_json::json!({"state": "Resumed"})).await
    }

    pub async fn snapshot_create(&self, snapshot: &SnapshotCreate) -> Result<(), EngineError> {
        self.command(Method::PUT, "/snapshot/create", snapshot).await
    }

    pub async fn snapshot_load(&self, load: &SnapshotLoad) -> Result<(), EngineError> {
        self.command(Method::PUT, "/snapshot/load", load).await
    }
}
