"""The runnable examples of a markdown page (README.md, docs/your-kernel.md), read one way for
both: its fenced blocks; the ```python blocks whose first line is `# NAME.py`, files the reader
saves; the commands of a ```bash block, each with the exit code it must give (0, or the `# exit N`
its line ends with) or the reason it is not run here (a trailing `# gpu`, `# setup`, ...); and the
environment they run in, a user's: the installed package's scripts on PATH, no PYTHONPATH, no
progress bars; and how a page's commands run: the first in bash as written (the console script
itself), the others in one interpreter (tests/cli/one_interpreter.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ONE_INTERPRETER = Path(__file__).with_name("one_interpreter.py")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FILE_LINE = re.compile(r"# ([\w.]+\.py)")


@dataclass(frozen=True)
class Command:
    line: str
    exit_code: int | None  # None: not run here (`why` says why)
    why: str = ""


def blocks(text: str, language: str) -> list[str]:
    """The bodies of the page's fenced blocks tagged `language` ('' for untagged ones), in order."""
    return [body for lang, body in FENCE.findall(text) if lang == language]


def saved_name(body: str) -> str | None:
    """NAME.py if the block is a file the reader saves (its first line is `# NAME.py`)."""
    match = FILE_LINE.fullmatch(body.splitlines()[0])
    return None if match is None else match.group(1)


def saved_files(text: str) -> dict[str, str]:
    """NAME.py -> its text, for the python blocks that are files."""
    return {name: body for body in blocks(text, "python") if (name := saved_name(body))}


def commands(block: str, not_run: Mapping[str, str]) -> list[Command]:
    """The block's commands (continuation lines joined; blank and comment-only lines skipped)
    with their expected exit codes; a line ending in `# KEY` for a KEY of `not_run` is not run
    here, for the reason `not_run[KEY]` gives."""
    keys = "|".join(re.escape(k) for k in not_run)
    mark = re.compile(rf"\s#\s*({keys}|exit (\d+))\b")
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        found = mark.search(line)
        if found is None:
            out.append(Command(line, 0))
        elif found.group(2) is not None:
            out.append(Command(line, int(found.group(2))))
        else:
            out.append(Command(line, None, not_run[found.group(1)]))
    return out


def user_env() -> dict[str, str]:
    """A user's shell: the installed package's scripts on PATH, no PYTHONPATH (the checkout's
    `tests/` is not importable), no progress bars (their lines would interleave with reports)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MOE_VERIFY_PROGRESS"] = "0"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_lines(
    lines: list[str], cwd: Path, env: Mapping[str, str], timeout_s: float
) -> list[subprocess.CompletedProcess[str]]:
    """Each line's exit code and output, run in order in `cwd`: the first in bash, as written,
    so the installed console script itself runs; the rest in one interpreter
    (tests/cli/one_interpreter.py: `moe_verify.cli.main` per plain `moe-verify` line, bash for
    any other), which saves a fresh interpreter importing torch per command."""
    if not lines:
        return []
    first = subprocess.run(
        ["bash", "-c", lines[0]],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if len(lines) == 1:
        return [first]
    io = cwd.parent / f".{cwd.name}-one-interpreter"
    io.mkdir()
    (io / "lines.json").write_text(json.dumps(lines[1:]))
    driver = subprocess.run(
        [sys.executable, str(ONE_INTERPRETER), str(io / "lines.json"), str(io / "results.json")],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s * (len(lines) - 1),
    )
    assert driver.returncode == 0, f"{ONE_INTERPRETER.name} failed:\n{driver.stderr[-3000:]}"
    results = json.loads((io / "results.json").read_text())
    return [first] + [
        subprocess.CompletedProcess(r["line"], r["returncode"], r["stdout"], r["stderr"])
        for r in results
    ]
