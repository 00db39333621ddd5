"""Backends on SGLang's convention for routed_scaling_factor (scale_on_output), and near misses.

Each is the optimized path with route and gather replaced: the route is the suite's routing with
factor 1 (unscaled weights) and declares scale_on_output; the gather is a direct torch
computation of SGLang 0.5.23's post_reorder_deepgemm arithmetic (the fp32 sum over k of
mm2 row x weight, times routed_scaling_factor, one rounding to bf16), independent of
`reference/`. The right one must pass in both modes; each near miss must fail at its stage.
"""

from __future__ import annotations

import torch

from moe_verify.examples import Sm90Chain
from moe_verify.spec import RoutedScalingRecipe, StageContext, routed_scale_on_output
from optimized.backend import OptimizedBackend
from tests.tester.sm90_chain_backends import OtherSumOrder, RotatedSlots

Outputs = dict[str, object]
ON_OUTPUT = RoutedScalingRecipe.SCALE_ON_OUTPUT.value


def scaled_sum(
    mm2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    inv_perm: torch.Tensor,
    expert_map: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """bf16 [M, H]: per token, acc += fp32(mm2[row]) * w over the live slots in k order (a
    rounded product, then a rounded sum: eager torch), then acc * scale in fp32."""
    local = ids.long()
    if expert_map is not None:
        local = torch.where(local >= 0, expert_map[local.clamp(min=0)].long(), -1)
    live = (local >= 0) & (inv_perm >= 0)
    acc = torch.zeros(ids.shape[0], mm2.shape[1], dtype=torch.float32, device=mm2.device)
    for k in range(ids.shape[1]):
        rows = mm2[inv_perm[:, k].long().clamp(min=0)].float()
        step = acc + rows * weights[:, k : k + 1].float()
        acc = torch.where(live[:, k : k + 1], step, acc)
    return (acc * torch.tensor(scale, dtype=torch.float32)).to(torch.bfloat16)


class ScaleOnOutput(OptimizedBackend):
    """SGLang's convention: unscaled route weights, declared; the gather applies the factor the
    route it reads calls for (`routed_scale_on_output`)."""

    name = "scale_on_output"

    def route(self, ctx: StageContext) -> Outputs:
        problem = ctx.problem
        if problem.routed_scaling_factor == 1.0:
            return super().route(ctx)
        out = super().route(ctx.replace(problem=problem.replace(routed_scaling_factor=1.0)))
        out["recipe"] = ON_OUTPUT
        return out

    def output_scale(self, ctx: StageContext) -> float:
        return routed_scale_on_output(ctx.upstream["route"], ctx.problem.routed_scaling_factor)

    def gather(self, ctx: StageContext) -> Outputs:
        up = ctx.upstream
        route = up["route"]
        out = scaled_sum(
            up["gemm2"]["mm2"],
            route["topk_ids"],
            route["topk_weights"],
            up["permute"]["inv_perm"],
            ctx.shard.expert_map,
            self.output_scale(ctx),
        )
        return {"out": out}


class ScaledTwice(ScaleOnOutput):
    """The suite's scaled route weights (undeclared) and the factor on the output too: an engine
    that mixes the two conventions scales twice."""

    name = "scaled_twice"
    route = OptimizedBackend.route

    def output_scale(self, ctx: StageContext) -> float:
        return ctx.problem.routed_scaling_factor


class DeclaresOnOutputReturnsScaled(ScaleOnOutput):
    """Declares scale_on_output but returns the scaled weights: held to its declaration."""

    name = "declares_on_output_returns_scaled"

    def route(self, ctx: StageContext) -> Outputs:
        out = OptimizedBackend.route(self, ctx)
        out["recipe"] = ON_OUTPUT
        return out


class NeverScales(ScaleOnOutput):
    """Unscaled route weights, declared, and a gather that forgets the factor."""

    name = "never_scales"

    def output_scale(self, ctx: StageContext) -> float:
        return 1.0


class ScaleOnOutputChain(ScaleOnOutput, Sm90Chain):
    """ScaleOnOutput with Sm90Chain's GEMMs and act_quant (the CPU test forces SM90): chained,
    it is held to the golden's SM90 chain bit for bit, its gather in the scale_on_output reading."""

    name = "scale_on_output_chain"


class RotatedScaleOnOutputChain(ScaleOnOutput, RotatedSlots):
    """ScaleOnOutputChain whose route lists each token's experts rotated by one slot: the chain's
    gather must read the golden's unscaled weights in that order."""

    name = "rotated_scale_on_output_chain"


class OtherSumOrderOnOutputChain(ScaleOnOutput, OtherSumOrder):
    """ScaleOnOutputChain whose unscaled weights sit OtherSumOrder.ULPS fp32 ulps above the
    golden's (within the route bound): the chain's gather must sum with them, in its reading."""

    name = "other_sum_order_on_output_chain"
