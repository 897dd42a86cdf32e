"""SPACE's Python SDK: isolated sandboxes for agent-written code.

`SPACE_URL` and `SPACE_API_KEY` say where the server is and who calls.
"""

from ._async import AsyncAttachment, AsyncClient, AsyncCommandHandle, AsyncSandbox, AsyncTemplate, AsyncVolume
from ._common import CommandResult, Execution, OutputEvent, VolumeMount
from ._errors import (AuthenticationError, CapacityError, ConflictError, ForbiddenError, InvalidRequestError,
                      NotFoundError, OperationFailedError, QuotaExceededError, SnapshotNotFoundError, SpaceError,
                      TooLargeError, VolumeInUseError, VolumeNotFoundError)
from ._sync import Attachment, Client, CommandHandle, Context, Sandbox, Template, Volume

__all__ = [
    "AsyncAttachment", "AsyncClient", "AsyncCommandHandle", "AsyncSandbox", "AsyncTemplate", "AsyncVolume", "Attachment",
    "AuthenticationError", "CapacityError", "Client", "CommandHandle", "CommandResult", "ConflictError", "Context",
    "Execution", "ForbiddenError", "InvalidRequestError", "NotFoundError", "OperationFailedError", "OutputEvent",
    "QuotaExceededError", "Sandbox", "SnapshotNotFoundError", "SpaceError", "Template", "TooLargeError", "Volume",
    "VolumeInUseError", "VolumeMount", "VolumeNotFoundError",
]
__version__ = "0.1.0"
