"""The asynchronous client: the same surface as the synchronous one, with `await`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Union

import httpx

from ._common import (STREAM_BREAKS, TERMINAL, CommandResult, Execution, OutputCollector, OutputEvent, VolumeMount, as_bytes,
                      check_operation, command_body, config, create_body, dockerfile_build, events_request, image_template,
                      listing, template_from, volume_body)
from ._errors import SpaceError, error_from_response


class AsyncClient:
    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, timeout: float = 90.0) -> None:
        self.url, headers = config(url, api_key)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            try:
                response = await self._http.request(method, path, **kwargs)
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # A kept-alive connection the server had closed: a GET is
                # safe to send again on a fresh one.
                if method != "GET":
                    raise
                response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise SpaceError(f"cannot reach the SPACE server at {self.url}: {err!r}", code="unreachable") from err
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            raise error_from_response(response.status_code, body)
        return response

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self.request(method, path, **kwargs)).json()

    async def put_secret(self, name: str, value: str, hosts: Sequence[str]) -> Dict[str, Any]:
        """Writes (or replaces) a secret of your tenant that may be sent only
        to `hosts` (`name` or `*.suffix`); the value is never returned."""
        return await self.json("PUT", f"/v1/secrets/{name}", json={"value": value, "hosts": list(hosts)})

    async def list_secrets(self) -> List[Dict[str, Any]]:
        """Your tenant's secrets: names and hosts, never values."""
        return (await self.json("GET", "/v1/secrets"))["secrets"]

    async def delete_secret(self, name: str) -> None:
        await self.request("DELETE", f"/v1/secrets/{name}")

    async def events(self, *, follow: bool = False, from_id: Optional[int] = None,
                     types: Optional[Sequence[str]] = None, sandbox_id: Optional[str] = None,
                     limit: Optional[int] = None) -> AsyncIterator[Dict[str, Any]]:
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
                async with self._http.stream("GET", "/v1/events", params=params, headers=headers,
                                             timeout=None) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise error_from_response(response.status_code, response.json())
                    async for line in response.aiter_lines():
                        if line.strip():
                            event = json.loads(line)
                            last = event["id"]
                            yield event
            except STREAM_BREAKS as err:
                if not follow:
                    raise SpaceError(f"the event stream broke: {err!r}", code="unreachable") from err
                await asyncio.sleep(0.5)
                continue
            if not follow:
                return

    async def wait_operation(self, operation_id: str, timeout: float = 300.0) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            operation = await self.json("GET", f"/v1/operations/{operation_id}", params={"wait": 30})
            if operation.get("state") in TERMINAL:
                return operation
            if time.monotonic() > deadline:
                raise SpaceError(f"operation {operation_id} did not finish within {timeout}s", code="timeout")


class AsyncCommandHandle:
    def __init__(self, sandbox: "AsyncSandbox", command_id: str) -> None:
        self.sandbox = sandbox
        self.id = command_id

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sandbox.id}/commands/{self.id}{suffix}"

    async def stream(self, from_offset: int = 0) -> AsyncIterator[OutputEvent]:
        params = {"from": from_offset, "follow": "true"}
        http = self.sandbox.client._http
        async with http.stream("GET", self._path("/output"), params=params, timeout=None) as response:
            if response.status_code >= 400:
                await response.aread()
                raise error_from_response(response.status_code, response.json())
            async for line in response.aiter_lines():
                if line.strip():
                    event = OutputEvent.parse(line)
                    yield event
                    if event.type == "exit":
                        return

    async def send_stdin(self, data: Union[str, bytes], eof: bool = False) -> None:
        params = {"eof": "true"} if eof else None
        await self.sandbox.client.request("POST", self._path("/stdin"), content=as_bytes(data), params=params)

    async def close_stdin(self) -> None:
        await self.sandbox.client.request("POST", self._path("/stdin"), content=b"", params={"eof": "true"})

    async def signal(self, name: str = "TERM") -> None:
        await self.sandbox.client.request("POST", self._path("/signal"), json={"signal": name})

    async def attach(self) -> "AsyncAttachment":
        """An interactive session over the command's WebSocket (needs
        `pip install space-sdk[attach]`)."""
        try:
            from websockets.asyncio.client import connect
        except ImportError as err:
            raise SpaceError("attach needs websockets 13 or later: pip install 'space-sdk[attach]'",
                             code="missing_dependency") from err
        client = self.sandbox.client
        url = client.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + self._path("/attach")
        socket = await connect(url, additional_headers={"Authorization": client._http.headers["Authorization"]})
        return AsyncAttachment(socket)

    async def wait(self, timeout: Optional[float] = None) -> CommandResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = await self.sandbox.client.json("GET", self._path(), params={"wait": 30})
            if info.get("result") is not None:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise SpaceError(f"command {self.id} still runs after {timeout}s", code="timeout")
        collector = OutputCollector(self.id, info["result"])
        async for event in self.stream():
            collector.add(event)
        return collector.finish()


class AsyncAttachment:
    """A live WebSocket session with a command (see `AsyncCommandHandle.attach`)."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self.result: Optional[Dict[str, Any]] = None

    async def send(self, data: Union[str, bytes]) -> None:
        await self._socket.send(as_bytes(data))

    async def resize(self, cols: int, rows: int) -> None:
        await self._socket.send(json.dumps({"resize": {"cols": cols, "rows": rows}}))

    async def close_stdin(self) -> None:
        await self._socket.send(json.dumps({"eof": True}))

    async def output(self) -> AsyncIterator[bytes]:
        """Yields output until the command ends (then `result` is set)."""
        async for message in self._socket:
            if isinstance(message, bytes):
                yield message
            else:
                frame = json.loads(message)
                if "exit" in frame:
                    self.result = frame["exit"]
                    return

    async def close(self) -> None:
        await self._socket.close()

    async def __aenter__(self) -> "AsyncAttachment":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncCommands:
    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self.sandbox = sandbox

    async def run(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None,
                  cwd: Optional[str] = None, timeout: Optional[float] = None,
                  user: Optional[str] = None) -> CommandResult:
        body = command_body(cmd, env, cwd, timeout, user)
        answer = await self.sandbox.client.json("POST", f"/v1/sandboxes/{self.sandbox.id}/exec", json=body,
                                                timeout=None if not timeout else timeout + 30)
        return CommandResult.from_exec(answer)

    async def start(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None,
                    cwd: Optional[str] = None, timeout: Optional[float] = None, user: Optional[str] = None,
                    stdin: bool = False, tag: Optional[str] = None) -> AsyncCommandHandle:
        body = command_body(cmd, env, cwd, timeout, user, stdin, tag)
        created = await self.sandbox.client.json("POST", f"/v1/sandboxes/{self.sandbox.id}/commands", json=body)
        return AsyncCommandHandle(self.sandbox, created["command"]["id"])

    async def connect(self, command_id: str) -> AsyncCommandHandle:
        await self.sandbox.client.json("GET", f"/v1/sandboxes/{self.sandbox.id}/commands/{command_id}")
        return AsyncCommandHandle(self.sandbox, command_id)

    async def list(self) -> List[Dict[str, Any]]:
        return (await self.sandbox.client.json("GET", f"/v1/sandboxes/{self.sandbox.id}/commands"))["commands"]


class AsyncFiles:
    """The files of a sandbox (`sandbox.files`) or of a volume
    (`volume.files`, no sandbox needed): the same calls on either."""

    def __init__(self, client: AsyncClient, route: str) -> None:
        self.client = client
        self._route = route

    def _path(self) -> str:
        return self._route

    async def write(self, path: str, data: Union[str, bytes], mode: Optional[str] = None) -> Dict[str, Any]:
        params = {"path": path}
        if mode:
            params["mode"] = mode
        return await self.client.json("PUT", self._path(), params=params, content=as_bytes(data))

    async def read(self, path: str) -> bytes:
        response = await self.client.request("GET", self._path(), params={"path": path})
        if response.headers.get("content-type", "").startswith("application/json"):
            raise SpaceError(f"{path} is a directory; use files.list", code="is_a_directory")
        return response.content

    async def list(self, path: str) -> List[Dict[str, Any]]:
        response = await self.client.request("GET", self._path(), params={"path": path})
        if not response.headers.get("content-type", "").startswith("application/json"):
            raise SpaceError(f"{path} is a file; use files.read", code="not_a_directory")
        return listing(response.json())

    async def remove(self, path: str, recursive: bool = False) -> None:
        params = {"path": path}
        if recursive:
            params["recursive"] = "true"
        await self.client.request("DELETE", self._path(), params=params)

    async def upload_tar(self, path: str, archive: Any) -> Dict[str, Any]:
        """Unpacks a tar archive (bytes, or a binary file) into directory
        `path`, made if missing."""
        body = archive.read() if hasattr(archive, "read") else bytes(archive)
        return await self.client.json("PUT", self._path(), params={"path": path, "format": "tar"}, content=body)

    async def download_tar(self, path: str) -> bytes:
        """Directory `path` and what it holds as a tar archive."""
        return (await self.client.request("GET", self._path(), params={"path": path, "format": "tar"})).content


class AsyncContext:
    """An interpreter kept alive in a sandbox (see `Context`)."""

    def __init__(self, sandbox: "AsyncSandbox", info: Dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.info = info
        self.id: str = info["id"]

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sandbox.id}/contexts/{self.id}{suffix}"

    async def run(self, code: str, *, timeout: Optional[float] = None, on_event: Optional[Any] = None,
                  env: Optional[Dict[str, str]] = None) -> Execution:
        body: Dict[str, Any] = {"code": code}
        if env:
            body["env"] = dict(env)
        if timeout is not None:
            body["timeout_s"] = int(timeout)
        execution = Execution()
        async with self.sandbox.client._http.stream("POST", self._path("/run"), json=body, timeout=None) as response:
            if response.status_code >= 400:
                await response.aread()
                raise error_from_response(response.status_code, response.json())
            async for line in response.aiter_lines():
                if line.strip():
                    event = json.loads(line)
                    if on_event:
                        on_event(event)
                    execution.add(event)
        return execution

    async def interrupt(self) -> None:
        await self.sandbox.client.json("POST", self._path("/interrupt"))

    async def restart(self) -> None:
        self.info = await self.sandbox.client.json("POST", self._path("/restart"))

    async def delete(self) -> None:
        await self.sandbox.client.request("DELETE", self._path())


class AsyncContexts:
    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self.sandbox = sandbox

    async def create(self, language: str = "python", *, cwd: Optional[str] = None,
                     env: Optional[Dict[str, str]] = None) -> AsyncContext:
        body: Dict[str, Any] = {"language": language, "env": env or {}}
        if cwd:
            body["cwd"] = cwd
        info = await self.sandbox.client.json("POST", f"/v1/sandboxes/{self.sandbox.id}/contexts", json=body)
        return AsyncContext(self.sandbox, info)

    async def list(self) -> List[AsyncContext]:
        listed = (await self.sandbox.client.json("GET", f"/v1/sandboxes/{self.sandbox.id}/contexts"))["contexts"]
        return [AsyncContext(self.sandbox, info) for info in listed]


class AsyncSandbox:
    def __init__(self, info: Dict[str, Any], client: AsyncClient, keep: bool = True) -> None:
        self.info = info
        self.id: str = info["id"]
        self.client = client
        self.keep = keep
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(client, f"/v1/sandboxes/{self.id}/files")
        self.contexts = AsyncContexts(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, state={self.info.get('state')!r})"

    @classmethod
    async def create(cls, template: str = "base", *, keep: bool = False, client: Optional[AsyncClient] = None,
                     timeout: float = 300.0, **spec: Any) -> "AsyncSandbox":
        client = client or AsyncClient()
        accepted = await client.json("POST", "/v1/sandboxes", json=create_body(template, spec))
        check_operation(await client.wait_operation(accepted["operation"]["id"], timeout))
        return cls(await client.json("GET", f"/v1/sandboxes/{accepted['sandbox']['id']}"), client, keep=keep)

    @classmethod
    async def connect(cls, sandbox_id: str, *, client: Optional[AsyncClient] = None) -> "AsyncSandbox":
        client = client or AsyncClient()
        return cls(await client.json("GET", f"/v1/sandboxes/{sandbox_id}"), client, keep=True)

    @classmethod
    async def list(cls, *, state: Optional[str] = None,
                   client: Optional[AsyncClient] = None) -> List["AsyncSandbox"]:
        client = client or AsyncClient()
        params = {"state": state} if state else None
        return [cls(s, client) for s in (await client.json("GET", "/v1/sandboxes", params=params))["sandboxes"]]

    async def refresh(self) -> Dict[str, Any]:
        self.info = await self.client.json("GET", f"/v1/sandboxes/{self.id}")
        return self.info

    async def _lifecycle(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        accepted = await self.client.json(method, path, json=(body or {}) if method == "POST" else None)
        operation = check_operation(await self.client.wait_operation(accepted["operation"]["id"]))
        await self.refresh()
        return operation

    async def set_network(self, egress: str, allow: Sequence[str] = (), deny: Sequence[str] = (),
                    secrets: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """Replaces the sandbox's egress policy at once; returns the sandbox."""
        body: Dict[str, Any] = {"egress": egress, "allow": list(allow), "deny": list(deny)}
        if secrets:
            # ENV -> secret name: ENV holds a placeholder the gateway replaces.
            body["secrets"] = {env: {"secret": name} for env, name in secrets.items()}
        self.info = await self.client.json("PUT", f"/v1/sandboxes/{self.id}/network", json=body)
        return self.info

    def port_url(self, port: int, path: str = "/") -> str:
        """The API URL that reaches `path` on a server listening on `port`
        inside the sandbox (send the API key with it)."""
        return f"{self.client.url}/v1/sandboxes/{self.id}/ports/{port}/{path.lstrip('/')}"

    async def port_request(self, port: int, method: str, path: str = "/", **kwargs: Any) -> httpx.Response:
        """An HTTP request to a server listening on `port` inside the
        sandbox (a dev server, a notebook), through the API."""
        return await self.client.request(method, f"/v1/sandboxes/{self.id}/ports/{port}/{path.lstrip('/')}", **kwargs)

    async def egress_log(self, limit: int = 1000) -> List[Dict[str, Any]]:
        """Every connection the sandbox made through the egress gateway."""
        return (await self.client.json("GET", f"/v1/sandboxes/{self.id}/egress", params={"limit": limit}))["events"]

    async def pause(self) -> Dict[str, Any]:
        return await self._lifecycle("POST", f"/v1/sandboxes/{self.id}/pause")

    async def resume(self) -> Dict[str, Any]:
        return await self._lifecycle("POST", f"/v1/sandboxes/{self.id}/resume")

    async def suspend(self) -> Dict[str, Any]:
        return await self._lifecycle("POST", f"/v1/sandboxes/{self.id}/suspend")

    async def delete(self) -> Dict[str, Any]:
        return await self._lifecycle("DELETE", f"/v1/sandboxes/{self.id}")

    async def fork(self, count: int = 1, *, labels: Optional[Dict[str, str]] = None,
                   timeout: float = 300.0) -> List["AsyncSandbox"]:
        """`count` copies of this running sandbox at one instant; returns once they run."""
        body = {"count": count, "labels": labels or {}}
        accepted = await self.client.json("POST", f"/v1/sandboxes/{self.id}/fork", json=body)
        check_operation(await self.client.wait_operation(accepted["operation"]["id"], timeout))
        return [AsyncSandbox(await self.client.json("GET", f"/v1/sandboxes/{s['id']}"), self.client, keep=self.keep)
                for s in accepted["sandboxes"]]

    async def checkpoint(self, name: str) -> Dict[str, Any]:
        return await self._lifecycle("POST", f"/v1/sandboxes/{self.id}/checkpoints", {"name": name})

    async def checkpoints(self) -> List[Dict[str, Any]]:
        return (await self.client.json("GET", f"/v1/sandboxes/{self.id}/checkpoints"))["checkpoints"]

    async def restore(self, name: str) -> Dict[str, Any]:
        return await self._lifecycle("POST", f"/v1/sandboxes/{self.id}/checkpoints/{name}/restore")

    async def delete_checkpoint(self, name: str) -> None:
        await self.client.request("DELETE", f"/v1/sandboxes/{self.id}/checkpoints/{name}")

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.keep:
            await self.delete()





class AsyncTemplate:
    """Templates sandboxes start from."""

    @staticmethod
    async def from_sandbox(name: str, sandbox: Union["AsyncSandbox", str], *, checkpoint: Optional[str] = None,
                           client: Optional[AsyncClient] = None, timeout: float = 300.0,
                           **defaults: Any) -> Dict[str, Any]:
        """A snapshot template of a running sandbox (or of one of its
        checkpoints); returns the template once it is ready."""
        client = sandbox.client if isinstance(sandbox, AsyncSandbox) else (client or AsyncClient())
        accepted = await client.json("POST", "/v1/templates", json=template_from(name, sandbox, checkpoint, defaults))
        check_operation(await client.wait_operation(accepted["operation"]["id"], timeout))
        return await client.json("GET", f"/v1/templates/{name}")

    @staticmethod
    async def from_image(name: str, reference: str, *, secret: Optional[str] = None,
                         username: Optional[str] = None, client: Optional[AsyncClient] = None,
                         timeout: float = 900.0, **defaults: Any) -> Dict[str, Any]:
        """A template of an image in an OCI registry (see
        ``Template.from_image``); returns the template once it is ready."""
        client = client or AsyncClient()
        body = image_template(name, reference, secret, username, defaults)
        accepted = await client.json("POST", "/v1/templates", json=body)
        check_operation(await client.wait_operation(accepted["operation"]["id"], timeout))
        return await client.json("GET", f"/v1/templates/{name}")

    @staticmethod
    async def build(name: str, dockerfile: str, context_dir: Optional[str] = None, *,
                    build_args: Optional[Dict[str, str]] = None, target: Optional[str] = None,
                    network: Optional[Dict[str, Any]] = None, secret: Optional[str] = None,
                    username: Optional[str] = None, client: Optional[AsyncClient] = None,
                    timeout: float = 1800.0, **defaults: Any) -> Dict[str, Any]:
        """A template built from a Dockerfile (see ``Template.build``)."""
        client = client or AsyncClient()
        form = dockerfile_build(name, dockerfile, context_dir, build_args, target, network, secret, username, defaults)
        accepted = await client.json("POST", "/v1/templates/builds", files=form)
        check_operation(await client.wait_operation(accepted["operation"]["id"], timeout))
        return await client.json("GET", f"/v1/templates/{name}")


class AsyncVolume:
    """A volume of yours (see `Volume`), with `await`."""

    def __init__(self, info: Dict[str, Any], client: AsyncClient) -> None:
        self.info = info
        self.name: str = info["name"]
        self.client = client
        self.files = AsyncFiles(client, f"/v1/volumes/{self.name}/files")

    def __repr__(self) -> str:
        return f"AsyncVolume({self.name!r}, size_mib={self.info.get('size_mib')!r})"

    def _path(self, suffix: str = "") -> str:
        return f"/v1/volumes/{self.name}{suffix}"

    @classmethod
    async def create(cls, name: str, *, size_mib: Optional[int] = None, from_snapshot: Any = None,
                     client: Optional[AsyncClient] = None) -> "AsyncVolume":
        """Makes a volume: empty, or a copy of a snapshot (`"VOLUME/SNAPSHOT"`)."""
        client = client or AsyncClient()
        return cls(await client.json("POST", "/v1/volumes", json=volume_body(name, size_mib, from_snapshot)), client)

    @classmethod
    async def get(cls, name: str, *, client: Optional[AsyncClient] = None) -> "AsyncVolume":
        client = client or AsyncClient()
        return cls(await client.json("GET", f"/v1/volumes/{name}"), client)

    @classmethod
    async def list(cls, *, client: Optional[AsyncClient] = None) -> List["AsyncVolume"]:
        client = client or AsyncClient()
        return [cls(v, client) for v in (await client.json("GET", "/v1/volumes"))["volumes"]]

    async def refresh(self) -> Dict[str, Any]:
        self.info = await self.client.json("GET", self._path())
        return self.info

    def mount(self, path: str, read_only: bool = False) -> VolumeMount:
        """This volume at `path`, for `AsyncSandbox.create(volumes=[...])`."""
        return VolumeMount(self.name, path, read_only)

    async def delete(self) -> None:
        await self.client.request("DELETE", self._path())

    async def snapshot(self, name: str) -> Dict[str, Any]:
        return await self.client.json("POST", self._path("/snapshots"), json={"name": name})

    async def snapshots(self) -> List[Dict[str, Any]]:
        return (await self.client.json("GET", self._path("/snapshots")))["snapshots"]

    async def restore(self, snapshot: str) -> Dict[str, Any]:
        self.info = await self.client.json("POST", self._path(f"/snapshots/{snapshot}/restore"))
        return self.info

    async def delete_snapshot(self, name: str) -> None:
        await self.client.request("DELETE", self._path(f"/snapshots/{name}"))

    async def move(self, node: str) -> Dict[str, Any]:
        answer = await self.client.json("POST", self._path("/move"), json={"node": node})
        if isinstance(answer, dict) and (answer.get("operation") or {}).get("id"):
            check_operation(await self.client.wait_operation(answer["operation"]["id"]))
        return await self.refresh()
