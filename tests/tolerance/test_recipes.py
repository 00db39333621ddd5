"""Stages with several legitimate recipes: quant_input and act_quant match one of the golden's
recipes (or the declared one), the result names it, a wrong one still fails, and a chained
permute after another legitimate quantization is compared against the same bytes it copied.

The golden here is the real one (`reference`) on tiny problems: its traces carry every recipe's
outputs. A tested trace is a copy of it with one stage's outputs replaced.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moe_verify.examples.ceil_packed import silu_and_mul_ceil_packed
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_one_stage
from moe_verify.spec import (
    ActQuantRecipe,
    GatherRecipe,
    InputQuantRecipe,
    Mode,
    MoEProblem,
    RoutedScalingRecipe,
    Stage,
    StageContext,
    Status,
)
from reference.gather import gather
from reference.moe import ReferenceBackend
from tests.tolerance.synthetic import clone_trace, replace_stage
from tolerance.compare import compare_stage
from tolerance.stages.recipes import RECIPE_REASON, golden_as

pytestmark = pytest.mark.cpu

CUDA, TRITON = InputQuantRecipe.CUDA_DIVISION.value, InputQuantRecipe.TRITON_RECIPROCAL.value
COLMAJOR, BF16_STEPS = ActQuantRecipe.COLMAJOR.value, ActQuantRecipe.BF16_STEPS.value
# Two 128-column groups per token; fp32 scales: the two quantizers differ in most groups.
P = MoEProblem(tokens=16, hidden=256, intermediate=256, num_experts=4, topk=2, alignment=32)
LL = P.replace(topology="ep:2+ll")  # act_quant: colmajor and the low-latency bf16_steps


@functools.cache
def golden(problem: MoEProblem) -> object:
    """The golden trace of rank 0 (shared: comparisons never write to it, tests copy it)."""
    return ReferenceBackend().run(problem, make_inputs(problem), rank=0)


def as_recipe(trace: object, stage: str, recipe: str, declare: str | None = None) -> object:
    """A copy of the golden trace whose `stage` returns `recipe`'s outputs under the contract's
    names (and, with `declare`, declares that recipe), as a backend implementing it would."""
    out = clone_trace(trace)
    keys = out[stage]["recipe_outputs"][recipe]
    outputs = {name: out[stage][key].clone() for name, key in keys.items()}
    if declare is not None:
        outputs["recipe"] = declare
    return replace_stage(out, stage, outputs)


def with_outputs(trace: object, stage: str, **changes: object) -> object:
    outs = {k: v for k, v in trace[stage].items() if k not in ("recipe", "recipe_outputs")}
    return replace_stage(trace, stage, {**outs, **changes})


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int32)


# -- quant_input -------------------------------------------------------------------------------


def test_the_quantizers_differ_on_this_case() -> None:
    g = golden(P)[Stage.QUANT_INPUT]
    assert not torch.equal(bits(g["a1q_scale"]), bits(g["a1q_scale@triton_reciprocal"]))
    assert not torch.equal(bits(g["a1q"]), bits(g["a1q@triton_reciprocal"]))


@pytest.mark.parametrize(
    ("stage", "recipe"),
    [
        (Stage.QUANT_INPUT, CUDA),
        (Stage.QUANT_INPUT, TRITON),
        (Stage.GATHER, GatherRecipe.MUL_ADD.value),
        (Stage.GATHER, GatherRecipe.FMA.value),
    ],
)
@pytest.mark.parametrize("declared", [False, True])
def test_matching_a_recipe_passes_and_names_it(stage: str, recipe: str, declared: bool) -> None:
    # the gather's recipes differ only on cancelling sums (`cancelling`, below)
    g = cancelling(P) if stage == Stage.GATHER else golden(P)
    other = as_recipe(g, stage, recipe, recipe if declared else None)
    result = compare_stage(stage, g, other, P)
    assert result.status is Status.PASS, result.checks
    assert result.recipe == recipe
    assert recipe in result.checks[0].detail


def test_quant_input_declared_recipe_is_the_only_one_tried() -> None:
    # Declares the CUDA recipe, computes the Triton one: fails, against the declared recipe.
    g = golden(P)
    other = as_recipe(g, Stage.QUANT_INPUT, TRITON, declare=CUDA)
    result = compare_stage(Stage.QUANT_INPUT, g, other, P)
    assert result.status is Status.FAIL
    assert result.recipe == CUDA
    failed = {c.name for c in result.failed_checks}
    assert failed == {"a1q codes", "a1q_scale"}
    held = "against the declared recipe cuda_division"
    assert all(held in c.detail for c in result.failed_checks)
    assert all(c.worst is not None for c in result.failed_checks)
    scales = next(c for c in result.failed_checks if c.name == "a1q_scale")
    assert "1 fp32 ulp apart" in scales.detail  # 4 printed digits would show equal values


def test_quant_input_declaring_an_unknown_recipe_fails() -> None:
    g = golden(P)
    other = as_recipe(g, Stage.QUANT_INPUT, CUDA, declare="torch_native")
    result = compare_stage(Stage.QUANT_INPUT, g, other, P)
    assert result.status is Status.FAIL
    (check,) = result.checks
    assert check.name == "recipe" and check.reason == RECIPE_REASON
    assert "cuda_division, triton_reciprocal" in check.detail


def test_quant_input_wrong_quantizer_fails_against_the_closest_recipe() -> None:
    # Scales one fp32 ulp above the Triton recipe's in every group, the Triton codes: no recipe
    # explains the scales; the closest (Triton, whose codes match) is the one reported against.
    g = golden(P)
    other = as_recipe(g, Stage.QUANT_INPUT, TRITON)
    scale = other[Stage.QUANT_INPUT]["a1q_scale"]
    wrong = (bits(scale) + 1).view(torch.float32)
    other = with_outputs(other, Stage.QUANT_INPUT, a1q_scale=wrong)
    result = compare_stage(Stage.QUANT_INPUT, g, other, P)
    assert result.status is Status.FAIL and result.recipe is None
    assert [c.name for c in result.failed_checks] == ["a1q_scale"]
    scales = result.failed_checks[0]
    assert "no legitimate recipe matches; against the closest, triton_reciprocal" in scales.detail
    assert scales.worst is not None and scales.worst.column == 0


@pytest.mark.parametrize("fmt", ["float32_ceil_ue8m0", "ue8m0_packed"])
def test_quant_input_ue8m0_recipes_agree_and_both_are_named(fmt: str) -> None:
    p = P.replace(scale_fmt=fmt)
    g = golden(p)
    other = as_recipe(g, Stage.QUANT_INPUT, TRITON)
    result = compare_stage(Stage.QUANT_INPUT, g, other, p)
    assert result.status is Status.PASS and result.recipe == CUDA  # the golden's order
    also = (
        "triton_reciprocal gives"
        if fmt == "ue8m0_packed"
        else "triton_reciprocal, amax_reciprocal, amax_reciprocal_sm90_triton give"
    )
    assert f"{also} the same bits here" in result.checks[0].detail  # LMDeploy writes no packed


def test_quant_input_mxfp8_has_one_quantizer() -> None:
    p = P.replace(recipe="mxfp8", scale_fmt="ue8m0_packed")
    g = golden(p)
    plain = compare_stage(Stage.QUANT_INPUT, g, clone_trace(g), p)
    assert plain.status is Status.PASS and plain.recipe is None
    declared = with_outputs(clone_trace(g), Stage.QUANT_INPUT, recipe=TRITON)
    result = compare_stage(Stage.QUANT_INPUT, g, declared, p)
    assert result.status is Status.FAIL
    assert "has one implementation here" in result.checks[0].detail


def test_quant_input_recipe_entry_must_be_a_string() -> None:
    g = golden(P)
    other = with_outputs(clone_trace(g), Stage.QUANT_INPUT, recipe=3)
    result = compare_stage(Stage.QUANT_INPUT, g, other, P)
    assert result.status is Status.FAIL and result.checks[0].name == "contract"


# -- act_quant -----------------------------------------------------------------------------------


def test_act_quant_low_latency_recipe_passes_on_ll_and_is_named() -> None:
    g = golden(LL)
    for declare in (None, BF16_STEPS):
        other = as_recipe(g, Stage.ACT_QUANT, BF16_STEPS, declare)
        result = compare_stage(Stage.ACT_QUANT, g, other, LL)
        assert result.status is Status.PASS, result.checks
        assert result.recipe == BF16_STEPS


def test_act_quant_declared_colmajor_computing_bf16_steps_fails() -> None:
    g = golden(LL)
    other = as_recipe(g, Stage.ACT_QUANT, BF16_STEPS, declare=COLMAJOR)
    result = compare_stage(Stage.ACT_QUANT, g, other, LL)
    assert result.status is Status.FAIL and result.recipe == COLMAJOR
    flips = next(c for c in result.checks if c.name == "scale flips")
    assert not flips.passed and flips.worst is not None and flips.worst.token is not None


def test_act_quant_bf16_steps_does_not_apply_off_the_low_latency_path() -> None:
    # The contiguous layout's golden has no bf16_steps: its outputs there are a bug.
    g_ll = golden(LL)
    g = golden(P)
    assert BF16_STEPS not in g[Stage.ACT_QUANT]["recipe_outputs"]
    other = as_recipe(g_ll, Stage.ACT_QUANT, BF16_STEPS, declare=BF16_STEPS)
    assert compare_stage(Stage.ACT_QUANT, g_ll, other, LL).status is Status.PASS
    declared = with_outputs(clone_trace(g), Stage.ACT_QUANT, recipe=BF16_STEPS)
    result = compare_stage(Stage.ACT_QUANT, g, declared, P)
    assert result.status is Status.FAIL and result.checks[0].name == "recipe"


def test_act_quant_wrong_scales_fail_against_the_closest_recipe() -> None:
    g = golden(LL)
    other = as_recipe(g, Stage.ACT_QUANT, BF16_STEPS)
    scale = other[Stage.ACT_QUANT]["a2q_scale"]
    other = with_outputs(other, Stage.ACT_QUANT, a2q_scale=scale * 1.5)
    result = compare_stage(Stage.ACT_QUANT, g, other, LL)
    assert result.status is Status.FAIL and result.recipe is None
    assert any("closest, bf16_steps" in c.detail for c in result.failed_checks)


# TensorRT-LLM's act_quant on packed UE8M0 problems: colmajor's roundings, ceil scales, packed.
CEIL_PACKED, PACKED = ActQuantRecipe.COLMAJOR_CEIL_PACKED.value, ActQuantRecipe.PACKED.value
PACKED_P = P.replace(scale_fmt="ue8m0_packed")


@pytest.mark.parametrize("declare", [None, CEIL_PACKED])
def test_act_quant_ceil_packed_passes_on_a_packed_problem_and_is_named(declare: str | None) -> None:
    g = golden(PACKED_P)
    assert list(g[Stage.ACT_QUANT]["recipe_outputs"]) == [PACKED, "packed_sm90_triton", CEIL_PACKED]
    other = as_recipe(g, Stage.ACT_QUANT, CEIL_PACKED, declare)
    assert other[Stage.ACT_QUANT]["a2q_scale"].dtype == torch.int32
    result = compare_stage(Stage.ACT_QUANT, g, other, PACKED_P)
    assert result.status is Status.PASS, result.checks
    assert result.recipe == CEIL_PACKED
    assert CEIL_PACKED in result.checks[0].detail


def test_act_quant_ceil_packed_is_not_the_packed_recipe() -> None:
    # Held to vLLM's packed recipe alone (as before it was listed), the same outputs fail: the
    # bf16 rounding after silu moves codes in more than the 0.1% the packed check allows.
    g = golden(PACKED_P)
    other = as_recipe(g, Stage.ACT_QUANT, CEIL_PACKED, declare=PACKED)
    result = compare_stage(Stage.ACT_QUANT, g, other, PACKED_P)
    assert result.status is Status.FAIL and result.recipe == PACKED
    assert "code fraction" in {c.name for c in result.failed_checks}


def test_act_quant_floor_instead_of_ceil_matches_no_recipe() -> None:
    # TensorRT-LLM's arithmetic with the scale rounded down: where amax / 448 is not a power of
    # two (every group but a rare exact one) the scale is half the ceil's, the top codes clip.
    g = golden(PACKED_P)
    q, s = silu_and_mul_ceil_packed(g[Stage.GEMM1]["mm1"], ceil=False)
    other = with_outputs(clone_trace(g), Stage.ACT_QUANT, a2q=q, a2q_scale=s)
    result = compare_stage(Stage.ACT_QUANT, g, other, PACKED_P)
    assert result.status is Status.FAIL and result.recipe is None
    flips = next(c for c in result.failed_checks if c.name == "scale flips")
    assert "no legitimate recipe matches; against the closest" in flips.detail
    assert flips.worst is not None and flips.worst.token is not None


def test_act_quant_chained_names_the_recipe_too() -> None:
    g = golden(LL)
    other = as_recipe(g, Stage.ACT_QUANT, BF16_STEPS)
    result = compare_stage(Stage.ACT_QUANT, g, other, LL, mode=Mode.CHAINED)
    assert result.status is Status.PASS and result.recipe == BF16_STEPS


# -- a chained permute after another legitimate quantization -------------------------------------


@pytest.mark.parametrize("problem", [P, LL], ids=["permute", "dispatch"])
def test_chained_copy_stage_follows_the_matched_quantizer(problem: MoEProblem) -> None:
    """The tested side quantized with the Triton recipe and its permute copied those bytes:
    chained, the copy is compared against the golden permute of the Triton recipe's rows."""
    g = golden(problem)
    stage = Stage.DISPATCH if problem.topology.kind.value == "ep+ll" else Stage.PERMUTE
    triton = g[Stage.QUANT_INPUT]["recipe_outputs"][TRITON]
    rebound = golden_as(g, Stage.QUANT_INPUT, triton)
    # the tested side's own chain: the golden's permute / dispatch run on the Triton quantization
    backend = ReferenceBackend()
    inputs = make_inputs(problem)
    copied = run_one_stage(backend, stage, problem, inputs, rebound.upto(stage), 0)
    other = replace_stage(as_recipe(g, Stage.QUANT_INPUT, TRITON), stage, copied)
    assert compare_stage(stage, g, other, problem, mode=Mode.CHAINED).status is Status.PASS
    # Isolated, that permute fed the golden's (CUDA) rows and must copy those: it fails.
    assert compare_stage(stage, g, other, problem, mode=Mode.ISOLATED).status is Status.FAIL
    # A chained permute that copied the golden's CUDA bytes after a Triton quant_input fails.
    stale = replace_stage(as_recipe(g, Stage.QUANT_INPUT, TRITON), stage, dict(g[stage]))
    result = compare_stage(stage, g, stale, problem, mode=Mode.CHAINED)
    assert result.status is Status.FAIL
    assert {c.name for c in result.failed_checks} >= {"a_perm rows", "a_scale_perm rows"}


# -- gather ------------------------------------------------------------------------------------

MUL_ADD, FMA = GatherRecipe.MUL_ADD.value, GatherRecipe.FMA.value


@functools.cache
def cancelling(problem: MoEProblem) -> object:
    """The golden trace with each token's second slot's mm2 row set to cancel its first
    (x1 = bf16(-x0 * w0 / w1)), so the sums are tiny residues: where `acc += x * w` rounds the
    product (mul_add) or not (fma) then decides many bf16 ulps of the result, as on the H200 with
    SGLang's gather (docs/tolerance.md#gather-recipes). The gather recomputed by the golden."""
    g = clone_trace(golden(problem))
    inv, w = g[Stage.PERMUTE]["inv_perm"].long(), g[Stage.ROUTE]["topk_weights"]
    mm2 = g[Stage.GEMM2]["mm2"].clone()
    mm2[inv[:, 1]] = (-mm2[inv[:, 0]].float() * w[:, :1] / w[:, 1:2]).to(mm2.dtype)
    g = replace_stage(g, Stage.GEMM2, {**g[Stage.GEMM2], "mm2": mm2})
    outs = ReferenceBackend().gather(StageContext(problem, make_inputs(problem), g, 0))
    return replace_stage(g, Stage.GATHER, outs)


def test_the_gather_recipes_differ_by_many_ulps_on_cancelling_sums() -> None:
    g = cancelling(P)[Stage.GATHER]
    assert bool((g["out"] != g["out@fma"]).any())
    # fed to the comparison, the golden's own two recipes are more than the 1 ulp apart that one
    # rounding allows: without the fma recipe a GPU-compiled gather would fail
    other = with_outputs(cancelling(P), Stage.GATHER, out=g["out@fma"].clone(), recipe=MUL_ADD)
    assert compare_stage(Stage.GATHER, cancelling(P), other, P).status is Status.FAIL


def test_a_gather_summing_k_in_reverse_order_matches_no_recipe() -> None:
    g = cancelling(P)
    inv, ids = g[Stage.PERMUTE]["inv_perm"], g[Stage.ROUTE]["topk_ids"]
    w = g[Stage.ROUTE]["topk_weights"]
    reverse = gather(g[Stage.GEMM2]["mm2"], ids.flip(1), w.flip(1), inv.flip(1), recipe=FMA)
    result = compare_stage(Stage.GATHER, g, with_outputs(g, Stage.GATHER, out=reverse), P)
    assert result.status is Status.FAIL
    assert "no legitimate recipe matches" in result.checks[0].detail


def test_the_fma_gather_rounds_each_step_once() -> None:
    # 1 + x * w = eps with 0 < |eps| < 2^-24: rounded apart, the product is -1 and the sum 0;
    # fused, the sum is eps exactly (then rounded to bf16).
    x = torch.tensor([[1.0], [-(1.0 + 2.0**-7)]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1.0 / (1.0 + 2.0**-7)]], dtype=torch.float32)
    ids, inv = torch.tensor([[0, 1]]), torch.tensor([[0, 1]])
    eps = float(x[1].double()) * float(w[0, 1].double()) + 1.0
    assert eps != 0.0 and abs(eps) < 2.0**-24
    assert gather(x, ids, w, inv, recipe=MUL_ADD).item() == 0.0
    fused = gather(x, ids, w, inv, recipe=FMA)
    assert fused.item() == torch.tensor(eps, dtype=torch.float32).to(torch.bfloat16).item() != 0


# -- routed scaling: the factor in the route's weights, or on the gather's sum -------------------

ON_OUTPUT = RoutedScalingRecipe.SCALE_ON_OUTPUT.value
# DeepSeek-V3's routing, two groups of two experts, factor 2.5 (not a power of two: the readings
# round differently)
GROUPED = P.replace(routing="grouped", num_expert_group=2, topk_group=2, routed_scaling_factor=2.5)


def on_output_route(trace: object, weights: str = "topk_weights@scale_on_output") -> object:
    """A copy of `trace` whose route declares scale_on_output and returns the golden's
    `weights` (its unscaled ones unless told), as SGLang's route does."""
    route = trace[Stage.ROUTE]
    outputs = {"topk_ids": route["topk_ids"].clone(), "topk_weights": route[weights].clone()}
    return replace_stage(clone_trace(trace), Stage.ROUTE, {**outputs, "recipe": ON_OUTPUT})


def test_the_routed_scaling_readings_differ_by_many_ulps_on_cancelling_sums() -> None:
    g = cancelling(GROUPED)[Stage.GATHER]
    assert g["routed_scaling_recipes"][ON_OUTPUT] == {
        MUL_ADD: f"{MUL_ADD}+{ON_OUTPUT}",
        FMA: f"{FMA}+{ON_OUTPUT}",
    }
    ulps = (g["out"].view(torch.int16) - g[f"out@{MUL_ADD}+{ON_OUTPUT}"].view(torch.int16)).abs()
    assert int(ulps.max()) > 1


@pytest.mark.parametrize("rounding", [MUL_ADD, FMA])
def test_a_scale_on_output_gather_is_judged_in_its_routes_reading(rounding: str) -> None:
    g = cancelling(GROUPED)
    out = g[Stage.GATHER][f"out@{rounding}+{ON_OUTPUT}"].clone()
    declared = with_outputs(on_output_route(g), Stage.GATHER, out=out)
    result = compare_stage(Stage.GATHER, g, declared, GROUPED)
    assert result.status is Status.PASS, result.checks
    assert result.recipe == f"{rounding}+{ON_OUTPUT}"
    # the same gather under a route in the golden's own reading: judged against the scaled
    # weights' sums, where cancelling residues round many ulps apart
    undeclared = with_outputs(g, Stage.GATHER, out=out)
    assert compare_stage(Stage.GATHER, g, undeclared, GROUPED).status is Status.FAIL


def test_a_declared_plain_gather_recipe_is_read_in_the_routes_reading() -> None:
    g = cancelling(GROUPED)
    out = g[Stage.GATHER][f"out@{FMA}+{ON_OUTPUT}"].clone()
    fma = with_outputs(on_output_route(g), Stage.GATHER, out=out, recipe=FMA)
    result = compare_stage(Stage.GATHER, g, fma, GROUPED)
    assert result.status is Status.PASS, result.checks
    assert result.recipe == f"{FMA}+{ON_OUTPUT}"
    mul_add = with_outputs(on_output_route(g), Stage.GATHER, out=out, recipe=MUL_ADD)
    assert compare_stage(Stage.GATHER, g, mul_add, GROUPED).status is Status.FAIL


def test_a_declared_route_reading_is_held_to_its_weights() -> None:
    g = golden(GROUPED)
    result = compare_stage(Stage.ROUTE, g, on_output_route(g), GROUPED)
    assert result.status is Status.PASS, result.checks
    assert result.recipe == ON_OUTPUT
    scaled = on_output_route(g, weights="topk_weights")  # declared, but the scaled weights
    result = compare_stage(Stage.ROUTE, g, scaled, GROUPED)
    assert result.status is Status.FAIL
    assert {c.name for c in result.failed_checks} == {"topk_weights"}
    assert "against the declared recipe scale_on_output" in result.failed_checks[0].detail
    # unscaled weights without the declaration: the golden's own (scaled) reading, failed
    plain = replace_stage(clone_trace(g), Stage.ROUTE, {
        "topk_ids": g[Stage.ROUTE]["topk_ids"].clone(),
        "topk_weights": g[Stage.ROUTE]["topk_weights@scale_on_output"].clone(),
    })  # fmt: skip
    assert compare_stage(Stage.ROUTE, g, plain, GROUPED).status is Status.FAIL
