"""Zero tolerance on SM90: an isolated GEMM that ran DeepGEMM on SM90 is held bit for bit to the
golden's tensor-core recipe (docs/tolerance.md "Zero tolerance on SM90").

The CPU has no SM90, so the one function that decides it (moe_verify.run.sm90_chain.sm90_device) is
forced here; the tested GEMMs (tests/tester/gemm_recipe_backends.py) report engine "deepgemm".
Every layout the SM90 GEMMs read: contiguous by m_indices, contiguous by psum expert ends, and
the masked batches of ep:N+ll; both SM90 scale formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_verify.run import sm90_chain
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Stage, Status
from reference.moe import ReferenceBackend
from tests.tester import gemm_recipe_backends as gb
from tolerance.policy import TENSOR_CORE_GEMM

pytestmark = pytest.mark.cpu

# H = 256: two K chunks in gemm1; I = 128: one in gemm2. A = 32: several experts per M_sum.
BASE = MoEProblem(tokens=16, hidden=256, intermediate=128, num_experts=4, topk=2, alignment=32)
GEMMS = (Stage.GEMM1, Stage.GEMM2)


@dataclass(frozen=True)
class Case:
    label: str
    problem: MoEProblem


LAYOUTS = [
    Case("m_indices", BASE),
    Case("psum", BASE.replace(grouped_layout="psum")),  # vLLM 0.32's SM90 layout: expert ends
    Case("masked", BASE.replace(topology="ep:2+ll")),  # the batched low-latency layout
]
CASES = [
    Case(f"{c.label}-{fmt}", c.problem.replace(scale_fmt=fmt))
    for c in LAYOUTS
    for fmt in ("float32", "float32_ceil_ue8m0")
]


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor counts as lying on an SM90 GPU."""
    monkeypatch.setattr(sm90_chain, "sm90_device", lambda t: True)


def gemm_results(report) -> dict:
    return {r.stage: r for r in report.isolated if r.stage in GEMMS}


def failures(report) -> str:
    return "\n".join([report.summary_line(), *report.failure_messages()])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_tensor_core_gemm_passes_bit_for_bit(case: Case, sm90: None, record_report) -> None:
    report = record_report(verify(case.problem, backend=gb.TensorCoreGemm(engine="triton")))
    assert report.passed, failures(report)
    for stage, result in gemm_results(report).items():
        assert result.recipe == "tensor_core", (stage, result.checks)
        bits = result.checks[-1]
        assert (
            bits.name.endswith(" bits") and bits.passed and bits.reason == TENSOR_CORE_GEMM.reason
        )
        assert (
            bits.detail.startswith("0 of ") and "vs fp32 dequant math, reported only" in bits.detail
        )
    assert "gemm1 tensor_core" in report.summary_line()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_fp32_dequant_math_fails_bitwise_within_the_old_bound(
    case: Case, sm90: None, record_report
) -> None:
    report = record_report(verify(case.problem, backend=gb.Fp32DequantGemm(engine="triton")))
    assert not report.passed and report.first_failure == Stage.GEMM1
    for stage, result in gemm_results(report).items():
        assert result.status is Status.FAIL, stage
        (bits,) = result.failed_checks
        assert bits.name.endswith(" bits") and bits.value > 0
        assert (
            f"{int(bits.value)} of " in bits.detail and "differ from the tensor-core" in bits.detail
        )
        assert "exceeded" not in bits.detail  # the fp32 bound itself holds
        assert bits.worst is not None and bits.worst.token is not None
        assert bits.worst.expert is not None and bits.worst.column is not None


@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: c.label)
def test_fp32_dequant_math_passes_the_bound_off_sm90(case: Case, record_report) -> None:
    report = record_report(verify(case.problem, backend=gb.Fp32DequantGemm(engine="triton")))
    assert report.passed, failures(report)
    assert all(r.recipe is None for r in gemm_results(report).values())


@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: c.label)
def test_one_ulp_in_one_live_element_fails_and_is_localized(
    case: Case, sm90: None, record_report
) -> None:
    report = record_report(verify(case.problem, backend=gb.OneUlpGemm(engine="triton")))
    for stage, result in gemm_results(report).items():
        assert result.status is Status.FAIL, stage
        (bits,) = result.failed_checks
        assert bits.value == 1 and bits.detail.startswith("1 of ")
        assert "(1 bf16 ulps," in bits.detail
        worst = bits.worst
        assert (worst.row, worst.column) == (gb.OneUlpGemm.ROW, gb.OneUlpGemm.COLUMN)
        assert worst.token is not None and worst.k is not None and worst.expert is not None
        assert worst.other != worst.golden


@pytest.mark.parametrize("case", LAYOUTS[::2], ids=lambda c: c.label)
def test_asked_for_with_the_interpreters_exact_math_it_fails(case: Case, record_report) -> None:
    """gemm_recipe="tensor_core" on the CPU: the Triton engine is exact fp32 math there, not the
    tensor core's, so its GEMMs must be reported failing, not passed."""
    report = record_report(
        verify(case.problem, backend="optimized", engine="triton", gemm_recipe="tensor_core")
    )
    assert not report.passed
    for stage, result in gemm_results(report).items():
        assert result.status is Status.FAIL and result.engine == "triton", stage
        assert "tl.dot is numpy's dot" in result.failed_checks[0].reason


def test_not_computed_unless_used(monkeypatch: pytest.MonkeyPatch, record_report) -> None:
    """Off SM90, or with gemm_recipe fp32_dequant on SM90, the golden never runs the model."""

    def refuse(*args: object) -> None:
        raise AssertionError("the tensor-core recipe ran although no comparison uses it")

    monkeypatch.setattr(ReferenceBackend, "with_tensor_core", refuse)
    backend = gb.Fp32DequantGemm(engine="triton")  # reports deepgemm, never runs the model
    assert record_report(verify(BASE, backend=backend)).passed
    monkeypatch.setattr(sm90_chain, "sm90_device", lambda t: True)
    report = record_report(verify(BASE, backend=backend, gemm_recipe="fp32_dequant"))
    assert report.passed and all(r.recipe is None for r in gemm_results(report).values())
    # chained mode compares against the golden's own chain: no tensor-core recipe either
    assert record_report(verify(BASE, backend=backend, mode="chained")).passed


@pytest.mark.parametrize(
    ("problem", "mode", "match"),
    [
        (BASE.replace(recipe="mxfp8", scale_fmt="ue8m0_packed"), "isolated", "fp8_block"),
        (BASE.replace(scale_fmt="ue8m0_packed"), "isolated", "fp8_block"),
        (BASE.replace(scale_fmt="ue8m0_packed"), "chained", "fp8_block"),
    ],
    ids=["mxfp8", "packed-ue8m0", "packed-ue8m0-chained"],
)
def test_asking_where_it_cannot_apply_is_refused(
    problem: MoEProblem, mode: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        verify(problem, backend="golden", mode=mode, gemm_recipe="tensor_core")
