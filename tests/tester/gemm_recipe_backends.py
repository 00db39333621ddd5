"""Tested GEMMs for the zero-tolerance SM90 check: each reports engine "deepgemm" (the verdict is
then bitwise where the harness sees SM90, which a CPU test forces), and computes its GEMMs as:

- TensorCoreGemm: the tensor core's block accumulation (the golden's tensor-core recipe), what
  DeepGEMM's SM90 kernel computes: passes bit for bit;
- Fp32DequantGemm: exact fp32 math on the dequantized operands (the golden's bounded recipe):
  within the old bound, but not the hardware's bits;
- OneUlpGemm: the tensor core's bits with one live element one bf16 ulp up, at ROW / COLUMN of
  each GEMM's output (flattened for the batched layout): must fail there, and only there.
"""

from __future__ import annotations

import torch

from moe_verify.spec import MoEInputs, MoEProblem, Stage, Trace
from optimized.backend import OptimizedBackend
from reference.moe import ReferenceBackend

Outputs = dict[str, object]
NAMES = {Stage.GEMM1: "mm1", Stage.GEMM2: "mm2"}


class TensorCoreGemm(OptimizedBackend):
    """gemm1 and gemm2 as DeepGEMM's SM90 kernel computes them (the tensor-core model)."""

    name = "tensor_core_gemm"
    recipe = "tensor_core"

    def _gemm(self, stage: str, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        golden = ReferenceBackend()
        outs = golden.run_stage(stage, p, x, up, rank)
        name = NAMES[stage]
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

    def gemm1(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        return self._gemm(Stage.GEMM1, p, x, up, rank)

    def gemm2(self, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        return self._gemm(Stage.GEMM2, p, x, up, rank)


class Fp32DequantGemm(TensorCoreGemm):
    """Exact fp32 math, reporting DeepGEMM: what the fp32 bound admits, not the hardware."""

    name = "fp32_dequant_gemm"
    recipe = "fp32_dequant"


class OneUlpGemm(TensorCoreGemm):
    """The tensor core's bits, one element of each GEMM one bf16 ulp up (a live row of expert
    0 in every layout the tests use: the first row of the buffer)."""

    name = "one_ulp_gemm"
    ROW, COLUMN = 0, 5

    def _gemm(self, stage: str, p: MoEProblem, x: MoEInputs, up: Trace, rank: int) -> Outputs:
        outs = super()._gemm(stage, p, x, up, rank)
        mm = outs[NAMES[stage]].clone()
        flat = mm.view(-1, mm.shape[-1])
        bits = flat.view(torch.int16)
        bits[self.ROW, self.COLUMN] += 1
        return {**outs, NAMES[stage]: mm}
