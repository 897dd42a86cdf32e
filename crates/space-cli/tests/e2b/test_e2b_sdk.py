"""The unmodified `e2b` SDK from PyPI against SPACE's E2B-compatible API.

Run by `crates/space-cli/tests/e2b.rs` against a real `space serve` and real
sandboxes, with only E2B's own environment variables set:
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (plus, for the tenancy check,
SPACE_OTHER_KEY: a key of another tenant).
"""

import asyncio
import io
import json
import os
import threading
import time
import unittest
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone

from e2b import (
    AsyncSandbox,
    AuthenticationException,
    FilesystemEventType,
    InvalidArgumentException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.filesystem import WriteEntry

RUN = uuid.uuid4().hex[:12]


def wait_until(what, check, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Commands(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create(timeout=600, metadata={"suite": RUN, "part": "commands"}, envs={"FROM_CREATE": "yes"})

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_foreground_output_and_exit_code(self):
        result = self.sbx.commands.run("echo hi; echo err >&2")
        self.assertEqual((result.stdout, result.stderr, result.exit_code), ("hi\n", "err\n", 0))

    def test_environment_working_directory_and_login_shell(self):
        result = self.sbx.commands.run('echo "$FROM_CREATE $X $(pwd)"; shopt -q login_shell && echo login', envs={"X": "y"}, cwd="/tmp")
        self.assertEqual(result.stdout, "yes y /tmp\nlogin\n")

    def test_a_non_zero_exit_raises_with_the_output(self):
        with self.assertRaises(CommandExitException) as raised:
            self.sbx.commands.run("echo out; echo bad >&2; exit 3")
        self.assertEqual(raised.exception.exit_code, 3)
        self.assertEqual(raised.exception.stdout, "out\n")
        self.assertEqual(raised.exception.stderr, "bad\n")

    def test_another_user(self):
        result = self.sbx.commands.run("whoami; echo $HOME", user="nobody")
        self.assertEqual(result.stdout, "nobody\n/nonexistent\n")
        with self.assertRaises(SandboxException):
            self.sbx.commands.run("true", user="no-such-user")

    def test_a_missing_working_directory_is_an_error(self):
        with self.assertRaises(SandboxException):
            self.sbx.commands.run("true", cwd="/no/such/dir")

    def test_background_output_arrives_while_it_runs(self):
        first = threading.Event()
        seen = []

        def on_stdout(chunk):
            seen.append(chunk)
            first.set()

        handle = self.sbx.commands.run("echo first; sleep 30; echo never", background=True)
        ended = []

        def wait():
            try:
                handle.wait(on_stdout=on_stdout)
            except CommandExitException as e:
                ended.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        self.assertTrue(first.wait(20), "the first line streams before the command ends")
        self.assertIn(handle.pid, [p.pid for p in self.sbx.commands.list()])
        self.assertTrue(handle.kill())
        waiter.join(30)
        self.assertEqual([e.exit_code for e in ended], [-1])
        self.assertEqual("".join(seen), "first\n")

    def test_wait_for_a_background_command(self):
        handle = self.sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", background=True)
        self.assertEqual(handle.wait().stdout, "1\n2\n3\n")

    def test_stdin_send_and_close(self):
        handle = self.sbx.commands.run("cat", background=True, stdin=True)
        self.sbx.commands.send_stdin(handle.pid, "hello\n")
        self.sbx.commands.send_stdin(handle.pid, b"bytes too\n")
        self.sbx.commands.close_stdin(handle.pid)
        self.assertEqual(handle.wait().stdout, "hello\nbytes too\n")

    def test_connect_to_a_running_command(self):
        handle = self.sbx.commands.run("sleep 1; echo done", background=True)
        again = self.sbx.commands.connect(handle.pid)
        self.assertEqual(again.wait().stdout, "done\n")
        with self.assertRaises(NotFoundException):
            self.sbx.commands.connect(handle.pid)

    def test_kill_and_list(self):
        handle = self.sbx.commands.run("sleep 600", background=True)
        listed = {p.pid: p for p in self.sbx.commands.list()}
        self.assertEqual(listed[handle.pid].cmd, "/bin/bash")
        self.assertTrue(self.sbx.commands.kill(handle.pid))
        wait_until("the killed command to leave the list", lambda: handle.pid not in [p.pid for p in self.sbx.commands.list()])
        self.assertFalse(self.sbx.commands.kill(handle.pid))

    def test_the_timeout_ends_the_command(self):
        started = time.time()
        with self.assertRaises((CommandExitException, TimeoutException)):
            self.sbx.commands.run("sleep 60", timeout=2)
        self.assertLess(time.time() - started, 30)
        wait_until("no sleep left", lambda: "sleep 60" not in self.sbx.commands.run("ps -eo args || true").stdout)


class Files(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create(metadata={"suite": RUN, "part": "files"})

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_write_read_and_describe(self):
        info = self.sbx.files.write("/tmp/e2b/hello.txt", "hello")
        self.assertEqual(info.path, "/tmp/e2b/hello.txt")
        self.assertEqual(self.sbx.files.read("/tmp/e2b/hello.txt"), "hello")
        self.assertEqual(self.sbx.files.read("/tmp/e2b/hello.txt", format="bytes"), b"hello")
        entry = self.sbx.files.get_info("/tmp/e2b/hello.txt")
        self.assertEqual((entry.name, entry.type, entry.size), ("hello.txt", FileType.FILE, 5))
        self.assertEqual(entry.permissions, "-rw-r--r--")
        has_user = self.sbx.commands.run("id -u user || true", user="root").stdout.strip() != ""
        self.assertEqual(entry.owner, "user" if has_user else "root")

    def test_binary_file_objects_and_many_files(self):
        payload = bytes(range(256)) * 4096
        self.sbx.files.write("/tmp/e2b/blob.bin", io.BytesIO(payload))
        self.assertEqual(self.sbx.files.read("/tmp/e2b/blob.bin", format="bytes"), payload)
        written = self.sbx.files.write_files([
            WriteEntry(path="/tmp/e2b/many/a.txt", data="A"),
            WriteEntry(path="/tmp/e2b/many/b.txt", data=b"B"),
        ])
        self.assertEqual(sorted(w.path for w in written), ["/tmp/e2b/many/a.txt", "/tmp/e2b/many/b.txt"])
        self.assertEqual(self.sbx.commands.run("cat /tmp/e2b/many/a.txt /tmp/e2b/many/b.txt").stdout, "AB")

    def test_list_make_dir_rename_remove(self):
        self.assertTrue(self.sbx.files.make_dir("/tmp/e2b/tree/sub"))
        self.assertFalse(self.sbx.files.make_dir("/tmp/e2b/tree/sub"))
        self.sbx.files.write("/tmp/e2b/tree/sub/deep.txt", "deep")
        self.sbx.files.write("/tmp/e2b/tree/top.txt", "top")
        top = {e.name: e for e in self.sbx.files.list("/tmp/e2b/tree")}
        self.assertEqual(sorted(top), ["sub", "top.txt"])
        self.assertEqual(top["sub"].type, FileType.DIR)
        self.assertEqual(top["top.txt"].path, "/tmp/e2b/tree/top.txt")
        deep = [e.path for e in self.sbx.files.list("/tmp/e2b/tree", depth=2)]
        self.assertIn("/tmp/e2b/tree/sub/deep.txt", deep)
        moved = self.sbx.files.rename("/tmp/e2b/tree/top.txt", "/tmp/e2b/tree/moved.txt")
        self.assertEqual(moved.path, "/tmp/e2b/tree/moved.txt")
        self.assertEqual(self.sbx.files.read("/tmp/e2b/tree/moved.txt"), "top")
        self.assertFalse(self.sbx.files.exists("/tmp/e2b/tree/top.txt"))
        self.sbx.files.remove("/tmp/e2b/tree")
        self.assertFalse(self.sbx.files.exists("/tmp/e2b/tree"))
        self.sbx.files.remove("/tmp/e2b/tree")  # removing what is gone succeeds

    def test_missing_paths_and_relative_paths(self):
        with self.assertRaises(FileNotFoundException):
            self.sbx.files.read("/tmp/no/such/file")
        with self.assertRaises(FileNotFoundException):
            self.sbx.files.get_info("/tmp/no/such/file")
        with self.assertRaises(NotFoundException):
            self.sbx.files.list("/tmp/no/such/dir")
        self.sbx.files.write("relative.txt", "in the home")
        self.assertEqual(self.sbx.commands.run("cat ~/relative.txt").stdout, "in the home")


class Envd(unittest.TestCase):
    """What E2B's envd does that its own test suite checks, each once."""

    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create(timeout=600, metadata={"suite": RUN, "part": "envd"})
        # E2B's sandboxes have the account `user`; SPACE's E2B template
        # brings it, and a sandbox that has it is served as E2B serves.
        # Made here (a template built before it lacks it), `user` is in
        # group sudo; the template build's sudoers file grants it too.
        cls.sbx.commands.run("id -u user >/dev/null 2>&1 || useradd -m -s /bin/bash -G sudo user", user="root")

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_the_default_user_and_home(self):
        self.assertEqual(self.sbx.commands.run("whoami; pwd").stdout, "user\n/home/user\n")
        self.assertEqual(self.sbx.commands.run("whoami", user="root").stdout, "root\n")
        self.sbx.files.write("owned/by-user.txt", "mine")
        entry = self.sbx.files.get_info("owned/by-user.txt")
        self.assertEqual((entry.path, entry.owner, entry.group), ("/home/user/owned/by-user.txt", "user", "user"))
        self.assertEqual(self.sbx.files.get_info("owned").owner, "user", "the directories a write makes are the user's")
        self.assertEqual(self.sbx.files.get_info("/root", user="root").path, "/root")

    def test_sudo_raises_the_default_user(self):
        # gVisor honours no setuid bit: the sandbox's sudo asks its agent.
        self.assertEqual(self.sbx.commands.run("sudo whoami").stdout, "root\n")
        self.assertEqual(self.sbx.commands.run('sudo echo "$FOO"', envs={"FOO": "bar"}).stdout, "bar\n")
        self.assertEqual(self.sbx.commands.run("sudo -u user id -un").stdout, "user\n")

    def test_a_pty_reconnected_answers_as_a_pty(self):
        terminal = self.sbx.pty.create(PtySize(80, 24))
        terminal.disconnect()
        again = self.sbx.pty.connect(terminal.pid)
        self.sbx.pty.send_stdin(terminal.pid, b"echo $((6 * 7))\nexit\n")
        seen = []
        result = again.wait(on_pty=lambda data: seen.append(data))
        self.assertEqual(result.exit_code, 0)
        self.assertIn(b"42", b"".join(seen))
        self.assertEqual(result.stdout, "", "a pty's output is not stdout")

    def test_a_command_past_its_timeout_is_a_timeout(self):
        async def run():
            sbx = await AsyncSandbox.connect(self.sbx.sandbox_id)
            await sbx.commands.run("sleep 20", timeout=2)

        started = time.time()
        with self.assertRaises(TimeoutException):
            asyncio.run(run())
        self.assertLess(time.time() - started, 15)

    def test_a_connection_past_its_timeout_is_a_timeout_and_the_command_goes_on(self):
        handle = self.sbx.commands.run("sleep 30", background=True)
        try:
            again = self.sbx.commands.connect(handle.pid, timeout=2)
            with self.assertRaises(TimeoutException):
                again.wait()
            self.assertIn(handle.pid, [p.pid for p in self.sbx.commands.list()])
        finally:
            handle.kill()

    def test_proc_files_are_read_whole(self):
        status = self.sbx.files.read("/proc/self/status")
        self.assertIn("Name:", status)

    def test_lists_walk_depth_first_with_owners(self):
        for path in ["walk/b/x", "walk/a/y", "walk/c"]:
            self.sbx.files.make_dir(path)
        self.sbx.files.write("walk/a/f.txt", "f")
        listed = self.sbx.files.list("walk", depth=2)
        self.assertEqual([e.path.removeprefix("/home/user/walk/") for e in listed], ["a", "a/f.txt", "a/y", "b", "b/x", "c"])
        self.assertEqual({(e.owner, e.group) for e in listed}, {("user", "user")})

    def test_a_symlink_is_described_by_its_target(self):
        self.sbx.files.write("links/target.txt", "t")
        self.sbx.commands.run("ln -sf target.txt link.txt && ln -sf /nowhere dangling", cwd="/home/user/links")
        entry = self.sbx.files.get_info("links/link.txt")
        self.assertEqual((entry.name, entry.type, entry.size), ("link.txt", FileType.FILE, 1))
        self.assertEqual(entry.symlink_target, "/home/user/links/target.txt")
        listed = {e.name: e for e in self.sbx.files.list("links")}
        self.assertEqual(listed["link.txt"].symlink_target, "/home/user/links/target.txt")
        self.assertEqual(listed["dangling"].type, FileType.SYMLINK)

    def test_metadata_is_refused_not_dropped(self):
        self.assertGreaterEqual(str(self.sbx._envd_version), "0.6.2")
        with self.assertRaises(InvalidArgumentException):
            self.sbx.files.write("meta.txt", "m", metadata={"k": "v"})
        self.assertFalse(self.sbx.files.exists("meta.txt"))

    def test_watching_a_directory(self):
        self.sbx.files.make_dir("watched/deep")
        handle = self.sbx.files.watch_dir("watched", recursive=True, include_entry=True)
        try:
            self.sbx.files.write("watched/deep/new.txt", "one")
            # What was done before a poll is in it.
            events = [(e.type, e.name) for e in handle.get_new_events()]
            self.assertEqual(
                events,
                [
                    (FilesystemEventType.CREATE, "deep/new.txt"),
                    (FilesystemEventType.CHMOD, "deep/new.txt"),
                    (FilesystemEventType.WRITE, "deep/new.txt"),
                ],
            )
            self.sbx.files.rename("watched/deep/new.txt", "watched/moved.txt")
            self.sbx.files.remove("watched/moved.txt")
            events = [(e.type, e.name) for e in handle.get_new_events()]
            self.assertEqual(
                events,
                [
                    (FilesystemEventType.RENAME, "deep/new.txt"),
                    (FilesystemEventType.CREATE, "moved.txt"),
                    (FilesystemEventType.REMOVE, "moved.txt"),
                ],
            )
        finally:
            handle.stop()
        self.assert_no_watcher_left("/home/user/watched")
        with self.assertRaises(FileNotFoundException):
            self.sbx.files.watch_dir("not-there")
        with self.assertRaises(SandboxException):
            self.sbx.files.watch_dir("watched/deep/../../owned/by-user.txt")

    def test_watching_a_directory_as_a_stream(self):
        async def watch():
            sbx = await AsyncSandbox.connect(self.sbx.sandbox_id)
            await sbx.files.make_dir("streamed")
            seen = asyncio.Event()

            def on_event(event):
                if event.type == FilesystemEventType.WRITE and event.name == "s.txt":
                    seen.set()

            handle = await sbx.files.watch_dir("streamed", on_event=on_event)
            await sbx.files.write("streamed/s.txt", "s")
            await asyncio.wait_for(seen.wait(), 30)
            await handle.stop()

        # (Its watcher ends when the client's connection does, which the
        # SDK's pool decides: not checked here.)
        asyncio.run(watch())

    def assert_no_watcher_left(self, path):
        # A watcher is a process in the sandbox: stopped, it is gone.
        def gone():
            return not [
                line
                for line in self.sbx.commands.run("ps -eo args", user="root").stdout.splitlines()
                if "space-agent watch" in line and line.endswith(path)
            ]

        wait_until("the watcher to end", gone)

    @unittest.skipIf(os.environ.get("SPACE_THROUGH_CONTROL_PLANE"), "a control plane does not serve signed file URLs")
    def test_signed_file_urls(self):
        self.sbx.files.write("signed.txt", "signed")
        with urllib.request.urlopen(self.sbx.download_url("signed.txt"), timeout=30) as answer:
            self.assertEqual(answer.read(), b"signed")
        with urllib.request.urlopen(self.sbx.download_url("signed.txt", use_signature_expiration=60), timeout=30) as answer:
            self.assertEqual(answer.read(), b"signed")
        refused = []
        expired = self.sbx.download_url("signed.txt", use_signature_expiration=-60)
        forged = self.sbx.download_url("signed.txt").replace("signed.txt", "other.txt")
        for url in [expired, forged]:
            with self.assertRaises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(url, timeout=30)
            refused.append((raised.exception.code, json.loads(raised.exception.read())["message"]))
        self.assertEqual(refused, [(401, "signature is already expired"), (401, "invalid signature")])
        boundary = "space-boundary"
        body = (
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"up.txt\"\r\n\r\n"
            f"uploaded\r\n--{boundary}--\r\n"
        ).encode()
        upload = urllib.request.Request(
            self.sbx.upload_url("up.txt"), data=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
        )
        with urllib.request.urlopen(upload, timeout=30) as answer:
            self.assertEqual(answer.status, 200)
        self.assertEqual(self.sbx.files.read("up.txt"), "uploaded")
        self.assertEqual(self.sbx.files.get_info("up.txt").owner, "user")

    def test_a_killed_sandbox_breaks_a_running_command(self):
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "killed"})
        handle = sbx.commands.run("sleep 60", background=True)
        sbx.kill()
        # The stream breaks off with a reset, as a connection to envd in a
        # sandbox that is gone does: the SDK raises its timeout error and,
        # the sandbox gone, names the kill.
        with self.assertRaises(TimeoutException) as raised:
            handle.wait()
        self.assertIn("sandbox was killed or reached its end of life", str(raised.exception))


class ControlPlane(unittest.TestCase):
    def test_info_list_timeout_and_metrics(self):
        sbx = Sandbox.create(timeout=120, metadata={"suite": RUN, "part": "control plane", "odd key": "a&b=c"})
        try:
            info = sbx.get_info()
            self.assertEqual(info.sandbox_id, sbx.sandbox_id)
            self.assertEqual(info.metadata["part"], "control plane")
            self.assertEqual(info.state, SandboxState.RUNNING)
            before = info.end_at
            self.assertLess((before - datetime.now(timezone.utc)).total_seconds(), 125)
            sbx.set_timeout(900)
            after = sbx.get_info().end_at
            self.assertGreater((after - datetime.now(timezone.utc)).total_seconds(), 800)

            found = Sandbox.list(query=SandboxQuery(metadata={"suite": RUN, "odd key": "a&b=c"})).next_items()
            self.assertEqual([s.sandbox_id for s in found], [sbx.sandbox_id])
            none = Sandbox.list(query=SandboxQuery(metadata={"suite": RUN, "odd key": "other"})).next_items()
            self.assertEqual(none, [])

            self.assertTrue(sbx.is_running())
            metrics = sbx.get_metrics()
            self.assertTrue(metrics and metrics[-1].mem_used > 0, metrics)
            self.assertEqual(metrics[-1].cpu_count, info.cpu_count)
        finally:
            sbx.kill()

    def test_a_sandbox_ends_at_its_timeout(self):
        sbx = Sandbox.create(timeout=3, metadata={"suite": RUN, "part": "timeout"})
        self.assertEqual(sbx.commands.run("echo alive").stdout, "alive\n")

        def gone():
            try:
                Sandbox.get_info(sbx.sandbox_id)
                return False
            except NotFoundException:
                return True

        wait_until("the sandbox to be killed at its timeout", gone, seconds=60)
        self.assertFalse(sbx.is_running())

    def test_a_sandbox_that_pauses_at_its_timeout(self):
        sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause"}, metadata={"suite": RUN, "part": "autopause"})
        try:
            sbx.files.write("/tmp/kept", "across the pause")
            wait_until("the sandbox to pause at its timeout", lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, seconds=60)
            self.assertFalse(sbx.is_running())
            again = Sandbox.connect(sbx.sandbox_id, timeout=60)
            self.assertEqual(again.files.read("/tmp/kept"), "across the pause")
        finally:
            Sandbox.kill(sbx.sandbox_id)

    def test_pages_of_a_list(self):
        sandboxes = [Sandbox.create(metadata={"suite": RUN, "part": "pages"}) for _ in range(3)]
        try:
            pager = Sandbox.list(query=SandboxQuery(metadata={"suite": RUN, "part": "pages"}), limit=2)
            ids = []
            while pager.has_next:
                ids += [s.sandbox_id for s in pager.next_items()]
            self.assertEqual(sorted(ids), sorted(s.sandbox_id for s in sandboxes))
        finally:
            for sbx in sandboxes:
                sbx.kill()

    def test_pause_connect_and_kill(self):
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "lifecycle"})
        sbx.files.write("/tmp/state", "kept")
        handle = sbx.commands.run("sleep 600", background=True)
        self.assertTrue(sbx.pause())
        self.assertFalse(sbx.is_running())
        self.assertFalse(sbx.pause(), "pausing a paused sandbox")
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"suite": RUN})).next_items()
        self.assertIn(sbx.sandbox_id, [s.sandbox_id for s in paused])
        with self.assertRaises(SandboxException):
            sbx.commands.run("true")

        again = Sandbox.connect(sbx.sandbox_id)
        self.assertTrue(again.is_running())
        self.assertEqual(again.files.read("/tmp/state"), "kept")
        self.assertIn(handle.pid, [p.pid for p in again.commands.list()], "a process survives pause and connect")
        self.assertEqual(again.commands.run("echo back").stdout, "back\n")

        self.assertTrue(again.kill())
        self.assertFalse(again.is_running())
        with self.assertRaises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
        self.assertFalse(Sandbox.kill(sbx.sandbox_id))
        with self.assertRaises(SandboxException):
            again.commands.run("true")
        self.assertNotIn(sbx.sandbox_id, [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": RUN})).next_items()])


class Errors(unittest.TestCase):
    def test_a_wrong_key_is_refused(self):
        with self.assertRaises(AuthenticationException):
            Sandbox.create(api_key="space_" + "0" * 40)
        with self.assertRaises(AuthenticationException):
            Sandbox.list(api_key="space_" + "0" * 40).next_items()

    def test_missing_sandbox_and_template(self):
        with self.assertRaises(NotFoundException):
            Sandbox.connect("sbx_00000000000000000000")
        with self.assertRaises(NotFoundException):
            Sandbox.get_info("sbx_00000000000000000000")
        with self.assertRaises(SandboxException):
            Sandbox.create(template="no-such-template")

    def test_another_tenant_sees_nothing(self):
        other = os.environ["SPACE_OTHER_KEY"]
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "tenancy"})
        try:
            with self.assertRaises(NotFoundException):
                Sandbox.connect(sbx.sandbox_id, api_key=other)
            self.assertFalse(Sandbox.kill(sbx.sandbox_id, api_key=other))
            listed = Sandbox.list(api_key=other).next_items()
            self.assertNotIn(sbx.sandbox_id, [s.sandbox_id for s in listed])
            self.assertTrue(sbx.is_running())
        finally:
            sbx.kill()

    def test_envd_needs_the_sandbox_token(self):
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "token"})
        try:
            base = os.environ["E2B_SANDBOX_URL"]
            for token in [None, "wrong"]:
                request = urllib.request.Request(
                    f"{base}/filesystem.Filesystem/Stat",
                    data=json.dumps({"path": "/etc/hostname"}).encode(),
                    headers={"Content-Type": "application/json", "E2b-Sandbox-Id": sbx.sandbox_id, **({"X-Access-Token": token} if token else {})},
                )
                with self.assertRaises(urllib.error.HTTPError) as raised:
                    urllib.request.urlopen(request, timeout=30)
                self.assertEqual(raised.exception.code, 401)
            # Without the token, an unknown sandbox answers the same: no
            # telling which ids exist.
            answers = []
            for sandbox_id in [sbx.sandbox_id, sbx.sandbox_id[:-1] + ("0" if sbx.sandbox_id[-1] != "0" else "1")]:
                request = urllib.request.Request(f"{base}/health", headers={"E2b-Sandbox-Id": sandbox_id})
                with self.assertRaises(urllib.error.HTTPError) as raised:
                    urllib.request.urlopen(request, timeout=30)
                answers.append((raised.exception.code, raised.exception.read()))
            self.assertEqual(answers[0], answers[1])
            self.assertEqual(answers[0][0], 401)
            self.assertTrue(sbx.files.exists("/etc/hostname"))
        finally:
            sbx.kill()

    def test_network_rules_are_refused_not_dropped(self):
        # A rule SPACE would enforce differently makes no sandbox (the rules
        # it enforces: test_e2b_control.py): one made without it would be
        # more open than asked for.
        part = {"suite": RUN, "part": "locked-down"}
        for network in [{"allow_out": ["pkgs.space.test"]}, {"deny_out": ["10.0.0.0/8"], "allow_out": ["10.0.0.1"]}]:
            with self.assertRaises(SandboxException) as raised:
                Sandbox.create(allow_internet_access=True, network=network, metadata=part)
            self.assertIn("denyOut", str(raised.exception))
        self.assertEqual(Sandbox.list(query=SandboxQuery(metadata=part)).next_items(), [])
        # allow_internet_access alone is served.
        sbx = Sandbox.create(allow_internet_access=False, metadata=part)
        try:
            self.assertFalse(sbx.get_info().allow_internet_access)
        finally:
            sbx.kill()

    def test_unsupported_calls_answer_with_an_error(self):
        request = urllib.request.Request(
            os.environ["E2B_API_URL"] + "/templates", headers={"X-API-KEY": os.environ["E2B_API_KEY"]}
        )
        with self.assertRaises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=30)
        self.assertEqual(raised.exception.code, 501)
        self.assertEqual(json.loads(raised.exception.read())["code"], 501)


if __name__ == "__main__":
    unittest.main()
