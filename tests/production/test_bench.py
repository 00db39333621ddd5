"""The bench command's plumbing on a CPU (numbers here are not performance: see docs/perf.md)."""

from __future__ import annotations

import pytest

from moe_verify.production.bench import bench, compare_cost, to_markdown
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


def test_compare_cost_times_the_comparisons_where_the_golden_lives() -> None:
    problem = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=2, topk=1)
    costs = compare_cost(problem, repeats=1)
    assert [c.device for c in costs] == ["cpu"]  # a CPU run has no second place to compare
    assert costs[0].seconds > 0
    table = to_markdown(problem, [], costs)
    assert "| cpu |" in table and "1.00x" in table
