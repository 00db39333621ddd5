"""The router weight applied on the input: a convention DeepGEMM does not care about, declared.

Top-1 MoE layers may apply a token's router weight before the experts instead of in the gather:
vLLM's prepare step (`apply_router_weight_on_input`) multiplies the bf16 hidden states by the
weight rounded to bf16, quantizes the product, and its gather then sums with weight 1. The
problem says which convention to verify (`MoEProblem.router_weight`, `--router-weight`); a
kernel fixed to one says which it applies: quant_input returns `router_weight="input"`
(moe_verify.spec.RouterWeight), and where that is not the problem's, quant_input fails with a
"router weight" check naming both (docs/stage-contract.md#router-weight).

- `WeightOnInput` (correct for problems with router_weight="input"): the optimized path with a
  quant_input that always weights the input, as vLLM's prepare does, and a gather that sums with
  weight 1. On a problem that says "gather" it fails at quant_input, naming the convention.
- `WeightTwice` (wrong): the same quant_input, but the gather also weights each row, as one
  that never heard the weight went on the input: fails at gather.
- `WeightOnScales` (wrong): the weight multiplied into `a1q_scale` after quantizing the plain
  input (fp32 scales only): the same dequantized product, other fp8 codes; fails at quant_input.
"""

from __future__ import annotations

import torch

from moe_verify.spec import (
    ROUTER_WEIGHT,
    Engine,
    Outputs,
    Recipe,
    RouterWeight,
    Stage,
    StageContext,
    StageDelegate,
    call_stage,
)
from optimized import OptimizedBackend
from optimized.kernels import quant


def _one_weight_per_token(ctx: StageContext) -> torch.Tensor:
    """fp32 [M, 1]: the route's weights, refused by name unless routing is top-1."""
    weights = ctx.upstream[Stage.ROUTE]["topk_weights"]
    if weights.shape[1] != 1:
        raise ValueError(
            f"the router weight on the input needs top-1 routing, got topk={weights.shape[1]}"
        )
    return weights


class WeightOnInput(StageDelegate):
    """quant_input weights every input row, and says so; the gather sums with weight 1."""

    name = "weight-on-input"

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(OptimizedBackend(engine=engine), self.name)

    def quant_input(self, ctx: StageContext) -> Outputs:
        problem, route = ctx.problem, ctx.upstream[Stage.ROUTE]
        hidden = ctx.inputs.hidden_states
        if "token_index" in route:  # ep:N+ht: the tokens this rank received
            hidden = hidden[route["token_index"]]
        weighted = hidden * _one_weight_per_token(ctx).to(hidden.dtype)  # bf16 x bf16(w)
        group = problem.recipe.act_group
        if problem.recipe is Recipe.MXFP8:
            q, s = quant.quantize_mxfp8(weighted, group)
        else:
            q, s = quant.quantize_fp8_groups(weighted, group, problem.scale_fmt)
        return {"a1q": q, "a1q_scale": s, ROUTER_WEIGHT: RouterWeight.INPUT.value}

    def gather(self, ctx: StageContext) -> Outputs:
        ones = torch.ones_like(_one_weight_per_token(ctx))  # the weight is in every row already
        upstream = ctx.upstream.replaced(Stage.ROUTE, topk_weights=ones)
        return call_stage(self.inner, Stage.GATHER, ctx.replace(upstream=upstream))


class WeightTwice(WeightOnInput):
    """Wrong: the input weighted, and the gather weights each row again."""

    name = "weight-twice"

    def gather(self, ctx: StageContext) -> Outputs:
        in_gather = ctx.problem.replace(router_weight=RouterWeight.GATHER)
        return call_stage(self.inner, Stage.GATHER, ctx.replace(problem=in_gather))


class WeightOnScales(WeightOnInput):
    """Wrong: the plain input quantized, then each row's fp32 scales times its weight."""

    name = "weight-on-scales"

    def quant_input(self, ctx: StageContext) -> Outputs:
        if ctx.problem.recipe is Recipe.MXFP8:
            raise ValueError("weight-on-scales multiplies fp32 scales; mxfp8's are E8M0 bytes")
        plain = ctx.replace(problem=ctx.problem.replace(router_weight=RouterWeight.GATHER))
        outputs = call_stage(self.inner, Stage.QUANT_INPUT, plain)
        scaled = outputs["a1q_scale"] * _one_weight_per_token(ctx)
        return {**outputs, "a1q_scale": scaled, ROUTER_WEIGHT: RouterWeight.INPUT.value}
