"""What a new user meets first: a usage error at once (before torch is imported), `--help` with
defaults, a `--backend` that cannot be built named with what went wrong (its constructor, a class
that is not a backend, a module that is not where the suite looks), and output paths refused
before the run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_verify.cli import main

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]

TINY = ["-T", "4", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]

KERNELS = """
from optimized import OptimizedBackend


class NeedsAGpu(OptimizedBackend):
    def __init__(self, engine="auto"):
        raise RuntimeError("cannot open /dev/nvidia0")


class NotABackend:
    name = "not-a-backend"

    def route(self, ctx):
        return {}
"""


@pytest.mark.parametrize("command", ["run", "sweep", "graph", "bench"])
def test_help_shows_each_flags_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tokens TOKENS, -T TOKENS default: 64" in out or command == "sweep", out
    if command in ("run", "sweep"):
        assert "--mode {isolated,chained,both} default: both" in out, out


@pytest.fixture
def in_kernels_dir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "msg_test_kernels.py").write_text(KERNELS)
    here = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(here)
    sys.modules.pop("msg_test_kernels", None)


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["run", *TINY, *argv]) == 2
    return " ".join(capsys.readouterr().err.split())


def test_a_constructor_that_raises_is_named(
    in_kernels_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, "--backend", "msg_test_kernels:NeedsAGpu")
    assert (
        "backend 'msg_test_kernels:NeedsAGpu': its constructor NeedsAGpu(engine='auto') raised"
        in err
    )
    assert "RuntimeError: cannot open /dev/nvidia0" in err


def test_a_class_that_is_not_a_backend_is_not_blamed_on_the_engine(
    in_kernels_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, "--backend", "msg_test_kernels:NotABackend", "--engine", "triton")
    assert "NotABackend is not a backend: it lacks quant_input(ctx)" in err, err
    assert "--engine" not in err, err


def test_a_module_not_found_says_where_it_was_looked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        err = _error(capsys, "--backend", "no_such_kernels:Mine")
    finally:
        os.chdir(here)
    assert "No module named 'no_such_kernels'" in err
    assert f"looked up in the current directory ({tmp_path}) and on PYTHONPATH" in err, err


@pytest.mark.parametrize(
    ("flag", "path", "says"),
    [
        (
            "--dump-dir",
            "/proc/moe-verify-x",
            "--dump-dir /proc/moe-verify-x: /proc is not writable",
        ),
        ("--plot", "/proc/moe-verify-x", "--plot /proc/moe-verify-x: /proc is not writable"),
        ("--markdown", "/sys/moe-verify-x.md", "--markdown /sys/moe-verify-x.md: not writable"),
        ("--json", "/proc/moe-verify-x.json", "--json /proc/moe-verify-x.json: not writable"),
    ],
    ids=["dump-dir", "plot", "markdown", "json"],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
    flag: str, path: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Even for root, to whom os.access says /proc and /sys are writable: no case runs, so no
    report is lost after it."""
    assert main(["run", *TINY, flag, path]) == 2
    out, err = capsys.readouterr()
    assert says in err and out == "", (out, err)


def test_verify_refuses_a_dump_dir_it_cannot_write_by_name() -> None:
    from moe_verify import verify
    from moe_verify.spec import MoEProblem

    problem = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
    with pytest.raises(ValueError, match="dump_dir /proc/moe-verify-x: /proc is not writable"):
        verify(problem, dump_dir="/proc/moe-verify-x")


# main() in a fresh interpreter: its exit code, then whether torch was ever imported.
_USAGE_CHILD = """
import sys
from moe_verify.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print("exit", exc.code)
print("torch imported", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", "-T", "abc"], "--tokens/-T"),  # a type check
        (["run", "--recipe", "nope"], "--recipe"),  # a choice
        (["sweep", "--mode", "nope"], "--mode"),  # another command's flag
        (["run", "--case-timeout", "-1"], "--case-timeout"),  # a checked value
    ],
    ids=["tokens", "recipe", "sweep-mode", "case-timeout"],
)
def test_a_usage_error_exits_2_before_torch_is_imported(argv: list[str], flag: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _USAGE_CHILD, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.stdout.split("\n")[:2] == ["exit 2", "torch imported False"], run.stdout + run.stderr
    assert f"argument {flag}" in run.stderr
