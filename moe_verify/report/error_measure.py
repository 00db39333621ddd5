"""Measuring a failure for its picture: `error_maps` runs inside verify's rank loop, while a rank's
traces still exist, and keeps only a small binned map (`moe_verify.report.error_map.ErrorMap`) per
failing stage; `moe_verify.report.plot` draws them (docs/plots.md).

Rows are the golden's: for the permuted stages its row order, grouped by expert segment, each live
(token, k) slot of the tested side placed at the golden's row of the same slot (row order inside a
segment is not deterministic, so rows are never matched by absolute index), padding rows left
undrawn; for the per-token stages one row per token. Columns are binned into scale blocks (128
wide, or the recipe's activation group for the quantized tensors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe_verify.report.error_map import ErrorMap, Measure, Segment
from moe_verify.run.runner import RankRun
from moe_verify.spec import (
    GEMM_OUTPUT,
    GroupedLayout,
    Mode,
    MoEProblem,
    Stage,
    TopologyKind,
    ceil_div,
)
from reference.topology import placement
from tolerance.metrics import bits, fp8_codes
from tolerance.policy import policy_for
from tolerance.results import ContractError
from tolerance.stages.context import Ctx, Slots, comparison_device, downstream_slots, live_slots
from tolerance.stages.layouts import (
    comparable_scale_codes,
    flatten_batched,
    psum_row_experts,
    scale_values,
    tested_layout,
)
from tolerance.stages.recipes import chained_copy_golden, declared_recipe, golden_as, golden_recipes

# Bounds of one panel, in cells: big cases are binned down to these (a DeepSeek-V3 rank has
# ~10^5 permuted rows and 56 column blocks). A panel has at least this many pixels each way, so
# no cell, and no single wrong row, is dropped when the image is drawn.
MAX_ROWS = 512
MAX_COLUMNS = 128
# Column block of the float outputs (GEMMs, gather): the 128-row weight scale block of fp8_block.
BLOCK = 128
# Elements per chunk of rows when measuring, so a large stage never allocates a full float32 copy.
_CHUNK_ELEMENTS = 1 << 24

_TOKEN_OUTPUTS = (Stage.GATHER, Stage.SHARED, Stage.REDUCE)


class _NoPicture(Exception):
    """The stage has no tensor pair to picture (not run, raised, or off the contract)."""


def error_maps(
    problem: MoEProblem, run: RankRun, mode: Mode, failing_stages: Sequence[str]
) -> list[ErrorMap]:
    """The error maps of `failing_stages` on one rank in `mode` (call it inside the rank loop,
    while `run` still holds the rank's traces). A stage with no tensor to picture (align, or one
    that either side skipped, raised or returned off the contract) gets no map."""
    mode = Mode(mode)
    if mode not in run.tested:
        raise ValueError(
            f"mode: expected one the rank ran ({[str(m) for m in run.tested]}), got {str(mode)!r}"
        )
    maps = []
    for stage in failing_stages:
        if stage not in _MEASURES:
            continue
        try:
            maps.append(_stage_map(problem, run, mode, Stage(stage)))
        except _NoPicture:
            continue
    return maps


def _stage_map(problem: MoEProblem, run: RankRun, mode: Mode, stage: Stage) -> ErrorMap:
    golden, tested = run.golden, run.tested[mode]
    for trace in (golden, tested):
        if trace.failure(stage) is not None:
            raise _NoPicture(f"{trace.backend} has no {stage} outputs")
    golden, tested = flatten_batched(golden), flatten_batched(tested)
    ctx = Ctx(
        golden,
        tested,
        problem,
        policy_for(stage, problem, mode),
        mode,
        comparison_device(golden, stage),
    )
    try:
        picture = _best_recipe(ctx, stage)
    except (ContractError, KeyError, ValueError, IndexError) as exc:
        raise _NoPicture(str(exc)) from exc
    return picture.binned(mode, stage, run.rank)


@dataclass(frozen=True)
class _Picture:
    """An unbinned map: cells [rows, C] (columns already grouped by `col_bin`)."""

    cells: torch.Tensor
    measure: Measure
    columns: int
    col_bin: int
    row_label: str
    col_label: str
    segments: tuple[Segment, ...] = ()
    split: int | None = None
    recipe: str | None = None

    def binned(self, mode: Mode, stage: str, rank: int) -> ErrorMap:
        reduce = "amax" if self.measure is Measure.RELATIVE else "mean"
        merge = max(1, ceil_div(self.cells.shape[1], MAX_COLUMNS))
        row_bin = max(1, ceil_div(self.cells.shape[0], MAX_ROWS))
        cells = _bin(_bin(self.cells, 1, merge, reduce), 0, row_bin, reduce)
        return ErrorMap(
            str(mode),
            str(stage),
            rank,
            cells.to("cpu", torch.float32),
            self.measure,
            self.cells.shape[0],
            self.columns,
            row_bin,
            self.col_bin * merge,
            self.row_label,
            self.col_label,
            self.segments,
            self.split,
            self.recipe,
        )

    def score(self) -> tuple[int, float]:
        """(lit cells, their sum): how far the tested side is from this picture's golden."""
        lit = self.cells > 0
        return int(lit.sum()), float(self.cells[lit].clamp(max=1e30).sum())


def _best_recipe(ctx: Ctx, stage: Stage) -> _Picture:
    """The stage's picture against the golden recipe the tested side declares, else the closest
    of the golden's legitimate recipes (a difference a legitimate recipe explains is no error)."""
    measure = _MEASURES[stage]
    recipes = golden_recipes(ctx.golden, stage) if stage in ctx.golden else {}
    if not recipes:
        return measure(chained_copy_golden(ctx, stage), stage)
    declared = declared_recipe(ctx.other, stage)
    tried = [declared] if declared in recipes else list(recipes)
    pictures = []
    for recipe in tried:
        view = dataclasses.replace(ctx, golden=golden_as(ctx.golden, stage, recipes[recipe]))
        pictures.append(dataclasses.replace(measure(view, stage), recipe=recipe))
    return min(pictures, key=_Picture.score)


def _bin(x: torch.Tensor, dim: int, size: int, reduce: str) -> torch.Tensor:
    """Merge runs of `size` entries along `dim` (0 or 1) by their NaN-ignoring max ("amax") or
    mean ("mean"); an all-NaN run stays NaN. The last run may be short."""
    if size == 1:
        return x
    x = x.movedim(dim, 0)
    n = x.shape[0]
    pad = -n % size
    x = torch.cat([x, x.new_full((pad, *x.shape[1:]), float("nan"))]) if pad else x
    runs = x.reshape(-1, size, *x.shape[1:])
    known = ~torch.isnan(runs)
    count = known.sum(dim=1)
    if reduce == "amax":
        out = torch.where(known, runs, -1.0).amax(dim=1)
    else:
        out = torch.where(known, runs, 0.0).sum(dim=1) / count.clamp(min=1)
    out = torch.where(count > 0, out, float("nan"))
    return out.movedim(0, dim)


def _relative_cells(
    value_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    n: int,
    width: int,
    columns: int,
    device: torch.device,
) -> torch.Tensor:
    """float32 [n, ceil(columns / width)]: per row i the worst |tested - golden| of each column
    block over max |golden row i| (rows whose golden is all zero: over the tensor's largest
    |golden| instead, or absolute when that is zero too). `value_rows(idx)` gives (tested, golden)
    float32 [len(idx), columns]; a non-finite difference is +inf."""
    chunk = max(1, _CHUNK_ELEMENTS // max(columns, 1))
    blocks, scales = [], []
    for lo in range(0, n, chunk):
        o, g = value_rows(torch.arange(lo, min(lo + chunk, n), device=device))
        diff = torch.where(o == g, 0.0, (o - g).abs())
        diff = _nan_to_inf(diff)
        blocks.append(_bin(diff, 1, width, "amax"))
        scales.append(g.abs().amax(dim=1) if columns else g.new_zeros(g.shape[0]))
    if not blocks:
        return torch.zeros(0, ceil_div(columns, width), device=device)
    block, scale = torch.cat(blocks), torch.cat(scales)
    top = float(scale.max()) if scale.numel() else 0.0
    scale = torch.where(scale > 0, scale, top if top > 0 else 1.0)
    return _nan_to_inf(block / scale[:, None])


def _nan_to_inf(x: torch.Tensor) -> torch.Tensor:
    """NaN -> +inf, everything else kept (torch.nan_to_num would also clip +inf to finite)."""
    return torch.where(torch.isnan(x), math.inf, x)


def _mismatch_cells(
    codes: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    group: int,
) -> torch.Tensor:
    """float32 [rows, columns / group]: the share of each group's elements that differ, 1 where
    the group's scale differs. codes (tested, golden) [rows, columns] compared as integers;
    scales (tested, golden) [rows, groups] as comparable integer codes."""
    o, g = codes
    differ = (o.to(torch.int64) != g.to(torch.int64)).to(torch.float32)
    share = _bin(differ, 1, group, "mean") if group > 1 else differ
    if scales is not None:
        share = torch.where(scales[0] != scales[1], 1.0, share)
    return share


def _place(cells: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """cells of live slots at their golden rows of an [n_rows, C] map; NaN elsewhere (padding)."""
    out = cells.new_full((n_rows, cells.shape[1]), float("nan"))
    out[rows] = cells
    return out


def _missing(slots: Slots, n_rows: int) -> torch.Tensor:
    """bool [L]: the slot's tested row lies outside a tensor of n_rows rows."""
    return (slots.other_rows < 0) | (slots.other_rows >= n_rows)


def _segments(ctx: Ctx) -> tuple[Segment, ...]:
    """The golden's expert segments, from its m_indices (runs of one local expert), with the
    local experts named by their global ids on this rank."""
    m = ctx.golden[Stage.PERMUTE]["m_indices"].to(ctx.device, torch.int64)
    live = (m >= 0).nonzero().flatten()
    if live.numel() == 0:
        return ()
    experts, counts = torch.unique_consecutive(m[live], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    hosted = placement(ctx.problem)[ctx.rank]
    return tuple(
        Segment(
            hosted[int(e)] if int(e) < len(hosted) else int(e),
            int(live[s]),
            int(live[s + c - 1]) + 1,
        )
        for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist(), strict=True)
    )


def _permuted_label(ctx: Ctx) -> str:
    if Stage.DISPATCH in ctx.golden:
        return "batched row (expert x capacity, golden order)"
    return "permuted row (golden order)"


def _golden_rows(ctx: Ctx) -> int:
    """Rows of the golden's permuted buffer."""
    return int(ctx.golden[Stage.PERMUTE]["m_indices"].numel())


RowValues = Callable[[torch.Tensor], torch.Tensor]


def _keyed(
    slots: Slots, o_rows: int, tested: RowValues, golden: RowValues
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """value_rows for `_relative_cells` over live slots: each side's values of the slot's row
    (a tested row outside its o_rows rows reads row 0; the caller marks it missing)."""
    inside = slots.other_rows.clamp(0, max(o_rows - 1, 0))

    def rows(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tested(inside[idx]), golden(slots.gold_rows[idx])

    return rows


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, group: int) -> RowValues:
    """Rows of fp8 codes (uint8) x their per-group scales (stored as `scale_values` reads them),
    fp32. Only the rows asked for are read: padding rows may never have been written."""
    groups = codes.shape[1] // group

    def rows(idx: torch.Tensor) -> torch.Tensor:
        values = codes[idx].view(torch.float8_e4m3fn).to(torch.float32)
        scale = scale_values(scales[idx], groups).to(torch.float32)
        return values * scale.repeat_interleave(group, dim=1)

    return rows


def _float_rows(x: torch.Tensor) -> RowValues:
    return lambda idx: x[idx].to(torch.float32)


def _gemm_picture(ctx: Ctx, stage: Stage) -> _Picture:
    """gemm1 / gemm2: mm1 / mm2 of every live slot, keyed through the permute the GEMM read."""
    name = GEMM_OUTPUT[stage]
    g, o = ctx.pair(stage, name)
    if o.dim() != 2 or g.dim() != 2 or o.shape[1] != g.shape[1]:
        raise _NoPicture(f"{name} is {tuple(o.shape)}, golden {tuple(g.shape)}")
    slots = downstream_slots(ctx)
    values = _keyed(slots, o.shape[0], _float_rows(o), _float_rows(g))
    cells = _relative_cells(values, len(slots), BLOCK, g.shape[1], ctx.device)
    cells[_missing(slots, o.shape[0])] = math.inf
    return _Picture(
        _place(cells, slots.gold_rows, _golden_rows(ctx)),
        Measure.RELATIVE,
        g.shape[1],
        BLOCK,
        _permuted_label(ctx),
        f"{name} column ({BLOCK}-wide blocks)",
        _segments(ctx),
        g.shape[1] // 2 if stage == Stage.GEMM1 else None,
    )


def _act_quant_picture(ctx: Ctx, stage: Stage) -> _Picture:
    """act_quant: the dequantized a2q x a2q_scale of every live slot, per scale group."""
    group = ctx.problem.recipe.act_group
    g_q, o_q = (fp8_codes(q) for q in ctx.pair(stage, "a2q"))
    if o_q.dim() != 2 or o_q.shape[1] != g_q.shape[1]:
        raise _NoPicture(f"a2q is {tuple(o_q.shape)}, golden {tuple(g_q.shape)}")
    g_s, o_s = ctx.pair(stage, "a2q_scale")
    o_rows = min(o_q.shape[0], o_s.shape[0])
    slots = downstream_slots(ctx)
    values = _keyed(slots, o_rows, _dequantized(o_q, o_s, group), _dequantized(g_q, g_s, group))
    cells = _relative_cells(values, len(slots), group, g_q.shape[1], ctx.device)
    cells[_missing(slots, o_rows)] = math.inf
    return _Picture(
        _place(cells, slots.gold_rows, _golden_rows(ctx)),
        Measure.RELATIVE,
        g_q.shape[1],
        group,
        _permuted_label(ctx),
        f"a2q column ({group}-wide scale groups, dequantized)",
        _segments(ctx),
    )


def _tested_row_experts(ctx: Ctx, n_rows: int) -> torch.Tensor:
    """int64 [n_rows]: each row's local expert in the tested permute's own grouped layout."""
    perm = ctx.other[Stage.PERMUTE]
    ends = perm.get("expert_ends")
    if tested_layout(ctx, Stage.PERMUTE) is GroupedLayout.PSUM and isinstance(ends, torch.Tensor):
        align = ctx.other[Stage.ALIGN] if Stage.ALIGN in ctx.other else ctx.golden[Stage.ALIGN]
        return psum_row_experts(ends.to(ctx.device), n_rows, int(align["alignment"]))
    m = perm["m_indices"].to(ctx.device, torch.int64)
    out = torch.full((n_rows,), -1, dtype=torch.int64, device=ctx.device)
    out[: min(n_rows, m.numel())] = m[:n_rows]
    return out


def _permute_picture(ctx: Ctx, stage: Stage) -> _Picture:
    """permute (and dispatch, read as one): per live slot, the share of a_perm codes that differ
    per scale group (1 where a_scale_perm differs), and the whole row where the tested side put
    the slot in another expert's rows or outside its buffer. Slots keyed through each side's own
    inv_perm."""
    group = ctx.problem.recipe.act_group
    g_q, o_q = (fp8_codes(q) for q in ctx.pair(Stage.PERMUTE, "a_perm"))
    if o_q.dim() != 2 or o_q.shape[1] != g_q.shape[1]:
        raise _NoPicture(f"a_perm is {tuple(o_q.shape)}, golden {tuple(g_q.shape)}")
    groups = g_q.shape[1] // group
    g_s, o_s = ctx.pair(Stage.PERMUTE, "a_scale_perm")
    o_codes, g_codes, _ = comparable_scale_codes(o_s, g_s, groups)
    slots = live_slots(ctx.golden, ctx.other, ctx.device)
    o_n = min(o_q.shape[0], o_codes.shape[0])
    missing = _missing(slots, o_n)
    inside = slots.other_rows.clamp(0, max(o_n - 1, 0))
    cells = _mismatch_cells(
        (o_q[inside], g_q[slots.gold_rows]),
        (o_codes[inside], g_codes[slots.gold_rows]),
        group,
    )
    g_m = ctx.golden[Stage.PERMUTE]["m_indices"].to(ctx.device, torch.int64)
    wrong_expert = _tested_row_experts(ctx, o_n)[inside] != g_m[slots.gold_rows]
    cells[wrong_expert] = 1.0
    cells[missing] = math.inf
    return _Picture(
        _place(cells, slots.gold_rows, _golden_rows(ctx)),
        Measure.MISMATCH,
        g_q.shape[1],
        group,
        _permuted_label(ctx),
        f"a_perm column ({group}-wide scale groups)",
        _segments(ctx),
    )


def _token_row_label(ctx: Ctx, stage: Stage) -> str:
    if stage == Stage.REDUCE:
        return "token"
    return "received token" if ctx.problem.topology.kind is TopologyKind.EP_HT else "token"


def _quant_input_picture(ctx: Ctx, stage: Stage) -> _Picture:
    """quant_input: per token, the share of a1q codes that differ per scale group (1 where the
    group's a1q_scale differs)."""
    group = ctx.problem.recipe.act_group
    g_q, o_q = (fp8_codes(q) for q in ctx.pair(stage, "a1q"))
    g_s, o_s = ctx.pair(stage, "a1q_scale")
    if o_q.shape != g_q.shape:
        raise _NoPicture(f"a1q is {tuple(o_q.shape)}, golden {tuple(g_q.shape)}")
    o_codes, g_codes, _ = comparable_scale_codes(o_s, g_s, g_q.shape[1] // group)
    if o_codes.shape != g_codes.shape:
        raise _NoPicture(f"a1q_scale is {tuple(o_s.shape)}, golden {tuple(g_s.shape)}")
    return _Picture(
        _mismatch_cells((o_q, g_q), (o_codes, g_codes), group),
        Measure.MISMATCH,
        g_q.shape[1],
        group,
        _token_row_label(ctx, stage),
        f"a1q column ({group}-wide scale groups)",
    )


def _sorted_route(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (id, weight) pairs sorted by id (-1 last), ties by weight: slot order within
    a token is free, so the picture compares the sets."""
    ids = ids.to(torch.int64)
    by_weight = torch.argsort(weights, dim=1, stable=True)
    ids, weights = ids.gather(1, by_weight), weights.gather(1, by_weight)
    by_id = torch.argsort(torch.where(ids >= 0, ids, (1 << 40) - ids), dim=1, stable=True)
    return ids.gather(1, by_id), weights.gather(1, by_id)


def _route_picture(ctx: Ctx, stage: Stage) -> _Picture:
    """route: per token and top-k slot (sorted by expert id), 1 where the id or the fp32 weight
    differs."""
    g_ids, o_ids = ctx.pair(stage, "topk_ids")
    g_w, o_w = (w.to(torch.float32) for w in ctx.pair(stage, "topk_weights"))
    if not (o_ids.shape == g_ids.shape == o_w.shape == g_w.shape):
        raise _NoPicture(f"topk_ids/topk_weights are {tuple(o_ids.shape)}/{tuple(o_w.shape)}")
    gi, gw = _sorted_route(g_ids, g_w)
    oi, ow = _sorted_route(o_ids, o_w)
    differ = (gi != oi) | (bits(gw) != bits(ow))
    return _Picture(
        differ.to(torch.float32),
        Measure.MISMATCH,
        g_ids.shape[1],
        1,
        _token_row_label(ctx, stage),
        "top-k slot (sorted by expert id)",
    )


def _token_output_picture(ctx: Ctx, stage: Stage) -> _Picture:
    """gather / shared / reduce: out [M, H], one row per token."""
    g, o = ctx.pair(stage, "out")
    if o.shape != g.shape or g.dim() != 2:
        raise _NoPicture(f"out is {tuple(o.shape)}, golden {tuple(g.shape)}")

    def values(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return o[idx].to(torch.float32), g[idx].to(torch.float32)

    return _Picture(
        _relative_cells(values, g.shape[0], BLOCK, g.shape[1], ctx.device),
        Measure.RELATIVE,
        g.shape[1],
        BLOCK,
        _token_row_label(ctx, stage),
        f"out column ({BLOCK}-wide blocks)",
    )


_MEASURES: dict[str, Callable[[Ctx, Stage], _Picture]] = {
    Stage.ROUTE: _route_picture,
    Stage.QUANT_INPUT: _quant_input_picture,
    Stage.PERMUTE: _permute_picture,
    Stage.DISPATCH: _permute_picture,
    Stage.GEMM1: _gemm_picture,
    Stage.ACT_QUANT: _act_quant_picture,
    Stage.GEMM2: _gemm_picture,
    **{s: _token_output_picture for s in _TOKEN_OUTPUTS},
}
