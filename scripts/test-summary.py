#!/usr/bin/env python3
"""The summary scripts/test.sh ends with, from nextest's JUnit report.

Passed, failed and skipped tests (a test that passes after saying SKIP,
because this host lacks what it needs, is counted as skipped and named;
so are tests nextest did not run), the failed ones by name and how they
failed (a test the watchdog stopped says "timed out"), the ten slowest,
the total time and the free disk.
"""

import argparse
import re
import shutil
import sys
import xml.etree.ElementTree as ET


def said_skip(case):
    """Whether the test's output has a line starting with SKIP."""
    for stream in ("system-out", "system-err"):
        node = case.find(stream)
        if node is not None and node.text and re.search(r"^SKIP", node.text, re.MULTILINE):
            return True
    return False


def skip_reason(case):
    for stream in ("system-out", "system-err"):
        node = case.find(stream)
        if node is not None and node.text:
            match = re.search(r"^SKIP\S*\s*(.*)$", node.text, re.MULTILINE)
            if match:
                # "SKIPPED <test name>: why" or "SKIP: why": the why.
                return match.group(1).split(": ", 1)[-1][:160]
    return ""


def minutes(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s"


def not_run(log):
    """Tests nextest listed but did not run, from its last summary line."""
    try:
        with open(log, errors="replace") as text:
            lines = [line for line in text if "Summary [" in line]
    except OSError:
        return 0
    match = re.search(r"(\d+) skipped", lines[-1]) if lines else None
    return int(match.group(1)) if match else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--junit", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--tests", required=True)
    parser.add_argument("--unprivileged", required=True)
    parser.add_argument("--doctests", required=True)
    parser.add_argument("--fuzzing", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--disk", action="append", default=[])
    args = parser.parse_args()

    print()
    print("==> summary")
    cases = []
    try:
        root = ET.parse(args.junit).getroot()
        for suite in root.iter("testsuite"):
            for case in suite.iter("testcase"):
                cases.append((suite.get("name", ""), case))
    except (OSError, ET.ParseError) as err:
        print(f"no test report ({err}): the tests did not run to their end")

    failed, skipped, passed = [], [], []
    for binary, case in cases:
        name = f"{binary} {case.get('name', '')}"
        seconds = float(case.get("time", "0") or 0)
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            # nextest's message is the panic's first line, or says it timed out.
            how = problem.get("message") or problem.get("type") or "failed"
            failed.append((name, seconds, how))
        elif said_skip(case):
            skipped.append((name, skip_reason(case)))
        else:
            passed.append(name)
    unrun = not_run(args.log)

    print(f"tests: {len(passed)} passed, {len(failed)} failed, {len(skipped) + unrun} skipped")
    for name, seconds, how in failed:
        print(f"  FAILED  {name} ({how}, after {seconds:.0f} s)")
    for name, why in skipped:
        print(f"  SKIPPED {name}: {why}")
    if unrun:
        print(f"  SKIPPED {unrun} test(s) nextest did not run (ignored or filtered out)")
    print(f"unprivileged tests: {args.unprivileged}; doc tests: {args.doctests}; fuzzing: {args.fuzzing}")

    slowest = sorted(((float(c.get("time", "0") or 0), f"{b} {c.get('name', '')}") for b, c in cases), reverse=True)
    if slowest:
        print("ten slowest tests:")
        for seconds, name in slowest[:10]:
            print(f"  {seconds:8.1f} s  {name}")
    test_time = float(root.get("time", "0") or 0) if cases else 0
    print(f"total time: {minutes(args.seconds)} (the tests: {minutes(test_time)})")
    for path in dict.fromkeys(args.disk):
        try:
            free = shutil.disk_usage(path).free
            print(f"free disk at {path}: {free / (1 << 30):.1f} GiB")
        except OSError as err:
            print(f"free disk at {path}: unknown ({err})")
    verdict = "passed" if args.tests == "passed" and not failed else "failed"
    print(f"tests {verdict}; unprivileged tests {args.unprivileged}; doc tests {args.doctests}; fuzzing {args.fuzzing}")


if __name__ == "__main__":
    sys.exit(main())
