"""A picture of a failure: one PNG per failing (mode, stage), the error against the golden as a
heatmap, ranks side by side (docs/plots.md).

`moe_verify.report.error_measure.error_maps` measures each rank while its traces exist;
`write_plots`
draws the maps once every rank is done. matplotlib is imported only when drawing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from moe_verify.report.error_map import ErrorMap, Measure
from moe_verify.spec import REPORT_STAGES, Mode, MoEProblem, Stage, ceil_div

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLOT_EXTRA = "pip install 'moe-verify[plot]'"

_MEASURE_LABEL = {
    Measure.RELATIVE: "worst |tested - golden| / max |golden row|",
    Measure.MISMATCH: "share of elements differing (code or scale)",
}


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
    step = max(1, ceil_div(len(m.segments), 32))
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


__all__ = ["require_matplotlib", "write_plots"]
