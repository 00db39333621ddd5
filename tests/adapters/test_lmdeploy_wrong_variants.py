"""Test-the-tester on LMDeploy: each wrong variant of LMDeploy's installed kernels
(wrong_lmdeploy.py) must fail verification in isolated mode at the stage its bug lives in.

The correct LMDeploy 0.18 already fails some checks (docs/implementations.md, findings 3-6: the
permute's padding conventions, the gather's bf16 accumulation, quant_input's third rounding with
fp32 scales, act_quant's fp32 scales under ceil-UE8M0), so a variant's verdict is judged against
the correct kernel's run on the same problem: the (stage, check) pairs it fails beyond the correct
run's must be non-empty and all at its own stage. Sizes as LMDeploy and the interpreter take them
(H = 1024, Ip = 512, A = 128), tp:1, 8 tokens top-2 of 4 experts (every segment has live rows;
four experts keep M_sum, and the interpreter's time, at 512 rows).
"""

from __future__ import annotations

import pytest

from moe_verify.adapters.lmdeploy import LmdeployBackend
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, ScaleFmt
from tests.adapters import wrong_lmdeploy as wrong
from tests.adapters.expect import Expect

pytestmark = pytest.mark.lmdeploy

BASE = MoEProblem(
    tokens=8, hidden=1024, intermediate=512, num_experts=4, topk=2,
    scale_fmt=ScaleFmt.FLOAT32, grouped_layout="m_indices",
)  # fmt: skip
# ceil-UE8M0: the correct quant_input passes bit for bit (1/scale is exact)
CEIL = BASE.replace(scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0)


CASES: list[Expect] = [
    Expect(wrong.QuantScalesFloored, CEIL, "quant_input"),  # scale 2^floor, not 2^ceil
    Expect(wrong.QuantScaleFmtDropped, CEIL, "quant_input"),  # amax/448, not a power of two
    Expect(wrong.ScatterSlotToNeighbour, BASE, "permute"),  # softmax: every expert has rows
    Expect(wrong.ActGateUpSwapped, BASE, "act_quant"),  # fp32: the correct act_quant passes
    Expect(wrong.GatherWeightsReversed, BASE, "gather"),  # top-2 weights differ within a token
    Expect(wrong.GatherIgnoresWeights, BASE, "gather"),
]

Pairs = set[tuple[str, str]]


def failing_pairs(report) -> Pairs:
    """The (stage, check) pairs failing in isolated mode, ranks folded; a stage that errored
    counts as ('stage', 'error')."""
    pairs: Pairs = set()
    for r in report.isolated or []:
        if r.status == "error":
            pairs.add((r.stage, "error"))
        pairs.update((r.stage, c.name) for c in r.failed_checks)
    return pairs


_CORRECT: dict[str, Pairs] = {}


def correct_failures(problem: MoEProblem) -> Pairs:
    """The correct LMDeploy's failing (stage, check) pairs on `problem` (run once a problem)."""
    if problem.id not in _CORRECT:
        _CORRECT[problem.id] = failing_pairs(
            verify(problem, backend=LmdeployBackend(), mode="isolated")
        )
    return _CORRECT[problem.id]


def test_every_variant_has_a_case() -> None:
    assert {e.variant for e in CASES} == set(wrong.WRONG_VARIANTS)


@pytest.mark.parametrize("expect", CASES, ids=lambda e: e.id)
def test_wrong_variant_fails_at_its_stage(expect: Expect, record_report) -> None:
    assert expect.overridden() == [expect.stage]
    report = record_report(verify(expect.problem, backend=expect.variant(), mode="isolated"))
    assert not report.passed, f"{expect.id} passed verification: {report.summary_line()}"
    ours = failing_pairs(report)
    correct = correct_failures(expect.problem)
    new = ours - correct
    text = "\n".join(report.failure_messages())
    assert new, f"{expect.id} fails nothing the correct LMDeploy does not: {sorted(ours)}\n{text}"
    assert {s for s, _ in new} == {expect.stage}, f"{expect.id} adds {sorted(new)}\n{text}"
    # the stages the correct kernel passes still pass: only the variant's stage is new
    assert {s for s, _ in ours} - {s for s, _ in correct} <= {expect.stage}, sorted(ours)
    for r in report.isolated or []:
        if r.stage == expect.stage:
            assert r.status != "error", f"{expect.id}: {r.label} raised: {r.reason}"
