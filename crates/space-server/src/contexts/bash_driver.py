# SPACE's code-context driver for bash: keeps one bash process alive (its
# variables, functions, cwd and exports carry from run to run) and speaks
# the same JSON lines as the Python driver. A run's end is found by a
# marker the driver prints after the code, on stdout and stderr; a run that
# exits non-zero ends with status "error" and an `ExitStatus` error.
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import uuid

LOCK = threading.Lock()


def emit(event):
    with LOCK:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def spawn():
    shell = subprocess.Popen(["bash", "--norc", "--noprofile"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    # SIGINT stops what runs, not the shell itself.
    shell.stdin.write(b"trap : INT\n")
    shell.stdin.flush()
    return shell


STATE = {"shell": spawn(), "count": 0}


def interrupt():
    try:
        os.killpg(STATE["shell"].pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def run(request):
    shell, run_id = STATE["shell"], request["id"]
    marker = ("__space_end_" + uuid.uuid4().hex).encode()
    script = request["code"].encode() + b"\n__space_status=$?; printf '%s %d\\n' " + marker + \
        b" $__space_status; printf '%s\\n' " + marker + b" >&2\n"
    try:
        shell.stdin.write(script)
        shell.stdin.flush()
    except BrokenPipeError:
        pass
    pending = {shell.stdout.fileno(): [b"", "stdout"], shell.stderr.fileno(): [b"", "stderr"]}
    timeout = request.get("timeout_s")
    deadline = time.monotonic() + timeout if timeout else None
    status, interrupted_at, exit_code = "ok", None, None
    while pending:
        ready, _, _ = select.select(list(pending), [], [], 0.25)
        for fd in ready:
            chunk = os.read(fd, 65536)
            held, kind = pending[fd]
            held += chunk
            at = held.find(marker)
            if at >= 0:
                if held[:at]:
                    emit({"run": run_id, "type": kind, "text": held[:at].decode(errors="replace")})
                if kind == "stdout":
                    tail = held[at + len(marker):].split(b"\n", 1)[0].strip()
                    exit_code = int(tail or b"0")
                del pending[fd]
                continue
            if not chunk:
                del pending[fd]
                continue
            # Hold back what could be the start of the marker.
            keep = len(marker)
            if len(held) > keep:
                emit({"run": run_id, "type": kind, "text": held[:-keep].decode(errors="replace")})
                held = held[-keep:]
            pending[fd][0] = held
        if shell.poll() is not None:
            emit({"type": "died", "why": f"the shell exited ({shell.returncode})"})
            return {"run": run_id, "type": "end", "status": "died", "execution_count": None}
        now = time.monotonic()
        if deadline and now > deadline and interrupted_at is None:
            status, interrupted_at = "timeout", now
            interrupt()
        elif interrupted_at is not None and now - interrupted_at > 5:
            shell.kill()
            STATE["shell"] = spawn()
            emit({"type": "ready", "restarted": True})
            return {"run": run_id, "type": "end", "status": "timeout", "execution_count": None}
    STATE["count"] += 1
    if exit_code and status == "ok":
        status = "error"
        emit({"run": run_id, "type": "error", "name": "ExitStatus", "value": f"exited with {exit_code}",
              "traceback": []})
    return {"run": run_id, "type": "end", "status": status, "execution_count": STATE["count"],
            "exit_code": exit_code}


def main():
    requests = queue.Queue()

    def read():
        for line in sys.stdin:
            try:
                request = json.loads(line)
            except ValueError:
                continue
            if request.get("op") == "interrupt":
                interrupt()
            else:
                requests.put(request)
        requests.put(None)

    threading.Thread(target=read, daemon=True).start()
    emit({"type": "ready"})
    while True:
        request = requests.get()
        if request is None:
            break
        if request.get("op") == "restart":
            STATE["shell"].kill()
            STATE["shell"], STATE["count"] = spawn(), 0
            emit({"type": "ready", "restarted": True})
        elif request.get("op") == "run":
            emit(run(request))
    STATE["shell"].kill()


main()
