"""Test-the-tester on vLLM: each wrong variant of vLLM's installed kernels (wrong_vllm.py) must
fail verification in isolated mode, at the stage its bug lives in and nowhere else.

Each row runs a small case on which its bug is reachable; the comment says why.
"""

from __future__ import annotations

import pytest

from moe_verify.adapters.vllm import VllmBackend
from moe_verify.spec import STAGES, Activation, MoEProblem, Routing, ScaleFmt
from moe_verify.verification import verify
from tests.adapters import wrong_vllm as wrong
from tests.adapters.expect import Expect

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


def _overridden(variant: type[VllmBackend]) -> list[str]:
    return [s for s in STAGES if s in vars(variant)]


def test_every_variant_has_a_case() -> None:
    assert {e.variant for e in CASES} == set(wrong.WRONG_VARIANTS)


@pytest.mark.parametrize("expect", CASES, ids=lambda e: e.id)
def test_wrong_variant_fails_at_its_stage(expect: Expect, record_report) -> None:
    assert _overridden(expect.variant) == [expect.stage], (
        f"{expect.id} must override exactly the stage it is expected to fail in"
    )
    report = record_report(verify(expect.problem, backend=expect.variant(), mode="isolated"))
    assert not report.passed, f"{expect.id} passed verification: {report.summary_line()}"
    culprit = report.first_failing_result
    assert culprit is not None and report.first_failure == expect.stage, report.summary_line()
    assert culprit.status == "fail", (
        f"{expect.id}: {culprit.label} raised instead of failing a check: {culprit.reason}"
    )
    failing = {r.stage for r in report.isolated or [] if r.status.failing}
    assert failing == {expect.stage}, f"isolated mode must blame {expect.stage} alone: {failing}"
