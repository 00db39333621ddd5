"""Stage-by-stage comparison of one backend's Trace against the golden's, per the policy table.

Each stage is compared as docs/stage-contract.md names it, with the Check that
`policy_for(stage, problem, mode)` returns. Permuted buffers are never compared by absolute row:
rows are keyed by (token, k). The permute stage is read through each side's own `inv_perm`. For
the stages after it (gemm1, act_quant, gemm2) the key is the permute the stage *consumed*: in
isolated mode the backend ran on the golden's upstream, so its rows sit where the golden's
`inv_perm` says; in chained mode they sit where the backend's own `inv_perm` says.

Live slots are those with golden `inv_perm[t, k] >= 0`; padding rows are checked only for their
contract values (m_indices -1, fp32 scales +0.0, packed scale bytes not 0xFF), never for data.
A stage recorded as `{SKIP_KEY: reason}` (StageSkipped) is reported as skipped, one recorded as
`{ERROR_KEY: message}` (the stage raised) as an error; neither is ever a pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch

from moe_verify.spec import REDUCE_STAGE, MoEProblem, Trace
from tolerance.checks import (
    Ctx,
    Slots,
    bound_check,
    bounded_checks,
    comparison_device,
    decode_scale,
    downstream_slots,
    exact_check,
    exact_int_vector,
    fp8_value,
    int_of,
    live_slots,
    nonfinite_check,
    rows_in_range,
    shape_fail,
    slot_name,
    slot_worst,
    take_rows,
    tensor_of,
    ulp_checks,
)
from tolerance.layouts import (
    _E8M0_NAN,
    comparable_scale_codes,
    flatten_batched,
    scale_values,
    unpack_ue8m0,
)
from tolerance.metrics import (
    Mismatch,
    argmax_coords,
    bits,
    first_true,
    fp8_code_distance,
    fp8_codes,
    fp8_value_distance,
    fp32_ulp_distance,
    mismatch_of,
    nan_inf_counts,
)
from tolerance.policy import CONTRACT_REASON, MODES, policy_for
from tolerance.results import (
    ERROR_KEY,
    SKIP_KEY,
    CheckResult,
    ContractError,
    StageResult,
    Worst,
)

# Stages ------------------------------------------------------------------------------------------


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


def _route(ctx: Ctx) -> list[CheckResult]:
    g_ids, o_ids = ctx.pair("route", "topk_ids")
    if g_ids.shape != o_ids.shape:
        return [shape_fail(ctx, "topk_ids", o_ids, g_ids)]
    g_w, o_w = (w.to(torch.float32) for w in ctx.pair("route", "topk_weights"))
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
    out.append(
        CheckResult(
            "topk_ids",
            first is None,
            bad_tokens,
            0,
            ctx.check.reason,
            worst,
            f"{bad_tokens} of {gi.shape[0]} tokens route to a different expert set{note}",
        )
    )

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

    if "token_index" in ctx.golden["route"]:
        out.append(
            exact_int_vector(ctx, "route", "token_index", "received rows differ", ctx.check.reason)
        )
    return out


def _quant_input(ctx: Ctx) -> list[CheckResult]:
    reason = ctx.check.reason
    out = []
    g_q, o_q = ctx.pair("quant_input", "a1q")
    if g_q.shape != o_q.shape:
        out.append(shape_fail(ctx, "a1q", o_q, g_q))
    else:
        gc, oc = fp8_codes(g_q), fp8_codes(o_q)
        mm = mismatch_of(oc != gc)
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
        out.append(exact_check("a1q codes", mm, what, reason, worst, note))

    hidden = g_q.shape[1]
    group = ctx.problem.recipe.act_group
    g_s, o_s = ctx.pair("quant_input", "a1q_scale")
    if o_s.shape[0] != g_s.shape[0]:
        out.append(shape_fail(ctx, "a1q_scale", o_s, g_s))
        return out
    co, cg, kind = comparable_scale_codes(o_s, g_s, hidden // group)
    mm = mismatch_of(co != cg)
    worst = None
    if mm.first is not None:
        t, gi = mm.first
        worst = Worst(
            token=ctx.token(t),
            rank=ctx.rank,
            column=gi * group,
            golden=decode_scale(int(cg[t, gi]), kind),
            other=decode_scale(int(co[t, gi]), kind),
        )
    what = f"scale groups differ ({group} columns each; compared as {kind} bits)"
    out.append(exact_check("a1q_scale", mm, what, reason, worst))
    return out


def _align(ctx: Ctx) -> list[CheckResult]:
    reason = ctx.check.reason
    out = []
    for name in ("M_sum", "alignment"):
        o, g = int_of(ctx.other, "align", name), int_of(ctx.golden, "align", name)
        worst = None if o == g else Worst(rank=ctx.rank, golden=g, other=o)
        out.append(
            CheckResult(name, o == g, abs(o - g), 0, reason, worst, f"{ctx.name} {o}, golden {g}")
        )

    out.append(
        exact_int_vector(
            ctx, "align", "counts", "local experts' counts differ", reason, "local expert"
        )
    )

    m_sum, align = int_of(ctx.other, "align", "M_sum"), int_of(ctx.other, "align", "alignment")
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
    g_c = tensor_of(ctx.golden, "align", "counts", ctx.device).to(torch.int64)
    need = int((((g_c + align - 1) // align) * align).sum())
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
    return out


def _permute(ctx: Ctx) -> list[CheckResult]:
    reason = ctx.check.reason
    G, B = ctx.golden, ctx.other
    out = []
    g_m, o_m = (m.to(torch.int64) for m in ctx.pair("permute", "m_indices"))
    m_sum = o_m.numel()

    out.append(exact_int_vector(ctx, "permute", "m_indices", "rows' local experts differ", reason))
    if "expert_start" in G["permute"]:
        out.append(
            exact_int_vector(
                ctx, "permute", "expert_start", "segment starts differ", reason, "local expert"
            )
        )

    # inv_perm: every live slot owns one distinct row inside [0, M_sum).
    s = live_slots(G, B, ctx.device)
    rows = s.other_rows
    in_range = (rows >= 0) & (rows < m_sum)
    hits = take_rows(torch.bincount(rows[in_range], minlength=m_sum), rows)
    shared = in_range & (hits > 1)
    bad = ~in_range | shared
    worst, note = None, ""
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        worst = slot_worst(ctx, s, i, other=int(rows[i]), golden=int(s.gold_rows[i]))
        why = "is shared with another slot" if bool(in_range[i]) else f"is outside [0, {m_sum})"
        note = f"; first: {slot_name(ctx, s, i)} -> row {int(rows[i])}, which {why}"
    what = "live slots map to an invalid row"
    out.append(exact_check("inv_perm", mismatch_of(bad), what, reason, worst, note))
    ok = ~bad

    # a_perm: the row of each live slot holds the golden row's bytes.
    g_a, o_a = (fp8_codes(a) for a in ctx.pair("permute", "a_perm"))
    if o_a.dim() != 2 or o_a.shape[1] != g_a.shape[1] or (m_sum and o_a.shape[0] != m_sum):
        out.append(shape_fail(ctx, "a_perm", o_a, g_a))
    else:
        gr, orow = g_a[s.gold_rows], take_rows(o_a, rows)
        diff = (gr != orow) & ok[:, None]
        out.append(
            _slot_rows_check(ctx, s, diff, "a_perm rows", reason, gr, orow, fp8_value, "bytes")
        )

    # a_scale_perm: same, on the scale groups that exist (pad bytes of packed words ignored).
    hidden, group = g_a.shape[1], ctx.problem.recipe.act_group
    groups = hidden // group
    g_s, o_s = ctx.pair("permute", "a_scale_perm")
    if m_sum and o_s.shape[0] != m_sum:
        out.append(shape_fail(ctx, "a_scale_perm", o_s, g_s))
        o_codes = None
    else:
        o_codes, g_codes, kind = comparable_scale_codes(o_s, g_s, groups)
        gr, orow = g_codes[s.gold_rows], take_rows(o_codes, rows)
        diff = (gr != orow) & ok[:, None]
        decode = partial(decode_scale, kind=kind)
        out.append(
            _slot_rows_check(
                ctx, s, diff, "a_scale_perm rows", reason, gr, orow, decode, "scale groups", group
            )
        )

    # Per-expert row sets: each live slot sits in its expert's segment.
    expected, got = g_m[s.gold_rows], take_rows(o_m, rows)
    wrong = ok & (got != expected)
    worst, note = None, ""
    if bool(wrong.any()):
        i = int(torch.nonzero(wrong)[0, 0])
        worst = slot_worst(ctx, s, i, golden=int(expected[i]), other=int(got[i]))
        note = (
            f"; first: {slot_name(ctx, s, i)} sits in row {int(rows[i])} of local expert "
            f"{int(got[i])}'s segment, golden local expert {int(expected[i])}"
        )
    what = "live slots sit in another expert's segment"
    out.append(exact_check("expert rows", mismatch_of(wrong), what, reason, worst, note))

    # Padding contract on rows claimed by no live slot.
    claimed = torch.zeros(m_sum, dtype=torch.bool, device=ctx.device)
    claimed[rows[in_range]] = True
    pad = ~claimed
    bad_pad = pad & (o_m != -1)
    worst, note = None, ""
    if bool(bad_pad.any()):
        r = int(torch.nonzero(bad_pad)[0, 0])
        worst = Worst(rank=ctx.rank, golden=-1, other=int(o_m[r]), row=r)
        note = f"; first: row {r} holds {int(o_m[r])}"
    mism = Mismatch(int(bad_pad.sum()), int(pad.sum()), None)
    what = "padding rows (claimed by no live slot) do not hold -1"
    out.append(exact_check("padding m_indices", mism, what, reason, worst, note))
    if o_codes is not None:
        out.append(_padding_scales(ctx, o_s, pad, groups, group, reason))
    return out


def _slot_rows_check(
    ctx: Ctx,
    s: Slots,
    diff: torch.Tensor,
    name: str,
    reason: str,
    golden_rows: torch.Tensor,
    other_rows: torch.Tensor,
    decode: Callable[[torch.Tensor], float | int],
    unit: str,
    column_step: int = 1,
) -> CheckResult:
    """Exact per-slot row comparison: diff [L, W] marks differing entries of live slots."""
    bad_slots = diff.any(dim=1)
    mism = mismatch_of(bad_slots)
    worst, note = None, ""
    if mism.first is not None:
        (i,) = mism.first
        c = int(torch.nonzero(diff[i])[0, 0])
        worst = slot_worst(
            ctx,
            s,
            i,
            column=c * column_step,
            golden=decode(golden_rows[i, c]),
            other=decode(other_rows[i, c]),
        )
        note = (
            f"; first: {slot_name(ctx, s, i)} -> {ctx.name} row {int(s.other_rows[i])} vs golden "
            f"row {int(s.gold_rows[i])}: {int(diff[i].sum())} of {diff.shape[1]} {unit} differ"
        )
    return exact_check(name, mism, "live slots' rows differ", reason, worst, note)


def _padding_scales(
    ctx: Ctx, scales: torch.Tensor, pad: torch.Tensor, groups: int, group: int, reason: str
) -> CheckResult:
    """fp32 padding rows must be +0.0 (bitwise); packed padding bytes must not be 0xFF (NaN)."""
    if scales.dtype == torch.int32:
        codes = unpack_ue8m0(scales, groups)
        bad = pad[:, None] & (codes == _E8M0_NAN)
        want, what = None, "padding-row packed bytes are 0xFF (NaN to the kernel, ref §14.19)"
    else:
        codes = bits(scales.to(torch.float32)).to(torch.int64)
        bad = pad[:, None] & (codes != 0)
        want, what = 0.0, "padding-row fp32 scales are not +0.0"
    mism = mismatch_of(bad)
    worst, note = None, ""
    if mism.first is not None:
        r, c = mism.first
        other = int(codes[r, c]) if scales.dtype == torch.int32 else float(scales[r, c])
        worst = Worst(rank=ctx.rank, column=c * group, golden=want, other=other, row=r)
        note = f"; first: row {r}, group {c} holds {other}"
    return exact_check("padding scales", mism, what, reason, worst, note)


def _gemm(ctx: Ctx, stage: str, name: str) -> list[CheckResult]:
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


def _act_quant(ctx: Ctx) -> list[CheckResult]:
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


def _token_output(ctx: Ctx, stage: str) -> list[CheckResult]:
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


_COMPARERS: dict[str, Callable[[Ctx], list[CheckResult]]] = {
    "route": _route,
    "quant_input": _quant_input,
    "align": _align,
    "permute": _permute,
    "gemm1": partial(_gemm, stage="gemm1", name="mm1"),
    "act_quant": _act_quant,
    "gemm2": partial(_gemm, stage="gemm2", name="mm2"),
    "gather": partial(_token_output, stage="gather"),
    "shared": partial(_token_output, stage="shared"),
    REDUCE_STAGE: partial(_token_output, stage=REDUCE_STAGE),
}


# Entry points ------------------------------------------------------------------------------------


def default_stages(problem: MoEProblem, golden: Trace, other: Trace) -> list[str]:
    """The topology's stages, plus `reduce` when either trace has it."""
    names = list(problem.stages)
    if REDUCE_STAGE in golden or REDUCE_STAGE in other:
        names.append(REDUCE_STAGE)
    return names


def not_compared(stage: str, golden: Trace, other: Trace) -> StageResult | None:
    """A skip (stage missing or skipped on either side) or error (a side raised in the stage)
    result when `stage` cannot be compared; None when it can. The other side is checked first."""
    for trace, who in ((other, other.backend), (golden, f"golden ({golden.backend})")):
        if stage not in trace:
            return StageResult(stage, "skip", [], f"{who} trace has no {stage!r} stage (not run)")
        outs = trace[stage]
        if ERROR_KEY in outs:
            return StageResult(stage, "error", [], f"{who} raised in {stage}: {outs[ERROR_KEY]}")
        if SKIP_KEY in outs:
            return StageResult(stage, "skip", [], f"{who} skipped {stage}: {outs[SKIP_KEY]}")
    return None


def compare_stage(
    stage: str,
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    *,
    mode: str = "isolated",
    device: torch.device | str | None = None,
) -> StageResult:
    """Compare one stage; never raises for a broken trace (status fail/skip/error instead).

    device: where to compare (both sides are moved there); the golden's device by default.
    """
    early = not_compared(stage, golden, other)
    if early is not None:
        return early
    comparer = _COMPARERS.get(stage)
    if "dispatch" in golden:  # batched layout: compare it as a contiguous one
        golden, other = flatten_batched(golden), flatten_batched(other)
        if stage == "dispatch":
            comparer = _permute
    if comparer is None:
        return StageResult(stage, "error", [], f"no comparison is defined for stage {stage!r}")
    where = torch.device(device) if device is not None else comparison_device(golden, stage)
    try:
        check = policy_for(stage, problem, mode)
        checks = comparer(Ctx(golden, other, problem, check, mode, where))
    except ContractError as exc:
        contract = CheckResult("contract", False, 1, 0, CONTRACT_REASON, None, str(exc))
        return StageResult(stage, "fail", [contract])
    except Exception as exc:  # a comparison bug must not take the whole report down
        return StageResult(stage, "error", [], f"{type(exc).__name__}: {exc}")
    return StageResult(stage, "pass" if all(c.passed for c in checks) else "fail", checks)


def compare(
    golden: Trace,
    other: Trace,
    problem: MoEProblem,
    stages: list[str] | None = None,
    *,
    mode: str = "isolated",
    device: torch.device | str | None = None,
) -> list[StageResult]:
    """Compare `other` against `golden` stage by stage (all of `default_stages` unless given).

    mode: "isolated" when each of `other`'s stages ran on the golden's upstream, "chained" when it
    ran end to end on its own; it picks the policy rows and which inv_perm keys permuted rows.
    device: where to compare, the golden's device by default (`comparison_device`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = list(stages) if stages is not None else default_stages(problem, golden, other)
    return [
        compare_stage(stage, golden, other, problem, mode=mode, device=device) for stage in names
    ]
