"""Backends that compute several stages in one method: fused stage groups.

A kernel that quantizes each token row as it scatters it never writes the [M, H] quant_input
output; one that runs the whole layer writes only the layer's output. Such a backend declares a
`FusedGroup` (moe_verify/spec/fused.py) and returns, from one method, the outputs of the stages
it exposes. The suite feeds the group the golden's upstream of its stages (isolated mode) or its
own (chained), and judges what it exposes: a wrong fused kernel is placed at the group, as
closely as its outputs allow (docs/stage-contract.md#fused-stage-groups).

The fused methods here call the optimized path's stage methods one after another inside one
call, so they show the form, not a faster kernel:

- `QuantizingScatter` (correct): quant_input fused into permute; only permute's outputs exist.
- `QuantizingScatterHalvesAScale` (wrong): the same with the first live row's first scale
  group halved, as a fused kernel that scales one row twice would; fails at
  "permute in quant_input+permute", naming the token and the group.
- `FusedForward` (correct): route through gather in one method; only the output is judged.
- `FusedForwardSwapsExperts` (wrong): the same with token 0's two experts exchanged before the
  layout is built, a misroute inside the fused kernel; fails at "gather in route+...+gather".

Problems with the contiguous layout (not ep:N+ll, whose dispatch replaces align and permute).
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    STAGES,
    Engine,
    FusedGroup,
    Outputs,
    Stage,
    StageContext,
    StageDelegate,
    Trace,
    call_stage,
)
from optimized import OptimizedBackend


def _with(upstream: Trace, stage: Stage, outputs: Outputs) -> Trace:
    """`upstream` with `stage`'s outputs added (a copy: the trace handed in is not written)."""
    out = upstream.only(upstream.stages)
    out.add(stage, outputs)
    return out


class QuantizingScatter(StageDelegate):
    """quant_input fused into permute: one method quantizes the token rows and lays them out
    per expert; the [M, H] fp8 copy of the input is never returned."""

    name = "quantizing-scatter"
    fused_groups = (FusedGroup("quantize_and_scatter", (Stage.QUANT_INPUT, Stage.PERMUTE)),)

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def quantize_and_scatter(self, ctx: StageContext) -> dict[str, Outputs]:
        quantized = call_stage(self.inner, Stage.QUANT_INPUT, ctx)
        upstream = _with(ctx.upstream, Stage.QUANT_INPUT, quantized)
        return {
            Stage.PERMUTE: call_stage(self.inner, Stage.PERMUTE, ctx.replace(upstream=upstream))
        }


class QuantizingScatterHalvesAScale(QuantizingScatter):
    """Wrong: the first live row's first scale group halved as it is scattered."""

    name = "quantizing-scatter-halves-a-scale"

    def quantize_and_scatter(self, ctx: StageContext) -> dict[str, Outputs]:
        permuted = super().quantize_and_scatter(ctx)[Stage.PERMUTE]
        rows = permuted["inv_perm"].reshape(-1)
        live = rows[rows >= 0]
        scales = permuted["a_scale_perm"]
        if live.numel() and scales.dtype == torch.float32:
            scales = scales.clone()
            scales[int(live[0]), 0] /= 2
        return {Stage.PERMUTE: {**permuted, "a_scale_perm": scales}}


class FusedForward(StageDelegate):
    """route through gather in one method: the layer's output is all it returns."""

    name = "fused-forward"
    fused_groups = (FusedGroup("forward", STAGES),)

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def routed(self, outputs: Outputs) -> Outputs:
        """route's outputs as the rest of the forward reads them (a hook for the wrong one)."""
        return outputs

    def forward(self, ctx: StageContext) -> dict[str, Outputs]:
        upstream = ctx.upstream
        for stage in STAGES:
            outputs = call_stage(self.inner, stage, ctx.replace(upstream=upstream))
            if stage is Stage.ROUTE:
                outputs = self.routed(outputs)
            upstream = _with(upstream, stage, outputs)
        return {Stage.GATHER: upstream[Stage.GATHER]}


class FusedForwardSwapsExperts(FusedForward):
    """Wrong: token 0's first two experts exchanged (their weights kept in place) before the
    layout is built, so its rows go through each other's weights."""

    name = "fused-forward-swaps-experts"

    def routed(self, outputs: Outputs) -> Outputs:
        ids = outputs["topk_ids"]
        if ids.shape[0] == 0 or ids.shape[1] < 2:
            return outputs
        ids = ids.clone()
        ids[0, [0, 1]] = ids[0, [1, 0]]
        return {**outputs, "topk_ids": ids}
