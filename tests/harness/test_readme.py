"""Every shell example in the README runs as written: each ```bash block is one item, its commands
run in order (one bash per line) from a scratch directory with the checkout importable, as from
the repo root, each exiting 0 or with the `# exit N` its line says; the transcript of the example
report (```console, `$ ` lines) must exit as its `echo $?` says and print its header line.

A trailing `# gpu`, `# vllm`, `# setup` or `# suite` comment marks a command not run here (a GPU,
vLLM, an install, the test suite itself); python blocks whose first line is `# NAME.py` are written
to the scratch directory first, as the README tells its reader to save them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOT_RUN = {
    "gpu": "needs a GPU",
    "vllm": "needs vLLM installed",
    "setup": "installs packages",
    "suite": "is the test suite itself",
}
MARK = re.compile(r"\s#\s*(gpu|vllm|setup|suite|exit (\d+))\b")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Command:
    line: str
    exit_code: int | None  # None: not run here (`why` says why)
    why: str = ""


def commands(block: str) -> list[Command]:
    """The block's commands with their expected exit codes; comment-only lines skipped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        mark = MARK.search(line)
        if mark is None:
            out.append(Command(line, 0))
        elif mark.group(2) is not None:
            out.append(Command(line, int(mark.group(2))))
        else:
            out.append(Command(line, None, NOT_RUN[mark.group(1)]))
    return out


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def shell_blocks() -> dict[str, list[Command]]:
    """id (the block's first command) -> its commands."""
    out = {}
    for body in blocks("bash"):
        cmds = commands(body)
        out[" ".join(cmds[0].line.split()[:4])] = cmds
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, MOE_VERIFY_PROGRESS="0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)  # the checkout importable, as from the repo root
    return env


def _scratch(tmp_path: Path) -> Path:
    for body in blocks("python"):
        first = body.splitlines()[0]
        if re.fullmatch(r"# [\w.]+\.py", first):
            (tmp_path / first[2:]).write_text(body)
    return tmp_path


def _run(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("block", list(shell_blocks()))
def test_readme_shell_block_runs_as_written(block: str, tmp_path: Path) -> None:
    cmds = shell_blocks()[block]
    runnable = [c for c in cmds if c.exit_code is not None]
    if not runnable:
        pytest.skip("; ".join(sorted({f"{c.line.split()[0]}... {c.why}" for c in cmds})))
    cwd = _scratch(tmp_path)
    for cmd in runnable:
        proc = _run(cmd.line, cwd)
        assert proc.returncode == cmd.exit_code, (
            f"{cmd.line!r} exited {proc.returncode}, the README says {cmd.exit_code}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )


def test_readme_example_report_is_what_the_command_prints(tmp_path: Path) -> None:
    (transcript,) = blocks("console")
    lines = transcript.splitlines()
    command = lines[0].removeprefix("$ ")
    exit_line = lines.index("$ echo $?")
    proc = _run(command, _scratch(tmp_path))
    assert proc.returncode == int(lines[exit_line + 1]), proc.stderr[-2000:]
    assert lines[1] in proc.stdout.splitlines(), proc.stdout  # the header, verbatim
    assert lines[exit_line - 1] == proc.stdout.splitlines()[-1]  # and the verdict line


def test_the_markers_are_read() -> None:
    """A marker the parser missed would run a GPU command on a CPU, or skip a CPU one."""
    parsed = commands(
        "moe-verify\nmoe-verify run --x  # exit 1: why\npip install x  # setup\n"
        "# a comment\npython -m pytest -m sm90  # gpu: H100\n"
    )
    assert [(c.line.split()[0], c.exit_code) for c in parsed] == [
        ("moe-verify", 0),
        ("moe-verify", 1),
        ("pip", None),
        ("python", None),
    ]
