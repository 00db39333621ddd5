"""The error map of one failing (mode, stage, rank): what `moe_verify.report.error_measure` keeps
of a
rank while its traces exist, small and on the CPU, and what `moe_verify.report.plot` draws once
every
rank is done (docs/plots.md). Each cell holds the worst relative error or the share of elements
that differ (`Measure`); for the permuted stages the golden's expert segments name the rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from moe_verify.spec import ceil_div


class Measure(enum.StrEnum):
    """What a cell's number is."""

    RELATIVE = "relative"  # float outputs: worst |tested - golden| / max |golden row| in the cell
    MISMATCH = "mismatch"  # exact outputs: share of elements whose code or group scale differs


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
            first, last = seg.start // self.row_bin, ceil_div(seg.end, self.row_bin)
            if bool(lit_rows[first:last].any()):
                out.append(seg.expert)
        return tuple(out)

    def lit_columns(self) -> tuple[int, ...]:
        """Indices of the column cells (blocks of `col_bin` columns) holding a lit cell."""
        return tuple(int(c) for c in self.lit.any(dim=0).nonzero().flatten())

    def lit_rows(self) -> tuple[int, ...]:
        """Indices of the row cells (`row_bin` rows each) holding a lit cell."""
        return tuple(int(r) for r in self.lit.any(dim=1).nonzero().flatten())
