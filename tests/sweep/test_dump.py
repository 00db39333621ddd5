"""Sweeps (summaries, crash isolation with breadcrumbs) and failing-case dumps with replay."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from moe_verify.run.dump import load_trace
from moe_verify.run.options import RunOptions
from moe_verify.run.verify import replay, verify
from moe_verify.spec import REPORT_STAGES, MoEProblem, StageContext
from moe_verify.sweep.sweep import sweep
from optimized.backend import OptimizedBackend
from reference.layout import aligned_m_sum_upper_bound

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]
SMALL = "fp8_block-tp1-T1-H128"  # the T = 1 smoke case: the fastest


class CrashesInGemm1(OptimizedBackend):
    """Dies like an illegal memory access would: the whole process, mid-stage."""

    name = "crashes-in-gemm1"

    def gemm1(self, ctx: StageContext):
        os._exit(139)


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "in-process"])
def test_sweep_writes_junit_json_and_markdown(tmp_path: Path, isolate: bool) -> None:
    summary = sweep("smoke", out_dir=tmp_path, filter_text=SMALL, isolate=isolate)
    assert summary.passed and len(summary.outcomes) == 1 and summary.exit_code == 0
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("tests") == "1" and suite.get("failures") == "0"
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["passed"] and data["cases"][0]["report"]["first_failure"] is None
    matrix = (tmp_path / "summary.md").read_text()
    assert "pass / pass" in matrix
    # every stage of any layout has its column: ep:N+ll's dispatch, the shared experts, the reduce
    header = next(line for line in matrix.splitlines() if line.startswith("| case |"))
    assert [c.strip() for c in header.split("|")[5:-2]] == list(REPORT_STAGES)


def test_sweep_rewrites_the_full_report_json_only_now_and_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """summary.json holds every report, so rewriting it around every case is quadratic: with the
    cases in a worker it is written when due (SUMMARY_JSON_EVERY_S) and at the end;
    progress.json around every case."""
    import moe_verify.sweep.sweep as sweep_module

    writes: list[tuple[str, int]] = []
    real = sweep_module.write_atomic

    def counting(path: Path, text: str) -> None:
        if path.name in ("summary.json", "progress.json"):
            writes.append((path.name, json.loads(text)["finished"]))
        real(path, text)

    monkeypatch.setattr(sweep_module, "write_atomic", counting)
    monkeypatch.setattr(sweep_module, "SUMMARY_JSON_EVERY_S", 3600.0)
    cases = [
        MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, seed=s) for s in (0, 1, 2)
    ]
    summary = sweep(cases, out_dir=tmp_path, isolate=True)
    assert summary.passed and len(summary.outcomes) == 3
    assert [f for n, f in writes if n == "summary.json"] == [0, 3]  # at the start and the end
    assert [f for n, f in writes if n == "progress.json"] == [0, 0, 1, 1, 2, 2, 3, 3]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [c["id"] for c in data["cases"]] == [c.id for c in cases] and data["running"] is None


def test_isolated_sweep_survives_a_crashing_case_and_names_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the subprocess imports the backend by module path
    summary = sweep(
        "smoke",
        backend="tests.sweep.test_dump:CrashesInGemm1",
        out_dir=tmp_path,
        isolate=True,
        filter_text=SMALL,
    )
    (outcome,) = summary.outcomes
    assert outcome.status == "error"
    assert "exit 139" in outcome.summary and '"stage": "gemm1"' in outcome.summary
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("errors") == "1"


def test_dump_and_replay_reproduce_a_failure(tmp_path: Path) -> None:
    from tests.tester.wrong_backends import SwappedExpertRows

    problem = MoEProblem(
        tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32
    )
    report = verify(
        problem, backend=SwappedExpertRows(engine="triton"), mode="isolated", dump_dir=tmp_path
    )
    assert report.first_failure == "permute"
    case = tmp_path / problem.id
    assert {
        "problem.json",
        "report.json",
        "inputs.safetensors",
        "golden_r0.safetensors",
        "isolated_r0.safetensors",
    } <= {p.name for p in case.iterdir()}
    # The backend, engine and mode the dump recorded, from the dump directory of this one case
    assert replay(tmp_path).first_failure == "permute"
    assert replay(case, backend="optimized", engine="triton", mode="isolated").passed
    golden = load_trace(case / "golden_r0.safetensors")
    m_sum = aligned_m_sum_upper_bound(16, 2, 4, 32)  # host ints survive in the metadata
    assert golden.stages[0] == "route" and golden["align"]["M_sum"] == m_sum
    assert golden["permute"]["a_perm"].dtype == torch.float8_e4m3fn


def test_each_case_releases_its_memory_before_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_in_process frees what the case left (a full collection, the CUDA cache) whether the
    case passed or raised, with its report no longer referenced."""
    import gc
    import weakref

    import moe_verify.run.verify as verification
    import moe_verify.sweep.sweep as sweep_module

    seen: list[weakref.ref] = []
    real_verify = verification.verify

    def verify(*args: object, **kwargs: object):
        report = real_verify(*args, **kwargs)
        seen.append(weakref.ref(report))
        return report

    released: list[bool] = []

    def release() -> None:
        gc.collect()
        released.append(seen[-1]() is None if seen else True)

    monkeypatch.setattr(verification, "verify", verify)
    monkeypatch.setattr(sweep_module, "release_memory", release)
    problem = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4)
    options = RunOptions("optimized", "isolated", engine="triton")
    outcome = sweep_module.run_in_process(problem, options)
    assert outcome.status == "pass" and released == [True]
    broken = sweep_module.run_in_process(problem, RunOptions("no.such:Backend", "isolated"))
    assert broken.status == "error" and len(released) == 2


def test_releasing_a_broken_cuda_context_does_not_mask_the_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a kernel broke the CUDA context, empty_cache raises: the case's own outcome stands."""
    import moe_verify.sweep.sweep as sweep_module

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", broken)
    sweep_module.release_memory()  # does not raise
    problem = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4)
    options = RunOptions("optimized", "isolated", engine="triton")
    assert sweep_module.run_in_process(problem, options).status == "pass"
