"""SM100 tier (B200): DeepGEMM's per-32, FP4 and packed-UE8M0 GEMMs against the golden.

Everything here is skipped on other machines, with the reason, by the arch gate in conftest.py.
Not yet run: no SM100 machine has been lent to this project (docs/gpu-results.md).
"""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Recipe, ScaleFmt

pytestmark = pytest.mark.sm100

DSV3_LOCAL = dict(hidden=7168, intermediate=2048, num_experts=32, topk=8)

# (recipe, scale format, tokens): the Blackwell recipes, decode and prefill sizes.
CASES = [
    MoEProblem(tokens=t, recipe=r, scale_fmt=f, **DSV3_LOCAL)
    for r, f in (
        (Recipe.FP8_BLOCK, ScaleFmt.UE8M0_PACKED),  # fp32 power-of-two scales packed by DeepGEMM
        (Recipe.FP8_BLOCK, ScaleFmt.FLOAT32_CEIL_UE8M0),
        (Recipe.MXFP8, ScaleFmt.UE8M0_PACKED),  # recipe (1, 32) on both operands
        (Recipe.MXFP4_W4A8, ScaleFmt.UE8M0_PACKED),  # m_grouped_fp8_fp4_gemm_nt_contiguous
    )
    for t in (7, 1000)
]


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_blackwell_pipeline_through_deepgemm(problem: MoEProblem, record_report) -> None:
    from optimized.backend import OptimizedBackend

    report = record_report(
        verify(problem, backend=OptimizedBackend(engine="deepgemm"), mode="both")
    )
    assert report.passed_strict, report.summary_line()  # no stage may skip on SM100
    for mode in ("isolated", "chained"):
        assert report.engine("gemm1", mode) == report.engine("gemm2", mode) == "deepgemm"


@pytest.mark.parametrize("alignment", [32, 64, 96, 128])
def test_sm100_alignments_deepgemm_2_6_1_can_pick(alignment: int, record_report) -> None:
    """DG 2.6.1 on SM100 can shrink the alignment to 32/64/96
    (`get_theoretical_mk_alignment_for_contiguous_layout`): BLOCK_M must follow."""
    from optimized.backend import OptimizedBackend

    problem = MoEProblem(
        tokens=64,
        hidden=2048,
        intermediate=1024,
        num_experts=16,
        topk=4,
        scale_fmt=ScaleFmt.UE8M0_PACKED,
        alignment=alignment,
    )
    report = record_report(
        verify(problem, backend=OptimizedBackend(engine="deepgemm"), mode="both")
    )
    assert report.passed_strict, report.summary_line()
