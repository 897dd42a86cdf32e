"""The SDK against a real SPACE server and real sandboxes (SPACE_URL and
SPACE_API_KEY point at it). Run: python -m unittest discover -s sdk/python/tests"""

import asyncio
import threading
import time
import unittest

from space_sdk import (AsyncClient, AsyncSandbox, AsyncTemplate, Client, ConflictError, InvalidRequestError, NotFoundError, Sandbox,
                       SpaceError, Template)


class SyncSdk(unittest.TestCase):
    def test_the_whole_surface(self):
        sbx = Sandbox.create(template="base", env={"WHO": "sdk"})
        try:
            self.assertEqual(sbx.info["state"], "running")
            result = sbx.commands.run("echo hello $WHO; echo oops >&2; exit 4")
            self.assertEqual((result.stdout, result.stderr, result.exit_code), ("hello sdk\n", "oops\n", 4))
            self.assertFalse(result.timed_out)
            timed = sbx.commands.run(["sleep", "30"], timeout=1)
            self.assertTrue(timed.timed_out)

            sbx.files.write("/root/sdk/notes.txt", "written by the sdk")
            self.assertEqual(sbx.files.read("/root/sdk/notes.txt"), b"written by the sdk")
            names = [entry["name"] for entry in sbx.files.list("/root/sdk")]
            self.assertEqual(names, ["notes.txt"])
            sbx.files.remove("/root/sdk", recursive=True)
            with self.assertRaises(NotFoundError):
                sbx.files.read("/root/sdk/notes.txt")

            handle = sbx.commands.start("for i in 1 2 3; do echo line $i; sleep 0.2; done; exit 2")
            events = list(handle.stream())
            self.assertEqual("".join(e.text for e in events if e.type == "stdout"), "line 1\nline 2\nline 3\n")
            self.assertEqual(events[-1].type, "exit")
            self.assertEqual(events[-1].result["exit_code"], 2)
            again = sbx.commands.connect(handle.id).wait()
            self.assertEqual((again.stdout, again.exit_code), ("line 1\nline 2\nline 3\n", 2))

            cat = sbx.commands.start(["cat"], stdin=True)
            cat.send_stdin("fed through stdin\n")
            cat.close_stdin()
            self.assertEqual(cat.wait().stdout, "fed through stdin\n")
            sleeper = sbx.commands.start(["sleep", "60"])
            sleeper.signal("TERM")
            self.assertEqual(sleeper.wait().signal, "TERM")

            with sbx.commands.start(["cat"], stdin=True).attach() as session:
                session.send(b"over the websocket\n")
                session.close_stdin()
                received = b"".join(session.output())
            self.assertEqual(received, b"over the websocket\n")
            self.assertEqual(session.result["exit_code"], 0)

            sbx.commands.run("echo kept > /tmp/state")
            sbx.suspend()
            self.assertEqual(sbx.state, "suspended")
            sbx.resume()
            sbx.pause()
            self.assertEqual(sbx.state, "paused")
            with self.assertRaises(ConflictError) as raised:
                sbx.commands.run("true")
            self.assertEqual(raised.exception.code, "invalid_state")
            sbx.resume()
            self.assertEqual(sbx.commands.run("cat /tmp/state").stdout, "kept\n")
            # Egress: refused by default, with the reason; a policy set live.
            denied = sbx.commands.run("python3 -c \"import urllib.request\ntry:\n    urllib.request.urlopen('http://pkgs.space.test/')\nexcept Exception as e:\n    print(e)\"")
            self.assertIn("403", denied.stdout)
            updated = sbx.set_network("allowlist", allow=["pkgs.space.test"], deny=["bad.space.test"])
            self.assertEqual(updated["network"]["allow"], ["pkgs.space.test"])
            log = sbx.egress_log()
            self.assertEqual((log[0]["host"], log[0]["reason"]), ("pkgs.space.test", "egress_disabled"))
            # Secrets: written, listed without values, bound as a placeholder.
            client = sbx.client
            info = client.put_secret("sdk-token", "sdk-value-1", hosts=["api.space.test"])
            self.assertEqual(info["hosts"], ["api.space.test"])
            self.assertNotIn("sdk-value-1", repr(client.list_secrets()))
            bound = sbx.set_network("allowlist", secrets={"SDK_TOKEN": "sdk-token"})
            placeholder = bound["network"]["secrets"]["SDK_TOKEN"]["placeholder"]
            self.assertTrue(placeholder.startswith("space_ph_"))
            client.delete_secret("sdk-token")
            # A server inside the sandbox, through the API.
            sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
            deadline = time.monotonic() + 60
            while True:
                try:
                    page = sbx.port_request(8000, "GET", "/")
                    break
                except SpaceError as err:
                    if err.code != "port_closed" or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            self.assertIn("Directory listing", page.text)
            self.assertTrue(sbx.port_url(8000, "/x").endswith(f"/v1/sandboxes/{sbx.id}/ports/8000/x"))
            self.assertEqual([s for s in client.list_secrets() if s["name"] == "sdk-token"], [])
            self.assertIn(sbx.id, [s.id for s in Sandbox.list()])
            self.assertEqual(Sandbox.connect(sbx.id).id, sbx.id)
        finally:
            sbx.delete()
        self.assertEqual(sbx.info["state"], "deleted")

    def test_context_manager_deletes_unless_kept(self):
        with Sandbox.create() as sbx:
            self.assertEqual(sbx.commands.run(["true"]).exit_code, 0)
        self.assertEqual(Sandbox.connect(sbx.id).info["state"], "deleted")

    def test_events_tell_what_happened_live_and_again_later(self):
        client = Client()
        newest = list(client.events(limit=1))
        start = newest[-1]["id"] + 1 if newest else 0
        seen, target = [], []

        def follow():
            for event in client.events(follow=True, from_id=start, types=["sandbox", "command"]):
                seen.append(event)
                sandbox = event.get("sandbox") or {}
                if target and event.get("sandbox_id") == target[0] and sandbox.get("state") == "deleted":
                    return

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        sbx = Sandbox.create()
        target.append(sbx.id)
        self.assertEqual(sbx.commands.run("exit 3").exit_code, 3)
        sbx.delete()
        follower.join(60)
        self.assertFalse(follower.is_alive(), "the followed stream never showed the delete")
        mine = [e for e in seen if e.get("sandbox_id") == sbx.id]
        steps = [(e["type"], (e.get("sandbox") or {}).get("state")) for e in mine]
        for step in [("sandbox.state", "creating"), ("sandbox.state", "running"), ("command.started", None),
                     ("command.exited", None), ("sandbox.state", "deleted")]:
            self.assertIn(step, steps)
        order = [steps.index(("sandbox.state", "running")), steps.index(("command.started", None)),
                 steps.index(("command.exited", None)), steps.index(("sandbox.state", "deleted"))]
        self.assertEqual(order, sorted(order))
        exited = mine[steps.index(("command.exited", None))]
        self.assertEqual(exited["command"]["result"]["exit_code"], 3)
        ids = [e["id"] for e in mine]
        self.assertEqual(ids, sorted(set(ids)))
        # Read again later, from the middle: the same events, and only this sandbox's.
        again = list(client.events(from_id=ids[1], sandbox_id=sbx.id, types=["sandbox", "command"]))
        self.assertEqual([e["id"] for e in again], ids[1:])
        operations = list(client.events(from_id=start, sandbox_id=sbx.id, types=["operation.finished"]))
        self.assertEqual(sorted(e["operation"]["kind"] for e in operations), ["create", "delete"])
        with self.assertRaises(InvalidRequestError):
            list(client.events(types=["sandboxes"]))

    def test_errors_are_typed(self):
        with self.assertRaises(NotFoundError) as raised:
            Sandbox.connect("sbx_doesnotexist")
        self.assertEqual(raised.exception.status, 404)
        with self.assertRaises(NotFoundError) as raised:
            Sandbox.create(template="no-such-template")
        self.assertEqual(raised.exception.code, "template_not_found")
        with self.assertRaises(SpaceError):
            Sandbox.create(memory_mib=1)


class SnapshotsSdk(unittest.TestCase):
    def test_forks_checkpoints_and_snapshot_templates(self):
        sbx = Sandbox.create(template="base")
        forks = []
        try:
            sbx.commands.run("echo 1 > /root/n")
            forks = sbx.fork(2, labels={"kind": "fork"})
            self.assertEqual(len(forks), 2)
            for i, fork in enumerate(forks):
                self.assertEqual(fork.info["state"], "running")
                self.assertEqual(fork.info["forked_from"], sbx.id)
                self.assertEqual(fork.info["labels"]["kind"], "fork")
                fork.commands.run(f"echo fork{i} > /root/n")
            self.assertEqual(sbx.commands.run("cat /root/n").stdout, "1\n")
            self.assertEqual([f.commands.run("cat /root/n").stdout for f in forks], ["fork0\n", "fork1\n"])

            self.assertEqual(sbx.checkpoint("start")["kind"], "checkpoint")
            self.assertEqual([c["name"] for c in sbx.checkpoints()], ["start"])
            with self.assertRaises(ConflictError):
                sbx.checkpoint("start")
            sbx.commands.run("echo 2 > /root/n")
            self.assertEqual(sbx.restore("start")["kind"], "restore_checkpoint")
            self.assertEqual(sbx.commands.run("cat /root/n").stdout, "1\n")
            with self.assertRaises(NotFoundError):
                sbx.restore("nope")

            template = Template.from_sandbox("sdk-snapshot", sbx, checkpoint="start")
            self.assertEqual(template["source"], {"checkpoint": {"sandbox": sbx.id, "name": "start"}})
            with Sandbox.create(template="sdk-snapshot") as child:
                self.assertEqual(child.commands.run("cat /root/n").stdout, "1\n")
            Template.delete("sdk-snapshot")
            sbx.delete_checkpoint("start")
            self.assertEqual(sbx.checkpoints(), [])
        finally:
            for fork in forks:
                fork.delete()
            sbx.delete()

    def test_the_same_with_await(self):
        async def scenario():
            async with await AsyncSandbox.create() as sbx:
                await sbx.commands.run("echo async > /root/n")
                [fork] = await sbx.fork()
                self.assertEqual((await fork.commands.run("cat /root/n")).stdout, "async\n")
                await fork.delete()
                await sbx.checkpoint("a")
                self.assertEqual([c["name"] for c in await sbx.checkpoints()], ["a"])
                await sbx.commands.run("rm /root/n")
                await sbx.restore("a")
                self.assertEqual((await sbx.commands.run("cat /root/n")).stdout, "async\n")
                template = await AsyncTemplate.from_sandbox("sdk-async-snapshot", sbx)
                self.assertEqual(template["source"], {"sandbox": sbx.id})
                async with await AsyncSandbox.create(template="sdk-async-snapshot") as child:
                    self.assertEqual((await child.commands.run("cat /root/n")).stdout, "async\n")
                await sbx.client.request("DELETE", "/v1/templates/sdk-async-snapshot")
            await sbx.client.aclose()

        asyncio.run(scenario())


class ImagesSdk(unittest.TestCase):
    """SPACE_TEST_IMAGE names an image in a registry the server may pull
    from (the harness pushes one with a shell, /etc/greeting and a start
    command)."""

    def image(self) -> str:
        import os
        image = os.environ.get("SPACE_TEST_IMAGE")
        if not image:
            self.skipTest("SPACE_TEST_IMAGE names no image (the Rust harness that runs these tests sets it)")
        return image

    def test_a_template_from_a_registry_image(self):
        image = self.image()
        template = Template.from_image("sdk-image", image, workdir="/tmp")
        try:
            self.assertEqual(template["source"]["image"]["reference"], image)
            self.assertEqual(template["defaults"]["workdir"], "/tmp")
            self.assertEqual(template["defaults"]["command"], ["/bin/sh", "run.sh"])
            with Sandbox.create(template="sdk-image") as sbx:
                self.assertEqual(sbx.commands.run("cat /etc/greeting").stdout, "from the top layer")
        finally:
            Template.delete("sdk-image")
        with self.assertRaises(InvalidRequestError) as raised:
            Template.from_image("sdk-missing", image.rsplit(":", 1)[0] + ":no-such-tag")
        self.assertEqual(raised.exception.code, "image_unavailable")
        with self.assertRaises(TypeError):
            Template.from_image("sdk-bad", image, username="someone")

    def test_the_same_with_await(self):
        image = self.image()

        async def scenario():
            client = AsyncClient()
            template = await AsyncTemplate.from_image("sdk-async-image", image, client=client)
            self.assertEqual(template["defaults"]["workdir"], "/app")
            await client.request("DELETE", "/v1/templates/sdk-async-image")
            await client.aclose()

        asyncio.run(scenario())


class DockerfileSdk(unittest.TestCase):
    def test_a_template_from_a_dockerfile_and_a_context(self):
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as context:
            os.makedirs(os.path.join(context, "app"))
            with open(os.path.join(context, "app", "main.py"), "w") as f:
                f.write("print('built by the sdk')\n")
            with open(os.path.join(context, "private.key"), "w") as f:
                f.write("never leaves this machine\n")
            with open(os.path.join(context, ".dockerignore"), "w") as f:
                f.write("*.key\n")
            dockerfile = "FROM template:base\nCOPY . /srv/\nRUN python3 /srv/app/main.py > /srv/out.txt\n"
            template = Template.build("sdk-dockerfile", dockerfile, context, memory_mib=512)
            try:
                self.assertEqual(template["defaults"]["memory_mib"], 512)
                with Sandbox.create(template="sdk-dockerfile") as sbx:
                    self.assertEqual(sbx.commands.run("cat /srv/out.txt").stdout, "built by the sdk\n")
                    self.assertNotEqual(sbx.commands.run("test -e /srv/private.key").exit_code, 0)
            finally:
                Template.delete("sdk-dockerfile")
        with self.assertRaises(InvalidRequestError) as raised:
            Template.build("sdk-bad", "FROM template:base\nONBUILD RUN true\n")
        self.assertIn("line 2", raised.exception.message)

    def test_the_same_with_await(self):
        async def scenario():
            client = AsyncClient()
            template = await AsyncTemplate.build("sdk-async-dockerfile", "FROM template:base\nRUN echo ok > /ok\n",
                                                 client=client)
            self.assertEqual(template["state"], "ready")
            await client.request("DELETE", "/v1/templates/sdk-async-dockerfile")
            await client.aclose()

        asyncio.run(scenario())


class ContextsSdk(unittest.TestCase):
    def test_a_context_keeps_state_and_gives_rich_results(self):
        with Sandbox.create(template="code-interpreter", memory_mib=1024) as sbx:
            ctx = sbx.contexts.create("python")
            self.assertEqual(ctx.run("x = 1").status, "ok")
            self.assertEqual(ctx.run("x + 1").text, "2")
            self.assertEqual(ctx.run("import os; os.environ['ONE_RUN']", env={"ONE_RUN": "yes"}).text, "'yes'")
            self.assertEqual(ctx.run("'ONE_RUN' in os.environ").text, "False")
            seen = []
            printed = ctx.run("print('live')", on_event=seen.append)
            self.assertEqual(printed.stdout, "live\n")
            self.assertEqual([e["type"] for e in seen], ["stdout", "end"])
            chart = ctx.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
            self.assertTrue(chart.png.startswith(b"\x89PNG"))
            failed = ctx.run("1 / 0")
            self.assertEqual((failed.status, failed.error["name"]), ("error", "ZeroDivisionError"))
            self.assertEqual([c.id for c in sbx.contexts.list()], [ctx.id])
            ctx.restart()
            self.assertEqual(ctx.run("x").error["name"], "NameError")
            ctx.delete()
            self.assertEqual(sbx.contexts.list(), [])

    def test_the_same_with_await(self):
        async def scenario():
            async with await AsyncSandbox.create(template="code-interpreter", memory_mib=1024) as sbx:
                ctx = await sbx.contexts.create()
                await ctx.run("y = 20")
                self.assertEqual((await ctx.run("y * 2")).text, "40")
                self.assertEqual((await ctx.run("import os; os.environ['W']", env={"W": "a"})).text, "'a'")
            await sbx.client.aclose()

        asyncio.run(scenario())


class AsyncSdk(unittest.TestCase):
    def test_the_same_surface_with_await(self):
        async def scenario():
            async with await AsyncSandbox.create() as sbx:
                result = await sbx.commands.run("echo async; exit 4")
                self.assertEqual((result.stdout, result.exit_code), ("async\n", 4))
                await sbx.files.write("/root/a.txt", b"bytes")
                self.assertEqual(await sbx.files.read("/root/a.txt"), b"bytes")
                handle = await sbx.commands.start(["sh", "-c", "echo one; echo two"])
                lines = [e.text async for e in handle.stream() if e.type == "stdout"]
                self.assertEqual("".join(lines), "one\ntwo\n")
                cat = await sbx.commands.start(["cat"], stdin=True)
                async with await cat.attach() as session:
                    await session.send("async websocket\n")
                    await session.close_stdin()
                    received = b"".join([chunk async for chunk in session.output()])
                self.assertEqual(received, b"async websocket\n")
                self.assertEqual(session.result["exit_code"], 0)
                await sbx.pause()
                await sbx.resume()
                states = [e["sandbox"]["state"] async for e in sbx.client.events(sandbox_id=sbx.id, types=["sandbox"])]
                self.assertEqual(states[-3:], ["running", "paused", "running"])
                self.assertEqual((await sbx.commands.run("echo back")).stdout, "back\n")
            self.assertEqual(sbx.info["state"], "deleted")
            await sbx.client.aclose()

        asyncio.run(scenario())


if __name__ == "__main__":
    unittest.main()
