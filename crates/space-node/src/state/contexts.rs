//! A code context while its driver runs, and what its record keeps.

use std::sync::{Arc, Mutex};

use serde_json::Value;
use space_api::CodeContext;
use space_engine::AgentConn;
use tokio::sync::{mpsc, oneshot};

use crate::error::NodeError;

/// A context while its driver runs.
pub(crate) struct LiveContext {
    pub(crate) info: Mutex<CodeContext>,
    pub(crate) agent: AgentConn,
    pub(crate) stream: u32,
    /// The driver's process id in the sandbox (to take its stream over).
    pub(crate) pid: u32,
    /// The interpreter's own environment (to start it again).
    pub(crate) env: std::collections::BTreeMap<String, String>,
    /// Set once the driver process is gone (its restart runs it anew).
    pub(crate) exited: std::sync::atomic::AtomicBool,
    /// The run going on, and where its events go.
    pub(crate) run: Mutex<Option<CurrentRun>>,
    /// Held by the run going on: one at a time.
    pub(crate) running: Arc<tokio::sync::Mutex<()>>,
    /// Told when the interpreter is ready (again, after a restart).
    pub(crate) ready: Mutex<Option<oneshot::Sender<Result<(), NotReady>>>>,
    /// Where runs that name no context go (E2B's code interpreter).
    pub(crate) default: std::sync::atomic::AtomicBool,
}

/// The run going on in a context. An interrupt is never lost: one asked
/// before the driver can take it is remembered here and given when it can
/// (the JavaScript driver says `started` from inside the run, the only time
/// a SIGINT reaches the run and not Node's own default).
pub(crate) struct CurrentRun {
    pub(crate) id: String,
    pub(crate) events: mpsc::UnboundedSender<Value>,
    /// Whether its code runs (JavaScript's `started`; the others take an
    /// interrupt on their stdin at any time).
    pub(crate) started: bool,
    pub(crate) interrupted: bool,
}

/// What a context's record keeps: enough to pick its driver up again on a
/// connection that still serves its stream (after a restart, in a fork).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct SavedContext {
    pub(crate) info: CodeContext,
    pub(crate) stream: u32,
    pub(crate) pid: u32,
    pub(crate) env: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub(crate) default: bool,
}

impl LiveContext {
    pub(crate) fn saved(&self) -> SavedContext {
        SavedContext {
            info: self.info(),
            stream: self.stream,
            pid: self.pid,
            env: self.env.clone(),
            default: self.default.load(std::sync::atomic::Ordering::SeqCst),
        }
    }

    pub(crate) fn set_state(&self, state: &str) {
        self.info.lock().unwrap_or_else(|e| e.into_inner()).state = state.to_string();
    }

    pub(crate) fn info(&self) -> CodeContext {
        self.info.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) async fn send(&self, request: Value) -> Result<(), NodeError> {
        let line = format!("{request}\n").into_bytes();
        self.agent.send_stdin(self.stream, line).await.map_err(crate::error::exec_failure)
    }

    /// Ends the run going on (if any) with `event`.
    pub(crate) fn end_run(&self, event: Value) {
        if let Some(run) = self.run.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = run.events.send(event);
        }
    }

    /// Whether `id` names the run going on (a late event of an earlier
    /// run is not this one's).
    pub(crate) fn is_current(&self, id: &str) -> bool {
        self.run.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|run| run.id == id)
    }

    pub(crate) async fn signal(&self, signal: nix::sys::signal::Signal) -> Result<(), NodeError> {
        self.agent.signal(self.stream, signal as i32).await.map_err(crate::error::exec_failure)
    }
}

/// Why a context's interpreter did not become ready.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotReady {
    /// The driver said the interpreter died, and why.
    #[error("{0}")]
    Died(String),
    /// The driver itself exited: the last line it wrote to stderr.
    #[error("{0}")]
    DriverExited(String),
}
