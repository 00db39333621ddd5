"""Comparers of the stages compared within bounds: the GEMMs (gemm1, gemm2; live (token, k) rows),
act_quant (scale flips, code distance, or dequantized values in chained mode) and the per-token
outputs (gather in bf16 ulps; shared and reduce bounded like a GEMM)."""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from moe_verify.spec import REDUCE_STAGE
from tolerance.checks import (
    Ctx,
    bound_check,
    bounded_checks,
    downstream_slots,
    fp8_value,
    nonfinite_check,
    rows_in_range,
    shape_fail,
    slot_worst,
    ulp_checks,
)
from tolerance.layouts import (
    scale_values,
)
from tolerance.metrics import (
    argmax_coords,
    first_true,
    fp8_code_distance,
    fp8_codes,
    fp8_value_distance,
)
from tolerance.results import (
    CheckResult,
    Worst,
)


def gemm_checks(ctx: Ctx, stage: str, name: str) -> list[CheckResult]:
    s = downstream_slots(ctx)
    g, o = ctx.pair(stage, name)
    if o.dim() != 2 or o.shape[1] != g.shape[1]:
        return [shape_fail(ctx, name, o, g)]
    s, row_fail = rows_in_range(ctx, s, o.shape[0], name)
    a, b = o[s.other_rows], g[s.gold_rows]
    checks = bounded_checks(ctx, a, b, lambda i: slot_worst(ctx, s, i), "live (token, k) rows")
    return [row_fail, *checks] if row_fail else checks


def _dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """fp8 e4m3 codes (uint8) x per-group scales -> fp32 values."""
    values = (
        codes.view(torch.float8_e4m3fn).float() if codes.dtype == torch.uint8 else codes.float()
    )
    return values * scales.float().repeat_interleave(group, dim=1)


def act_quant_checks(ctx: Ctx) -> list[CheckResult]:
    check = ctx.check
    s = downstream_slots(ctx)
    g_q, o_q = (fp8_codes(q) for q in ctx.pair("act_quant", "a2q"))
    if o_q.dim() != 2 or o_q.shape[1] != g_q.shape[1]:
        return [shape_fail(ctx, "a2q", o_q, g_q)]
    group = ctx.problem.recipe.act_group
    groups = g_q.shape[1] // group
    g_s, o_s = (scale_values(x, groups) for x in ctx.pair("act_quant", "a2q_scale"))
    s, row_fail = rows_in_range(ctx, s, min(o_q.shape[0], o_s.shape[0]), "a2q / a2q_scale")
    qa, qb = o_q[s.other_rows], g_q[s.gold_rows]
    sa, sb = o_s[s.other_rows], g_s[s.gold_rows]
    out = [row_fail] if row_fail else []
    locate = partial(slot_worst, ctx, s)

    # NaN codes, and scales that are NaN/Inf (an E8M0 0xFF byte reads as NaN).
    finite = nonfinite_check(ctx, qa, qb, locate, "live (token, k) rows")
    bad_scales = int((~torch.isfinite(sa)).sum() + (~torch.isfinite(sb)).sum())
    if bad_scales:
        finite = dataclasses.replace(
            finite,
            passed=False,
            value=finite.value + bad_scales,
            detail=finite.detail + f"; {bad_scales} non-finite scales",
        )
    out.append(finite)

    if check.kind == "act_quant_values":
        a_val = _dequantize_codes(qa, sa, group)
        b_val = _dequantize_codes(qb, sb, group)
        return out + bounded_checks(ctx, a_val, b_val, locate, "live (token, k) rows")[1:]

    differ = ~(sa == sb)
    n_groups = differ.numel()
    flips = int(differ.sum())
    at = first_true(differ)
    worst = None
    if at is not None:
        worst = locate(at[0])
        worst = dataclasses.replace(
            worst, column=at[1] * group, golden=float(sb[at]), other=float(sa[at])
        )
    flip_limit = check.limit("scale_flip_frac")
    out.append(
        bound_check(
            "scale flips",
            flips / n_groups if n_groups else 0.0,
            flip_limit,
            worst,
            f"{flips} of {n_groups} live scale groups differ",
        )
    )
    step = ((sa - sb).abs() / torch.minimum(sa, sb)).masked_fill(~differ, 0.0)
    step = torch.where(differ & torch.isnan(step), torch.full_like(step, float("inf")), step)
    at = argmax_coords(step)
    value, worst = 0.0, None
    if at is not None and flips:
        value = float(step[at])
        worst = dataclasses.replace(
            locate(at[0]), column=at[1] * group, golden=float(sb[at]), other=float(sa[at])
        )
    out.append(
        bound_check(
            "scale step",
            value,
            check.limit("scale_step"),
            worst,
            f"largest |s_a - s_b| / min(s_a, s_b) over differing groups: {value:.4g}",
        )
    )

    same_scale = (~differ).repeat_interleave(group, dim=1)
    sa_el, sb_el = sa.repeat_interleave(group, dim=1), sb.repeat_interleave(group, dim=1)
    dist = torch.where(
        same_scale,
        fp8_code_distance(qa, qb).to(torch.float64),
        fp8_value_distance(qa, sa_el, qb, sb_el),
    )
    at = argmax_coords(dist)
    value, worst, note = 0.0, None, ""
    if at is not None:
        value = float(dist[at])
        worst = dataclasses.replace(
            locate(at[0]),
            column=at[1],
            golden=fp8_value(qb[at]) * float(sb_el[at]),
            other=fp8_value(qa[at]) * float(sa_el[at]),
        )
        note = (
            f"; worst: code 0x{int(qa[at]):02x} vs golden 0x{int(qb[at]):02x} "
            "(dequantized values shown)"
        )
    moved = int((~(dist == 0)).sum())
    out.append(
        bound_check(
            "code distance",
            value,
            check.limit("code_dist"),
            worst,
            f"max {value:.3g} e4m3 steps (ulps at the coarser scale where a scale flipped){note}",
        )
    )
    total = dist.numel()
    out.append(
        bound_check(
            "code fraction",
            moved / total if total else 0.0,
            check.limit("code_frac"),
            None,
            f"{moved} of {total} live codes differ",
        )
    )
    return out


def token_output_checks(ctx: Ctx, stage: str) -> list[CheckResult]:
    """gather / shared / reduce: out [M, H] per element and per token."""
    g, o = ctx.pair(stage, "out")
    if o.shape != g.shape:
        return [shape_fail(ctx, "out", o, g)]
    rank = None if stage == REDUCE_STAGE else ctx.rank

    def locate(t: int) -> Worst:
        return Worst(token=ctx.token(t) if rank is not None else t, rank=rank)

    kind = ctx.check.kind
    if kind == "gather":
        return ulp_checks(ctx, o, g, locate, "tokens")
    if kind in ("gemm", "reduce"):
        return bounded_checks(ctx, o, g, locate, "tokens")
    raise ValueError(f"policy gives {stage} a {kind!r} check; it takes gather, gemm or reduce")
