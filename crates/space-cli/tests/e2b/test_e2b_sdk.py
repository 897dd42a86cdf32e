"""The unmodified `e2b` SDK from PyPI against SPACE's E2B-compatible API.

Run by `crates/space-cli/tests/e2b.rs` against a real `space serve` and real
sandboxes, with only E2B's own environment variables set:
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (plus, for the tenancy check,
SPACE_OTHER_KEY: a key of another tenant).
"""

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
    AuthenticationException,
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
        self.assertEqual(entry.owner, "root")

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
        # SPACE does not enforce E2B's network rules (yet): a sandbox made
        # without them would be more open than asked for.
        part = {"suite": RUN, "part": "locked-down"}
        for network in [{"deny_out": ["0.0.0.0/0"]}, {"allow_out": ["10.0.0.1"], "deny_out": ["0.0.0.0/0"]}]:
            with self.assertRaises(SandboxException) as raised:
                Sandbox.create(allow_internet_access=True, network=network, metadata=part)
            self.assertIn("network rules", str(raised.exception))
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
