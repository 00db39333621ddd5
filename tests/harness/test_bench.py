"""The bench command's plumbing on a CPU (numbers here are not performance: see docs/perf.md)."""

from __future__ import annotations

import pytest

from moe_verify.bench import bench, to_markdown
from moe_verify.spec import MoEProblem

pytestmark = pytest.mark.cpu


def test_bench_times_every_kernel_stage_and_reports_unavailable_engines() -> None:
    problem = MoEProblem(
        tokens=8, hidden=128, intermediate=128, num_experts=2, topk=1, alignment=16
    )
    timings = bench(problem, engines=("triton", "deepgemm"), repeats=1)
    stages = [t.stage for t in timings]
    assert stages.count("gemm1") == 2 and stages.count("gemm2") == 2
    assert {"quant_input", "permute", "act_quant", "gather"} <= set(stages)
    triton_gemm = next(t for t in timings if t.stage == "gemm1" and t.engine == "triton")
    assert triton_gemm.median_us > 0 and triton_gemm.work == 2.0 * 8 * 256 * 128
    table = to_markdown(problem, timings)
    assert problem.id in table and "gather" in table
