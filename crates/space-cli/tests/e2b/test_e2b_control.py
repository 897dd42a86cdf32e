"""E2B's control-plane calls beyond the basics, through the unmodified `e2b`
SDK against SPACE: the key in E2B's own shape, network rules mapped onto
SPACE's egress policy (or refused), fork, snapshots, metrics ranges, pauses
without memory (refused) and the base template's account and tools.

Run by `crates/space-cli/tests/e2b.rs` with E2B's variables, E2B_API_KEY in
E2B's shape (`e2b_` and hex, from `space keys e2b`), SPACE_KEY the same key
as SPACE spells it, and a server whose gateway resolves allowed.space.test
and denied.space.test to a local server that answers `upstream saw ...`.
"""

import os
import unittest
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone

from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
)

RUN = uuid.uuid4().hex[:12]

# A GET through the gateway (urllib reads the proxy variables every
# command has): the answer's text, or `HTTP <status>`.
FETCH = (
    "python3 -c \"import sys, urllib.request, urllib.error\n"
    "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())\n"
    "except urllib.error.HTTPError as e:\n    print('HTTP', e.code)\" "
)


def fetch(sbx, url):
    return sbx.commands.run(FETCH + url, timeout=60).stdout.strip()


class Keys(unittest.TestCase):
    def test_a_key_in_either_shape_is_the_same_key(self):
        e2b_key = os.environ["E2B_API_KEY"]
        self.assertEqual(e2b_key, "e2b_" + os.environ["SPACE_KEY"].encode().hex())
        Sandbox.list(api_key=e2b_key).next_items()

        def listing(key):
            request = urllib.request.Request(os.environ["E2B_API_URL"] + "/v2/sandboxes", headers={"X-API-KEY": key})
            try:
                return urllib.request.urlopen(request, timeout=30).status
            except urllib.error.HTTPError as e:
                return e.code

        self.assertEqual(listing(os.environ["SPACE_KEY"]), 200)
        # E2B's shape of a key that is not one is refused like the key.
        for wrong in ["e2b_" + "space_0000".encode().hex(), "e2b_" + "0" * 40, e2b_key[:-2]]:
            self.assertEqual(listing(wrong), 401, wrong)
            with self.assertRaises(AuthenticationException):
                Sandbox.list(api_key=wrong).next_items()


class Network(unittest.TestCase):
    def test_rules_given_at_create_are_enforced(self):
        sbx = Sandbox.create(
            network={"deny_out": ["0.0.0.0/0"], "allow_out": ["allowed.space.test"]},
            metadata={"suite": RUN, "part": "network"},
        )
        try:
            self.assertEqual(fetch(sbx, "http://allowed.space.test/a"), "upstream saw GET /a HTTP/1.1")
            self.assertEqual(fetch(sbx, "http://denied.space.test/b"), "HTTP 403")
            info = sbx.get_info()
            self.assertTrue(info.allow_internet_access)
            # `update_network` replaces them at once: now all but one host.
            sbx.update_network({"deny_out": ["denied.space.test"]})
            self.assertEqual(fetch(sbx, "http://denied.space.test/c"), "HTTP 403")
            self.assertEqual(fetch(sbx, "http://allowed.space.test/d"), "upstream saw GET /d HTTP/1.1")
            # What an update leaves out is cleared: everything is allowed.
            sbx.update_network({})
            self.assertEqual(fetch(sbx, "http://denied.space.test/e"), "upstream saw GET /e HTTP/1.1")
            # And no internet at all.
            sbx.update_network({"allow_internet_access": False})
            self.assertEqual(fetch(sbx, "http://allowed.space.test/f"), "HTTP 403")
            self.assertFalse(sbx.get_info().allow_internet_access)
        finally:
            sbx.kill()

    def test_what_cannot_be_enforced_is_refused_and_makes_no_sandbox(self):
        part = {"suite": RUN, "part": "refused-network"}
        for network, why in [
            # A host name needs all other traffic denied (as on E2B).
            ({"allow_out": ["allowed.space.test"]}, "host names are allowed only"),
            # SPACE's deny beats allow: this exception cannot be made.
            ({"deny_out": ["192.0.2.0/24"], "allow_out": ["192.0.2.7"]}, "lets through part"),
            ({"egress_proxy": {"address": "proxy.space.test:1080"}}, "egress proxy"),
            (
                {"deny_out": ["0.0.0.0/0"], "allow_out": ["allowed.space.test"],
                 "rules": {"allowed.space.test": [{"transform": {"headers": {"X-Token": "literal"}}}]}},
                "without a secret",
            ),
        ]:
            with self.assertRaises(SandboxException) as raised:
                Sandbox.create(network=network, metadata=part)
            self.assertIn(why, str(raised.exception))
        self.assertEqual(Sandbox.list(query=SandboxQuery(metadata=part)).next_items(), [])
        # Refused on update too, changing nothing.
        sbx = Sandbox.create(network={"deny_out": ["0.0.0.0/0"]}, metadata=part)
        try:
            with self.assertRaises(SandboxException):
                sbx.update_network({"allow_out": ["allowed.space.test"]})
            self.assertEqual(fetch(sbx, "http://allowed.space.test/g"), "HTTP 403")
        finally:
            sbx.kill()


class ForkAndSnapshots(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create(timeout=600, metadata={"suite": RUN, "part": "fork"})
        cls.sbx.files.write("/tmp/state.txt", "before")

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_fork_copies_the_sandbox_and_leaves_it_running(self):
        forks = self.sbx.fork(count=2, timeout=120)
        try:
            self.assertEqual(len(forks), 2)
            self.assertEqual(len({f.sandbox_id for f in forks} | {self.sbx.sandbox_id}), 3)
            for fork in forks:
                self.assertEqual(fork.files.read("/tmp/state.txt"), "before")
            forks[0].files.write("/tmp/state.txt", "fork")
            self.assertEqual(self.sbx.files.read("/tmp/state.txt"), "before")
            self.assertEqual(forks[1].files.read("/tmp/state.txt"), "before")
            self.assertTrue(self.sbx.is_running())
        finally:
            for fork in forks:
                fork.kill()
        gone = Sandbox.create(metadata={"suite": RUN, "part": "fork"})
        gone.kill()
        with self.assertRaises(NotFoundException):
            gone.fork()

    def test_a_snapshot_starts_new_sandboxes_and_is_deleted(self):
        name = f"snap-{RUN}"
        snapshot = self.sbx.create_snapshot(name=name)
        self.assertEqual((snapshot.snapshot_id, snapshot.names), (name, [name]))
        try:
            self.assertTrue(self.sbx.is_running())
            listed = Sandbox.list_snapshots(sandbox_id=self.sbx.sandbox_id).next_items()
            self.assertIn(name, [s.snapshot_id for s in listed])
            self.assertEqual(Sandbox.list_snapshots(name=name + "-none").next_items(), [])
            copy = Sandbox.create(snapshot.snapshot_id)
            try:
                self.assertEqual(copy.files.read("/tmp/state.txt"), "before")
            finally:
                copy.kill()
        finally:
            self.assertTrue(Sandbox.delete_snapshot(snapshot.snapshot_id))
        self.assertFalse(Sandbox.delete_snapshot(snapshot.snapshot_id))
        self.assertNotIn(name, [s.snapshot_id for s in Sandbox.list_snapshots().next_items()])


class Lifecycle(unittest.TestCase):
    def test_metrics_of_a_range_in_the_past_are_none(self):
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "metrics"})
        try:
            self.assertGreater(len(sbx.get_metrics()), 0)
            long_ago = datetime.now(timezone.utc) - timedelta(hours=1)
            self.assertEqual(sbx.get_metrics(start=long_ago, end=long_ago + timedelta(minutes=30)), [])
        finally:
            sbx.kill()

    def test_a_pause_without_memory_is_refused(self):
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "pause"})
        try:
            with self.assertRaises(SandboxException) as raised:
                sbx.pause(keep_memory=False)
            self.assertIn("keep_memory", str(raised.exception))
            self.assertTrue(sbx.is_running())
        finally:
            sbx.kill()


class Base(unittest.TestCase):
    def test_the_base_has_e2bs_user_and_tools(self):
        sbx = Sandbox.create(metadata={"suite": RUN, "part": "base"})
        try:
            out = sbx.commands.run("whoami; echo $HOME; cd && pwd", user="user").stdout
            self.assertEqual(out, "user\n/home/user\n/home/user\n")
            out = sbx.commands.run("python --version; command -v curl sudo", user="user").stdout
            # The sandbox's sudo asks the agent (gVisor never lets a setuid
            # program raise privileges); Debian's stays at /usr/bin/sudo.
            self.assertTrue(out.startswith("Python 3.") and out.endswith("/curl\n/usr/local/bin/sudo\n"), out)
            self.assertEqual(sbx.commands.run("sudo whoami", user="user").stdout, "root\n")
            # Passwordless sudo is also the account's policy in sudoers.
            out = sbx.commands.run("/usr/bin/sudo -n -l -U user", user="root").stdout
            self.assertIn("(ALL : ALL) NOPASSWD: ALL", out)
        finally:
            sbx.kill()


if __name__ == "__main__":
    unittest.main()
