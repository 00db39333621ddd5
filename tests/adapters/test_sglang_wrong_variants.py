"""Test-the-tester on SGLang: each wrong variant of SGLang's installed kernels (wrong_sglang.py)
must fail verification in isolated mode, at the stage its bug lives in and nowhere else."""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, Routing, ScaleFmt
from tests.adapters import wrong_sglang as wrong
from tests.adapters.expect import Expect, assert_fails_at_its_stage

pytestmark = pytest.mark.sglang

# 12 tokens, top-2 of 8 experts: every segment has padding rows after its live ones.
BASE = MoEProblem(
    tokens=12, hidden=384, intermediate=256, num_experts=8, topk=2,
    scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0,
)  # fmt: skip

# grouped routing with routed_scaling_factor 2.5: SGLang's route leaves the weights unscaled
GROUPED = BASE.replace(
    routing=Routing.GROUPED, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
)


CASES: list[Expect] = [
    Expect(wrong.CountsMissLastSlot, BASE, "align"),  # softmax routing: the last slot is live
    Expect(wrong.PaddingRowsClaimed, BASE, "permute"),  # the tail past the segments claimed
    Expect(wrong.ScalesOfTheNextToken, BASE, "permute"),  # every token has its own scales
    Expect(wrong.GatherWeightsReversed, BASE, "gather"),  # top-2 weights differ within a token
    Expect(wrong.GatherScaledTwice, BASE, "gather"),
    Expect(wrong.GatherWithoutTheFactor, GROUPED, "gather"),  # 2.5x short
]


def test_every_variant_has_a_case() -> None:
    assert {e.variant for e in CASES} == set(wrong.WRONG_VARIANTS)


@pytest.mark.parametrize("expect", CASES, ids=lambda e: e.id)
def test_wrong_variant_fails_at_its_stage(expect: Expect, record_report) -> None:
    assert expect.overridden() == [expect.stage]
    report = record_report(verify(expect.problem, backend=expect.variant(), mode="isolated"))
    assert_fails_at_its_stage(expect, report)


def test_padding_rows_claimed_fail_at_the_tail_only(record_report) -> None:
    """PaddingRowsClaimed marks every padding row with its segment's expert, a legitimate
    convention (docs/tolerance.md#permute-and-padding), and the tail with the last expert, which
    is not: permute fails on the tail alone and names the accepted convention."""
    report = record_report(verify(BASE, backend=wrong.PaddingRowsClaimed(), mode="isolated"))
    (permute,) = [r for r in report.isolated or [] if r.stage == "permute"]
    assert permute.recipe == "segment_owned_padding", permute
    failed = {c.name: c for c in permute.failed_checks}
    assert set(failed) == {"m_indices", "padding m_indices", "layouts agree"}, failed
    assert "the tail past the segments" in failed["m_indices"].detail
    assert failed["m_indices"].value == 1  # one bad segment: the tail
