"""Every shell example in the README runs as written: each ```bash block is one item, its commands
run in order from a fresh, empty scratch directory outside the checkout, with
the package installed and no PYTHONPATH (as a user runs them: `tests/` is not importable there),
each exiting 0 or with the `# exit N` its line says; the transcript of the example report
(```console, `$ ` lines) must exit as its `echo $?` says and print its header and verdict lines.

A block's first command runs in bash, the console script itself; the others run in one
interpreter, each as `moe_verify.cli.main` (tests/cli/doc_examples.py `run_lines`). A trailing
`# gpu`, `# vllm`, `# setup` or `# suite` comment marks a command not run here (a GPU,
vLLM, an install, the test suite itself); python blocks whose first line is `# NAME.py` are written
to the scratch directory first, as the README tells its reader to save them. The CLI summary
(the README's "The CLI" block) must name every flag its examples pass, under the command they
pass it to.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from moe_verify.args import add_problem_args
from moe_verify.cli import build_parser
from tests.cli import doc_examples
from tests.cli.doc_examples import Command, user_env

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOT_RUN = {
    "gpu": "needs a GPU",
    "vllm": "needs vLLM installed",
    "setup": "installs packages",
    "suite": "is the test suite itself",
}


def commands(block: str) -> list[Command]:
    return doc_examples.commands(block, NOT_RUN)


def blocks(language: str) -> list[str]:
    return doc_examples.blocks(README.read_text(), language)


def shell_blocks() -> dict[str, list[Command]]:
    """id (the block's first command) -> its commands."""
    out = {}
    for body in blocks("bash"):
        cmds = commands(body)
        out[" ".join(cmds[0].line.split()[:4])] = cmds
    return out


def _scratch(tmp_path: Path) -> Path:
    """A fresh directory outside the checkout holding only the README's `# NAME.py` files."""
    cwd = tmp_path / "scratch"
    cwd.mkdir()
    assert ROOT not in cwd.resolve().parents, f"{cwd} is inside the checkout {ROOT}"
    for name, text in doc_examples.saved_files(README.read_text()).items():
        (cwd / name).write_text(text)
    return cwd


def _run(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = user_env()
    assert "PYTHONPATH" not in env and ROOT not in cwd.resolve().parents
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_checkout_is_not_importable_where_the_examples_run(tmp_path: Path) -> None:
    """What makes the examples a user's: a README command that names a module of the checkout's
    tests (`--backend tests.tester...:Class`) fails here as it fails for a user."""
    cwd = _scratch(tmp_path)
    proc = _run("python -c 'import tests.tester'", cwd)
    assert proc.returncode != 0 and "No module named 'tests'" in proc.stderr, proc.stderr
    proc = _run("python -c 'import moe_verify.examples'", cwd)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("block", list(shell_blocks()))
def test_readme_shell_block_runs_as_written(block: str, tmp_path: Path) -> None:
    cmds = shell_blocks()[block]
    runnable = [c for c in cmds if c.exit_code is not None]
    if not runnable:
        pytest.skip("; ".join(sorted({f"{c.line.split()[0]}... {c.why}" for c in cmds})))
    cwd = _scratch(tmp_path)
    env = user_env()
    assert "PYTHONPATH" not in env and ROOT not in cwd.resolve().parents
    procs = doc_examples.run_lines([c.line for c in runnable], cwd, env, timeout_s=300)
    for cmd, proc in zip(runnable, procs, strict=True):
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


FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def problem_flags() -> set[str]:
    """The problem's flags (moe_verify/args.py add_problem_args), which `[problem flags]` names."""
    parser = argparse.ArgumentParser(add_help=False)
    add_problem_args(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def cli_summary() -> dict[str, set[str]]:
    """command -> the flags "The CLI" block names for it; `[problem flags]` stands for the
    problem's flags, as `run`'s lines name them (only those: run's --backend is not bench's)."""
    (block,) = [b for b in blocks("") if b.startswith("moe-verify run [")]
    named: dict[str, set[str]] = {}
    command = ""
    for line in block.splitlines():
        if line.startswith("moe-verify "):
            command = line.split()[1]
        named.setdefault(command, set()).update(FLAG.findall(line))
        if "[problem flags]" in line:
            named[command] |= named["run"] & problem_flags()
    return named


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def example_commands() -> list[tuple[str, list[str]]]:
    """(command, its arguments) of every `moe-verify` line in the README's examples, the
    transcript and the lines not run here included (`moe-verify` alone, or with flags, is run)."""
    lines = [c.line for cmds in shell_blocks().values() for c in cmds]
    lines += [line[2:] for line in blocks("console")[0].splitlines() if line.startswith("$ ")]
    out = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if "moe-verify" not in words:
            continue
        args = words[words.index("moe-verify") + 1 :]
        if args and not args[0].startswith("-"):
            out.append((args[0], args[1:]))
        else:
            out.append(("run", args))
    return out


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_the_cli_summary_names_every_flag_of_each_command(command: str) -> None:
    named = cli_summary().get(command, set())
    missing = [
        "/".join(a.option_strings)
        for a in subcommands()[command]._actions
        if a.option_strings and a.help != argparse.SUPPRESS and "--help" not in a.option_strings
        if not set(a.option_strings) & named
    ]
    assert not missing, f"the README's CLI summary of `moe-verify {command}` lacks {missing}"


@pytest.mark.parametrize(("command", "args"), example_commands(), ids=lambda x: str(x)[:60])
def test_each_example_passes_flags_its_command_has(command: str, args: list[str]) -> None:
    """So an example's flag is one the summary names (the test above): a flag the command does
    not have, or one of another command, fails here even where the line does not run (a GPU)."""
    parser = subcommands()[command]
    unknown = [
        a
        for a in args
        if FLAG.fullmatch(a.split("=")[0]) and a.split("=")[0] not in parser._option_string_actions
    ]
    assert not unknown, f"`moe-verify {command}` has no {unknown}"


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
