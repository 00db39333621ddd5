"""gemm1 with up-first columns: a convention DeepGEMM does not care about, declared.

A kernel whose w13 is stored `cat([w3, w1])` (up projection first) writes each mm1 row as
[up | gate]; the activation after it must read it that way. Neither is wrong, so the backend
says which it writes: gemm1 returns `column_order="up_first"` (moe_verify.spec.Gemm1Columns),
the comparison reads its mm1 with the halves exchanged, and in isolated mode its act_quant is
fed the golden's mm1 up-first (docs/stage-contract.md#gemm1-column-order).

- `UpFirstGemm1` (correct): the optimized path's gemm1 with its output columns up-first (each
  output column is one weight row's dot product, so this is bit for bit the GEMM over
  `cat([w3, w1])`), declared, and an act_quant that reads up-first rows.
- `UpFirstUndeclared` (wrong): the same without the declaration; fails at gemm1, and the
  failure says the halves exchanged would match.
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    COLUMN_ORDER,
    Engine,
    Gemm1Columns,
    Outputs,
    Stage,
    StageContext,
    StageDelegate,
    call_stage,
)
from optimized import OptimizedBackend


def _exchanged(mm1: torch.Tensor) -> torch.Tensor:
    first, second = mm1.chunk(2, dim=-1)
    return torch.cat([second, first], dim=-1)


class UpFirstGemm1(StageDelegate):
    """gemm1 writes [up | gate] and says so; act_quant reads [up | gate]."""

    name = "up-first-gemm1"
    declares = True

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def gemm1(self, ctx: StageContext) -> Outputs:
        outputs = call_stage(self.inner, Stage.GEMM1, ctx)
        up_first = {**outputs, "mm1": _exchanged(outputs["mm1"])}
        return (
            {**up_first, COLUMN_ORDER: Gemm1Columns.UP_FIRST.value} if self.declares else up_first
        )

    def act_quant(self, ctx: StageContext) -> Outputs:
        mm1 = ctx.upstream[Stage.GEMM1]["mm1"]  # [up | gate]: back to the inner path's order
        upstream = ctx.upstream.replaced(Stage.GEMM1, mm1=_exchanged(mm1))
        return call_stage(self.inner, Stage.ACT_QUANT, ctx.replace(upstream=upstream))


class UpFirstUndeclared(UpFirstGemm1):
    """Wrong: up-first columns written, gate-first declared (by saying nothing)."""

    name = "up-first-undeclared"
    declares = False
