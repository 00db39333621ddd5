"""The CLI front door: the default run, exit codes, strict mode, JSON output, bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_verify.cli import main
from moe_verify.spec import MoEProblem, StageSkipped
from moe_verify.verification import verify
from optimized.backend import OptimizedBackend
from tolerance.compare import compare

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


def test_default_run_prints_a_stage_table_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_verify.cli", "-T", "8", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "verdict PASS" in proc.stdout and "gemm1 [triton]" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and report["first_failure"] is None


def test_bad_argument_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--hidden", "100"]) == 2
    assert "hidden=100 must be a multiple of 128" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module", ["tolerance", "tolerance.metrics", "reference", "optimized", "moe_verify.cli"]
)
def test_each_package_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """The packages import one another (tolerance <-> moe_verify); none may need another to
    have been imported before it."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compare_on_cpu_reaches_compare_and_torchrun_refuses_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    verify_module = sys.modules["moe_verify.verification"]
    devices = []

    def spy(*args, device=None, **kwargs):
        devices.append(device)
        return compare(*args, device=device, **kwargs)

    monkeypatch.setattr(verify_module, "compare", spy)
    assert main(["run", "-T", "8", "-H", "128", "-I", "128", "-E", "4", "--compare-on", "cpu"]) == 0
    assert "verdict PASS" in capsys.readouterr().out
    assert devices == ["cpu", "cpu"]  # isolated and chained
    devices.clear()
    assert main(["run", "-T", "8", "-H", "128", "-I", "128", "-E", "4"]) == 0
    assert devices == [None, None]  # the golden's device
    assert main(["run", "--launcher", "torchrun", "--topology", "ep:2", "--compare-on", "cpu"]) == 2
    assert "--compare-on cpu is not supported with --launcher torchrun" in capsys.readouterr().err


class DeclinesGemm2(OptimizedBackend):
    """A backend that skips a stage it should run."""

    name = "declines-gemm2"

    def gemm2(self, p, x, up, rank):
        raise StageSkipped("not implemented by this backend")


def test_skips_pass_by_default_but_fail_strict() -> None:
    report = verify(
        MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=2, topk=1, alignment=16),
        backend=DeclinesGemm2(engine="triton"),
        mode="both",
    )
    assert report.passed and not report.passed_strict
    assert report.counts("isolated")["skip"] == 1
    assert any(r.stage == "gemm2" and r.status == "skip" for r in report.isolated)


def test_rank_dependent_failure_names_the_rank_and_its_experts() -> None:
    from tests.tester.wrong_backends import ExpertMapIgnoredOnRank1
    from tolerance.report import Report

    problem = MoEProblem(
        tokens=16,
        hidden=128,
        intermediate=128,
        num_experts=6,
        topk=2,
        alignment=32,
        topology="ep:2",
    )
    report = verify(problem, backend=ExpertMapIgnoredOnRank1(engine="triton"), mode="isolated")
    assert report.failed_ranks == [1]
    assert "rank 1 hosts experts [3, 4, 5]" in report.to_table()
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.rank_experts == {0: [0, 1, 2], 1: [3, 4, 5]}


class SharedTwice(OptimizedBackend):
    """The shared experts' output added twice (vLLM runner bug class: shared reduced twice)."""

    name = "shared-twice"

    def shared(self, p, x, up, rank):
        out = super().shared(p, x, up, rank)["out"]
        return {"out": (out.float() * 2).to(out.dtype), "engine": "triton"}


def test_shared_expert_bug_is_named_at_the_shared_stage() -> None:
    problem = MoEProblem(
        tokens=8,
        hidden=128,
        intermediate=256,
        num_experts=4,
        topk=2,
        alignment=32,
        topology="ep:2",
        shared_experts=1,
    )
    report = verify(problem, backend=SharedTwice(engine="triton"), mode="isolated")
    assert report.first_failure == "shared"
    assert {r.stage for r in report.isolated if r.status == "fail"} == {"shared", "reduce"}


def test_summary_puts_modes_side_by_side_one_line_per_stage() -> None:
    from tests.tester.wrong_backends import SwappedExpertRows

    problem = MoEProblem(
        tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32
    )
    text = verify(problem, backend=SwappedExpertRows(engine="triton"), mode="both").to_summary()
    permute = next(line for line in text.splitlines() if line.startswith("permute "))
    assert permute.split()[1:3] == ["fail", "fail"] and "a_perm rows" in permute
    gemm1 = next(line for line in text.splitlines() if line.startswith("gemm1 [triton]"))
    assert gemm1.split()[2:4] == ["pass", "fail"]  # isolated clean, chained inherits the swap


def test_python_api_runs_on_a_cpu_without_setup() -> None:
    """README's Python example: no TRITON_INTERPRET set by hand, `verify` is the function."""
    code = (
        "from moe_verify import MoEProblem, verify\n"
        "r = verify(MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2,"
        " alignment=32), mode='both')\n"
        "print(r.passed, r.first_failure)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("True None")


def test_a_backend_module_in_the_current_directory_loads_without_pythonpath(tmp_path: Path) -> None:
    """The README's `--backend module:Class` examples run from the directory holding the module."""
    (tmp_path / "my_kernels.py").write_text(
        "import optimized\n\n\nclass MyKernels(optimized.OptimizedBackend):\n    name = 'mine'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the project itself, as an installed package would be found
    # -P: no current directory on sys.path, as for the `moe-verify` console script
    cmd = [sys.executable, "-P", "-m", "moe_verify.cli", "run", "--backend", "my_kernels:MyKernels"]
    cmd += ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "--alignment", "32"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backend mine" in proc.stdout
