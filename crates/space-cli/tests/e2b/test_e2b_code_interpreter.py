"""The unmodified `e2b-code-interpreter` SDK against SPACE, configured with
E2B's environment variables only (E2B_API_URL, E2B_SANDBOX_URL,
E2B_API_KEY): its default template, runs with rich results (text as E2B
gives it, a DataFrame's data, charts), contexts (the default python and
javascript ones listed, started in /home/user), per-run env in every
language, ES modules, top-level await and TypeScript, a client-side
timeout that interrupts the run, a sandbox killed during a run, and the
tokens the context routes need."""

import base64
import json
import os
import struct
import threading
import time
import unittest
import urllib.error
import urllib.request

from e2b import TimeoutException
from e2b_code_interpreter import Sandbox


def png_size(data):
    """Width and height of a PNG from its IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    return struct.unpack(">II", data[16:24])


class CodeInterpreter(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # E2B's default template for it (`code-interpreter-v1`) is served by
        # SPACE's `code-interpreter`.
        cls.sbx = Sandbox.create(metadata={"suite": "code-interpreter"})

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_state_and_the_last_value(self):
        first = self.sbx.run_code("x = 41")
        self.assertIsNone(first.error)
        self.assertEqual(first.results, [])
        second = self.sbx.run_code("x + 1")
        self.assertEqual(second.text, "42")
        self.assertTrue(second.results[0].is_main_result)
        self.assertGreater(second.execution_count, first.execution_count)

    def test_output_as_it_comes_and_errors(self):
        seen = []
        execution = self.sbx.run_code(
            "import sys, subprocess\nprint('hello')\nprint('oops', file=sys.stderr)\n"
            "subprocess.run(['echo', 'from a program'])",
            on_stdout=lambda message: seen.append(message.line),
        )
        self.assertIsNone(execution.error)
        self.assertIn("hello\n", "".join(execution.logs.stdout))
        self.assertIn("from a program\n", "".join(execution.logs.stdout))
        self.assertEqual("".join(execution.logs.stderr), "oops\n")
        self.assertEqual("".join(seen), "".join(execution.logs.stdout))
        failed = self.sbx.run_code("def f():\n    return 1 / 0\nf()")
        self.assertEqual(failed.error.name, "ZeroDivisionError")
        self.assertEqual(failed.error.value, "division by zero")
        self.assertIsInstance(failed.error.traceback, str)
        self.assertIn("return 1 / 0", failed.error.traceback)
        self.assertNotIn("\x1b[", failed.error.traceback)

    def test_a_chart_and_a_dataframe(self):
        chart = self.sbx.run_code(
            "import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 3))\nplt.plot([1, 4, 9])\nplt.show()"
        )
        self.assertIsNone(chart.error)
        pngs = [base64.b64decode(r.png) for r in chart.results if r.png]
        self.assertEqual(len(pngs), 1, chart.results)
        width, height = png_size(pngs[0])
        self.assertGreater(width, 100)
        self.assertGreater(height, 100)
        frame = self.sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
        self.assertIn("<table", frame.results[0].html)
        self.assertIn("a", frame.results[0].text)

    def test_contexts(self):
        ctx = self.sbx.create_code_context(cwd="/tmp")
        self.assertEqual(ctx.cwd, "/tmp")
        self.assertEqual(ctx.language, "python")
        self.assertEqual(self.sbx.run_code("import os; os.getcwd()", context=ctx).text, "/tmp")
        self.sbx.run_code("only_here = 'ctx'", context=ctx)
        self.assertEqual(self.sbx.run_code("only_here", context=ctx).text, "ctx")
        # The default context does not see it.
        self.assertEqual(self.sbx.run_code("only_here").error.name, "NameError")
        self.assertIn(ctx.id, [c.id for c in self.sbx.list_code_contexts()])
        self.sbx.restart_code_context(ctx)
        self.assertEqual(self.sbx.run_code("only_here", context=ctx).error.name, "NameError")
        self.sbx.remove_code_context(ctx)
        self.assertNotIn(ctx.id, [c.id for c in self.sbx.list_code_contexts()])
        with self.assertRaises(Exception):
            self.sbx.run_code("1", context=ctx)

        js = self.sbx.create_code_context(language="javascript")
        self.sbx.run_code("let answer = 21", context=js)
        self.assertEqual(self.sbx.run_code("answer * 2", context=js).text, "42")
        shell = self.sbx.run_code("cd /tmp && echo \"in $(pwd)\"", language="bash")
        self.assertEqual("".join(shell.logs.stdout), "in /tmp\n")

    def test_env_for_one_run(self):
        execution = self.sbx.run_code("import os; os.environ.get('WHO')", envs={"WHO": "e2b"})
        self.assertEqual(execution.text, "e2b")
        self.assertEqual(self.sbx.run_code("repr(os.environ.get('WHO'))").text, "None")
        shell = self.sbx.run_code("echo \"$WHO\"", language="bash", envs={"WHO": "it's"})
        self.assertEqual(shell.logs.stdout, ["it's\n"])
        after = self.sbx.run_code("echo ${WHO:-unset}", language="bash")
        self.assertEqual(after.logs.stdout, ["unset\n"])

    def test_text_as_e2b_gives_it(self):
        # E2B's server takes one pair of quotes off a result's text.
        self.assertEqual(self.sbx.run_code("'quoted'").text, "quoted")
        self.assertEqual(self.sbx.run_code("'it' + \"'s\"").text, "it's")
        self.assertEqual(self.sbx.run_code("['a']").text, "['a']")
        self.assertEqual(self.sbx.run_code("'js'", language="javascript").text, "js")

    def test_the_default_contexts_and_their_directory(self):
        languages = [c.language for c in self.sbx.list_code_contexts()]
        self.assertIn("python", languages)
        self.assertIn("javascript", languages)
        for language, code in [("python", "import os; os.getcwd()"), ("javascript", "process.cwd()")]:
            self.assertEqual(self.sbx.run_code(code, language=language).text, "/home/user", language)
        shell = self.sbx.create_code_context(language="bash")  # the default one may have moved
        self.assertEqual(self.sbx.run_code("pwd", context=shell).logs.stdout, ["/home/user\n"])
        self.assertEqual(self.sbx.create_code_context().cwd, "/home/user")

    def test_javascript_modules_await_and_typescript(self):
        imported = self.sbx.run_code("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)",
                                     language="js")
        self.assertEqual(imported.logs.stdout, ["function\n"])
        self.assertEqual(self.sbx.run_code("await Promise.resolve('later')", language="js").text, "later")
        typed = self.sbx.run_code("const typed: number = 41; console.log(typed + 1)", language="ts")
        self.assertEqual(typed.logs.stdout, ["42\n"], typed)

    def test_data_charts_and_saved_images(self):
        frame = self.sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3]})")
        self.assertEqual(frame.results[0].data, {"a": [1, 2, 3]})
        drawn = self.sbx.run_code(
            "import matplotlib.pyplot as plt\nplt.figure()\nplt.plot([1, 2], [3, 4], label='up')\n"
            "plt.xlabel('Time (s)')\nplt.title('Rise')\nplt.show()"
        )
        chart = drawn.results[0].chart
        self.assertEqual((chart.type, chart.title, chart.x_unit), ("line", "Rise", "s"))
        self.assertEqual([(e.label, e.points) for e in chart.elements], [("up", [(1.0, 3.0), (2.0, 4.0)])])
        self.assertFalse(drawn.results[0].extra)
        saved = self.sbx.run_code("from PIL import Image\nImage.new('RGB', (8, 8)).save('/tmp/e2b.png')")
        self.assertEqual(png_size(base64.b64decode(saved.results[0].png)), (8, 8))

    def test_a_sandbox_killed_during_a_run(self):
        # E2B's connection drops with the sandbox: the SDK finds it gone.
        # Killed during a run, and (most likely) while the run's default
        # context still starts.
        for warm, after in [(True, 2.0), (False, 0.3)]:
            doomed = Sandbox.create(metadata={"suite": "code-interpreter"})
            if warm:
                self.assertEqual(doomed.run_code("1").text, "1")
            killer = threading.Timer(after, doomed.kill)
            killer.start()
            try:
                with self.assertRaisesRegex(TimeoutException, "killed while the request was in progress"):
                    doomed.run_code("import time; time.sleep(120)", timeout=100)
            finally:
                killer.cancel()
                doomed.kill()

    def test_a_timeout_interrupts_the_run(self):
        with self.assertRaises(TimeoutException):
            self.sbx.run_code("import time\nfor _ in range(120): time.sleep(0.5)", timeout=2)
        # The server interrupted the run when the client went away: the
        # context answers again long before the loop's 60 s.
        deadline = time.monotonic() + 30
        while True:
            try:
                self.assertEqual(self.sbx.run_code("1 + 1").text, "2")
                break
            except Exception as busy:  # 409 while the interrupt lands
                if time.monotonic() > deadline:
                    raise AssertionError(f"the context stayed busy: {busy}")
                time.sleep(0.2)

    def test_a_client_going_away_at_any_moment_interrupts_the_run(self):
        # E2B's interrupt is the client going away (its timeout): at any
        # moment after the run is sent, for each language, the run ends and
        # the next one is answered, with the state kept.
        loops = {"python": ("n = 0", "while True:\n    n += 1", "n > 0"),
                 "javascript": ("var n = 0", "for (;;) { n++ }", "n > 0"),
                 "bash": ("n=0", "while :; do n=$((n+1)); done", "(( n > 0 )) && echo true")}
        for language, (setup, endless, check) in loops.items():
            context = self.sbx.create_code_context(language=language)
            self.sbx.run_code(setup, context=context)
            for round_ in range(12):
                with self.assertRaises(TimeoutException):
                    self.sbx.run_code(endless, context=context, timeout=0.05 + (round_ % 4) * 0.1)
                deadline = time.monotonic() + 30
                while True:
                    try:
                        answer = self.sbx.run_code(check, context=context, timeout=20)
                        break
                    except Exception as busy:  # 409 while the interrupt lands
                        if time.monotonic() > deadline:
                            raise AssertionError(f"{language}, round {round_}: the context stayed busy: {busy}")
                        time.sleep(0.05)
                shown = answer.text if language != "bash" else "".join(answer.logs.stdout).strip()
                self.assertIn(shown, ("True", "true"), f"{language}, round {round_}: {answer}")

    def test_the_context_routes_need_the_sandbox_tokens(self):
        base = os.environ["E2B_SANDBOX_URL"]
        for headers, status in [
            ({}, 401),
            ({"E2B-Traffic-Access-Token": "wrong"}, 401),
            ({"E2B-Traffic-Access-Token": self.sbx.traffic_access_token, "E2b-Sandbox-Port": "8080"}, 502),
        ]:
            request = urllib.request.Request(
                f"{base}/contexts",
                headers={"E2b-Sandbox-Id": self.sbx.sandbox_id, "E2b-Sandbox-Port": "49999", **headers},
            )
            with self.assertRaises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(request, timeout=30)
            self.assertEqual(raised.exception.code, status)
            self.assertEqual(json.loads(raised.exception.read())["code"], status)
        request = urllib.request.Request(
            f"{base}/execute",
            data=json.dumps({"code": "1", "language": "cobol"}).encode(),
            headers={"E2b-Sandbox-Id": self.sbx.sandbox_id, "E2b-Sandbox-Port": "49999",
                     "Content-Type": "application/json", "X-Access-Token": self.sbx._envd_access_token},
        )
        with self.assertRaises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=30)
        self.assertEqual(raised.exception.code, 400)
        self.assertIn("cobol", json.loads(raised.exception.read())["message"])


if __name__ == "__main__":
    unittest.main()
