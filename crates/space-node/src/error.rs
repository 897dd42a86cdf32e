//! The runtime's errors: [`NodeError`] (from `space-core`, shared with the
//! control plane), and how an agent's failure becomes one.

use space_api::ErrorCode;
pub use space_core::error::NodeError;
use space_engine::AgentError;
use space_proto::{ExecFailure, FileFailure};

/// An agent's failure to run something, as the caller sees it.
pub fn exec_failure(err: AgentError) -> NodeError {
    match err {
        AgentError::ExecFailed(failed) => {
            let code = match failed.reason {
                ExecFailure::NotFound => ErrorCode::ExecutableNotFound,
                ExecFailure::PermissionDenied => ErrorCode::PermissionDenied,
                ExecFailure::BadCwd => ErrorCode::InvalidCwd,
                ExecFailure::BadUser => ErrorCode::InvalidUser,
                ExecFailure::Invalid => ErrorCode::InvalidValue,
                ExecFailure::Spawn => ErrorCode::SpawnFailed,
            };
            NodeError::new(code, failed.message)
        }
        AgentError::Disconnected | AgentError::Timeout(_) | AgentError::Impostor => {
            NodeError::new(ErrorCode::InvalidState, "the sandbox is not reachable; it may have stopped")
        }
        AgentError::Protocol(err) => NodeError::internal("talking to the agent", err),
        AgentError::File(err) => NodeError::internal("starting a command", err.message),
        AgentError::PortClosed(why) => NodeError::internal("starting a command", why),
    }
}

/// An agent's failure with a file, as the caller sees it.
pub fn file_error(err: AgentError) -> NodeError {
    match err {
        AgentError::File(error) => {
            let code = match error.reason {
                FileFailure::NotFound => ErrorCode::FileNotFound,
                FileFailure::PermissionDenied => ErrorCode::PermissionDenied,
                FileFailure::WrongType => ErrorCode::WrongFileType,
                FileFailure::NotEmpty => ErrorCode::DirectoryNotEmpty,
                FileFailure::Invalid => ErrorCode::InvalidRequest,
                FileFailure::Io => ErrorCode::IoError,
                FileFailure::Exists => ErrorCode::AlreadyExists,
            };
            NodeError::new(code, error.message)
        }
        AgentError::Disconnected | AgentError::Timeout(_) => {
            NodeError::new(ErrorCode::InvalidState, "the sandbox is not reachable; it may have stopped")
        }
        other => NodeError::internal("a file operation", other),
    }
}
