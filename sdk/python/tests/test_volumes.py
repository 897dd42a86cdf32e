"""Volumes through the SDK against a real SPACE server (SPACE_URL and
SPACE_API_KEY point at it): files that outlive the sandbox that wrote them,
one writer at a time, snapshots, and the files of a volume without a
sandbox. Run: python -m unittest discover -s sdk/python/tests"""

import asyncio
import io
import tarfile
import unittest

from space_sdk import (AsyncSandbox, AsyncVolume, ConflictError, InvalidRequestError, NotFoundError, Sandbox,
                       SnapshotNotFoundError, Volume, VolumeInUseError, VolumeMount, VolumeNotFoundError)


def tar_of(files):
    """A tar archive holding `files` (name -> bytes)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def names_in(archive):
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return sorted(m.name.lstrip("./") for m in tar.getmembers() if m.isfile())


class VolumesSdk(unittest.TestCase):
    def setUp(self):
        self.made = []

    def tearDown(self):
        for volume in reversed(self.made):
            try:
                volume.delete()
            except NotFoundError:
                pass

    def volume(self, name, **kwargs):
        volume = Volume.create(name, **kwargs)
        self.made.append(volume)
        return volume

    def test_what_one_sandbox_wrote_the_next_reads_after_it_is_gone(self):
        ws = self.volume("sdk-ws", size_mib=64)
        self.assertEqual((ws.info["size_mib"], ws.info["mounted_by"]), (64, []))
        self.assertIn("sdk-ws", [v.name for v in Volume.list()])
        # Seeded without a sandbox.
        ws.files.write("/seed.txt", "seeded")

        a = Sandbox.create(volumes=[ws.mount("/workspace")])
        try:
            self.assertEqual(a.info["volumes"], [{"name": "sdk-ws", "path": "/workspace", "read_only": False}])
            self.assertEqual(a.commands.run("cat /workspace/seed.txt").stdout, "seeded")
            wrote = a.commands.run("mkdir -p /workspace/out && echo from A > /workspace/out/result.txt")
            self.assertEqual(wrote.exit_code, 0, wrote.stderr)
            self.assertEqual(ws.mounted_by, [{"sandbox_id": a.id, "path": "/workspace", "read_only": False}])
            # One writer: a second read-write mount names the holder.
            with self.assertRaises(VolumeInUseError) as raised:
                Sandbox.create(volumes=[{"name": "sdk-ws", "path": "/w"}])
            self.assertEqual(raised.exception.holder, a.id)
            self.assertIsInstance(raised.exception, ConflictError)
            # Nor may the files routes write, nor the volume go, under it.
            with self.assertRaises(VolumeInUseError):
                ws.files.write("/other.txt", "no")
            with self.assertRaises(VolumeInUseError):
                ws.delete()
        finally:
            a.delete()

        self.assertEqual(ws.mounted_by, [])
        b = Sandbox.create(volumes=[VolumeMount("sdk-ws", "/data", read_only=True)])
        try:
            self.assertEqual(b.commands.run("cat /data/out/result.txt").stdout, "from A\n")
            for write in ("echo more > /data/out/result.txt", "echo more >> /data/out/result.txt", "echo new > /data/new.txt"):
                refused = b.commands.run(write)
                self.assertNotEqual(refused.exit_code, 0, f"a read-only mount refuses {write!r}")
            # Any number of read-only mounts at once.
            with Sandbox.create(volumes=[{"name": "sdk-ws", "path": "/data", "read_only": True}]) as c:
                self.assertEqual(c.commands.run("cat /data/out/result.txt").stdout, "from A\n")
                self.assertEqual(len(ws.mounted_by), 2)
                # A sandbox's files as a tar, and back into it elsewhere.
                archive = c.files.download_tar("/data/out")
                self.assertEqual(names_in(archive), ["result.txt"])
                c.files.upload_tar("/root/copy", archive)
                self.assertEqual(c.commands.run("cat /root/copy/result.txt").stdout, "from A\n")
            self.assertEqual(ws.files.read("/out/result.txt"), b"from A\n")
        finally:
            b.delete()

    def test_snapshots_restore_and_new_volumes_from_them(self):
        ws = self.volume("sdk-snap")
        ws.files.write("/state.txt", "one")
        snapshot = ws.snapshot("first")
        self.assertEqual((snapshot["name"], snapshot["volume"]), ("first", "sdk-snap"))
        self.assertEqual([s["name"] for s in ws.snapshots()], ["first"])
        ws.files.write("/state.txt", "two")
        ws.files.write("/later.txt", "later")
        restored = ws.restore("first")
        self.assertEqual(restored["name"], "sdk-snap")
        self.assertEqual(ws.files.read("/state.txt"), b"one")
        with self.assertRaises(NotFoundError):
            ws.files.read("/later.txt")
        branch = self.volume("sdk-branch", from_snapshot="sdk-snap/first")
        self.assertEqual(branch.info["from_snapshot"], {"volume": "sdk-snap", "snapshot": "first"})
        self.assertEqual(branch.files.read("/state.txt"), b"one")
        branch.files.write("/state.txt", "branched")
        self.assertEqual(ws.files.read("/state.txt"), b"one", "a branch is a copy")
        with self.assertRaises(SnapshotNotFoundError):
            ws.restore("no-such-snapshot")
        ws.delete_snapshot("first")
        self.assertEqual(ws.snapshots(), [])

    def test_files_and_tars_without_a_sandbox(self):
        ws = self.volume("sdk-files")
        ws.files.upload_tar("/project", tar_of({"a.txt": b"A", "src/b.py": b"print(1)\n"}))
        self.assertEqual(sorted(e["name"] for e in ws.files.list("/project")), ["a.txt", "src"])
        self.assertEqual(ws.files.read("/project/src/b.py"), b"print(1)\n")
        self.assertEqual(names_in(ws.files.download_tar("/project")), ["a.txt", "src/b.py"])
        ws.files.remove("/project/src", recursive=True)
        self.assertEqual([e["name"] for e in ws.files.list("/project")], ["a.txt"])
        self.assertIsInstance(Volume.get("sdk-files").info["used_bytes"], int)

    def test_bad_input_is_a_clear_error_that_changes_nothing(self):
        with self.assertRaises(VolumeNotFoundError) as raised:
            Volume.get("sdk-no-such-volume")
        self.assertEqual((raised.exception.status, raised.exception.code), (404, "volume_not_found"))
        with self.assertRaises(VolumeNotFoundError):
            Sandbox.create(volumes=[{"name": "sdk-no-such-volume", "path": "/w"}])
        self.volume("sdk-bad")
        for path in ("relative/path", "/", "/proc/x"):
            with self.assertRaises(InvalidRequestError, msg=path):
                Sandbox.create(volumes=[{"name": "sdk-bad", "path": path}])
        with self.assertRaises(InvalidRequestError):
            Sandbox.create(volumes=[{"name": "sdk-bad", "path": "/a", "read_only": True},
                                    {"name": "sdk-bad", "path": "/a", "read_only": True}])
        with self.assertRaises(ConflictError) as raised:
            Volume.create("sdk-bad")
        self.assertEqual(raised.exception.code, "name_taken")
        with self.assertRaises(InvalidRequestError):
            Volume.create("Not A Name")
        with self.assertRaises(TypeError):
            Sandbox.create(volumes=[{"name": "sdk-bad", "mountpoint": "/w"}])
        self.assertEqual(Volume.get("sdk-bad").info["mounted_by"], [])
        self.assertNotIn("Not A Name", [v.name for v in Volume.list()])

    def test_the_same_with_await(self):
        async def scenario():
            ws = await AsyncVolume.create("sdk-async-ws", size_mib=32)
            try:
                await ws.files.write("/in.txt", "async seed")
                async with await AsyncSandbox.create(volumes=[ws.mount("/workspace")], client=ws.client) as sbx:
                    self.assertEqual((await sbx.commands.run("cat /workspace/in.txt")).stdout, "async seed")
                    await sbx.commands.run("echo async out > /workspace/out.txt")
                    with self.assertRaises(VolumeInUseError):
                        await ws.delete()
                self.assertEqual(await ws.files.read("/out.txt"), b"async out\n")
                await ws.snapshot("s")
                self.assertEqual([s["name"] for s in await ws.snapshots()], ["s"])
                await ws.files.upload_tar("/t", tar_of({"x": b"x"}))
                self.assertEqual(names_in(await ws.files.download_tar("/t")), ["x"])
                await ws.restore("s")
                self.assertEqual([e["name"] for e in await ws.files.list("/")], ["in.txt", "out.txt"])
                self.assertIn("sdk-async-ws", [v.name for v in await AsyncVolume.list(client=ws.client)])
            finally:
                await ws.delete()
            with self.assertRaises(VolumeNotFoundError):
                await AsyncVolume.get("sdk-async-ws", client=ws.client)
            await ws.client.aclose()

        asyncio.run(scenario())


if __name__ == "__main__":
    unittest.main()
