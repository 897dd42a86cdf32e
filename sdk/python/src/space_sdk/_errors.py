"""Exceptions mirroring the API's errors (`{"error": {"code", "message", "details"}}`)."""

from __future__ import annotations

from typing import Any, Dict, Optional


class SpaceError(Exception):
    """An error answer from the SPACE server, or a failed operation."""

    def __init__(self, message: str, *, status: Optional[int] = None, code: str = "error",
                 details: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.details = details or {}

    def __str__(self) -> str:
        where = f"HTTP {self.status} " if self.status else ""
        return f"{where}{self.code}: {self.message}"


class InvalidRequestError(SpaceError):
    """400 or 422: the request was malformed or made no sense."""


class AuthenticationError(SpaceError):
    """401: missing or bad API key."""


class ForbiddenError(SpaceError):
    """403: not allowed with this key."""


class NotFoundError(SpaceError):
    """404: no such sandbox, command, operation or template (or not yours)."""


class ConflictError(SpaceError):
    """409: the object is in the wrong state for this, or the name is taken."""


class TooLargeError(SpaceError):
    """413: the body is too large."""


class QuotaExceededError(SpaceError):
    """429: past the tenant's quota."""


class CapacityError(SpaceError):
    """503: the host is out of capacity or the engine is unavailable."""


class VolumeNotFoundError(NotFoundError):
    """404 `volume_not_found`: no volume of that name is yours."""


class SnapshotNotFoundError(NotFoundError):
    """404 `snapshot_not_found`: the volume has no snapshot of that name."""


class VolumeInUseError(ConflictError):
    """409 `volume_in_use`: a sandbox mounts the volume in a way that refuses
    this (a second read-write mount, a delete, a restore, a write through
    the files routes while it is mounted read-write); `holder` names it."""

    @property
    def holder(self) -> Optional[str]:
        """The sandbox that mounts the volume, when the server named it."""
        return self.details.get("sandbox_id")


class OperationFailedError(SpaceError):
    """An accepted operation (create, pause, …) ended in failure."""


_BY_STATUS = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    413: TooLargeError,
    422: InvalidRequestError,
    429: QuotaExceededError,
    503: CapacityError,
}


# Codes with an exception of their own (a subclass of their status's).
_BY_CODE = {
    "volume_not_found": VolumeNotFoundError,
    "snapshot_not_found": SnapshotNotFoundError,
    "volume_in_use": VolumeInUseError,
}


def error_from_response(status: int, body: Any) -> SpaceError:
    error = body.get("error", {}) if isinstance(body, dict) else {}
    cls = _BY_CODE.get(error.get("code", "")) or _BY_STATUS.get(status, SpaceError)
    return cls(error.get("message") or f"the server answered {status}", status=status,
               code=error.get("code", "error"), details=error.get("details") or {})
