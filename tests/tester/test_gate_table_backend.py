"""A backend whose act_quant reads the H200 gate table passes and the report names the table
recipe (tests/tester/gate_table_backends.py); the optimized path's own kernel, run by the Triton
interpreter (numpy's exp, an IEEE division), is named with the plain recipe."""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem
from moe_verify.sweep.cases import SWIGLU
from tests.tester.gate_table_backends import TableGateActQuant

pytestmark = pytest.mark.cpu

BASE = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
CASES = [
    pytest.param(BASE.replace(scale_fmt="ue8m0_packed"), "packed_sm90_triton", id="silu-packed"),
    pytest.param(BASE.replace(activation=SWIGLU), "colmajor_sm90_triton", id="swigluoai-float32"),
]


@pytest.mark.parametrize(("problem", "recipe"), CASES)
def test_table_gate_backend_passes_and_is_named(
    problem: MoEProblem, recipe: str, record_report
) -> None:
    report = record_report(verify(problem, backend=TableGateActQuant(engine="triton"), mode="both"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    for mode in ("isolated", "chained"):
        assert report.recipes(mode)["act_quant"] == recipe, report.recipes(mode)
    assert f"act_quant {recipe}" in report.summary_line()


@pytest.mark.parametrize(("problem", "recipe"), CASES)
def test_interpreter_kernel_is_named_with_the_plain_recipe(
    problem: MoEProblem, recipe: str, record_report
) -> None:
    report = record_report(verify(problem, backend="optimized", engine="triton"))
    assert report.passed, "\n".join([report.summary_line(), *report.failure_messages()])
    assert report.recipes("isolated")["act_quant"] == recipe.removesuffix("_sm90_triton")
