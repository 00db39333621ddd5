"""Which legitimate recipes apply to a problem's stages, and how the golden's trace carries them.

A stage with several correct implementations (docs/tolerance.md#legitimate-recipes) is computed by
the golden once per recipe that applies to the problem. The trace holds the first recipe's outputs
under the contract's names (what the golden's later stages consume) and every recipe's outputs under
`name@recipe`, listed by the host entry "recipe_outputs" {recipe: {name: trace key}} (the comparison
reads only that map, so the naming stays here) and named by "recipe" (the golden's own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from moe_verify.spec import (
    ROUTER_WEIGHT_OUTPUTS,
    Activation,
    ActQuantRecipe,
    GatherRecipe,
    InputQuantRecipe,
    MoEProblem,
    Recipe,
    RoutedScalingRecipe,
    RouterWeight,
    ScaleFmt,
)
from reference.activation import (
    fused_act_quant_recipe,
    sglang_sm90_cuda_recipe,
    sm90_triton_recipe,
)

__all__ = [
    "act_quant_recipes",
    "gather_recipes",
    "gather_reading_recipes",
    "input_quant_recipes",
    "recipe_outputs",
    "routed_scaling_recipes",
    "router_weight_outputs",
]

# The one act_quant group size the low-latency CUDA kernel takes, and TensorRT-LLM's packing one
# (its word loop steps by 128 columns).
_BF16_STEPS_GROUP = _TRTLLM_GROUP = 128


def input_quant_recipes(problem: MoEProblem) -> tuple[InputQuantRecipe, ...]:
    """quant_input's recipes, the golden's own first: both of vLLM's 1 x 128 quantizers for
    fp8_block and mxfp4_w4a8 activations in every scale format and topology (the UE8M0 packed
    variant is the CUDA recipe, and packing is a layout step); LMDeploy's (amax_reciprocal, and
    its twin compiled for an H200, amax_reciprocal_sm90_triton) in the fp32 formats it writes;
    SGLang's JIT CUDA one on an H200 (fast_reciprocal_sm90_cuda) with float32 scales; none for
    mxfp8, whose one quantizer (FlashInfer's) has no alternative."""
    if problem.recipe is Recipe.MXFP8:
        return ()
    vllm = (InputQuantRecipe.CUDA_DIVISION, InputQuantRecipe.TRITON_RECIPROCAL)
    if problem.scale_fmt is ScaleFmt.UE8M0_PACKED:
        return vllm
    lmdeploy = (InputQuantRecipe.AMAX_RECIPROCAL, InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON)
    if problem.scale_fmt is ScaleFmt.FLOAT32:
        return (*vllm, *lmdeploy, InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA)
    return (*vllm, *lmdeploy)


def _plain_silu(activation: Activation) -> bool:
    return activation.kind == "silu" and activation.limit is None


def act_quant_recipes(problem: MoEProblem) -> tuple[ActQuantRecipe, ...]:
    """act_quant's recipes, the golden's own first: the fused Triton kernel of the scale format
    (packed or colmajor); its twin with the gate the H200's Triton computes (packed_sm90_triton /
    colmajor_sm90_triton), where a recorded table applies to the activation (else none, silently:
    `sm90_triton_recipe`); with fp32 scales LMDeploy's (colmajor_amax_reciprocal, and its twin
    compiled for an H200 where the gate table applies); with float32
    scales and silu SGLang's on an H200 (packed_fast_reciprocal_sm90_cuda, where
    `sglang_sm90_cuda_recipe` models it); with packed UE8M0 scales, plain silu and
    128-column groups TensorRT-LLM's silu_and_mul_masked_post_quant_fwd (colmajor_ceil_packed); on
    the batched low-latency layout (ep:N+ll) also vLLM's CUDA kernel
    persistent_masked_m_silu_mul_quant (bf16_steps), which takes plain silu with 128-column
    groups only."""
    fused = fused_act_quant_recipe(problem.scale_fmt)
    recipes = [fused]
    hardware = sm90_triton_recipe(fused, problem.activation)
    if hardware is not None:
        recipes.append(hardware)
    if fused is ActQuantRecipe.COLMAJOR:
        lmdeploy = ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL
        recipes.append(lmdeploy)
        lmdeploy_sm90 = sm90_triton_recipe(lmdeploy, problem.activation)
        if lmdeploy_sm90 is not None:
            recipes.append(lmdeploy_sm90)
    sglang = sglang_sm90_cuda_recipe(problem.activation, problem.scale_fmt)
    if sglang is not None:
        recipes.append(sglang)
    if (
        fused is ActQuantRecipe.PACKED
        and _plain_silu(problem.activation)
        and problem.recipe.act_group == _TRTLLM_GROUP
    ):
        recipes.append(ActQuantRecipe.COLMAJOR_CEIL_PACKED)
    if (
        problem.batched
        and _plain_silu(problem.activation)
        and problem.recipe.act_group == _BF16_STEPS_GROUP
    ):
        recipes.append(ActQuantRecipe.BF16_STEPS)
    return tuple(recipes)


def gather_recipes(problem: MoEProblem) -> tuple[GatherRecipe, ...]:
    """gather's recipes, the golden's own first: the product and the sum rounded apart (mul_add),
    and one FMA per step (fma), as a GPU compiles `acc += x * w`; both apply to every problem."""
    return (GatherRecipe.MUL_ADD, GatherRecipe.FMA)


def routed_scaling_recipes(problem: MoEProblem) -> tuple[RoutedScalingRecipe, ...]:
    """The route's readings of routed_scaling_factor, the golden's own first: the factor in the
    route's weights (scale_in_routing) and on the gather's fp32 sum (scale_on_output), where
    the problem has a factor other than 1 (grouped routing only, moe_verify/spec/routing.py);
    none otherwise, where the two readings are the same numbers, and none where the weight is
    applied on the input (MoEProblem.router_weight): the factor then travels in the weight
    multiplied into the input, and a sum times the factor would apply it twice."""
    if problem.routed_scaling_factor == 1.0 or problem.router_weight is RouterWeight.INPUT:
        return ()
    return (RoutedScalingRecipe.SCALE_IN_ROUTING, RoutedScalingRecipe.SCALE_ON_OUTPUT)


def gather_reading_recipes(problem: MoEProblem) -> dict[str, dict[str, str]]:
    """The gather's recipe names per routed-scaling reading, {reading: {gather recipe: name}}:
    the golden's own reading under the plain gather recipe names (mul_add, fma: as without a
    factor), the other under "<gather recipe>+<reading>" (fma+scale_on_output). Empty where
    the problem has one reading (`routed_scaling_recipes`)."""
    readings = routed_scaling_recipes(problem)
    return {
        str(reading): {
            str(r): str(r) if n == 0 else f"{r}+{reading}" for r in gather_recipes(problem)
        }
        for n, reading in enumerate(readings)
    }


def recipe_outputs(
    by_recipe: Mapping[str, Sequence[Tensor]], names: Sequence[str]
) -> dict[str, object]:
    """One stage's outputs from each recipe's tensors (in `names` order), the first recipe's
    under the plain names, every other under `name@recipe`; plus "recipe" (the first) and
    "recipe_outputs" {recipe: {name: trace key}}."""
    out: dict[str, object] = {}
    keys: dict[str, dict[str, str]] = {}
    for n, (recipe, tensors) in enumerate(by_recipe.items()):
        recipe = str(recipe)
        keys[recipe] = {name: name if n == 0 else f"{name}@{recipe}" for name in names}
        for name, tensor in zip(names, tensors, strict=True):
            out[keys[recipe][name]] = tensor
    out["recipe"] = next(iter(keys))
    out["recipe_outputs"] = keys
    return out


def router_weight_outputs(convention: RouterWeight, outputs: Mapping[str, object]) -> dict:
    """quant_input's `outputs` computed in the router-weight `convention` the problem does not
    follow, beside the stage's own: each tensor under "<key>@router_weight_<convention>", and the
    host entry ROUTER_WEIGHT_OUTPUTS {convention: {key: that key}}. Its other recipes are the
    stage's own, so "recipe" and "recipe_outputs" read the same; the comparison binds the keys to
    name a quant_input that matches them (tolerance/stages/router_weight.py)."""
    convention = RouterWeight(convention)
    keys = {
        k: f"{k}@router_weight_{convention.value}"
        for k, v in outputs.items()
        if isinstance(v, Tensor)
    }
    return {
        **{keys[k]: outputs[k] for k in keys},
        ROUTER_WEIGHT_OUTPUTS: {convention.value: keys},
    }
