"""Comparers of the stages compared within bounds: the GEMMs (gemm1, gemm2; live (token, k) rows),
act_quant (scale flips, code distance, or dequantized values in chained mode) and the per-token
outputs (gather in bf16 ulps; shared and reduce bounded like a GEMM).

Each stage's rows are keyed once, by `gemm_rows`, `act_quant_rows` or `token_rows`: the checks
here and `bounded_values` (what calibration measures, through `tolerance.compare.keyed_values`)
read the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from moe_verify.spec import GEMM_OUTPUT, GemmRecipe, Mode, Stage
from tolerance.metrics import (
    argmax_coords,
    bf16_ulp_distance,
    bits,
    first_true,
    fp8_code_distance,
    fp8_codes,
    fp8_value_distance,
    row_max,
)
from tolerance.policy import LAYOUT_REASON, TENSOR_CORE_GEMM
from tolerance.results import CheckResult, ContractError, Worst
from tolerance.stages.checks import (
    bound_check,
    bounded_checks,
    counted,
    fp8_value,
    nonfinite_check,
    shape_fail,
    ulp_checks,
    with_rows,
)
from tolerance.stages.context import (
    Ctx,
    Slots,
    downstream_slots,
    rows_in_range,
    slot_name,
    slot_worst,
    tensor_of,
)
from tolerance.stages.layouts import layout_check, row_experts, scale_values, tested_layout
from tolerance.stages.recipes import (
    gather_in_reading,
    golden_as,
    golden_recipes,
    match_recipe,
    sm90_chain,
)

_LIVE_ROWS = "live (token, k) rows"
TOKEN_STAGES = (Stage.GATHER, Stage.SHARED, Stage.REDUCE)
_BOUNDED = [*GEMM_OUTPUT, Stage.ACT_QUANT, *TOKEN_STAGES]


# Keyed rows --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyed:
    """One stage's compared rows: row i of `other` and of `golden` ([L, N], on the comparison
    device) is the same live (token, k) slot, or the same token for per-token outputs.

    locate maps row i to its coordinates; rows names a row in messages; row_map is the failed
    check for live slots whose row lies outside the tested tensor, layout_map the one for live
    slots on rows the grouped layout the stage read gives no output to (both kinds dropped).
    """

    other: torch.Tensor
    golden: torch.Tensor
    locate: Callable[[int], Worst]
    rows: str
    row_map: CheckResult | None = None
    layout_map: CheckResult | None = None

    def with_row_map(self, checks: list[CheckResult]) -> list[CheckResult]:
        return [c for c in (self.row_map, self.layout_map) if c is not None] + checks


def rows_in_layout(ctx: Ctx, stage: str, s: Slots, n_rows: int) -> tuple[Slots, CheckResult | None]:
    """Keep the slots whose row the grouped layout `stage` read gives their own expert (the
    golden's local expert of the slot); a failed check for the others. A psum GEMM leaves gap
    rows unspecified and an m_indices GEMM computes a -1 row with no expert, so a slot sitting
    there (a permute that misplaced it, chained) has no output to compare."""
    experts = row_experts(ctx, tested_layout(ctx, stage), n_rows)
    if experts is None or len(s) == 0:
        return s, None
    g_m = tensor_of(ctx.golden, Stage.PERMUTE, "m_indices", ctx.device).to(torch.int64)
    want, got = g_m[s.gold_rows], experts[s.other_rows]
    bad = got != want
    if not bool(bad.any()):
        return s, None
    i = int(torch.nonzero(bad)[0, 0])
    count, layout = int(bad.sum()), tested_layout(ctx, stage)
    result = CheckResult(
        "layout rows",
        False,
        count,
        0,
        LAYOUT_REASON,
        slot_worst(ctx, s, i, golden=int(want[i]), other=int(got[i])),
        f"{count} of {len(s)} live slots sit on rows the {layout} layout {stage} read gives "
        f"no output of theirs; first: {slot_name(ctx, s, i)} -> row {int(s.other_rows[i])}, "
        f"local expert {int(got[i])} there (-1: none), golden local expert {int(want[i])}",
        beyond={"slots": count},
    )
    return s.select(~bad), with_rows(result, bad, partial(slot_worst, ctx, s))


def gemm_rows(ctx: Ctx, stage: str, name: str) -> Keyed | CheckResult:
    """gemm1 / gemm2: the `name` rows of every live slot, or the failed shape check. Rows are
    keyed through the permute the stage read, and must be rows its grouped layout computes for
    the slot's expert (`rows_in_layout`)."""
    s = downstream_slots(ctx)
    g, o = ctx.pair(stage, name)
    if o.dim() != 2 or o.shape[1] != g.shape[1]:
        return shape_fail(ctx, name, o, g)
    s, row_map = rows_in_range(ctx, s, o.shape[0], name)
    s, layout_map = rows_in_layout(ctx, stage, s, o.shape[0])
    return Keyed(
        o[s.other_rows],
        g[s.gold_rows],
        partial(slot_worst, ctx, s),
        _LIVE_ROWS,
        row_map,
        layout_map,
    )


@dataclass(frozen=True)
class QuantRows:
    """act_quant's live rows on both sides: fp8 codes [L, I] (uint8) and their per-group scales
    [L, I/group] (float64), row i of each the same (token, k) slot."""

    codes: tuple[torch.Tensor, torch.Tensor]  # (other, golden)
    scales: tuple[torch.Tensor, torch.Tensor]  # (other, golden)
    group: int
    locate: Callable[[int], Worst]
    row_map: CheckResult | None

    @cached_property
    def scale_differs(self) -> torch.Tensor:
        """bool [L, I/group]: the two sides' scales of a group differ."""
        sa, sb = self.scales
        return ~(sa == sb)

    @cached_property
    def distances(self) -> torch.Tensor:
        """float64 [L, I]: e4m3 code steps where the group's scales agree, else the value distance
        in e4m3 ulps at the coarser scale."""
        qa, qb = self.codes
        same_scale = (~self.scale_differs).repeat_interleave(self.group, dim=1)
        sa_el, sb_el = self.element_scales
        return torch.where(
            same_scale,
            fp8_code_distance(qa, qb).to(torch.float64),
            fp8_value_distance(qa, sa_el, qb, sb_el),
        )

    @cached_property
    def element_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each element's scale, (other, golden) [L, I]."""
        return (
            self.scales[0].repeat_interleave(self.group, dim=1),
            self.scales[1].repeat_interleave(self.group, dim=1),
        )

    def values(self) -> Keyed:
        """The dequantized values q x scale (fp32), as keyed rows."""
        (qa, qb), (sa, sb) = self.codes, self.scales
        a = _dequantize_codes(qa, sa, self.group)
        b = _dequantize_codes(qb, sb, self.group)
        return Keyed(a, b, self.locate, _LIVE_ROWS, self.row_map)


def act_quant_rows(ctx: Ctx) -> QuantRows | CheckResult:
    """act_quant: the a2q codes and a2q_scale scales of every live slot, or the failed shape
    check."""
    s = downstream_slots(ctx)
    g_q, o_q = (fp8_codes(q) for q in ctx.pair(Stage.ACT_QUANT, "a2q"))
    if o_q.dim() != 2 or o_q.shape[1] != g_q.shape[1]:
        return shape_fail(ctx, "a2q", o_q, g_q)
    group = ctx.problem.recipe.act_group
    groups = g_q.shape[1] // group
    g_s, o_s = ctx.pair(Stage.ACT_QUANT, "a2q_scale")
    if o_s.dim() != 2:
        return shape_fail(ctx, "a2q_scale", o_s, g_s)
    s, row_map = rows_in_range(ctx, s, min(o_q.shape[0], o_s.shape[0]), "a2q / a2q_scale")
    # Only the live slots' rows are read: padding rows are unspecified, a kernel may never write
    # them, and reading them is what compute-sanitizer's initcheck reports (it did, on the H200).
    return QuantRows(
        (o_q[s.other_rows], g_q[s.gold_rows]),
        (scale_values(o_s[s.other_rows], groups), scale_values(g_s[s.gold_rows], groups)),
        group,
        partial(slot_worst, ctx, s),
        row_map,
    )


def token_rows(ctx: Ctx, stage: str) -> Keyed | CheckResult:
    """gather / shared / reduce: out [M, H], one row per token, or the failed shape check.
    reduce is the sum over ranks, so its coordinates name the global token and no rank."""
    g, o = ctx.pair(stage, "out")
    if o.shape != g.shape:
        return shape_fail(ctx, "out", o, g)
    rank = None if stage == Stage.REDUCE else ctx.rank

    def locate(t: int) -> Worst:
        return Worst(token=ctx.token(t) if rank is not None else t, rank=rank)

    return Keyed(o, g, locate, "tokens")


def bounded_values(ctx: Ctx, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tested, golden) values of a bounded stage as its checks read them; a ContractError when
    they cannot all be keyed (shape off contract, or a live slot's row outside the tested tensor).
    """
    if stage in GEMM_OUTPUT:
        keyed = gemm_rows(ctx, stage, GEMM_OUTPUT[stage])
    elif stage == Stage.ACT_QUANT:
        rows = act_quant_rows(ctx)
        keyed = rows if isinstance(rows, CheckResult) else rows.values()
    elif stage in TOKEN_STAGES:  # the gather in its route's routed-scaling reading
        keyed = token_rows(gather_in_reading(ctx) if stage == Stage.GATHER else ctx, stage)
    else:
        raise ValueError(f"{stage} is not a bounded stage; keyed values exist for {_BOUNDED}")
    failed = keyed if isinstance(keyed, CheckResult) else (keyed.row_map or keyed.layout_map)
    if failed is not None:
        raise ContractError(f"{stage} rows cannot be keyed by (token, k): {failed.detail}")
    assert isinstance(keyed, Keyed)
    return keyed.other, keyed.golden


def _dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """fp8 e4m3 codes (uint8) x per-group scales -> fp32 values."""
    values = (
        codes.view(torch.float8_e4m3fn).float() if codes.dtype == torch.uint8 else codes.float()
    )
    return values * scales.float().repeat_interleave(group, dim=1)


# GEMMs -------------------------------------------------------------------------------------------


def gemm_checks(ctx: Ctx, stage: str, name: str) -> list[CheckResult]:
    """The layout the problem forces (if it forces one), then the live rows: bounded against the
    golden's fp32 dequant math, or, where the golden carries the tensor-core recipe of the stage
    (isolated mode, or chained against its SM90 chain; `tensor_core_keys`), bit for bit against
    it with the bound reported beside."""
    forced = layout_check(ctx, stage)
    hardware = tensor_core_keys(ctx, stage)
    exact = ctx
    if hardware is not None and sm90_chain(ctx.golden):  # the chain's own outputs are the model's
        fp32 = golden_recipes(ctx.golden, stage)[GemmRecipe.FP32_DEQUANT]
        exact = dataclasses.replace(ctx, golden=golden_as(ctx.golden, stage, fp32))
    keyed = gemm_rows(exact, stage, name)
    if isinstance(keyed, CheckResult):
        return [keyed]
    checks = bounded_checks(exact, keyed.other, keyed.golden, keyed.locate, keyed.rows)
    if hardware is not None:
        checks = tensor_core_checks(ctx, stage, name, hardware, checks)
    checks = keyed.with_row_map(checks)
    return checks if forced is None else [forced, *checks]


def row_rel_error_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 [R, N]: |a - b| / rowmax|b| per element (0 where equal, Inf on a zero row)."""
    err = (a.to(torch.float64) - b.to(torch.float64)).abs().nan_to_num(nan=float("inf"))
    scaled = err / row_max(b)
    return torch.where(err == 0, torch.zeros_like(scaled), scaled)


def tensor_core_keys(ctx: Ctx, stage: str) -> dict[str, str] | None:
    """{output name: golden trace key} of the golden's tensor-core recipe of GEMM `stage`: in
    isolated mode where the harness added it (moe_verify/run/sm90_chain.py), chained where the
    golden is its SM90 chain (`sm90_chain`: every stage computed as SM90 does); else None. A
    chained GEMM of any other golden reads its own upstream, on which the recipe was not
    computed."""
    if ctx.mode is not Mode.ISOLATED and not sm90_chain(ctx.golden):
        return None
    return golden_recipes(ctx.golden, stage).get(GemmRecipe.TENSOR_CORE)


def tensor_core_checks(
    ctx: Ctx, stage: str, name: str, keys: dict[str, str], bounded: list[CheckResult]
) -> list[CheckResult]:
    """NaN/Inf, then the verdict: every live element bit for bit against the tensor-core recipe
    (policy TENSOR_CORE_GEMM), its detail ending with the `bounded` checks against fp32 dequant
    math (how far the arithmetic is from exact math, reported only)."""
    hw = dataclasses.replace(ctx, golden=golden_as(ctx.golden, stage, keys), check=TENSOR_CORE_GEMM)
    keyed = gemm_rows(hw, stage, name)
    if isinstance(keyed, CheckResult):
        return [keyed]
    a, b = keyed.other, keyed.golden
    differ = bits(a) != bits(b) if a.dtype == b.dtype else torch.ones_like(a, dtype=torch.bool)
    count, total = int(differ.sum()), differ.numel()
    worst, note = None, ""
    if count:
        # The worst is the largest move relative to its row (a bf16 ulp count would favour the
        # cancelling outputs near zero, where a tiny error is thousands of ulps).
        moved = row_rel_error_matrix(a, b).masked_fill(~differ, -1.0)
        r, c = argmax_coords(moved)
        worst = dataclasses.replace(
            keyed.locate(r), column=c, golden=float(b[r, c]), other=float(a[r, c])
        )
        ulps = int(bf16_ulp_distance(a[r, c], b[r, c]))
        note = (
            f"; worst at {worst.coords()}: tensor core {float(b[r, c])!r}, {ctx.name} "
            f"{float(a[r, c])!r} ({ulps} bf16 ulps, {float(moved[r, c]):.3g} x rowmax)"
        )
    exact = "; ".join(
        f"{bc.name}: {bc.detail} (limit {bc.limit:g}{'' if bc.passed else ', exceeded'})"
        for bc in bounded[1:]
    )
    detail = (
        f"{count} of {total} live elements differ from the tensor-core recipe bit for bit{note}; "
        f"vs fp32 dequant math, reported only: {exact}"
    )
    verdict = CheckResult(
        f"{name} bits",
        count == 0,
        count,
        0,
        TENSOR_CORE_GEMM.reason,
        worst,
        detail,
        recipe=GemmRecipe.TENSOR_CORE.value,
        beyond=counted(differ, keyed.rows),
    )
    return [bounded[0], with_rows(verdict, differ, keyed.locate)]


# act_quant ---------------------------------------------------------------------------------------


def act_quant_finite(ctx: Ctx, rows: QuantRows) -> CheckResult:
    """NaN codes, and scales that are NaN/Inf (an E8M0 0xFF byte reads as NaN)."""
    (qa, qb), (sa, sb) = rows.codes, rows.scales
    finite = nonfinite_check(ctx, qa, qb, rows.locate, _LIVE_ROWS)
    bad_scales = int((~torch.isfinite(sa)).sum() + (~torch.isfinite(sb)).sum())
    if not bad_scales:
        return finite
    return dataclasses.replace(
        finite,
        passed=False,
        value=finite.value + bad_scales,
        detail=finite.detail + f"; {bad_scales} non-finite scales",
        beyond={**finite.beyond, "scales": bad_scales},
    )


def scale_flips(ctx: Ctx, rows: QuantRows) -> CheckResult:
    """The share of live scale groups whose scale differs."""
    sa, sb = rows.scales
    differ = rows.scale_differs
    n_groups = differ.numel()
    flips = int(differ.sum())
    at = first_true(differ)
    worst = None
    if at is not None:
        worst = dataclasses.replace(
            rows.locate(at[0]), column=at[1] * rows.group, golden=float(sb[at]), other=float(sa[at])
        )
    result = bound_check(
        "scale flips",
        flips / n_groups if n_groups else 0.0,
        ctx.check.limit("scale_flip_frac"),
        worst,
        f"{flips} of {n_groups} live scale groups differ",
        counted(differ, _LIVE_ROWS, "scale groups"),
    )
    return with_rows(result, differ, rows.locate)


def scale_step(ctx: Ctx, rows: QuantRows) -> CheckResult:
    """How far a differing scale moved, relative to the smaller of the two."""
    sa, sb = rows.scales
    differ = rows.scale_differs
    step = ((sa - sb).abs() / torch.minimum(sa, sb)).masked_fill(~differ, 0.0)
    step = torch.where(differ & torch.isnan(step), torch.full_like(step, float("inf")), step)
    at = argmax_coords(step)
    value, worst = 0.0, None
    if at is not None and bool(differ.any()):
        value = float(step[at])
        worst = dataclasses.replace(
            rows.locate(at[0]), column=at[1] * rows.group, golden=float(sb[at]), other=float(sa[at])
        )
    limit = ctx.check.limit("scale_step")
    over = ~(step <= limit.value)
    result = bound_check(
        "scale step",
        value,
        limit,
        worst,
        f"largest |s_a - s_b| / min(s_a, s_b) over differing groups: {value:.4g}",
        counted(over, _LIVE_ROWS, "scale groups"),
    )
    return with_rows(result, over, rows.locate)


def code_distance(ctx: Ctx, rows: QuantRows) -> CheckResult:
    """The largest move of an fp8 code (steps, or ulps at the coarser scale where a scale
    flipped), with the dequantized values of the worst element."""
    (qa, qb), (sa_el, sb_el) = rows.codes, rows.element_scales
    dist = rows.distances
    at = argmax_coords(dist)
    value, worst, note = 0.0, None, ""
    if at is not None:
        value = float(dist[at])
        worst = dataclasses.replace(
            rows.locate(at[0]),
            column=at[1],
            golden=fp8_value(qb[at]) * float(sb_el[at]),
            other=fp8_value(qa[at]) * float(sa_el[at]),
        )
        note = (
            f"; worst: code 0x{int(qa[at]):02x} vs golden 0x{int(qb[at]):02x} "
            "(dequantized values shown)"
        )
    limit = ctx.check.limit("code_dist")
    over = ~(dist <= limit.value)
    result = bound_check(
        "code distance",
        value,
        limit,
        worst,
        f"max {value:.3g} e4m3 steps (ulps at the coarser scale where a scale flipped){note}",
        counted(over, _LIVE_ROWS, "codes"),
    )
    return with_rows(result, over, rows.locate)


def code_fraction(ctx: Ctx, rows: QuantRows) -> CheckResult:
    """The share of live codes that moved at all."""
    dist = rows.distances
    differ = ~(dist == 0)
    moved = int(differ.sum())
    total = dist.numel()
    result = bound_check(
        "code fraction",
        moved / total if total else 0.0,
        ctx.check.limit("code_frac"),
        None,
        f"{moved} of {total} live codes differ",
        counted(differ, _LIVE_ROWS, "codes"),
    )
    return with_rows(result, differ, rows.locate)


def dequantized_value_checks(ctx: Ctx, rows: QuantRows) -> list[CheckResult]:
    """Chained: q x scale bounded like a GEMM output (act_quant_finite has counted NaN/Inf)."""
    values = rows.values()
    return bounded_checks(ctx, values.other, values.golden, values.locate, values.rows)[1:]


def _code_checks(ctx: Ctx, rows: QuantRows) -> list[CheckResult]:
    return [
        scale_flips(ctx, rows),
        scale_step(ctx, rows),
        code_distance(ctx, rows),
        code_fraction(ctx, rows),
    ]


# The policy's check kind picks the ruler: codes and scales on the same upstream (isolated), the
# dequantized values after a chained GEMM1, where code distance is the wrong ruler
# (docs/tolerance.md#act-quant-chained).
_ACT_QUANT_RULERS: dict[str, Callable[[Ctx, QuantRows], list[CheckResult]]] = {
    "act_quant": _code_checks,
    "act_quant_values": dequantized_value_checks,
}


def act_quant_checks(ctx: Ctx) -> list[CheckResult]:
    """act_quant against the legitimate kernel recipe the tested side matches (or declares):
    packed, colmajor or bf16_steps, whichever apply to the problem."""
    return match_recipe(ctx, Stage.ACT_QUANT, act_quant_against)


def act_quant_against(ctx: Ctx) -> tuple[list[CheckResult], float]:
    """act_quant's checks against the golden of `ctx` (one recipe's outputs), and how many live
    codes and scale groups differ from it bit for bit."""
    rows = act_quant_rows(ctx)
    if isinstance(rows, CheckResult):
        return [rows], float("inf")
    ruler = _ACT_QUANT_RULERS.get(ctx.check.kind)
    if ruler is None:
        raise ValueError(
            f"policy gives act_quant a {ctx.check.kind!r} check; it takes {list(_ACT_QUANT_RULERS)}"
        )
    checks = [act_quant_finite(ctx, rows), *ruler(ctx, rows)]
    (qa, qb) = rows.codes
    differing = int((qa != qb).sum()) + int(rows.scale_differs.sum())
    return ([rows.row_map, *checks] if rows.row_map else checks), float(differing)


# Per-token outputs -------------------------------------------------------------------------------


def gather_against(ctx: Ctx) -> tuple[list[CheckResult], float]:
    """gather's checks against the golden of `ctx` (one recipe's outputs), and how many live
    elements differ from it bit for bit."""
    keyed = token_rows(ctx, Stage.GATHER)
    if isinstance(keyed, CheckResult):
        return [keyed], float("inf")
    checks = ulp_checks(ctx, keyed.other, keyed.golden, keyed.locate, keyed.rows)
    return checks, float((keyed.other != keyed.golden).sum())


def token_output_checks(ctx: Ctx, stage: str) -> list[CheckResult]:
    """gather / shared / reduce: out [M, H] per element and per token; the gather against its
    legitimate recipes (reference/recipes.py gather_recipes) in the routed-scaling reading of the
    route it read (`gather_in_reading`)."""
    kind = ctx.check.kind
    if stage == Stage.GATHER:
        ctx = gather_in_reading(ctx)
    if kind == "gather" and stage == Stage.GATHER:
        return match_recipe(ctx, stage, gather_against)
    keyed = token_rows(ctx, stage)
    if isinstance(keyed, CheckResult):
        return [keyed]
    if kind == "gather":  # the shared experts held bit for bit (SHARED_BITWISE)
        return ulp_checks(ctx, keyed.other, keyed.golden, keyed.locate, keyed.rows)
    if kind in ("gemm", "reduce"):
        return bounded_checks(ctx, keyed.other, keyed.golden, keyed.locate, keyed.rows)
    raise ValueError(f"policy gives {stage} a {kind!r} check; it takes gather, gemm or reduce")
