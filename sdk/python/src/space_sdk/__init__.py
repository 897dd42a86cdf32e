"""SPACE's Python SDK: isolated sandboxes for agent-written code.

`SPACE_URL` and `SPACE_API_KEY` say where the server is and who calls.
"""

from ._async import AsyncAttachment, AsyncClient, AsyncCommandHandle, AsyncSandbox
from ._common import CommandResult, OutputEvent
from ._errors import (AuthenticationError, CapacityError, ConflictError, ForbiddenError, InvalidRequestError,
                      NotFoundError, OperationFailedError, QuotaExceededError, SpaceError, TooLargeError)
from ._sync import Attachment, Client, CommandHandle, Sandbox

__all__ = [
    "AsyncAttachment", "AsyncClient", "AsyncCommandHandle", "AsyncSandbox", "Attachment", "AuthenticationError", "CapacityError", "Client",
    "CommandHandle", "CommandResult", "ConflictError", "ForbiddenError", "InvalidRequestError", "NotFoundError",
    "OperationFailedError", "OutputEvent", "QuotaExceededError", "Sandbox", "SpaceError", "TooLargeError",
]
__version__ = "0.1.0"
