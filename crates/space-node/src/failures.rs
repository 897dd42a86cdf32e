//! The runtime's typed failures that cross its files: why an agent could
//! not be taken back, why saving an image failed and at which step, why a
//! sandbox woken from an image did not come up, why a snapshot template's
//! build could not save its sandbox. They sit below every file that makes
//! or reads them.

use std::time::Duration;

use space_api::SandboxState;
use space_engine::{AgentError, EngineError};

use crate::error::NodeError;
use crate::store::StoreError;

/// Why a sandbox's agent could not be taken back.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AdoptError {
    /// Nothing of the sandbox runs any more: its agent cannot dial in.
    #[error("its engine processes are gone")]
    EngineGone,
    /// Its engine processes went away while its agent was awaited.
    #[error("its engine processes are gone (the agent did not dial in within {waited:?})")]
    GoneWhileWaiting { waited: Duration },
    /// The engine still runs it, and nothing dialled in in time.
    #[error("the agent did not dial in within {waited:?}")]
    NotDialledIn { waited: Duration },
    /// The engine still runs it; only connections without the agent's
    /// key dialled in.
    #[error(
        "the agent did not dial in within {waited:?}; {turned_away} connection(s) without the agent's key were turned away"
    )]
    OnlyImpostors { waited: Duration, turned_away: usize },
    /// A connection that holds the key (or the first one after a restore)
    /// failed its handshake.
    #[error("the agent's handshake failed: {0}")]
    Handshake(#[source] AgentError),
    #[error("the engine could not {action}: {source}")]
    Engine {
        action: &'static str,
        #[source]
        source: EngineError,
    },
    #[error("asking the engine for its status: {0}")]
    StatusCheck(#[source] tokio::task::JoinError),
    #[error("no agent session was recorded")]
    NoSession,
    #[error("reading the sandbox's commands: {0}")]
    Store(#[from] StoreError),
    #[error("reopening a command's transcript: {0}")]
    Transcript(#[source] std::io::Error),
    /// The sandbox's record could not be read or changed.
    #[error("{}", .0.message)]
    Record(NodeError),
}

impl AdoptError {
    pub(crate) fn engine(action: &'static str) -> impl FnOnce(EngineError) -> AdoptError {
        move |source| AdoptError::Engine { action, source }
    }
}

impl From<NodeError> for AdoptError {
    fn from(err: NodeError) -> AdoptError {
        AdoptError::Record(err)
    }
}

/// Why saving a sandbox's memory and disk (for a suspend, a fork, a
/// checkpoint or a snapshot template) failed, by the step it failed at.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SaveError {
    #[error("thawing: {0}")]
    Thaw(#[source] EngineError),
    #[error("quiescing the agent: the agent is not connected")]
    NotConnected,
    #[error("quiescing the agent: {0}")]
    Quiesce(#[source] AgentError),
    #[error("saving memory and disk: {0}")]
    Save(#[source] EngineError),
    #[error("writing the snapshot: {0}")]
    Snapshot(#[source] EngineError),
    #[error("reconnecting the agent: {0}")]
    Reconnect(#[source] AdoptError),
    #[error("recording it: {0}")]
    Record(#[source] std::io::Error),
}

impl SaveError {
    /// The step it failed at, which a client may learn (no host paths).
    pub(crate) fn step(&self) -> &'static str {
        match self {
            SaveError::Thaw(_) => "thawing",
            SaveError::NotConnected | SaveError::Quiesce(_) => "quiescing the agent",
            SaveError::Save(_) => "saving memory and disk",
            SaveError::Snapshot(_) => "writing the snapshot",
            SaveError::Reconnect(_) => "reconnecting the agent",
            SaveError::Record(_) => "recording it",
        }
    }
}

/// Why a sandbox started from an image (a fork, a rewound checkpoint) did
/// not come up as itself.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WakeError {
    #[error("starting from the image: {0}")]
    Start(#[source] EngineError),
    /// Whose agent session (the source's, the checkpoint's) is not known.
    #[error("the {0} agent session is not known")]
    NoSession(&'static str),
    #[error(transparent)]
    Adopt(#[from] AdoptError),
    #[error("giving the agent a fresh identity: {0}")]
    Identity(#[source] EngineError),
    #[error("giving the agent a fresh identity: {0}")]
    SetIdentity(#[source] AgentError),
    /// The sandbox's record could not be changed.
    #[error("{}", .0.message)]
    Record(NodeError),
}

/// Why a snapshot template's build could not save its sandbox's image.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TemplateSaveError {
    /// The sandbox or the build's operation could not be read.
    #[error("{}", .0.message)]
    Record(NodeError),
    #[error("the sandbox is {}, not running", .0.as_str())]
    NotRunning(SandboxState),
    #[error("saving the sandbox failed while {0}")]
    Save(#[source] SaveError),
    /// Its actor ended before it answered (the sandbox was deleted).
    #[error("the sandbox went away")]
    Gone,
}
