//! A request's session with a sandbox: the one way from outside the runtime
//! to a sandbox's agent. It is opened from an [`OwnedSandbox`] (the caller's
//! ownership, or the sandbox's own token, was checked where it was loaded),
//! holds the sandbox's work gate shared for as long as it lives (an idle
//! pause, which takes the gate exclusively, never freezes a sandbox under a
//! request), wakes a sandbox the server paused for idleness or told its
//! engine was idle, and marks the sandbox active. Everything that talks to
//! an agent for a request (commands, code contexts, files, ports) takes a
//! session, so no entry point can forget one of these rules.

use std::sync::Arc;

use space_api::SandboxState;
use space_engine::AgentConn;

use crate::access::OwnedSandbox;
use crate::error::NodeError;
use crate::lifecycle::WorkGuard;
use crate::platform::Platform;

/// An open session with one sandbox; dropping it lets the sandbox idle.
pub struct Session {
    id: String,
    work: WorkGuard,
    agent: Option<AgentConn>,
}

impl Session {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The sandbox's state, read under the work gate.
    pub fn state(&self) -> SandboxState {
        self.work.state
    }

    /// The agent of a sandbox that takes requests; else 409 `invalid_state`
    /// saying it could not `action`.
    pub fn agent(&self, action: &str) -> Result<&AgentConn, NodeError> {
        let state = self.work.state;
        if !crate::domain::accepts_commands(state) {
            return Err(NodeError::invalid_state("sandbox", state.as_str(), action));
        }
        self.agent.as_ref().ok_or_else(|| {
            NodeError::invalid_state("sandbox", state.as_str(), &format!("{action} (its agent is not connected)"))
        })
    }
}

impl Platform {
    /// Opens a session with `sandbox`, waking it first if the server paused
    /// it for idleness.
    pub async fn session(self: &Arc<Self>, sandbox: &OwnedSandbox) -> Result<Session, NodeError> {
        let work = self.begin_work(sandbox.id()).await?;
        let agent = self.agent(sandbox.id());
        Ok(Session { id: sandbox.id().to_string(), work, agent })
    }
}
