"""The comparer of permute (and dispatch seen as a contiguous layout): every live slot's row,
segment and bytes, both layouts one plan, and the padding contract of the layout the tested
GEMMs read. Takes a comparison context and returns its checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property, partial

import torch

from moe_verify.spec import GroupedLayout, Stage, round_up
from tolerance.metrics import (
    Mismatch,
    fp8_codes,
    mismatch_of,
)
from tolerance.results import CheckResult, Worst
from tolerance.stages.checks import (
    decode_scale,
    exact_check,
    exact_int_vector,
    fp8_value,
    shape_fail,
    take_rows,
    with_rows,
)
from tolerance.stages.context import (
    Ctx,
    Slots,
    int_of,
    live_slots,
    slot_name,
    slot_worst,
    tensor_of,
)
from tolerance.stages.layouts import (
    E8M0_NAN,
    comparable_scale_codes,
    consumed,
    fp32_to_e8m0,
    layout_check,
    psum_row_experts,
    tested_layout,
    tested_m_indices,
    unpack_ue8m0,
)


@dataclass(frozen=True)
class PermuteRows:
    """Where the tested permute put the golden's live slots.

    slots: the live slots, other rows from the tested inv_perm; m_indices: (golden, other) int64
    [M_sum]; in_range / shared: bool [L], the slot's row lies in [0, M_sum) / is claimed by
    another slot too.
    """

    slots: Slots
    m_indices: tuple[torch.Tensor, torch.Tensor]
    in_range: torch.Tensor
    shared: torch.Tensor

    @property
    def m_sum(self) -> int:
        return self.m_indices[1].numel()

    @property
    def rows(self) -> torch.Tensor:
        """int64 [L]: each live slot's row in the tested buffers."""
        return self.slots.other_rows

    @property
    def invalid(self) -> torch.Tensor:
        """bool [L]: slots without a row of their own (their row contents are not compared)."""
        return ~self.in_range | self.shared

    @cached_property
    def padding(self) -> torch.Tensor:
        """bool [M_sum]: rows claimed by no live slot."""
        claimed = torch.zeros(self.m_sum, dtype=torch.bool, device=self.rows.device)
        claimed[self.rows[self.in_range]] = True
        return ~claimed


def permute_rows(ctx: Ctx) -> PermuteRows:
    """The tested permute's m_indices and the row each live slot maps to, read once for all the
    permute checks."""
    g_m = tensor_of(ctx.golden, Stage.PERMUTE, "m_indices", ctx.device).to(torch.int64)
    o_m, _ = tested_m_indices(ctx)
    s = live_slots(ctx.golden, ctx.other, ctx.device)
    rows, m_sum = s.other_rows, o_m.numel()
    in_range = (rows >= 0) & (rows < m_sum)
    hits = take_rows(torch.bincount(rows[in_range], minlength=m_sum), rows)
    return PermuteRows(s, (g_m, o_m), in_range, in_range & (hits > 1))


@dataclass(frozen=True)
class PermutedScales:
    """a_scale_perm of both sides as comparable int64 codes [M_sum, groups], and their kind."""

    stored: torch.Tensor  # the tested side's a_scale_perm as returned
    codes: tuple[torch.Tensor, torch.Tensor]  # (other, golden)
    kind: str
    groups: int
    group: int


def permuted_scales(ctx: Ctx, layout: PermuteRows) -> PermutedScales | CheckResult:
    """Both sides' scale groups that exist (pad bytes of packed words ignored), or the failed
    shape check."""
    hidden = tensor_of(ctx.golden, Stage.PERMUTE, "a_perm", ctx.device).shape[1]
    group = ctx.problem.recipe.act_group
    groups = hidden // group
    g_s, o_s = ctx.pair(Stage.PERMUTE, "a_scale_perm")
    if layout.m_sum and o_s.shape[0] != layout.m_sum:
        return shape_fail(ctx, "a_scale_perm", o_s, g_s)
    o_codes, g_codes, kind = comparable_scale_codes(o_s, g_s, groups)
    return PermutedScales(o_s, (o_codes, g_codes), kind, groups, group)


def _segment_ends(ctx: Ctx) -> torch.Tensor | None:
    """int64 [E_l]: where each golden expert segment ends (start_e + round_up(count_e, A)); None
    for a layout without segments (the batched one, seen as contiguous)."""
    if Stage.ALIGN not in ctx.golden or "expert_start" not in ctx.golden[Stage.PERMUTE]:
        return None
    starts = tensor_of(ctx.golden, Stage.PERMUTE, "expert_start", ctx.device).to(torch.int64)
    counts = tensor_of(ctx.golden, Stage.ALIGN, "counts", ctx.device).to(torch.int64)
    align = int_of(ctx.golden, Stage.ALIGN, "alignment")
    return starts + round_up(counts, align)


def _row_segments(ctx: Ctx, rows: int) -> tuple[torch.Tensor, int] | None:
    """int64 [rows]: the golden segment each row lies in (local expert e for rows
    [start_e, start_e + round_up(count_e, A)), E_l for the tail past the last segment), and E_l;
    None for a layout without segments (the batched one, seen as contiguous)."""
    ends = _segment_ends(ctx)
    if ends is None:
        return None
    return torch.bucketize(torch.arange(rows, device=ctx.device), ends, right=True), ends.numel()


def _segment_owned(
    golden: torch.Tensor, other: torch.Tensor, segment: tuple[torch.Tensor, int] | None
) -> torch.Tensor:
    """bool [rows]: padding rows of a segment (golden -1) that the tested side marks with that
    segment's expert. DeepGEMM reads a tile's expert from its first row and computes every row of
    the tile (SM100; SM90 skips a 64-row slice only when its first row is -1), so a padding row
    marked with its own segment's expert is computed and left unread, like a -1 row: a legitimate
    convention (LMDeploy's `ep_scatter_fp8`; docs/stage-contract.md#permute-and-padding). The tail
    past the last segment must still hold -1."""
    if segment is None:
        return torch.zeros_like(golden, dtype=torch.bool)
    seg, experts = segment
    return (golden == -1) & (seg < experts) & (other == seg)


SEGMENT_OWNED_PADDING = "segment_owned_padding"


def m_indices_check(ctx: Ctx) -> CheckResult:
    """Per expert segment: its live rows hold the expert and its padding -1 or the segment's own
    expert, and every row past the last segment holds -1. Segments sit where the counts and A put
    them, so a tested M_sum longer or shorter than the golden's compares only the rows it has
    beyond the segments. A psum-only permute is read through its expert_ends."""
    g_m = tensor_of(ctx.golden, Stage.PERMUTE, "m_indices", ctx.device).to(torch.int64)
    o_m, source = tested_m_indices(ctx)
    rows = max(g_m.numel(), o_m.numel())
    g_full = torch.nn.functional.pad(g_m, (0, rows - g_m.numel()), value=-1)
    o_full = torch.nn.functional.pad(o_m, (0, rows - o_m.numel()), value=-1)
    segment = _row_segments(ctx, rows)
    owned = _segment_owned(g_full, o_full, segment)
    bad = (g_full != o_full) & ~owned
    sizes = f"{ctx.name} M_sum {o_m.numel()}, golden {g_m.numel()}{source}"
    if segment is None:
        mm = mismatch_of(bad)
        worst, note = None, ""
        if mm.first is not None:
            (r,) = mm.first
            worst = Worst(rank=ctx.rank, golden=int(g_full[r]), other=int(o_full[r]), row=r)
            note = f"; first: row {r}: golden {int(g_full[r])}, {ctx.name} {int(o_full[r])}"
        what = f"rows' local experts differ ({sizes})"
        return exact_check("m_indices", mm, what, ctx.check.reason, worst, note, "rows")
    seg, experts = segment
    bad_segments = torch.unique(seg[bad])
    worst, note = None, ""
    if bad_segments.numel():
        r = int(torch.nonzero(bad)[0, 0])
        e = int(seg[r])
        where = f"local expert {e}'s segment" if e < experts else "the tail past the segments"
        worst = Worst(rank=ctx.rank, golden=int(g_full[r]), other=int(o_full[r]), row=r)
        note = (
            f"; first: {where}, {int((seg[bad] == e).sum())} rows differ, row {r}: golden "
            f"{int(g_full[r])}, {ctx.name} {int(o_full[r])}"
        )
    mm = Mismatch(bad_segments.numel(), experts + 1, None)
    what = f"expert segments (and the tail) hold other experts or padding ({sizes})"
    result = exact_check("m_indices", mm, what, ctx.check.reason, worst, note, "segments")
    result = replace(result, beyond={"rows": int(bad.sum()), "segments": mm.count})
    n_owned = int(owned.sum())
    if not n_owned:
        return result
    return replace(
        result,
        detail=f"{result.detail}; {n_owned} padding rows hold their segment's expert",
        recipe=SEGMENT_OWNED_PADDING,
    )


def expert_ends_check(ctx: Ctx) -> CheckResult:
    """The psum layout: each local expert's live rows end where the golden's do."""
    return exact_int_vector(
        ctx,
        Stage.PERMUTE,
        "expert_ends",
        "psum ends differ (start_e + count_e)",
        ctx.check.reason,
        "local expert",
    )


def layouts_agree_check(ctx: Ctx, layout: PermuteRows) -> CheckResult:
    """The tested side's two grouped layouts are one plan: the rows its expert_ends give each
    expert (DeepGEMM's psum reading) are exactly the rows its m_indices name, except padding rows
    (claimed by no live slot) that m_indices marks with their segment's expert."""
    o_m = tensor_of(ctx.other, Stage.PERMUTE, "m_indices", ctx.device).to(torch.int64)
    ends = tensor_of(ctx.other, Stage.PERMUTE, "expert_ends", ctx.device)
    align = int_of(consumed(ctx), Stage.ALIGN, "alignment")
    from_ends = psum_row_experts(ends, o_m.numel(), align)
    # A gap row marked with its own segment's expert is the index layout's padding convention
    # (`_segment_owned`); the segments here are the tested side's own.
    aligned = round_up(ends.to(torch.int64), align)
    rows = torch.arange(o_m.numel(), device=ctx.device)
    segment = (torch.bucketize(rows, aligned.to(ctx.device), right=True), ends.numel())
    owned = _segment_owned(from_ends, o_m, segment) & layout.padding
    mm = mismatch_of((from_ends != o_m) & ~owned)
    worst, note = None, ""
    if mm.first is not None:
        (r,) = mm.first
        worst = Worst(rank=ctx.rank, golden=int(from_ends[r]), other=int(o_m[r]), row=r)
        note = f"; first: row {r}: m_indices {int(o_m[r])}, expert_ends give {int(from_ends[r])}"
    what = f"rows where {ctx.name}'s m_indices and expert_ends disagree"
    return exact_check("layouts agree", mm, what, ctx.check.reason, worst, note, "rows")


def expert_start_check(ctx: Ctx) -> CheckResult:
    """Each local expert's segment starts where the golden's does."""
    return exact_int_vector(
        ctx,
        Stage.PERMUTE,
        "expert_start",
        "segment starts differ",
        ctx.check.reason,
        "local expert",
    )


def inv_perm_check(ctx: Ctx, layout: PermuteRows) -> CheckResult:
    """Every live slot owns one distinct row inside [0, M_sum)."""
    s, rows, bad = layout.slots, layout.rows, layout.invalid
    worst, note = None, ""
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        worst = slot_worst(ctx, s, i, other=int(rows[i]), golden=int(s.gold_rows[i]))
        why = (
            "is shared with another slot"
            if bool(layout.in_range[i])
            else f"is outside [0, {layout.m_sum})"
        )
        note = f"; first: {slot_name(ctx, s, i)} -> row {int(rows[i])}, which {why}"
    what = "live slots map to an invalid row"
    result = exact_check("inv_perm", mismatch_of(bad), what, ctx.check.reason, worst, note, "slots")
    return with_rows(result, bad, partial(slot_worst, ctx, s))


def a_perm_check(ctx: Ctx, layout: PermuteRows) -> CheckResult:
    """The row of each live slot holds the golden row's fp8 bytes."""
    g_a, o_a = (fp8_codes(a) for a in ctx.pair(Stage.PERMUTE, "a_perm"))
    m_sum = layout.m_sum
    if o_a.dim() != 2 or o_a.shape[1] != g_a.shape[1] or (m_sum and o_a.shape[0] != m_sum):
        return shape_fail(ctx, "a_perm", o_a, g_a)
    gr, orow = g_a[layout.slots.gold_rows], take_rows(o_a, layout.rows)
    diff = (gr != orow) & ~layout.invalid[:, None]
    return _slot_rows_check(
        ctx, layout.slots, diff, "a_perm rows", ctx.check.reason, gr, orow, fp8_value, "bytes"
    )


def a_scale_perm_check(ctx: Ctx, layout: PermuteRows, scales: PermutedScales) -> CheckResult:
    """The row of each live slot holds the golden row's scale groups, bit for bit."""
    o_codes, g_codes = scales.codes
    gr, orow = g_codes[layout.slots.gold_rows], take_rows(o_codes, layout.rows)
    diff = (gr != orow) & ~layout.invalid[:, None]
    decode = partial(decode_scale, kind=scales.kind)
    return _slot_rows_check(
        ctx,
        layout.slots,
        diff,
        "a_scale_perm rows",
        ctx.check.reason,
        gr,
        orow,
        decode,
        "scale groups",
        scales.group,
    )


def expert_rows_check(ctx: Ctx, layout: PermuteRows) -> CheckResult:
    """Per-expert row sets: each live slot sits in its expert's segment."""
    s, rows = layout.slots, layout.rows
    g_m, o_m = layout.m_indices
    expected, got = g_m[s.gold_rows], take_rows(o_m, rows)
    wrong = ~layout.invalid & (got != expected)
    worst, note = None, ""
    if bool(wrong.any()):
        i = int(torch.nonzero(wrong)[0, 0])
        worst = slot_worst(ctx, s, i, golden=int(expected[i]), other=int(got[i]))
        # -1: a row no expert claims (padding; in a batch, at or past its masked_m), so the
        # GEMM never reads the slot
        place = (
            "which no expert reads"
            if int(got[i]) < 0
            else f"of local expert {int(got[i])}'s segment"
        )
        note = (
            f"; first: {slot_name(ctx, s, i)} sits in row {int(rows[i])} {place}, golden local "
            f"expert {int(expected[i])}"
        )
    what = "live slots sit in another expert's segment or in one no expert reads"
    result = exact_check(
        "expert rows", mismatch_of(wrong), what, ctx.check.reason, worst, note, "slots"
    )
    return with_rows(result, wrong, partial(slot_worst, ctx, s))


def padding_m_indices_check(ctx: Ctx, layout: PermuteRows) -> CheckResult:
    """Rows claimed by no live slot hold m_indices -1 (DeepGEMM skips a slice whose first row is
    -1) or, inside an expert's segment, that segment's expert (`_segment_owned`)."""
    (g_m, o_m), pad = layout.m_indices, layout.padding
    rows = o_m.numel()
    g_full = torch.nn.functional.pad(g_m[:rows], (0, rows - min(rows, g_m.numel())), value=-1)
    owned = _segment_owned(g_full, o_m, _row_segments(ctx, rows))
    bad_pad = pad & (o_m != -1) & ~owned
    worst, note = None, ""
    if bool(bad_pad.any()):
        r = int(torch.nonzero(bad_pad)[0, 0])
        worst = Worst(rank=ctx.rank, golden=-1, other=int(o_m[r]), row=r)
        note = f"; first: row {r} holds {int(o_m[r])}"
    mism = Mismatch(int(bad_pad.sum()), int(pad.sum()), None)
    what = "padding rows (claimed by no live slot) hold neither -1 nor their segment's expert"
    return exact_check(
        "padding m_indices", mism, what, ctx.check.reason, worst, note, "padding rows"
    )


def padding_scales_check(
    ctx: Ctx, layout: PermuteRows, scales: PermutedScales
) -> CheckResult | None:
    """What DeepGEMM requires of the scales of rows claimed by no live slot, where it reads them,
    by format: packed bytes must not be 0xFF (NaN to the kernel; a batch's rows past masked_m,
    never read, are free); fp32 scales rounded to UE8M0 must pass DeepGEMM's
    packer assert, `(bits & 0x807FFFFF) == 0` (a power of two or +0.0), since its SM100 packer
    reads every row and a violation traps the kernel (vLLM issue #49783). Plain fp32 scales reach
    only SM90's 1D2D kernel, which scales each row by its own scale: None, nothing to check."""
    stored, pad, group = scales.stored, layout.padding, scales.group
    if stored.dtype == torch.int32 and Stage.DISPATCH in ctx.golden:
        # Batches handed to DeepGEMM packed: its masked GEMM reads rows below masked_m only,
        # and no packer runs, so nothing reads the rows past it.
        return None
    if stored.dtype == torch.int32:
        codes = unpack_ue8m0(stored, scales.groups)
        bad = pad[:, None] & (codes == E8M0_NAN)
        what = "padding-row packed bytes are 0xFF (NaN to the kernel)"
    elif ctx.problem.scale_fmt.is_ue8m0:
        bad = pad[:, None] & (fp32_to_e8m0(stored) < 0)  # -1: no exact UE8M0 byte
        what = "padding-row fp32 scales are not a power of two or +0.0 (DeepGEMM's packer traps)"
    else:
        return None
    mism = mismatch_of(bad)
    worst, note = None, ""
    if mism.first is not None:
        r, c = mism.first
        other = int(codes[r, c]) if stored.dtype == torch.int32 else float(stored[r, c])
        want = None if stored.dtype == torch.int32 else 0.0
        worst = Worst(rank=ctx.rank, column=c * group, golden=want, other=other, row=r)
        note = f"; first: row {r}, group {c} holds {other}"
    return exact_check(
        "padding scales", mism, what, ctx.check.reason, worst, note, "scales", "padding rows"
    )


def permute_checks(ctx: Ctx) -> list[CheckResult]:
    """permute (and dispatch, seen as a contiguous layout): m_indices per segment, segment
    starts and psum ends exactly, both layouts one plan, each live slot's row, bytes, scales and
    segment, and the padding contract of the layout the backend's GEMMs read: with m_indices
    the padding scales DeepGEMM's SM100 packer reads (`padding_scales_check`); with psum the gap
    and tail rows are skipped by every consumer, so their scales are unspecified."""
    out = [m_indices_check(ctx)]
    # optional on the tested side (docs/stage-contract.md: checked when present)
    if "expert_start" in ctx.golden[Stage.PERMUTE] and "expert_start" in ctx.other[Stage.PERMUTE]:
        out.append(expert_start_check(ctx))
    layout = permute_rows(ctx)
    tested = ctx.other[Stage.PERMUTE]
    if "expert_ends" in ctx.golden[Stage.PERMUTE] and "expert_ends" in tested:
        out.append(expert_ends_check(ctx))
        if "m_indices" in tested:
            out.append(layouts_agree_check(ctx, layout))
    forced = layout_check(ctx, Stage.PERMUTE)
    out += [] if forced is None else [forced]
    out += [inv_perm_check(ctx, layout), a_perm_check(ctx, layout)]
    scales = permuted_scales(ctx, layout)  # or the failed shape check, reported in its place
    if isinstance(scales, CheckResult):
        return [*out, scales, expert_rows_check(ctx, layout), padding_m_indices_check(ctx, layout)]
    out += [
        a_scale_perm_check(ctx, layout, scales),
        expert_rows_check(ctx, layout),
        padding_m_indices_check(ctx, layout),
    ]
    padding = padding_scales_check(ctx, layout, scales)
    if tested_layout(ctx, Stage.PERMUTE) is GroupedLayout.PSUM or padding is None:
        return out
    return [*out, padding]


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
    result = exact_check(name, mism, "live slots' rows differ", reason, worst, note, "slots")
    result = replace(result, beyond={unit: int(diff.sum()), "slots": mism.count})
    return with_rows(result, bad_slots, partial(slot_worst, ctx, s))
