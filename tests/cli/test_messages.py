"""What a new user meets first: a usage error at once (before torch is imported), `--help` with
defaults, a `--backend` that cannot be built named with what went wrong (its constructor, a class
that is not a backend, a module that is not where the suite looks), and output paths refused
before the run."""

from __future__ import annotations

import errno
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


# A failing case (the README's wrong permute), isolated only: a few seconds on a CPU.
FAILING = [*TINY, "--backend", "moe_verify.examples:SwappedExpertRows", "--mode", "isolated"]


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    ("flag", "name", "writer"),
    [
        ("--dump-dir", "dump_dir", "moe_verify.run.verify.dump_case"),
        ("--plot", "plot_dir", "moe_verify.report.plot.write_plots"),
    ],
    ids=["dump-dir", "plot"],
)
def test_a_directory_that_fills_up_during_the_run_loses_no_report(
    flag: str,
    name: str,
    writer: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The directory passed the check before the run; the disk filled during it. The report is
    printed, then the error naming the output (exit 2, as any error)."""
    monkeypatch.setattr(writer, _disk_full)
    assert main(["run", *FAILING, flag, str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "FAIL fp8_block-tp1-T4-H128-I128-E4-k2-softmax-A32 [swapped_expert_rows" in out, out
    says = f"{name} {tmp_path}: not written after the run, whose verdict was FAIL"
    assert says in " ".join(err.split()) and "No space left on device" in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fill")
def test_a_json_file_on_a_full_disk_is_named_after_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/dev/full passes the check before the run (it exists and is writable) and refuses every
    write, as a full disk does."""
    assert main(["run", *FAILING, "--json", "/dev/full"]) == 2
    out, err = capsys.readouterr()
    assert "FAIL fp8_block-tp1-T4-H128-I128-E4-k2-softmax-A32" in out, out
    assert "--json /dev/full: not written after the run" in err, err


def test_verify_keeps_the_report_of_a_run_whose_dump_was_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moe_verify import verify
    from moe_verify.examples import SwappedExpertRows
    from moe_verify.run.verify import OutputNotWritten
    from moe_verify.spec import MoEProblem, Status

    monkeypatch.setattr("moe_verify.run.verify.dump_case", _disk_full)
    problem = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2,
                         alignment=32)  # fmt: skip
    with pytest.raises(OutputNotWritten) as raised:
        verify(problem, backend=SwappedExpertRows, mode="isolated", dump_dir=tmp_path)
    assert isinstance(raised.value, OSError)
    assert raised.value.report.verdict is Status.FAIL


# main() in a fresh interpreter: its exit code (argparse's SystemExit or main's return), then
# whether torch was ever imported.
_USAGE_CHILD = """
import sys
from moe_verify.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("exit", code)
print("torch imported", "torch" in sys.modules)
"""


def _usage_error(argv: list[str]) -> str:
    """The stderr of `moe-verify argv`, which must exit 2 without importing torch."""
    run = subprocess.run(
        [sys.executable, "-c", _USAGE_CHILD, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.stdout.split("\n")[:2] == ["exit 2", "torch imported False"], run.stdout + run.stderr
    return " ".join(run.stderr.split())


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", "-T", "abc"], "--tokens/-T"),  # a type check
        (["run", "--recipe", "nope"], "--recipe"),  # a choice
        (["sweep", "--mode", "nope"], "--mode"),  # another command's flag
        (["run", "--case-timeout", "-1"], "--case-timeout"),  # a checked value
        (["run", "--invariance", "nope"], "--invariance"),  # a named setting
    ],
    ids=["tokens", "recipe", "sweep-mode", "case-timeout", "invariance"],
)
def test_a_usage_error_exits_2_before_torch_is_imported(argv: list[str], flag: str) -> None:
    assert f"argument {flag}" in _usage_error(argv)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "-T", "0"], "-T/--tokens: expected an int in [1, "),  # the problem's checks
        (["run", "-E", "4", "-k", "5"], "-k/--topk must be in [1, num_experts=4], got 5"),
        (["run", "--topology", "xyz"], "topology 'xyz': expected tp:N, ep:N"),
        (["run", "--backend", "nope"], "backend: expected 'optimized', "),  # the run options'
        (["run", "--problem-json", "no-such.json"], "--problem-json no-such.json: No such file"),
        (["graph", "-T", "0"], "-T/--tokens: expected an int in [1, "),
        (["sweep", "--preset", "nope"], "preset: expected one of ["),  # the case selection's
        (["sweep", "--shard", "3/2"], "--shard: i must be in 1..n, got '3/2'"),
        (["sweep", "--filter", "no-such-case"], "sweep: no case of 'smoke' matches the filter"),
    ],
    ids=[
        "tokens",
        "topk",
        "topology",
        "backend",
        "problem-json",
        "graph",
        "preset",
        "shard",
        "filter",
    ],
)
def test_a_bad_value_exits_2_before_torch_is_imported(argv: list[str], says: str) -> None:
    """Checked after parsing, still before the heavy imports: one line at once, not seconds
    later."""
    err = _usage_error(argv)
    assert f"moe-verify: error: {says}" in err, err
