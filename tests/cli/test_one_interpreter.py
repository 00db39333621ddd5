"""The doc tests' one-interpreter runner (tests/cli/one_interpreter.py) says what bash would: each
command's exit code, its stdout and stderr, one command's environment not leaking into the next,
and the checkout's `tests/` no more importable there than in a user's shell."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.doc_examples import run_lines, user_env
from tests.cli.one_interpreter import in_process_args

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]

# (line, exit code, a needle of its stdout or stderr); all refused or answered before any work
LINES = [
    ("moe-verify run --json no/such/dir/report.json  # exit 2", 2, "no/such/dir"),
    ("moe-verify run --no-such-flag", 2, "unrecognized arguments: --no-such-flag"),
    ("moe-verify run --help", 0, "usage: moe-verify run"),
    # as for a user: the checkout's tests are not a module where the examples run
    (
        "moe-verify run --backend tests.tester.wrong_backends:SwappedExpertRows",
        2,
        "No module named 'tests'",
    ),
    ("echo from-bash; exit 3", 3, "from-bash"),
]


def test_plain_moe_verify_lines_run_in_process_and_the_rest_in_bash() -> None:
    assert in_process_args("moe-verify run -T 4 --poison 0xFF  # exit 1: why") == [
        "run",
        "-T",
        "4",
        "--poison",
        "0xFF",
    ]
    assert in_process_args("moe-verify") == []
    for line in ("moe-verify run > out.txt", "moe-verify run | tail -1", "X=1 moe-verify run"):
        assert in_process_args(line) is None, line
    assert in_process_args("python -m moe_verify.cli run") is None


def test_each_line_says_what_bash_says(tmp_path: Path) -> None:
    cwd = tmp_path / "scratch"
    cwd.mkdir()
    env = user_env()
    lines = [line for line, _, _ in LINES]
    in_one = run_lines(["true", *lines], cwd, env, timeout_s=120)[1:]
    for (line, code, needle), proc in zip(LINES, in_one, strict=True):
        said = f"{line!r}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert proc.returncode == code, said
        assert needle in proc.stdout + proc.stderr, said
    # the same first line alone, in bash: the console script's own words
    (alone,) = run_lines([LINES[0][0]], cwd, env, timeout_s=120)
    assert (alone.returncode, alone.stdout) == (in_one[0].returncode, in_one[0].stdout)
    assert alone.stderr == in_one[0].stderr


def test_a_commands_environment_does_not_reach_the_next(tmp_path: Path) -> None:
    """A command that sets a variable (as the CLI does for its children) leaves the next one the
    environment it was started with."""
    cwd = tmp_path / "scratch"
    cwd.mkdir()
    env = {**user_env(), "MOE_VERIFY_PROBE": "before"}
    code = "import os; os.environ['MOE_VERIFY_PROBE'] = 'after'; print('set')"
    (cwd / "setter.py").write_text(f"{code}\n")
    procs = run_lines(
        ["true", "moe-verify run --backend setter:X", "echo probe=$MOE_VERIFY_PROBE"],
        cwd,
        env,
        timeout_s=120,
    )
    assert "set" in procs[1].stdout, procs[1].stdout + procs[1].stderr
    assert procs[2].stdout.strip() == "probe=before"
