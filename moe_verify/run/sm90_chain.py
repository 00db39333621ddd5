"""The golden a tested GEMM is held to bit for bit on SM90 (docs/tolerance.md "Zero tolerance on
SM90"): which stages get the golden's tensor-core recipe (`gemm_recipe_applies`), the golden's
SM90 chain a chained run is held to (`with_sm90_chain`), and the recipe a tested act_quant with
the recorded H200 gate is declared as (`declare_hardware_gate`).

Each choice is made after the tested side ran, because the tested stage says what ran it (its
engine, declared recipe, gate provenance) and where (`sm90_device`).
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    GEMM_OUTPUT,
    Backend,
    Engine,
    GemmRecipe,
    MoEInputs,
    MoEProblem,
    Recipe,
    RoutedScalingRecipe,
    ScaleFmt,
    Stage,
    Trace,
    is_sm90,
)
from reference.activation import fused_act_quant_recipe, sm90_triton_recipe
from reference.hardware.gate_table import gate_table_provenance
from reference.moe import ReferenceBackend
from reference.recipes import act_quant_recipes
from tolerance.stages.recipes import (
    HARDWARE_ACT_RECIPES,
    golden_recipes,
    route_reading,
    same_bits,
)
from tolerance.stages.slots import slot_order

# The scale formats DeepGEMM's SM90 FP8 GEMM reads (fp32 scales; ceil-UE8M0 ones are fp32 too).
_SM90_FORMATS = (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)


def sm90_device(t: torch.Tensor) -> bool:
    """The tensor lies on an SM90 (Hopper) GPU (moe_verify/spec/arch.py `is_sm90`): the one place
    that decides whether a GEMM's output came from SM90 hardware."""
    return t.is_cuda and is_sm90(t.device)


def check_gemm_recipe(problem: MoEProblem, gemm_recipe: GemmRecipe | None) -> None:
    """A ValueError where an explicit tensor_core cannot apply to `problem` (not the SM90
    fp8_block recipe with fp32 or ceil-UE8M0 scales); the value itself is RunOptions'
    (moe_verify/run/options.py)."""
    if gemm_recipe is GemmRecipe.TENSOR_CORE:
        if problem.recipe is not Recipe.FP8_BLOCK or problem.scale_fmt not in _SM90_FORMATS:
            raise ValueError(
                f"gemm_recipe tensor_core models SM90's fp8_block GEMM with fp32 or ceil-UE8M0 "
                f"scales, got recipe {problem.recipe}, scale format {problem.scale_fmt}"
            )


def gemm_recipe_applies(
    problem: MoEProblem, tested: Trace, stage: str, gemm_recipe: GemmRecipe | str | None
) -> bool:
    """Whether `stage` (gemm1 or gemm2) of `tested` is held to the tensor-core recipe: asked for
    (gemm_recipe tensor_core), or automatically (None) where the tested stage reports engine
    "deepgemm" or declares the recipe (the suite's Triton engine compiled for SM90 promotes as
    DeepGEMM does) and its output lies on an SM90 GPU (`sm90_device`), for fp8_block with fp32
    or ceil-UE8M0 scales; never for gemm_recipe fp32_dequant, nor where the stage did not run."""
    recipe = GemmRecipe(gemm_recipe) if gemm_recipe is not None else None
    if recipe is GemmRecipe.FP32_DEQUANT or stage not in tested or tested.failure(stage):
        return False
    if problem.recipe is not Recipe.FP8_BLOCK or problem.scale_fmt not in _SM90_FORMATS:
        return False
    if recipe is GemmRecipe.TENSOR_CORE:
        return True
    out = tested[stage].get(GEMM_OUTPUT[stage])
    engine, declared = tested[stage].get("engine"), tested[stage].get("recipe")
    model = engine == Engine.DEEPGEMM or declared == GemmRecipe.TENSOR_CORE
    return model and isinstance(out, torch.Tensor) and sm90_device(out)


def with_gemm_recipe(
    problem: MoEProblem,
    inputs: MoEInputs,
    golden: Backend,
    golden_trace: Trace,
    tested: Trace,
    gemm_recipe: GemmRecipe | str | None,
) -> Trace:
    """The golden trace with the tensor-core recipe added to each GEMM stage it applies to
    (`gemm_recipe_applies`), computed only then: the model costs 10-100x the fp32 GEMM. It runs
    after the tested side because the tested stage says which engine ran it; the comparison then
    holds that stage bit for bit to the recipe (tolerance/stages/bounded.py `gemm_checks`)."""
    reference = golden if isinstance(golden, ReferenceBackend) else ReferenceBackend()
    for stage in GEMM_OUTPUT:
        if stage in golden_trace and gemm_recipe_applies(problem, tested, stage, gemm_recipe):
            golden_trace = reference.with_tensor_core(problem, inputs, golden_trace, stage)
    return golden_trace


def declare_hardware_gate(problem: MoEProblem, tested: Trace) -> None:
    """Declare, for a tested act_quant that declares no recipe itself, the recipe whose gate is
    the recorded H200 table (reference/hardware/gate_table.py), where the stage reports it computed
    its gate as that table was recorded: compiled by the same Triton version on a GPU of the same
    compute capability ("gate_triton", "gate_capability"; optimized/kernels/act_quant.py
    `gate_source`), and the problem has that recipe. The stage is then held to it bit for bit
    (tolerance/stages/recipes.py `hardware_check`). Anything else (another Triton, the interpreter,
    someone else's kernel) keeps the matcher and its bounds."""
    if Stage.ACT_QUANT not in tested or tested.failure(Stage.ACT_QUANT) is not None:
        return
    outs = tested[Stage.ACT_QUANT]
    if outs.get("recipe") is not None or not table_gate(outs):
        return
    twin = sm90_triton_recipe(fused_act_quant_recipe(problem.scale_fmt), problem.activation)
    if twin is not None and twin in act_quant_recipes(problem):
        outs["recipe"] = twin.value


def table_gate(outs: dict) -> bool:
    """A stage's outputs say its gate was computed as the recorded H200 table was: by the same
    Triton version on a GPU of the same compute capability (optimized/kernels/act_quant.py
    `gate_source`)."""
    table = gate_table_provenance()
    facts = (outs.get("gate_triton"), outs.get("gate_capability"))
    return "gate_triton" in outs and facts == (table.get("triton"), table.get("capability"))


def sm90_shared(tested: Trace) -> bool:
    """The tested shared experts ran as SM90 computes them: both GEMMs declare the tensor-core
    recipe, on an SM90 GPU, and the gate is the table's (`table_gate`)."""
    if Stage.SHARED not in tested or tested.failure(Stage.SHARED) is not None:
        return False
    outs = tested[Stage.SHARED]
    out = outs.get("out")
    declared = outs.get("recipe") == GemmRecipe.TENSOR_CORE
    return declared and table_gate(outs) and isinstance(out, torch.Tensor) and sm90_device(out)


def with_sm90_chain(
    problem: MoEProblem,
    inputs: MoEInputs,
    golden: Backend,
    golden_trace: Trace,
    tested: Trace,
    gemm_recipe: GemmRecipe | str | None,
) -> Trace | None:
    """The golden's SM90 chain (reference/moe.py `sm90_chain`) that a chained `tested` run is
    held to bit for bit, or None (compared against `golden_trace` with the chained bounds).

    Automatically (gemm_recipe None) where both tested GEMMs are held to the tensor-core recipe
    (`gemm_recipe_applies`) and the tested act_quant declares a recipe with the H200's Triton
    gate that the problem has: the chain is then defined to the bit, and the golden computes it
    with that recipe. Asked for (tensor_core), with any legitimate act_quant recipe the tested
    stage declares. A tested act_quant that declares none keeps the chained bounds either way:
    the chain's gemm2 would read one recipe's a2q while the matcher could pass the stage on
    another. The shared experts join the chain where they ran as SM90 computes them
    (`sm90_shared`), else keep their bounds. Only after the tested run, which says what ran."""
    recipe = GemmRecipe(gemm_recipe) if gemm_recipe is not None else None
    if recipe is GemmRecipe.FP32_DEQUANT or Stage.GEMM2 not in golden_trace:
        return None
    if any(not gemm_recipe_applies(problem, tested, s, gemm_recipe) for s in GEMM_OUTPUT):
        return None
    legit = act_quant_recipes(problem)
    declared = tested[Stage.ACT_QUANT].get("recipe") if Stage.ACT_QUANT in tested else None
    act = next((r for r in legit if r == declared), None)
    if act is None or (recipe is None and act not in HARDWARE_ACT_RECIPES):
        return None  # the chain's gemm2 reads the act_quant recipe the tested stage computes
    if not same_quantized_input(golden_trace, tested):
        return None  # another legitimate quant_input recipe: the chain would start elsewhere
    reference = golden if isinstance(golden, ReferenceBackend) else ReferenceBackend()
    slots, weights = legitimately_other_route(golden_trace, tested)
    shared = sm90_shared(tested)
    reading = route_reading(golden_trace, tested)
    reading = RoutedScalingRecipe(reading) if reading is not None else None
    return reference.sm90_chain(problem, inputs, golden_trace, act, slots, weights, shared, reading)


def same_quantized_input(golden: Trace, tested: Trace) -> bool:
    """The tested quant_input's codes and scales are bit for bit the golden's own recipe's, so
    the golden's SM90 chain starts from the operands the tested GEMMs read. (A tested quant
    that matches another legitimate recipe keeps the chained bounds.)"""
    if tested.failure(Stage.QUANT_INPUT) is not None:
        return False
    g, t = golden[Stage.QUANT_INPUT], tested[Stage.QUANT_INPUT]
    return all(
        isinstance(t.get(name), torch.Tensor) and same_bits(t[name].to(g[name].device), g[name])
        for name in ("a1q", "a1q_scale")
    )


def legitimately_other_route(
    golden: Trace, tested: Trace
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(slots, weights) for the SM90 chain's gather, from a tested route that routes every
    token to the golden's experts but is not bit for bit the golden's route: `slots` (the
    golden's slot of each tested slot, tolerance/stages/slots.py `slot_order`) where some token
    lists its experts in another order, `weights` (the tested ones) where they are not the golden's
    bit for bit once in the same order (the golden's weights in the routed-scaling reading the
    tested route declares, `route_reading`: its unscaled ones for scale_on_output, which the
    chain's gather then reads in that reading). Both are legitimate: the order inside a token is not
    semantic, and each side renormalizes in its own sum order (a few ulps, which the route check
    bounds: tolerance/policy.py `renormalized_weight_ulps`). (None, None) where the route is the
    golden's, or routes elsewhere (the route check then fails, and names the stage)."""
    if tested.failure(Stage.ROUTE) is not None:
        return None, None
    g, t = golden[Stage.ROUTE], tested[Stage.ROUTE]
    ids, weights = t.get("topk_ids"), t.get("topk_weights")
    reading = route_reading(golden, tested)  # the golden's weights in the tested route's reading
    key = golden_recipes(golden, Stage.ROUTE)[reading]["topk_weights"] if reading else None
    g_ids, g_weights = g["topk_ids"], g[key or "topk_weights"]
    if not isinstance(ids, torch.Tensor) or not isinstance(weights, torch.Tensor):
        return None, None
    if ids.shape != g_ids.shape or weights.shape != g_weights.shape:
        return None, None
    ids, weights = ids.to(g_ids.device).long(), weights.to(g_weights.device)
    slots = slot_order(g_ids, ids)
    if not torch.equal(g_ids.long().gather(1, slots), ids):
        return None, None
    in_order = bool((slots == torch.arange(ids.shape[1], device=ids.device)).all())
    same = same_bits(weights, g_weights.gather(1, slots))
    return (None if in_order else slots), (None if same else weights)
