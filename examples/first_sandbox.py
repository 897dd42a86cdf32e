#!/usr/bin/env python3
"""Your first sandbox, end to end, with the SPACE Python SDK.

It creates a sandbox and waits for it, runs a few commands that share
state, keeps the run's state and each command's transcript and result under
./space-runs/<sandbox id>/, then asks what to do with the sandbox: keep,
pause, suspend or delete. With stdin not a terminal it reads the choice
from stdin (`printf 'delete\\n' | python examples/first_sandbox.py`).

Needs SPACE_URL and SPACE_API_KEY (a dev server prints where its key is).
"""

import json
import pathlib
import sys
import time

from space_sdk import Sandbox, SpaceError

CHOICES = ("keep", "pause", "suspend", "delete")


def save(path: pathlib.Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")


def main() -> int:
    print("creating a sandbox from template 'base'…")
    print("  (the server accepts at once; the sandbox is ready only when the create operation succeeds — waiting)")
    started = time.monotonic()
    sbx = Sandbox.create(template="base", keep=True, env={"PROJECT": "first-sandbox"})
    print(f"  {sbx.id} is {sbx.info['state']} after {time.monotonic() - started:.2f}s")

    run_dir = pathlib.Path("space-runs") / sbx.id
    (run_dir / "commands").mkdir(parents=True, exist_ok=True)
    state = {"sandbox": sbx.info, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commands": []}
    save(run_dir / "run.json", state)

    steps = [
        "echo \"hello from $(hostname) in $PROJECT\"",
        "cd /root && echo 'state survives between commands' > notes.txt && ls -l notes.txt",
        "cat /root/notes.txt && python3 -c 'import sys; print(sys.version.split()[0])'",
        "echo 'a failing step' >&2; exit 3",
    ]
    for n, step in enumerate(steps, 1):
        print(f"\n$ {step}")
        result = sbx.commands.run(step, timeout=60)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        print(f"  → exit code {result.exit_code}" + (" (timed out)" if result.timed_out else ""))
        base = run_dir / "commands" / f"{n:02d}-{result.command_id}"
        (base.with_suffix(".stdout")).write_text(result.stdout)
        (base.with_suffix(".stderr")).write_text(result.stderr)
        record = {"command": step, "id": result.command_id, "exit_code": result.exit_code,
                  "signal": result.signal, "timed_out": result.timed_out}
        save(base.with_suffix(".result.json"), record)
        state["commands"].append(record)
        save(run_dir / "run.json", state)

    print(f"\ntranscripts and results are in {run_dir}/")
    if sys.stdin.isatty():
        prompt = f"what now with {sbx.id}? [{'/'.join(CHOICES)}] "
        choice = input(prompt).strip().lower()
    else:
        choice = sys.stdin.readline().strip().lower()
        print(f"choice from stdin: {choice!r}")
    if choice not in CHOICES:
        print(f"'{choice}' is not one of {', '.join(CHOICES)}; keeping the sandbox")
        choice = "keep"

    outcome = {"choice": choice}
    try:
        if choice == "keep":
            print(f"keeping {sbx.id}: it keeps running (SPACE_URL, `space sandbox get {sbx.id}`)")
        else:
            operation = getattr(sbx, choice)()
            outcome["operation"] = operation
            print(f"{choice}: operation {operation['id']} {operation['state']}; the sandbox is now {sbx.info['state']}")
    except SpaceError as err:
        outcome["error"] = str(err)
        print(f"{choice} failed: {err}", file=sys.stderr)
        save(run_dir / "outcome.json", outcome)
        return 1
    state["sandbox"] = sbx.info
    save(run_dir / "run.json", state)
    save(run_dir / "outcome.json", outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
