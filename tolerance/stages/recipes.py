"""Stages with several legitimate recipes (docs/tolerance.md#legitimate-recipes): the tested side is
compared against each recipe the golden computed for the problem, passes when one matches, and the
result names it.

The golden's stage lists its recipes in the host entry "recipe_outputs" {recipe: {name: trace
key}} (reference/recipes.py). A tested stage may declare the recipe it implements (its host entry
"recipe", moe_verify.spec.Trace); it is then compared against that recipe alone. Otherwise every
recipe is tried with the stage's own checks, and the one that passes (the closest one when none
does) is reported. A bitwise stage stays bitwise: each recipe is compared exactly, never a
tolerance that spans two of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moe_verify.spec import ActQuantRecipe, GemmRecipe, Mode, Stage, Trace
from tolerance.policy import ACT_QUANT_BITWISE, GATHER_BITWISE, SHARED_BITWISE, Check
from tolerance.results import CheckResult, ContractError
from tolerance.stages.context import Ctx, tensor_of

RECIPE_REASON = (
    "a stage with several legitimate recipes matches one the golden models for this problem; a "
    "declared recipe is checked against that one alone (docs/tolerance.md#legitimate-recipes)"
)

# One recipe's comparison: the stage's checks and how far the tested side is from that recipe
# (what differs bit for bit, counted in DISTANCE_UNITS; 0 when it matches).
Comparer = Callable[[Ctx], tuple[list[CheckResult], float]]
# What a stage's Comparer counts as its distance from a recipe.
DISTANCE_UNITS: dict[Stage, str] = {
    Stage.ROUTE: "failed checks",
    Stage.QUANT_INPUT: "codes and scale groups",
    Stage.ACT_QUANT: "codes and scale groups",
    Stage.GATHER: "bf16 output elements",
    Stage.SHARED: "bf16 output elements",
    Stage.REDUCE: "bf16 output elements",
}


# The act_quant recipes computed as an H200 computes them, from recorded tables
# (reference/hardware/gate_table.py, reference/hardware/quotient_table.py): held bit for
# bit where declared.
HARDWARE_ACT_RECIPES = frozenset(
    {
        ActQuantRecipe.PACKED_SM90_TRITON.value,
        ActQuantRecipe.COLMAJOR_SM90_TRITON.value,
        ActQuantRecipe.PACKED_FAST_RECIPROCAL_SM90_CUDA.value,
        ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON.value,
    }
)


def sm90_chain(golden: Trace) -> bool:
    """The golden trace is its SM90 chain (reference/moe.py `sm90_chain`): its gemm1's own
    recipe is the tensor core's."""
    return Stage.GEMM1 in golden and golden[Stage.GEMM1].get("recipe") == GemmRecipe.TENSOR_CORE


def hardware_check(stage: str, golden: Trace, other: Trace, mode: Mode, check: Check) -> Check:
    """The stage's Check where the golden computed the hardware's own recipe (zero tolerance on
    SM90, docs/tolerance.md#zero-tolerance-on-sm90), else `check`: chained against the golden's
    SM90 chain, act_quant, the gather and (where the chain computed them as SM90 does) the shared
    experts bit for bit (the GEMMs' verdict is bitwise through `tensor_core_keys`); isolated,
    act_quant bit for bit where the tested stage declares a recipe with the H200's Triton gate."""
    chain = mode is Mode.CHAINED and sm90_chain(golden)
    if stage == Stage.ACT_QUANT and Stage.ACT_QUANT in other:
        declared = other[Stage.ACT_QUANT].get("recipe")
        if chain or (mode is Mode.ISOLATED and declared in HARDWARE_ACT_RECIPES):
            return ACT_QUANT_BITWISE
    if stage == Stage.GATHER and chain:
        return GATHER_BITWISE
    if stage == Stage.SHARED and chain and Stage.SHARED in golden:
        if golden[Stage.SHARED].get("recipe") == GemmRecipe.TENSOR_CORE:
            return SHARED_BITWISE
    return check


def golden_recipes(golden: Trace, stage: str) -> dict[str, dict[str, str]]:
    """The golden's recipes of `stage` in its order, {recipe: {output name: trace key}}; empty
    when the stage has one implementation only."""
    mapping = golden[stage].get("recipe_outputs")
    if mapping is None:
        return {}
    if not isinstance(mapping, dict) or not all(isinstance(v, dict) for v in mapping.values()):
        raise ContractError(
            f"golden {stage}.recipe_outputs must map recipe -> {{name: key}}, got {mapping!r}"
        )
    return mapping


def declared_recipe(trace: Trace, stage: str) -> str | None:
    """The recipe a trace declares for `stage` (its "recipe" host entry), or None."""
    value = trace[stage].get("recipe")
    if value is not None and not isinstance(value, str):
        raise ContractError(f"{trace.backend} {stage}.recipe must be a string, got {value!r}")
    return value


def golden_as(golden: Trace, stage: str, keys: dict[str, str]) -> Trace:
    """`golden` with `stage`'s contract names bound to one recipe's outputs (no copies)."""
    out = Trace(golden.backend, golden.rank)
    for name, outs in golden.items():
        if name == stage:
            outs = {**outs, **{n: outs[k] for n, k in keys.items()}}
        out.add(name, outs)
    return out


def route_reading(golden: Trace, other: Trace) -> str | None:
    """The routed-scaling reading (moe_verify.spec.RoutedScalingRecipe) the tested side's
    gather reads its route in: the one its route declares where the golden's route has it, else
    the golden's own; None where the problem has one reading (docs/tolerance.md#routed-scaling).
    A route that did not run declares nothing: the golden's own reading, as the isolated feed
    (moe_verify/run/runner.py `fed_upstream`) hands its gather."""
    if Stage.ROUTE not in golden:
        return None
    own = golden[Stage.ROUTE].get("recipe")
    readings = golden_recipes(golden, Stage.ROUTE)
    if Stage.ROUTE in other and other.failure(Stage.ROUTE) is None:
        declared = other[Stage.ROUTE].get("recipe")
        if declared in readings:
            return declared
    return own if readings else None


def gather_in_reading(ctx: Ctx) -> Ctx:
    """`ctx` for the gather judged in its route's reading (`route_reading`): the golden's gather
    recipes of that reading only ("routed_scaling_recipes", reference/recipes.py
    gather_reading_recipes), the first of them under the plain names (what the bounded chained
    check reads), and a declared plain gather recipe (mul_add, fma) read as that reading's.
    Unchanged where the problem has one reading."""
    names = ctx.golden[Stage.GATHER].get("routed_scaling_recipes")
    reading = route_reading(ctx.golden, ctx.other)
    if not isinstance(names, dict) or reading not in names:
        return ctx
    own = names[reading]
    recipes = golden_recipes(ctx.golden, Stage.GATHER)
    kept = {n: recipes[n] for n in own.values() if n in recipes}
    # the plain names hold the reading's first recipe: what a bound (chained) check reads
    golden = golden_as(ctx.golden, Stage.GATHER, next(iter(kept.values())))
    golden = golden.replaced(Stage.GATHER, recipe_outputs=kept)
    other = ctx.other
    declared = declared_recipe(other, Stage.GATHER)
    if declared in own:
        other = other.replaced(Stage.GATHER, recipe=own[declared])
    return dataclasses.replace(ctx, golden=golden, other=other)


def _undeclarable(ctx: Ctx, stage: str, declared: str, known: list[str]) -> CheckResult:
    legit = ", ".join(known) if known else f"none: {stage} has one implementation here"
    return CheckResult(
        "recipe",
        False,
        1,
        0,
        RECIPE_REASON,
        None,
        f"{ctx.name} declares {stage} recipe {declared!r}, which is not a legitimate recipe of "
        f"this problem (legitimate: {legit})",
        recipe=declared,
    )


def _annotated(checks: list[CheckResult], recipe: str, named: bool, note: str) -> list[CheckResult]:
    """The checks, naming `recipe` when `named`; the first check and every failed one say in
    their detail which recipe they were measured against."""
    return [
        dataclasses.replace(
            c,
            detail=(f"{c.detail}; {note}" if c.detail else note)
            if n == 0 or not c.passed
            else c.detail,
            recipe=recipe if named else None,
        )
        for n, c in enumerate(checks)
    ]


def match_recipe(ctx: Ctx, stage: str, compare: Comparer) -> list[CheckResult]:
    """`compare` against the declared recipe, or against each of the golden's recipes of `stage`
    (the one whose checks all pass wins, the closest on ties; in the golden's order on equal
    distance). The checks carry the recipe when they pass or it was declared; their details say
    which recipe they were measured against."""
    recipes = golden_recipes(ctx.golden, stage)
    declared = declared_recipe(ctx.other, stage)
    if not recipes:
        if declared is not None:
            return [_undeclarable(ctx, stage, declared, [])]
        return compare(ctx)[0]
    if declared is not None and declared not in recipes:
        return [_undeclarable(ctx, stage, declared, list(recipes))]
    tried = [declared] if declared is not None else list(recipes)
    results = []
    for recipe in tried:
        view = dataclasses.replace(ctx, golden=golden_as(ctx.golden, stage, recipes[recipe]))
        checks, distance = compare(view)
        results.append((not all(c.passed for c in checks), distance, recipe, checks))
    failed, distance, recipe, checks = min(results, key=lambda r: r[:2])
    if declared is not None:
        note = f"against the declared recipe {recipe}"
    elif not failed:
        note = f"matches recipe {recipe} (of {', '.join(tried)})"
        also = [r for f, d, r, _ in results if not f and d == 0 and r != recipe and distance == 0]
        if also:
            verb = "gives" if len(also) == 1 else "give"
            note += f"; {', '.join(also)} {verb} the same bits here"
    else:
        note = (
            f"no legitimate recipe matches; against the closest, {recipe} "
            f"({_fmt(distance)} {DISTANCE_UNITS.get(Stage(stage), 'outputs')} differ bit for bit; "
            "tried "
            f"{', '.join(tried)})"
        )
    return _annotated(checks, recipe, declared is not None or not failed, note)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


# Chained mode: the copy stages after a legitimately different input quantization ---------------

_COPY_STAGES = (Stage.PERMUTE, Stage.DISPATCH)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (fp8 as bytes, fp32 as int32: -0 and NaN payloads count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return bool(torch.equal(a, b))


def quant_recipe_of(ctx: Ctx) -> str | None:
    """The golden quant_input recipe whose codes and scales the tested quant_input equals bit for
    bit (its declared one only, if it declares one), or None."""
    if Stage.QUANT_INPUT not in ctx.other or ctx.other.failure(Stage.QUANT_INPUT) is not None:
        return None
    recipes = golden_recipes(ctx.golden, Stage.QUANT_INPUT)
    declared = declared_recipe(ctx.other, Stage.QUANT_INPUT)
    names = [declared] if declared in recipes else [] if declared is not None else list(recipes)
    for recipe in names:
        keys = recipes[recipe]
        if all(
            same_bits(
                tensor_of(ctx.other, Stage.QUANT_INPUT, name, ctx.device),
                tensor_of(ctx.golden, Stage.QUANT_INPUT, key, ctx.device),
            )
            for name, key in keys.items()
        ):
            return recipe
    return None


def chained_copy_golden(ctx: Ctx, stage: str) -> Ctx:
    """`ctx` for a chained permute (or dispatch, seen as one) after a tested quant_input that
    matched another legitimate recipe than the golden's own: the golden's permute redone on that
    recipe's a1q and a1q_scale (each live slot's row the recipe's row of its token, padding as the
    golden's), so the copy is still compared bit for bit, against the same bytes it copied.
    Any other stage, mode or case: `ctx` unchanged."""
    if ctx.mode is not Mode.CHAINED or stage not in _COPY_STAGES:
        return ctx
    recipe = quant_recipe_of(ctx)
    own = ctx.golden[Stage.QUANT_INPUT].get("recipe") if recipe is not None else None
    if recipe is None or recipe == own:
        return ctx
    keys = golden_recipes(ctx.golden, Stage.QUANT_INPUT)[recipe]
    a1q = tensor_of(ctx.golden, Stage.QUANT_INPUT, keys["a1q"], ctx.device)
    a1q_scale = tensor_of(ctx.golden, Stage.QUANT_INPUT, keys["a1q_scale"], ctx.device)
    inv = tensor_of(ctx.golden, Stage.PERMUTE, "inv_perm", ctx.device).to(torch.int64)
    a_perm = tensor_of(ctx.golden, Stage.PERMUTE, "a_perm", ctx.device).clone()
    scales = tensor_of(ctx.golden, Stage.PERMUTE, "a_scale_perm", ctx.device).clone()
    if scales.dtype != a1q_scale.dtype or scales.dim() != 2:
        raise ContractError(
            f"golden permute.a_scale_perm ({scales.dtype}) is not a row copy of quant_input "
            f"a1q_scale ({a1q_scale.dtype}) for recipe {recipe}"
        )
    live = inv >= 0
    tokens, rows = live.nonzero()[:, 0], inv[live]
    a_perm[rows], scales[rows] = a1q[tokens], a1q_scale[tokens]
    golden = golden_as(ctx.golden, Stage.QUANT_INPUT, keys)
    golden = golden_as(golden, Stage.PERMUTE, {})
    golden[Stage.PERMUTE].update(a_perm=a_perm, a_scale_perm=scales)
    return dataclasses.replace(ctx, golden=golden)
