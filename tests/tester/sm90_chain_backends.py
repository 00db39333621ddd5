"""Tested chains for zero tolerance on SM90 in chained mode (docs/tolerance.md "Zero tolerance on
SM90"). Each runs the optimized path's own route, quant, permute and gather, and reports its
GEMMs as DeepGEMM's (the CPU test forces SM90):

- Sm90Chain: the GEMMs as the tensor core computes them (the golden's tensor-core recipe, here on
  the chain's own upstream) and act_quant with the H200's compiled Triton gate (the recorded
  table), reporting the gate facts the optimized kernel reports on that GPU: passes bit for bit;
- NoFmaPromotion: the tensor core's chunk sums promoted with a separate fp32 multiply and add
  instead of DeepGEMM's FMA (a few bf16 outputs in 10^5 move by an ulp with fp32 scales);
- OneUlpChain: Sm90Chain with one live element of each GEMM one bf16 ulp up;
- Fp32Shared: shared experts that declare the tensor core but compute exact fp32 math.

The last two stay inside every chained bound; only the bitwise chain catches them.
"""

from __future__ import annotations

from unittest import mock

import torch

import reference.tensor_core as tensor_core
from moe_verify.spec import MoEInputs, MoEProblem, Trace
from reference.activation import act_quant, fused_act_quant_recipe, sm90_triton_recipe
from reference.gate_table import gate_table_provenance
from reference.moe import ReferenceBackend
from tests.tester.gemm_recipe_backends import OneUlpGemm, TensorCoreGemm

Outputs = dict[str, object]


def table_gate_facts() -> dict[str, str]:
    """The facts optimized/kernels/act_quant.py `gate_source` reports on the GPU the gate table
    was recorded on."""
    table = gate_table_provenance()
    return {"gate_triton": table["triton"], "gate_capability": table["capability"]}


class Sm90Chain(TensorCoreGemm):
    """DeepGEMM's GEMMs and the H200 Triton act_quant, bit for bit as SM90 computes them."""

    name = "sm90_chain"

    def act_quant(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        mm1 = up["gemm1"]["mm1"]
        recipe = sm90_triton_recipe(fused_act_quant_recipe(p.scale_fmt), p.activation)
        q, s = act_quant(
            mm1.reshape(-1, mm1.shape[-1]), p.activation, p.recipe.act_group, p.scale_fmt, recipe
        )
        return {
            "a2q": q.view(*mm1.shape[:-1], q.shape[-1]),
            "a2q_scale": s.reshape(*mm1.shape[:-1], s.shape[-1]),
            **table_gate_facts(),
        }

    # the shared experts' GEMMs by the tensor-core recipe (False: exact fp32 math, a fault here)
    shared_tensor_core = True

    def shared(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        """The shared experts as SM90 computes them (both GEMMs by the tensor-core recipe,
        act_quant with the table gate), declared as the optimized backend declares its own."""
        twin = sm90_triton_recipe(fused_act_quant_recipe(p.scale_fmt), p.activation)
        outs = ReferenceBackend()._shared(p, x, rank, twin, tensor_core=self.shared_tensor_core)
        return {**outs, "recipe": "tensor_core", **table_gate_facts()}


class Fp32Shared(Sm90Chain):
    """Sm90Chain whose shared experts declare the tensor core but compute exact fp32 math."""

    name = "fp32_shared"
    shared_tensor_core = False


def _mul_then_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return a.float() * b.float() + c.float()  # two roundings: not the FFMA


class NoFmaPromotion(Sm90Chain):
    """The promotion without FMA: final = fp32(fp32(sa * sb * chunk) + final)."""

    name = "no_fma_promotion"

    def _gemm(self, stage: str, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        with mock.patch.object(tensor_core, "fma_fp32", _mul_then_add):
            return super()._gemm(stage, p, x, up, rank)


class OneUlpChain(Sm90Chain, OneUlpGemm):
    """Sm90Chain with one element of each GEMM's output one bf16 ulp up (OneUlpGemm.ROW/COLUMN)."""

    name = "one_ulp_chain"


class OtherSumOrder(Sm90Chain):
    """Sm90Chain whose route weights sit ULPS fp32 ulps above its own (every slot), as a top-k
    renormalized in another sum order may: within the route bound (2k + 1 ulps), so the SM90
    chain's gather must sum with these weights and still pass bit for bit."""

    name = "other_sum_order"
    ULPS = 5  # 2k + 1 at k = 2

    def route(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        outs = super().route(p, x, up, rank)
        weights = outs["topk_weights"].clone()
        weights.view(torch.int32).add_(self.ULPS)
        return {**outs, "topk_weights": weights}


class ReciprocalQuant(Sm90Chain):
    """Sm90Chain whose quant_input is vLLM's other legitimate 1x128 quantizer (Triton's
    reciprocal multiply, one e4m3 code apart from the golden's own at ties with fp32 scales)."""

    name = "reciprocal_quant"

    def quant_input(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        from reference.formats import quantize_fp8_groups

        q, s = quantize_fp8_groups(x.hidden_states, 128, p.scale_fmt, recipe="triton_reciprocal")
        return {"a1q": q, "a1q_scale": s}


class RotatedSlots(Sm90Chain):
    """Sm90Chain whose route lists each token's experts rotated by one slot (slot i holds what
    its own top-k put at slot i - 1): the same routing, and every later stage follows its own
    order, so its gather sums each token's slots in another order."""

    name = "rotated_slots"

    def route(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        outs = super().route(p, x, up, rank)
        return {
            **outs,
            "topk_ids": outs["topk_ids"].roll(1, dims=1),
            "topk_weights": outs["topk_weights"].roll(1, dims=1),
        }
