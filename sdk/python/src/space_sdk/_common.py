"""What the sync and async clients share: configuration, request bodies
and the shapes of results."""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import httpx

from ._errors import OperationFailedError, SpaceError

DEFAULT_URL = "http://127.0.0.1:7070"
TERMINAL = ("succeeded", "failed", "cancelled")


def config(url: Optional[str], api_key: Optional[str]) -> "tuple[str, Dict[str, str]]":
    url = (url or os.environ.get("SPACE_URL") or DEFAULT_URL).rstrip("/")
    key = api_key or os.environ.get("SPACE_API_KEY")
    if not key:
        raise SpaceError("no API key: pass api_key= or set SPACE_API_KEY", code="no_api_key")
    return url, {"Authorization": f"Bearer {key}"}


def events_request(follow: bool, from_id: Optional[int], types: Optional[Sequence[str]], sandbox_id: Optional[str],
                   limit: Optional[int], last: Optional[int]) -> "tuple[Dict[str, Any], Dict[str, str]]":
    """The query and headers of `GET /v1/events`: after the last event seen
    once there is one (a resumed stream), else from `from_id`."""
    params: Dict[str, Any] = {}
    headers: Dict[str, str] = {}
    if follow:
        params["follow"] = "true"
    if types:
        params["types"] = ",".join(types)
    if sandbox_id:
        params["sandbox_id"] = sandbox_id
    if limit is not None:
        params["limit"] = limit
    if last is not None:
        headers["Last-Event-ID"] = str(last)
    elif from_id is not None:
        params["from"] = from_id
    return params, headers


# Breaks of a followed stream that are resumed rather than raised.
STREAM_BREAKS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)


SANDBOX_SETTINGS = ("vcpus", "memory_mib", "disk_mib", "env", "labels", "lifecycle", "network", "volumes")


def create_body(template: str, spec: Dict[str, Any]) -> Dict[str, Any]:
    unknown = set(spec) - set(SANDBOX_SETTINGS)
    if unknown:
        raise TypeError(f"unknown sandbox settings: {sorted(unknown)}")
    body: Dict[str, Any] = {"template": template}
    for key in SANDBOX_SETTINGS:
        if spec.get(key) is not None:
            body[key] = spec[key]
    if "volumes" in body:
        body["volumes"] = [mount_body(mount) for mount in body["volumes"]]
    return body


@dataclass
class VolumeMount:
    """A volume mounted into a sandbox at create: `Sandbox.create(volumes=[VolumeMount("ws", "/workspace")])`
    (or `volume.mount("/workspace")`, or the dict `{"name", "path", "read_only"}`)."""
    name: str
    path: str
    read_only: bool = False


def mount_body(mount: Any) -> Dict[str, Any]:
    """One mount as the API takes it, from a `VolumeMount` or a dict."""
    if isinstance(mount, VolumeMount):
        return {"name": mount.name, "path": mount.path, "read_only": mount.read_only}
    if isinstance(mount, dict):
        unknown = set(mount) - {"name", "path", "read_only"}
        if unknown or "name" not in mount or "path" not in mount:
            raise TypeError(f"a mount is {{'name', 'path', 'read_only'}}, got {mount!r}")
        return {"name": mount["name"], "path": mount["path"], "read_only": bool(mount.get("read_only", False))}
    raise TypeError(f"a mount is a VolumeMount or a dict, got {mount!r}")


def volume_body(name: str, size_mib: Optional[int], from_snapshot: Any) -> Dict[str, Any]:
    """`POST /v1/volumes`'s body; `from_snapshot` is `"VOLUME/SNAPSHOT"`, a
    `(volume, snapshot)` pair or `{"volume", "snapshot"}`."""
    body: Dict[str, Any] = {"name": name}
    if size_mib is not None:
        body["size_mib"] = size_mib
    if from_snapshot is not None:
        if isinstance(from_snapshot, str):
            volume, sep, snapshot = from_snapshot.partition("/")
            if not sep:
                raise TypeError(f"from_snapshot is 'VOLUME/SNAPSHOT', got {from_snapshot!r}")
            from_snapshot = {"volume": volume, "snapshot": snapshot}
        elif isinstance(from_snapshot, (tuple, list)):
            volume, snapshot = from_snapshot
            from_snapshot = {"volume": volume, "snapshot": snapshot}
        body["from_snapshot"] = dict(from_snapshot)
    return body


def tar_body(archive: Any) -> Any:
    """A tar archive to upload: bytes, or a binary file object (streamed)."""
    return bytes(archive) if isinstance(archive, (bytes, bytearray, memoryview)) else archive


def template_from(name: str, sandbox: Any, checkpoint: Optional[str], defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The body that makes a snapshot template of a sandbox (or its checkpoint)."""
    sandbox_id = sandbox if isinstance(sandbox, str) else sandbox.id
    source: Dict[str, Any] = {"sandbox": sandbox_id}
    if checkpoint is not None:
        source = {"checkpoint": {"sandbox": sandbox_id, "name": checkpoint}}
    unknown = set(defaults) - {"disk_mib", "env", "workdir", "user", "network"}
    if unknown:
        raise TypeError(f"unknown template defaults: {sorted(unknown)}")
    return {"name": name, "from": source, "defaults": defaults}


def image_template(name: str, reference: str, secret: Optional[str], username: Optional[str],
                   defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The body that makes a template of a registry image (with the tenant
    secret holding the registry's password or token, when given)."""
    unknown = set(defaults) - {"vcpus", "memory_mib", "disk_mib", "env", "workdir", "user", "network", "command"}
    if unknown:
        raise TypeError(f"unknown template defaults: {sorted(unknown)}")
    if username is not None and secret is None:
        raise TypeError("username is the registry user whose password the secret holds: give secret too")
    image: Any = reference
    if secret is not None:
        auth: Dict[str, Any] = {"secret": secret}
        if username is not None:
            auth["username"] = username
        image = {"reference": reference, "auth": auth}
    body: Dict[str, Any] = {"name": name, "from": {"image": image}}
    if defaults:
        body["defaults"] = defaults
    return body


def dockerfile_build(name: str, dockerfile: str, context_dir: Optional[str], build_args: Optional[Dict[str, str]],
                     target: Optional[str], network: Optional[Dict[str, Any]], secret: Optional[str],
                     username: Optional[str], defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The multipart form of a Dockerfile build (for httpx's ``files=``):
    part ``build`` (the request), then part ``context`` (``context_dir`` as
    a tar without what its ``.dockerignore`` leaves out)."""
    unknown = set(defaults) - {"vcpus", "memory_mib", "disk_mib", "env", "workdir", "user", "network", "command"}
    if unknown:
        raise TypeError(f"unknown template defaults: {sorted(unknown)}")
    request: Dict[str, Any] = {"name": name, "dockerfile": dockerfile, "build_args": dict(build_args or {}),
                               "defaults": defaults}
    if target is not None:
        request["target"] = target
    if network is not None:
        request["network"] = network
    if username is not None and secret is None:
        raise TypeError("username is the registry user whose password the secret holds: give secret too")
    if secret is not None:
        request["registry_auth"] = {"secret": secret, **({"username": username} if username is not None else {})}
    form: Dict[str, Any] = {"build": (None, json.dumps(request), "application/json")}
    if context_dir is not None:
        form["context"] = ("context.tar", context_tar(context_dir), "application/x-tar")
    return form


def context_tar(context_dir: str) -> Any:
    """``context_dir`` as a tar in a temporary file, without what its
    ``.dockerignore`` excludes (patterns matched with ``fnmatch`` on each
    path and its parents, ``!`` re-including, the last match winning; the
    server applies the file exactly as Docker does to what it receives)."""
    import fnmatch
    import os
    import tarfile
    import tempfile
    patterns: List[str] = []
    ignore = os.path.join(context_dir, ".dockerignore")
    if os.path.exists(ignore):
        with open(ignore) as lines:
            patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]

    def excluded(path: str) -> bool:
        parts = path.split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        verdict = False
        for pattern in patterns:
            negated = pattern.startswith("!")
            bare = pattern[1:] if negated else pattern
            bare = bare.strip("/").removeprefix("./")
            if any(fnmatch.fnmatchcase(candidate, bare) for candidate in candidates):
                verdict = not negated
        return verdict and path != ".dockerignore"

    out = tempfile.TemporaryFile()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for top, dirs, files in os.walk(context_dir):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(top, name)
                rel = os.path.relpath(full, context_dir)
                if not excluded(rel):
                    tar.add(full, arcname=rel, recursive=False)
    out.seek(0)
    return out


def command_body(cmd: Union[str, Sequence[str]], env: Optional[Dict[str, str]], cwd: Optional[str],
                 timeout: Optional[float], user: Optional[str], stdin: bool = False,
                 tag: Optional[str] = None) -> Dict[str, Any]:
    body: Dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if user:
        body["user"] = user
    if timeout:
        body["timeout_s"] = max(1, int(round(timeout)))
    if stdin:
        body["stdin"] = True
    if tag:
        body["tag"] = tag
    return body


def check_operation(operation: Dict[str, Any]) -> Dict[str, Any]:
    if operation.get("state") != "succeeded":
        error = operation.get("error") or {}
        raise OperationFailedError(
            f"the {operation.get('kind')} operation {operation.get('state')}: {error.get('message', 'no reason given')}",
            code=error.get("code", "operation_failed"), details={"operation": operation})
    return operation


@dataclass
class CommandResult:
    """How a command ended, with its output."""
    stdout: str
    stderr: str
    exit_code: Optional[int]
    signal: Optional[str] = None
    timed_out: bool = False
    oom_killed: bool = False
    command_id: Optional[str] = None
    truncated: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_exec(cls, answer: Dict[str, Any]) -> "CommandResult":
        result = answer.get("result") or {}
        return cls(stdout=answer.get("stdout", ""), stderr=answer.get("stderr", ""),
                   exit_code=result.get("exit_code"), signal=result.get("signal"),
                   timed_out=bool(result.get("timed_out")), oom_killed=bool(result.get("oom_killed")),
                   command_id=(answer.get("command") or {}).get("id"),
                   truncated=bool(answer.get("truncated")), raw=answer)

    @classmethod
    def from_output(cls, command_id: str, stdout: str, stderr: str, result: Dict[str, Any]) -> "CommandResult":
        return cls(stdout=stdout, stderr=stderr, exit_code=result.get("exit_code"), signal=result.get("signal"),
                   timed_out=bool(result.get("timed_out")), oom_killed=bool(result.get("oom_killed")),
                   command_id=command_id, raw=result)


@dataclass
class OutputEvent:
    """One piece of a command's output, or its end (`type == "exit"`)."""
    type: str
    offset: int = 0
    data: bytes = b""
    result: Optional[Dict[str, Any]] = None

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    @classmethod
    def parse(cls, line: str) -> "OutputEvent":
        frame = json.loads(line)
        if frame.get("type") == "exit":
            return cls(type="exit", result=frame.get("result") or {})
        if "data_b64" in frame:
            data = base64.b64decode(frame["data_b64"])
        else:
            data = frame.get("data", "").encode("utf-8")
        return cls(type=frame.get("type", "stdout"), offset=int(frame.get("offset", 0)), data=data)


@dataclass
class Execution:
    """What a code context's run gave: its output, its results (MIME
    bundles), its error if it raised, and how it ended."""
    stdout: str = ""
    stderr: str = ""
    results: List[Dict[str, Any]] = field(default_factory=list)
    error: Optional[Dict[str, Any]] = None
    status: str = ""
    execution_count: Optional[int] = None

    def add(self, event: Dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "stdout":
            self.stdout += event.get("text", "")
        elif kind == "stderr":
            self.stderr += event.get("text", "")
        elif kind == "result":
            self.results.append(event)
        elif kind == "error":
            self.error = event
        elif kind == "end":
            self.status = event.get("status", "")
            self.execution_count = event.get("execution_count")

    def _first(self, mime: str) -> Optional[str]:
        main = [r for r in self.results if r.get("is_main_result")]
        for result in main + [r for r in self.results if not r.get("is_main_result")]:
            if mime in result.get("data", {}):
                return result["data"][mime]
        return None

    @property
    def text(self) -> Optional[str]:
        """The main result as text (the last expression's value)."""
        return self._first("text/plain")

    @property
    def html(self) -> Optional[str]:
        return self._first("text/html")

    @property
    def png(self) -> Optional[bytes]:
        """The first image (a chart), decoded."""
        data = self._first("image/png")
        return base64.b64decode(data) if data else None


class OutputCollector:
    """Gathers a command's streamed output into its result."""

    def __init__(self, command_id: str, result: Dict[str, Any]) -> None:
        self.command_id = command_id
        self.result = result
        self.out = bytearray()
        self.err = bytearray()

    def add(self, event: OutputEvent) -> None:
        if event.type == "stdout":
            self.out += event.data
        elif event.type == "stderr":
            self.err += event.data
        elif event.result:
            self.result = event.result

    def finish(self) -> CommandResult:
        return CommandResult.from_output(self.command_id, self.out.decode("utf-8", "replace"),
                                         self.err.decode("utf-8", "replace"), self.result)


def as_bytes(data: Union[str, bytes]) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


def listing(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(body.get("entries", []))
