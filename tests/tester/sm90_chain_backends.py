"""Tested chains for zero tolerance on SM90 in chained mode (docs/tolerance.md "Zero tolerance on
SM90"). Each runs the optimized path's own route, quant, permute and gather, and reports its
GEMMs as DeepGEMM's (the CPU test forces SM90):

- Sm90Chain (moe_verify/examples/tensor_core.py): the GEMMs as the tensor core computes them (the
  golden's tensor-core recipe, here on the chain's own upstream) and act_quant with the H200's
  compiled Triton gate (the recorded table), reporting the gate facts the optimized kernel
  reports on that GPU: passes bit for bit;
- NoFmaPromotion (moe_verify/examples/tensor_core.py, the README's demo): the tensor core's chunk
  sums promoted with a separate fp32 multiply and add instead of DeepGEMM's FMA (a few bf16
  outputs in 10^5 move by an ulp with fp32 scales);
- OneUlpChain: Sm90Chain with one live element of each GEMM one bf16 ulp up;
- Fp32Shared: shared experts that declare the tensor core but compute exact fp32 math.

The last two stay inside every chained bound; only the bitwise chain catches them.
"""

from __future__ import annotations

import torch

from moe_verify.examples import Sm90Chain
from moe_verify.spec import StageContext
from tests.tester.gemm_recipe_backends import OneUlpGemm

Outputs = dict[str, object]


class Fp32Shared(Sm90Chain):
    """Sm90Chain whose shared experts declare the tensor core but compute exact fp32 math."""

    name = "fp32_shared"
    shared_tensor_core = False


class OneUlpChain(Sm90Chain, OneUlpGemm):
    """Sm90Chain with one element of each GEMM's output one bf16 ulp up (OneUlpGemm.ROW/COLUMN)."""

    name = "one_ulp_chain"


class OtherSumOrder(Sm90Chain):
    """Sm90Chain whose route weights sit ULPS fp32 ulps above its own (every slot), as a top-k
    renormalized in another sum order may: within the route bound (2k + 1 ulps), so the SM90
    chain's gather must sum with these weights and still pass bit for bit."""

    name = "other_sum_order"
    ULPS = 5  # 2k + 1 at k = 2

    def route(self, ctx: StageContext) -> Outputs:
        outs = super().route(ctx)
        weights = outs["topk_weights"].clone()
        weights.view(torch.int32).add_(self.ULPS)
        return {**outs, "topk_weights": weights}


class ReciprocalQuant(Sm90Chain):
    """Sm90Chain whose quant_input is vLLM's other legitimate 1x128 quantizer (Triton's
    reciprocal multiply, one e4m3 code apart from the golden's own at ties with fp32 scales)."""

    name = "reciprocal_quant"

    def quant_input(self, ctx: StageContext) -> Outputs:
        p, x = ctx.problem, ctx.inputs
        from reference.formats import quantize_fp8_groups

        q, s = quantize_fp8_groups(x.hidden_states, 128, p.scale_fmt, recipe="triton_reciprocal")
        return {"a1q": q, "a1q_scale": s}


class RotatedSlots(Sm90Chain):
    """Sm90Chain whose route lists each token's experts rotated by one slot (slot i holds what
    its own top-k put at slot i - 1): the same routing, and every later stage follows its own
    order, so its gather sums each token's slots in another order."""

    name = "rotated_slots"

    def route(self, ctx: StageContext) -> Outputs:
        outs = super().route(ctx)
        return {
            **outs,
            "topk_ids": outs["topk_ids"].roll(1, dims=1),
            "topk_weights": outs["topk_weights"].roll(1, dims=1),
        }
