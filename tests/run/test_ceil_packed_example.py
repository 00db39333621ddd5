"""An act_quant as TensorRT-LLM's DeepGEMM MoE computes it (moe_verify/examples/ceil_packed.py):
declared "colmajor_ceil_packed", it passes on packed UE8M0 problems in both modes and the report
names the recipe; the same with the scale rounded down fails at act_quant."""

from __future__ import annotations

import pytest

from moe_verify.examples.ceil_packed import CeilPackedActQuant, FloorPackedActQuant
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Stage, Status

pytestmark = pytest.mark.cpu

PACKED = dict(num_experts=4, topk=2, scale_fmt="ue8m0_packed")
CASES = [
    # I = 256: two groups, one word whose last two bytes are pad
    MoEProblem(tokens=9, hidden=256, intermediate=256, **PACKED),
    # T = 1; I = 640: five groups, a second word holding one group and three pad bytes
    MoEProblem(tokens=1, hidden=128, intermediate=640, alignment=32, **PACKED),
    # the kernel's own layout: the masked batches [E_l, M_max, 2I], on two TP ranks
    MoEProblem(
        tokens=9, hidden=128, intermediate=768, topology="tp:2", grouped_layout="masked", **PACKED
    ),
]


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_the_declared_ceil_packed_act_quant_passes(problem: MoEProblem) -> None:
    report = verify(problem, backend=CeilPackedActQuant(engine="triton"), mode="both")
    assert report.passed_strict, report.summary_line()
    acts = [r for r in report.isolated if r.stage == Stage.ACT_QUANT]  # one per rank
    assert len(acts) == problem.topology.size
    assert all(act.recipe == "colmajor_ceil_packed" for act in acts)
    assert "act_quant colmajor_ceil_packed" in report.summary_line()


@pytest.mark.parametrize("problem", [CASES[0], CASES[2]], ids=lambda p: p.id)
def test_the_floor_variant_fails_at_act_quant(problem: MoEProblem) -> None:
    report = verify(problem, backend=FloorPackedActQuant(engine="triton"), mode="isolated")
    first = report.first_failing_result
    assert first is not None and first.stage == Stage.ACT_QUANT, report.summary_line()
    assert first.status is Status.FAIL and first.recipe == "colmajor_ceil_packed"
    assert "scale flips" in {c.name for c in first.failed_checks}
    assert "against the declared recipe colmajor_ceil_packed" in first.failed_checks[0].detail
