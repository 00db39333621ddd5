"""What the long commands print: progress on stderr only (never stdout, off with
MOE_VERIFY_PROGRESS=0), the summary alone on stdout when `--out` takes the full output, and no
numpy warnings from the Triton interpreter in a failing run's stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import moe_verify.calibrate
import moe_verify.production.bench
from moe_verify.cli import main
from moe_verify.common import progress
from moe_verify.spec import Engine, MoEProblem

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]
TINY = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)


@pytest.fixture
def progress_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bars drawn at once and at every redraw (a test's commands end in well under DELAY_S)."""
    monkeypatch.delenv("MOE_VERIFY_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)


def _fake_measure(problem: MoEProblem, tested: object, notes: list, engines: set) -> Iterator:
    """One sample per calibration run, the stage announced as the runner announces it."""
    progress.stage_started(0, "golden", "gemm1")
    yield "optimized/isolated", "gemm1", "per-token", 0.001, 0.03125


@pytest.fixture
def fast_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_verify.calibrate, "CALIBRATION", [TINY, TINY.replace(tokens=8)])
    monkeypatch.setattr(moe_verify.calibrate, "_measure", _fake_measure)
    monkeypatch.setattr(moe_verify.calibrate, "_e8m0_costs", lambda *args: None)


def test_calibrate_out_prints_the_summary_and_writes_the_tables(
    fast_calibration: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calibration.md"
    assert main(["calibrate", "--seeds", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# Noise-floor calibration" in out.read_text()  # the full tables went to the file
    assert "# Noise-floor calibration" not in printed and len(printed.splitlines()) <= 6
    assert printed.startswith("calibrated 2 case(s) x 2 seed(s)")
    assert "gemm1 per-token 0.001 / 0.0312 (3.2%" in printed
    assert f"wrote {out} and {out.with_suffix('.json')}" in printed


def test_calibrate_without_out_prints_the_tables(
    fast_calibration: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--seeds", "1"]) == 0
    assert capsys.readouterr().out.startswith("# Noise-floor calibration")


def test_calibrate_shows_its_progress_on_stderr(
    fast_calibration: None, progress_now: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--seeds", "2"]) == 0
    captured = capsys.readouterr()
    assert "calibrate" in captured.err and TINY.id in captured.err  # the case in flight
    assert "seed 2/2" in captured.err and "rank 0 golden gemm1" in captured.err
    assert "\r" not in captured.err  # stderr is not a terminal here: one line per redraw
    assert "calibrate:" not in captured.out and "seed 1/2" not in captured.out


def test_progress_is_off_with_moe_verify_progress_0(
    fast_calibration: None,
    progress_now: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("MOE_VERIFY_PROGRESS", "0")
    assert main(["calibrate", "--seeds", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_bench_out_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(moe_verify.production.bench, "bench", lambda *args, **kwargs: [])
    monkeypatch.setattr(
        moe_verify.production.bench, "to_markdown", lambda *args: "| table |\n| --- |"
    )
    out = tmp_path / "perf.md"
    argv = ["bench", "-T", "4", "-H", "128", "-I", "128", "-E", "4", "-k", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == "| table |\n| --- |\n"
    case = TINY.replace(alignment=128).id  # bench's default alignment
    assert printed.splitlines() == [f"appended the bench of {case} (2 lines) to {out}"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "| table |\n| --- |\n"


def test_bench_shows_the_stage_in_flight_on_stderr(
    progress_now: None, capsys: pytest.CaptureFixture[str]
) -> None:
    moe_verify.production.bench.bench(TINY, engines=(Engine.TRITON,), repeats=1)
    err = capsys.readouterr().err
    assert f"bench {TINY.id}" in err and "gather" in err


def test_audit_shows_the_layer_in_flight_on_stderr(
    progress_now: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moe_verify.audit import audit
    from tests.audit.test_e8m0 import _model, _save

    audit(_save(tmp_path, _model("pow2", layers=2, experts=1)), device="cpu")
    err = capsys.readouterr().err
    assert "audit-e8m0" in err and "layer 1" in err


def test_a_failing_run_leaves_no_interpreter_warnings_on_stderr(tmp_path: Path) -> None:
    """A scale read as its byte value makes gemm1's outputs huge, and act_quant's exp overflows
    under the interpreter: the report says so (exit 1); stderr stays empty."""
    env = dict(os.environ, MOE_VERIFY_PROGRESS="0", PYTHONPATH=str(ROOT))
    backend = "tests.tester.field_bugs:E8m0BytesCopiedAsNumbers"
    flags = ["-T", "16", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
    flags += ["--mode", "both", "--engine", "triton", "--backend", backend]
    proc = subprocess.run(
        [sys.executable, "-m", "moe_verify.cli", "run", *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == ""
