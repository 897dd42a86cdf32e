//! A job for a sandbox's actor: an operation to carry out and what only
//! its kind carries. The platform queues jobs; the actor (`actor.rs`) takes
//! them one at a time.

use space_api::{OperationKind, OperationOrigin};

use crate::failures::TemplateSaveError;

/// A job for a sandbox's actor: carry out operation `operation_id`.
pub(crate) struct Job {
    pub(crate) operation_id: String,
    pub(crate) work: Work,
}

/// What a job does: one kind of operation, with what only that kind
/// carries.
pub(crate) enum Work {
    /// A create, from the warm or hot member handed out for it, if any
    /// (boxed: a member is far larger than any other job).
    Create {
        warm: Option<Box<crate::warm::WarmMember>>,
    },
    Delete,
    /// A pause; `idle`: the server's own idle pause, carried out only if
    /// the sandbox is still idle (see `idle.rs`).
    Pause {
        idle: bool,
    },
    Resume,
    Suspend,
    Fork,
    Checkpoint,
    RestoreCheckpoint,
    /// A snapshot template's build: save the sandbox's image into `dir`,
    /// and say how that went.
    SaveImage {
        dir: std::path::PathBuf,
        reply: tokio::sync::oneshot::Sender<Result<(), TemplateSaveError>>,
    },
    /// An operation with nothing for the actor to do (a template build
    /// with no image to save).
    Nothing,
}

impl Job {
    /// The job that carries out `operation`, as its kind and origin say.
    pub(crate) fn new(operation: &space_api::Operation) -> Job {
        let work = match operation.kind {
            OperationKind::Create => Work::Create { warm: None },
            OperationKind::Delete => Work::Delete,
            OperationKind::Pause => Work::Pause { idle: operation.origin == OperationOrigin::Idle },
            OperationKind::Resume => Work::Resume,
            OperationKind::Suspend => Work::Suspend,
            OperationKind::Fork => Work::Fork,
            OperationKind::Checkpoint => Work::Checkpoint,
            OperationKind::RestoreCheckpoint => Work::RestoreCheckpoint,
            OperationKind::BuildTemplate => Work::Nothing,
        };
        Job { operation_id: operation.id.clone(), work }
    }

    /// A create that hands out `warm` instead of a cold start.
    pub(crate) fn create(operation: &space_api::Operation, warm: Option<crate::warm::WarmMember>) -> Job {
        Job { operation_id: operation.id.clone(), work: Work::Create { warm: warm.map(Box::new) } }
    }

    /// A snapshot template build's save of the sandbox's image into `dir`.
    pub(crate) fn save_image(
        operation: &space_api::Operation,
        dir: std::path::PathBuf,
        reply: tokio::sync::oneshot::Sender<Result<(), TemplateSaveError>>,
    ) -> Job {
        Job { operation_id: operation.id.clone(), work: Work::SaveImage { dir, reply } }
    }
}
