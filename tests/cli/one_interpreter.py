"""Runs a page's `moe-verify` lines in one interpreter, as the console script would run each.

`python one_interpreter.py COMMANDS.json RESULTS.json` reads a JSON list of shell lines and writes
one {"line", "returncode", "stdout", "stderr"} per line. A plain `moe-verify ARGS` line (no pipe,
redirect, variable or glob) is `moe_verify.cli.main(ARGS)` in this process, with file descriptors
1 and 2 sent to files for its duration (so what its children print is caught too), the
environment and the working directory put back after it, and sys.argv[0] `moe-verify` as the
console script has it; any other line runs in bash. What is saved: a fresh interpreter importing
torch and the suite per command (1.4-2.0 s on the CPU tier's 2 cores, docs/ci.md).

The console script's sys.path holds its bin directory, not this file's folder nor the working
directory: the folder is dropped before anything is imported, so a module of the checkout's
`tests/` or the working directory (a user's `my_kernels.py`) is importable only as the CLI makes
it (moe_verify/common/loader.py), as for a user.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

_SHELL = set("|&;<>()$`*?[]{}~=\\\"'")


def in_process_args(line: str) -> list[str] | None:
    """The arguments of a plain `moe-verify ...` line (a trailing comment dropped), or None for
    a line only bash can run as written."""
    words = shlex.split(line, comments=True)
    if not words or words[0] != "moe-verify":
        return None
    code = line.split(" #", 1)[0]
    if any(ch in _SHELL for ch in code):
        return None
    return words[1:]


def _captured(run: object) -> tuple[int, str, str]:
    """run() with descriptors 1 and 2 in temporary files: (its exit code, stdout, stderr)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = run()  # type: ignore[operator]
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def run_line(line: str) -> dict[str, object]:
    args = in_process_args(line)
    if args is None:
        proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True)
        return {
            "line": line,
            "returncode": proc.returncode,
            "stdout": proc.stdout,
            "stderr": proc.stderr,
        }
    from moe_verify.cli import main

    env, cwd, argv = dict(os.environ), os.getcwd(), sys.argv
    sys.argv = ["moe-verify", *args]

    def console_script() -> int:
        try:
            return main(args)
        except SystemExit as exc:  # argparse's own errors, --help
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)

    try:
        code, out, err = _captured(console_script)
    finally:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = argv
    return {"line": line, "returncode": code, "stdout": out, "stderr": err}


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: the console script has its bin directory there
    lines = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run_line(line) for line in lines]))
