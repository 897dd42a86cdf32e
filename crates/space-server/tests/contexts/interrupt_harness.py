"""Runs in a sandbox beside copies of SPACE's context drivers and speaks
their protocol the way the server does, with an interrupt written right
behind each run request (0 to 3 ms after it: before the driver read the
run, while it starts the cell, while it runs) -- the moments a host
round trip hides. JavaScript gets SIGINT once the run says `started`, as
the server sends it. Prints one JSON line: per language, the rounds, the
runs that ended `interrupted`, those that did not end (lost), whether the
interpreter lived and kept its state."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROUNDS = int(sys.argv[1])
PATIENCE = 20.0
LANGUAGES = {
    "python": (["python3", "-c"], ("python_charts.py", "python_driver.py"), "n = 0", "while True:\n    n += 1",
               "print(n > 0)"),
    "javascript": (["node", "--expose-internals", "-e"], "js_driver.js", "var n = 0", "for (;;) { n++ }",
                   "console.log(n > 0 ? 'True' : 'False')"),
    "bash": (["python3", "-c"], "bash_driver.py", "n=0", "while :; do n=$((n+1)); done",
             "(( n > 0 )) && echo True || echo False"),
}


class Driver:
    def __init__(self, command, source):
        # The host runs some drivers after a file of helpers, as one program.
        code = ""
        for name in (source,) if isinstance(source, str) else source:
            with open(os.path.join(HERE, name)) as file:
                code += file.read()
        self.proc = subprocess.Popen(command + [code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.events, self.seen = [], threading.Condition()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            if line.strip():
                with self.seen:
                    self.events.append(json.loads(line))
                    self.seen.notify_all()

    def send(self, request):
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def wait(self, matches, patience=PATIENCE):
        deadline = time.monotonic() + patience
        with self.seen:
            while True:
                found = next((e for e in self.events if matches(e)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0 or self.proc.poll() is not None:
                    return found
                self.seen.wait(min(left, 0.5))

    def run(self, run_id, code):
        self.send({"op": "run", "id": run_id, "code": code})
        return self.wait(lambda e: e.get("run") == run_id and e.get("type") == "end")


def rounds(language):
    command, source, setup, endless, check = LANGUAGES[language]
    driver = Driver(command, source)
    result = {"rounds": ROUNDS, "interrupted": 0, "lost": [], "alive": False, "state_kept": False}
    if driver.wait(lambda e: e.get("type") == "ready") is None:
        return result
    driver.run("setup", setup)
    for round_ in range(ROUNDS):
        run_id = f"r{round_}"
        driver.send({"op": "run", "id": run_id, "code": endless})
        time.sleep(0 if round_ % 3 == 0 else random.random() * 0.003)
        if language == "javascript":
            if driver.wait(lambda e: e.get("run") == run_id and e.get("type") == "started") is not None:
                os.kill(driver.proc.pid, signal.SIGINT)
        else:
            driver.send({"op": "interrupt", "run": run_id})
        end = driver.wait(lambda e: e.get("run") == run_id and e.get("type") == "end")
        if end is None:
            result["lost"].append(round_)
            break
        if end.get("status") == "interrupted":
            result["interrupted"] += 1
    result["alive"] = driver.proc.poll() is None
    if result["alive"] and not result["lost"]:
        end = driver.run("check", check)
        printed = "".join(e.get("text", "") for e in driver.events if e.get("run") == "check" and e["type"] == "stdout")
        result["state_kept"] = end is not None and printed == "True\n"
    driver.proc.kill()
    return result


print(json.dumps({language: rounds(language) for language in LANGUAGES}))
