"""The synchronous client."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import httpx

from ._common import (STREAM_BREAKS, TERMINAL, CommandResult, Execution, OutputCollector, OutputEvent, VolumeMount, as_bytes,
                      check_operation, command_body, config, create_body, dockerfile_build, events_request, image_template,
                      listing, tar_body, template_from, volume_body)
from ._errors import SpaceError, error_from_response


class Client:
    """One connection pool to a SPACE server."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, timeout: float = 90.0) -> None:
        self.url, headers = config(url, api_key)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # A kept-alive connection the server had closed: a GET is
                # safe to send again on a fresh one.
                if method != "GET":
                    raise
                response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise SpaceError(f"cannot reach the SPACE server at {self.url}: {err!r}", code="unreachable") from err
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            raise error_from_response(response.status_code, body)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def put_secret(self, name: str, value: str, hosts: Sequence[str]) -> Dict[str, Any]:
        """Writes (or replaces) a secret of your tenant that may be sent only
        to `hosts` (`name` or `*.suffix`); the value is never returned."""
        return self.json("PUT", f"/v1/secrets/{name}", json={"value": value, "hosts": list(hosts)})

    def list_secrets(self) -> List[Dict[str, Any]]:
        """Your tenant's secrets: names and hosts, never values."""
        return (self.json("GET", "/v1/secrets"))["secrets"]

    def delete_secret(self, name: str) -> None:
        self.request("DELETE", f"/v1/secrets/{name}")

    def events(self, *, follow: bool = False, from_id: Optional[int] = None, types: Optional[Sequence[str]] = None,
               sandbox_id: Optional[str] = None, limit: Optional[int] = None) -> Iterator[Dict[str, Any]]:
        """Your sandboxes', operations' and commands' events (`GET /v1/events`),
        oldest first, as dicts: `{"id", "type", "at", "sandbox_id", and the
        "sandbox", "operation" or "command" as it was}`. Without `from_id`,
        the newest `limit` (or with `follow`, those from now on). With
        `follow`, keeps yielding as things happen and, if the connection
        breaks, resumes after the last event seen."""
        last: Optional[int] = None
        while True:
            params, headers = events_request(follow, from_id, types, sandbox_id, limit, last)
            try:
                with self._http.stream("GET", "/v1/events", params=params, headers=headers, timeout=None) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise error_from_response(response.status_code, response.json())
                    for line in response.iter_lines():
                        if line.strip():
                            event = json.loads(line)
                            last = event["id"]
                            yield event
            except STREAM_BREAKS as err:
                if not follow:
                    raise SpaceError(f"the event stream broke: {err!r}", code="unreachable") from err
                time.sleep(0.5)
                continue
            if not follow:
                return

    def wait_operation(self, operation_id: str, timeout: float = 300.0) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            operation = self.json("GET", f"/v1/operations/{operation_id}", params={"wait": 30})
            if operation.get("state") in TERMINAL:
                return operation
            if time.monotonic() > deadline:
                raise SpaceError(f"operation {operation_id} did not finish within {timeout}s", code="timeout")


_default: Optional[Client] = None


def _client(client: Optional[Client]) -> Client:
    global _default
    if client is not None:
        return client
    if _default is None:
        _default = Client()
    return _default


class CommandHandle:
    """A command started in a sandbox: stream it, feed it, signal it, wait."""

    def __init__(self, sandbox: "Sandbox", command_id: str) -> None:
        self.sandbox = sandbox
        self.id = command_id

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sandbox.id}/commands/{self.id}{suffix}"

    def stream(self, from_offset: int = 0) -> Iterator[OutputEvent]:
        """Yields output events as they arrive, ending with the exit event."""
        params = {"from": from_offset, "follow": "true"}
        client = self.sandbox.client
        with client._http.stream("GET", self._path("/output"), params=params, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                raise error_from_response(response.status_code, response.json())
            for line in response.iter_lines():
                if line.strip():
                    event = OutputEvent.parse(line)
                    yield event
                    if event.type == "exit":
                        return

    def send_stdin(self, data: Union[str, bytes], eof: bool = False) -> None:
        params = {"eof": "true"} if eof else None
        self.sandbox.client.request("POST", self._path("/stdin"), content=as_bytes(data), params=params)

    def close_stdin(self) -> None:
        self.sandbox.client.request("POST", self._path("/stdin"), content=b"", params={"eof": "true"})

    def signal(self, name: str = "TERM") -> None:
        self.sandbox.client.request("POST", self._path("/signal"), json={"signal": name})

    def attach(self) -> "Attachment":
        """An interactive session over the command's WebSocket: bytes in are
        its stdin, bytes out its output (needs `pip install space-sdk[attach]`)."""
        try:
            from websockets.sync.client import connect
        except ImportError as err:
            raise SpaceError("attach needs the websockets package: pip install 'space-sdk[attach]'",
                             code="missing_dependency") from err
        client = self.sandbox.client
        url = client.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + self._path("/attach")
        headers = {"Authorization": client._http.headers["Authorization"]}
        try:
            opened = connect(url, additional_headers=headers)
        except TypeError:  # websockets < 14 names it extra_headers
            opened = connect(url, extra_headers=headers)
        # Entered as a context manager, which newer websockets expect; the
        # attachment leaves it when closed.
        socket = opened.__enter__() if hasattr(opened, "__enter__") else opened
        return Attachment(socket)

    def info(self) -> Dict[str, Any]:
        return self.sandbox.client.json("GET", self._path())

    def wait(self, timeout: Optional[float] = None) -> CommandResult:
        """Waits for the end and returns the result with the whole output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = self.sandbox.client.json("GET", self._path(), params={"wait": 30})
            if info.get("result") is not None:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise SpaceError(f"command {self.id} still runs after {timeout}s", code="timeout")
        collector = OutputCollector(self.id, info["result"])
        for event in self.stream():
            collector.add(event)
        return collector.finish()


class Attachment:
    """A live WebSocket session with a command (see `CommandHandle.attach`)."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self.result: Optional[Dict[str, Any]] = None

    def send(self, data: Union[str, bytes]) -> None:
        self._socket.send(as_bytes(data))

    def resize(self, cols: int, rows: int) -> None:
        self._socket.send(json.dumps({"resize": {"cols": cols, "rows": rows}}))

    def close_stdin(self) -> None:
        self._socket.send(json.dumps({"eof": True}))

    def output(self) -> Iterator[bytes]:
        """Yields output until the command ends (then `result` is set)."""
        for message in self._socket:
            if isinstance(message, bytes):
                yield message
            else:
                frame = json.loads(message)
                if "exit" in frame:
                    self.result = frame["exit"]
                    return

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Commands:
    def __init__(self, sandbox: "Sandbox") -> None:
        self.sandbox = sandbox

    def run(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None, timeout: Optional[float] = None, user: Optional[str] = None) -> CommandResult:
        """Runs a shell string (or an argv) and returns how it ended."""
        body = command_body(cmd, env, cwd, timeout, user)
        answer = self.sandbox.client.json("POST", f"/v1/sandboxes/{self.sandbox.id}/exec", json=body,
                                          timeout=None if not timeout else timeout + 30)
        return CommandResult.from_exec(answer)

    def start(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None, timeout: Optional[float] = None, user: Optional[str] = None,
              stdin: bool = False, tag: Optional[str] = None) -> CommandHandle:
        """Starts a command and returns at once with a handle to it."""
        body = command_body(cmd, env, cwd, timeout, user, stdin, tag)
        created = self.sandbox.client.json("POST", f"/v1/sandboxes/{self.sandbox.id}/commands", json=body)
        return CommandHandle(self.sandbox, created["command"]["id"])

    def connect(self, command_id: str) -> CommandHandle:
        """A handle to a command started earlier (re-attach by id)."""
        self.sandbox.client.json("GET", f"/v1/sandboxes/{self.sandbox.id}/commands/{command_id}")
        return CommandHandle(self.sandbox, command_id)

    def list(self) -> List[Dict[str, Any]]:
        return self.sandbox.client.json("GET", f"/v1/sandboxes/{self.sandbox.id}/commands")["commands"]


class Files:
    """The files of a sandbox (`sandbox.files`) or of a volume
    (`volume.files`, no sandbox needed): the same calls on either."""

    def __init__(self, client: Client, route: str) -> None:
        self.client = client
        self._route = route

    def _path(self) -> str:
        return self._route

    def write(self, path: str, data: Union[str, bytes], mode: Optional[str] = None) -> Dict[str, Any]:
        params = {"path": path}
        if mode:
            params["mode"] = mode
        return self.client.json("PUT", self._path(), params=params, content=as_bytes(data))

    def read(self, path: str) -> bytes:
        response = self.client.request("GET", self._path(), params={"path": path})
        if response.headers.get("content-type", "").startswith("application/json"):
            raise SpaceError(f"{path} is a directory; use files.list", code="is_a_directory")
        return response.content

    def list(self, path: str) -> List[Dict[str, Any]]:
        response = self.client.request("GET", self._path(), params={"path": path})
        if not response.headers.get("content-type", "").startswith("application/json"):
            raise SpaceError(f"{path} is a file; use files.read", code="not_a_directory")
        return listing(response.json())

    def remove(self, path: str, recursive: bool = False) -> None:
        params = {"path": path}
        if recursive:
            params["recursive"] = "true"
        self.client.request("DELETE", self._path(), params=params)

    def upload_tar(self, path: str, archive: Any) -> Dict[str, Any]:
        """Unpacks a tar archive (bytes, or a binary file streamed) into
        directory `path`, made if missing."""
        return self.client.json("PUT", self._path(), params={"path": path, "format": "tar"},
                                content=tar_body(archive))

    def download_tar(self, path: str) -> bytes:
        """Directory `path` and what it holds as a tar archive."""
        return self.client.request("GET", self._path(), params={"path": path, "format": "tar"}).content


class Context:
    """An interpreter kept alive in a sandbox: state carries from run to run."""

    def __init__(self, sandbox: "Sandbox", info: Dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.info = info
        self.id: str = info["id"]

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sandbox.id}/contexts/{self.id}{suffix}"

    def run(self, code: str, *, timeout: Optional[float] = None,
            on_event: Optional[Any] = None, env: Optional[Dict[str, str]] = None) -> Execution:
        """Runs `code` and returns what it gave; `on_event` sees each event
        (output as it happens) first; `env` holds for this run only."""
        body: Dict[str, Any] = {"code": code}
        if env:
            body["env"] = dict(env)
        if timeout is not None:
            body["timeout_s"] = int(timeout)
        execution = Execution()
        client = self.sandbox.client
        with client._http.stream("POST", self._path("/run"), json=body, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                raise error_from_response(response.status_code, response.json())
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if on_event:
                    on_event(event)
                execution.add(event)
        return execution

    def interrupt(self) -> None:
        self.sandbox.client.json("POST", self._path("/interrupt"))

    def restart(self) -> None:
        self.info = self.sandbox.client.json("POST", self._path("/restart"))

    def delete(self) -> None:
        self.sandbox.client.request("DELETE", self._path())


class Contexts:
    def __init__(self, sandbox: "Sandbox") -> None:
        self.sandbox = sandbox

    def create(self, language: str = "python", *, cwd: Optional[str] = None,
               env: Optional[Dict[str, str]] = None) -> Context:
        """Starts an interpreter and returns once it answers."""
        body: Dict[str, Any] = {"language": language, "env": env or {}}
        if cwd:
            body["cwd"] = cwd
        return Context(self.sandbox, self.sandbox.client.json("POST", f"/v1/sandboxes/{self.sandbox.id}/contexts",
                                                              json=body))

    def list(self) -> List[Context]:
        listed = self.sandbox.client.json("GET", f"/v1/sandboxes/{self.sandbox.id}/contexts")["contexts"]
        return [Context(self.sandbox, info) for info in listed]


class Sandbox:
    """A sandbox on the SPACE server."""

    def __init__(self, info: Dict[str, Any], client: Client, keep: bool = True) -> None:
        self.info = info
        self.id: str = info["id"]
        self.client = client
        self.keep = keep
        self.commands = Commands(self)
        self.files = Files(client, f"/v1/sandboxes/{self.id}/files")
        self.contexts = Contexts(self)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.info.get('state')!r})"

    @classmethod
    def create(cls, template: str = "base", *, keep: bool = False, client: Optional[Client] = None,
               timeout: float = 300.0, **spec: Any) -> "Sandbox":
        """Creates a sandbox and returns once it runs (accepted is not ready:
        this waits for the create operation and raises if it failed)."""
        client = _client(client)
        accepted = client.json("POST", "/v1/sandboxes", json=create_body(template, spec))
        check_operation(client.wait_operation(accepted["operation"]["id"], timeout))
        return cls(client.json("GET", f"/v1/sandboxes/{accepted['sandbox']['id']}"), client, keep=keep)

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Optional[Client] = None) -> "Sandbox":
        client = _client(client)
        return cls(client.json("GET", f"/v1/sandboxes/{sandbox_id}"), client, keep=True)

    @classmethod
    def list(cls, *, state: Optional[str] = None, client: Optional[Client] = None) -> List["Sandbox"]:
        client = _client(client)
        params = {"state": state} if state else None
        return [cls(s, client) for s in client.json("GET", "/v1/sandboxes", params=params)["sandboxes"]]

    def refresh(self) -> Dict[str, Any]:
        self.info = self.client.json("GET", f"/v1/sandboxes/{self.id}")
        return self.info

    @property
    def state(self) -> str:
        return self.refresh()["state"]

    def _lifecycle(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        accepted = self.client.json(method, path, json=(body or {}) if method == "POST" else None)
        operation = check_operation(self.client.wait_operation(accepted["operation"]["id"]))
        self.refresh()
        return operation

    def set_network(self, egress: str, allow: Sequence[str] = (), deny: Sequence[str] = (),
                    secrets: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """Replaces the sandbox's egress policy at once (open connections it
        no longer allows are cut); returns the sandbox."""
        body: Dict[str, Any] = {"egress": egress, "allow": list(allow), "deny": list(deny)}
        if secrets:
            # ENV -> secret name: ENV holds a placeholder the gateway replaces.
            body["secrets"] = {env: {"secret": name} for env, name in secrets.items()}
        self.info = self.client.json("PUT", f"/v1/sandboxes/{self.id}/network", json=body)
        return self.info

    def port_url(self, port: int, path: str = "/") -> str:
        """The API URL that reaches `path` on a server listening on `port`
        inside the sandbox (send the API key with it)."""
        return f"{self.client.url}/v1/sandboxes/{self.id}/ports/{port}/{path.lstrip('/')}"

    def port_request(self, port: int, method: str, path: str = "/", **kwargs: Any) -> httpx.Response:
        """An HTTP request to a server listening on `port` inside the
        sandbox (a dev server, a notebook), through the API."""
        return self.client.request(method, f"/v1/sandboxes/{self.id}/ports/{port}/{path.lstrip('/')}", **kwargs)

    def egress_log(self, limit: int = 1000) -> List[Dict[str, Any]]:
        """Every connection the sandbox made through the egress gateway."""
        return self.client.json("GET", f"/v1/sandboxes/{self.id}/egress", params={"limit": limit})["events"]

    def pause(self) -> Dict[str, Any]:
        return self._lifecycle("POST", f"/v1/sandboxes/{self.id}/pause")

    def resume(self) -> Dict[str, Any]:
        return self._lifecycle("POST", f"/v1/sandboxes/{self.id}/resume")

    def suspend(self) -> Dict[str, Any]:
        return self._lifecycle("POST", f"/v1/sandboxes/{self.id}/suspend")

    def delete(self) -> Dict[str, Any]:
        return self._lifecycle("DELETE", f"/v1/sandboxes/{self.id}")

    def fork(self, count: int = 1, *, labels: Optional[Dict[str, str]] = None,
             timeout: float = 300.0) -> List["Sandbox"]:
        """`count` copies of this running sandbox at one instant (memory,
        processes, disk), each a sandbox of its own; returns once they run."""
        body = {"count": count, "labels": labels or {}}
        accepted = self.client.json("POST", f"/v1/sandboxes/{self.id}/fork", json=body)
        check_operation(self.client.wait_operation(accepted["operation"]["id"], timeout))
        return [Sandbox(self.client.json("GET", f"/v1/sandboxes/{s['id']}"), self.client, keep=self.keep)
                for s in accepted["sandboxes"]]

    def checkpoint(self, name: str) -> Dict[str, Any]:
        """Saves checkpoint `name` (memory, processes, disk) without
        stopping the sandbox; returns the finished operation."""
        return self._lifecycle("POST", f"/v1/sandboxes/{self.id}/checkpoints", {"name": name})

    def checkpoints(self) -> List[Dict[str, Any]]:
        return self.client.json("GET", f"/v1/sandboxes/{self.id}/checkpoints")["checkpoints"]

    def restore(self, name: str) -> Dict[str, Any]:
        """Rolls the sandbox back to checkpoint `name` (it keeps its id)."""
        return self._lifecycle("POST", f"/v1/sandboxes/{self.id}/checkpoints/{name}/restore")

    def delete_checkpoint(self, name: str) -> None:
        self.client.request("DELETE", f"/v1/sandboxes/{self.id}/checkpoints/{name}")

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.keep:
            self.delete()


class Template:
    """Templates sandboxes start from."""

    @staticmethod
    def from_sandbox(name: str, sandbox: Union["Sandbox", str], *, checkpoint: Optional[str] = None,
                     client: Optional[Client] = None, timeout: float = 300.0, **defaults: Any) -> Dict[str, Any]:
        """A snapshot template of a running sandbox (or of one of its
        checkpoints): its sandboxes start from that memory and disk instead
        of booting. Returns the template once it is ready."""
        client = sandbox.client if isinstance(sandbox, Sandbox) else _client(client)
        accepted = client.json("POST", "/v1/templates", json=template_from(name, sandbox, checkpoint, defaults))
        check_operation(client.wait_operation(accepted["operation"]["id"], timeout))
        return client.json("GET", f"/v1/templates/{name}")

    @staticmethod
    def from_image(name: str, reference: str, *, secret: Optional[str] = None, username: Optional[str] = None,
                   client: Optional[Client] = None, timeout: float = 900.0, **defaults: Any) -> Dict[str, Any]:
        """A template of an image in an OCI registry
        (``registry.example/team/app:1.2`` or ``…@sha256:…``), pulled by the
        server: its env, working dir, user and start command become the
        template's defaults (``defaults`` given here win). ``secret`` names
        the tenant secret holding the registry's password (with
        ``username``) or token. An image that cannot be pulled raises at
        once; returns the template once it is ready."""
        client = _client(client)
        accepted = client.json("POST", "/v1/templates", json=image_template(name, reference, secret, username, defaults))
        check_operation(client.wait_operation(accepted["operation"]["id"], timeout))
        return client.json("GET", f"/v1/templates/{name}")

    @staticmethod
    def build(name: str, dockerfile: str, context_dir: Optional[str] = None, *,
              build_args: Optional[Dict[str, str]] = None, target: Optional[str] = None,
              network: Optional[Dict[str, Any]] = None, secret: Optional[str] = None,
              username: Optional[str] = None, client: Optional[Client] = None, timeout: float = 1800.0,
              **defaults: Any) -> Dict[str, Any]:
        """A template built from a Dockerfile (its text) and the files of
        ``context_dir``: RUN steps run in sandboxes of the build with
        ``network`` (none when not given), each step a cached layer. An
        instruction not supported raises at once; returns the template
        once it is ready."""
        client = _client(client)
        form = dockerfile_build(name, dockerfile, context_dir, build_args, target, network, secret, username, defaults)
        accepted = client.json("POST", "/v1/templates/builds", files=form)
        check_operation(client.wait_operation(accepted["operation"]["id"], timeout))
        return client.json("GET", f"/v1/templates/{name}")

    @staticmethod
    def get(name: str, *, client: Optional[Client] = None) -> Dict[str, Any]:
        return _client(client).json("GET", f"/v1/templates/{name}")

    @staticmethod
    def delete(name: str, *, client: Optional[Client] = None) -> None:
        _client(client).request("DELETE", f"/v1/templates/{name}")


class Volume:
    """A volume of yours: storage that outlives sandboxes, mounted into them
    at create (`Sandbox.create(volumes=[volume.mount("/workspace")])`); its
    files are reachable without a sandbox too (`volume.files`)."""

    def __init__(self, info: Dict[str, Any], client: Client) -> None:
        self.info = info
        self.name: str = info["name"]
        self.client = client
        self.files = Files(client, f"/v1/volumes/{self.name}/files")

    def __repr__(self) -> str:
        return f"Volume({self.name!r}, size_mib={self.info.get('size_mib')!r})"

    def _path(self, suffix: str = "") -> str:
        return f"/v1/volumes/{self.name}{suffix}"

    @classmethod
    def create(cls, name: str, *, size_mib: Optional[int] = None, from_snapshot: Any = None,
               client: Optional[Client] = None) -> "Volume":
        """Makes a volume: empty, or a copy of one of your volumes' snapshots
        (`from_snapshot="VOLUME/SNAPSHOT"`). `size_mib` is its quota
        (default 1024), counted against your tenant's disk quota."""
        client = _client(client)
        return cls(client.json("POST", "/v1/volumes", json=volume_body(name, size_mib, from_snapshot)), client)

    @classmethod
    def get(cls, name: str, *, client: Optional[Client] = None) -> "Volume":
        client = _client(client)
        return cls(client.json("GET", f"/v1/volumes/{name}"), client)

    @classmethod
    def list(cls, *, client: Optional[Client] = None) -> List["Volume"]:
        client = _client(client)
        return [cls(v, client) for v in client.json("GET", "/v1/volumes")["volumes"]]

    def refresh(self) -> Dict[str, Any]:
        self.info = self.client.json("GET", self._path())
        return self.info

    @property
    def used_bytes(self) -> int:
        return self.refresh()["used_bytes"]

    @property
    def mounted_by(self) -> List[Dict[str, Any]]:
        """The live sandboxes that mount it: `{"sandbox_id", "path", "read_only"}`."""
        return self.refresh()["mounted_by"]

    def mount(self, path: str, read_only: bool = False) -> VolumeMount:
        """This volume at `path`, for `Sandbox.create(volumes=[...])`."""
        return VolumeMount(self.name, path, read_only)

    def delete(self) -> None:
        """Deletes it with its snapshots (`VolumeInUseError` while mounted)."""
        self.client.request("DELETE", self._path())

    def snapshot(self, name: str) -> Dict[str, Any]:
        """Snapshots its files as they are now (copy-on-write: cheap)."""
        return self.client.json("POST", self._path("/snapshots"), json={"name": name})

    def snapshots(self) -> List[Dict[str, Any]]:
        return self.client.json("GET", self._path("/snapshots"))["snapshots"]

    def restore(self, snapshot: str) -> Dict[str, Any]:
        """Puts its files back as snapshot `snapshot` holds them (the
        snapshot stays; `VolumeInUseError` while mounted)."""
        self.info = self.client.json("POST", self._path(f"/snapshots/{snapshot}/restore"))
        return self.info

    def delete_snapshot(self, name: str) -> None:
        self.client.request("DELETE", self._path(f"/snapshots/{name}"))

    def move(self, node: str) -> Dict[str, Any]:
        """In a cluster: copies it to `node` (while nothing mounts it)."""
        answer = self.client.json("POST", self._path("/move"), json={"node": node})
        if isinstance(answer, dict) and (answer.get("operation") or {}).get("id"):
            check_operation(self.client.wait_operation(answer["operation"]["id"]))
        return self.refresh()
