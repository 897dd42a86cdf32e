"""SPACE's Python SDK: isolated sandboxes for agent-written code.

`SPACE_URL` and `SPACE_API_KEY` say where the server is and who calls.
"""

from ._async import AsyncAttachment, AsyncClient, AsyncCommandHandle, AsyncSandbox, AsyncTemplate
from ._common import CommandResult, Execution, OutputEvent
from ._errors import (AuthenticationError, CapacityError, ConflictError, ForbiddenError, InvalidRequestError,
                      NotFoundError, OperationFailedError, QuotaExceededError, SpaceError, TooLargeError)
from ._sync import Attachment, Client, CommandHandle, Context, Sandbox, Template

__all__ = [
    "AsyncAttachment", "AsyncClient", "AsyncCommandHandle", "AsyncSandbox", "AsyncTemplate", "Attachment", "AuthenticationError", "CapacityError", "Client",
    "CommandHandle", "CommandResult", "ConflictError", "Context", "Execution", "ForbiddenError", "InvalidRequestError", "NotFoundError",
    "OperationFailedError", "OutputEvent", "QuotaExceededError", "Sandbox", "SpaceError", "Template", "TooLargeError",
]
__version__ = "0.1.0"
