"""Comparers of the stages that must match exactly: route (ids and fp32 weights), quant_input
(fp8 codes and scale bits) and align (counts, M_sum); permute's is tolerance/stages/permute.py.
Each takes a comparison context and returns its checks."""

from __future__ import annotations

from functools import partial

import torch

from moe_verify.spec import Stage, round_up
from tolerance.metrics import (
    argmax_coords,
    first_true,
    fp8_codes,
    fp32_ulp_distance,
    mismatch_of,
    nan_inf_counts,
)
from tolerance.results import CheckResult, ContractError, Worst, entry
from tolerance.stages.checks import (
    bound_check,
    decode_scale,
    exact_check,
    exact_int_vector,
    fp8_value,
    shape_fail,
    with_rows,
)
from tolerance.stages.context import (
    Ctx,
    int_of,
    tensor_of,
    token_worst,
)
from tolerance.stages.layouts import (
    comparable_scale_codes,
)
from tolerance.stages.recipes import declared_recipe, match_recipe


def _canonical_route(
    ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort each token's (id, weight) pairs by id, negatives last, ties by weight.

    Returns (ids, weights, original k), each [M, k].
    """
    by_weight = torch.argsort(weights, dim=1, stable=True)
    ids1, w1 = ids.gather(1, by_weight), weights.gather(1, by_weight)
    key = torch.where(ids1 >= 0, ids1, (1 << 40) - ids1)
    by_id = torch.argsort(key, dim=1, stable=True)
    return ids1.gather(1, by_id), w1.gather(1, by_id), by_weight.gather(1, by_id)


def route_checks(ctx: Ctx) -> list[CheckResult]:
    """ids as a set per token, weights within the policy's ulps: against the golden's own
    weights, or, for a route that declares its routed-scaling reading
    (moe_verify.spec.RoutedScalingRecipe), against the golden's weights in that reading alone.
    A reading is never inferred: it decides what the gather is fed and judged against
    (docs/tolerance.md#routed-scaling), so a route on another one says so."""
    if declared_recipe(ctx.other, Stage.ROUTE) is None:
        return route_against(ctx)
    return match_recipe(ctx, Stage.ROUTE, lambda c: _with_distance(route_against(c)))


def _with_distance(checks: list[CheckResult]) -> tuple[list[CheckResult], float]:
    return checks, float(sum(not c.passed for c in checks))


def route_against(ctx: Ctx) -> list[CheckResult]:
    """route's checks against the golden of `ctx` (one reading's weights)."""
    g_ids, o_ids = ctx.pair(Stage.ROUTE, "topk_ids")
    if g_ids.shape != o_ids.shape:
        return [shape_fail(ctx, "topk_ids", o_ids, g_ids)]
    g_w, o_w = (w.to(torch.float32) for w in ctx.pair(Stage.ROUTE, "topk_weights"))
    if g_w.shape != o_w.shape or g_w.shape != g_ids.shape:
        return [shape_fail(ctx, "topk_weights", o_w, g_w)]
    gi, gw, gk = _canonical_route(g_ids.to(torch.int64), g_w)
    oi, ow, _ = _canonical_route(o_ids.to(torch.int64), o_w)

    out = []
    differ = gi != oi
    first = first_true(differ)
    bad_tokens = int(differ.any(dim=1).sum())
    worst, note = None, ""
    if first is not None:
        t, j = first
        expert = int(gi[t, j])
        worst = Worst(
            token=ctx.token(t),
            k=int(gk[t, j]),
            expert=expert if expert >= 0 else None,
            rank=ctx.rank,
            golden=expert,
            other=int(oi[t, j]),
        )
        note = f"; token {ctx.token(t)}: golden {gi[t].tolist()} vs {ctx.name} {oi[t].tolist()}"
    ids = CheckResult(
        "topk_ids",
        first is None,
        bad_tokens,
        0,
        ctx.check.reason,
        worst,
        f"{bad_tokens} of {gi.shape[0]} tokens route to a different expert set{note}",
        beyond={"tokens": bad_tokens},
    )
    out.append(with_rows(ids, differ, partial(token_worst, ctx)))

    comparable = (gi >= 0) & (gi == oi)
    ulp = fp32_ulp_distance(ow, gw).masked_fill(~comparable, 0)
    at = argmax_coords(ulp)
    value, worst = 0, None
    if at is not None:
        value = int(ulp[at])
        expert = int(gi[at])
        worst = Worst(
            token=ctx.token(at[0]),
            k=int(gk[at]),
            expert=expert if expert >= 0 else None,
            rank=ctx.rank,
            golden=float(gw[at]),
            other=float(ow[at]),
        )
    out.append(
        bound_check(
            "topk_weights",
            value,
            ctx.check.limit("ulp"),
            worst,
            f"max {value} fp32 ulp over {int(comparable.sum())} live slots with matching ids "
            "(pairs sorted by id)",
        )
    )

    if "token_index" in ctx.golden[Stage.ROUTE]:
        out.append(
            exact_int_vector(
                ctx, Stage.ROUTE, "token_index", "received rows differ", ctx.check.reason
            )
        )
    return out


def quant_input_checks(ctx: Ctx) -> list[CheckResult]:
    """fp8 codes and scale bits, exactly, against the legitimate input quantizer the tested side
    matches (or declares): vLLM's CUDA division or Triton reciprocal recipe."""
    return match_recipe(ctx, Stage.QUANT_INPUT, quant_input_against)


def quant_input_against(ctx: Ctx) -> tuple[list[CheckResult], float]:
    """quant_input's checks against the golden of `ctx` (one recipe's outputs), and how many
    codes and scale groups differ."""
    checks = _quant_input_bits(ctx)
    return checks, sum(float(c.value) for c in checks if not c.passed)


def _quant_input_bits(ctx: Ctx) -> list[CheckResult]:
    reason = ctx.check.reason
    out = []
    g_q, o_q = ctx.pair(Stage.QUANT_INPUT, "a1q")
    if g_q.shape != o_q.shape:
        out.append(shape_fail(ctx, "a1q", o_q, g_q))
    else:
        gc, oc = fp8_codes(g_q), fp8_codes(o_q)
        differ = oc != gc
        mm = mismatch_of(differ)
        worst, note = None, ""
        if mm.first is not None:
            t, c = mm.first
            worst = Worst(
                token=ctx.token(t),
                rank=ctx.rank,
                column=c,
                golden=fp8_value(gc[t, c]),
                other=fp8_value(oc[t, c]),
            )
            note = f"; first: code 0x{int(oc[t, c]):02x} vs golden 0x{int(gc[t, c]):02x}"
        nan = nan_inf_counts(oc)[0]
        what = f"fp8 codes differ ({nan} NaN codes on {ctx.name})"
        codes = exact_check("a1q codes", mm, what, reason, worst, note, "codes", "tokens")
        out.append(with_rows(codes, differ, partial(token_worst, ctx)))

    hidden = g_q.shape[1]
    group = ctx.problem.recipe.act_group
    g_s, o_s = ctx.pair(Stage.QUANT_INPUT, "a1q_scale")
    if o_s.shape[0] != g_s.shape[0]:
        out.append(shape_fail(ctx, "a1q_scale", o_s, g_s))
        return out
    co, cg, kind = comparable_scale_codes(o_s, g_s, hidden // group)
    differ = co != cg
    mm = mismatch_of(differ)
    worst, note = None, ""
    if mm.first is not None:
        t, gi = mm.first
        golden, other = decode_scale(int(cg[t, gi]), kind), decode_scale(int(co[t, gi]), kind)
        worst = Worst(
            token=ctx.token(t), rank=ctx.rank, column=gi * group, golden=golden, other=other
        )
        # fp32 scales one ulp apart print alike at 4 digits: give the bits and their distance
        apart = f", {abs(int(co[t, gi]) - int(cg[t, gi]))} fp32 ulp apart" if kind == "fp32" else ""
        note = f"; first: {other!r} vs golden {golden!r}{apart}"
    what = f"scale groups differ ({group} columns each; compared as {kind} bits)"
    scales = exact_check("a1q_scale", mm, what, reason, worst, note, "scale groups", "tokens")
    out.append(with_rows(scales, differ, partial(token_worst, ctx)))
    return out


def align_checks(ctx: Ctx) -> list[CheckResult]:
    """alignment and counts exactly; M_sum need not be the golden's: any multiple of the
    alignment that fits every segment is valid, and `m_sum_recipe_check` names the legitimate
    formula it equals (docs/tolerance.md#align)."""
    reason = ctx.check.reason
    out = []
    o, g = int_of(ctx.other, Stage.ALIGN, "alignment"), int_of(ctx.golden, Stage.ALIGN, "alignment")
    worst = None if o == g else Worst(rank=ctx.rank, golden=g, other=o)
    out.append(
        CheckResult(
            "alignment", o == g, abs(o - g), 0, reason, worst, f"{ctx.name} {o}, golden {g}"
        )
    )

    out.append(
        exact_int_vector(
            ctx, Stage.ALIGN, "counts", "local experts' counts differ", reason, "local expert"
        )
    )

    m_sum = int_of(ctx.other, Stage.ALIGN, "M_sum")
    align = int_of(ctx.other, Stage.ALIGN, "alignment")
    if align < 1:
        raise ContractError(f"{ctx.name} align.alignment must be >= 1, got {align}")
    remainder = m_sum % align
    out.append(
        CheckResult(
            "M_sum % alignment",
            remainder == 0,
            remainder,
            0,
            reason,
            None,
            f"{ctx.name} M_sum {m_sum} with alignment {align} leaves {remainder}",
        )
    )
    g_c = tensor_of(ctx.golden, Stage.ALIGN, "counts", ctx.device).to(torch.int64)
    need = int(round_up(g_c, align).sum())
    out.append(
        CheckResult(
            "M_sum fits segments",
            m_sum >= need,
            max(0, need - m_sum),
            0,
            reason,
            None,
            f"{ctx.name} M_sum {m_sum} vs sum of round_up(count_e, {align}) = {need} over the "
            "golden counts",
        )
    )
    out.append(m_sum_recipe_check(ctx, m_sum, valid=remainder == 0 and m_sum >= need))
    return out


def m_sum_recipe_check(ctx: Ctx, m_sum: int, valid: bool) -> CheckResult:
    """Which legitimate formula the tested M_sum equals (the golden's "M_sum_recipes"), named as
    the stage's recipe. A backend that declares one (its align "recipe" entry) must equal it;
    otherwise any valid M_sum passes here, named "another valid M_sum" when no formula gives it.
    """
    recipes = entry(ctx.golden, Stage.ALIGN, "M_sum_recipes")
    if not isinstance(recipes, dict) or not recipes:
        raise ContractError(f"golden align.M_sum_recipes must be a dict name -> M_sum: {recipes!r}")
    own = int_of(ctx.golden, Stage.ALIGN, "M_sum")
    names = sorted(recipes, key=lambda r: int(recipes[r]) != own)  # the golden's formula first
    matched = [r for r in names if int(recipes[r]) == m_sum]
    known = ", ".join(f"{r} {int(recipes[r])}" for r in names)
    declared = ctx.other[Stage.ALIGN].get("recipe")
    if declared is not None:
        ok = declared in recipes and int(recipes[declared]) == m_sum
        want = int(recipes[declared]) if declared in recipes else None
        worst = None if ok else Worst(rank=ctx.rank, golden=want, other=m_sum)
        what = f"= {want}" if want is not None else "is not a legitimate M_sum formula"
        return CheckResult(
            "M_sum recipe",
            ok,
            0 if ok else 1,
            0,
            ctx.check.reason,
            worst,
            f"{ctx.name} declares {declared!r} ({what}) and returns M_sum {m_sum} "
            f"(legitimate: {known})",
            recipe=str(declared) if ok else None,
        )
    name = " = ".join(matched) if matched else ("another valid M_sum" if valid else None)
    return CheckResult(
        "M_sum recipe",
        True,
        0,
        0,
        ctx.check.reason,
        None,
        f"{ctx.name} M_sum {m_sum}: {name or 'not valid (see above)'} (legitimate: {known})",
        recipe=name,
    )
