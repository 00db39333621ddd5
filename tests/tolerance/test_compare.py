"""Stage comparison: identical traces pass, legal differences pass, and every check can fail.

Each test mutates one entry of a copy of a tiny hand-built golden trace (tests/tolerance) and
asserts which stage and check fail and which coordinates they name. Perturbation sizes come
from the policy table, never from literals.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from moe_verify.spec import GEMM_OUTPUT, STAGES, Mode, MoEProblem, Recipe, Stage, Status, Trace
from tests.tolerance.synthetic import (
    build_golden,
    clone_trace,
    mark_stage,
    reorder_segments,
    replace_stage,
    slot_row,
    tiny_problem,
)
from tolerance import StageResult, compare, compare_stage, policy_for
from tolerance.metrics import fp32_ulp_distance
from tolerance.policy import POLICY

pytestmark = pytest.mark.cpu

# Problem per scale layout; each row names the storage it exercises.
PROBLEMS = {
    "fp8_block-float32": tiny_problem(),  # fp32 scales, column-major a2q_scale
    "fp8_block-ceil": tiny_problem(scale_fmt="float32_ceil_ue8m0"),  # fp32 powers of two
    "fp8_block-packed": tiny_problem(scale_fmt="ue8m0_packed"),  # a2q_scale packed int32
    "mxfp8-packed": tiny_problem("mxfp8", "ue8m0_packed"),  # uint8 a1q_scale, packed permute
}
FP32_SCALES = ["fp8_block-float32", "fp8_block-ceil"]
PACKED_ACT = ["fp8_block-packed", "mxfp8-packed"]
MODES = list(Mode)
ALL_STAGES = [*STAGES, Stage.REDUCE]


@pytest.fixture(params=list(PROBLEMS), ids=list(PROBLEMS))
def problem(request: pytest.FixtureRequest) -> MoEProblem:
    return PROBLEMS[request.param]


@pytest.fixture
def golden(problem: MoEProblem) -> Trace:
    return build_golden(problem)


@pytest.fixture
def other(golden: Trace) -> Trace:
    return clone_trace(golden)


def _stage(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str, mode: Mode = Mode.ISOLATED
) -> StageResult:
    return compare_stage(stage, golden, other, problem, mode=mode)


def _failed(result: StageResult) -> dict[str, object]:
    return {c.name: c for c in result.failed_checks}


def _fp32_up(x: torch.Tensor, index: tuple[int, ...], steps: int) -> None:
    """Move one fp32 element `steps` ulps away from zero (bit increments of the magnitude)."""
    bits = x.view(torch.int32)
    bits[index] = bits[index] + steps


def _bf16_up(x: torch.Tensor, index: tuple[int, ...], steps: int) -> None:
    """Move one bf16 element `steps` ulps away from zero (bit increments of the magnitude)."""
    bits = x.view(torch.int16)
    bits[index] = bits[index] + steps


def _fp8_up(x: torch.Tensor, index: tuple[int, ...], steps: int) -> None:
    """Move one e4m3 code `steps` values away from zero (stays below the NaN code)."""
    codes = x.view(torch.uint8)
    code = int(codes[index])
    magnitude = code & 0x7F
    magnitude = magnitude + steps if magnitude + steps < 0x7F else magnitude - steps
    codes[index] = (code & 0x80) | magnitude


# -- the policy table -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", ALL_STAGES)
@pytest.mark.parametrize(
    "recipe_fmt",
    [(r.value, f.value) for r in Recipe for f in r.allowed_scale_fmts],
    ids=lambda rf: f"{rf[0]}-{rf[1]}",
)
def test_policy_covers_every_stage_recipe_format_and_mode(
    stage: str, recipe_fmt: tuple[str, str], mode: str
) -> None:
    recipe, fmt = recipe_fmt
    check = policy_for(stage, tiny_problem().replace(recipe=recipe, scale_fmt=fmt), mode)
    assert check.kind in ("exact", "gemm", "act_quant", "act_quant_values", "gather", "reduce")
    assert check.reason
    for name, limit in check.limits().items():
        assert limit.reason, f"{stage} {name} has no reason"
        assert limit.value >= 0


def test_policy_chained_row_outranks_recipe_row() -> None:
    mx = tiny_problem("mxfp8", "ue8m0_packed")
    assert policy_for("gemm2", mx, Mode.CHAINED) != policy_for("gemm2", mx, Mode.ISOLATED)
    # fp8_block with ceil scales: no recipe row (the quantizers agree there), the generic row
    assert policy_for("gemm2", mx, Mode.CHAINED) == policy_for(
        "gemm2", tiny_problem(scale_fmt="float32_ceil_ue8m0"), Mode.CHAINED
    )


def test_policy_rows_all_carry_reasons() -> None:
    for rule in POLICY:
        assert isinstance(rule.check.reason, str) and rule.check.reason.strip(), rule
        for name, limit in rule.check.limits().items():
            assert isinstance(limit.reason, str) and limit.reason.strip(), (rule, name)


def test_policy_unknown_stage_and_mode_are_refused() -> None:
    with pytest.raises(LookupError, match="no tolerance policy"):
        policy_for("nonsense", tiny_problem())
    with pytest.raises(ValueError, match="mode"):
        policy_for("gemm1", tiny_problem(), "sideways")


def test_policy_limit_lookup_names_what_is_missing() -> None:
    with pytest.raises(LookupError, match="sets no 'atol'"):
        policy_for("permute", tiny_problem()).limit("atol")


# -- what must pass -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_identical_traces_pass_every_stage(
    golden: Trace, other: Trace, problem: MoEProblem, mode: str
) -> None:
    results = compare(golden, other, problem, mode=mode)
    assert [r.stage for r in results] == ALL_STAGES
    assert {r.stage: r.status for r in results} == dict.fromkeys(ALL_STAGES, Status.PASS)


def test_segment_reorder_passes_every_stage_chained(golden: Trace, problem: MoEProblem) -> None:
    results = compare(golden, reorder_segments(golden), problem, mode=Mode.CHAINED)
    assert {r.stage: r.status for r in results} == dict.fromkeys(ALL_STAGES, Status.PASS)


def test_segment_reorder_passes_permute_isolated(golden: Trace, problem: MoEProblem) -> None:
    assert _stage(golden, reorder_segments(golden), problem, "permute").status == Status.PASS


def test_isolated_mode_keys_downstream_rows_by_the_golden_layout(
    golden: Trace, problem: MoEProblem
) -> None:
    # An isolated gemm1 ran on the golden's a_perm; rows in another order are then wrong rows.
    assert _stage(golden, reorder_segments(golden), problem, "gemm1").status == Status.FAIL


def test_route_order_inside_a_token_passes(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["route"]["topk_ids"] = golden["route"]["topk_ids"].flip(1).clone()
    other["route"]["topk_weights"] = golden["route"]["topk_weights"].flip(1).clone()
    assert _stage(golden, other, problem, "route").status == Status.PASS


def test_route_weight_within_ulp_limit_passes(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    steps = int(policy_for("route", problem).limit("ulp").value)
    _fp32_up(other["route"]["topk_weights"], (0, 1), steps)
    assert _stage(golden, other, problem, "route").status == Status.PASS


@pytest.mark.parametrize("stage", ["gemm1", "gemm2"])
def test_gemm_nan_in_padding_row_passes(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str
) -> None:
    name = GEMM_OUTPUT[Stage(stage)]
    padding = int(torch.nonzero(golden["permute"]["m_indices"] == -1)[0, 0])
    other[stage][name][padding, 3] = float("nan")
    assert _stage(golden, other, problem, stage).status == Status.PASS


@pytest.mark.parametrize("stage", ["gemm1", "gemm2"])
def test_gemm_one_bf16_ulp_everywhere_passes(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str
) -> None:
    # Two correct bf16 roundings of one fp32 value differ by at most one ulp.
    name = GEMM_OUTPUT[Stage(stage)]
    live = golden["permute"]["m_indices"] >= 0
    other[stage][name].view(torch.int16)[live] += 1
    assert _stage(golden, other, problem, stage).status == Status.PASS


def test_gather_within_ulp_limit_passes(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    steps = int(policy_for("gather", problem).limit("ulp").value)
    _bf16_up(other["gather"]["out"], (2, 7), steps)
    assert _stage(golden, other, problem, "gather").status == Status.PASS


# -- route ----------------------------------------------------------------------------------------


def test_route_misrouted_id_fails_naming_the_token(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["route"]["topk_ids"][1, 0] = 3  # token 1: experts {2, 0} -> {3, 0}
    check = _failed(_stage(golden, other, problem, "route"))["topk_ids"]
    w = check.worst
    assert (w.token, w.k, w.expert, w.golden, w.other) == (1, 0, 2, 2, 3)
    assert "token 1: golden [0, 2]" in check.detail


def test_route_weight_beyond_ulp_limit_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    steps = int(policy_for("route", problem).limit("ulp").value) + 1
    _fp32_up(other["route"]["topk_weights"], (2, 1), steps)
    check = _failed(_stage(golden, other, problem, "route"))["topk_weights"]
    assert (check.worst.token, check.worst.k, check.worst.expert) == (2, 1, 2)


# -- quant_input ----------------------------------------------------------------------------------


def test_quant_input_code_flip_fails_with_token_and_column(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    _fp8_up(other["quant_input"]["a1q"], (2, 5), 1)
    check = _failed(_stage(golden, other, problem, "quant_input"))["a1q codes"]
    assert (check.worst.token, check.worst.column) == (2, 5)
    assert check.worst.golden != check.worst.other


def test_quant_input_scale_bit_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    scale = other["quant_input"]["a1q_scale"]
    if scale.dtype == torch.uint8:
        scale[1, 0] += 1
    else:
        scale.view(torch.int32)[1, 0] += 1  # one mantissa bit
    check = _failed(_stage(golden, other, problem, "quant_input"))["a1q_scale"]
    assert check.worst.token == 1


# -- align ----------------------------------------------------------------------------------------


def test_align_longer_valid_m_sum_passes_as_another_valid_m_sum(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # A multiple of A above every segment is a valid M_sum, even one no formula gives.
    other["align"]["M_sum"] = golden["align"]["M_sum"] + golden["align"]["alignment"]
    result = _stage(golden, other, problem, "align")
    assert result.status == Status.PASS and result.recipe == "another valid M_sum"


def test_align_unaligned_m_sum_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    other["align"]["M_sum"] = golden["align"]["M_sum"] + 1
    assert "M_sum % alignment" in _failed(_stage(golden, other, problem, "align"))


def test_align_m_sum_too_small_for_segments_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["align"]["M_sum"] = golden["align"]["alignment"]
    assert "M_sum fits segments" in _failed(_stage(golden, other, problem, "align"))


def test_align_counts_mismatch_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    other["align"]["counts"][2] -= 1
    check = _failed(_stage(golden, other, problem, "align"))["counts"]
    assert "local expert 2" in check.detail
    assert check.worst.golden == check.worst.other + 1


# -- permute --------------------------------------------------------------------------------------


def test_permute_rows_swapped_between_experts_fails_naming_the_slot(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    a = other["permute"]["a_perm"].view(torch.uint8)
    r0, r1 = slot_row(golden, 0, 0), slot_row(golden, 1, 0)  # experts 0 and 2
    a[[r0, r1]] = a[[r1, r0]].clone()
    result = _stage(golden, other, problem, "permute")
    check = _failed(result)["a_perm rows"]
    assert (check.worst.token, check.worst.k, check.worst.expert) == (0, 0, 0)
    assert "slot (token 0, k 0)" in check.detail


def test_permute_slot_in_another_experts_segment_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # Data follows the slots consistently, but each slot now sits in the other expert's segment.
    perm = other["permute"]
    r0, r1 = slot_row(golden, 0, 0), slot_row(golden, 1, 0)
    for name in ("a_perm", "a_scale_perm"):
        x = perm[name].view(torch.uint8) if name == "a_perm" else perm[name]
        x[[r0, r1]] = x[[r1, r0]].clone()
    perm["inv_perm"][0, 0], perm["inv_perm"][1, 0] = r1, r0
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert set(failed) == {"expert rows"}
    assert (failed["expert rows"].worst.token, failed["expert rows"].worst.k) == (0, 0)


def test_permute_padding_m_indices_zero_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    m_indices = other["permute"]["m_indices"]
    m_indices[m_indices == -1] = 0
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert {"m_indices", "padding m_indices"} <= set(failed)
    assert failed["padding m_indices"].worst.other == 0


@pytest.mark.parametrize("bad", [0.3, -0.0, float("nan")], ids=["not-pow2", "negative-zero", "nan"])
def test_permute_ue8m0_fp32_padding_scale_must_pass_deepgemms_packer(bad: float) -> None:
    # DeepGEMM's UE8M0 packer asserts (bits & 0x807FFFFF) == 0 on every row it reads.
    problem = PROBLEMS["fp8_block-ceil"]
    golden = build_golden(problem)
    other = clone_trace(golden)
    padding = int(torch.nonzero(golden["permute"]["m_indices"] == -1)[0, 0])
    other["permute"]["a_scale_perm"][padding, 0] = bad
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert set(failed) == {"padding scales"}
    assert failed["padding scales"].worst.row == padding


@pytest.mark.parametrize("good", [1.0, 2.0**-20, 0.0], ids=["one", "tiny-pow2", "zero"])
def test_permute_ue8m0_fp32_padding_scale_may_be_any_power_of_two(good: float) -> None:
    problem = PROBLEMS["fp8_block-ceil"]
    golden = build_golden(problem)
    other = clone_trace(golden)
    other["permute"]["a_scale_perm"][golden["permute"]["m_indices"] == -1] = good
    assert _stage(golden, other, problem, "permute").status == Status.PASS


def test_permute_plain_fp32_padding_scales_are_unspecified() -> None:
    # Plain fp32 scales reach only SM90's 1D2D GEMM, which scales each row by its own scale.
    problem = PROBLEMS["fp8_block-float32"]
    golden = build_golden(problem)
    other = clone_trace(golden)
    other["permute"]["a_scale_perm"][golden["permute"]["m_indices"] == -1] = float("nan")
    result = _stage(golden, other, problem, "permute")
    assert result.status == Status.PASS
    assert "padding scales" not in {c.name for c in result.checks}


def test_permute_packed_padding_byte_ff_fails() -> None:
    problem = PROBLEMS["mxfp8-packed"]
    golden = build_golden(problem)
    other = clone_trace(golden)
    padding = int(torch.nonzero(golden["permute"]["m_indices"] == -1)[0, 0])
    other["permute"]["a_scale_perm"][padding, 0] = 0xFF << 8  # byte 1: group 1
    failed = _failed(_stage(golden, other, problem, "permute"))
    assert set(failed) == {"padding scales"}
    assert failed["padding scales"].worst.column == problem.recipe.act_group


def test_act_quant_packed_pad_bytes_are_ignored() -> None:
    # H=128 at 1x128 groups packs one exponent byte per word; bytes 1..3 are padding.
    problem = PROBLEMS["fp8_block-packed"]
    golden = build_golden(problem)
    scale = golden["act_quant"]["a2q_scale"]
    other = clone_trace(golden)
    other["act_quant"]["a2q_scale"].copy_(scale | (0x5E << 8))
    assert _stage(golden, other, problem, "act_quant").status == Status.PASS


def test_permute_scale_row_differs_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    row = slot_row(golden, 3, 0)
    scale = other["permute"]["a_scale_perm"]
    if scale.dtype == torch.int32:
        scale[row, 0] += 1  # byte 0 (group 0) one exponent up
    else:
        scale[row, 0] *= 2
    check = _failed(_stage(golden, other, problem, "permute"))["a_scale_perm rows"]
    assert (check.worst.token, check.worst.k, check.worst.column) == (3, 0, 0)


def test_permute_duplicate_inv_perm_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    other["permute"]["inv_perm"][2, 1] = slot_row(golden, 1, 0)  # both slots in expert 2
    check = _failed(_stage(golden, other, problem, "permute"))["inv_perm"]
    assert "shared" in check.detail


def test_permute_out_of_range_inv_perm_fails_without_crashing(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["permute"]["inv_perm"][0, 1] = golden["align"]["M_sum"] + 5
    result = _stage(golden, other, problem, "permute")
    check = _failed(result)["inv_perm"]
    assert (check.worst.token, check.worst.k) == (0, 1)
    assert "outside" in check.detail


# -- gemm -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", ["gemm1", "gemm2"])
def test_gemm_nan_in_live_row_fails(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str, mode: str
) -> None:
    name = GEMM_OUTPUT[Stage(stage)]
    other[stage][name][slot_row(golden, 2, 1), 9] = float("nan")
    result = _stage(golden, other, problem, stage, mode)
    check = _failed(result)["nan_inf"]
    assert (check.worst.token, check.worst.k, check.worst.expert, check.worst.column) == (
        2,
        1,
        2,
        9,
    )
    assert "1 NaN" in check.detail


@pytest.mark.parametrize("stage", ["gemm1", "gemm2"])
def test_gemm_element_beyond_bound_fails_with_coordinates(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str
) -> None:
    name = GEMM_OUTPUT[Stage(stage)]
    check = policy_for(stage, problem)
    row = slot_row(golden, 1, 1)
    gold = golden[stage][name][row].float()
    allowed = check.limit("atol").value * float(gold.abs().max()) + check.limit(
        "rtol"
    ).value * float(gold[17].abs())
    other[stage][name][row, 17] = float(gold[17]) + 4 * allowed
    result = _stage(golden, other, problem, stage)
    elementwise = _failed(result)["elementwise"]
    assert (elementwise.worst.token, elementwise.worst.k, elementwise.worst.column) == (1, 1, 17)


@pytest.mark.parametrize("stage", ["gemm1", "gemm2"])
def test_gemm_misrouted_row_fails_per_token(
    golden: Trace, other: Trace, problem: MoEProblem, stage: str
) -> None:
    # Slot (0, 1)'s row gets expert 2's output for token 1: a plausible, finite, wrong row.
    name = GEMM_OUTPUT[Stage(stage)]
    x = other[stage][name]
    x[slot_row(golden, 0, 1)] = golden[stage][name][slot_row(golden, 1, 0)]
    check = _failed(_stage(golden, other, problem, stage))["per-token"]
    assert (check.worst.token, check.worst.k, check.worst.expert) == (0, 1, 1)


def test_gemm_missing_output_fails_contract(golden: Trace, problem: MoEProblem) -> None:
    other = replace_stage(clone_trace(golden), "gemm1", {"engine": "deepgemm"})
    result = _stage(golden, other, problem, "gemm1")
    assert result.status == Status.FAIL
    assert "'mm1'" in _failed(result)["contract"].detail


# -- act_quant ------------------------------------------------------------------------------------


def test_act_quant_code_beyond_distance_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    steps = int(policy_for("act_quant", problem).limit("code_dist").value) + 1
    _fp8_up(other["act_quant"]["a2q"], (slot_row(golden, 3, 0), 40), steps)
    check = _failed(_stage(golden, other, problem, "act_quant"))["code distance"]
    assert (check.worst.token, check.worst.k, check.worst.column) == (3, 0, 40)


@pytest.mark.parametrize("problem_id", PACKED_ACT)
def test_act_quant_packed_byte_order_swapped_fails(problem_id: str) -> None:
    problem = PROBLEMS[problem_id]
    golden = build_golden(problem)
    other = clone_trace(golden)
    words = other["act_quant"]["a2q_scale"]
    b = [(words.to(torch.int64) >> (8 * j)) & 0xFF for j in range(4)]
    swapped = (b[0] << 24) | (b[1] << 16) | (b[2] << 8) | b[3]
    words.copy_(torch.where(swapped >= 1 << 31, swapped - (1 << 32), swapped).to(torch.int32))
    result = _stage(golden, other, problem, "act_quant")
    assert {"scale flips", "scale step"} <= set(_failed(result))


def test_act_quant_scale_two_exponents_off_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    scale = other["act_quant"]["a2q_scale"]
    row = slot_row(golden, 0, 0)
    if scale.dtype == torch.int32:
        scale[row, 0] += 2  # group 0's byte
    else:
        scale[row, 0] *= 4
    check = _failed(_stage(golden, other, problem, "act_quant"))["scale step"]
    assert (check.worst.token, check.worst.k, check.worst.column) == (0, 0, 0)


def test_act_quant_nan_code_in_live_row_fails(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    other["act_quant"]["a2q"].view(torch.uint8)[slot_row(golden, 1, 1), 3] = 0x7F
    check = _failed(_stage(golden, other, problem, "act_quant"))["nan_inf"]
    assert (check.worst.token, check.worst.k, check.worst.column) == (1, 1, 3)


def test_act_quant_nan_code_in_padding_row_passes(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    padding = int(torch.nonzero(golden["permute"]["m_indices"] == -1)[0, 0])
    other["act_quant"]["a2q"].view(torch.uint8)[padding, 3] = 0x7F
    assert _stage(golden, other, problem, "act_quant").status == Status.PASS


# -- gather / reduce ------------------------------------------------------------------------------


def test_gather_misrouted_token_fails_with_token_coordinate(
    golden: Trace, other: Trace, problem: MoEProblem
) -> None:
    # Token 1's output uses token 2's expert-1 row in place of its own expert-0 contribution.
    mm2 = golden["gemm2"]["mm2"].float()
    w = golden["route"]["topk_weights"]
    wrong = mm2[slot_row(golden, 1, 0)] * w[1, 0] + mm2[slot_row(golden, 2, 0)] * w[1, 1]
    other["gather"]["out"][1] = wrong.to(torch.bfloat16)
    result = _stage(golden, other, problem, "gather")
    failed = _failed(result)
    assert failed["ulp"].worst.token == 1
    assert failed["per-token"].worst.token == 1
    assert "golden routes token 1 to experts [2, 0]" in failed["ulp"].detail


def test_gather_beyond_ulp_limit_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    steps = int(policy_for("gather", problem).limit("ulp").value) + 1
    _bf16_up(other["gather"]["out"], (2, 7), steps)
    check = _failed(_stage(golden, other, problem, "gather"))["ulp"]
    assert (check.worst.token, check.worst.column, check.value) == (2, 7, steps)


def test_reduce_perturbed_token_fails(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    other["reduce"]["out"][2] = -other["reduce"]["out"][2]
    failed = _failed(_stage(golden, other, problem, "reduce"))
    assert failed["per-token"].worst.token == 2
    assert failed["per-token"].worst.rank is None


# -- skip / error ---------------------------------------------------------------------------------


def test_skipped_stage_is_reported_as_skip_with_reason(golden: Trace, problem: MoEProblem) -> None:
    other = mark_stage(clone_trace(golden), "gemm2", Status.SKIP, "needs SM100")
    result = _stage(golden, other, problem, "gemm2")
    assert result.status == Status.SKIP
    assert "needs SM100" in result.reason


def test_missing_stage_is_reported_as_skip(golden: Trace, problem: MoEProblem) -> None:
    other = replace_stage(clone_trace(golden), "act_quant", None)
    results = {r.stage: r for r in compare(golden, other, problem)}
    assert results["act_quant"].status == Status.SKIP
    assert "no 'act_quant' stage" in results["act_quant"].reason


def test_chained_stage_after_skipped_permute_fails_contract(
    golden: Trace, problem: MoEProblem
) -> None:
    other = mark_stage(clone_trace(golden), "permute", Status.SKIP, "not here")
    result = _stage(golden, other, problem, "gemm1", Mode.CHAINED)
    assert result.status == Status.FAIL
    assert "permute was skipped or raised" in _failed(result)["contract"].detail


def test_stage_that_raised_is_reported_as_error(golden: Trace, problem: MoEProblem) -> None:
    other = mark_stage(clone_trace(golden), "gemm1", Status.ERROR, "RuntimeError: IMA")
    result = _stage(golden, other, problem, "gemm1")
    assert result.status == Status.ERROR
    assert "candidate raised in gemm1: RuntimeError: IMA" == result.reason


def test_comparison_bug_is_an_error_not_a_crash(
    golden: Trace, other: Trace, problem: MoEProblem, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: object) -> list[object]:
        raise RuntimeError("boom")

    # The package re-exports the function `compare`, which shadows the module attribute.
    compare_module = importlib.import_module("tolerance.compare")
    monkeypatch.setitem(compare_module._COMPARERS, "route", broken)
    result = _stage(golden, other, problem, "route")
    assert (result.status, result.reason) == (Status.ERROR, "RuntimeError: boom")


def test_compare_subset_of_stages(golden: Trace, other: Trace, problem: MoEProblem) -> None:
    assert [r.stage for r in compare(golden, other, problem, ["permute", "gather"])] == [
        "permute",
        "gather",
    ]


# -- route weights under renormalization --------------------------------------------------------


@pytest.mark.parametrize("topk", [3, 8])
def test_renormalized_weights_in_two_sum_orders_stay_within_the_bound(topk: int) -> None:
    """The bound's premise: the same k scores renormalized by sums in two orders (as the golden,
    with its lowest-id tie order, and a kernel with torch.topk's) differ by at most the policy's
    ulps. Many random tokens, so the check is not passed by luck; and the worst seen must be
    within the bound, while the two orders really differ (two terms commute, three need not)."""
    gen = torch.Generator().manual_seed(topk)
    scores = torch.rand(20000, topk, generator=gen) ** 4  # spread exponents, as sigmoid tails do
    ahead = scores / scores.sum(dim=-1, keepdim=True)
    reverse = scores.flip(1)
    behind = (reverse / reverse.cumsum(dim=-1)[:, -1:]).flip(1)
    worst = int(fp32_ulp_distance(ahead, behind).max())
    problem = MoEProblem(tokens=64, hidden=128, intermediate=128, num_experts=16, topk=topk)
    limit = policy_for("route", problem).limit("ulp")
    assert limit.value == 2 * topk + 1
    assert 0 < worst <= limit.value, f"{worst} ulps between two sum orders at k={topk}"


def test_weights_without_renormalization_keep_one_ulp() -> None:
    problem = MoEProblem(
        tokens=64, hidden=128, intermediate=128, num_experts=16, topk=8, renormalize=False
    )
    assert policy_for("route", problem).limit("ulp").value == 1
