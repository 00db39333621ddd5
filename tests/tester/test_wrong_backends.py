"""Test-the-tester: every wrong backend must fail verification, and isolated mode must name the
stage its bug lives in (and the rank, for a rank-dependent bug).

Each row runs the smallest case on which its bug is reachable; the comment says why. `chained`
records what a user would see end to end: the first failing stage when the backend runs on its own
outputs, or None where the bug is invisible there and only isolated mode exposes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_verify.run.verify import verify
from moe_verify.spec import STAGES, GroupedLayout, MoEProblem, Recipe, Routing, ScaleFmt, Topology
from optimized.backend import OptimizedBackend
from tests.tester import wrong_backends as wrong
from tolerance.compare import StageResult

pytestmark = pytest.mark.cpu

CEIL, PACKED = ScaleFmt.FLOAT32_CEIL_UE8M0, ScaleFmt.UE8M0_PACKED
M_INDICES, PSUM = GroupedLayout.M_INDICES, GroupedLayout.PSUM
# Four experts, top-2, A = 32 (SM100's smallest DeepGEMM alignment, half the interpreter time of
# 128): every expert has live rows and padding rows; one 128-column scale group per row.
BASE = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
MXFP8 = BASE.replace(recipe=Recipe.MXFP8, scale_fmt=PACKED)  # 4 E8M0 bytes in one packed word
TWO_GROUPS = BASE.replace(intermediate=256)  # act_quant scales [M, 2]: row- vs column-major differ


@dataclass(frozen=True)
class Expect:
    """A wrong backend, the case that reaches its bug, and where the suite must catch it."""

    backend: type[OptimizedBackend]
    problem: MoEProblem
    stage: str  # the isolated culprit: the stage the bug lives in
    chained: str | None  # first failing stage in chained mode; None: invisible end to end
    rank: int | None = None  # the failing rank of a rank-dependent bug

    @property
    def id(self) -> str:
        return self.backend.name


CASES: list[Expect] = [
    Expect(wrong.MisroutedToken, BASE, "route", "route"),  # E > k: an unused expert exists
    Expect(
        wrong.RoutedScalingTwice,
        BASE.replace(
            routing=Routing.GROUPED,
            num_experts=8,
            num_expert_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
        "route",
        "route",
    ),  # DeepSeek grouped routing with a scaling factor != 1
    Expect(wrong.FloorInputScales, BASE.replace(scale_fmt=CEIL), "quant_input", "quant_input"),
    # ^ ceil-UE8M0 input scales
    Expect(wrong.MSumOneBlockShort, BASE, "align", "align"),  # one block below the exact sum
    Expect(wrong.MSumNotAligned, BASE, "align", "align"),
    Expect(wrong.HalfAlignment, BASE, "align", "align"),  # A = 32 halves to 16
    Expect(
        wrong.ExpertMapIgnoredOnRank1,
        BASE.replace(topology=Topology.parse("ep:2")),
        "align",
        "align",
        rank=1,
    ),  # EP2, linear: rank 1 hosts experts 2, 3, so global != local ids there
    Expect(wrong.SwappedExpertRows, BASE, "permute", "permute"),
    Expect(wrong.SlotInWrongSegment, BASE, "permute", "permute"),
    # ^ counts far below A leave a free row in every segment
    Expect(wrong.PaddingMIndicesZero, BASE, "permute", "permute"),  # ~8 live rows per 32
    Expect(wrong.UnalignedSegments, BASE, "permute", "permute"),
    Expect(wrong.SegmentMIndicesWrong, BASE, "permute", "permute"),
    Expect(
        wrong.ExpertEndsOffByOne, BASE.replace(grouped_layout=PSUM), "permute", "permute"
    ),  # the psum layout the GEMMs then read; every count of ~8 is far from A = 32
    Expect(wrong.InvPermOffByOne, BASE, "permute", "permute"),
    Expect(
        wrong.GarbagePaddingScales,
        BASE.replace(scale_fmt=CEIL, grouped_layout=M_INDICES),
        "permute",
        "permute",
    ),  # fp32 UE8M0 scales: the format where DeepGEMM asserts powers of two (vLLM PR #49784), in
    # the m_indices layout, whose GEMM reads every row (psum skips gap rows: auto on SM90)
    Expect(wrong.NanPaddingPackedScales, MXFP8, "permute", "permute"),  # packed padding words
    Expect(wrong.PermutedScaleBytesReversed, MXFP8, "permute", "permute"),
    # ^ MXFP8 packs the permuted scales: 4 bytes a word, H = 128
    Expect(wrong.StaleGemm1Row, BASE, "gemm1", "gemm1"),
    Expect(
        wrong.HalfGridGemm1,
        BASE.replace(tokens=24, routing=Routing.ONE_EXPERT),
        "gemm1",
        "gemm1",
    ),  # one expert with 24 live rows > A/2 = 16, so the unlaunched half holds live rows
    Expect(wrong.GateUpSwapped, BASE, "act_quant", "act_quant"),
    # ^ N(0, 1) inputs make gate and up O(1): silu(g)*u != silu(u)*g
    Expect(wrong.FloorActScales, BASE.replace(scale_fmt=CEIL), "act_quant", "act_quant"),
    Expect(wrong.ActScaleBytesReversed, BASE.replace(scale_fmt=PACKED), "act_quant", "act_quant"),
    # ^ packed UE8M0 act scales: one group and three pad bytes per word
    Expect(wrong.ActScaleWrittenRowMajor, TWO_GROUPS, "act_quant", "act_quant"),
    Expect(wrong.Gemm2IgnoresScaleStrides, TWO_GROUPS, "gemm2", None),
    # ^ the golden's act scales are row-major, this backend's own column-major
    Expect(wrong.NanExpertOutput, BASE, "gemm2", "gemm2"),
    Expect(wrong.TopkWeightsIgnored, BASE, "gather", "gather"),  # softmax weights != 1
    Expect(
        wrong.Bf16GatherAccumulation,
        BASE.replace(tokens=9, num_experts=8, topk=8, routing=Routing.UNIFORM),
        "gather",
        None,
    ),  # k = 8: seven bf16 roundings per element instead of one
    Expect(
        wrong.InvalidSlotGathered,
        BASE.replace(topk=3, routing=Routing.INVALID_SLOTS),
        "gather",
        "gather",
    ),  # -1 slots keep a nonzero weight
    Expect(
        wrong.LastExpertDroppedOnLastRank,
        BASE.replace(num_experts=6, topology=Topology.parse("ep:4")),
        "gather",
        "gather",
        rank=3,
    ),  # E % N = 2: ranks 0, 1 hold two experts, ranks 2, 3 one; rank 3's is expert 5
]


def _overridden_stage(backend: type[OptimizedBackend]) -> list[str]:
    return [s for s in STAGES if s in vars(backend)]


def _first_failing(results: list[StageResult] | None) -> StageResult | None:
    return next((r for r in results or [] if r.status.failing), None)


def test_every_wrong_backend_has_a_case() -> None:
    assert {e.backend for e in CASES} == set(wrong.WRONG_BACKENDS)
    assert len({e.id for e in CASES}) == len(CASES) >= 15


@pytest.mark.parametrize("expect", CASES, ids=lambda e: e.id)
def test_wrong_backend_is_caught(expect: Expect, record_report) -> None:
    assert _overridden_stage(expect.backend) == [expect.stage], (
        f"{expect.id} must override exactly the stage it is expected to fail in"
    )
    backend = expect.backend(engine="triton")
    report = record_report(verify(expect.problem, backend=backend, mode="both"))
    assert not report.passed, f"{expect.id} passed verification: {report.summary_line()}"

    culprit = report.first_failing_result
    assert culprit is not None and report.first_failure == expect.stage, report.summary_line()
    assert culprit.status == "fail", (
        f"{expect.id}: {culprit.label} raised instead of failing a check: {culprit.reason}"
    )
    isolated = {(r.stage, r.rank) for r in report.isolated or [] if r.status.failing}
    assert {s for s, _ in isolated if s != "reduce"} == {expect.stage}, (
        f"isolated mode must blame {expect.stage} alone, it fails {sorted(isolated, key=str)}"
    )
    assert culprit.rank == expect.rank, report.summary_line()
    if expect.rank is not None:
        assert report.failed_ranks == [expect.rank], report.failed_ranks

    chained = _first_failing(report.chained)
    assert (chained.stage if chained else None) == expect.chained, (
        f"{expect.id}: chained mode first fails at {chained.label if chained else None}, "
        f"expected {expect.chained}"
    )
