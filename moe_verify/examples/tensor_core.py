"""DeepGEMM's SM90 GEMMs as the tensor core computes them, and a fault in that arithmetic (a
wrong kernel, for the demo): the promotion of each chunk's sum done without the FMA.

- `TensorCoreGemm`: gemm1 and gemm2 by the golden's tensor-core model, reported as DeepGEMM's
  (the verdict is then bitwise where the harness holds GEMMs to the hardware's bits);
- `Sm90Chain`: those GEMMs and act_quant with the H200's compiled Triton gate (the recorded
  table), the chain an SM90 GPU computes: passes bit for bit in chained mode;
- `NoFmaPromotion`: Sm90Chain whose promotion is fp32(fp32(sa * sb * chunk) + final) instead of
  DeepGEMM's FMA: a few bf16 outputs in 10^5 move by one ulp with fp32 scales, inside every
  bound, failed bit for bit (docs/tolerance.md#zero-tolerance-on-sm90).
"""

from __future__ import annotations

from unittest import mock

import torch

import reference.hardware.tensor_core as tensor_core
from moe_verify.spec import GEMM_OUTPUT, Stage, StageContext, Trace
from optimized.backend import OptimizedBackend, Outputs
from reference.activation import act_quant, fused_act_quant_recipe, sm90_triton_recipe
from reference.hardware.gate_table import gate_table_provenance
from reference.moe import ReferenceBackend


class TensorCoreGemm(OptimizedBackend):
    """gemm1 and gemm2 as DeepGEMM's SM90 kernel computes them (the tensor-core model);
    `recipe = "fp32_dequant"` computes exact fp32 math instead, still reported as DeepGEMM's."""

    name = "tensor_core_gemm"
    recipe = "tensor_core"

    def _gemm(self, ctx: StageContext, stage: Stage) -> Outputs:
        p, x, up, rank = ctx.problem, ctx.inputs, ctx.upstream, ctx.rank
        golden = ReferenceBackend()
        outs = getattr(golden, stage.value)(ctx)
        name = GEMM_OUTPUT[stage]
        if self.recipe == "tensor_core":
            trace = Trace(up.backend, rank)
            for s, o in up.items():
                trace.add(s, o)
            trace.add(stage, outs)
            outs = {
                **outs,
                name: golden.with_tensor_core(p, x, trace, stage)[stage][f"{name}@tensor_core"],
            }
        return {**outs, "engine": "deepgemm"}

    def gemm1(self, ctx: StageContext) -> Outputs:
        return self._gemm(ctx, Stage.GEMM1)

    def gemm2(self, ctx: StageContext) -> Outputs:
        return self._gemm(ctx, Stage.GEMM2)


def table_gate_facts() -> dict[str, str]:
    """The facts optimized/kernels/act_quant.py `gate_source` reports on the GPU the gate table
    was recorded on."""
    table = gate_table_provenance()
    return {"gate_triton": table["triton"], "gate_capability": table["capability"]}


class Sm90Chain(TensorCoreGemm):
    """DeepGEMM's GEMMs and the H200 Triton act_quant, bit for bit as SM90 computes them."""

    name = "sm90_chain"

    def act_quant(self, ctx: StageContext) -> Outputs:
        p, up = ctx.problem, ctx.upstream
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

    def shared(self, ctx: StageContext) -> Outputs:
        """The shared experts as SM90 computes them (both GEMMs by the tensor-core recipe,
        act_quant with the table gate), declared as the optimized backend declares its own."""
        p, x, rank = ctx.problem, ctx.inputs, ctx.rank
        twin = sm90_triton_recipe(fused_act_quant_recipe(p.scale_fmt), p.activation)
        outs = ReferenceBackend()._shared(p, x, rank, twin, tensor_core=self.shared_tensor_core)
        return {**outs, "recipe": "tensor_core", **table_gate_facts()}


def _mul_then_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return a.float() * b.float() + c.float()  # two roundings: not the FFMA


class NoFmaPromotion(Sm90Chain):
    """The promotion without FMA: final = fp32(fp32(sa * sb * chunk) + final)."""

    name = "no_fma_promotion"

    def _gemm(self, ctx: StageContext, stage: Stage) -> Outputs:
        with mock.patch.object(tensor_core, "fma_fp32", _mul_then_add):
            return super()._gemm(ctx, stage)
