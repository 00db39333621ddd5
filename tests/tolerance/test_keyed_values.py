"""keyed_values: the (tested, golden) rows of a bounded stage, aligned by (token, k) exactly as
the stage's checks key them (what calibration measures)."""

from __future__ import annotations

import pytest
import torch

from moe_verify.spec import Mode, MoEProblem, Status, Trace
from tests.tolerance.synthetic import (
    build_golden,
    clone_trace,
    dequant,
    mark_stage,
    reorder_segments,
    slot_row,
    tiny_problem,
)
from tolerance.compare import ContractError, compare_stage, keyed_values
from tolerance.metrics import calc_diff
from tolerance.stages.layouts import scale_values

pytestmark = pytest.mark.cpu

PROBLEMS = {
    "fp8_block-float32": tiny_problem(),  # column-major fp32 a2q_scale
    "fp8_block-packed": tiny_problem(scale_fmt="ue8m0_packed"),  # packed int32 a2q_scale
}
PERMUTED = ["gemm1", "act_quant", "gemm2"]


@pytest.fixture(params=list(PROBLEMS), ids=list(PROBLEMS))
def problem(request: pytest.FixtureRequest) -> MoEProblem:
    return PROBLEMS[request.param]


@pytest.fixture
def golden(problem: MoEProblem) -> Trace:
    return build_golden(problem)


def _live_slots(golden: Trace) -> int:
    return int((golden["permute"]["inv_perm"] >= 0).sum())


@pytest.mark.parametrize("stage", PERMUTED)
def test_reordered_rows_key_to_the_same_values_chained(
    golden: Trace, problem: MoEProblem, stage: str
) -> None:
    tested, gold = keyed_values(stage, golden, reorder_segments(golden), problem, Mode.CHAINED)
    assert tested.shape[0] == gold.shape[0] == _live_slots(golden)
    assert torch.equal(tested, gold)


@pytest.mark.parametrize("stage", PERMUTED)
def test_isolated_rows_are_keyed_by_the_golden_layout(
    golden: Trace, problem: MoEProblem, stage: str
) -> None:
    # Isolated, the tested stage ran on the golden's permute: its own reordered rows are misread.
    tested, gold = keyed_values(stage, golden, reorder_segments(golden), problem, Mode.ISOLATED)
    assert not torch.equal(tested, gold)


def test_act_quant_values_are_the_dequantized_codes(golden: Trace, problem: MoEProblem) -> None:
    _, gold = keyed_values("act_quant", golden, clone_trace(golden), problem)
    aq = golden["act_quant"]
    group = problem.recipe.act_group
    scales = scale_values(aq["a2q_scale"], aq["a2q"].shape[1] // group).float()
    inv = golden["permute"]["inv_perm"]
    live_rows = inv[inv >= 0]  # the golden's row of each live slot, in (token, k) order
    row = slot_row(golden, 2, 1)
    i = int((live_rows == row).nonzero())
    assert gold.dtype == torch.float32
    assert torch.equal(gold[i : i + 1], dequant(aq["a2q"][row : row + 1], scales[row : row + 1]))


def _nudge(x: torch.Tensor, index: tuple[int, int]) -> None:
    """Move one bf16 or e4m3 element one step toward zero (never onto a NaN code)."""
    bits = x.view(torch.uint8 if x.element_size() == 1 else torch.int16)
    sign_bit = 0x80 if x.element_size() == 1 else 0x8000
    magnitude = int(bits[index]) & (sign_bit - 1)
    bits[index] += -1 if magnitude else 1


# The stages and modes whose checks report a calc_diff over the keyed rows.
MEASURED = [
    ("gemm1", Mode.ISOLATED),
    ("gemm1", Mode.CHAINED),
    ("act_quant", Mode.CHAINED),  # dequantized values; isolated act_quant compares codes
    ("gemm2", Mode.ISOLATED),
    ("gemm2", Mode.CHAINED),
    ("gather", Mode.CHAINED),  # isolated gather counts bf16 ulps
    ("reduce", Mode.ISOLATED),
    ("reduce", Mode.CHAINED),
]


@pytest.mark.parametrize(("stage", "mode"), MEASURED, ids=lambda v: str(v))
def test_keyed_values_are_the_rows_the_checks_measure(
    golden: Trace, problem: MoEProblem, stage: str, mode: Mode
) -> None:
    other = clone_trace(golden)
    name = {"gemm1": "mm1", "gemm2": "mm2", "act_quant": "a2q"}.get(stage, "out")
    _nudge(other[stage][name], (slot_row(golden, 1, 0) if stage in PERMUTED else 1, 5))
    result = compare_stage(stage, golden, other, problem, mode=mode)
    reported = next(c.value for c in result.checks if c.name == "calc_diff")
    tested, gold = keyed_values(stage, golden, other, problem, mode)
    assert reported > 0
    assert calc_diff(tested, gold) == reported


def test_a_stage_that_did_not_run_cannot_be_keyed(golden: Trace, problem: MoEProblem) -> None:
    other = mark_stage(clone_trace(golden), "gemm1", Status.SKIP, "needs SM100")
    with pytest.raises(ContractError, match="needs SM100"):
        keyed_values("gemm1", golden, other, problem)


def test_a_slot_outside_the_tested_rows_cannot_be_keyed(golden: Trace, problem: MoEProblem) -> None:
    other = clone_trace(golden)
    other["permute"]["inv_perm"][1, 0] = golden["gemm1"]["mm1"].shape[0] + 7
    with pytest.raises(ContractError, match="map outside"):
        keyed_values("gemm1", golden, other, problem, Mode.CHAINED)


def test_unbounded_stages_have_no_keyed_values(golden: Trace, problem: MoEProblem) -> None:
    with pytest.raises(ValueError, match="not a bounded stage"):
        keyed_values("permute", golden, clone_trace(golden), problem)
