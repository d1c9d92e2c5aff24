"""The command line a node runs: a bash wrapper in its own session and process group that reports its group, reads
the command's environment from stdin (never the command line, which every user of the node can read) and copies the
output to the node's log."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

PGID_MARKER = "@@trainpipe-pgid"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# $1 is the node's log file (/dev/null for none), the rest is the command. The command runs in a subshell that
# restores SIGTERM/SIGINT (SIGHUP stays ignored, as under nohup: a lost connection must not kill it). Its environment
# comes on stdin as NAME=value entries, each ended by a NUL (values may hold newlines), then an empty entry: input that
# ends before that entry exits 125, so a command never runs with half its environment.
WRAPPER = f"""trap '' TERM INT HUP
printf '%s %s\\n' {PGID_MARKER} "$$"
while :; do IFS= read -r -d '' entry || exit 125; [ -z "$entry" ] && break; export -- "$entry" || exit 125; done
log=$1; shift
if [ "$log" != /dev/null ]; then mkdir -p -- "$(dirname -- "$log")" || exit 125; fi
( trap - TERM INT; {{setup}}exec "$@" ) </dev/null 2>&1 | tee -p -a -- "$log"
exit "${{PIPESTATUS[0]}}"
"""


def wrapped_command(argv: Sequence[str], workdir: str | None, log_path: str | None) -> str:
    """The remote command line: the wrapper in its own session (setsid -w waits and returns its status). It holds
    no environment value: those go to the wrapper's stdin (environment_input)."""
    setup = f"cd -- {shlex.quote(workdir)} || exit 1; " if workdir else ""
    script = WRAPPER.replace("{setup}", setup)
    return " ".join(["exec setsid -w bash -c", shlex.quote(script), "trainpipe-node",
                     shlex.quote(log_path or "/dev/null"), *(shlex.quote(arg) for arg in argv)])


def environment_input(env: Mapping[str, str]) -> bytes:
    """What the wrapper reads from stdin: each NAME=value ended by a NUL, then an empty entry."""
    entries = []
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise ValueError(f"environment variable name {name!r} is not a shell identifier")
        if "\0" in value:
            raise ValueError(f"environment variable {name}: a value cannot hold a NUL character")
        entries.append(f"{name}={value}\0".encode())
    return b"".join(entries) + b"\0"
