#!/usr/bin/env python3
"""Fails when the docs show a `space` command or flag the CLI does not
have: every `space ...` in the shell blocks and inline code of the named
markdown files is walked through the built binary's own `--help` (its
subcommands, then its options), so a renamed or removed flag breaks the
test command instead of a reader's first try.

Usage: check-cli-docs.py SPACE_BINARY FILE.md ...
"""

import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

SPACE = None
# Where a command line starts: `space`, maybe behind sudo or a path.
INVOCATION = re.compile(r"(?:^|(?<=[\s;&|(=]))(?:sudo\s+(?:-E\s+)?)?(?:\./target/release/|/usr/local/bin/)?space\s+(?=[a-z])")
SHELL_STOP = {"|", "||", "&&", ";", ")", ">", ">>", "<", "2>&1", "&", "--"}


@lru_cache(maxsize=None)
def help_of(path):
    """The subcommands and options `space PATH --help` lists."""
    shown = subprocess.run([SPACE, *path, "--help"], capture_output=True, text=True, timeout=30)
    if shown.returncode != 0:
        return None
    commands, options, section = set(), set(), None
    for line in shown.stdout.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line[:-1]
        elif section == "Commands":
            m = re.match(r"^  (\S+)", line)
            if m:
                commands.add(m.group(1))
        elif section == "Options":
            m = re.match(r"^\s+(?:-(\w),\s+)?--([\w-]+)|^\s+-(\w)\b", line)
            if m:
                options.update(x for x in m.groups() if x)
    return commands - {"help"}, options | {"help", "h"}


def invocations(text):
    """Every `space ...` command line of a markdown file's shell blocks and
    inline code, continuation lines joined and comments dropped."""
    lines = []
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang in ("", "sh", "bash", "console"):
            lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    lines += re.findall(r"`([^`]+)`", prose)
    for line in lines:
        line = re.sub(r"(^|\s)#.*", "", line)
        for m in INVOCATION.finditer(line):
            yield line[m.end():]


def tokens_of(rest):
    try:
        tokens = shlex.split(rest)
    except ValueError:
        tokens = rest.split()
    kept = []
    for token in tokens:
        if token in SHELL_STOP or token.startswith(("$(", ")")):
            break
        # The end of a `$(space ...)`: the command ends with this word.
        closes = token.endswith(")") and token.count("(") < token.count(")")
        kept.append(token.rstrip(")").strip("[]") if closes else token.strip("[]"))
        if closes:
            break
    return kept


def check(rest):
    """What is wrong with one command line, if anything."""
    tokens = tokens_of(rest)
    path, commands_left = (), None
    while tokens and help_of(path) and tokens[0] in help_of(path)[0]:
        path += (tokens.pop(0),)
    commands, options = help_of(path)
    if commands and not path:
        if tokens and not tokens[0].startswith("-"):
            return f"`space {tokens[0]}` is no command"
    if commands:
        # A shorthand such as `space keys … --database URL`: the flag must
        # belong to one of the group's commands.
        commands_left = commands
        options = set().union(*(help_of(path + (c,))[1] for c in commands_left))
    for token in tokens:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=")[0]
            if name not in options:
                return f"`space {' '.join(path)}` has no --{name}"
        elif re.match(r"^-[A-Za-z]+$", token):
            for letter in token[1:]:
                if letter not in options:
                    return f"`space {' '.join(path)}` has no -{letter}"
    return None


def main():
    global SPACE
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    SPACE = sys.argv[1]
    if help_of(()) is None:
        sys.exit(f"{SPACE} --help failed")
    wrong, count = [], 0
    for name in sys.argv[2:]:
        for rest in invocations(Path(name).read_text()):
            count += 1
            problem = check(rest)
            if problem:
                wrong.append(f"{name}: space {rest.strip()}: {problem}")
    for line in wrong:
        print(f"CLI docs: {line}", file=sys.stderr)
    if wrong:
        sys.exit(f"{len(wrong)} documented command(s) the CLI does not have")
    print(f"CLI docs checked: {count} command lines, all known to the CLI")


if __name__ == "__main__":
    main()
