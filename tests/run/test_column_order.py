"""gemm1's column order, declared: an up-first gemm1 that says so passes in both modes (its
act_quant fed up-first rows in isolated mode); one that does not say so fails at gemm1, and the
failure names the column order (moe_verify/examples/columns.py, tolerance/stages/columns.py)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.examples.columns import UpFirstGemm1, UpFirstUndeclared
from moe_verify.run.verify import verify
from moe_verify.spec import (
    COLUMN_ORDER,
    MoEProblem,
    Outputs,
    Stage,
    StageContext,
    Status,
    Topology,
    TopologyKind,
)
from tolerance.stages.columns import swap_halves

pytestmark = pytest.mark.cpu

SHAPE = dict(hidden=128, intermediate=256, num_experts=8, topk=2, alignment=32)
CASES = [
    MoEProblem(tokens=8, **SHAPE),
    MoEProblem(tokens=1, **SHAPE),  # T = 1
    MoEProblem(tokens=9, topology=Topology(TopologyKind.TP, 2), **SHAPE),  # halves per TP shard
    MoEProblem(tokens=12, topology=Topology(TopologyKind.EP, 2), **SHAPE),
    MoEProblem(tokens=8, topology=Topology.parse("ep:2+ll"), **SHAPE),  # the batched layout
]


def test_swapping_the_halves_twice_is_the_identity() -> None:
    mm1 = torch.arange(12.0).view(2, 6)
    assert swap_halves(mm1).tolist() == [[3, 4, 5, 0, 1, 2], [9, 10, 11, 6, 7, 8]]
    assert torch.equal(swap_halves(swap_halves(mm1)), mm1)


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.id)
def test_a_declared_up_first_gemm1_passes(problem: MoEProblem) -> None:
    report = verify(problem, backend=UpFirstGemm1(engine="triton"), mode="both")
    assert report.passed_strict, report.summary_line()


@pytest.mark.parametrize("problem", CASES[:3], ids=lambda p: p.id)
def test_an_undeclared_up_first_gemm1_fails_at_gemm1_naming_the_order(problem: MoEProblem) -> None:
    report = verify(problem, backend=UpFirstUndeclared(engine="triton"), mode="both")
    first = report.first_failing_result
    assert first is not None and first.stage == Stage.GEMM1, report.summary_line()
    check = first.failed_checks[0]
    assert check.name == "column order"
    assert "writes up_first columns but declares gate_first" in check.detail
    assert "first failure: gemm1" in report.summary_line()
    assert "(column order: 1 > 0" in report.summary_line()


def test_a_gemm1_wrong_otherwise_does_not_blame_the_column_order() -> None:
    """Halves exchanged and one row also wrong: exchanging back does not make it pass, so the
    column order is not offered as the explanation."""

    class AlsoWrong(UpFirstUndeclared):
        def gemm1(self, ctx: StageContext) -> Outputs:
            outputs = super().gemm1(ctx)
            mm1 = outputs["mm1"].clone()
            mm1[0] = 0
            return {**outputs, "mm1": mm1}

    report = verify(CASES[0], backend=AlsoWrong(engine="triton"), mode="isolated")
    (gemm1,) = [r for r in report.isolated if r.stage == Stage.GEMM1]
    assert gemm1.status is Status.FAIL
    assert "column order" not in [c.name for c in gemm1.failed_checks]


def test_an_unknown_column_order_breaks_the_contract() -> None:
    class Sideways(UpFirstGemm1):
        def gemm1(self, ctx: StageContext) -> Outputs:
            return {**super().gemm1(ctx), COLUMN_ORDER: "sideways"}

    report = verify(CASES[0], backend=Sideways(engine="triton"), mode="isolated")
    (gemm1,) = [r for r in report.isolated if r.stage == Stage.GEMM1]
    assert gemm1.status is Status.FAIL
    assert "expected one of ['gate_first', 'up_first'], got 'sideways'" in gemm1.reason + str(
        [c.detail for c in gemm1.checks]
    )
