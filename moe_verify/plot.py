"""A picture of a failure: one PNG per failing (mode, stage), the error against the golden as a
heatmap, ranks side by side (docs/plots.md).

`error_maps` runs inside verify's rank loop, while a rank's traces still exist, and keeps only a
small binned map per failing stage; `write_plots` draws them once every rank is done. Rows are
the golden's: for the permuted stages its row order, grouped by expert segment, each live (token,
k) slot of the tested side placed at the golden's row of the same slot (row order inside a
segment is not deterministic, so rows are never matched by absolute index), padding rows left
undrawn; for the per-token stages one row per token. Columns are binned into scale blocks (128
wide, or the recipe's activation group for the quantized tensors). matplotlib is imported only
when drawing.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from moe_verify.runner import RankRun
from moe_verify.spec import (
    REPORT_STAGES,
    GroupedLayout,
    Mode,
    MoEProblem,
    Stage,
    TopologyKind,
)
from reference.topology import placement
from tolerance.context import Ctx, Slots, comparison_device, downstream_slots, live_slots
from tolerance.layouts import (
    comparable_scale_codes,
    flatten_batched,
    psum_row_experts,
    scale_values,
    tested_layout,
)
from tolerance.metrics import bits, fp8_codes
from tolerance.policy import policy_for
from tolerance.recipes import chained_copy_golden, declared_recipe, golden_as, golden_recipes
from tolerance.results import ContractError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# Bounds of one panel, in cells: big cases are binned down to these (a DeepSeek-V3 rank has
# ~10^5 permuted rows and 56 column blocks). A panel has at least this many pixels each way, so
# no cell, and no single wrong row, is dropped when the image is drawn.
MAX_ROWS = 512
MAX_COLUMNS = 128
# Column block of the float outputs (GEMMs, gather): the 128-row weight scale block of fp8_block.
BLOCK = 128
# Elements per chunk of rows when measuring, so a large stage never allocates a full float32 copy.
_CHUNK_ELEMENTS = 1 << 24

_PERMUTED = (Stage.PERMUTE, Stage.DISPATCH, Stage.GEMM1, Stage.ACT_QUANT, Stage.GEMM2)
_TOKEN_OUTPUTS = (Stage.GATHER, Stage.SHARED, Stage.REDUCE)
_GEMM_OUTPUTS = {Stage.GEMM1: "mm1", Stage.GEMM2: "mm2"}

PLOT_EXTRA = "pip install 'moe-verify[plot]'"


class Measure(enum.StrEnum):
    """What a cell's number is."""

    RELATIVE = "relative"  # float outputs: worst |tested - golden| / max |golden row| in the cell
    MISMATCH = "mismatch"  # exact outputs: share of elements whose code or group scale differs


_MEASURE_LABEL = {
    Measure.RELATIVE: "worst |tested - golden| / max |golden row|",
    Measure.MISMATCH: "share of elements differing (code or scale)",
}


@dataclass(frozen=True)
class Segment:
    """One expert's live rows in the golden's permuted layout: [start, end) in unbinned rows;
    its padding follows up to the next segment's start."""

    expert: int  # global (logical) expert id
    start: int
    end: int


@dataclass(frozen=True, eq=False)
class ErrorMap:
    """One (mode, stage, rank) picture's data, small and on the CPU.

    error: float32 [rows / row_bin, columns / col_bin] (rounded up): 0 exact, > 0 the cell's
    `measure`, +inf a non-finite value or a live slot whose row the tested side does not have,
    NaN a cell of padding rows only (no live (token, k) slot of the golden).
    """

    mode: str
    stage: str
    rank: int
    error: torch.Tensor
    measure: Measure
    rows: int  # rows before binning
    columns: int  # columns before binning
    row_bin: int  # rows per cell
    col_bin: int  # columns per cell
    row_label: str
    col_label: str
    segments: tuple[Segment, ...] = ()  # permuted stages: the golden's expert segments
    split: int | None = None  # gemm1: the column where mm1's up half begins
    recipe: str | None = None  # the golden recipe measured against, for stages with several

    @property
    def lit(self) -> torch.Tensor:
        """bool [R, C]: cells with an error (padding cells are never lit)."""
        return self.error > 0

    def lit_experts(self) -> tuple[int, ...]:
        """Global ids of the experts whose segment holds a lit cell."""
        lit_rows = self.lit.any(dim=1)
        out = []
        for seg in self.segments:
            first, last = seg.start // self.row_bin, -(-seg.end // self.row_bin)
            if bool(lit_rows[first:last].any()):
                out.append(seg.expert)
        return tuple(out)

    def lit_columns(self) -> tuple[int, ...]:
        """Indices of the column cells (blocks of `col_bin` columns) holding a lit cell."""
        return tuple(int(c) for c in self.lit.any(dim=0).nonzero().flatten())

    def lit_rows(self) -> tuple[int, ...]:
        """Indices of the row cells (`row_bin` rows each) holding a lit cell."""
        return tuple(int(r) for r in self.lit.any(dim=1).nonzero().flatten())


class _NoPicture(Exception):
    """The stage has no tensor pair to picture (not run, raised, or off the contract)."""


# Measuring -------------------------------------------------------------------------------------


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
        merge = max(1, -(-self.cells.shape[1] // MAX_COLUMNS))
        row_bin = max(1, -(-self.cells.shape[0] // MAX_ROWS))
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
        return torch.zeros(0, -(-columns // width), device=device)
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
    name = _GEMM_OUTPUTS[stage]
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


# Drawing ---------------------------------------------------------------------------------------


def require_matplotlib() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only, no display), or an ImportError that
    says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            f"plots need matplotlib, which is not installed ({exc}); install it with {PLOT_EXTRA}"
        ) from exc
    return plt


def write_plots(problem: MoEProblem, maps: Sequence[ErrorMap], out_dir: Path) -> list[Path]:
    """One PNG per (mode, stage) of `maps` in `out_dir` (created if needed), ranks side by side
    (a rank without a map for that stage is drawn as an empty panel); returns the files written,
    in report order. Nothing is drawn, and matplotlib is not needed, when `maps` is empty."""
    if not maps:
        return []
    plt = require_matplotlib()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[ErrorMap]] = {}
    for m in maps:
        groups.setdefault((m.mode, m.stage), []).append(m)
    order = {str(s): i for i, s in enumerate(REPORT_STAGES)}
    files = []
    for mode, stage in sorted(groups, key=lambda k: (k[0] != Mode.ISOLATED, order.get(k[1], 99))):
        path = out_dir / f"{problem.id}-{mode}-{stage}.png"
        _draw(plt, problem, groups[(mode, stage)], path)
        files.append(path)
    return files


def _panels(problem: MoEProblem, maps: list[ErrorMap]) -> list[tuple[int, ErrorMap | None]]:
    """(rank, map) per panel: every rank of the topology for a rank's stage, the maps alone for
    the cross-rank reduce."""
    by_rank = {m.rank: m for m in maps}
    if maps[0].stage == Stage.REDUCE:
        return sorted(by_rank.items())
    return [(r, by_rank.get(r)) for r in range(problem.topology.size)]


def _draw(plt: ModuleType, problem: MoEProblem, maps: list[ErrorMap], path: Path) -> None:
    from matplotlib import colors

    panels = _panels(problem, maps)
    first = maps[0]
    finite = [m.error[torch.isfinite(m.error)] for m in maps]
    top = max((float(f.max()) for f in finite if f.numel()), default=0.0)
    if first.measure is Measure.RELATIVE:
        vmax = top if top > 0 else 1.0
        norm: colors.Normalize = colors.LogNorm(vmin=vmax * 1e-4, vmax=vmax)
    else:
        vmax = 1.0
        norm = colors.Normalize(vmin=1e-6, vmax=vmax)
    cmap = plt.get_cmap("viridis").with_extremes(under="white", over="red", bad="#c8c8c8")

    width = max(2.2, min(4.5, 24.0 / len(panels)))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.6 + width * len(panels), 7.6), squeeze=False
    )
    image = None
    for ax, (rank, m) in zip(axes[0], panels, strict=True):
        rank_name = "all ranks" if first.stage == Stage.REDUCE else f"rank {rank}"
        if m is None:
            ax.set_axis_off()
            ax.text(
                0.5,
                0.5,
                f"{rank_name}: no map\n(passed, or no tensor to picture)",
                ha="center",
                va="center",
            )
            continue
        data = m.error.to(torch.float64).clone()
        lit = data > 0
        data[~lit & ~torch.isnan(data)] = vmax * 1e-9  # exact: below vmin, drawn white
        data[lit] = data[lit].clamp(min=norm.vmin)  # any error gets at least the lowest colour
        data[torch.isinf(data)] = vmax * 1e9  # non-finite or missing: over, drawn red
        extent = (0, m.error.shape[1] * m.col_bin, m.error.shape[0] * m.row_bin, 0)
        image = ax.imshow(
            data.numpy(),
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            norm=norm,
            extent=extent,
        )
        ax.set_xlim(0, m.columns)
        ax.set_ylim(m.rows, 0)
        _decorate(ax, m)
        ax.set_title(f"{rank_name}: {_summary(m)}", fontsize=9)
    recipe = f", against recipe {first.recipe}" if first.recipe else ""
    fig.suptitle(f"{problem.id}\n{first.stage} ({first.mode}){recipe}", fontsize=10)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes[0]), extend="both", fraction=0.04, pad=0.02)
        bar.set_label(_MEASURE_LABEL[first.measure])
    fig.text(
        0.01,
        0.01,
        "white: exact   gray: padding rows (no live (token, k))   red: non-finite, or the "
        "tested side has no row for the slot",
        fontsize=7,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _decorate(ax: Axes, m: ErrorMap) -> None:
    """Axis labels, expert segment boundaries and names, column block lines, gate | up."""
    ax.set_xlabel(m.col_label, fontsize=8)
    cells = m.error.shape[1]
    if cells <= 64:
        for c in range(1, cells):
            ax.axvline(c * m.col_bin, color="#909090", lw=0.3)
    if m.split is not None:
        ax.axvline(m.split, color="black", lw=1.2, ls="--")
        ax.text(m.split, 0, "gate | up", ha="center", va="bottom", fontsize=7)
    if not m.segments:
        ax.set_ylabel(m.row_label, fontsize=8)
        return
    for seg in m.segments[1:]:
        ax.axhline(seg.start, color="black", lw=0.8)
    step = max(1, -(-len(m.segments) // 32))
    shown = m.segments[::step]
    ax.set_yticks([(s.start + s.end) / 2 for s in shown])
    ax.set_yticklabels([f"e{s.expert}" for s in shown], fontsize=7)
    ax.set_ylabel(f"{m.row_label}, by expert segment", fontsize=8)


def _summary(m: ErrorMap) -> str:
    """Where the error is, in words: experts or rows, and column ranges."""
    columns = m.lit_columns()
    if not columns:
        return "no error on live rows (see the report)"
    if m.segments:
        experts = m.lit_experts()
        where = f"expert{'s' if len(experts) > 1 else ''} {_short(experts)}"
    else:
        rows = m.lit_rows()
        unit = m.row_label + "s" if m.row_bin == 1 else f"bins of {m.row_bin} rows"
        where = f"{len(rows)} of {m.error.shape[0]} {unit}"
    if len(columns) == m.error.shape[1]:
        return f"{where}, all columns"
    spans = [f"{c * m.col_bin}-{min((c + 1) * m.col_bin, m.columns) - 1}" for c in columns]
    return f"{where}, columns {_short(spans)}"


def _short(items: Sequence[object]) -> str:
    return ", ".join(map(str, items[:4])) + (f" (+{len(items) - 4})" if len(items) > 4 else "")


__all__ = ["ErrorMap", "Measure", "Segment", "error_maps", "require_matplotlib", "write_plots"]
