"""The generic check builders every stage comparer shares: bound and exact checks, the NaN/Inf,
per-element (atol x rowmax + rtol), per-row and bf16-ulp checks with their worst coordinates, and
the small value helpers their messages use. The context they read is `tolerance.stages.context`."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

import torch

from tolerance.metrics import (
    Mismatch,
    argmax_coords,
    bf16_ulp_distance,
    calc_diff,
    e4m3_value,
    excess_ratio,
    first_rows,
    first_true,
    host_ints,
    int_mismatch,
    nan_inf_counts,
    nonfinite,
    row_max,
    row_rel_error,
)
from tolerance.policy import CONTRACT_REASON, NONFINITE_REASON, Limit
from tolerance.results import FIRST_ROWS, CheckResult, Worst
from tolerance.stages.context import Ctx

# Values and rows --------------------------------------------------------------------------------


def py_scalar(x: torch.Tensor) -> float | int:
    """One element as a Python number."""
    return float(x) if x.is_floating_point() else int(x)


def fp8_value(code: torch.Tensor) -> float:
    """The e4m3 value of one fp8 code, for display."""
    return float(e4m3_value(code.reshape(1))[0])


def decode_scale(code: int | torch.Tensor, kind: str) -> float | int:
    """A scale code (an int or one-element tensor) for display: fp32 raw bits -> the float;
    E8M0 bytes stay bytes, as a Python int."""
    code = int(code)
    if kind == "fp32":
        return struct.unpack("<f", struct.pack("<I", code & 0xFFFFFFFF))[0]
    return code


def row_unit(rows: str) -> str:
    """What one row of a compared [rows, N] tensor counts as in a check's `beyond`: 'slots' for
    live (token, k) rows, 'tokens' for per-token outputs, else 'rows'."""
    if "token, k" in rows:
        return "slots"
    return "tokens" if "token" in rows else "rows"


def counted(mask: torch.Tensor, rows: str, unit: str = "elements") -> dict[str, int]:
    """A check's `beyond` from a bool [rows, N] mask of what is beyond its bound: the elements,
    and the rows (slots, tokens) holding one."""
    if mask.dim() < 2:
        return {unit: int(mask.sum())}
    elements, held = host_ints(mask.sum(), mask.flatten(1).any(dim=1).sum())
    return {unit: elements, row_unit(rows): held}


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] with out-of-range rows clamped (callers mask them): [len(rows), *x.shape[1:]]."""
    if x.shape[0] == 0:
        return torch.zeros((rows.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    return x[rows.clamp(0, x.shape[0] - 1)]


def with_rows(
    check: CheckResult, mask: torch.Tensor, locate: Callable[[int], Worst]
) -> CheckResult:
    """A failed `check` naming its first rows beyond the bound (CheckResult.first_rows): the rows
    of the bool mask [rows, ...] holding a True, located by `locate`; a passing one unchanged."""
    if check.passed:
        return check
    return dataclasses.replace(
        check, first_rows=tuple(locate(r) for r in first_rows(mask, FIRST_ROWS))
    )


# Check builders ---------------------------------------------------------------------------------


def bound_check(
    name: str,
    value: float,
    limit: Limit,
    worst: Worst | None,
    detail: str,
    beyond: dict[str, int] | None = None,
) -> CheckResult:
    """value <= limit; the worst coordinates are dropped when nothing differs at all. `beyond`:
    how many units exceed the bound, by unit (CheckResult.beyond)."""
    worst = None if value == 0 else worst
    return CheckResult(
        name,
        bool(value <= limit.value),
        value,
        limit.value,
        limit.reason,
        worst,
        detail,
        beyond=beyond or {},
    )


def exact_check(
    name: str,
    mism: Mismatch,
    what: str,
    reason: str,
    worst: Worst | None,
    note: str = "",
    unit: str = "elements",
    row_unit: str | None = None,
) -> CheckResult:
    """value = mismatch count, limit 0; detail '<count> of <total> <what><note>'. `unit` names
    what the mismatch counts (codes, slots, rows) and `row_unit` what a row of a 2-D mismatch
    is (tokens), for the check's `beyond`."""
    detail = f"{mism.count} of {mism.total} {what}{note if mism.count else ''}"
    beyond = {unit: mism.count}
    if row_unit is not None and mism.rows is not None:
        beyond[row_unit] = mism.rows
    return CheckResult(
        name,
        mism.count == 0,
        mism.count,
        0,
        reason,
        worst if mism.count else None,
        detail,
        beyond=beyond,
    )


def shape_fail(ctx: Ctx, name: str, other: torch.Tensor, golden: torch.Tensor) -> CheckResult:
    """The failed '<name> shape' check: the tested side's dtype and shape against the golden's."""
    return CheckResult(
        f"{name} shape",
        False,
        1,
        0,
        CONTRACT_REASON,
        None,
        f"{ctx.name} {name} is {other.dtype} {tuple(other.shape)}, "
        f"golden {golden.dtype} {tuple(golden.shape)}",
    )


# Shared bounded / ulp comparisons ----------------------------------------------------------------


def nonfinite_check(
    ctx: Ctx, a: torch.Tensor, b: torch.Tensor, locate: Callable[[int], Worst], rows: str
) -> CheckResult:
    bad = nonfinite(a) | nonfinite(b)
    na, ia = nan_inf_counts(a)
    nb, ib = nan_inf_counts(b)
    at = first_true(bad)
    worst = None
    if at is not None:
        other = fp8_value(a[at]) if a.dtype == torch.uint8 else py_scalar(a[at])
        golden = fp8_value(b[at]) if b.dtype == torch.uint8 else py_scalar(b[at])
        worst = dataclasses.replace(locate(at[0]), column=at[1], golden=golden, other=other)
    result = CheckResult(
        "nan_inf",
        at is None,
        na + ia + nb + ib,
        0,
        NONFINITE_REASON,
        worst,
        f"{ctx.name}: {na} NaN, {ia} Inf; golden: {nb} NaN, {ib} Inf (in {a.shape[0]} {rows})",
        beyond=counted(bad, rows),
    )
    return with_rows(result, bad, locate)


def per_row_check(
    ctx: Ctx, a: torch.Tensor, b: torch.Tensor, locate: Callable[[int], Worst], rows: str
) -> CheckResult:
    limit = ctx.check.limit("row_err")
    values, cols = row_rel_error(a, b)
    at = argmax_coords(values)
    if at is None:
        return bound_check("per-token", 0.0, limit, None, f"no {rows}")
    r, c = at[0], int(cols[at[0]])
    worst = dataclasses.replace(
        locate(r), column=c, golden=py_scalar(b[r, c]), other=py_scalar(a[r, c])
    )
    over_rows = ~(values <= limit.value)
    over = int(over_rows.sum())
    detail = (
        f"{over} of {a.shape[0]} {rows} beyond max|a-b| <= {limit.value:g} x rowmax|golden|; "
        f"worst row error {float(values[r]):.4g}"
    )
    result = bound_check(
        "per-token", float(values[r]), limit, worst, detail, {row_unit(rows): over}
    )
    return with_rows(result, over_rows, locate)


def bounded_checks(
    ctx: Ctx, a: torch.Tensor, b: torch.Tensor, locate: Callable[[int], Worst], rows: str
) -> list[CheckResult]:
    """gemm / reduce: NaN/Inf, per element (atol x rowmax + rtol), per row, calc_diff."""
    check = ctx.check
    atol, rtol, outliers = check.limit("atol"), check.limit("rtol"), check.limit("mismatch_frac")
    out = [nonfinite_check(ctx, a, b, locate, rows)]

    ratio = excess_ratio(a, b, atol.value, rtol.value, row_max(b))
    beyond = ~(ratio <= 1.0)
    n_beyond, total = int(beyond.sum()), beyond.numel()
    frac = n_beyond / total if total else 0.0
    at = argmax_coords(ratio)
    worst, note = None, ""
    if at is not None and not bool(ratio[at] == 0):
        worst = dataclasses.replace(
            locate(at[0]), column=at[1], golden=py_scalar(b[at]), other=py_scalar(a[at])
        )
        err = abs(float(a[at]) - float(b[at]))
        note = f"; worst |a-b| = {err:.4g}, {float(ratio[at]):.3g}x the allowed error"
    elementwise = CheckResult(
        "elementwise",
        frac <= outliers.value,
        frac,
        outliers.value,
        f"|a-b| <= {atol.value:g} x rowmax|golden| + {rtol.value:g} x |golden|: rtol: "
        f"{rtol.reason}; atol: {atol.reason}; outliers: {outliers.reason}",
        worst,
        f"{n_beyond} of {total} elements beyond the bound{note}",
        beyond=counted(beyond, rows),
    )
    out.append(with_rows(elementwise, beyond, locate))
    out.append(per_row_check(ctx, a, b, locate, rows))
    cd = check.limit("calc_diff")
    value = calc_diff(a, b)
    out.append(
        bound_check("calc_diff", value, cd, None, f"calc_diff over {total} elements = {value:.3g}")
    )
    return out


def ulp_checks(
    ctx: Ctx, a: torch.Tensor, b: torch.Tensor, locate: Callable[[int], Worst], rows: str
) -> list[CheckResult]:
    """gather: NaN/Inf, per element bf16 ulps, per row."""
    limit = ctx.check.limit("ulp")
    out = [nonfinite_check(ctx, a, b, locate, rows)]
    ulp = bf16_ulp_distance(a, b)
    at = argmax_coords(ulp)
    value, worst, note = 0, None, ""
    if at is not None:
        value = int(ulp[at])
        worst = dataclasses.replace(
            locate(at[0]), column=at[1], golden=py_scalar(b[at]), other=py_scalar(a[at])
        )
        note = ctx.token_note(at[0]) if value > limit.value and worst.rank is not None else ""
    over_mask = ulp > limit.value
    over = int(over_mask.sum())
    detail = (
        f"{over} of {ulp.numel()} elements beyond {limit.value:g} bf16 ulp; max {value} ulp{note}"
    )
    ulp_check = bound_check("ulp", value, limit, worst, detail, counted(over_mask, rows))
    out.append(with_rows(ulp_check, over_mask, locate))
    out.append(per_row_check(ctx, a, b, locate, rows))
    return out


def exact_int_vector(
    ctx: Ctx, stage: str, name: str, what: str, reason: str, index_name: str | None = None
) -> CheckResult:
    """A 1-D integer entry of `stage` compared element for element (ids, counts, starts).

    index_name names what an index means in the failure note (e.g. "local expert"); the worst
    coordinates carry the row when the index is a row of a permuted buffer (index_name None).
    """
    g, o = (x.to(torch.int64) for x in ctx.pair(stage, name))
    if g.shape != o.shape:
        return shape_fail(ctx, name, o, g)
    mm = int_mismatch(o, g)
    worst, note = None, ""
    if mm.first is not None:
        (i,) = mm.first
        worst = Worst(
            rank=ctx.rank, golden=int(g[i]), other=int(o[i]), row=i if index_name is None else None
        )
        if index_name is not None:
            note = f"; first: {index_name} {i}: golden {int(g[i])}, {ctx.name} {int(o[i])}"
    unit = f"{index_name}s" if index_name is not None else "rows"
    return exact_check(name, mm, what, reason, worst, note, unit=unit)
