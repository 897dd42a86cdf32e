# SPACE's code-context driver for Python: runs in the sandbox, keeps one
# Jupyter kernel (ipykernel) alive, and speaks JSON lines with the host on
# stdin/stdout. Requests: {"op": "run", "id", "code", "timeout_s"},
# {"op": "interrupt"}, {"op": "restart"}. Events: {"type": "ready"} when the
# kernel answers; per run {"run", "type": "stdout"|"stderr", "text"},
# {"run", "type": "result", "data": {mime: value}, "is_main_result"},
# {"run", "type": "error", "name", "value", "traceback"}, and last
# {"run", "type": "end", "status": "ok"|"error"|"timeout"|"died",
#  "execution_count"}; {"type": "died", "why"} when the kernel dies.
import json
import os
import queue
import re
import sys
import threading
import time

from jupyter_client.manager import KernelManager

OUT = sys.stdout
LOCK = threading.Lock()
COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def emit(event):
    with LOCK:
        OUT.write(json.dumps(event) + "\n")
        OUT.flush()


def ready(manager, client, patience=120):
    """Waits until the kernel answers; fails at once if it exits meanwhile
    (out of memory, a broken install)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            client.wait_for_ready(timeout=1)
            return
        except RuntimeError:
            if not manager.is_alive():
                raise RuntimeError("the interpreter exited while starting (out of memory?)")
            if time.monotonic() > deadline:
                raise


def start():
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=os.getcwd(), env=dict(os.environ))
    client = manager.client()
    client.start_channels()
    ready(manager, client)
    return manager, client


def restart(manager, client):
    """A fresh interpreter: restarted if it still runs, started anew if it
    died (its channels are new then)."""
    if manager.is_alive():
        manager.restart_kernel(now=True)
        ready(manager, client)
        return manager, client
    client.stop_channels()
    try:
        manager.cleanup_resources()
    except Exception:
        pass
    return start()


def run(manager, client, request):
    run_id = request["id"]
    timeout = request.get("timeout_s") or None
    msg_id = client.execute(request["code"], store_history=True, allow_stdin=False)
    deadline = time.monotonic() + timeout if timeout else None
    interrupted_at = None
    status = "ok"
    while True:
        try:
            message = client.get_iopub_msg(timeout=0.25)
        except queue.Empty:
            if not manager.is_alive():
                emit({"type": "died", "why": "the interpreter exited"})
                return {"run": run_id, "type": "end", "status": "died", "execution_count": None}
            now = time.monotonic()
            if deadline and now > deadline and interrupted_at is None:
                status, interrupted_at = "timeout", now
                manager.interrupt_kernel()
            elif interrupted_at is not None and now - interrupted_at > 5:
                # It does not answer an interrupt: start it afresh.
                STATE["manager"], STATE["client"] = restart(manager, client)
                emit({"type": "ready", "restarted": True})
                return {"run": run_id, "type": "end", "status": "timeout", "execution_count": None}
            continue
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            emit({"run": run_id, "type": content["name"], "text": content["text"]})
        elif kind in ("execute_result", "display_data"):
            emit({"run": run_id, "type": "result", "data": content.get("data", {}),
                  "is_main_result": kind == "execute_result"})
        elif kind == "error":
            if status == "ok":
                status = "error"
            traceback = [COLOUR.sub("", line) for line in content["traceback"]]
            emit({"run": run_id, "type": "error", "name": content["ename"], "value": content["evalue"],
                  "traceback": traceback})
        elif kind == "status" and content["execution_state"] == "idle":
            break
    count = None
    waited = time.monotonic() + 5
    while time.monotonic() < waited:
        try:
            reply = client.get_shell_msg(timeout=max(0.0, waited - time.monotonic()))
        except queue.Empty:
            break
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            count = reply["content"].get("execution_count")
            break
    return {"run": run_id, "type": "end", "status": status, "execution_count": count}


STATE = {}


def main():
    STATE["manager"], STATE["client"] = start()
    requests = queue.Queue()

    def read():
        for line in sys.stdin:
            try:
                request = json.loads(line)
            except ValueError:
                continue
            if request.get("op") == "interrupt":
                if STATE["manager"].is_alive():
                    STATE["manager"].interrupt_kernel()
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
            try:
                STATE["manager"], STATE["client"] = restart(STATE["manager"], STATE["client"])
            except Exception as e:
                emit({"type": "died", "why": f"the interpreter did not start again: {e}"})
                continue
            emit({"type": "ready", "restarted": True})
        elif request.get("op") == "run":
            emit(run(STATE["manager"], STATE["client"], request))
    STATE["client"].stop_channels()
    STATE["manager"].shutdown_kernel(now=True)


main()
