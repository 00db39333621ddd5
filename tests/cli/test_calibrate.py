"""`moe-verify calibrate` on one tiny case x 2 seeds: the result's shape, the golden's own floor,
the E8M0 cost rows, and the rendered outputs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from moe_verify.calibrate import EXCESS, CalibrationResult, calibrate
from moe_verify.spec import MoEProblem
from reference.moe import ReferenceBackend
from tolerance.policy import policy_for

pytestmark = pytest.mark.cpu

TINY = MoEProblem(tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2)  # fp8, fp32
SEEDS = 2
BOUNDED = ("gemm1", "act_quant", "gemm2", "gather")
# The golden's fp64-vs-fp32 accumulation floor must sit far below every GEMM limit: the golden is
# the ruler, so its own noise may use only a small share of what the policy allows the kernels.
GOLDEN_FLOOR_SHARE = 0.25
# Its noise is a bf16 rounding flipped by one ulp (<= 2^-7 of the value, at the bottom of a
# binade). Next to the row max, one flip reaches 2^-7 / (atol + rtol) of the per-element bound:
# 40% under the isolated GEMM policy (measured 28%, docs/calibration-cpu.md), so the per-element
# ratio is held to one flip rather than to GOLDEN_FLOOR_SHARE.
BF16_ULP = 2.0**-7


@pytest.fixture(scope="module")
def out_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("calibration") / "calibration.md"


@pytest.fixture(scope="module")
def result(out_path: Path) -> CalibrationResult:
    return calibrate(seeds=SEEDS, out=out_path, cases=[TINY])


def test_every_source_measures_every_bounded_stage_on_every_seed(result: CalibrationResult):
    assert result.notes == []
    assert result.sources() == [
        "golden64/chained",
        "golden64/isolated",
        "optimized/chained",
        "optimized/isolated",
    ]
    for source in result.sources():
        stages = {m.stage for m in result.measurements if m.source == source and m.bounded}
        assert set(BOUNDED) <= stages, source
    for m in result.measurements:
        assert m.case == TINY.id
        assert sorted(m.values) == list(range(SEEDS)), (m.source, m.stage, m.check)
        assert m.limit >= 0 and m.value >= 0


def test_headroom_is_value_over_limit(result: CalibrationResult):
    for m in result.measurements:
        if m.limit > 0:
            assert m.headroom == pytest.approx(m.value / m.limit)
        elif m.value == 0:
            assert m.headroom == 0


def test_excess_ratio_is_measured_where_the_policy_sets_atol_and_rtol(result: CalibrationResult):
    excess = {(m.source, m.stage) for m in result.measurements if m.check == EXCESS}
    for mode in ("isolated", "chained"):
        assert (f"optimized/{mode}", "gemm1") in excess
        assert (f"optimized/{mode}", "gemm2") in excess
    assert ("optimized/chained", "act_quant") in excess  # chained act_quant compares values
    assert ("optimized/isolated", "act_quant") not in excess  # isolated compares codes
    assert ("optimized/isolated", "gather") not in excess  # isolated gather is bounded in ulps


def test_golden_fp64_floor_is_far_below_every_gemm_limit(result: CalibrationResult):
    gemm = [
        m
        for m in result.measurements
        if m.source == "golden64/isolated" and m.stage in ("gemm1", "gemm2") and m.bounded
    ]
    assert {m.check for m in gemm} >= {EXCESS, "elementwise", "per-token", "calc_diff"}
    for m in gemm:
        if m.check == EXCESS:
            check = policy_for(m.stage, TINY, "isolated")
            one_flip = BF16_ULP / (check.limit("atol").value + check.limit("rtol").value)
            assert m.value <= one_flip, (m.stage, m.value, one_flip)
        elif m.check == "per-token":  # one flip at the row max: 2^-7 of the row, 25% of 2^-5
            assert m.value <= BF16_ULP and m.headroom <= GOLDEN_FLOOR_SHARE, (m.stage, m.value)
        else:
            assert m.headroom < GOLDEN_FLOOR_SHARE, (m.stage, m.check, m.value, m.limit)


def test_e8m0_cost_covers_every_scale_format_of_the_recipe(result: CalibrationResult):
    fmts = {c.scale_fmt for c in result.e8m0}
    assert fmts == {f.value for f in TINY.recipe.allowed_scale_fmts}
    for c in result.e8m0:
        assert sorted(c.calc_diff) == list(range(SEEDS))
        # Quantization costs something, and stays a perturbation of the master-weight output.
        assert all(0 < v < 1 for v in c.rel_l2.values()), c


def test_markdown_names_each_stage_and_source(result: CalibrationResult):
    text = result.to_markdown()
    for stage in BOUNDED:
        assert f"| {stage} |" in text
    for source in result.sources():
        assert f"## {source}: every case" in text
    assert "Accuracy cost of the scale format" in text
    assert "moe-verify calibrate --seeds" in text


def test_out_writes_markdown_and_json(result: CalibrationResult, out_path: Path):
    assert out_path.read_text() == result.to_markdown()
    data = json.loads(out_path.with_suffix(".json").read_text())
    assert data["seeds"] == SEEDS
    assert len(data["measurements"]) == len(result.measurements)
    assert {"case", "source", "stage", "check", "value", "limit", "headroom"} <= set(
        data["measurements"][0]
    )


def test_a_case_that_cannot_run_is_a_note_not_a_crash():
    # The FP4 experts support silu only: the golden raises in act_quant and in the E8M0 run.
    bad = MoEProblem(
        tokens=4,
        hidden=128,
        intermediate=128,
        num_experts=2,
        topk=1,
        recipe="mxfp4_w4a8",
        scale_fmt="float32_ceil_ue8m0",
        activation="swigluoai",
    )
    result = calibrate(seeds=1, out=None, cases=[bad])
    assert any("act_quant" in n for n in result.notes), result.notes
    assert any("not measured" in n and "silu" in n for n in result.notes), result.notes
    assert "## Not measured" in result.to_markdown()


class _ScaledGemm2(ReferenceBackend):
    """The golden with GEMM2's output scaled by 1 + 2^-4: beyond every isolated GEMM bound."""

    name = "scaled-gemm2"

    def gemm2(self, *args: object) -> dict[str, object]:
        out = super().gemm2(*args)
        return {**out, "mm2": (out["mm2"].float() * (1 + 2**-4)).to(torch.bfloat16)}


def test_a_noise_beyond_the_limit_shows_as_over_it():
    result = calibrate(seeds=1, out=None, cases=[TINY], backend=_ScaledGemm2())
    over = {
        m.check
        for m in result.measurements
        if m.source == "scaled-gemm2/isolated" and m.stage == "gemm2" and m.headroom > 1
    }
    assert {EXCESS, "elementwise", "per-token"} <= over
    assert "| scaled-gemm2/isolated | gemm2 | per-token |" in result.to_markdown()
    assert "**" in result.to_markdown()  # over-limit headroom is bold


class _HangsInGemm2(ReferenceBackend):
    """The golden, whose gemm2 never returns (a deadlocked kernel)."""

    name = "hangs-in-gemm2"

    def gemm2(self, *args: object) -> dict[str, object]:
        while True:
            time.sleep(3600)


# Long enough for the tiny case's goldens on a loaded 2-core machine (well under a second in the
# -n 2 tier), short enough to wait out.
HANG_TIMEOUT_S = 5.0


def test_a_case_that_hangs_is_a_note_after_the_case_timeout():
    small = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
    start = time.monotonic()
    result = calibrate(
        seeds=1, out=None, cases=[small], backend=_HangsInGemm2(), case_timeout_s=HANG_TIMEOUT_S
    )
    assert time.monotonic() - start < 10 * HANG_TIMEOUT_S
    timed_out = [n for n in result.notes if "timed out after" in n or "case timeout ran out" in n]
    assert timed_out and all(small.id in n for n in timed_out), result.notes
