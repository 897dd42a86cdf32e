# SPACE's code-context driver for Python, run by the agent in the sandbox as
# `python3 -c DRIVER`: IPython's shell (the execution and display machinery
# ipykernel wraps, without its messaging transport) in this very process,
# speaking JSON lines with the host on stdin/stdout.
# Requests: {"op": "run", "id", "code", "timeout_s", "env"}, {"op": "interrupt",
# "run"}, {"op": "restart"}. Events: {"type": "ready", "cwd"} once it can run; per run
# {"run", "type": "stdout"|"stderr", "text"}, {"run", "type": "result",
# "data": {mime: value}, "is_main_result"}, {"run", "type": "error", "name",
# "value", "traceback"}, and last {"run", "type": "end", "status":
# "ok"|"error"|"interrupted"|"timeout"|"died", "execution_count"}.
# An interrupt is never lost: one for a run not started yet ends it before
# its code runs; one that comes while the cell starts or runs raises
# KeyboardInterrupt in it (SIGINT is sent only while the cell runs, and
# the cell looks for an interrupt asked before it began).
# What is written straight to file descriptors 1 and 2 (programs a cell
# starts, C code) is captured and passed on as output. A restart, and a run
# that ignores its interrupt for 5 s, execs this process afresh (same pid,
# same pipes): the new interpreter ends the cut run, then says it is ready.
import base64
import io
import json
import os
import queue
import re
import select
import signal
import sys
import threading
import time

# Charts shown by matplotlib come back as images, without `savefig`.
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
# A run cut by the exec that made this process: {"run", "status"}.
CUT = os.environ.pop("SPACE_CONTEXT_CUT", None)
ENVIRON = dict(os.environ)

# Missing IPython fails here, with the host still reading our stderr.
from IPython.core.displayhook import DisplayHook  # noqa: E402
from IPython.core.displaypub import DisplayPublisher  # noqa: E402
from IPython.core.formatters import BaseFormatter  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from traitlets import ObjectName, Type, Unicode  # noqa: E402
from traitlets.config import Config  # noqa: E402

COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# How long an interrupted run has to end before the interpreter is replaced.
PATIENCE = 5.0
# The host's pipes move to descriptors of their own: a cell reads nothing
# on 0, and what it writes on 1 and 2 is captured.
REQUESTS, EVENTS, HOST_STDERR = os.dup(0), os.dup(1), os.dup(2)
CAPTURED = {}
for fd, kind in ((1, "stdout"), (2, "stderr")):
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)
    os.set_blocking(read_end, False)
    CAPTURED[read_end] = kind
NULL = os.open(os.devnull, os.O_RDONLY)
os.dup2(NULL, 0)
os.close(NULL)

LOCK = threading.Lock()  # the queued events
PENDING = []
PENDING_SIZE = [0]
CAPTURE = threading.Lock()  # reading the captured pipes
RUN_LOCK = threading.Lock()
# The run going on. `asked` counts its interrupts and `raised` those its
# cell was given as KeyboardInterrupt; `in_cell` is set while the cell runs
# (the only time a SIGINT of ours raises).
RUN = {"id": None, "in_cell": False, "asked": 0, "raised": 0, "errored": False}
# Interrupts of runs not started yet (their run request is still queued).
EARLY = set()


def encode(value):
    """JSON for what a display formatter returns: bytes (PNG, JPEG) as
    base64, numpy's numbers as numbers."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode()
    if hasattr(value, "item") and hasattr(value, "dtype"):
        try:
            return value.item()
        except ValueError:
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return repr(value)


def finite(value):
    """`value` with NaN and the infinities as null (JSON has none)."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(event):
    try:
        return json.dumps(event, default=encode, allow_nan=False)
    except ValueError:
        return json.dumps(finite(json.loads(json.dumps(event, default=encode))))


def emit(event, now=False):
    """Queues an event of the run going on (dropped between runs); they go
    out together (a quick cell's result and end in one write) at the end of
    a cell, within 50 ms, or past 64 KiB."""
    run = RUN["id"]
    if run is None and event.get("type") != "ready":
        return
    if run is not None:
        event["run"] = run
    line = dumps(event) + "\n"
    with LOCK:
        PENDING.append(line)
        PENDING_SIZE[0] += len(line)
        full = PENDING_SIZE[0] > 65536
    if now or full:
        send_events()


def send_events():
    with LOCK:
        data = memoryview("".join(PENDING).encode())
        PENDING.clear()
        PENDING_SIZE[0] = 0
        while data:
            data = data[os.write(EVENTS, data):]


class Stream(io.TextIOBase):
    """sys.stdout/sys.stderr: text goes out as events, in order with results,
    at most 50 ms late and at once before a result or the end."""

    def __init__(self, kind, fd):
        super().__init__()
        self.kind, self.fd, self.parts, self.size = kind, fd, [], 0
        self.lock = threading.Lock()

    encoding = "utf-8"
    errors = "replace"

    def writable(self):
        return True

    def isatty(self):
        return False

    def fileno(self):
        return self.fd

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self.lock:
            self.parts.append(text)
            self.size += len(text)
            full = self.size > 65536
        if full:
            self.flush()
        return len(text)

    def flush(self):
        with self.lock:
            text, self.parts, self.size = "".join(self.parts), [], 0
        if text:
            emit({"type": self.kind, "text": text})


def flush_streams():
    sys.stdout.flush()
    sys.stderr.flush()


def read_captured(fds):
    """Passes on what programs wrote to descriptors 1 and 2."""
    with CAPTURE:
        for fd in fds:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                emit({"type": CAPTURED[fd], "text": chunk.decode(errors="replace")})


def capture():
    while True:
        readable, _, _ = select.select(list(CAPTURED), [], [])
        read_captured(readable)


class Hook(DisplayHook):
    """The value of a cell's last expression: its main result."""

    def start_displayhook(self):
        self.data = None

    def write_output_prompt(self):
        pass

    def write_format_data(self, format_dict, md_dict=None):
        self.data = format_dict

    def finish_displayhook(self):
        flush_streams()
        if self.data:
            emit({"type": "result", "data": self.data, "is_main_result": True})
        self.data = None


class Publisher(DisplayPublisher):
    """`display(...)` and charts: results that are not the main one."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        flush_streams()
        emit({"type": "result", "data": data, "is_main_result": False})

    def clear_output(self, wait=False):
        pass


class Shell(InteractiveShell):
    displayhook_class = Type(Hook)
    display_pub_class = Type(Publisher)

    def _showtraceback(self, etype, evalue, stb):
        flush_streams()
        RUN["errored"] = True
        name = getattr(etype, "__name__", str(etype))
        emit({"type": "error", "name": name, "value": str(evalue),
              "traceback": [COLOUR.sub("", line) for line in stb]})

    def enable_gui(self, gui=None):
        pass

    def _get_exc_info(self, exc_tuple=None):
        etype, value, tb = super()._get_exc_info(exc_tuple)
        # The handler that raised a KeyboardInterrupt is not the user's code.
        link = tb
        while link is not None and link.tb_next is not None:
            if link.tb_next.tb_frame.f_code is on_sigint.__code__:
                link.tb_next = None
                break
            link = link.tb_next
        return etype, value, tb


def ask_interrupt(now):
    """Asks the run going on to stop; called with RUN_LOCK held."""
    RUN["asked"] += 1
    if RUN["interrupted_at"] is None:
        RUN["interrupted_at"] = now
    if RUN["in_cell"]:
        # The cell's children too (a `subprocess.run` it waits for).
        os.killpg(os.getpgrp(), signal.SIGINT)


def interrupt(run_id):
    with RUN_LOCK:
        if RUN["id"] is not None and RUN["id"] == run_id:
            ask_interrupt(time.monotonic())
        elif run_id is not None and len(EARLY) < 64:
            # Its run request is queued behind this one (or it is over:
            # then this is forgotten when the next run starts).
            EARLY.add(run_id)


def on_sigint(signum, frame):
    """SIGINT: a KeyboardInterrupt in the cell if one is asked and not yet
    given; otherwise nothing (between cells, or a stray one)."""
    if RUN["in_cell"] and RUN["asked"] > RUN["raised"]:
        RUN["raised"] = RUN["asked"]
        raise KeyboardInterrupt


def start_afresh(cut_status=None):
    """Execs a fresh interpreter in this process; it ends the run going on
    with `cut_status`. Called with RUN_LOCK held."""
    flush_streams()
    send_events()
    env = dict(ENVIRON)
    if RUN["id"] is not None and cut_status:
        env["SPACE_CONTEXT_CUT"] = json.dumps({"run": RUN["id"], "status": cut_status})
    os.dup2(REQUESTS, 0)
    os.dup2(EVENTS, 1)
    os.dup2(HOST_STDERR, 2)
    os.execve(sys.executable, sys.orig_argv, env)


def read_requests(runs):
    pending = b""
    while True:
        data = os.read(REQUESTS, 65536)
        if not data:
            runs.put(None)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = json.loads(line)
            except ValueError:
                continue
            op = request.get("op")
            if op == "interrupt":
                interrupt(request.get("run"))
            elif op == "restart":
                with RUN_LOCK:
                    start_afresh("died")
            elif op == "run":
                runs.put(request)


def watch():
    """Flushes output every 50 ms; interrupts a run past its deadline, and
    replaces the interpreter if it does not answer the interrupt."""
    while True:
        time.sleep(0.05)
        flush_streams()
        send_events()
        with RUN_LOCK:
            if RUN["id"] is None:
                continue
            now = time.monotonic()
            if RUN["deadline"] and now > RUN["deadline"] and not RUN["timed_out"]:
                RUN["timed_out"] = True
                ask_interrupt(now)
            elif RUN["interrupted_at"] is not None and now - RUN["interrupted_at"] > PATIENCE:
                start_afresh("timeout" if RUN["timed_out"] else "interrupted")


def run(shell, request):
    timeout = request.get("timeout_s")
    with RUN_LOCK:
        early = request["id"] in EARLY
        EARLY.clear()
        RUN.update(id=request["id"], deadline=time.monotonic() + timeout if timeout else None,
                   interrupted_at=time.monotonic() if early else None, timed_out=False,
                   asked=1 if early else 0, raised=0, in_cell=False, errored=False)
    env = request.get("env") or {}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    status = "error"
    try:
        try:
            RUN["in_cell"] = True
            # An interrupt asked before this line sent no signal: it is
            # given here (one asked after it comes as SIGINT).
            if RUN["asked"] > RUN["raised"]:
                RUN["raised"] = RUN["asked"]
                raise KeyboardInterrupt
            result = shell.run_cell(request["code"], store_history=True)
            status = "ok" if result.success else "error"
        finally:
            RUN["in_cell"] = False
    except KeyboardInterrupt:
        pass  # Before the cell began, or after its own handling: shown below.
    RUN["in_cell"] = False
    # An interrupt the cell was given is always shown as one, also when it
    # was not shown yet: raised before the cell began or after its own
    # handling, or while IPython compiled the cell (its traceback printer
    # then fails on the compiler's frame and prints around `_showtraceback`).
    if RUN["raised"] and not RUN["errored"] and status != "ok":
        emit({"type": "error", "name": "KeyboardInterrupt", "value": "", "traceback": ["KeyboardInterrupt"]})
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    flush_streams()
    read_captured(list(CAPTURED))
    with RUN_LOCK:
        if RUN["timed_out"]:
            status = "timeout"
        elif RUN["asked"] and status != "ok":
            status = "interrupted"
        emit({"type": "end", "status": status, "execution_count": shell.execution_count - 1}, now=True)
        RUN["id"] = None


class TableFormatter(BaseFormatter):
    """`e2b/data`: a pandas DataFrame as its columns (E2B's code
    interpreter shows it as `result.data`)."""

    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj):
        # Only a cell that imported pandas can show a DataFrame.
        pandas = sys.modules.get("pandas")
        if pandas is not None and isinstance(obj, pandas.DataFrame):
            columns = obj.to_dict(orient="list")
            for name, values in columns.items():
                columns[name] = [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
            return columns
        return super().__call__(obj)


class ChartFormatter(BaseFormatter):
    """`e2b/chart`: what a matplotlib figure draws, as data (`chart_of`)."""

    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict, str)

    def __call__(self, obj):
        figure = sys.modules.get("matplotlib.figure")
        if figure is not None and isinstance(obj, figure.Figure):
            try:
                return chart_of(obj)
            except Exception:  # noqa: BLE001 - a figure it cannot read is shown as an image only
                return None
        return super().__call__(obj)


def show_saved_images(module):
    """`Image.save(path)` displays the image too (as E2B's code interpreter
    does)."""
    saved = module.Image.save

    def save(image, fp, format=None, **params):
        if isinstance(fp, (str, os.PathLike)):
            from IPython.display import display

            display(image)
        return saved(image, fp, format, **params)

    module.Image.save = save


class AfterImport:
    """Imports these modules as they are, then changes them (`PATCHES`),
    without importing any before a cell does."""

    PATCHES = {"PIL.Image": show_saved_images, "matplotlib.axes._axes": keep_box_stats}

    def find_spec(self, name, path=None, target=None):
        patch = self.PATCHES.get(name)
        if patch is None:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loaded = spec.loader.exec_module

        def exec_module(module):
            loaded(module)
            try:
                patch(module)
            except Exception:  # noqa: BLE001 - another version of the module: left as it is
                pass

        spec.loader.exec_module = exec_module
        return spec


def add_formats(shell):
    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = TableFormatter(parent=shell.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=shell.display_formatter)
    sys.meta_path.insert(0, AfterImport())


def main():
    sys.stdout, sys.stderr = Stream("stdout", 1), Stream("stderr", 2)
    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "NoColor"
    shell = Shell.instance(config=config)
    add_formats(shell)
    signal.signal(signal.SIGINT, on_sigint)
    if CUT:
        cut = json.loads(CUT)
        RUN["id"] = cut["run"]
        if cut["status"] == "interrupted":
            emit({"type": "error", "name": "KeyboardInterrupt", "value": f"the run did not stop within {PATIENCE:g} s"
                  " of its interrupt: the interpreter was started afresh", "traceback": []})
        emit({"type": "end", "status": cut["status"], "execution_count": None})
        RUN["id"] = None
    runs = queue.Queue()
    for target, args in ((read_requests, (runs,)), (watch, ()), (capture, ())):
        threading.Thread(target=target, args=args, daemon=True).start()
    emit({"type": "ready", "cwd": os.getcwd()}, now=True)
    while True:
        request = runs.get()
        if request is None:
            break
        try:
            run(shell, request)
        except KeyboardInterrupt:
            # Interrupts asked twice within a few instructions of the
            # cell's end: the run's end still goes out.
            RUN["in_cell"] = False
            with RUN_LOCK:
                if RUN["id"] is not None:
                    emit({"type": "end", "status": "interrupted", "execution_count": None}, now=True)
                    RUN["id"] = None


main()
