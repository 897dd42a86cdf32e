# SPACE's code-context driver for bash, run in the sandbox as `python3 -c
# DRIVER`: keeps one bash process alive in a session of its own (its
# variables, functions, cwd and exports carry from run to run) and speaks
# the same JSON lines with the host on stdin/stdout as the Python driver:
# requests {"op": "run", "id", "code", "timeout_s", "env"}, {"op": "interrupt",
# "run"}, {"op": "restart"}; events {"type": "ready"} ("restarted": true
# after a restart), per run {"run", "type": "stdout"|"stderr", "text"},
# {"run", "type": "error", ...} and last {"run", "type": "end", "status":
# "ok"|"error"|"interrupted"|"timeout"|"died", "execution_count",
# "exit_code"}; {"type": "died", "why"} when the shell exits. A run's code
# is sourced from a here-document (its stdin is that, read to the end) and
# ends at a marker printed after it on stdout and stderr; a non-zero exit
# is an `ExitStatus` error. A run's `env` is exported around the sourced
# code and put back as it was after it (unset if it was), interrupted or not.
# An interrupt unwinds the whole run, as Ctrl-C does at a prompt, and keeps
# the shell: SIGINT to the shell's process group ends a foreground program,
# and the shell's INT trap sets a DEBUG trap that returns (extdebug: status
# 2 before a command returns from the function or sourced file it is in)
# until the sourced code is left, then removes itself. (A `return` in the
# INT trap itself, after a program it waited for died of SIGINT, left the
# shell deaf to the next interrupt.) A SIGINT that comes before the code is
# sourced does nothing, so it is sent again every half second until the run
# ends.
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid

# How long an interrupted run has to end before its worker is replaced.
PATIENCE = 5.0
# How often an interrupt is signalled again while its run goes on.
AGAIN = 0.5
# Run by the shell once: what makes SIGINT end a run and not the shell.
SETUP = b"""shopt -s extdebug
__space_unwind() {
  if (( ${#FUNCNAME[@]} > 1 )); then return 2; fi
  trap - DEBUG
}
trap 'trap __space_unwind DEBUG' INT
"""


OUT = []


def emit(event):
    """Queues an event for the host; `send` writes what is queued at once
    (a run's last output and its end in one write)."""
    OUT.append(json.dumps(event) + "\n")


def send():
    write_all(1, "".join(OUT).encode())
    OUT.clear()


def write_all(fd, data):
    data = memoryview(data)
    while data:
        data = data[os.write(fd, data):]


def drain(fd):
    """What can be read from a non-blocking pipe now; None at its end."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks) if chunks else None
        chunks.append(chunk)


class Shell:
    """The bash process; `feed` turns what it writes into events and says
    when a run ended."""

    def __init__(self):
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.files = {self.proc.stdout.fileno(): self.proc.stdout, self.proc.stderr.fileno(): self.proc.stderr}
        self.open = {self.proc.stdout.fileno(): "stdout", self.proc.stderr.fileno(): "stderr"}
        for fd in self.open:
            os.set_blocking(fd, False)
        self.stderr_tail = b""
        # SIGINT stops what runs, not the shell itself.
        self.proc.stdin.write(SETUP)
        self.proc.stdin.flush()
        self.ready, self.count = True, 0
        self.held = None

    def close(self, fd):
        del self.open[fd]
        self.files.pop(fd).close()

    def signal(self, signum):
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self):
        self.signal(signal.SIGKILL)
        self.proc.wait()
        for fd in list(self.open):
            self.close(fd)
        if self.proc.stdin:
            self.proc.stdin.close()

    def why(self):
        last = self.stderr_tail.decode(errors="replace").strip().splitlines()
        return last[-1] if last else f"the shell exited ({self.proc.poll()})"

    def begin(self, request):
        self.marker = ("__space_end_" + uuid.uuid4().hex).encode()
        self.held = {"stdout": b"", "stderr": b""}
        self.exit_code = None
        body = request["code"].encode()
        delimiter = b"__SPACE_CELL_" + uuid.uuid4().hex.encode()
        before, after = run_env(request.get("env") or {})
        script = before + b"source /dev/stdin <<'" + delimiter + b"'\n" + body + \
            (b"" if body.endswith(b"\n") else b"\n") + delimiter + b"\n__space_status=$?; " + after + \
            b"printf '%s %d\\n' " + self.marker + b" $__space_status; printf '%s\\n' " + self.marker + b" >&2\n"
        try:
            self.proc.stdin.write(script)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def feed(self, kind, data, out):
        held = self.held
        if held is None or kind not in held:
            return None
        data = held[kind] + data
        at = data.find(self.marker)
        if at >= 0:
            if data[:at]:
                out({"type": kind, "text": data[:at].decode(errors="replace")})
            if kind == "stdout":
                self.exit_code = int(data[at + len(self.marker):].split(b"\n", 1)[0].strip() or b"0")
            del held[kind]
        else:
            # Hold back what could be the start of the marker.
            keep = len(self.marker)
            if len(data) > keep:
                out({"type": kind, "text": data[:-keep].decode(errors="replace")})
                data = data[-keep:]
            held[kind] = data
        if held:
            return None
        self.held = None
        self.count += 1
        return {"type": "end", "status": "error" if self.exit_code else "ok", "execution_count": self.count,
                "exit_code": self.exit_code}


def quoted(text):
    return b"'" + text.encode().replace(b"'", b"'\\''") + b"'"


def run_env(env):
    """Shell lines that export a run's variables, and those that put them
    back (the host lets only shell names through)."""
    before, after = b"", b""
    for n, (name, value) in enumerate(sorted(env.items())):
        saved = b"__space_env_%d" % n
        name = name.encode()
        before += saved + b"_set=${" + name + b"+x}; " + saved + b"=${" + name + b"-}; export " + name + b"=" + \
            quoted(value) + b"\n"
        after += b"if [ -n \"$" + saved + b"_set\" ]; then " + name + b"=\"$" + saved + b"\"; else unset " + name + \
            b"; fi; unset " + saved + b" " + saved + b"_set; "
    return before, after


def spawn():
    return Shell()


class Driver:
    def __init__(self):
        self.worker = spawn()
        self.restarted = False
        self.announced = False
        self.run = None
        self.waiting = []

    def out(self, event):
        if self.run is not None:
            event["run"] = self.run["id"]
            emit(event)

    def end(self, status=None, end=None):
        """Ends the run going on: with the worker's end event, or `status`
        (which also overrides the worker's: a timed-out run is "timeout")."""
        event = dict(end or {"execution_count": None})
        if status:
            event["status"] = status
        if status == "interrupted":
            # As a shell reports a program that SIGINT ended.
            event["exit_code"] = 130
        event.update(type="end", run=self.run["id"])
        self.run = None
        emit(event)

    def replace_worker(self):
        if self.worker is not None:
            self.worker.kill()
        self.worker, self.restarted, self.announced = spawn(), True, False

    def request(self, request):
        op = request.get("op")
        if op == "interrupt":
            run_id = request.get("run")
            if self.run is not None and self.run["id"] == run_id:
                self.interrupt(time.monotonic())
            else:
                # Not started yet: it ends before its code runs.
                queued = [r for r in self.waiting if r["id"] == run_id]
                for queued_run in queued:
                    self.waiting.remove(queued_run)
                    self.run = {"id": run_id}
                    self.out({"type": "error", "name": "KeyboardInterrupt", "value": "interrupted", "traceback": []})
                    self.end("interrupted")
        elif op == "restart":
            if self.run is not None:
                self.end("died")
            self.replace_worker()
        elif op == "run":
            self.waiting.append(request)

    def interrupt(self, now):
        run = self.run
        if run["interrupted_at"] is None:
            run["interrupted_at"] = now
        run["signalled_at"] = now
        if self.worker is not None:
            self.worker.signal(signal.SIGINT)

    def start_next(self):
        if self.run is not None or not self.waiting or self.worker is None or not self.worker.ready:
            return
        request = self.waiting.pop(0)
        timeout = request.get("timeout_s")
        self.run = {"id": request["id"], "deadline": time.monotonic() + timeout if timeout else None,
                    "interrupted_at": None, "signalled_at": None, "timed_out": False}
        self.worker.begin(request)

    def worker_output(self, fd):
        worker = self.worker
        kind = worker.open[fd]
        data = drain(fd)
        if data is None:
            worker.close(fd)
            return
        if kind == "stderr" and self.run is None:
            # Kept to say why the shell did not start.
            worker.stderr_tail = (worker.stderr_tail + data)[-4096:]
        end = worker.feed(kind, data, self.out)
        if end is not None and self.run is not None:
            status = None
            if self.run["timed_out"]:
                status = "timeout"
            if self.run["interrupted_at"] is not None and end["status"] != "ok":
                status = status or "interrupted"
                self.out({"type": "error", "name": "KeyboardInterrupt", "value": "interrupted", "traceback": []})
            elif end["exit_code"]:
                self.out({"type": "error", "name": "ExitStatus", "value": f"exited with {end['exit_code']}",
                          "traceback": []})
            self.end(status, end)

    def check(self):
        worker = self.worker
        if worker is not None and (worker.proc.poll() is not None or not worker.open):
            # What it wrote before it went.
            for fd in list(worker.open):
                self.worker_output(fd)
            worker.proc.wait()
            why = worker.why()
            worker.kill()
            self.worker = None
            emit({"type": "died", "why": why})
            if self.run is not None:
                self.end("died")
            return
        run = self.run
        if run is None:
            return
        now = time.monotonic()
        if run["deadline"] and now > run["deadline"] and not run["timed_out"]:
            run["timed_out"] = True
            self.interrupt(now)
        elif run["interrupted_at"] is not None and now - run["interrupted_at"] > PATIENCE:
            # It does not answer an interrupt: a fresh interpreter.
            self.out({"type": "error", "name": "KeyboardInterrupt", "value": f"the run did not stop within "
                      f"{PATIENCE:g} s of its interrupt: the shell was started afresh", "traceback": []})
            self.end("timeout" if run["timed_out"] else "interrupted")
            self.replace_worker()
        elif run["signalled_at"] is not None and now - run["signalled_at"] > AGAIN:
            self.interrupt(now)

    def serve(self):
        pending = b""
        stdin_open = True
        while stdin_open or self.run is not None:
            send()
            fds = ([0] if stdin_open else []) + (list(self.worker.open) if self.worker else [])
            readable, _, _ = select.select(fds, [], [], 0.25)
            for fd in readable:
                if fd == 0:
                    data = os.read(0, 65536)
                    if not data:
                        stdin_open = False
                        continue
                    pending += data
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        try:
                            self.request(json.loads(line))
                        except ValueError:
                            continue
                elif self.worker is not None and fd in self.worker.open:
                    self.worker_output(fd)
            if self.worker is not None and self.worker.ready and not self.announced:
                self.announced = True
                emit({"type": "ready", "restarted": True} if self.restarted else {"type": "ready", "cwd": os.getcwd()})
            self.check()
            self.start_next()
        send()
        if self.worker is not None:
            self.worker.kill()


Driver().serve()
