"""Test-the-tester on vLLM: each wrong variant of vLLM's installed kernels (wrong_vllm.py) must
fail verification in isolated mode, at the stage its bug lives in and nowhere else.

Each row runs a small case on which its bug is reachable; the comment says why.
"""

from __future__ import annotations

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import Activation, MoEProblem, Routing, ScaleFmt
from tests.adapters import wrong_vllm as wrong
from tests.adapters.expect import Expect, assert_fails_at_its_stage

pytestmark = pytest.mark.vllm

# Eight experts, top-2, 12 tokens: every expert has live rows far fewer than A = 128, so each
# segment has padding rows after its live ones.
BASE = MoEProblem(tokens=12, hidden=384, intermediate=256, num_experts=8, topk=2)
CEIL, PACKED = ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED


CASES: list[Expect] = [
    Expect(wrong.OffByOnePrefixSum, BASE.replace(scale_fmt=CEIL), "permute"),
    # ^ experts 1.. start one row late: their first segment row is left unclaimed
    Expect(
        wrong.UnzeroedPaddingScales,
        BASE.replace(scale_fmt=CEIL, grouped_layout="m_indices"),
        "permute",
    ),
    # ^ fp32 ceil-UE8M0 scales on the per-row layout, whose padding rows DeepGEMM's packer reads
    Expect(wrong.PackedScaleBytesReversed, BASE.replace(scale_fmt=PACKED), "act_quant"),
    # ^ I = 256: two groups and two pad bytes (94) per word, so the reversal moves every byte
    Expect(
        wrong.OneSidedUpClamp,
        BASE.replace(scale_fmt=CEIL, activation=Activation("swigluoai", 1.702, 1.0, 1.5)),
        "act_quant",
    ),  # L = 1.5: about 7% of the N(0, 1) up values lie below -L
    Expect(
        wrong.MinusOneCheckSkipped,
        BASE.replace(scale_fmt=CEIL, routing=Routing.INVALID_SLOTS),
        "gather",
    ),
    # ^ -1 slots keep a nonzero router weight
    Expect(wrong.GatherWeightsReversed, BASE.replace(scale_fmt=CEIL), "gather"),
    # ^ softmax top-2 weights differ within a token
]


def test_every_variant_has_a_case() -> None:
    assert {e.variant for e in CASES} == set(wrong.WRONG_VARIANTS)


@pytest.mark.parametrize("expect", CASES, ids=lambda e: e.id)
def test_wrong_variant_fails_at_its_stage(expect: Expect, record_report) -> None:
    assert expect.overridden() == [expect.stage]
    report = record_report(verify(expect.problem, backend=expect.variant(), mode="isolated"))
    assert_fails_at_its_stage(expect, report)
